#include "core/cuda/cuda_device.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/log.h"

namespace zoe::cuda {
namespace {

Status CudaError(cudaError_t err, std::string_view what) {
  const std::string message =
      fmt::format("{}: {} ({})", what, cudaGetErrorString(err), cudaGetErrorName(err));
  if (err == cudaErrorMemoryAllocation) return Status::OutOfMemory(message);
  if (err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver) {
    return Status::NotSupported(message);
  }
  if (err == cudaErrorInvalidValue) return Status::InvalidArgument(message);
  return Status::IoError(message);
}

// A cudaEvent recorded on a stream right after the copy it stands for.
class CudaEvent final : public DeviceEvent::Impl {
 public:
  CudaEvent(int device, cudaEvent_t event, std::string what)
      : device_(device), event_(event), what_(std::move(what)) {}
  ~CudaEvent() override { (void)cudaEventDestroy(event_); }

  bool Poll() override {
    (void)cudaSetDevice(device_);
    return cudaEventQuery(event_) != cudaErrorNotReady;
  }

  Status Wait() override {
    (void)cudaSetDevice(device_);
    const cudaError_t err = cudaEventSynchronize(event_);
    return err == cudaSuccess ? Status::Ok() : CudaError(err, what_);
  }

 private:
  int device_;
  cudaEvent_t event_;
  std::string what_;
};

cudaMemcpyKind ToCuda(CopyKind kind) {
  switch (kind) {
    case CopyKind::kHostToDevice:
      return cudaMemcpyHostToDevice;
    case CopyKind::kDeviceToHost:
      return cudaMemcpyDeviceToHost;
    case CopyKind::kDeviceToDevice:
      return cudaMemcpyDeviceToDevice;
  }
  return cudaMemcpyDefault;
}

class CudaQueue final : public DeviceQueue {
 public:
  CudaQueue(DeviceBackend& backend, int device, cudaStream_t stream)
      : DeviceQueue(backend), device_(device), stream_(stream) {}
  ~CudaQueue() override {
    (void)cudaSetDevice(device_);
    (void)cudaStreamSynchronize(stream_);
    (void)cudaStreamDestroy(stream_);
  }

  Status Synchronize() override {
    (void)cudaSetDevice(device_);
    const cudaError_t err = cudaStreamSynchronize(stream_);
    return err == cudaSuccess ? Status::Ok() : CudaError(err, "synchronize CUDA stream");
  }

 protected:
  Result<DeviceEvent> Submit(const CopyRequest& request) override {
    const std::string what =
        fmt::format("{} copy of {} bytes", CopyKindName(request.kind), request.bytes);
    (void)cudaSetDevice(device_);
    cudaError_t err =
        cudaMemcpyAsync(request.dst, request.src, request.bytes, ToCuda(request.kind), stream_);
    if (err != cudaSuccess) return CudaError(err, what);
    cudaEvent_t event;
    err = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
    if (err != cudaSuccess) return CudaError(err, "create CUDA event");
    err = cudaEventRecord(event, stream_);
    if (err != cudaSuccess) {
      (void)cudaEventDestroy(event);
      return CudaError(err, "record CUDA event");
    }
    return DeviceEvent(std::make_shared<CudaEvent>(device_, event, what));
  }

 private:
  int device_;
  cudaStream_t stream_;
};

class CudaDevice final : public DeviceBackend {
 public:
  CudaDevice(int device, std::string name, uint64_t capacity)
      : DeviceBackend(capacity), device_(device), name_(std::move(name)) {}

  std::string name() const override { return name_; }
  bool is_real_gpu() const override { return true; }

  Result<std::unique_ptr<DeviceQueue>> CreateQueue() override {
    (void)cudaSetDevice(device_);
    cudaStream_t stream;
    const cudaError_t err = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    if (err != cudaSuccess) return CudaError(err, "create CUDA stream");
    return std::unique_ptr<DeviceQueue>(std::make_unique<CudaQueue>(*this, device_, stream));
  }

  Status Synchronize() override {
    (void)cudaSetDevice(device_);
    const cudaError_t err = cudaDeviceSynchronize();
    return err == cudaSuccess ? Status::Ok() : CudaError(err, "synchronize CUDA device");
  }

 protected:
  Result<void*> AllocateMemory(uint64_t bytes) override {
    (void)cudaSetDevice(device_);
    void* memory = nullptr;
    const cudaError_t err = cudaMalloc(&memory, bytes);
    if (err != cudaSuccess) return CudaError(err, fmt::format("cudaMalloc of {} bytes", bytes));
    return memory;
  }

  void FreeMemory(void* data, uint64_t) override {
    (void)cudaSetDevice(device_);
    (void)cudaFree(data);
  }

 private:
  int device_;
  std::string name_;
};

}  // namespace

Result<std::unique_ptr<DeviceBackend>> CreateCudaDevice(int ordinal, uint64_t capacity_bytes) {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    return Status::NotSupported(
        fmt::format("no CUDA device: {} ({})", cudaGetErrorString(err), cudaGetErrorName(err)));
  }
  if (ordinal < 0 || ordinal >= count) {
    return Status::NotSupported(
        fmt::format("no CUDA device {}: the runtime reports {} device(s)", ordinal, count));
  }
  cudaDeviceProp props;
  if ((err = cudaGetDeviceProperties(&props, ordinal)) != cudaSuccess) {
    return CudaError(err, fmt::format("query CUDA device {}", ordinal));
  }
  if ((err = cudaSetDevice(ordinal)) != cudaSuccess) {
    return CudaError(err, fmt::format("select CUDA device {}", ordinal));
  }
  size_t free_bytes = 0, total_bytes = 0;
  if ((err = cudaMemGetInfo(&free_bytes, &total_bytes)) != cudaSuccess) {
    return CudaError(err, fmt::format("query memory of CUDA device {}", ordinal));
  }
  if (capacity_bytes > total_bytes) {
    return Status::InvalidArgument(
        fmt::format("device capacity {} bytes exceeds the {} bytes of CUDA device {} ({})",
                    capacity_bytes, total_bytes, ordinal, props.name));
  }
  const uint64_t capacity = capacity_bytes == 0 ? free_bytes : capacity_bytes;
  std::string name = fmt::format("cuda:{} ({})", ordinal, props.name);
  return std::unique_ptr<DeviceBackend>(
      std::make_unique<CudaDevice>(ordinal, std::move(name), capacity));
}

}  // namespace zoe::cuda
