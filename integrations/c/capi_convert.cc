// Conversions from zoe.h's enums and strings to the C++ engine's types (capi_handles.h).
#include <fmt/format.h>

#include "integrations/c/capi_handles.h"

namespace zoe::capi {
namespace {

constexpr int kLastTier = ZOE_TIER_NVME;
constexpr int kLastAccess = ZOE_ACCESS_READ_WRITE;
constexpr int kLastDType = ZOE_DTYPE_FLOAT8_E5M2;
constexpr int kLastSlot = ZOE_STATE_EXP_AVG_SQ;

// The C numbers are the C++ ones (zoe_dtype is core/vocabulary.h's DType); a change on either
// side breaks the build here.
static_assert(static_cast<int>(offload::Tier::kDevice) == ZOE_TIER_DEVICE);
static_assert(static_cast<int>(offload::Tier::kHost) == ZOE_TIER_HOST);
static_assert(static_cast<int>(offload::Tier::kNvme) == ZOE_TIER_NVME);
static_assert(static_cast<int>(offload::Access::kRead) == ZOE_ACCESS_READ);
static_assert(static_cast<int>(offload::Access::kWrite) == ZOE_ACCESS_WRITE);
static_assert(static_cast<int>(offload::Access::kReadWrite) == ZOE_ACCESS_READ_WRITE);
static_assert(static_cast<int>(DType::kFloat32) == ZOE_DTYPE_FLOAT32);
static_assert(static_cast<int>(DType::kFloat16) == ZOE_DTYPE_FLOAT16);
static_assert(static_cast<int>(DType::kBFloat16) == ZOE_DTYPE_BFLOAT16);
static_assert(static_cast<int>(DType::kInt8) == ZOE_DTYPE_INT8);
static_assert(static_cast<int>(DType::kUInt8) == ZOE_DTYPE_UINT8);
static_assert(static_cast<int>(DType::kInt32) == ZOE_DTYPE_INT32);
static_assert(static_cast<int>(DType::kInt64) == ZOE_DTYPE_INT64);
static_assert(static_cast<int>(DType::kFloat64) == ZOE_DTYPE_FLOAT64);
static_assert(static_cast<int>(DType::kBool) == ZOE_DTYPE_BOOL);
static_assert(static_cast<int>(DType::kFloat8E4M3) == ZOE_DTYPE_FLOAT8_E4M3);
static_assert(static_cast<int>(DType::kFloat8E5M2) == ZOE_DTYPE_FLOAT8_E5M2);
static_assert(static_cast<int>(offload::StateSlot::kMaster) == ZOE_STATE_MASTER);
static_assert(static_cast<int>(offload::StateSlot::kExpAvg) == ZOE_STATE_EXP_AVG);
static_assert(static_cast<int>(offload::StateSlot::kExpAvgSq) == ZOE_STATE_EXP_AVG_SQ);
static_assert(static_cast<int>(StatusCode::kInternal) == ZOE_ERR_INTERNAL);

Status OutOfRange(std::string_view name, int value, std::string_view allowed) {
  return Status::InvalidArgument(
      fmt::format("{} = {} is not a valid value; allowed: {}", name, value, allowed));
}

}  // namespace

Result<offload::Tier> ToTier(int value, std::string_view name) {
  if (value < 0 || value > kLastTier)
    return OutOfRange(name, value, "ZOE_TIER_DEVICE (0), ZOE_TIER_HOST (1), ZOE_TIER_NVME (2)");
  return static_cast<offload::Tier>(value);
}

Result<offload::Access> ToAccess(int value) {
  if (value < 0 || value > kLastAccess) {
    return OutOfRange("access", value,
                      "ZOE_ACCESS_READ (0), ZOE_ACCESS_WRITE (1), ZOE_ACCESS_READ_WRITE (2)");
  }
  return static_cast<offload::Access>(value);
}

Result<DType> ToTensorDType(int value, std::string_view name) {
  if (value < 0 || value > kLastDType)
    return OutOfRange(name, value,
                      "a zoe_dtype, ZOE_DTYPE_FLOAT32 (0) .. ZOE_DTYPE_FLOAT8_E5M2 (10)");
  return static_cast<DType>(value);
}

Result<optim::DType> ToOptimDType(int value, std::string_view name) {
  // Gradients and parameters: the kernels' element types but int8 (optim::kAllDTypes).
  const bool is_dtype = value >= 0 && value <= kLastDType;
  const auto dtype = static_cast<DType>(value);
  if (is_dtype && optim::CheckKernelDType(dtype, optim::kAllDTypes, name).ok()) return dtype;
  const std::string_view given = is_dtype ? DTypeName(dtype) : std::string_view("not a zoe_dtype");
  return Status::InvalidArgument(
      fmt::format("{} = {} ({}) is not supported by optimizer groups; allowed: ZOE_DTYPE_FLOAT32, "
                  "ZOE_DTYPE_BFLOAT16, ZOE_DTYPE_FLOAT16",
                  name, value, given));
}

Result<offload::StateSlot> ToStateSlot(int value) {
  if (value < 0 || value > kLastSlot) {
    return OutOfRange("slot", value,
                      "ZOE_STATE_MASTER (0), ZOE_STATE_EXP_AVG (1), ZOE_STATE_EXP_AVG_SQ (2)");
  }
  return static_cast<offload::StateSlot>(value);
}

Result<char*> CopyForCaller(std::string_view text) {
  char* copy = static_cast<char*>(std::malloc(text.size() + 1));
  if (copy == nullptr)
    return Status::OutOfMemory(fmt::format("{} bytes for a returned string", text.size() + 1));
  std::memcpy(copy, text.data(), text.size());
  copy[text.size()] = '\0';
  return copy;
}

}  // namespace zoe::capi
