// Description: the Boost.Asio executor: posted work runs, ParallelFor covers every index once.
#include "core/executor.h"

#include <gtest/gtest.h>

#include <atomic>
#include <latch>
#include <vector>

namespace zoe {
namespace {

TEST(Executor, PostedWorkRunsOnWorkers) {
  Executor executor(2);
  EXPECT_EQ(executor.threads(), 2u);
  std::latch done(10);
  std::atomic<int> sum{0};
  for (int i = 0; i < 10; ++i) {
    executor.Post([&, i] {
      sum += i;
      done.count_down();
    });
  }
  done.wait();
  EXPECT_EQ(sum.load(), 45);
}

TEST(Executor, ParallelForCoversEveryIndexExactlyOnce) {
  Executor executor(3);
  for (size_t n : {0ul, 1ul, 7ul, 1000ul, 100003ul}) {
    std::vector<std::atomic<int>> hits(n);
    executor.ParallelFor(n, 97, [&](size_t begin, size_t end) {
      ASSERT_LE(end - begin, 97u);
      for (size_t i = begin; i < end; ++i) hits[i]++;
    });
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << "n=" << n << " i=" << i;
  }
}

TEST(Executor, ThreadInitRunsOncePerWorker) {
  std::atomic<int> inits{0};
  {
    Executor executor(4, [&](unsigned) { inits++; });
  }
  EXPECT_EQ(inits.load(), 4);
}

TEST(Executor, ConcurrentParallelForCallsDoNotInterfere) {
  Executor executor(2);
  std::atomic<long> a{0}, b{0};
  std::thread other([&] {
    executor.ParallelFor(5000, 10, [&](size_t s, size_t e) { a += static_cast<long>(e - s); });
  });
  executor.ParallelFor(7000, 13, [&](size_t s, size_t e) { b += static_cast<long>(e - s); });
  other.join();
  EXPECT_EQ(a.load(), 5000);
  EXPECT_EQ(b.load(), 7000);
}

}  // namespace
}  // namespace zoe
