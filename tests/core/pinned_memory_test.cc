// Description: pinned host memory: budget accounting, OutOfMemory messages, and the one-warning
// fallback when locking fails.
#include "core/pinned_memory.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <linux/capability.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#include "core/aligned_buffer.h"
#include "core/log.h"

namespace zoe {
namespace {

using ::testing::HasSubstr;

constexpr size_t kPage = 4096;

// A locker that fails with `error` from its `fail_from`-th call on (0-based) and counts calls.
class ScriptedLocker final : public PageLocker {
 public:
  ScriptedLocker(int error, int fail_from) : error_(error), fail_from_(fail_from) {}
  std::string_view name() const override { return "scripted-lock"; }
  int Lock(void*, size_t) override { return locks_++ >= fail_from_ ? -error_ : 0; }
  void Unlock(void*, size_t) override { unlocks_++; }
  int locks() const { return locks_.load(); }
  int unlocks() const { return unlocks_.load(); }

 private:
  int error_;
  int fail_from_;
  std::atomic<int> locks_{0};
  std::atomic<int> unlocks_{0};
};

PinnedMemoryPool MakePool(uint64_t budget, std::shared_ptr<PageLocker> locker = nullptr,
                          size_t alignment = kPage) {
  auto pool = PinnedMemoryPool::Create({.name = "test",
                                        .budget_bytes = budget,
                                        .alignment = alignment,
                                        .locker = std::move(locker)});
  EXPECT_TRUE(pool.ok()) << pool.status().ToString();
  return std::move(pool).value();
}

TEST(PinnedMemory, BuffersAreAlignedRoundedAndAccounted) {
  auto locker = std::make_shared<ScriptedLocker>(0, 1 << 30);
  PinnedMemoryPool pool = MakePool(64 * kPage, locker, 2 * kPage);
  EXPECT_EQ(pool.alignment(), 2 * kPage);
  auto a = pool.Allocate(100);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  EXPECT_EQ(a->size(), 2 * kPage);
  EXPECT_TRUE(IsAligned(a->data(), 2 * kPage));
  EXPECT_TRUE(a->pinned());
  std::memset(a->data(), 0xab, a->size());  // the whole rounded size is usable
  EXPECT_EQ(pool.used_bytes(), 2 * kPage);
  EXPECT_EQ(pool.pinned_bytes(), 2 * kPage);
  {
    auto b = pool.Allocate(5 * kPage);
    ASSERT_TRUE(b.ok());
    EXPECT_EQ(pool.used_bytes(), 8 * kPage);
  }
  EXPECT_EQ(pool.used_bytes(), 2 * kPage);
  EXPECT_EQ(locker->unlocks(), 1);
  EXPECT_FALSE(pool.fell_back_to_unpinned());
  EXPECT_TRUE(pool.fallback_reason().ok());
}

TEST(PinnedMemory, SmallAlignmentIsRaisedToThePageSoBuffersNeverSharePages) {
  PinnedMemoryPool pool = MakePool(16 * kPage, std::make_shared<ScriptedLocker>(0, 1 << 30), 64);
  EXPECT_GE(pool.alignment(), kPage);
  auto a = pool.Allocate(1);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->size(), pool.alignment());
}

TEST(PinnedMemory, ZeroBytesGivesAnEmptyBufferWithoutBudget) {
  PinnedMemoryPool pool = MakePool(0);
  auto empty = pool.Allocate(0);
  ASSERT_TRUE(empty.ok());
  EXPECT_TRUE(empty->empty());
  EXPECT_EQ(pool.used_bytes(), 0u);
}

TEST(PinnedMemory, RequestBeyondBudgetIsOutOfMemoryNamingRequestUseAndBudget) {
  PinnedMemoryPool pool = MakePool(4 * kPage, std::make_shared<ScriptedLocker>(0, 1 << 30));
  auto held = pool.Allocate(3 * kPage);
  ASSERT_TRUE(held.ok());
  auto refused = pool.Allocate(2 * kPage);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kOutOfMemory);
  EXPECT_EQ(refused.status().message(),
            "pinned memory pool 'test': cannot allocate 8192 bytes (8192 rounded to 4096-byte "
            "alignment): 12288 of the 16384-byte budget in use, 4096 available");
  EXPECT_EQ(pool.used_bytes(), 3 * kPage);  // a refusal reserves nothing
  auto fits = pool.Allocate(kPage);
  EXPECT_TRUE(fits.ok());
  EXPECT_EQ(pool.used_bytes(), 4 * kPage);
}

TEST(PinnedMemory, HugeRequestsAndBadAlignmentsAreRejected) {
  PinnedMemoryPool pool = MakePool(4 * kPage);
  EXPECT_EQ(pool.Allocate(SIZE_MAX).status().code(), StatusCode::kInvalidArgument);
  auto bad = PinnedMemoryPool::Create({.name = "odd", .budget_bytes = 1, .alignment = 3000});
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().message(),
            "pinned memory pool 'odd': alignment 3000 is not a power of two");
}

TEST(PinnedMemory, MovedBuffersReturnTheirBytesOnce) {
  auto locker = std::make_shared<ScriptedLocker>(0, 1 << 30);
  PinnedMemoryPool pool = MakePool(8 * kPage, locker);
  auto a = pool.Allocate(kPage);
  auto b = pool.Allocate(2 * kPage);
  ASSERT_TRUE(a.ok() && b.ok());
  PinnedBuffer moved = std::move(*a);
  EXPECT_TRUE(a->empty());
  moved = std::move(*b);  // frees the first page, takes over the second buffer
  EXPECT_EQ(pool.used_bytes(), 2 * kPage);
  EXPECT_EQ(locker->unlocks(), 1);
  moved = PinnedBuffer();
  EXPECT_EQ(pool.used_bytes(), 0u);
  EXPECT_EQ(locker->unlocks(), 2);
}

TEST(PinnedMemory, BuffersMayOutliveTheirPool) {
  PinnedBuffer survivor;
  {
    PinnedMemoryPool pool = MakePool(kPage, std::make_shared<ScriptedLocker>(0, 1 << 30));
    survivor = std::move(pool.Allocate(kPage)).value();
  }
  std::memset(survivor.data(), 1, survivor.size());
  survivor = PinnedBuffer();  // returns to the pool's shared accounting; must not crash
}

TEST(PinnedMemory, LockFailureFallsBackWithExactlyOneWarning) {
  ASSERT_TRUE(log::SetLevel("warn").ok());
  log::ScopedCapture capture;
  auto locker = std::make_shared<ScriptedLocker>(EPERM, 1);  // the second lock fails
  PinnedMemoryPool pool = MakePool(16 * kPage, locker);
  auto first = pool.Allocate(kPage);
  ASSERT_TRUE(first.ok());
  EXPECT_TRUE(first->pinned());
  std::vector<PinnedBuffer> later;
  for (int i = 0; i < 4; ++i) {
    auto buffer = pool.Allocate(kPage);
    ASSERT_TRUE(buffer.ok()) << "fallback must still hand out memory";
    EXPECT_FALSE(buffer->pinned());
    std::memset(buffer->data(), i, buffer->size());
    later.push_back(std::move(*buffer));
  }
  EXPECT_TRUE(pool.fell_back_to_unpinned());
  EXPECT_EQ(pool.used_bytes(), 5 * kPage);
  EXPECT_EQ(pool.pinned_bytes(), kPage);
  EXPECT_EQ(locker->locks(), 2) << "no further lock attempts after the fallback";
  EXPECT_EQ(pool.fallback_reason().code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(pool.fallback_reason().message(),
            "pinned memory pool 'test': scripted-lock of 4096 bytes: Operation not permitted");
  EXPECT_EQ(capture.Count("cannot page-lock"), 1u);
  EXPECT_EQ(capture.Count("pinned memory pool 'test'"), 1u);
  later.clear();
  EXPECT_EQ(locker->unlocks(), 0) << "unpinned buffers are not unlocked";
  first = PinnedBuffer();
  EXPECT_EQ(locker->unlocks(), 1);
}

TEST(PinnedMemory, ConcurrentFailuresStillWarnOnce) {
  ASSERT_TRUE(log::SetLevel("warn").ok());
  log::ScopedCapture capture;
  PinnedMemoryPool pool = MakePool(64 * kPage, std::make_shared<ScriptedLocker>(ENOMEM, 0));
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 8; ++i) {
        auto buffer = pool.Allocate(kPage);
        EXPECT_TRUE(buffer.ok());
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(capture.Count("cannot page-lock"), 1u);
  EXPECT_EQ(pool.used_bytes(), 0u);
  EXPECT_EQ(pool.fallback_reason().code(), StatusCode::kOutOfMemory);
}

TEST(PinnedMemory, RealMlockPinsWithinTheLimit) {
  PinnedMemoryPool pool = MakePool(16 * kPage, MlockPageLocker());
  auto buffer = pool.Allocate(4 * kPage);
  ASSERT_TRUE(buffer.ok());
  if (!buffer->pinned())
    GTEST_SKIP() << "mlock refused here: " << pool.fallback_reason().ToString();
  EXPECT_EQ(pool.pinned_bytes(), 4 * kPage);
}

// Runs `body` in a forked child and returns its exit status (or 128 + signal).
int RunInChild(const std::function<int()>& body) {
  std::fflush(nullptr);  // the child must not repeat output buffered in the parent
  const pid_t pid = fork();
  if (pid == 0) _exit(body());
  int status = 0;
  if (pid < 0 || waitpid(pid, &status, 0) != pid) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// Drops CAP_IPC_LOCK from the effective set (so RLIMIT_MEMLOCK applies even to root) and lowers
// RLIMIT_MEMLOCK to `bytes`. False when the kernel refuses either.
bool RestrictMemlock(rlim_t bytes) {
  __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct data[2] = {};
  if (syscall(SYS_capget, &header, data) != 0) return false;
  data[CAP_TO_INDEX(CAP_IPC_LOCK)].effective &= ~CAP_TO_MASK(CAP_IPC_LOCK);
  if (syscall(SYS_capset, &header, data) != 0) return false;
  const rlimit limit{bytes, bytes};
  return setrlimit(RLIMIT_MEMLOCK, &limit) == 0;
}

// Exit codes of the child below.
enum ChildResult {
  kChildOk = 0,
  kChildCannotRestrict = 10,
  kChildAllocFailed,
  kChildStillPinned,
  kChildNoFallback,
  kChildWrongWarnings,
  kChildWrongReason
};

TEST(PinnedMemory, LowMemlockLimitFallsBackForReal) {
  const int result = RunInChild([] {
    if (!RestrictMemlock(64 * 1024)) return static_cast<int>(kChildCannotRestrict);
    if (!log::SetLevel("warn").ok()) return static_cast<int>(kChildWrongWarnings);
    log::ScopedCapture capture;
    auto pool = PinnedMemoryPool::Create(
        {.name = "limited", .budget_bytes = 8u << 20, .locker = MlockPageLocker()});
    if (!pool.ok()) return static_cast<int>(kChildAllocFailed);
    auto big = pool->Allocate(1u << 20);  // beyond the 64 KiB limit
    auto next = pool->Allocate(1u << 20);
    if (!big.ok() || !next.ok()) return static_cast<int>(kChildAllocFailed);
    if (big->pinned() || next->pinned()) return static_cast<int>(kChildStillPinned);
    if (!pool->fell_back_to_unpinned()) return static_cast<int>(kChildNoFallback);
    const int err = pool->fallback_reason().sys_errno();
    if (err != EPERM && err != ENOMEM && err != EAGAIN) return static_cast<int>(kChildWrongReason);
    if (capture.Count("pinned memory pool 'limited': cannot page-lock 1048576 bytes with mlock") !=
        1) {
      return static_cast<int>(kChildWrongWarnings);
    }
    std::memset(big->data(), 7, big->size());
    return static_cast<int>(kChildOk);
  });
  if (result == kChildCannotRestrict)
    GTEST_SKIP() << "cannot drop CAP_IPC_LOCK or set RLIMIT_MEMLOCK";
  EXPECT_EQ(result, kChildOk);
}

}  // namespace
}  // namespace zoe
