// Vocabulary of the optimizer kernels: their element types and instruction-set paths, and the
// optimizer kinds and arithmetic of core/vocabulary.h under the names the kernels use.
#pragma once

#include <cstddef>
#include <iterator>
#include <string_view>

#include "core/result.h"
#include "core/vocabulary.h"

namespace zoe::optim {

// Element type of a buffer the kernels read or write: zoe::DType (core/vocabulary.h), the one
// element-type enum. The kernels take a subset of it -- fp32, bf16, fp16 for gradients, parameters
// and parameter copies (kAllDTypes), fp32, bf16, int8 for optimizer state (kStateDTypes) -- and
// every entry point checks its dtypes with CheckKernelDType. Arithmetic is always fp32. kInt8 is
// only an optimizer-state type: block-wise quantized moments (quantize.h), one byte per element
// plus an fp32 scale per block.
using DType = zoe::DType;

// Which update rule a step applies, and how Adam computes its denominator (core/vocabulary.h).
using Kind = zoe::OptimizerKind;
using zoe::Arithmetic;
using zoe::StoreMode;

// Instruction-set path of the CPU kernels, best first. Every path computes bit-identical fp32
// results (see kernel_math.h for why).
enum class Isa {
  kAvx512Bf16,  // AVX-512 F/BW/VL/DQ plus the native bf16 conversion (vcvtneps2bf16) and byte
                // permutes (VBMI): Zen 4, Sapphire Rapids and later
  kAvx512,      // AVX-512 F/BW/VL/DQ, bf16 conversion emulated with integer instructions
  kAvx2,        // AVX2 + FMA + F16C
  kScalar,      // portable C++: the reference every other path is tested against
};

inline constexpr Isa kAllIsas[] = {Isa::kAvx512Bf16, Isa::kAvx512, Isa::kAvx2, Isa::kScalar};
inline constexpr Kind kAllKinds[] = {Kind::kAdamW, Kind::kAdam, Kind::kAdagrad, Kind::kLion};
// Element types of gradients, parameters and parameter copies.
inline constexpr DType kAllDTypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
// Element types of optimizer state (moments).
inline constexpr DType kStateDTypes[] = {DType::kFloat32, DType::kBFloat16, DType::kInt8};

// The element types the kernels take, in kernel-slot order: kKernelSlotDTypes[KernelSlot(t)] == t.
inline constexpr DType kKernelSlotDTypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16,
                                              DType::kInt8};
inline constexpr int kNoKernelSlot = -1;

// The one mapping from an element type to the index of the kernel tables (kernels.h,
// kernel_math.h, cuda/adamw.cu): 0 fp32, 1 bf16, 2 fp16, 3 int8, and kNoKernelSlot for every other
// zoe::DType. The tables keep this layout, not zoe::DType's trace-file and C API numbering.
constexpr int KernelSlot(DType type) {
  for (int slot = 0; slot < static_cast<int>(std::size(kKernelSlotDTypes)); ++slot) {
    if (kKernelSlotDTypes[slot] == type) return slot;
  }
  return kNoKernelSlot;
}

// Ok when `dtype` is one of `allowed` (kAllDTypes or kStateDTypes), else an InvalidArgument
// "<what> = <dtype> is not an element type the optimizer takes; allowed: <allowed>" (a value
// outside zoe::DType is named "unknown (<number>)").
Status CheckKernelDType(DType dtype, const DType* allowed, size_t allowed_count,
                        std::string_view what);
template <size_t N>
Status CheckKernelDType(DType dtype, const DType (&allowed)[N], std::string_view what) {
  return CheckKernelDType(dtype, allowed, N, what);
}

// Element types are named and parsed by zoe::DTypeName and zoe::ParseDType.
// "adamw", "adam", "adagrad", "lion".
inline std::string_view KindName(Kind kind) { return zoe::OptimizerKindName(kind); }
// "avx512bf16", "avx512", "avx2", "scalar" (the spellings ZOE_ISA accepts).
std::string_view IsaName(Isa isa);
// "exact", "fast".
using zoe::ArithmeticName;

// Inverses of the names above; an unknown name is an error listing the accepted ones.
inline Result<Kind> ParseKind(std::string_view name) { return zoe::ParseOptimizerKind(name); }
Result<Isa> ParseIsa(std::string_view name);
using zoe::ParseArithmetic;
using zoe::ParseStoreMode;
using zoe::StoreModeName;

// Number of optimizer-state tensors a kind keeps per parameter: 2 for Adam/AdamW (exp_avg,
// exp_avg_sq), 1 for Adagrad (sum of squares, kept in the exp_avg_sq slot) and Lion (exp_avg).
constexpr int StateTensors(Kind kind) {
  return (kind == Kind::kAdamW || kind == Kind::kAdam) ? 2 : 1;
}
constexpr bool UsesExpAvg(Kind kind) { return kind != Kind::kAdagrad; }
constexpr bool UsesExpAvgSq(Kind kind) { return kind != Kind::kLion; }

}  // namespace zoe::optim
