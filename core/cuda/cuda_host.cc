#include "core/cuda/cuda_host.h"

#include <cuda_runtime_api.h>

#include <cerrno>
#include <string>
#include <utility>

#include "core/log.h"

namespace zoe::cuda {
namespace {

class HostRegisterLocker final : public PageLocker {
 public:
  explicit HostRegisterLocker(std::shared_ptr<PageLocker> inner)
      : inner_(std::move(inner)), name_(std::string(inner_->name()) + "+cudaHostRegister") {}

  std::string_view name() const override { return name_; }

  int Lock(void* addr, size_t bytes) override {
    if (const int rc = inner_->Lock(addr, bytes); rc != 0) return rc;
    const cudaError_t err = cudaHostRegister(addr, bytes, cudaHostRegisterDefault);
    if (err == cudaSuccess) return 0;
    ZOE_LOG_DEBUG("cudaHostRegister of {} bytes failed: {}", bytes, cudaGetErrorString(err));
    inner_->Unlock(addr, bytes);
    return err == cudaErrorMemoryAllocation ? -ENOMEM : -EIO;
  }

  void Unlock(void* addr, size_t bytes) override {
    (void)cudaHostUnregister(addr);
    inner_->Unlock(addr, bytes);
  }

 private:
  std::shared_ptr<PageLocker> inner_;
  std::string name_;
};

}  // namespace

bool HostRegistrationAvailable() {
  static const bool available = [] {
    int count = 0;
    return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
  }();
  return available;
}

std::shared_ptr<PageLocker> MakeHostRegisterLocker(std::shared_ptr<PageLocker> inner) {
  return std::make_shared<HostRegisterLocker>(std::move(inner));
}

}  // namespace zoe::cuda
