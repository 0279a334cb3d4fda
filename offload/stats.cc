#include "offload/stats.h"

#include <fmt/format.h>

#include <array>

namespace zoe::offload {
namespace {

constexpr auto kRelaxed = std::memory_order_relaxed;

size_t Index(Tier tier) { return static_cast<size_t>(tier); }
size_t Index(Link link) { return static_cast<size_t>(link); }

// Raises `peak` to at least `value`; a CAS loop because another thread may raise it concurrently.
void RaiseTo(std::atomic<uint64_t>& peak, uint64_t value) {
  uint64_t seen = peak.load(kRelaxed);
  while (seen < value && !peak.compare_exchange_weak(seen, value, kRelaxed)) {
  }
}

}  // namespace

// Indexed by Link's value (core/vocabulary.h's mechanism).
constexpr std::array<std::string_view, kLinkCount> kLinkNames = {"device_to_host", "host_to_device",
                                                                 "host_to_nvme", "nvme_to_host"};

std::string_view LinkName(Link link) { return NameIn(kLinkNames, link); }

Result<Link> LinkBetween(Tier from, Tier to) {
  if (from == Tier::kDevice && to == Tier::kHost) return Link::kDeviceToHost;
  if (from == Tier::kHost && to == Tier::kDevice) return Link::kHostToDevice;
  if (from == Tier::kHost && to == Tier::kNvme) return Link::kHostToNvme;
  if (from == Tier::kNvme && to == Tier::kHost) return Link::kNvmeToHost;
  return Status::InvalidArgument(
      fmt::format("no link from {} to {}; data moves only between neighbours: device<->host<->nvme",
                  TierName(from), TierName(to)));
}

void Stats::AddTransfer(Link link, uint64_t bytes) {
  AtomicLink& counters = links_[Index(link) % kLinkCount];
  counters.bytes.fetch_add(bytes, kRelaxed);
  counters.transfers.fetch_add(1, kRelaxed);
}

void Stats::AddPrefetchIssued(uint64_t chunks) { prefetches_issued_.fetch_add(chunks, kRelaxed); }
void Stats::AddPrefetchHit() { prefetch_hits_.fetch_add(1, kRelaxed); }
void Stats::AddPrefetchMiss() { prefetch_misses_.fetch_add(1, kRelaxed); }
void Stats::AddTraceMatched() { trace_matched_.fetch_add(1, kRelaxed); }
void Stats::AddTraceResynced() { trace_resynced_.fetch_add(1, kRelaxed); }
void Stats::AddTraceUnmatched() { trace_unmatched_.fetch_add(1, kRelaxed); }

void Stats::AddStall(uint64_t nanoseconds) {
  stall_nanoseconds_.fetch_add(nanoseconds, kRelaxed);
  stalls_.fetch_add(1, kRelaxed);
}

void Stats::AddEviction(Tier from, bool dirty) {
  AtomicTier& tier = tiers_[Index(from) % kTierCount];
  (dirty ? tier.evictions_dirty : tier.evictions_clean).fetch_add(1, kRelaxed);
}

void Stats::AddOccupancy(Tier tier, uint64_t bytes) {
  AtomicTier& t = tiers_[Index(tier) % kTierCount];
  RaiseTo(t.peak, t.occupancy.fetch_add(bytes, kRelaxed) + bytes);
}

// A CAS loop so that a concurrent add is never lost and the count never wraps below zero.
Status Stats::SubtractOccupancy(Tier tier, uint64_t bytes) {
  std::atomic<uint64_t>& occupancy = tiers_[Index(tier) % kTierCount].occupancy;
  uint64_t seen = occupancy.load(kRelaxed);
  while (!occupancy.compare_exchange_weak(seen, seen >= bytes ? seen - bytes : 0, kRelaxed)) {
  }
  if (seen < bytes) {
    return Status::Internal(fmt::format("{} tier occupancy of {} bytes cannot drop by {} bytes",
                                        TierName(tier), seen, bytes));
  }
  return Status::Ok();
}

StatsSnapshot Stats::Snapshot() const {
  StatsSnapshot s;
  for (size_t i = 0; i < kLinkCount; ++i) {
    s.links[i] = {links_[i].bytes.load(kRelaxed), links_[i].transfers.load(kRelaxed)};
  }
  for (size_t i = 0; i < kTierCount; ++i) {
    s.tiers[i] = {tiers_[i].occupancy.load(kRelaxed), tiers_[i].peak.load(kRelaxed),
                  tiers_[i].evictions_clean.load(kRelaxed),
                  tiers_[i].evictions_dirty.load(kRelaxed)};
  }
  s.prefetches_issued = prefetches_issued_.load(kRelaxed);
  s.prefetch_hits = prefetch_hits_.load(kRelaxed);
  s.prefetch_misses = prefetch_misses_.load(kRelaxed);
  s.stall_nanoseconds = stall_nanoseconds_.load(kRelaxed);
  s.stalls = stalls_.load(kRelaxed);
  s.trace_matched = trace_matched_.load(kRelaxed);
  s.trace_resynced = trace_resynced_.load(kRelaxed);
  s.trace_unmatched = trace_unmatched_.load(kRelaxed);
  return s;
}

nlohmann::json Stats::ToJson() const { return StatsToJson(Snapshot()); }

void Stats::Reset() {
  for (AtomicLink& link : links_) {
    link.bytes.store(0, kRelaxed);
    link.transfers.store(0, kRelaxed);
  }
  for (AtomicTier& tier : tiers_) {
    tier.peak.store(tier.occupancy.load(kRelaxed), kRelaxed);
    tier.evictions_clean.store(0, kRelaxed);
    tier.evictions_dirty.store(0, kRelaxed);
  }
  for (auto* counter :
       {&prefetches_issued_, &prefetch_hits_, &prefetch_misses_, &stall_nanoseconds_, &stalls_,
        &trace_matched_, &trace_resynced_, &trace_unmatched_}) {
    counter->store(0, kRelaxed);
  }
}

nlohmann::json StatsToJson(const StatsSnapshot& s) {
  nlohmann::json links = nlohmann::json::object();
  for (size_t i = 0; i < kLinkCount; ++i) {
    links[std::string(LinkName(static_cast<Link>(i)))] = {{"bytes", s.links[i].bytes},
                                                          {"transfers", s.links[i].transfers}};
  }
  nlohmann::json tiers = nlohmann::json::object();
  for (size_t i = 0; i < kTierCount; ++i) {
    const TierCounters& t = s.tiers[i];
    tiers[std::string(TierName(static_cast<Tier>(i)))] = {
        {"occupancy_bytes", t.occupancy_bytes},
        {"peak_occupancy_bytes", t.peak_occupancy_bytes},
        {"evictions_clean", t.evictions_clean},
        {"evictions_dirty", t.evictions_dirty}};
  }
  const uint64_t acquires = s.prefetch_hits + s.prefetch_misses;
  const double hit_rate =
      acquires == 0 ? 0.0 : static_cast<double>(s.prefetch_hits) / static_cast<double>(acquires);
  return {{"schema_version", 1},
          {"links", links},
          {"tiers", tiers},
          {"prefetch",
           {{"issued", s.prefetches_issued},
            {"hits", s.prefetch_hits},
            {"misses", s.prefetch_misses},
            {"hit_rate", hit_rate}}},
          {"stall", {{"nanoseconds", s.stall_nanoseconds}, {"count", s.stalls}}},
          {"trace",
           {{"matched", s.trace_matched},
            {"resynced", s.trace_resynced},
            {"unmatched", s.trace_unmatched}}}};
}

}  // namespace zoe::offload
