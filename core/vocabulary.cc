#include "core/vocabulary.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>

namespace zoe {
namespace {

// Every table is indexed by its enum's value.
static_assert(kOptimizerKindNames.size() == static_cast<size_t>(OptimizerKind::kLion) + 1);
static_assert(kArithmeticNames.size() == static_cast<size_t>(Arithmetic::kFast) + 1);
static_assert(kEvictionKindNames.size() == static_cast<size_t>(EvictionKind::kLru) + 1);
static_assert(kStoreModeNames.size() == static_cast<size_t>(StoreMode::kStreaming) + 1);
static_assert(kDTypes.size() == static_cast<size_t>(DType::kFloat8E5M2) + 1);
constexpr bool DTypesInEnumOrder() {
  for (size_t i = 0; i < kDTypes.size(); ++i) {
    if (static_cast<size_t>(kDTypes[i].dtype) != i) return false;
  }
  return true;
}
static_assert(DTypesInEnumOrder());

std::array<std::string_view, kDTypes.size()> DTypeNames() {
  std::array<std::string_view, kDTypes.size()> names;
  for (size_t i = 0; i < kDTypes.size(); ++i) names[i] = kDTypes[i].name;
  return names;
}

}  // namespace

bool SameName(std::string_view a, std::string_view b, Case letter_case) {
  if (letter_case == Case::kExact) return a == b;
  return std::equal(a.begin(), a.end(), b.begin(), b.end(), [](char x, char y) {
    return std::tolower(static_cast<unsigned char>(x)) ==
           std::tolower(static_cast<unsigned char>(y));
  });
}

Status UnknownName(std::string_view what, std::string_view name, const std::string_view* names,
                   size_t count) {
  return Status::InvalidArgument(
      fmt::format("unknown {} '{}'; allowed: {}", what, name, JoinNames(names, count)));
}

std::string JoinNames(const std::string_view* names, size_t count) {
  return fmt::format("{}", fmt::join(names, names + count, ", "));
}

Result<OptimizerKind> ParseOptimizerKind(std::string_view name) {
  return ParseIn<OptimizerKind>(kOptimizerKindNames, "optimizer", name);
}

Result<Arithmetic> ParseArithmetic(std::string_view name) {
  return ParseIn<Arithmetic>(kArithmeticNames, "arithmetic", name);
}

Result<EvictionKind> ParseEvictionKind(std::string_view name) {
  return ParseIn<EvictionKind>(kEvictionKindNames, "eviction", name);
}

Result<StoreMode> ParseStoreMode(std::string_view name) {
  return ParseIn<StoreMode>(kStoreModeNames, "stores", name);
}

Result<DType> ParseDType(std::string_view name) {
  for (const DTypeInfo& info : kDTypes) {
    const auto same = [&](std::string_view spelling) {
      return !spelling.empty() && SameName(name, spelling, Case::kIgnore);
    };
    if (same(info.name) || same(info.torch_name) || same(info.short_name)) {
      return info.dtype;
    }
  }
  const auto names = DTypeNames();
  return UnknownName("dtype", name, names.data(), names.size());
}

Status CheckMomentDType(DType dtype, std::string_view what) {
  if (std::find(kMomentDTypes.begin(), kMomentDTypes.end(), dtype) != kMomentDTypes.end())
    return Status::Ok();
  return Status::InvalidArgument(fmt::format("{} = {} is not a moment dtype; allowed: {}", what,
                                             DTypeName(dtype), JoinNames(kMomentDTypeNames)));
}

}  // namespace zoe
