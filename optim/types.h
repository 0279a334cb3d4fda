// Vocabulary of the optimizer kernels: element types, optimizer kinds and instruction-set paths,
// with the names they carry in configuration, logs and benchmark output.
#pragma once

#include <cstddef>
#include <string_view>

#include "core/result.h"

namespace zoe::optim {

// Element type of a buffer the kernels read or write. Arithmetic is always fp32. kI8 is only an
// optimizer-state type: block-wise quantized moments (quantize.h), one byte per element plus an
// fp32 scale per block.
enum class DType { kF32, kBF16, kF16, kI8 };

// Which update rule a step applies.
enum class Kind {
  kAdamW,    // Adam with decoupled weight decay (Loshchilov & Hutter), torch.optim.AdamW
  kAdam,     // Adam with L2 weight decay added to the gradient, torch.optim.Adam
  kAdagrad,  // torch.optim.Adagrad (lr_decay 0, initial accumulator 0)
  kLion,     // Lion (Chen et al. 2023): sign of an interpolated momentum
};

// How Adam and AdamW compute the bias-corrected denominator (optim/chunk.h states the bound).
enum class Arithmetic {
  kExact,  // sqrt(v) / sqrt(1 - beta2^t): torch's operations, bit-identical to torch
  kFast,   // sqrt(v) * (1 / sqrt(1 - beta2^t)): one division fewer per element
};

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

// "fp32", "bf16", "fp16", "int8".
std::string_view DTypeName(DType type);
// "adamw", "adam", "adagrad", "lion".
std::string_view KindName(Kind kind);
// "avx512bf16", "avx512", "avx2", "scalar" (the spellings ZOE_ISA accepts).
std::string_view IsaName(Isa isa);
// "exact", "fast".
std::string_view ArithmeticName(Arithmetic arithmetic);

// Inverses of the names above (also accepting "f32", "float32", "float16", "bfloat16", "i8"); an
// unknown name is an error listing the accepted ones.
Result<DType> ParseDType(std::string_view name);
Result<Kind> ParseKind(std::string_view name);
Result<Isa> ParseIsa(std::string_view name);
Result<Arithmetic> ParseArithmetic(std::string_view name);

// Number of optimizer-state tensors a kind keeps per parameter: 2 for Adam/AdamW (exp_avg,
// exp_avg_sq), 1 for Adagrad (sum of squares, kept in the exp_avg_sq slot) and Lion (exp_avg).
constexpr int StateTensors(Kind kind) {
  return (kind == Kind::kAdamW || kind == Kind::kAdam) ? 2 : 1;
}
constexpr bool UsesExpAvg(Kind kind) { return kind != Kind::kAdagrad; }
constexpr bool UsesExpAvgSq(Kind kind) { return kind != Kind::kLion; }

}  // namespace zoe::optim
