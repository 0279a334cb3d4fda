#include "optim/types.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
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

// Indexed by Isa's value (core/vocabulary.h's mechanism).
constexpr std::array<std::string_view, 4> kIsaNames = {"avx512bf16", "avx512", "avx2", "scalar"};
static_assert(kIsaNames.size() == static_cast<size_t>(Isa::kScalar) + 1);

std::string_view IsaName(Isa isa) { return NameIn(kIsaNames, isa); }

Result<Isa> ParseIsa(std::string_view name) {
  return ParseIn<Isa>(kIsaNames, "instruction set", name);
}

}  // namespace zoe::optim
