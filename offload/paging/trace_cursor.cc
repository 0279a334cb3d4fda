#include "offload/paging/trace_cursor.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace zoe::offload {
namespace {

Status ValidateOptions(const TraceCursorOptions& options) {
  if (!(options.rerecord_mismatch_fraction >= 0.0 && options.rerecord_mismatch_fraction <= 1.0)) {
    return Status::InvalidArgument(fmt::format("rerecord_mismatch_fraction {} must be in [0, 1]",
                                               options.rerecord_mismatch_fraction));
  }
  if (options.max_lookahead_events == 0) {
    return Status::InvalidArgument("max_lookahead_events must be positive");
  }
  return Status::Ok();
}

Status ValidateTrace(const Trace& trace, size_t chunk_count) {
  if (trace.events.size() >= std::numeric_limits<uint32_t>::max()) {
    return Status::InvalidArgument(
        fmt::format("trace '{}' has {} events; at most {} can be replayed", trace.name,
                    trace.events.size(), std::numeric_limits<uint32_t>::max() - 1));
  }
  for (size_t i = 0; i < trace.events.size(); ++i) {
    const TraceEvent& e = trace.events[i];
    if (e.chunk.value >= chunk_count || !e.tensor.valid() || !IsValidAccess(e.access)) {
      return Status::InvalidArgument(fmt::format(
          "trace '{}': event {} names chunk {} of tensor {}, but the registry has {} chunks",
          trace.name, i, e.chunk.value, e.tensor.value, chunk_count));
    }
  }
  return Status::Ok();
}

}  // namespace

Result<TraceCursor> TraceCursor::Create(Trace trace, size_t chunk_count,
                                        const TraceCursorOptions& options) {
  ZOE_RETURN_IF_ERROR(ValidateOptions(options));
  ZOE_RETURN_IF_ERROR(ValidateTrace(trace, chunk_count));
  return TraceCursor(std::move(trace), chunk_count, options);
}

// Positions are appended in trace order, so every list is sorted without a sort.
TraceCursor::TraceCursor(Trace trace, size_t chunk_count, const TraceCursorOptions& options)
    : trace_(std::move(trace)),
      options_(options),
      chunk_positions_(chunk_count),
      seen_stamp_(chunk_count, 0) {
  for (size_t i = 0; i < trace_.events.size(); ++i) {
    const TraceEvent& e = trace_.events[i];
    chunk_positions_[e.chunk.value].push_back(static_cast<uint32_t>(i));
    target_positions_[TargetKey(e)].push_back(static_cast<uint32_t>(i));
  }
}

uint64_t TraceCursor::Wrap(uint64_t position) const {
  if (options_.cyclic && size() > 0) return position % size();
  return std::min(position, size());
}

void TraceCursor::MoveTo(uint64_t position) { position_ = Wrap(position); }

void TraceCursor::Placed(const TraceEvent& event) {
  anchor_.reset();
  if (options_.repeat_lookback == 0) return;
  if (recent_.size() == options_.repeat_lookback) recent_.pop_front();
  recent_.push_back(TargetKey(event));
}

void TraceCursor::Restart() {
  position_ = 0;
  recent_.clear();
  anchor_.reset();
  mismatches_ = 0;
}

uint64_t TraceCursor::DistanceInList(const std::vector<uint32_t>& positions, uint64_t from) const {
  auto it = std::lower_bound(positions.begin(), positions.end(), from);
  if (it != positions.end()) return *it - from;
  if (options_.cyclic && !positions.empty() && from < size()) {
    return size() - from + positions.front();
  }
  return kNever;
}

uint64_t TraceCursor::NextOccurrence(const TraceEvent& event, uint64_t from) const {
  auto it = target_positions_.find(TargetKey(event));
  if (it == target_positions_.end()) return kNever;
  return DistanceInList(it->second, from);
}

uint64_t TraceCursor::NextUseDistance(ChunkId chunk) const {
  if (chunk.value >= chunk_positions_.size()) return kNever;
  return DistanceInList(chunk_positions_[chunk.value], position_);
}

bool TraceCursor::IsRecentRepeat(const TraceEvent& event) const {
  return std::find(recent_.begin(), recent_.end(), TargetKey(event)) != recent_.end();
}

AcquireMatch TraceCursor::OnAcquire(const TraceEvent& event) {
  if (!finished() && trace_.events[position_].SameTarget(event)) {
    MoveTo(position_ + 1);
    Placed(event);
    ++matched_;
    return AcquireMatch::kMatched;
  }
  return Mismatch(event);
}

// Steps 1-3 of the header comment, in order.
AcquireMatch TraceCursor::Mismatch(const TraceEvent& event) {
  ++mismatches_;
  if (size() == 0 || IsRecentRepeat(event)) {
    ++unmatched_;
    return AcquireMatch::kUnmatched;
  }
  const uint64_t ahead = NextOccurrence(event, position_);
  if (ahead <= options_.resync_window) {
    MoveTo(position_ + ahead + 1);
    Placed(event);
    ++resynced_;
    return AcquireMatch::kResynced;
  }
  if (anchor_) {
    const uint64_t from = Wrap(*anchor_ + 1);
    const uint64_t after_anchor = NextOccurrence(event, from);
    if (after_anchor <= options_.resync_window) {
      MoveTo(from + after_anchor + 1);
      Placed(event);
      ++resynced_;
      return AcquireMatch::kResynced;
    }
  }
  if (ahead == kNever) {
    anchor_.reset();
  } else {
    anchor_ = Wrap(position_ + ahead);
  }
  ++unmatched_;
  return AcquireMatch::kUnmatched;
}

// Walks the upcoming events once, charging each distinct chunk to the window on first sight
// (stamped, so no set is built per call), and collects those `skip` does not exclude.
std::vector<ChunkId> TraceCursor::NextPrefetches(const PrefetchLimits& limits,
                                                 const std::function<bool(ChunkId)>& skip) {
  std::vector<ChunkId> chunks;
  if (size() == 0 || limits.max_chunks == 0) return chunks;
  ++stamp_;
  const uint64_t remaining = options_.cyclic ? size() : size() - position_;
  const uint64_t horizon = std::min(remaining, options_.max_lookahead_events);
  uint64_t window = 0;
  for (uint64_t i = 0; i < horizon; ++i) {
    const TraceEvent& e = trace_.events[Wrap(position_ + i)];
    if (seen_stamp_[e.chunk.value] == stamp_) continue;
    seen_stamp_[e.chunk.value] = stamp_;
    if (limits.only_tier && e.tier != *limits.only_tier) continue;
    const uint64_t cost = limits.chunk_bytes ? limits.chunk_bytes(e.chunk) : e.bytes;
    if (cost > limits.byte_budget - window) break;
    window += cost;  // a chunk acquired to be overwritten takes its room all the same
    if (!Reads(e.access)) continue;  // its acquire overwrites it: nothing to bring in
    if (skip && skip(e.chunk)) continue;
    chunks.push_back(e.chunk);
    if (chunks.size() >= limits.max_chunks) break;
  }
  return chunks;
}

bool TraceCursor::ShouldRerecord() const {
  const auto proportional = static_cast<uint64_t>(
      std::ceil(options_.rerecord_mismatch_fraction * static_cast<double>(size())));
  const uint64_t threshold =
      std::max<uint64_t>({options_.rerecord_min_mismatches, proportional, 1});
  return mismatches_ >= threshold;
}

}  // namespace zoe::offload
