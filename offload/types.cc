#include "offload/types.h"

#include <fmt/format.h>

#include <array>
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

struct DTypeInfo {
  DType dtype;
  size_t bytes;
  std::string_view name;
  std::string_view torch_name;
};

constexpr std::array<DTypeInfo, 11> kDTypes = {{
    {DType::kFloat32, 4, "fp32", "float32"},
    {DType::kFloat16, 2, "fp16", "float16"},
    {DType::kBFloat16, 2, "bf16", "bfloat16"},
    {DType::kInt8, 1, "int8", "int8"},
    {DType::kUInt8, 1, "uint8", "uint8"},
    {DType::kInt32, 4, "int32", "int32"},
    {DType::kInt64, 8, "int64", "int64"},
    {DType::kFloat64, 8, "fp64", "float64"},
    {DType::kBool, 1, "bool", "bool"},
    {DType::kFloat8E4M3, 1, "fp8_e4m3", "float8_e4m3fn"},
    {DType::kFloat8E5M2, 1, "fp8_e5m2", "float8_e5m2"},
}};

const DTypeInfo* FindDType(DType dtype) {
  for (const DTypeInfo& info : kDTypes) {
    if (info.dtype == dtype) return &info;
  }
  return nullptr;
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

size_t DTypeSize(DType dtype) {
  const DTypeInfo* info = FindDType(dtype);
  return info ? info->bytes : 0;
}

std::string_view DTypeName(DType dtype) {
  const DTypeInfo* info = FindDType(dtype);
  return info ? info->name : "unknown";
}

Result<DType> ParseDType(std::string_view name) {
  std::string allowed;
  for (const DTypeInfo& info : kDTypes) {
    if (EqualsIgnoreCase(name, info.name) || EqualsIgnoreCase(name, info.torch_name)) {
      return info.dtype;
    }
    allowed += allowed.empty() ? "" : ", ";
    allowed += info.name;
  }
  return Status::InvalidArgument(fmt::format("unknown dtype '{}'; allowed: {}", name, allowed));
}

}  // namespace zoe::offload
