// Moving copies of runs between a cached tier and the tier below it: loads, write-backs,
// eviction, back-pressure and applying finished transfers. One code path for HOST and DEVICE;
// every state change goes through TierCopy::Apply (tier_residency.h). See tier_manager.h for the
// contract.
#include <fmt/format.h>

#include <cstring>
#include <utility>

#include "core/log.h"
#include "offload/paging/tier_manager.h"  // IWYU pragma: associated

namespace zoe::offload {
namespace {

// How each tier's transfers are named in errors and counted in the statistics.
std::string_view LoadVerb(Tier tier) { return tier == Tier::kDevice ? "copy to device" : "read"; }
std::string_view WriteVerb(Tier tier) {
  return tier == Tier::kDevice ? "copy from device" : "write back";
}
Link LoadLink(Tier tier) { return tier == Tier::kDevice ? Link::kHostToDevice : Link::kNvmeToHost; }
Link WriteLink(Tier tier) {
  return tier == Tier::kDevice ? Link::kDeviceToHost : Link::kHostToNvme;
}

void LogIfRefused(const Status& applied) {
  if (!applied.ok()) ZOE_LOG_ERROR("tier manager: {}", applied.ToString());
}

// The configuration key that sets a tier's budget, as a Busy error names it.
std::string_view BudgetSetting(Tier tier) {
  return tier == Tier::kDevice
             ? "zoe.device_budget"
             : "zoe.tensor_host_budget (by default half of zoe.host_budget; paged parameters, "
               "offloaded activations and device staging all take from it)";
}

}  // namespace

// Back-pressure. Evicts unpinned copies (by the tier's policy) until the bytes being freed cover
// the shortfall, then waits for those write-backs. When every copy in the tier is pinned, evicts
// an unpinned copy above it, which gives back its pin. With nothing evictable and nothing in
// flight, only a Release can help: waits for one, at most busy_timeout.
Status TierManager::Reserve(std::unique_lock<std::mutex>& lock, Tier tier, uint64_t bytes,
                            std::string_view who) {
  Budget& budget = *slot(tier).budget;
  Clock::time_point deadline = Clock::now() + options_.busy_timeout;
  for (;;) {
    Status reserved = budget.TryReserve(bytes);
    if (reserved.ok() || reserved.code() == StatusCode::kOutOfMemory) return reserved;
    bool progressed = false;
    ZOE_RETURN_IF_ERROR(ReserveStep(lock, tier, bytes, &progressed));
    if (progressed) {
      deadline = Clock::now() + options_.busy_timeout;
      continue;
    }
    ++waiting_;
    const std::cv_status woken = changed_.wait_until(lock, deadline);
    --waiting_;
    if (woken == std::cv_status::timeout && budget.available() < bytes &&
        !slot(tier).policy.ChooseVictim().ok()) {
      return BusyError(tier, bytes, who);
    }
  }
}

// One attempt to free bytes: finish a transfer in flight (when that is enough, or nothing is
// evictable), else evict a victim, else evict a copy above. `*progressed` is false when none
// applied.
Status TierManager::ReserveStep(std::unique_lock<std::mutex>& lock, Tier tier, uint64_t bytes,
                                bool* progressed) {
  *progressed = true;
  uint64_t freeing = 0;
  for (const Run& run : runs_) {
    const TierCopy& copy = run.copy(tier);
    if (copy.state == CopyState::kWritingBack && copy.pending.then == AfterWrite::kEvict)
      freeing += run.bytes;
  }
  Result<ChunkId> victim = slot(tier).policy.ChooseVictim();
  const bool enough_in_flight = slot(tier).budget->available() + freeing >= bytes;
  Status finished;
  if (!(victim.ok() && !enough_in_flight) && FinishAnyTransfer(lock, tier, &finished))
    return finished;
  if (victim.ok()) return StartEviction(run_of_chunk_[victim->value], tier);
  return EvictUpperCopy(lock, tier, progressed);
}

Status TierManager::BusyError(Tier tier, uint64_t bytes, std::string_view who) const {
  const Budget& budget = *slot(tier).budget;
  return Status::Busy(fmt::format(
      "'{}' needs {} bytes of {} memory but {} of {} bytes are held by pinned chunks and none was "
      "released for {} ms; release tensors or raise the {} budget: {}",
      who, bytes, TierName(tier), budget.reserved(), budget.capacity(),
      std::chrono::duration_cast<std::chrono::milliseconds>(options_.busy_timeout).count(),
      TierName(tier), BudgetSetting(tier)));
}

// A run never written to NVMe starts as zeros in HOST; a pure write of a run's only tensor needs
// no read; anything else is copied in from the tier below.
Status TierManager::StartLoad(size_t run_index, Tier tier, Access access) {
  Run& run = runs_[run_index];
  TierCopy& copy = run.copy(tier);
  Result<TierMemory> memory = slot(tier).backend->Allocate(run.bytes);
  if (!memory.ok()) {
    GiveBackReservation(run_index, tier);
    return std::move(memory).status();
  }
  copy.memory = std::move(memory).value();
  stats_.AddOccupancy(tier, run.bytes);
  const bool lowest = !CachedTierBelow(tier);
  const bool overwritten = access == Access::kWrite && run.tensors.size() == 1;
  if (lowest && (!run.on_nvme || overwritten)) return FillWithoutRead(run_index, tier);
  Result<Transfer> transfer = slot(tier).backend->CopyIn(LowerOf(run), copy.memory, run.bytes);
  if (!transfer.ok()) {
    ReleaseCopyMemory(run_index, tier);
    return std::move(transfer).status().WithContext(
        fmt::format("{} {}", LoadVerb(tier), Describe(run)));
  }
  copy.pending =
      PendingTransfer{.transfer = std::move(transfer).value(), .origin = Origin::kDemand};
  return copy.Apply(CopyEvent::kLoadStarted);
}

Status TierManager::FillWithoutRead(size_t run_index, Tier tier) {
  Run& run = runs_[run_index];
  TierCopy& copy = run.copy(tier);
  if (!run.on_nvme) std::memset(copy.memory.data(), 0, run.bytes);
  ZOE_RETURN_IF_ERROR(copy.Apply(CopyEvent::kFilled));
  return slot(tier).policy.Insert(run.first_chunk, false);
}

Status TierManager::StartWriteBack(size_t run_index, Tier tier, AfterWrite then) {
  Run& run = runs_[run_index];
  TierCopy& copy = run.copy(tier);
  Result<Transfer> transfer = slot(tier).backend->CopyOut(copy.memory, LowerOf(run), run.bytes);
  if (!transfer.ok()) {
    return std::move(transfer).status().WithContext(
        fmt::format("{} {}", WriteVerb(tier), Describe(run)));
  }
  copy.pending = PendingTransfer{
      .transfer = std::move(transfer).value(), .origin = Origin::kDemand, .then = then};
  return copy.Apply(CopyEvent::kWriteStarted);
}

Status TierManager::StartEviction(size_t run_index, Tier tier) {
  Run& run = runs_[run_index];
  TierCopy& copy = run.copy(tier);
  EvictionPolicy& policy = slot(tier).policy;
  ZOE_RETURN_IF_ERROR(policy.Remove(run.first_chunk));
  if (copy.state == CopyState::kWritingBack) {  // a flush is writing it: free it when done
    copy.pending.then = AfterWrite::kEvict;
    return Status::Ok();
  }
  if (!copy.dirty) {
    FreeCopy(run_index, tier, CopyEvent::kFreed);
    stats_.AddEviction(tier, false);
    return Status::Ok();
  }
  Status started = StartWriteBack(run_index, tier, AfterWrite::kEvict);
  if (!started.ok()) {
    Status restored = policy.Insert(run.first_chunk, true);
    (void)restored;
  }
  return started;
}

void TierManager::FreeCopy(size_t run_index, Tier tier, CopyEvent event) {
  LogIfRefused(runs_[run_index].copy(tier).Apply(event));
  ReleaseCopyMemory(run_index, tier);
}

// Gives back the copy's memory and bytes; a hint waiting above for this copy is dropped, and the
// pin this copy held below is released (which wakes waiters).
void TierManager::ReleaseCopyMemory(size_t run_index, Tier tier) {
  Run& run = runs_[run_index];
  TierCopy& copy = run.copy(tier);
  slot(tier).backend->Free(run.bytes, std::move(copy.memory));
  copy.memory = TierMemory();
  copy.dirty = false;
  Status released = slot(tier).budget->Release(run.bytes);
  Status subtracted = stats_.SubtractOccupancy(tier, run.bytes);
  if (!released.ok() || !subtracted.ok()) {
    ZOE_LOG_ERROR("tier manager: {} accounting broken: {} {}", TierName(tier), released.ToString(),
                  subtracted.ToString());
  }
  if (const std::optional<Tier> above = CachedTierAbove(tier)) run.copy(*above).wanted = {};
  if (const std::optional<Tier> below = CachedTierBelow(tier))
    Unpin(run_index, *below, Tenant::kUpperCopy);
  changed_.notify_all();  // wakes Reserve waiters
}

void TierManager::GiveBackReservation(size_t run_index, Tier tier) {
  Status released = slot(tier).budget->Release(runs_[run_index].bytes);
  (void)released;
  if (const std::optional<Tier> below = CachedTierBelow(tier))
    Unpin(run_index, *below, Tenant::kUpperCopy);
  changed_.notify_all();  // the bytes may be what another Reserve waits for
}

// Exactly one thread waits on a transfer (claiming it); the others sleep on the condition
// variable until that thread has applied the outcome.
Status TierManager::FinishTransfer(std::unique_lock<std::mutex>& lock, size_t run_index,
                                   Tier tier) {
  TierCopy& copy = runs_[run_index].copy(tier);
  if (copy.pending.claimed()) {
    changed_.wait(lock);
    return Status::Ok();
  }
  copy.pending.waiter = std::this_thread::get_id();
  const Transfer transfer = copy.pending.transfer;
  lock.unlock();
  Status outcome = slot(tier).backend->Wait(transfer);
  lock.lock();
  return ApplyTransfer(run_index, tier, std::move(outcome));
}

Status TierManager::ApplyTransfer(size_t run_index, Tier tier, Status outcome) {
  changed_.notify_all();
  if (runs_[run_index].copy(tier).state == CopyState::kLoading)
    return ApplyLoad(run_index, tier, std::move(outcome));
  return ApplyWrite(run_index, tier, std::move(outcome));
}

Status TierManager::ApplyLoad(size_t run_index, Tier tier, Status outcome) {
  Run& run = runs_[run_index];
  if (!outcome.ok()) {
    FreeCopy(run_index, tier, CopyEvent::kLoadFailed);
    return std::move(outcome).WithContext(fmt::format("{} {}", LoadVerb(tier), Describe(run)));
  }
  ZOE_RETURN_IF_ERROR(run.copy(tier).Apply(CopyEvent::kLoaded));
  stats_.AddTransfer(LoadLink(tier), run.bytes);
  ZOE_RETURN_IF_ERROR(slot(tier).policy.Insert(run.first_chunk, false));
  const std::optional<Tier> above = CachedTierAbove(tier);
  if (above && run.copy(*above).wanted == Origin::kHint) StartWantedCopy(run_index, *above);
  return Status::Ok();
}

// A failed write-back keeps the copy resident and dirty: it is the only current one.
Status TierManager::ApplyWrite(size_t run_index, Tier tier, Status outcome) {
  Run& run = runs_[run_index];
  TierCopy& copy = run.copy(tier);
  EvictionPolicy& policy = slot(tier).policy;
  const AfterWrite then = copy.pending.then;
  const bool changed = copy.pending.source_changed;
  if (!outcome.ok()) {
    copy.write_error = outcome;
    ZOE_RETURN_IF_ERROR(copy.Apply(CopyEvent::kWriteFailed));
    if (!policy.Contains(run.first_chunk))
      ZOE_RETURN_IF_ERROR(policy.Insert(run.first_chunk, true));
    return std::move(outcome).WithContext(fmt::format("{} {}", WriteVerb(tier), Describe(run)));
  }
  ZOE_RETURN_IF_ERROR(copy.Apply(CopyEvent::kWritten));
  copy.dirty = changed;  // the tier below may hold a mix of old and new bytes: write it again
  copy.write_error = Status::Ok();
  ZOE_RETURN_IF_ERROR(MarkWrittenBelow(run_index, tier));
  stats_.AddTransfer(WriteLink(tier), run.bytes);
  if (then == AfterWrite::kEvict && !changed) {
    FreeCopy(run_index, tier, CopyEvent::kFreed);
    stats_.AddEviction(tier, true);
    return Status::Ok();
  }
  if (policy.Contains(run.first_chunk)) return policy.MarkDirty(run.first_chunk, changed);
  return policy.Insert(run.first_chunk, changed);
}

// Prefers write-backs that free memory, then loads nobody waits for (prefetches); a transfer
// another thread already waits on is waited for through the condition variable. Only a
// write-back's failure is returned: a failed load frees its memory all the same, and its error
// belongs to the acquire of that run, not to the caller.
bool TierManager::FinishAnyTransfer(std::unique_lock<std::mutex>& lock, Tier tier,
                                    Status* outcome) {
  size_t chosen = runs_.size();
  bool any_claimed = false;
  for (size_t i = 0; i < runs_.size(); ++i) {
    const TierCopy& copy = runs_[i].copy(tier);
    if (!copy.in_flight()) continue;
    if (copy.pending.claimed()) {
      any_claimed = true;
      continue;
    }
    const bool frees = copy.pending.then == AfterWrite::kEvict;
    if (chosen == runs_.size() || frees) chosen = i;
    if (frees) break;
  }
  if (chosen == runs_.size()) {
    if (any_claimed) changed_.wait(lock);
    return any_claimed;
  }
  const bool load = runs_[chosen].copy(tier).state == CopyState::kLoading;
  Status finished = FinishTransfer(lock, chosen, tier);
  if (load && !finished.ok()) {  // the run is absent again and its own acquire reports it
    ZOE_LOG_WARN("tier manager: {}", finished.ToString());
    runs_[chosen].copy(tier).load_error = std::exchange(finished, Status::Ok());
  }
  *outcome = std::move(finished);
  return true;
}

}  // namespace zoe::offload
