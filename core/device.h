// The device tier: memory on an accelerator and asynchronous copies to and from it, behind one
// contract with two backends — CUDA (core/cuda/cuda_device.cc, built when ZOE_HAVE_CUDA) and a
// host-memory stand-in (core/host_device.h) for machines without a GPU.
//
// Contract shared by every backend:
//  - A backend has a capacity in bytes; Allocate() beyond what is left is OutOfMemory naming the
//    requested bytes, the bytes in use and the capacity. A DeviceAllocation is move-only and
//    returns its bytes when destroyed; it must not outlive its backend.
//  - Copies are issued on a DeviceQueue and run in submission order on that queue; different
//    queues run concurrently. A copy returns at once with a DeviceEvent that can be polled
//    (Ready) and waited on (Wait -> the copy's Status). Ranges are checked before submission: a
//    copy outside its allocation, between overlapping ranges of one allocation, or touching an
//    allocation of another backend is InvalidArgument and nothing is submitted.
//  - Host memory given to a copy must stay valid, and unmodified for a host-to-device copy,
//    until its event is ready. Copies from pinned memory (core/pinned_memory.h) are fastest.
//  - A queue must be destroyed before its backend; destroying a queue waits for its copies.
//  - Thread-safe: allocation, queue creation and copy submission may happen on any thread.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>

#include "core/result.h"

namespace zoe {

class DeviceBackend;

enum class CopyKind { kHostToDevice, kDeviceToHost, kDeviceToDevice };
std::string_view CopyKindName(CopyKind kind);  // "host-to-device", ...

// The completion of one asynchronous copy. Copyable handle; all copies share the state.
class DeviceEvent {
 public:
  // What a backend implements for its events.
  class Impl {
   public:
    virtual ~Impl() = default;
    virtual bool Poll() = 0;    // true once the copy finished, successfully or not
    virtual Status Wait() = 0;  // blocks until finished; the copy's Status
  };

  DeviceEvent() = default;  // an event that is already complete and OK (nothing to copy)
  explicit DeviceEvent(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

  bool Ready() const { return impl_ == nullptr || impl_->Poll(); }
  // May be called any number of times, from any thread.
  Status Wait() const { return impl_ == nullptr ? Status::Ok() : impl_->Wait(); }

 private:
  std::shared_ptr<Impl> impl_;
};

// Device memory (for the stand-in: host memory playing that role). Move-only; freed back to its
// backend's budget on destruction.
class DeviceAllocation {
 public:
  DeviceAllocation() = default;
  DeviceAllocation(DeviceAllocation&& other) noexcept;
  DeviceAllocation& operator=(DeviceAllocation&& other) noexcept;
  DeviceAllocation(const DeviceAllocation&) = delete;
  DeviceAllocation& operator=(const DeviceAllocation&) = delete;
  ~DeviceAllocation();

  void* data() const { return data_; }  // a device address: not dereferenceable on the host
  uint64_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  const DeviceBackend* backend() const { return backend_; }

 private:
  friend class DeviceBackend;
  void Release();

  DeviceBackend* backend_ = nullptr;
  void* data_ = nullptr;
  uint64_t size_ = 0;
};

// A place in device memory: `offset` bytes into `allocation`.
struct DeviceRange {
  const DeviceAllocation* allocation = nullptr;
  uint64_t offset = 0;
};

// An in-order queue of copies (a CUDA stream, or a worker thread for the stand-in).
class DeviceQueue {
 public:
  virtual ~DeviceQueue() = default;
  DeviceQueue(const DeviceQueue&) = delete;
  DeviceQueue& operator=(const DeviceQueue&) = delete;

  // Each copies `src.size()` / `dst.size()` / `bytes` bytes; see the contract above.
  Result<DeviceEvent> CopyToDevice(std::span<const std::byte> src, DeviceRange dst);
  Result<DeviceEvent> CopyToHost(DeviceRange src, std::span<std::byte> dst);
  Result<DeviceEvent> CopyOnDevice(DeviceRange src, DeviceRange dst, uint64_t bytes);

  // Waits until every copy submitted so far has finished; the first failure among them since the
  // last Synchronize, or OK.
  virtual Status Synchronize() = 0;

  DeviceBackend& backend() const { return backend_; }

 protected:
  explicit DeviceQueue(DeviceBackend& backend) : backend_(backend) {}

  struct CopyRequest {
    CopyKind kind;
    void* dst;
    const void* src;
    uint64_t bytes;
  };
  // Enqueues a validated, non-empty copy.
  virtual Result<DeviceEvent> Submit(const CopyRequest& request) = 0;

 private:
  Status CheckRange(std::string_view role, DeviceRange range, uint64_t bytes) const;

  DeviceBackend& backend_;
};

class DeviceBackend {
 public:
  virtual ~DeviceBackend() = default;
  DeviceBackend(const DeviceBackend&) = delete;
  DeviceBackend& operator=(const DeviceBackend&) = delete;

  virtual std::string name() const = 0;  // "host stand-in", "cuda:0 (NVIDIA H100 ...)"
  virtual bool is_real_gpu() const = 0;

  uint64_t capacity_bytes() const { return capacity_; }
  uint64_t used_bytes() const { return used_.load(); }

  // Device memory of `bytes` bytes (0 gives an empty allocation using no budget).
  Result<DeviceAllocation> Allocate(uint64_t bytes);

  // Whether [data, data + bytes) overlaps memory of a live allocation of this backend (bytes 0
  // counts as 1; a range past the address space ends at its top): what a caller hands over as
  // host memory must not (device addresses cannot be read on the host; the stand-in's are host
  // memory, so this is how its twin of a GPU catches the mistake too).
  bool Holds(const void* data, uint64_t bytes) const;

  // A new in-order copy queue.
  virtual Result<std::unique_ptr<DeviceQueue>> CreateQueue() = 0;

  // Waits for every copy on every queue of this backend.
  virtual Status Synchronize() = 0;

 protected:
  explicit DeviceBackend(uint64_t capacity_bytes);

  // Allocates `bytes` (> 0, already within the budget) of device memory.
  virtual Result<void*> AllocateMemory(uint64_t bytes) = 0;
  virtual void FreeMemory(void* data, uint64_t bytes) = 0;

 private:
  friend class DeviceAllocation;
  void Free(void* data, uint64_t bytes);

  uint64_t capacity_;
  std::atomic<uint64_t> used_{0};
  mutable std::mutex live_mutex_;
  std::map<uintptr_t, uint64_t> live_;  // start address -> bytes of each live allocation
};

// The backend named by `kind`: "cuda" (device 0; NotSupported when zoe was built without CUDA or
// no device exists), "host" (the stand-in; capacity_bytes must be > 0), or "auto" (CUDA when
// cudaGetDeviceCount reports a device, else the stand-in; the choice and the reason are logged).
// capacity_bytes == 0 gives a CUDA backend the memory free on the device when it is created.
Result<std::unique_ptr<DeviceBackend>> CreateDeviceBackend(std::string_view kind,
                                                           uint64_t capacity_bytes);

}  // namespace zoe
