// AdamW on device buffers: the GPU twin of UpdateChunk for Kind::kAdamW. Compiles without CUDA;
// in a build without CUDA every call returns NotSupported.
//
// The kernel uses round-to-nearest intrinsics (__fmul_rn, __fadd_rn, __fdiv_rn, __fsqrt_rn) in
// the order of optim/kernel_math.h, so it gives the CPU kernels' exact bits.
#pragma once

#include <cstdint>

#include "core/status.h"
#include "optim/chunk.h"

namespace zoe::optim::cuda {

// True when zoe was built with CUDA and a device is visible.
bool DeviceAvailable();

// Enqueues one AdamW step over `chunk`, whose pointers are device memory, on `stream` (a
// cudaStream_t; null is the default stream) and returns without waiting. Argument errors and
// launch failures are returned; faults during execution surface at the next synchronisation.
// hyper.kind must be kAdamW and layout.state fp32 or bf16 (InvalidArgument otherwise).
Status LaunchAdamW(const HyperParams& hyper, int64_t step, const ChunkLayout& layout,
                   const ChunkBuffers& chunk, const GradScaling& scaling, void* stream);

}  // namespace zoe::optim::cuda
