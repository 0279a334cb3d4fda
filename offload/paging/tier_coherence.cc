// The inclusive tiers: a copy in a tier above HOST (DEVICE) pins and stages through the run's HOST
// copy, so the two must stay coherent. These are the only rules that tell the cached tiers apart;
// everything else moves copies the same way in either tier. See tier_manager.h for the contract.
#include <fmt/format.h>

#include <utility>

#include "core/log.h"
#include "offload/paging/tier_manager.h"  // IWYU pragma: associated

namespace zoe::offload {

// A copy above taken now would miss the writes still to come through these acquires, and copying
// it back later would undo them.
bool TierManager::HasWriterIn(const Run& run, Tier tier) const {
  for (TensorId tensor : run.tensors) {
    for (const Acquired& acquired : tensors_[tensor.value].acquired) {
      if (acquired.tier == tier && Writes(acquired.access)) return true;
    }
  }
  return false;
}

// An acquire of a run a copy above holds must see that copy's bytes (copy back when dirty), and a
// write must not leave a stale copy above behind (drop it).
bool TierManager::NeedsUpperSync(const Run& run, Tier tier, Access access) const {
  const std::optional<Tier> above = CachedTierAbove(tier);
  if (!above) return false;
  const TierCopy& upper = run.copy(*above);
  if (upper.state == CopyState::kAbsent) return false;
  return upper.state != CopyState::kResident || upper.dirty || Writes(access);
}

Status TierManager::SyncUpperForAcquire(std::unique_lock<std::mutex>& lock, size_t run_index,
                                        Tier tier, Access access, const std::string& name) {
  const Tier above = *CachedTierAbove(tier);  // NeedsUpperSync found a copy there
  const TierCopy& upper = runs_[run_index].copy(above);
  if (upper.state != CopyState::kResident) return FinishTransfer(lock, run_index, above);
  if (upper.pinned() > 0) {
    return Status::FailedPrecondition(fmt::format(
        "tensor '{}' shares {} with tensors acquired on the {}{}; release them there before "
        "acquiring it on the {} for {}",
        name, Describe(runs_[run_index]), TierName(above), upper.dirty ? " for writing" : "",
        TierName(tier), AccessName(access)));
  }
  if (Writes(access)) return StartEviction(run_index, above);
  return StartWriteBack(run_index, above, AfterWrite::kStay);
}

// Evicts the victim of the tier above (copying it back first when dirty) and waits for that, so
// its copy in `tier` loses the pin it held.
Status TierManager::EvictUpperCopy(std::unique_lock<std::mutex>& lock, Tier tier, bool* unpinned) {
  *unpinned = false;
  const std::optional<Tier> above = CachedTierAbove(tier);
  if (!above || !HasTier(*above)) return Status::Ok();
  Result<ChunkId> victim = slot(*above).policy.ChooseVictim();
  if (!victim.ok()) return Status::Ok();
  const size_t run_index = run_of_chunk_[victim->value];
  ZOE_RETURN_IF_ERROR(StartEviction(run_index, *above));
  while (runs_[run_index].copy(*above).state == CopyState::kWritingBack)
    ZOE_RETURN_IF_ERROR(FinishTransfer(lock, run_index, *above));
  *unpinned = true;
  return Status::Ok();
}

// Below HOST: NVMe now holds the run. Below DEVICE: the HOST copy holds bytes NVMe does not; if
// it was being written meanwhile, that write may hold some of the old bytes.
Status TierManager::MarkWrittenBelow(size_t run_index, Tier tier) {
  Run& run = runs_[run_index];
  const std::optional<Tier> below = CachedTierBelow(tier);
  if (!below) {
    run.on_nvme = true;
    return Status::Ok();
  }
  TierCopy& lower = run.copy(*below);
  if (lower.state == CopyState::kWritingBack) lower.pending.source_changed = true;
  return MarkDirty(run_index, *below);
}

LowerCopy TierManager::LowerOf(Run& run) {
  return LowerCopy{run.extent.offset, run.copy(Tier::kHost).memory.host_span(run.bytes)};
}

}  // namespace zoe::offload
