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

bool EqualsIgnoreCase(std::string_view a, std::string_view b) {
  return std::equal(a.begin(), a.end(), b.begin(), b.end(), [](char x, char y) {
    return std::tolower(static_cast<unsigned char>(x)) ==
           std::tolower(static_cast<unsigned char>(y));
  });
}

template <size_t N>
Status UnknownName(std::string_view what, std::string_view name,
                   const std::array<std::string_view, N>& allowed) {
  return Status::InvalidArgument(
      fmt::format("unknown {} '{}'; allowed: {}", what, name, JoinNames(allowed)));
}

// The enum value whose name in `names` is exactly `name`.
template <class Enum, size_t N>
Result<Enum> ParseExact(const std::array<std::string_view, N>& names, std::string_view what,
                        std::string_view name) {
  const auto found = std::find(names.begin(), names.end(), name);
  if (found == names.end()) return UnknownName(what, name, names);
  return static_cast<Enum>(found - names.begin());
}

std::array<std::string_view, kDTypes.size()> DTypeNames() {
  std::array<std::string_view, kDTypes.size()> names;
  for (size_t i = 0; i < kDTypes.size(); ++i) names[i] = kDTypes[i].name;
  return names;
}

}  // namespace

std::string JoinNames(const std::string_view* names, size_t count) {
  return fmt::format("{}", fmt::join(names, names + count, ", "));
}

Result<OptimizerKind> ParseOptimizerKind(std::string_view name) {
  return ParseExact<OptimizerKind>(kOptimizerKindNames, "optimizer", name);
}

Result<Arithmetic> ParseArithmetic(std::string_view name) {
  return ParseExact<Arithmetic>(kArithmeticNames, "arithmetic", name);
}

Result<EvictionKind> ParseEvictionKind(std::string_view name) {
  return ParseExact<EvictionKind>(kEvictionKindNames, "eviction", name);
}

Result<StoreMode> ParseStoreMode(std::string_view name) {
  return ParseExact<StoreMode>(kStoreModeNames, "stores", name);
}

Result<DType> ParseDType(std::string_view name) {
  for (const DTypeInfo& info : kDTypes) {
    const bool short_match = !info.short_name.empty() && EqualsIgnoreCase(name, info.short_name);
    if (EqualsIgnoreCase(name, info.name) || EqualsIgnoreCase(name, info.torch_name) ||
        short_match) {
      return info.dtype;
    }
  }
  return UnknownName("dtype", name, DTypeNames());
}

Status CheckMomentDType(DType dtype, std::string_view what) {
  if (std::find(kMomentDTypes.begin(), kMomentDTypes.end(), dtype) != kMomentDTypes.end())
    return Status::Ok();
  return Status::InvalidArgument(fmt::format("{} = {} is not a moment dtype; allowed: {}", what,
                                             DTypeName(dtype), JoinNames(kMomentDTypeNames)));
}

}  // namespace zoe
