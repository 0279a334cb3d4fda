// Vocabulary of the tier manager: memory tiers, access modes, element types and the strong ids
// that name tensors and chunks. Everything here is a value type with no dependencies on io/.
#pragma once

#include <compare>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <string_view>

#include "core/result.h"

namespace zoe::offload {

// Where bytes live, fastest first. Data moves only between neighbours: DEVICE <-> HOST <-> NVME.
enum class Tier : uint8_t {
  kDevice = 0,  // GPU memory, or the host-memory stand-in where there is no GPU
  kHost = 1,    // pinned DRAM
  kNvme = 2,    // swap space on NVMe
};
inline constexpr size_t kTierCount = 3;

// "device", "host", "nvme"; "unknown" for a value outside the enum.
std::string_view TierName(Tier tier);
// Accepts the names TierName gives (case-insensitive); anything else is an error listing them.
Result<Tier> ParseTier(std::string_view name);
// True for the three named tiers; false for a value cast from an out-of-range integer.
bool IsValidTier(Tier tier);

// What an acquire intends to do with the bytes. Writing marks the chunk dirty; reading requires
// the current contents to be made resident (a pure write may skip the read).
enum class Access : uint8_t {
  kRead = 0,
  kWrite = 1,
  kReadWrite = 2,
};

std::string_view AccessName(Access access);  // "read", "write", "read_write"
Result<Access> ParseAccess(std::string_view name);
bool IsValidAccess(Access access);
inline bool Reads(Access access) { return access != Access::kWrite; }
inline bool Writes(Access access) { return access != Access::kRead; }

// Element types of registered tensors. The numbers are part of the trace file format and of the
// C API: a value, once given, is never reused.
enum class DType : uint8_t {
  kFloat32 = 0,
  kFloat16 = 1,
  kBFloat16 = 2,
  kInt8 = 3,
  kUInt8 = 4,
  kInt32 = 5,
  kInt64 = 6,
  kFloat64 = 7,
  kBool = 8,
  kFloat8E4M3 = 9,
  kFloat8E5M2 = 10,
};

// Bytes per element; 0 for a value outside the enum (an unknown dtype).
size_t DTypeSize(DType dtype);
// "fp32", "fp16", "bf16", "int8", "uint8", "int32", "int64", "fp64", "bool", "fp8_e4m3",
// "fp8_e5m2"; "unknown" for a value outside the enum.
std::string_view DTypeName(DType dtype);
// Accepts the names above and the torch spellings ("float32", "float16", "bfloat16", "float64",
// "float8_e4m3fn", "float8_e5m2"), case-insensitive; anything else is an error listing them.
Result<DType> ParseDType(std::string_view name);
inline bool IsValidDType(DType dtype) { return DTypeSize(dtype) != 0; }

// A dense integer id that cannot be mixed up with another kind of id. Ids are indices into the
// registry's tables, assigned 0, 1, 2, ... in registration order.
template <class Tag>
struct StrongId {
  static constexpr uint32_t kInvalidValue = std::numeric_limits<uint32_t>::max();

  uint32_t value = kInvalidValue;

  constexpr StrongId() = default;
  constexpr explicit StrongId(uint32_t v) : value(v) {}
  constexpr bool valid() const { return value != kInvalidValue; }
  friend constexpr auto operator<=>(StrongId, StrongId) = default;
};

struct TensorIdTag {};
struct ChunkIdTag {};
using TensorId = StrongId<TensorIdTag>;
using ChunkId = StrongId<ChunkIdTag>;

}  // namespace zoe::offload

template <class Tag>
struct std::hash<zoe::offload::StrongId<Tag>> {
  size_t operator()(zoe::offload::StrongId<Tag> id) const noexcept {
    return std::hash<uint32_t>{}(id.value);
  }
};
