// Vocabulary of the optimizer kernels: their element types and instruction-set paths, and the
// optimizer kinds and arithmetic of core/vocabulary.h under the names the kernels use.
#pragma once

#include <cstddef>
#include <string_view>

#include "core/result.h"
#include "core/vocabulary.h"

namespace zoe::optim {

// Element type of a buffer the kernels read or write: the subset of zoe::DType (core/vocabulary.h)
// the kernels take. Arithmetic is always fp32. kI8 is only an optimizer-state type: block-wise
// quantized moments (quantize.h), one byte per element plus an fp32 scale per block. It is its own
// enum, not zoe::DType, because its values index the kernel tables (kernels.h, kernel_math.h),
// which zoe::DType's trace-file and C API numbering cannot; ToDType and ToKernelDType are the one
// bridge between the two, and the names are zoe::DType's.
enum class DType { kF32, kBF16, kF16, kI8 };

// Which update rule a step applies, and how Adam computes its denominator (core/vocabulary.h).
using Kind = zoe::OptimizerKind;
using zoe::Arithmetic;

// Instruction-set path of the CPU kernels, best first. Every path computes bit-identical fp32
// results (see kernel_math.h for why).
enum class Isa {
  kAvx512Bf16,  // AVX-512 F/BW/VL/DQ plus the native bf16 conversion (vcvtneps2bf16)
  kAvx512,      // AVX-512 F/BW/VL/DQ, bf16 conversion emulated with integer instructions
  kAvx2,        // AVX2 + FMA + F16C
  kScalar,      // portable C++: the reference every other path is tested against
};

inline constexpr Isa kAllIsas[] = {Isa::kAvx512Bf16, Isa::kAvx512, Isa::kAvx2, Isa::kScalar};
inline constexpr Kind kAllKinds[] = {Kind::kAdamW, Kind::kAdam, Kind::kAdagrad, Kind::kLion};
// Element types of gradients and parameters (every type but kI8).
inline constexpr DType kAllDTypes[] = {DType::kF32, DType::kBF16, DType::kF16};
// Element types of optimizer state (moments).
inline constexpr DType kStateDTypes[] = {DType::kF32, DType::kBF16, DType::kI8};

// Bytes of one element (for kI8 without its block's scale).
constexpr size_t SizeOf(DType type) {
  return type == DType::kF32 ? 4 : (type == DType::kI8 ? 1 : 2);
}

// The same element type in zoe's vocabulary.
zoe::DType ToDType(DType type);
// The kernels' element type for `dtype`; an InvalidArgument naming `what`, the dtype and the
// allowed ones (fp32, bf16, fp16, int8) when the kernels do not take it.
Result<DType> ToKernelDType(zoe::DType dtype, std::string_view what);

// "fp32", "bf16", "fp16", "int8" (zoe::DTypeName's).
std::string_view DTypeName(DType type);
// "adamw", "adam", "adagrad", "lion".
inline std::string_view KindName(Kind kind) { return zoe::OptimizerKindName(kind); }
// "avx512bf16", "avx512", "avx2", "scalar" (the spellings ZOE_ISA accepts).
std::string_view IsaName(Isa isa);
// "exact", "fast".
using zoe::ArithmeticName;

// Inverses of the names above (element types also accept zoe::ParseDType's other spellings:
// "f32", "float32", "float16", "bfloat16", "i8", any letter case); an unknown name is an error
// listing the accepted ones.
Result<DType> ParseDType(std::string_view name);
inline Result<Kind> ParseKind(std::string_view name) { return zoe::ParseOptimizerKind(name); }
Result<Isa> ParseIsa(std::string_view name);
using zoe::ParseArithmetic;

// Number of optimizer-state tensors a kind keeps per parameter: 2 for Adam/AdamW (exp_avg,
// exp_avg_sq), 1 for Adagrad (sum of squares, kept in the exp_avg_sq slot) and Lion (exp_avg).
constexpr int StateTensors(Kind kind) {
  return (kind == Kind::kAdamW || kind == Kind::kAdam) ? 2 : 1;
}
constexpr bool UsesExpAvg(Kind kind) { return kind != Kind::kAdagrad; }
constexpr bool UsesExpAvgSq(Kind kind) { return kind != Kind::kLion; }

}  // namespace zoe::optim
