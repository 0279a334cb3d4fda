// The boundary between cuda_adamw.cc (host C++) and adamw.cu (nvcc): plain types only.
#pragma once

#include <cstddef>

#include "optim/kernels.h"

namespace zoe::optim::cuda {

// Number of visible CUDA devices (0 when the runtime reports an error).
int DeviceCount();

// Launches the AdamW kernel for dtypes given as DType / CopySlot values; returns the cudaError_t
// of the launch (0 on success).
int LaunchAdamWKernel(const UpdateConstants& constants, const UpdatePointers& pointers,
                      size_t count, DType grad, DType state, CopySlot copy, void* stream);

// The message of a cudaError_t.
const char* ErrorString(int error);

}  // namespace zoe::optim::cuda
