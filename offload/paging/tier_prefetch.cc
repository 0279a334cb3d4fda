// Trace recording and replay, and prefetch into the cached tiers: the hint (Prefetch), the
// look-ahead of a replayed trace, and applying prefetches nobody waits for. See tier_manager.h for
// the contract.
#include <fmt/format.h>

#include <algorithm>
#include <utility>

#include "core/log.h"
#include "offload/paging/tier_manager.h"  // IWYU pragma: associated

namespace zoe::offload {

// ---- hints ----------------------------------------------------------------------------------

Status TierManager::Prefetch(TensorId tensor, Tier tier) {
  std::lock_guard lock(mutex_);
  ZOE_ASSIGN_OR_RETURN(const TensorEntry* entry, Entry(tensor));
  if (!IsValidTier(tier))
    return Status::InvalidArgument("prefetch: tier must be device, host or nvme");
  // NVMe always holds the run; without a device tier a DEVICE hint has nowhere to go.
  if (tier == Tier::kNvme || !HasTier(tier)) return Status::Ok();
  const std::string context = fmt::format("prefetch tensor '{}'", entry->desc.name);
  return HintCopy(tensors_[tensor.value].run, tier).WithContext(context);
}

// Starts the copy into `tier` when the tier below holds the run and `tier` has room without
// evicting; otherwise asks the tier below first, and the copy follows its load (`wanted`).
Status TierManager::HintCopy(size_t run_index, Tier tier) {
  Run& run = runs_[run_index];
  if (run.copy(tier).state != CopyState::kAbsent) return Status::Ok();
  const std::optional<Tier> below = CachedTierBelow(tier);
  if (below && HasWriterIn(run, *below)) return Status::Ok();
  if (!below || run.copy(*below).state == CopyState::kResident) {
    CollectPrefetches(tier, runs_.size());
    if (!slot(tier).budget->TryReserve(run.bytes).ok()) return Status::Ok();
    return StartPrefetch(run_index, tier);
  }
  run.copy(tier).wanted = Origin::kHint;
  Status hinted = HintCopy(run_index, *below);
  // The tier below had no room: nothing will follow.
  if (runs_[run_index].copy(*below).state == CopyState::kAbsent)
    runs_[run_index].copy(tier).wanted = Origin::kNone;
  return hinted;
}

// A copy above HOST holds a pin on the HOST copy for as long as it exists (StartLoad gives it
// back, with the bytes, when the copy cannot start).
Status TierManager::StartPrefetch(size_t run_index, Tier tier) {
  runs_[run_index].copy(tier).wanted = Origin::kNone;
  if (const std::optional<Tier> below = CachedTierBelow(tier))
    Pin(run_index, *below, Tenant::kUpperCopy);
  ZOE_RETURN_IF_ERROR(StartLoad(run_index, tier, Access::kRead));
  TierCopy& copy = runs_[run_index].copy(tier);
  if (copy.state == CopyState::kLoading) {
    copy.pending.origin = Origin::kPrefetch;
    slot(tier).prefetching.push_back(run_index);
  }
  stats_.AddPrefetchIssued();
  return Status::Ok();
}

void TierManager::StartWantedCopy(size_t run_index, Tier tier) {
  Run& run = runs_[run_index];
  run.copy(tier).wanted = Origin::kNone;
  const std::optional<Tier> below = CachedTierBelow(tier);
  if (!HasTier(tier) || run.copy(tier).state != CopyState::kAbsent) return;
  if (below && HasWriterIn(run, *below)) return;
  if (!slot(tier).budget->TryReserve(run.bytes).ok()) return;
  Status started = StartPrefetch(run_index, tier);
  if (!started.ok())
    ZOE_LOG_DEBUG("tier manager: {} prefetch not started: {}", TierName(tier), started.ToString());
}

// ---- traces ---------------------------------------------------------------------------------

Status TierManager::TraceBegin(std::string_view name) {
  std::lock_guard lock(mutex_);
  if (open_iteration_) {
    return Status::FailedPrecondition(
        fmt::format("trace_begin '{}': an iteration is already open; call trace_end first", name));
  }
  Result<const Trace*> known = traces_.Find(name);
  const bool replaying_it = cursor_ && cursor_->trace().name == name;
  const bool rerecord = replaying_it && cursor_->ShouldRerecord();
  if (known.ok() && !rerecord) {
    if (replaying_it) {
      cursor_->Restart();
    } else {
      ZOE_RETURN_IF_ERROR(StartReplay(**known));
    }
  } else {
    if (rerecord) {
      ZOE_LOG_INFO("tier manager: re-recording trace '{}' after {} mismatches in one iteration",
                   name, cursor_->mismatches_this_iteration());
    }
    ZOE_RETURN_IF_ERROR(traces_.Begin(name, layout_.Fingerprint()));
    ForgetReplay();
  }
  open_iteration_ = true;
  return Status::Ok();
}

Status TierManager::TraceEnd() {
  std::lock_guard lock(mutex_);
  if (!open_iteration_) return Status::FailedPrecondition("trace_end: no trace_begin is open");
  open_iteration_ = false;
  if (!traces_.recording()) return Status::Ok();
  ZOE_ASSIGN_OR_RETURN(const Trace* trace, traces_.End());
  return StartReplay(*trace);
}

bool TierManager::trace_recording() const {
  std::lock_guard lock(mutex_);
  return traces_.recording();
}

Status TierManager::StartReplay(const Trace& trace) {
  ZOE_ASSIGN_OR_RETURN(TraceCursor cursor,
                       TraceCursor::Create(trace, layout_.chunk_count(), options_.trace_cursor));
  cursor_.emplace(std::move(cursor));
  if (options_.eviction == EvictionKind::kLru) return Status::Ok();
  const auto next_use = [this](ChunkId chunk) { return NextUseOfRun(run_of_chunk_[chunk.value]); };
  for (TierSlot& tier : tiers_) tier.policy.SetNextUse(next_use);
  return Status::Ok();
}

void TierManager::ForgetReplay() {
  cursor_.reset();
  for (TierSlot& tier : tiers_) tier.policy.SetNextUse({});
}

Status TierManager::TraceSave(std::string_view name, const std::string& path) const {
  std::unique_lock lock(mutex_);
  ZOE_ASSIGN_OR_RETURN(const Trace* trace, traces_.Find(name));
  const Trace copy = *trace;
  lock.unlock();
  return SaveTrace(copy, path);
}

Result<std::string> TierManager::TraceLoad(const std::string& path) {
  std::unique_lock lock(mutex_);
  const uint64_t fingerprint = layout_.Fingerprint();
  lock.unlock();
  ZOE_ASSIGN_OR_RETURN(Trace trace, LoadTrace(path, fingerprint));
  std::string name = trace.name;
  lock.lock();
  if (layout_.Fingerprint() != fingerprint)
    return Status::FailedPrecondition("trace_load " + path + ": tensors were registered meanwhile");
  ZOE_RETURN_IF_ERROR(traces_.Insert(std::move(trace)));
  return name;
}

// The nearest next use of any chunk of the run: a run is needed as soon as one of its chunks is.
uint64_t TierManager::NextUseOfRun(size_t run_index) const {
  if (!cursor_) return 0;
  const Run& run = runs_[run_index];
  const uint64_t chunks = run.bytes / layout_.options().chunk_bytes;
  uint64_t nearest = TraceCursor::kNever;
  for (uint64_t c = 0; c < chunks; ++c) {
    const ChunkId chunk(static_cast<uint32_t>(run.first_chunk.value + c));
    nearest = std::min(nearest, cursor_->NextUseDistance(chunk));
  }
  return nearest;
}

// Only acquires inside TraceBegin/TraceEnd are the iteration's: one between iterations (an
// optimizer step, a checkpoint) is not in the trace, and matching it would move the cursor to
// where its chunk last appeared and prefetch from there. The cursor stays at the iteration's end,
// so eviction meanwhile still ranks runs by their use in the next iteration.
void TierManager::AdvanceTrace(TensorId tensor, Access access, Tier tier, size_t acquiring_run) {
  if (!open_iteration_ || (!traces_.recording() && !cursor_)) return;
  Result<std::vector<TraceEvent>> events = EventsForAcquire(layout_, tensor, access, tier);
  if (!events.ok()) return;
  if (traces_.recording()) {
    for (const TraceEvent& event : *events) {
      Status recorded = traces_.Record(event);
      if (!recorded.ok() && !warned_trace_full_) {
        ZOE_LOG_WARN("tier manager: {}", recorded.ToString());
        warned_trace_full_ = true;
      }
    }
    return;
  }
  for (const TraceEvent& event : *events) CountMatch(cursor_->OnAcquire(event));
  // HOST first: a copy above can only start from a run resident on HOST.
  for (auto tier_it = kCopyTiers.rbegin(); tier_it != kCopyTiers.rend(); ++tier_it)
    IssuePrefetches(*tier_it, acquiring_run);
}

void TierManager::CountMatch(AcquireMatch match) {
  switch (match) {
    case AcquireMatch::kMatched:
      stats_.AddTraceMatched();
      break;
    case AcquireMatch::kResynced:
      stats_.AddTraceResynced();
      break;
    case AcquireMatch::kUnmatched:
      stats_.AddTraceUnmatched();
      break;
  }
}

// ---- look-ahead -----------------------------------------------------------------------------

// Applies prefetches that finished and nobody waits for; a failed one leaves its copy absent with
// the error, which the next acquire of the run in that tier reports. Forgets prefetches that
// became demand transfers or were applied elsewhere.
void TierManager::CollectPrefetches(Tier tier, size_t acquiring_run) {
  std::erase_if(slot(tier).prefetching, [this, tier, acquiring_run](size_t run_index) {
    TierCopy& copy = runs_[run_index].copy(tier);
    if (copy.pending.origin != Origin::kPrefetch) return true;
    if (copy.pending.claimed() || run_index == acquiring_run) return false;
    std::optional<Status> outcome = slot(tier).backend->Poll(copy.pending.transfer);
    if (!outcome) return false;
    Status applied = ApplyTransfer(run_index, tier, std::move(*outcome));
    if (!applied.ok()) {
      ZOE_LOG_DEBUG("tier manager: {} prefetch failed: {}", TierName(tier), applied.ToString());
      runs_[run_index].copy(tier).load_error = std::move(applied);
    }
    return true;
  });
}

// HOST looks ahead over every upcoming event (any acquire needs HOST first); a tier above it only
// over the events acquired in it, within its budget.
PrefetchLimits TierManager::LookAheadLimits(Tier tier) const {
  PrefetchLimits limits;
  limits.byte_budget = options_.lookahead_bytes;
  limits.max_chunks = options_.prefetch_in_flight - slot(tier).prefetching.size();
  limits.chunk_bytes = [this](ChunkId) { return layout_.options().chunk_bytes; };
  if (CachedTierBelow(tier)) {
    limits.byte_budget = std::min(limits.byte_budget, slot(tier).budget->capacity());
    limits.only_tier = tier;
  }
  return limits;
}

// Walks the look-ahead window of the trace in order of first use and starts copies into `tier`
// of absent runs while the in-flight limit and the budget (possibly after evicting clean copies
// needed later) allow. Stops at the first run that cannot be placed, or (above HOST) whose HOST
// copy is not resident yet, so prefetches stay in trace order; the next acquire resumes there.
void TierManager::IssuePrefetches(Tier tier, size_t acquiring_run) {
  if (!HasTier(tier) || !cursor_) return;
  CollectPrefetches(tier, acquiring_run);
  if (slot(tier).prefetching.size() >= options_.prefetch_in_flight) return;
  const auto present = [this, tier](ChunkId chunk) {
    return runs_[run_of_chunk_[chunk.value]].copy(tier).state != CopyState::kAbsent;
  };
  const std::optional<Tier> below = CachedTierBelow(tier);
  for (ChunkId chunk : cursor_->NextPrefetches(LookAheadLimits(tier), present)) {
    const size_t run_index = run_of_chunk_[chunk.value];
    const Run& run = runs_[run_index];
    if (run.copy(tier).state != CopyState::kAbsent) continue;  // an earlier chunk of its run
    if (below && (run.copy(*below).state != CopyState::kResident || HasWriterIn(run, *below)))
      return;
    if (!ReserveForPrefetch(run_index, tier, cursor_->NextUseDistance(chunk))) return;
    Status started = StartPrefetch(run_index, tier);
    if (!started.ok()) {
      ZOE_LOG_DEBUG("tier manager: {} prefetch not started: {}", TierName(tier),
                    started.ToString());
      return;
    }
  }
}

bool TierManager::ReserveForPrefetch(size_t run_index, Tier tier, uint64_t distance) {
  const uint64_t bytes = runs_[run_index].bytes;
  for (;;) {
    if (slot(tier).budget->TryReserve(bytes).ok()) return true;
    Result<ChunkId> victim = slot(tier).policy.ChooseVictim();
    if (!victim.ok()) return false;
    const size_t victim_run = run_of_chunk_[victim->value];
    const TierCopy& candidate = runs_[victim_run].copy(tier);
    if (candidate.state != CopyState::kResident || candidate.dirty ||
        NextUseOfRun(victim_run) <= distance) {
      return false;
    }
    if (!StartEviction(victim_run, tier).ok()) return false;
  }
}

}  // namespace zoe::offload
