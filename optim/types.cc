#include "optim/types.h"

#include <fmt/format.h>

#include <algorithm>
#include <string>

namespace zoe::optim {
namespace {

// "fp32", or "unknown (200)" for a value outside zoe::DType.
std::string DTypeLabel(DType dtype) {
  if (IsValidDType(dtype)) return std::string(DTypeName(dtype));
  return fmt::format("unknown ({})", static_cast<int>(dtype));
}

// "fp32, bf16, fp16": element types as errors list them.
std::string DTypeNames(const DType* types, size_t count) {
  std::string names;
  for (size_t i = 0; i < count; ++i)
    names += fmt::format("{}{}", i == 0 ? "" : ", ", DTypeName(types[i]));
  return names;
}

}  // namespace

Status CheckKernelDType(DType dtype, const DType* allowed, size_t allowed_count,
                        std::string_view what) {
  if (std::find(allowed, allowed + allowed_count, dtype) != allowed + allowed_count) {
    return Status::Ok();
  }
  return Status::InvalidArgument(
      fmt::format("{} = {} is not an element type the optimizer takes; allowed: {}", what,
                  DTypeLabel(dtype), DTypeNames(allowed, allowed_count)));
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

Result<Isa> ParseIsa(std::string_view name) {
  for (Isa isa : kAllIsas) {
    if (IsaName(isa) == name) return isa;
  }
  return Status::InvalidArgument("unknown instruction set '" + std::string(name) +
                                 "'; allowed: avx512bf16, avx512, avx2, scalar");
}

}  // namespace zoe::optim
