// Description: kernel threads (pinned executors, CPU affinity) and first-touch allocation.
#include "optim/threads.h"

#include <gtest/gtest.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <vector>

namespace zoe::optim {
namespace {

TEST(Threads, AllowedCpusIsNonEmptyAndSorted) {
  const std::vector<int> cpus = AllowedCpus();
  ASSERT_FALSE(cpus.empty());
  EXPECT_TRUE(std::is_sorted(cpus.begin(), cpus.end()));
}

TEST(Threads, PinnedWorkersRunOnTheirCpu) {
  const std::vector<int> cpus = AllowedCpus();
  auto threads = KernelThreads::Create(2, /*pin=*/true);
  ASSERT_TRUE(threads.ok());
  ASSERT_NE((*threads)->executor(), nullptr);
  EXPECT_EQ((*threads)->executor()->threads(), 1u);
  std::atomic<int> seen{-1};
  std::atomic<bool> done{false};
  (*threads)->executor()->Post([&] {
    seen = sched_getcpu();
    done = true;
  });
  while (!done) sched_yield();
  EXPECT_EQ(seen.load(), cpus[1 % cpus.size()]);
}

TEST(Threads, OneParticipantMeansTheCallerAlone) {
  auto threads = KernelThreads::Create(1, false);
  ASSERT_TRUE(threads.ok());
  EXPECT_EQ((*threads)->executor(), nullptr);
  EXPECT_TRUE((*threads)->PinCaller().ok());
  auto all = KernelThreads::Create(0, false);
  EXPECT_EQ((*all)->participants(), AllowedCpus().size());
}

TEST(Threads, PinningToAnImpossibleCpuIsAnError) {
  EXPECT_EQ(PinCurrentThread(-1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(PinCurrentThread(1 << 20).code(), StatusCode::kInvalidArgument);
  // A CPU that exists in the mask type but not on this machine: the kernel refuses it.
  cpu_set_t set;
  ASSERT_EQ(sched_getaffinity(0, sizeof(set), &set), 0);
  const Status status = PinCurrentThread(CPU_SETSIZE - 1);
  EXPECT_FALSE(status.ok());
  EXPECT_NE(status.message().find("cpu 1023"), std::string_view::npos);
  ASSERT_EQ(sched_setaffinity(0, sizeof(set), &set), 0);  // restore this thread's mask
}

TEST(Threads, FirstTouchAllocationIsZeroedAndAligned) {
  Executor executor(2);
  for (Executor* e : {&executor, static_cast<Executor*>(nullptr)}) {
    auto buffer = AllocateFirstTouch(100003, 4096, e);
    ASSERT_TRUE(buffer.ok());
    EXPECT_GE(buffer->size(), 100003u);
    EXPECT_TRUE(IsAligned(buffer->data(), 64));
    EXPECT_TRUE(std::all_of(buffer->data(), buffer->data() + buffer->size(),
                            [](std::byte b) { return b == std::byte{0}; }));
  }
  EXPECT_EQ(AllocateFirstTouch(10, 0, nullptr).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace zoe::optim
