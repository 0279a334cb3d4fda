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
#include "core/vocabulary.h"

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

// Element types of registered tensors: the one DType (core/vocabulary.h), its size and names.
using zoe::DType;
using zoe::DTypeName;
using zoe::DTypeSize;
using zoe::IsValidDType;
using zoe::ParseDType;

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
