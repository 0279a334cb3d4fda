// NcclCollectives: see nccl_collectives.h.
#include "offload/distributed/nccl_collectives.h"

#if defined(ZOE_HAVE_NCCL) && defined(ZOE_HAVE_CUDA)
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <vector>

#include "offload/distributed/nccl_library.h"
#endif

namespace zoe::offload {

#if defined(ZOE_HAVE_NCCL) && defined(ZOE_HAVE_CUDA)
namespace {

Status CheckCuda(cudaError_t result, const char* what) {
  if (result == cudaSuccess) return Status::Ok();
  return Status::Internal(
      fmt::format("NCCL collectives: {}: {}", what, cudaGetErrorString(result)));
}

Status CheckNccl(const NcclLibrary& nccl, ncclResult_t result, const char* what) {
  if (result == ncclSuccess) return Status::Ok();
  return Status::Aborted(
      fmt::format("NCCL collectives: {}: {}", what, nccl.GetErrorString(result)));
}

// A device allocation that grows to the largest size asked for.
class DeviceBuffer {
 public:
  ~DeviceBuffer() {
    if (data_ != nullptr) (void)cudaFree(data_);
  }
  Result<std::byte*> Reserve(size_t bytes) {
    if (bytes <= bytes_) return data_;
    if (data_ != nullptr) ZOE_RETURN_IF_ERROR(CheckCuda(cudaFree(data_), "cudaFree"));
    data_ = nullptr;
    bytes_ = 0;
    void* data = nullptr;
    ZOE_RETURN_IF_ERROR(CheckCuda(cudaMalloc(&data, bytes), "cudaMalloc"));
    data_ = static_cast<std::byte*>(data);
    bytes_ = bytes;
    return data_;
  }

 private:
  std::byte* data_ = nullptr;
  size_t bytes_ = 0;
};

size_t Sum(std::span<const uint64_t> counts) {
  size_t total = 0;
  for (const uint64_t c : counts) total += c;
  return total;
}

class NcclCollectives final : public Collectives {
 public:
  NcclCollectives(const NcclLibrary& nccl, ncclComm_t comm, cudaStream_t stream, int rank,
                  int world)
      : nccl_(nccl), comm_(comm), stream_(stream), rank_(rank), world_(world) {}
  int rank() const override { return rank_; }
  int world_size() const override { return world_; }

  Status AllReduceSum(std::span<double> values) override {
    const size_t bytes = values.size_bytes();
    ZOE_ASSIGN_OR_RETURN(std::byte * buffer, send_.Reserve(bytes));
    ZOE_RETURN_IF_ERROR(ToDevice(buffer, values.data(), bytes));
    ZOE_RETURN_IF_ERROR(CheckNccl(
        nccl_, nccl_.AllReduce(buffer, buffer, values.size(), ncclFloat64, ncclSum, comm_, stream_),
        "ncclAllReduce"));
    return ToHost(values.data(), buffer, bytes);
  }

  Status ReduceScatterSum(std::span<const float> send, std::span<float> recv,
                          std::span<const uint64_t> counts) override {
    ZOE_ASSIGN_OR_RETURN(std::byte * in, send_.Reserve(Sum(counts) * sizeof(float)));
    ZOE_ASSIGN_OR_RETURN(std::byte * out, recv_.Reserve(recv.size_bytes() + sizeof(float)));
    ZOE_RETURN_IF_ERROR(ToDevice(in, send.data(), send.size_bytes()));
    ZOE_RETURN_IF_ERROR(Check(nccl_.GroupStart(), "ncclGroupStart"));
    size_t offset = 0;
    for (int root = 0; root < world_; ++root) {
      const size_t count = counts[static_cast<size_t>(root)];
      const float* part = reinterpret_cast<const float*>(in) + offset;
      // An error inside a group is reported by ncclGroupEnd, which must run in any case.
      (void)nccl_.Reduce(part, out, count, ncclFloat32, ncclSum, root, comm_, stream_);
      offset += count;
    }
    ZOE_RETURN_IF_ERROR(Check(nccl_.GroupEnd(), "ncclReduce (per root) in ncclGroupEnd"));
    return ToHost(recv.data(), out, recv.size_bytes());
  }

  Status AllGather(std::span<const float> send, std::span<float> recv,
                   std::span<const uint64_t> counts) override {
    ZOE_ASSIGN_OR_RETURN(std::byte * out, recv_.Reserve(Sum(counts) * sizeof(float)));
    size_t offset = 0;
    for (int r = 0; r < rank_; ++r) offset += counts[static_cast<size_t>(r)];
    float* gathered = reinterpret_cast<float*>(out);
    ZOE_RETURN_IF_ERROR(ToDevice(gathered + offset, send.data(), send.size_bytes()));
    ZOE_RETURN_IF_ERROR(Check(nccl_.GroupStart(), "ncclGroupStart"));
    offset = 0;
    for (int root = 0; root < world_; ++root) {
      const size_t count = counts[static_cast<size_t>(root)];
      (void)nccl_.Broadcast(gathered + offset, gathered + offset, count, ncclFloat32, root, comm_,
                            stream_);
      offset += count;
    }
    ZOE_RETURN_IF_ERROR(Check(nccl_.GroupEnd(), "ncclBroadcast (per root) in ncclGroupEnd"));
    return ToHost(recv.data(), out, recv.size_bytes());
  }

  Status Barrier() override {
    double one = 1.0;
    return AllReduceSum(std::span<double>(&one, 1));
  }

 private:
  Status Check(ncclResult_t result, const char* what) const {
    return CheckNccl(nccl_, result, what);
  }
  Status ToDevice(void* device, const void* host, size_t bytes) {
    return CheckCuda(cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, stream_),
                     "cudaMemcpyAsync to the device");
  }
  // Waits for the collective (and reports NCCL's asynchronous error), then copies back.
  Status ToHost(void* host, const void* device, size_t bytes) {
    ZOE_RETURN_IF_ERROR(
        CheckCuda(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, stream_),
                  "cudaMemcpyAsync to the host"));
    const cudaError_t synced = cudaStreamSynchronize(stream_);
    ncclResult_t async = ncclSuccess;
    ZOE_RETURN_IF_ERROR(Check(nccl_.CommGetAsyncError(comm_, &async), "ncclCommGetAsyncError"));
    ZOE_RETURN_IF_ERROR(Check(async, "asynchronous error"));
    return CheckCuda(synced, "cudaStreamSynchronize");
  }

  const NcclLibrary& nccl_;
  ncclComm_t comm_;
  cudaStream_t stream_;
  int rank_;
  int world_;
  DeviceBuffer send_;
  DeviceBuffer recv_;
};

}  // namespace

Result<std::unique_ptr<Collectives>> MakeNcclCollectives(void* nccl_comm, void* cuda_stream) {
  if (nccl_comm == nullptr) return Status::InvalidArgument("nccl_comm is NULL");
  ZOE_ASSIGN_OR_RETURN(const NcclLibrary* nccl, LoadNccl());
  auto comm = static_cast<ncclComm_t>(nccl_comm);
  int rank = 0;
  int world = 0;
  ZOE_RETURN_IF_ERROR(CheckNccl(*nccl, nccl->CommUserRank(comm, &rank), "ncclCommUserRank"));
  ZOE_RETURN_IF_ERROR(CheckNccl(*nccl, nccl->CommCount(comm, &world), "ncclCommCount"));
  return std::unique_ptr<Collectives>(
      new NcclCollectives(*nccl, comm, static_cast<cudaStream_t>(cuda_stream), rank, world));
}

#else

Result<std::unique_ptr<Collectives>> MakeNcclCollectives(void*, void*) {
  return Status::NotSupported(
      "NCCL collectives: zoe was built without NCCL (CMake found no nccl.h, or ZOE_WITH_NCCL=OFF)");
}

#endif

}  // namespace zoe::offload
