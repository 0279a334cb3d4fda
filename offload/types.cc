#include "offload/types.h"

#include <array>
#include <string>

namespace zoe::offload {
// Indexed by the enums' values (core/vocabulary.h's mechanism).
constexpr std::array<std::string_view, kTierCount> kTierNames = {"device", "host", "nvme"};
constexpr std::array<std::string_view, 3> kAccessNames = {"read", "write", "read_write"};
static_assert(kAccessNames.size() == static_cast<size_t>(Access::kReadWrite) + 1);

std::string_view TierName(Tier tier) { return NameIn(kTierNames, tier); }

bool IsValidTier(Tier tier) { return static_cast<size_t>(tier) < kTierNames.size(); }

Result<Tier> ParseTier(std::string_view name) {
  return ParseIn<Tier>(kTierNames, "tier", name, Case::kIgnore);
}

std::string_view AccessName(Access access) { return NameIn(kAccessNames, access); }

bool IsValidAccess(Access access) { return static_cast<size_t>(access) < kAccessNames.size(); }

Result<Access> ParseAccess(std::string_view name) {
  return ParseIn<Access>(kAccessNames, "access", name, Case::kIgnore);
}

}  // namespace zoe::offload
