// EvictionPolicy: picks which resident chunk of one tier to evict when the tier is full.
//
// The tier manager reports residency as it changes: Insert when a chunk becomes resident, Touch
// on every use, Pin/Unpin around the time a caller holds a pointer into it, MarkDirty when it is
// written, Remove once it has left the tier. Only unpinned chunks are candidates.
//
// Two policies, switched at run time:
//  - LRU (no trace): the least recently touched unpinned chunk.
//  - OPT (SetNextUse given, e.g. bound to TraceCursor::NextUseDistance): Belady's choice, the
//    unpinned chunk whose next use is farthest away. Ties prefer a clean chunk (evicting it costs
//    no write-back), then the least recently used.
// LRU order is a list of unpinned chunks, so LRU is O(1); OPT scans the unpinned chunks once per
// choice (O(n log k) with the cursor's binary search), stopping early at a clean never-used chunk.
// Not thread-safe: the tier manager calls it under its own lock.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <list>
#include <string_view>
#include <unordered_map>

#include "core/result.h"
#include "offload/types.h"

namespace zoe::offload {

class EvictionPolicy {
 public:
  // Events until the chunk is needed again; a larger value makes it a better victim.
  using NextUseFn = std::function<uint64_t(ChunkId)>;

  explicit EvictionPolicy(Tier tier) : tier_(tier) {}

  // A chunk became resident (unpinned, most recently used). FailedPrecondition if it already is.
  Status Insert(ChunkId chunk, bool dirty);
  // The chunk left the tier. NotFound if it is not resident; FailedPrecondition while pinned.
  Status Remove(ChunkId chunk);
  // The chunk was used: it becomes the most recently used.
  Status Touch(ChunkId chunk);
  // Pins nest: a chunk is a candidate again once every Pin has its Unpin. Both count as a use.
  Status Pin(ChunkId chunk);
  Status Unpin(ChunkId chunk);  // FailedPrecondition when not pinned
  Status MarkDirty(ChunkId chunk, bool dirty);

  // OPT with `next_use`; an empty function returns to LRU.
  void SetNextUse(NextUseFn next_use) { next_use_ = std::move(next_use); }
  bool uses_next_use() const { return static_cast<bool>(next_use_); }

  // The chunk to evict next. NotFound when nothing is resident; Busy when every resident chunk
  // is pinned (the caller must fail the request rather than wait for itself).
  Result<ChunkId> ChooseVictim() const;

  bool Contains(ChunkId chunk) const { return entries_.contains(chunk); }
  bool IsPinned(ChunkId chunk) const;
  bool IsDirty(ChunkId chunk) const;
  size_t size() const { return entries_.size(); }
  size_t evictable() const { return lru_.size(); }
  Tier tier() const { return tier_; }

 private:
  struct Entry {
    uint32_t pins = 0;
    bool dirty = false;
    std::list<ChunkId>::iterator position;  // in lru_ while unpinned
  };

  Result<Entry*> Lookup(ChunkId chunk, std::string_view operation);
  ChunkId ChooseOptimal() const;

  Tier tier_;
  NextUseFn next_use_;
  std::unordered_map<ChunkId, Entry> entries_;
  std::list<ChunkId> lru_;  // unpinned chunks, least recently used first
};

}  // namespace zoe::offload
