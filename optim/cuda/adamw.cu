// The AdamW kernel on device buffers. One thread per element in a grid-stride loop; the
// arithmetic is optim/kernel_math.h's AdamStep with explicit round-to-nearest intrinsics (no
// contraction into FMA), and conversions follow optim/convert.h bit for bit.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "optim/cuda/adamw_kernel.h"

namespace zoe::optim::cuda {
namespace {

__device__ float LoadBf16(const uint16_t* p, size_t i) {
  return __uint_as_float(uint32_t{p[i]} << 16);
}

__device__ uint16_t ToBf16(float x) {
  const uint32_t bits = __float_as_uint(x);
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  if (magnitude < 0x00800000u) return static_cast<uint16_t>((bits >> 16) & 0x8000u);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

template <DType D>
__device__ float Load(const void* base, size_t i) {
  if constexpr (D == DType::kFloat32) {
    return static_cast<const float*>(base)[i];
  } else if constexpr (D == DType::kBFloat16) {
    return LoadBf16(static_cast<const uint16_t*>(base), i);
  } else {
    return __half2float(static_cast<const __half*>(base)[i]);
  }
}

template <DType D>
__device__ void Store(void* base, size_t i, float x) {
  if constexpr (D == DType::kFloat32) {
    static_cast<float*>(base)[i] = x;
  } else if constexpr (D == DType::kBFloat16) {
    static_cast<uint16_t*>(base)[i] = ToBf16(x);
  } else {
    static_cast<__half*>(base)[i] = __float2half_rn(x);
  }
}

template <DType G, DType S, CopySlot C>
__global__ void AdamWKernel(UpdateConstants k, UpdatePointers p, size_t count) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    const float g = __fmul_rn(Load<G>(p.grad, i), k.grad_scale);
    float w = __fmul_rn(p.master[i], k.decay);
    float m = Load<S>(p.exp_avg, i);
    float v = Load<S>(p.exp_avg_sq, i);
    m = __fadd_rn(__fmul_rn(m, k.beta1), __fmul_rn(g, k.one_minus_beta1));
    v = __fadd_rn(__fmul_rn(v, k.beta2), __fmul_rn(__fmul_rn(k.one_minus_beta2, g), g));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), k.bias_correction2_sqrt), k.eps);
    w = __fadd_rn(w, __fdiv_rn(__fmul_rn(k.neg_step_size, m), denom));
    p.master[i] = w;
    Store<S>(p.exp_avg, i, m);
    Store<S>(p.exp_avg_sq, i, v);
    if constexpr (C == CopySlot::kBF16) Store<DType::kBFloat16>(p.param_copy, i, w);
    if constexpr (C == CopySlot::kF16) Store<DType::kFloat16>(p.param_copy, i, w);
    if constexpr (C == CopySlot::kF32) Store<DType::kFloat32>(p.param_copy, i, w);
  }
}

template <DType G, DType S, CopySlot C>
int Launch(const UpdateConstants& k, const UpdatePointers& p, size_t count, cudaStream_t stream) {
  constexpr int kThreads = 256;
  const size_t wanted = (count + kThreads - 1) / kThreads;
  const int blocks = static_cast<int>(wanted < 65535 * 8 ? wanted : 65535 * 8);
  AdamWKernel<G, S, C><<<blocks, kThreads, 0, stream>>>(k, p, count);
  return static_cast<int>(cudaGetLastError());
}

template <DType G, DType S>
int LaunchForCopy(const UpdateConstants& k, const UpdatePointers& p, size_t count, CopySlot copy,
                  cudaStream_t stream) {
  switch (copy) {
    case CopySlot::kNone:
      return Launch<G, S, CopySlot::kNone>(k, p, count, stream);
    case CopySlot::kBF16:
      return Launch<G, S, CopySlot::kBF16>(k, p, count, stream);
    case CopySlot::kF16:
      return Launch<G, S, CopySlot::kF16>(k, p, count, stream);
    case CopySlot::kF32:
      return Launch<G, S, CopySlot::kF32>(k, p, count, stream);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

template <DType G>
int LaunchForState(const UpdateConstants& k, const UpdatePointers& p, size_t count, DType state,
                   CopySlot copy, cudaStream_t stream) {
  if (state == DType::kBFloat16)
    return LaunchForCopy<G, DType::kBFloat16>(k, p, count, copy, stream);
  return LaunchForCopy<G, DType::kFloat32>(k, p, count, copy, stream);
}

}  // namespace

int DeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) return 0;
  return count;
}

int LaunchAdamWKernel(const UpdateConstants& constants, const UpdatePointers& pointers,
                      size_t count, DType grad, DType state, CopySlot copy, void* stream) {
  if (count == 0) return 0;
  auto s = static_cast<cudaStream_t>(stream);
  switch (grad) {
    case DType::kFloat32:
      return LaunchForState<DType::kFloat32>(constants, pointers, count, state, copy, s);
    case DType::kBFloat16:
      return LaunchForState<DType::kBFloat16>(constants, pointers, count, state, copy, s);
    case DType::kFloat16:
      return LaunchForState<DType::kFloat16>(constants, pointers, count, state, copy, s);
    default:  // LaunchAdamW refuses every other dtype
      break;
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

const char* ErrorString(int error) { return cudaGetErrorString(static_cast<cudaError_t>(error)); }

}  // namespace zoe::optim::cuda
