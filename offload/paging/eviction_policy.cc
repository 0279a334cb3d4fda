#include "offload/paging/eviction_policy.h"

#include <fmt/format.h>

#include <limits>

namespace zoe::offload {

Result<EvictionPolicy::Entry*> EvictionPolicy::Lookup(ChunkId chunk, std::string_view operation) {
  auto it = entries_.find(chunk);
  if (it == entries_.end()) {
    return Status::NotFound(fmt::format("{} chunk {}: it is not resident in the {} tier", operation,
                                        chunk.value, TierName(tier_)));
  }
  return &it->second;
}

Status EvictionPolicy::Insert(ChunkId chunk, bool dirty) {
  if (entries_.contains(chunk)) {
    return Status::FailedPrecondition(fmt::format(
        "insert chunk {}: already resident in the {} tier", chunk.value, TierName(tier_)));
  }
  lru_.push_back(chunk);
  entries_.emplace(chunk, Entry{0, dirty, std::prev(lru_.end())});
  return Status::Ok();
}

Status EvictionPolicy::Remove(ChunkId chunk) {
  ZOE_ASSIGN_OR_RETURN(Entry * entry, Lookup(chunk, "remove"));
  if (entry->pins > 0) {
    return Status::FailedPrecondition(
        fmt::format("remove chunk {} from the {} tier: it is pinned {} times", chunk.value,
                    TierName(tier_), entry->pins));
  }
  lru_.erase(entry->position);
  entries_.erase(chunk);
  return Status::Ok();
}

Status EvictionPolicy::Touch(ChunkId chunk) {
  ZOE_ASSIGN_OR_RETURN(Entry * entry, Lookup(chunk, "touch"));
  if (entry->pins == 0) lru_.splice(lru_.end(), lru_, entry->position);
  return Status::Ok();
}

Status EvictionPolicy::Pin(ChunkId chunk) {
  ZOE_ASSIGN_OR_RETURN(Entry * entry, Lookup(chunk, "pin"));
  if (entry->pins == std::numeric_limits<uint32_t>::max()) {
    return Status::FailedPrecondition(fmt::format("pin chunk {}: pin count overflow", chunk.value));
  }
  if (entry->pins++ == 0) lru_.erase(entry->position);
  return Status::Ok();
}

Status EvictionPolicy::Unpin(ChunkId chunk) {
  ZOE_ASSIGN_OR_RETURN(Entry * entry, Lookup(chunk, "unpin"));
  if (entry->pins == 0) {
    return Status::FailedPrecondition(fmt::format("unpin chunk {} in the {} tier: it is not pinned",
                                                  chunk.value, TierName(tier_)));
  }
  if (--entry->pins == 0) {
    lru_.push_back(chunk);
    entry->position = std::prev(lru_.end());
  }
  return Status::Ok();
}

Status EvictionPolicy::MarkDirty(ChunkId chunk, bool dirty) {
  ZOE_ASSIGN_OR_RETURN(Entry * entry, Lookup(chunk, "mark dirty"));
  entry->dirty = dirty;
  return Status::Ok();
}

bool EvictionPolicy::IsPinned(ChunkId chunk) const {
  auto it = entries_.find(chunk);
  return it != entries_.end() && it->second.pins > 0;
}

bool EvictionPolicy::IsDirty(ChunkId chunk) const {
  auto it = entries_.find(chunk);
  return it != entries_.end() && it->second.dirty;
}

Result<ChunkId> EvictionPolicy::ChooseVictim() const {
  if (entries_.empty()) {
    return Status::NotFound(fmt::format(
        "no chunk is resident in the {} tier, so none can be evicted", TierName(tier_)));
  }
  if (lru_.empty()) {
    return Status::Busy(fmt::format(
        "all {} chunks resident in the {} tier are pinned; release a tensor or raise the {} budget",
        entries_.size(), TierName(tier_), TierName(tier_)));
  }
  return next_use_ ? ChooseOptimal() : lru_.front();
}

// Belady: scan from least to most recently used and keep the best so far, replacing it only on a
// strictly farther next use, or an equal one that is clean where the best is dirty. Scanning in
// LRU order makes the least recently used win the remaining ties. A clean chunk never used again
// cannot be beaten, so the scan stops there.
ChunkId EvictionPolicy::ChooseOptimal() const {
  ChunkId best = lru_.front();
  uint64_t best_distance = next_use_(best);
  bool best_dirty = entries_.at(best).dirty;
  for (ChunkId candidate : lru_) {
    if (best_distance == std::numeric_limits<uint64_t>::max() && !best_dirty) break;
    const uint64_t distance = next_use_(candidate);
    const bool dirty = entries_.at(candidate).dirty;
    if (distance > best_distance || (distance == best_distance && best_dirty && !dirty)) {
      best = candidate;
      best_distance = distance;
      best_dirty = dirty;
    }
  }
  return best;
}

}  // namespace zoe::offload
