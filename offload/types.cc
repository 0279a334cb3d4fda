#include "offload/types.h"

#include <fmt/format.h>

#include <cctype>
#include <string>

namespace zoe::offload {
namespace {

bool EqualsIgnoreCase(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(a[i])) !=
        std::tolower(static_cast<unsigned char>(b[i]))) {
      return false;
    }
  }
  return true;
}

}  // namespace

std::string_view TierName(Tier tier) {
  switch (tier) {
    case Tier::kDevice:
      return "device";
    case Tier::kHost:
      return "host";
    case Tier::kNvme:
      return "nvme";
  }
  return "unknown";
}

bool IsValidTier(Tier tier) { return TierName(tier) != "unknown"; }

Result<Tier> ParseTier(std::string_view name) {
  for (Tier tier : {Tier::kDevice, Tier::kHost, Tier::kNvme}) {
    if (EqualsIgnoreCase(name, TierName(tier))) return tier;
  }
  return Status::InvalidArgument(
      fmt::format("unknown tier '{}'; allowed: device, host, nvme", name));
}

std::string_view AccessName(Access access) {
  switch (access) {
    case Access::kRead:
      return "read";
    case Access::kWrite:
      return "write";
    case Access::kReadWrite:
      return "read_write";
  }
  return "unknown";
}

bool IsValidAccess(Access access) { return AccessName(access) != "unknown"; }

Result<Access> ParseAccess(std::string_view name) {
  for (Access access : {Access::kRead, Access::kWrite, Access::kReadWrite}) {
    if (EqualsIgnoreCase(name, AccessName(access))) return access;
  }
  return Status::InvalidArgument(
      fmt::format("unknown access '{}'; allowed: read, write, read_write", name));
}

}  // namespace zoe::offload
