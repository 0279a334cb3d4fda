#include "optim/types.h"

#include <fmt/format.h>

#include <string>

namespace zoe::optim {
namespace {

constexpr DType kKernelDTypes[] = {DType::kF32, DType::kBF16, DType::kF16, DType::kI8};

// "fp32, bf16, fp16, int8": the element types the kernels take, as errors list them.
std::string KernelDTypeNames() {
  std::string names;
  for (DType type : kKernelDTypes)
    names += fmt::format("{}{}", names.empty() ? "" : ", ", DTypeName(type));
  return names;
}

}  // namespace

zoe::DType ToDType(DType type) {
  switch (type) {
    case DType::kF32:
      return zoe::DType::kFloat32;
    case DType::kBF16:
      return zoe::DType::kBFloat16;
    case DType::kF16:
      return zoe::DType::kFloat16;
    case DType::kI8:
      return zoe::DType::kInt8;
  }
  return static_cast<zoe::DType>(0xff);  // not a dtype: DTypeName says "unknown"
}

Result<DType> ToKernelDType(zoe::DType dtype, std::string_view what) {
  for (DType type : kKernelDTypes) {
    if (ToDType(type) == dtype) return type;
  }
  return Status::InvalidArgument(
      fmt::format("{} = {} is not an element type the optimizer takes; allowed: {}", what,
                  zoe::DTypeName(dtype), KernelDTypeNames()));
}

std::string_view DTypeName(DType type) { return zoe::DTypeName(ToDType(type)); }

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

Result<DType> ParseDType(std::string_view name) {
  Result<zoe::DType> dtype = zoe::ParseDType(name);
  if (dtype.ok()) {
    Result<DType> kernel = ToKernelDType(*dtype, "element type");
    if (kernel.ok()) return kernel;
  }
  return Status::InvalidArgument(
      fmt::format("unknown element type '{}'; allowed: {}", name, KernelDTypeNames()));
}

Result<Isa> ParseIsa(std::string_view name) {
  for (Isa isa : kAllIsas) {
    if (IsaName(isa) == name) return isa;
  }
  return Status::InvalidArgument("unknown instruction set '" + std::string(name) +
                                 "'; allowed: avx512bf16, avx512, avx2, scalar");
}

}  // namespace zoe::optim
