#include "optim/types.h"

#include <string>

namespace zoe::optim {

std::string_view DTypeName(DType type) {
  switch (type) {
    case DType::kF32:
      return "fp32";
    case DType::kBF16:
      return "bf16";
    case DType::kF16:
      return "fp16";
    case DType::kI8:
      return "int8";
  }
  return "unknown";
}

std::string_view KindName(Kind kind) {
  switch (kind) {
    case Kind::kAdamW:
      return "adamw";
    case Kind::kAdam:
      return "adam";
    case Kind::kAdagrad:
      return "adagrad";
    case Kind::kLion:
      return "lion";
  }
  return "unknown";
}

std::string_view IsaName(Isa isa) {
  switch (isa) {
    case Isa::kAvx512Bf16:
      return "avx512bf16";
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kScalar:
      return "scalar";
  }
  return "unknown";
}

std::string_view ArithmeticName(Arithmetic arithmetic) {
  return arithmetic == Arithmetic::kFast ? "fast" : "exact";
}

Result<DType> ParseDType(std::string_view name) {
  if (name == "fp32" || name == "f32" || name == "float32") return DType::kF32;
  if (name == "bf16" || name == "bfloat16") return DType::kBF16;
  if (name == "fp16" || name == "f16" || name == "float16") return DType::kF16;
  if (name == "int8" || name == "i8") return DType::kI8;
  return Status::InvalidArgument("unknown element type '" + std::string(name) +
                                 "'; allowed: fp32, bf16, fp16, int8");
}

Result<Kind> ParseKind(std::string_view name) {
  for (Kind kind : kAllKinds) {
    if (KindName(kind) == name) return kind;
  }
  return Status::InvalidArgument("unknown optimizer '" + std::string(name) +
                                 "'; allowed: adamw, adam, adagrad, lion");
}

Result<Isa> ParseIsa(std::string_view name) {
  for (Isa isa : kAllIsas) {
    if (IsaName(isa) == name) return isa;
  }
  return Status::InvalidArgument("unknown instruction set '" + std::string(name) +
                                 "'; allowed: avx512bf16, avx512, avx2, scalar");
}

Result<Arithmetic> ParseArithmetic(std::string_view name) {
  if (name == "exact") return Arithmetic::kExact;
  if (name == "fast") return Arithmetic::kFast;
  return Status::InvalidArgument("unknown arithmetic '" + std::string(name) +
                                 "'; allowed: exact, fast");
}

}  // namespace zoe::optim
