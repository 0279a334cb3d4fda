// Host side of optim/cuda/adamw.h: argument checks and constants here, the kernel in adamw.cu
// (compiled only when CUDA is found).
#include <string>

#include "optim/cuda/adamw.h"
#if defined(ZOE_HAVE_CUDA)
#include "optim/cuda/adamw_kernel.h"
#endif

namespace zoe::optim::cuda {
namespace {

// The state dtypes the CUDA kernel updates (no int8 block kernel on the device).
constexpr DType kDeviceStateDTypes[] = {DType::kFloat32, DType::kBFloat16};

}  // namespace

bool DeviceAvailable() {
#if defined(ZOE_HAVE_CUDA)
  return DeviceCount() > 0;
#else
  return false;
#endif
}

Status LaunchAdamW(const HyperParams& hyper, int64_t step, const ChunkLayout& layout,
                   const ChunkBuffers& chunk, const GradScaling& scaling, void* stream) {
  if (hyper.kind != Kind::kAdamW) {
    return Status::InvalidArgument("the CUDA kernel implements adamw, not " +
                                   std::string(KindName(hyper.kind)));
  }
  ZOE_RETURN_IF_ERROR(ValidateUpdate(hyper, step, layout, chunk, scaling));
  ZOE_RETURN_IF_ERROR(CheckKernelDType(layout.state, kDeviceStateDTypes, "CUDA AdamW state dtype"));
#if defined(ZOE_HAVE_CUDA)
  const UpdatePointers pointers{chunk.master, chunk.grad, chunk.exp_avg, chunk.exp_avg_sq,
                                chunk.param_copy};
  const int error =
      LaunchAdamWKernel(MakeUpdateConstants(hyper, step, scaling), pointers, chunk.count,
                        layout.grad, layout.state, CopySlotOf(layout.param_copy), stream);
  if (error != 0) {
    return Status::Internal("CUDA AdamW launch over " + std::to_string(chunk.count) +
                            " elements failed: " + ErrorString(error));
  }
  return Status::Ok();
#else
  (void)stream;
  return Status::NotSupported("zoe was built without CUDA (ZOE_WITH_CUDA=OFF or no nvcc)");
#endif
}

}  // namespace zoe::optim::cuda
