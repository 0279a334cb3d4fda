#include "core/pinned_memory.h"

#include <fmt/format.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <utility>

#include "core/aligned_buffer.h"
#include "core/io_memory.h"
#include "core/log.h"
#ifdef ZOE_HAVE_CUDA
#include "core/cuda/cuda_host.h"
#endif

namespace zoe {
namespace {

// Calls the syscalls directly: the sanitizers' mlock interceptors do nothing and report success,
// which would hide a real RLIMIT_MEMLOCK refusal in sanitizer builds.
class Mlocker final : public PageLocker {
 public:
  std::string_view name() const override { return "mlock"; }
  int Lock(void* addr, size_t bytes) override {
    return syscall(SYS_mlock, addr, bytes) == 0 ? 0 : -errno;
  }
  void Unlock(void* addr, size_t bytes) override { (void)syscall(SYS_munlock, addr, bytes); }
};

size_t PageSize() {
  const long page = sysconf(_SC_PAGESIZE);
  return page > 0 ? static_cast<size_t>(page) : 4096;
}

}  // namespace

std::shared_ptr<PageLocker> MlockPageLocker() { return std::make_shared<Mlocker>(); }

std::shared_ptr<PageLocker> DefaultPageLocker() {
#ifdef ZOE_HAVE_CUDA
  if (cuda::HostRegistrationAvailable()) return cuda::MakeHostRegisterLocker(MlockPageLocker());
#endif
  return MlockPageLocker();
}

// Accounting shared by a pool and its buffers, so either may be destroyed first.
struct PinnedBuffer::PoolState {
  std::string name;
  uint64_t budget = 0;
  size_t alignment = 0;
  std::shared_ptr<PageLocker> locker;
  std::atomic<uint64_t> used{0};
  std::atomic<uint64_t> pinned{0};
  std::atomic<bool> fell_back{false};
  mutable std::mutex reason_mutex;
  Status fallback_reason;

  // Reserves `bytes` of the budget; false when they do not fit.
  bool Reserve(uint64_t bytes) {
    uint64_t current = used.load(std::memory_order_relaxed);
    do {
      if (bytes > budget - current) return false;
    } while (!used.compare_exchange_weak(current, current + bytes, std::memory_order_relaxed));
    return true;
  }

  // Records the first locking failure and warns about it; later failures stay silent.
  void FallBack(int err, size_t bytes) {
    {
      std::lock_guard lock(reason_mutex);
      if (fell_back.load()) return;
      fallback_reason = Status::FromErrno(
          err, fmt::format("pinned memory pool '{}': {} of {} bytes", name, locker->name(), bytes));
      fell_back.store(true);
    }
    ZOE_LOG_WARN(
        "pinned memory pool '{}': cannot page-lock {} bytes with {} ({}); raise `ulimit -l` or "
        "grant CAP_IPC_LOCK. Using unpinned memory for this pool from now on: host-device and "
        "disk transfers will be slower",
        name, bytes, locker->name(), std::strerror(-err));
  }
};

// ---------------------------------------------------------------------------------------------
// PinnedBuffer

PinnedBuffer::PinnedBuffer(PinnedBuffer&& other) noexcept
    : pool_(std::move(other.pool_)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      pinned_(std::exchange(other.pinned_, false)) {}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& other) noexcept {
  if (this != &other) {
    Release();
    pool_ = std::move(other.pool_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    pinned_ = std::exchange(other.pinned_, false);
  }
  return *this;
}

PinnedBuffer::~PinnedBuffer() { Release(); }

void PinnedBuffer::Release() {
  if (data_ == nullptr) return;
  if (pinned_) {
    pool_->locker->Unlock(data_, size_);
    pool_->pinned.fetch_sub(size_);
  }
  FreeIoMemory(data_, size_);
  pool_->used.fetch_sub(size_);
  pool_.reset();
  data_ = nullptr;
  size_ = 0;
  pinned_ = false;
}

// ---------------------------------------------------------------------------------------------
// PinnedMemoryPool

PinnedMemoryPool::PinnedMemoryPool(std::shared_ptr<PinnedBuffer::PoolState> state)
    : state_(std::move(state)) {}

Result<PinnedMemoryPool> PinnedMemoryPool::Create(PinnedPoolOptions options) {
  const size_t alignment = options.alignment;
  if (alignment == 0 || (alignment & (alignment - 1)) != 0) {
    return Status::InvalidArgument(fmt::format(
        "pinned memory pool '{}': alignment {} is not a power of two", options.name, alignment));
  }
  auto state = std::make_shared<PinnedBuffer::PoolState>();
  state->name = std::move(options.name);
  state->budget = options.budget_bytes;
  state->alignment = std::max(alignment, PageSize());
  state->locker = options.locker ? std::move(options.locker) : DefaultPageLocker();
  return PinnedMemoryPool(std::move(state));
}

Result<PinnedBuffer> PinnedMemoryPool::Allocate(size_t bytes) {
  if (bytes == 0) return PinnedBuffer();
  if (bytes > UINT64_MAX - state_->alignment) {
    return Status::InvalidArgument(
        fmt::format("pinned memory pool '{}': {} bytes is not a size", state_->name, bytes));
  }
  const size_t rounded = AlignUp(bytes, state_->alignment);
  if (!state_->Reserve(rounded)) {
    const uint64_t used = state_->used.load();
    return Status::OutOfMemory(fmt::format(
        "pinned memory pool '{}': cannot allocate {} bytes ({} rounded to {}-byte alignment): {} "
        "of the {}-byte budget in use, {} available",
        state_->name, bytes, rounded, state_->alignment, used, state_->budget,
        state_->budget - std::min(used, state_->budget)));
  }
  Result<PinnedBuffer> buffer = AllocateReserved(rounded);
  if (!buffer.ok()) state_->used.fetch_sub(rounded);
  return buffer;
}

// Allocates and locks `rounded` bytes whose budget is already reserved.
Result<PinnedBuffer> PinnedMemoryPool::AllocateReserved(size_t rounded) {
  void* memory = AllocateIoMemory(rounded, state_->alignment);
  if (memory == nullptr) {
    return Status::OutOfMemory(
        fmt::format("pinned memory pool '{}': the system refused {} bytes", state_->name, rounded));
  }
  PinnedBuffer buffer;
  buffer.pool_ = state_;
  buffer.data_ = static_cast<std::byte*>(memory);
  buffer.size_ = rounded;
  if (!state_->fell_back.load()) {
    const int rc = state_->locker->Lock(memory, rounded);
    if (rc == 0) {
      buffer.pinned_ = true;
      state_->pinned.fetch_add(rounded);
    } else {
      state_->FallBack(rc, rounded);
    }
  }
  return buffer;
}

const std::string& PinnedMemoryPool::name() const { return state_->name; }
uint64_t PinnedMemoryPool::budget_bytes() const { return state_->budget; }
uint64_t PinnedMemoryPool::used_bytes() const { return state_->used.load(); }
uint64_t PinnedMemoryPool::pinned_bytes() const { return state_->pinned.load(); }
size_t PinnedMemoryPool::alignment() const { return state_->alignment; }
bool PinnedMemoryPool::fell_back_to_unpinned() const { return state_->fell_back.load(); }

Status PinnedMemoryPool::fallback_reason() const {
  std::lock_guard lock(state_->reason_mutex);
  return state_->fallback_reason;
}

}  // namespace zoe
