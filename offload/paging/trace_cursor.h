// TraceCursor: replays a recorded trace against the acquires actually made, and answers the two
// questions the tier manager asks of it: what to prefetch next, and how soon a chunk is needed
// again (for Belady/OPT eviction).
//
// Matching. The cursor points at the next expected event. An acquire of that event advances it
// (kMatched). Any other acquire is a mismatch, handled so that partly diverging iterations keep
// their prefetching:
//  1. A repeat of one of the last few placed acquires (a framework touching a tensor twice) leaves
//     the cursor where it is (kUnmatched).
//  2. If the event occurs within `resync_window` events ahead, the cursor jumps past it
//     (kResynced): the skipped events were not needed this time. This covers a mixture-of-experts
//     layer picking other experts (the unknown experts are kUnmatched, the next shared layer
//     resynchronises) and an evaluation pass that skips part of the trace.
//  3. Otherwise the cursor stays, and the event's next occurrence anywhere in the trace becomes an
//     anchor. If the following unmatched acquire occurs within `resync_window` after the anchor,
//     two acquires agree on where the iteration is, and the cursor relocates there (kResynced).
//     One spurious far match never moves the cursor; a real jump costs one event.
// Mismatches (kResynced and kUnmatched) are counted per iteration; past the threshold
// ShouldRerecord() tells the tier manager to record the next iteration afresh.
//
// Repetition. With `cyclic` (the default) the trace is taken to repeat: past its last event the
// cursor wraps to the first, look-ahead continues into the next iteration, and a chunk's next use
// may lie in the next iteration. Restart() marks the start of an iteration explicitly.
//
// Cost. Positions of every chunk and of every (tensor, chunk) target are precomputed and sorted,
// so NextUseDistance and the resynchronising search are binary searches, not scans.
// Not thread-safe: the tier manager calls it under its own lock.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <limits>
#include <optional>
#include <unordered_map>
#include <vector>

#include "core/result.h"
#include "offload/paging/trace.h"
#include "offload/types.h"

namespace zoe::offload {

struct TraceCursorOptions {
  bool cyclic = true;            // the trace repeats, iteration after iteration
  uint64_t resync_window = 256;  // how far ahead (events) a mismatch may jump
  uint32_t repeat_lookback = 4;  // placed acquires a repeat is compared with
  uint64_t rerecord_min_mismatches = 16;
  double rerecord_mismatch_fraction = 0.25;  // of the trace's events
  uint64_t max_lookahead_events = 1 << 16;   // bounds the work of one NextPrefetches
};

enum class AcquireMatch {
  kMatched,    // the expected event
  kResynced,   // found elsewhere in the trace; the cursor moved past it
  kUnmatched,  // not placed in the trace; the cursor stayed
};

struct PrefetchLimits {
  // Bytes of distinct upcoming chunks the look-ahead spans, resident ones included: the window
  // ends before the first chunk that would exceed it.
  uint64_t byte_budget = 0;
  // Prefetches that may be issued now (the in-flight limit minus what is in flight).
  size_t max_chunks = 0;
  // The bytes a chunk costs in the window; when empty, the bytes of its first upcoming event.
  std::function<uint64_t(ChunkId)> chunk_bytes;
  // When set, only chunks whose first upcoming event was acquired on this tier count: the others
  // are neither charged to the window nor returned (e.g. the DEVICE look-ahead).
  std::optional<Tier> only_tier;
};

class TraceCursor {
 public:
  static constexpr uint64_t kNever = std::numeric_limits<uint64_t>::max();

  // Indexes `trace` for a registry of `chunk_count` chunks; an event naming a chunk outside it, or
  // nonsensical options, are errors.
  static Result<TraceCursor> Create(Trace trace, size_t chunk_count,
                                    const TraceCursorOptions& options = {});

  // Feeds one actual acquire event (see EventsForAcquire) and says how it matched.
  AcquireMatch OnAcquire(const TraceEvent& event);

  // Starts a new iteration: back to the first event, mismatch count cleared.
  void Restart();

  // The distinct chunks of the upcoming events, in order of first use, that `skip` (resident or
  // already in flight) does not exclude, within the window, count and tier of `limits`. A chunk
  // whose first upcoming use is a write (Access::kWrite: its contents are overwritten, as a
  // gradient written afresh each iteration) is neither prefetched nor charged to the window.
  std::vector<ChunkId> NextPrefetches(const PrefetchLimits& limits,
                                      const std::function<bool(ChunkId)>& skip);

  // Events from the cursor to the chunk's next use (0: it is the next expected event); kNever when
  // the trace does not use it again (with cyclic, only when the trace never uses it).
  uint64_t NextUseDistance(ChunkId chunk) const;

  bool ShouldRerecord() const;

  const Trace& trace() const { return trace_; }
  uint64_t position() const { return position_; }        // index of the next expected event
  bool finished() const { return position_ >= size(); }  // only without cyclic
  uint64_t mismatches_this_iteration() const { return mismatches_; }
  uint64_t matched() const { return matched_; }
  uint64_t resynced() const { return resynced_; }
  uint64_t unmatched() const { return unmatched_; }

 private:
  TraceCursor(Trace trace, size_t chunk_count, const TraceCursorOptions& options);

  uint64_t size() const { return trace_.events.size(); }
  uint64_t Wrap(uint64_t position) const;
  bool IsRecentRepeat(const TraceEvent& event) const;
  // Distance from `from` to the first use at or after it among sorted `positions`, or kNever.
  uint64_t DistanceInList(const std::vector<uint32_t>& positions, uint64_t from) const;
  // Distance from `from` to the next occurrence of the event's target, or kNever.
  uint64_t NextOccurrence(const TraceEvent& event, uint64_t from) const;
  AcquireMatch Mismatch(const TraceEvent& event);
  void MoveTo(uint64_t position);
  void Placed(const TraceEvent& event);  // a matched or resynchronised acquire

  static uint64_t TargetKey(const TraceEvent& e) {
    return (uint64_t{e.tensor.value} << 32) | e.chunk.value;
  }

  Trace trace_;
  TraceCursorOptions options_;
  std::vector<std::vector<uint32_t>> chunk_positions_;                    // by chunk id
  std::unordered_map<uint64_t, std::vector<uint32_t>> target_positions_;  // by TargetKey
  std::vector<uint64_t> seen_stamp_;  // per chunk: the NextPrefetches call that last saw it
  uint64_t stamp_ = 0;

  uint64_t position_ = 0;
  std::optional<uint64_t> anchor_;  // where the last unplaced acquire occurs next (step 3)
  std::deque<uint64_t> recent_;     // TargetKeys of the last placed acquires, newest last
  uint64_t mismatches_ = 0;
  uint64_t matched_ = 0;
  uint64_t resynced_ = 0;
  uint64_t unmatched_ = 0;
};

}  // namespace zoe::offload
