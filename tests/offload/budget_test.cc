// Description: Budget: reservations within capacity, immediate failure above it, blocking
// back-pressure released by other threads, FIFO order, timeout, cancellation, and a multi-thread
// stress that checks the budget is never exceeded.
#include "offload/budget.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <random>
#include <thread>
#include <vector>

namespace zoe::offload {
namespace {

// Spins until `n` Reserve calls are queued; the wait condition is exact, not a sleep.
void WaitForWaiters(const Budget& budget, size_t n) {
  while (budget.waiting() != n) std::this_thread::yield();
}

TEST(Budget, ReservesAndReleasesWithinCapacity) {
  Budget budget("device budget", 1000);
  ASSERT_TRUE(budget.Reserve(600).ok());
  ASSERT_TRUE(budget.TryReserve(400).ok());
  EXPECT_EQ(budget.reserved(), 1000u);
  EXPECT_EQ(budget.available(), 0u);
  ASSERT_TRUE(budget.Release(700).ok());
  EXPECT_EQ(budget.available(), 700u);
  EXPECT_EQ(budget.peak_reserved(), 1000u);
  EXPECT_TRUE(budget.Reserve(0).ok());
  EXPECT_EQ(budget.capacity(), 1000u);
}

TEST(Budget, RequestAboveTheWholeBudgetFailsAtOnce) {
  Budget budget("device budget", 1000);
  Status s = budget.Reserve(1001);
  EXPECT_EQ(s.code(), StatusCode::kOutOfMemory);
  EXPECT_EQ(s.message(),
            "device budget: a request of 1001 bytes exceeds the whole budget of 1000 bytes; raise "
            "the budget or use smaller chunks");
  EXPECT_EQ(budget.TryReserve(5000).code(), StatusCode::kOutOfMemory);
  EXPECT_EQ(budget.reserved(), 0u);
  EXPECT_EQ(budget.waiting(), 0u);
}

TEST(Budget, TryReserveIsBusyWhenFullAndChangesNothing) {
  Budget budget("host budget", 100);
  ASSERT_TRUE(budget.TryReserve(80).ok());
  Status s = budget.TryReserve(30);
  EXPECT_EQ(s.code(), StatusCode::kBusy);
  EXPECT_EQ(s.message(),
            "host budget: 30 bytes do not fit now (80 of 100 bytes reserved, 0 waiting)");
  EXPECT_EQ(budget.reserved(), 80u);
}

TEST(Budget, ReleasingMoreThanReservedIsAnInternalError) {
  Budget budget("host budget", 100);
  ASSERT_TRUE(budget.Reserve(10).ok());
  Status s = budget.Release(11);
  EXPECT_EQ(s.code(), StatusCode::kInternal);
  EXPECT_EQ(s.message(), "host budget: release of 11 bytes exceeds the 10 bytes reserved");
  EXPECT_EQ(budget.reserved(), 10u);
}

TEST(Budget, ReserveWaitsUntilAnotherThreadReleases) {
  Budget budget("device budget", 100);
  ASSERT_TRUE(budget.Reserve(100).ok());
  std::future<Status> waiter = std::async(std::launch::async, [&] { return budget.Reserve(60); });
  WaitForWaiters(budget, 1);
  ASSERT_TRUE(budget.Release(50).ok());  // 50 free: not enough yet
  ASSERT_TRUE(budget.Release(10).ok());  // 60 free
  EXPECT_TRUE(waiter.get().ok());
  EXPECT_EQ(budget.reserved(), 100u);
  EXPECT_EQ(budget.waiting(), 0u);
}

TEST(Budget, WaitersAreServedInArrivalOrder) {
  Budget budget("device budget", 100);
  ASSERT_TRUE(budget.Reserve(100).ok());
  std::future<Status> big = std::async(std::launch::async, [&] { return budget.Reserve(80); });
  WaitForWaiters(budget, 1);
  std::future<Status> small = std::async(std::launch::async, [&] { return budget.Reserve(10); });
  WaitForWaiters(budget, 2);
  // 20 bytes free would fit the small request, but the big one arrived first.
  ASSERT_TRUE(budget.Release(20).ok());
  EXPECT_EQ(budget.TryReserve(10).code(), StatusCode::kBusy) << "TryReserve never jumps the queue";
  EXPECT_TRUE(budget.Reserve(0).ok()) << "an empty request never waits";
  EXPECT_EQ(budget.reserved(), 80u);
  // 80 free: exactly the big request, which leaves the queue holding them.
  ASSERT_TRUE(budget.Release(60).ok());
  WaitForWaiters(budget, 1);
  EXPECT_EQ(budget.reserved(), 100u);
  EXPECT_TRUE(big.get().ok());
  ASSERT_TRUE(budget.Release(10).ok());
  EXPECT_TRUE(small.get().ok());
  EXPECT_EQ(budget.reserved(), 100u);
  EXPECT_EQ(budget.waiting(), 0u);
}

TEST(Budget, TimeoutGivesUpWithBusy) {
  Budget budget("device budget", 100);
  ASSERT_TRUE(budget.Reserve(100).ok());
  ReserveOptions options;
  options.timeout = std::chrono::milliseconds(1);
  Status s = budget.Reserve(1, options);
  EXPECT_EQ(s.code(), StatusCode::kBusy);
  EXPECT_EQ(s.message(),
            "device budget: timed out while waiting for 1 bytes (100 of 100 bytes reserved, 1 "
            "waiting)");
  EXPECT_EQ(budget.waiting(), 0u);
  EXPECT_EQ(budget.reserved(), 100u);
  options.timeout = std::chrono::nanoseconds(0);
  ASSERT_TRUE(budget.Release(1).ok());
  EXPECT_TRUE(budget.Reserve(1, options).ok()) << "a zero timeout still takes what fits";
}

TEST(Budget, CancellationWakesAndAbortsTheWaiter) {
  Budget budget("host budget", 100);
  ASSERT_TRUE(budget.Reserve(100).ok());
  std::atomic<bool> shutting_down{false};
  ReserveOptions options;
  options.cancelled = [&] { return shutting_down.load(); };
  std::future<Status> waiter =
      std::async(std::launch::async, [&] { return budget.Reserve(50, options); });
  WaitForWaiters(budget, 1);
  shutting_down = true;
  budget.WakeWaiters();
  Status s = waiter.get();
  EXPECT_EQ(s.code(), StatusCode::kAborted);
  EXPECT_EQ(s.message(),
            "host budget: cancelled while waiting for 50 bytes (100 of 100 bytes reserved, 1 "
            "waiting)");
  EXPECT_EQ(budget.waiting(), 0u);
  EXPECT_EQ(budget.Reserve(50, options).code(), StatusCode::kAborted) << "cancelled on entry";
}

TEST(Budget, ALeavingHeadLetsTheNextWaiterThrough) {
  Budget budget("device budget", 100);
  ASSERT_TRUE(budget.Reserve(95).ok());
  std::atomic<bool> give_up{false};
  ReserveOptions head_options;
  head_options.cancelled = [&] { return give_up.load(); };
  std::future<Status> head =
      std::async(std::launch::async, [&] { return budget.Reserve(90, head_options); });
  WaitForWaiters(budget, 1);
  std::future<Status> next = std::async(std::launch::async, [&] { return budget.Reserve(10); });
  WaitForWaiters(budget, 2);
  ASSERT_TRUE(budget.Release(5).ok());  // 10 free: fits `next`, which is behind `head`
  give_up = true;
  budget.WakeWaiters();
  EXPECT_EQ(head.get().code(), StatusCode::kAborted);
  EXPECT_TRUE(next.get().ok());
  EXPECT_EQ(budget.reserved(), 100u);
}

TEST(Budget, ConcurrentReservationsNeverExceedTheBudget) {
  constexpr uint64_t kCapacity = 1000;
  Budget budget("device budget", kCapacity);
  std::atomic<uint64_t> held{0};
  std::atomic<bool> exceeded{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 random(t);
      for (int i = 0; i < 500; ++i) {
        const uint64_t bytes = 1 + random() % 400;
        const bool blocking = random() % 2 == 0;
        if (blocking) {
          ASSERT_TRUE(budget.Reserve(bytes).ok());
        } else if (!budget.TryReserve(bytes).ok()) {
          continue;
        }
        if (held.fetch_add(bytes) + bytes > kCapacity) exceeded = true;
        held.fetch_sub(bytes);
        ASSERT_TRUE(budget.Release(bytes).ok());
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_FALSE(exceeded.load());
  EXPECT_EQ(budget.reserved(), 0u);
  EXPECT_LE(budget.peak_reserved(), kCapacity);
  EXPECT_EQ(budget.waiting(), 0u);
}

}  // namespace
}  // namespace zoe::offload
