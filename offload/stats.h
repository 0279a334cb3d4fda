// Stats: counters of the tier manager, updated from any thread (relaxed atomics: each counter is
// exact, a snapshot of several is not taken at one instant) and read as a struct or as JSON.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string_view>

#include "core/result.h"
#include "offload/types.h"

namespace zoe::offload {

// The four directions data moves in; DEVICE and NVME are not neighbours.
enum class Link : uint8_t {
  kDeviceToHost = 0,
  kHostToDevice = 1,
  kHostToNvme = 2,
  kNvmeToHost = 3,
};
inline constexpr size_t kLinkCount = 4;

std::string_view LinkName(Link link);  // "device_to_host", ...
// The link from one tier to a neighbouring one; InvalidArgument for the same tier or DEVICE<->NVME.
Result<Link> LinkBetween(Tier from, Tier to);

struct LinkCounters {
  uint64_t bytes = 0;
  uint64_t transfers = 0;
};

struct TierCounters {
  uint64_t occupancy_bytes = 0;
  uint64_t peak_occupancy_bytes = 0;
  uint64_t evictions_clean = 0;  // left this tier without a write-back
  uint64_t evictions_dirty = 0;  // written back to the next tier first
};

struct StatsSnapshot {
  std::array<LinkCounters, kLinkCount> links{};
  std::array<TierCounters, kTierCount> tiers{};
  uint64_t prefetches_issued = 0;
  uint64_t prefetch_hits = 0;      // an acquire found its chunk resident or arriving by prefetch
  uint64_t prefetch_misses = 0;    // an acquire had to start the transfer itself
  uint64_t stall_nanoseconds = 0;  // time acquires spent waiting
  uint64_t stalls = 0;
  uint64_t trace_matched = 0;
  uint64_t trace_resynced = 0;
  uint64_t trace_unmatched = 0;
};

class Stats {
 public:
  void AddTransfer(Link link, uint64_t bytes);
  void AddPrefetchIssued(uint64_t chunks = 1);
  void AddPrefetchHit();
  void AddPrefetchMiss();
  void AddStall(uint64_t nanoseconds);
  void AddEviction(Tier from, bool dirty);
  // Occupancy moves by a delta; the peak follows the maximum. Releasing more than is occupied is
  // a bug in the caller: the count stops at 0 and the call returns Internal.
  void AddOccupancy(Tier tier, uint64_t bytes);
  Status SubtractOccupancy(Tier tier, uint64_t bytes);
  void AddTraceMatched();
  void AddTraceResynced();
  void AddTraceUnmatched();

  StatsSnapshot Snapshot() const;
  nlohmann::json ToJson() const;  // StatsToJson(Snapshot())
  // Clears every counter except current occupancy (which describes memory still in use); the
  // peak restarts from the current occupancy.
  void Reset();

 private:
  struct AtomicTier {
    std::atomic<uint64_t> occupancy{0};
    std::atomic<uint64_t> peak{0};
    std::atomic<uint64_t> evictions_clean{0};
    std::atomic<uint64_t> evictions_dirty{0};
  };
  struct AtomicLink {
    std::atomic<uint64_t> bytes{0};
    std::atomic<uint64_t> transfers{0};
  };

  std::array<AtomicLink, kLinkCount> links_;
  std::array<AtomicTier, kTierCount> tiers_;
  std::atomic<uint64_t> prefetches_issued_{0};
  std::atomic<uint64_t> prefetch_hits_{0};
  std::atomic<uint64_t> prefetch_misses_{0};
  std::atomic<uint64_t> stall_nanoseconds_{0};
  std::atomic<uint64_t> stalls_{0};
  std::atomic<uint64_t> trace_matched_{0};
  std::atomic<uint64_t> trace_resynced_{0};
  std::atomic<uint64_t> trace_unmatched_{0};
};

// The snapshot as JSON, every size in bytes and every time in nanoseconds:
// {"schema_version": 1,
//  "links": {"device_to_host": {"bytes", "transfers"}, ...},
//  "tiers": {"device": {"occupancy_bytes", "peak_occupancy_bytes", "evictions_clean",
//                       "evictions_dirty"}, ...},
//  "prefetch": {"issued", "hits", "misses", "hit_rate"},
//  "stall": {"nanoseconds", "count"},
//  "trace": {"matched", "resynced", "unmatched"}}
nlohmann::json StatsToJson(const StatsSnapshot& snapshot);

}  // namespace zoe::offload
