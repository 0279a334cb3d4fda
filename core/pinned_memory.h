// Pinned (page-locked) host memory with a byte budget. Page-locked memory is what DMA engines
// (NVMe, GPU copies) can target directly, and it is a scarce, machine-wide resource, so zoe
// takes it only from a bounded PinnedMemoryPool.
//
// Contract:
//  - Every buffer is aligned to max(alignment, page size) and its size rounded up to that, so no
//    two buffers share a page (unlocking one never unlocks another). The budget counts the
//    rounded bytes.
//  - A request beyond the remaining budget is OutOfMemory naming the requested bytes, the bytes
//    in use and the budget. The bytes return to the budget when the buffer is destroyed.
//  - When page-locking fails (a low RLIMIT_MEMLOCK: EPERM/ENOMEM/EAGAIN), the pool logs ONE
//    warning, switches to plain memory for that and every later buffer, and says so through
//    fell_back_to_unpinned() / fallback_reason(); buffer.pinned() tells for each buffer.
//  - With a CUDA device present (builds with ZOE_HAVE_CUDA), the default locker also registers
//    the memory with cudaHostRegister so device copies from it are truly asynchronous.
//  - Thread-safe: buffers may be allocated and destroyed from any thread; a buffer may outlive
//    its pool object (they share the accounting state).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "core/result.h"

namespace zoe {

// Page-locks and unlocks host memory. Replaceable so tests can make locking fail on demand.
class PageLocker {
 public:
  virtual ~PageLocker() = default;
  virtual std::string_view name() const = 0;  // "mlock", "mlock+cudaHostRegister", ...
  // Page-locks [addr, addr + bytes) (page-aligned); 0 or -errno.
  virtual int Lock(void* addr, size_t bytes) = 0;
  // Undoes a successful Lock of the same range.
  virtual void Unlock(void* addr, size_t bytes) = 0;
};

// mlock/munlock; subject to RLIMIT_MEMLOCK unless the process holds CAP_IPC_LOCK.
std::shared_ptr<PageLocker> MlockPageLocker();
// mlock, plus cudaHostRegister when zoe was built with CUDA and a device is present.
std::shared_ptr<PageLocker> DefaultPageLocker();

struct PinnedPoolOptions {
  std::string name = "pinned";         // names the pool in messages
  uint64_t budget_bytes = 0;           // upper bound on the bytes of all live buffers
  size_t alignment = 4096;             // a power of two; raised to the page size if smaller
  std::shared_ptr<PageLocker> locker;  // null: DefaultPageLocker()
};

class PinnedMemoryPool;

// A move-only block of host memory from a PinnedMemoryPool, returned to its budget (and
// unlocked) on destruction. The memory is not initialised.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(PinnedBuffer&& other) noexcept;
  PinnedBuffer& operator=(PinnedBuffer&& other) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer();

  std::byte* data() { return data_; }
  const std::byte* data() const { return data_; }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  bool pinned() const { return pinned_; }  // page-locked (false after a fallback)
  std::span<std::byte> span() { return {data_, size_}; }
  std::span<const std::byte> span() const { return {data_, size_}; }

 private:
  friend class PinnedMemoryPool;
  struct PoolState;
  void Release();

  std::shared_ptr<PoolState> pool_;
  std::byte* data_ = nullptr;
  size_t size_ = 0;
  bool pinned_ = false;
};

class PinnedMemoryPool {
 public:
  // Fails when the alignment is not a power of two.
  static Result<PinnedMemoryPool> Create(PinnedPoolOptions options);

  // A buffer of at least `bytes` (rounded up; see the contract above). bytes == 0 gives an
  // empty buffer that uses no budget.
  Result<PinnedBuffer> Allocate(size_t bytes);

  const std::string& name() const;
  uint64_t budget_bytes() const;
  uint64_t used_bytes() const;         // rounded bytes of live buffers
  uint64_t pinned_bytes() const;       // the part of used_bytes() that is page-locked
  size_t alignment() const;            // effective alignment (>= page size)
  bool fell_back_to_unpinned() const;  // page-locking failed once; later buffers are plain
  Status fallback_reason() const;      // why, or OK when no fallback happened

 private:
  explicit PinnedMemoryPool(std::shared_ptr<PinnedBuffer::PoolState> state);
  Result<PinnedBuffer> AllocateReserved(size_t rounded);

  std::shared_ptr<PinnedBuffer::PoolState> state_;
};

}  // namespace zoe
