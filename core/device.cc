#include "core/device.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <iterator>
#include <utility>

#include "core/host_device.h"
#include "core/log.h"
#include "core/vocabulary.h"
#ifdef ZOE_HAVE_CUDA
#include "core/cuda/cuda_device.h"
#endif

namespace zoe {

// Indexed by CopyKind's value (core/vocabulary.h's mechanism).
constexpr std::array<std::string_view, 3> kCopyKindNames = {"host-to-device", "device-to-host",
                                                            "device-to-device"};
static_assert(kCopyKindNames.size() == static_cast<size_t>(CopyKind::kDeviceToDevice) + 1);

std::string_view CopyKindName(CopyKind kind) { return NameIn(kCopyKindNames, kind); }

// ---------------------------------------------------------------------------------------------
// DeviceAllocation

DeviceAllocation::DeviceAllocation(DeviceAllocation&& other) noexcept
    : backend_(std::exchange(other.backend_, nullptr)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)) {}

DeviceAllocation& DeviceAllocation::operator=(DeviceAllocation&& other) noexcept {
  if (this != &other) {
    Release();
    backend_ = std::exchange(other.backend_, nullptr);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

DeviceAllocation::~DeviceAllocation() { Release(); }

void DeviceAllocation::Release() {
  if (data_ != nullptr) backend_->Free(data_, size_);
  data_ = nullptr;
  size_ = 0;
}

// ---------------------------------------------------------------------------------------------
// DeviceBackend

DeviceBackend::DeviceBackend(uint64_t capacity_bytes) : capacity_(capacity_bytes) {}

Result<DeviceAllocation> DeviceBackend::Allocate(uint64_t bytes) {
  DeviceAllocation allocation;
  allocation.backend_ = this;
  if (bytes == 0) return allocation;
  uint64_t used = used_.load();
  do {
    if (bytes > capacity_ - used) {
      return Status::OutOfMemory(
          fmt::format("device '{}': cannot allocate {} bytes: {} of {} bytes in use, {} available",
                      name(), bytes, used, capacity_, capacity_ - used));
    }
  } while (!used_.compare_exchange_weak(used, used + bytes));
  Result<void*> memory = AllocateMemory(bytes);
  if (!memory.ok()) {
    used_.fetch_sub(bytes);
    return std::move(memory).status().WithContext(
        fmt::format("device '{}': allocate {} bytes", name(), bytes));
  }
  allocation.data_ = *memory;
  allocation.size_ = bytes;
  {
    std::lock_guard<std::mutex> lock(live_mutex_);
    live_.emplace(reinterpret_cast<uintptr_t>(*memory), bytes);
  }
  return allocation;
}

void DeviceBackend::Free(void* data, uint64_t bytes) {
  {
    std::lock_guard<std::mutex> lock(live_mutex_);
    live_.erase(reinterpret_cast<uintptr_t>(data));
  }
  FreeMemory(data, bytes);
  used_.fetch_sub(bytes);
}

bool DeviceBackend::Holds(const void* data, uint64_t bytes) const {
  const auto begin = reinterpret_cast<uintptr_t>(data);
  const uint64_t length = std::max<uint64_t>(bytes, 1);
  const uintptr_t end = length > UINTPTR_MAX - begin ? UINTPTR_MAX : begin + length;
  std::lock_guard<std::mutex> lock(live_mutex_);
  auto after = live_.lower_bound(end);  // the first allocation starting at or past the end
  if (after == live_.begin()) return false;
  const auto& [start, size] = *std::prev(after);
  return start + size > begin;
}

// ---------------------------------------------------------------------------------------------
// DeviceQueue: validation shared by every backend

Status DeviceQueue::CheckRange(std::string_view role, DeviceRange range, uint64_t bytes) const {
  if (range.allocation == nullptr || range.allocation->backend() != &backend_) {
    return Status::InvalidArgument(
        fmt::format("{} is not an allocation of device '{}'", role, backend_.name()));
  }
  const uint64_t size = range.allocation->size();
  if (range.offset > size || bytes > size - range.offset) {
    return Status::InvalidArgument(
        fmt::format("{} range of {} bytes at offset {} exceeds its device allocation of {} bytes",
                    role, bytes, range.offset, size));
  }
  return Status::Ok();
}

Result<DeviceEvent> DeviceQueue::CopyToDevice(std::span<const std::byte> src, DeviceRange dst) {
  ZOE_RETURN_IF_ERROR(CheckRange("host-to-device destination", dst, src.size()));
  if (src.empty()) return DeviceEvent();
  auto* target = static_cast<std::byte*>(dst.allocation->data()) + dst.offset;
  return Submit({CopyKind::kHostToDevice, target, src.data(), src.size()});
}

Result<DeviceEvent> DeviceQueue::CopyToHost(DeviceRange src, std::span<std::byte> dst) {
  ZOE_RETURN_IF_ERROR(CheckRange("device-to-host source", src, dst.size()));
  if (dst.empty()) return DeviceEvent();
  const auto* source = static_cast<const std::byte*>(src.allocation->data()) + src.offset;
  return Submit({CopyKind::kDeviceToHost, dst.data(), source, dst.size()});
}

Result<DeviceEvent> DeviceQueue::CopyOnDevice(DeviceRange src, DeviceRange dst, uint64_t bytes) {
  ZOE_RETURN_IF_ERROR(CheckRange("device-to-device source", src, bytes));
  ZOE_RETURN_IF_ERROR(CheckRange("device-to-device destination", dst, bytes));
  const bool overlap = src.allocation == dst.allocation && src.offset < dst.offset + bytes &&
                       dst.offset < src.offset + bytes;
  if (overlap) {
    return Status::InvalidArgument(fmt::format(
        "device-to-device copy of {} bytes from offset {} to offset {} of one allocation overlaps "
        "itself; copy through a separate allocation",
        bytes, src.offset, dst.offset));
  }
  if (bytes == 0) return DeviceEvent();
  const auto* source = static_cast<const std::byte*>(src.allocation->data()) + src.offset;
  auto* target = static_cast<std::byte*>(dst.allocation->data()) + dst.offset;
  return Submit({CopyKind::kDeviceToDevice, target, source, bytes});
}

// ---------------------------------------------------------------------------------------------
// Factory

namespace {

constexpr std::string_view kKinds = "auto, cuda, host";

Result<std::unique_ptr<DeviceBackend>> CreateHost(uint64_t capacity_bytes) {
  ZOE_ASSIGN_OR_RETURN(std::chrono::microseconds delay, AdversarialDelayFromEnv());
  ZOE_ASSIGN_OR_RETURN(auto device, HostStandInDevice::Create({.capacity_bytes = capacity_bytes,
                                                               .adversarial_delay = delay}));
  return std::unique_ptr<DeviceBackend>(std::move(device));
}

// The CUDA backend, or NotSupported saying why there is none.
Result<std::unique_ptr<DeviceBackend>> CreateCuda(uint64_t capacity_bytes) {
#ifdef ZOE_HAVE_CUDA
  return cuda::CreateCudaDevice(0, capacity_bytes);
#else
  (void)capacity_bytes;
  return Status::NotSupported("zoe was built without CUDA (ZOE_WITH_CUDA=OFF or no nvcc found)");
#endif
}

}  // namespace

Result<std::unique_ptr<DeviceBackend>> CreateDeviceBackend(std::string_view kind,
                                                           uint64_t capacity_bytes) {
  if (kind == "host") return CreateHost(capacity_bytes);
  if (kind == "cuda") return CreateCuda(capacity_bytes);
  if (kind != "auto") {
    return Status::InvalidArgument(
        fmt::format("device backend '{}' is unknown; allowed: {}", kind, kKinds));
  }
  Result<std::unique_ptr<DeviceBackend>> cuda = CreateCuda(capacity_bytes);
  if (cuda.ok()) {
    ZOE_LOG_INFO("device backend: {} (auto: a CUDA device is present)", (*cuda)->name());
    return cuda;
  }
  if (cuda.status().code() != StatusCode::kNotSupported) return cuda;
  ZOE_LOG_INFO("device backend: host stand-in (auto: {})", cuda.status().message());
  return CreateHost(capacity_bytes);
}

}  // namespace zoe
