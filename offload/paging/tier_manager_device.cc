// The device tier of TierManager: acquire on DEVICE, device back-pressure and eviction, and keeping
// the device copy coherent with the HOST copy. See tier_manager.h for the contract; the device tier
// is inclusive (a device-resident run keeps its HOST copy resident and pinned).
#include <fmt/format.h>

#include <algorithm>
#include <utility>

#include "core/log.h"
#include "offload/paging/tier_manager.h"  // IWYU pragma: associated

namespace zoe::offload {

Result<void*> TierManager::AcquireDevice(TensorId tensor, Access access) {
  if (!device_) {
    return Status::NotSupported(
        "acquire: no device tier is configured (set device_backend); acquire on the host tier");
  }
  std::unique_lock lock(mutex_);
  ZOE_ASSIGN_OR_RETURN(const TensorEntry* entry, Entry(tensor));
  const std::string name = entry->desc.name;
  const size_t run_index = tensors_[tensor.value].run;
  const Clock::time_point start = Clock::now();
  Progress progress;
  if (!runs_[run_index].device_copy_error.ok()) {
    return std::exchange(runs_[run_index].device_copy_error, {})
        .WithContext(fmt::format("acquire tensor '{}' on the device", name));
  }
  for (;;) {
    Run& run = runs_[run_index];
    if (run.device == Residency::kResident) break;
    if (run.device == Residency::kAbsent && !run.device_copy_error.ok()) {  // finished elsewhere
      return std::exchange(run.device_copy_error, {})
          .WithContext(fmt::format("acquire tensor '{}' on the device", name));
    }
    if (!progress.advanced && run.device == Residency::kLoading) {  // prefetched meanwhile
      run.device_prefetch_pending = false;  // a demand copy now: out of the in-flight limit
      AdvanceTrace(tensor, access, Tier::kDevice, run_index);
      progress.advanced = true;
      continue;
    }
    progress.waited = true;
    Status step = run.device == Residency::kAbsent
                      ? LoadToDevice(lock, tensor, access, name, &progress)
                      : FinishDeviceCopy(lock, run_index);
    if (!step.ok()) {
      return std::move(step).WithContext(fmt::format("acquire tensor '{}' on the device", name));
    }
  }
  Run& run = runs_[run_index];
  ++run.device_pins;
  ZOE_RETURN_IF_ERROR(device_policy_.Pin(run.first_chunk));
  if (Writes(access)) {
    run.device_dirty = true;
    ZOE_RETURN_IF_ERROR(device_policy_.MarkDirty(run.first_chunk, true));
  }
  void* data =
      static_cast<std::byte*>(run.device_memory.data()) + tensors_[tensor.value].run_offset;
  FinishAcquire(tensor, access, Tier::kDevice, start, &progress);
  return data;
}

// HOST first (the staging copy, pinned for as long as the device holds the run), then device
// memory, then the copy. Any failure leaves the run as it was on the device (absent).
Status TierManager::LoadToDevice(std::unique_lock<std::mutex>& lock, TensorId tensor, Access access,
                                 const std::string& name, Progress* progress) {
  ZOE_RETURN_IF_ERROR(BringToHost(lock, tensor, access, name, progress, HostUse::kDeviceStaging));
  const size_t run_index = tensors_[tensor.value].run;
  if (runs_[run_index].device != Residency::kAbsent) return Status::Ok();
  if (HasHostWriter(runs_[run_index])) {
    return Status::FailedPrecondition(fmt::format(
        "tensor '{}' shares {} with tensors acquired on the host for writing; release them there "
        "before acquiring it on the device",
        name, Describe(runs_[run_index])));
  }
  PinHostRun(run_index);
  Status reserved = ReserveDevice(lock, runs_[run_index].bytes, name);
  if (reserved.ok() && runs_[run_index].device != Residency::kAbsent) {
    reserved = device_budget_->Release(runs_[run_index].bytes);  // loaded by another thread
    UnpinHostRun(run_index);
    return reserved;
  }
  if (!reserved.ok()) {
    UnpinHostRun(run_index);
    return reserved;
  }
  progress->loaded = true;
  return StartDeviceLoad(run_index);
}

// Requires reserved device bytes and a HOST pin; gives both back on failure.
Status TierManager::StartDeviceLoad(size_t run_index) {
  Run& run = runs_[run_index];
  Result<DeviceAllocation> memory = TakeDeviceMemory(run.bytes);
  if (!memory.ok()) {
    Status released = device_budget_->Release(run.bytes);
    (void)released;
    UnpinHostRun(run_index);
    return std::move(memory).status();
  }
  run.device_memory = std::move(memory).value();
  stats_.AddOccupancy(Tier::kDevice, run.bytes);
  Result<DeviceEvent> copy = device_queue_->CopyToDevice(run.memory.span().first(run.bytes),
                                                         DeviceRange{&run.device_memory, 0});
  if (!copy.ok()) {
    FreeDevice(run_index);
    return std::move(copy).status().WithContext("copy to device " + Describe(run));
  }
  run.device = Residency::kLoading;
  run.device_event = std::move(copy).value();
  run.device_event_claimed = false;
  return Status::Ok();
}

Status TierManager::StartDeviceWriteBack(size_t run_index, bool evict_after) {
  Run& run = runs_[run_index];
  Result<DeviceEvent> copy = device_queue_->CopyToHost(DeviceRange{&run.device_memory, 0},
                                                       run.memory.span().first(run.bytes));
  if (!copy.ok()) return std::move(copy).status().WithContext("copy from device " + Describe(run));
  run.device = Residency::kWritingBack;
  run.device_event = std::move(copy).value();
  run.device_event_claimed = false;
  run.device_evict_after = evict_after;
  return Status::Ok();
}

Status TierManager::StartDeviceEviction(size_t run_index) {
  Run& run = runs_[run_index];
  ZOE_RETURN_IF_ERROR(device_policy_.Remove(run.first_chunk));
  if (run.device == Residency::kWritingBack) {  // a flush is copying it: free it when done
    run.device_evict_after = true;
    return Status::Ok();
  }
  if (!run.device_dirty) {
    FreeDevice(run_index);
    stats_.AddEviction(Tier::kDevice, false);
    return Status::Ok();
  }
  Status started = StartDeviceWriteBack(run_index, true);
  if (!started.ok()) {
    Status restored = device_policy_.Insert(run.first_chunk, true);
    (void)restored;
  }
  return started;
}

void TierManager::FreeDevice(size_t run_index) {
  Run& run = runs_[run_index];
  KeepDeviceMemory(run.bytes, std::move(run.device_memory));
  run.device_memory = DeviceAllocation();
  run.device = Residency::kAbsent;
  run.device_dirty = false;
  Status released = device_budget_->Release(run.bytes);
  Status subtracted = stats_.SubtractOccupancy(Tier::kDevice, run.bytes);
  if (!released.ok() || !subtracted.ok()) {
    ZOE_LOG_ERROR("tier manager: device accounting broken: {} {}", released.ToString(),
                  subtracted.ToString());
  }
  UnpinHostRun(run_index);  // also wakes waiters
}

Result<DeviceAllocation> TierManager::TakeDeviceMemory(uint64_t bytes) {
  for (auto it = spare_device_.begin(); it != spare_device_.end(); ++it) {
    if (it->first != bytes) continue;
    DeviceAllocation memory = std::move(it->second);
    spare_device_.erase(it);
    return memory;
  }
  Result<DeviceAllocation> memory = device_->Allocate(bytes);
  if (memory.ok() || spare_device_.empty()) return memory;
  spare_device_.clear();  // spares of other sizes hold the device's capacity
  return device_->Allocate(bytes);
}

void TierManager::KeepDeviceMemory(uint64_t bytes, DeviceAllocation memory) {
  if (!memory.empty()) spare_device_.emplace_back(bytes, std::move(memory));
}

bool TierManager::SkipsWait(DeviceWait wait) const {
  return (options_.skipped_device_waits_for_testing & static_cast<uint8_t>(wait)) != 0;
}

// One thread waits on the event and applies it; the others wait for that on the condition
// variable, exactly as for I/O tickets.
Status TierManager::FinishDeviceCopy(std::unique_lock<std::mutex>& lock, size_t run_index) {
  Run& run = runs_[run_index];
  if (run.device_event_claimed) {
    changed_.wait(lock);
    return Status::Ok();
  }
  run.device_event_claimed = true;
  const DeviceEvent event = run.device_event;
  lock.unlock();
  Status outcome = SkipsWait(DeviceWait::kDemandCopy) ? Status::Ok() : event.Wait();
  lock.lock();
  return ApplyDeviceCopy(run_index, std::move(outcome));
}

Status TierManager::ApplyDeviceCopy(size_t run_index, Status outcome) {
  Run& run = runs_[run_index];
  run.device_event = DeviceEvent();
  run.device_event_claimed = false;
  changed_.notify_all();
  if (run.device == Residency::kLoading) {
    run.device_prefetch_pending = false;
    if (!outcome.ok()) {
      FreeDevice(run_index);
      return std::move(outcome).WithContext("copy to device " + Describe(run));
    }
    run.device = Residency::kResident;
    stats_.AddTransfer(Link::kHostToDevice, run.bytes);
    return device_policy_.Insert(run.first_chunk, false);
  }
  const bool evict = run.device_evict_after;
  run.device_evict_after = false;
  run.device = Residency::kResident;
  if (!outcome.ok()) {  // the device copy stays the only current one
    if (!device_policy_.Contains(run.first_chunk))
      ZOE_RETURN_IF_ERROR(device_policy_.Insert(run.first_chunk, true));
    return std::move(outcome).WithContext("copy from device " + Describe(run));
  }
  run.device_dirty = false;
  run.dirty = true;
  if (run.host == Residency::kWritingBack) run.rewritten_while_writing = true;
  ZOE_RETURN_IF_ERROR(host_policy_.MarkDirty(run.first_chunk, true));
  stats_.AddTransfer(Link::kDeviceToHost, run.bytes);
  if (evict) {
    FreeDevice(run_index);
    stats_.AddEviction(Tier::kDevice, true);
    return Status::Ok();
  }
  if (device_policy_.Contains(run.first_chunk))
    return device_policy_.MarkDirty(run.first_chunk, false);
  return device_policy_.Insert(run.first_chunk, false);
}

bool TierManager::FinishAnyDeviceCopy(std::unique_lock<std::mutex>& lock, Status* outcome) {
  size_t chosen = runs_.size();
  bool any_claimed = false;
  for (size_t i = 0; i < runs_.size(); ++i) {
    const Run& run = runs_[i];
    if (run.device != Residency::kLoading && run.device != Residency::kWritingBack) continue;
    if (run.device_event_claimed) {
      any_claimed = true;
      continue;
    }
    if (chosen == runs_.size() || run.device_evict_after) chosen = i;
    if (run.device_evict_after) break;
  }
  if (chosen != runs_.size()) {
    const bool load = runs_[chosen].device == Residency::kLoading;
    Status finished = FinishDeviceCopy(lock, chosen);
    if (load && !finished.ok()) {  // another acquire's copy (or a prefetch): its run reports it
      ZOE_LOG_WARN("tier manager: {}", finished.ToString());
      runs_[chosen].device_copy_error = std::exchange(finished, Status::Ok());
    }
    *outcome = std::move(finished);
    return true;
  }
  if (any_claimed) changed_.wait(lock);
  return any_claimed;
}

// The device's back-pressure, the same algorithm as ReserveHost: evict until the bytes being
// freed cover the shortfall, wait for copies in flight, and with everything pinned wait for a
// Release at most busy_timeout.
Status TierManager::ReserveDevice(std::unique_lock<std::mutex>& lock, uint64_t bytes,
                                  std::string_view who) {
  Clock::time_point deadline = Clock::now() + options_.busy_timeout;
  for (;;) {
    Status reserved = device_budget_->TryReserve(bytes);
    if (reserved.ok() || reserved.code() == StatusCode::kOutOfMemory) return reserved;
    uint64_t freeing = 0;
    for (const Run& run : runs_)
      if (run.device == Residency::kWritingBack && run.device_evict_after) freeing += run.bytes;
    Result<ChunkId> victim = device_policy_.ChooseVictim();
    const bool enough_in_flight = device_budget_->available() + freeing >= bytes;
    Status finished;
    if (!(victim.ok() && !enough_in_flight) && FinishAnyDeviceCopy(lock, &finished)) {
      ZOE_RETURN_IF_ERROR(finished);
      deadline = Clock::now() + options_.busy_timeout;
      continue;
    }
    if (victim.ok()) {
      ZOE_RETURN_IF_ERROR(StartDeviceEviction(run_of_chunk_[victim->value]));
      deadline = Clock::now() + options_.busy_timeout;
      continue;
    }
    ++waiting_;
    const std::cv_status woken = changed_.wait_until(lock, deadline);
    --waiting_;
    if (woken == std::cv_status::timeout && device_budget_->available() < bytes &&
        !device_policy_.ChooseVictim().ok()) {
      return Status::Busy(fmt::format(
          "'{}' needs {} bytes of device memory but {} of {} bytes are held by pinned chunks and "
          "none was released for {} ms; release tensors or raise the device budget",
          who, bytes, device_budget_->reserved(), device_budget_->capacity(),
          std::chrono::duration_cast<std::chrono::milliseconds>(options_.busy_timeout).count()));
    }
  }
}

// Evicts the device's victim (copying it back first when dirty) and waits for that, so its HOST
// copy loses the pin the device held. `*unpinned` is false when every device copy is pinned.
Status TierManager::EvictDeviceCopyForHost(std::unique_lock<std::mutex>& lock, bool* unpinned) {
  *unpinned = false;
  if (!device_) return Status::Ok();
  Result<ChunkId> victim = device_policy_.ChooseVictim();
  if (!victim.ok()) return Status::Ok();
  const size_t run_index = run_of_chunk_[victim->value];
  ZOE_RETURN_IF_ERROR(StartDeviceEviction(run_index));
  while (runs_[run_index].device == Residency::kWritingBack)
    ZOE_RETURN_IF_ERROR(FinishDeviceCopy(lock, run_index));
  *unpinned = true;
  return Status::Ok();
}

// A device copy of the run taken now would miss the writes still to come through these acquires,
// and copying it back later would undo them.
bool TierManager::HasHostWriter(const Run& run) const {
  for (TensorId tensor : run.tensors) {
    for (const Acquired& acquired : tensors_[tensor.value].acquired) {
      if (acquired.tier == Tier::kHost && Writes(acquired.access)) return true;
    }
  }
  return false;
}

// A HOST acquire of a run the device holds must see the device's bytes (copy back when dirty),
// and a HOST write must not leave a stale device copy behind (drop it).
bool TierManager::NeedsDeviceSync(const Run& run, Access access) const {
  if (run.device == Residency::kAbsent) return false;
  return run.device != Residency::kResident || run.device_dirty || Writes(access);
}

Status TierManager::SyncDeviceForHost(std::unique_lock<std::mutex>& lock, size_t run_index,
                                      Access access, const std::string& name) {
  Run& run = runs_[run_index];
  if (run.device != Residency::kResident) return FinishDeviceCopy(lock, run_index);
  if (run.device_pins > 0) {
    return Status::FailedPrecondition(fmt::format(
        "tensor '{}' shares {} with tensors acquired on the device{}; release them there before "
        "acquiring it on the host for {}",
        name, Describe(run), run.device_dirty ? " for writing" : "", AccessName(access)));
  }
  if (Writes(access)) return StartDeviceEviction(run_index);
  return StartDeviceWriteBack(run_index, false);
}

Status TierManager::FlushDevice(std::unique_lock<std::mutex>& lock) {
  if (!device_) return Status::Ok();
  Status first_error;
  std::vector<size_t> copying;
  for (size_t i = 0; i < runs_.size(); ++i) {
    if (runs_[i].device == Residency::kWritingBack) {  // started by another call: wait for it too
      copying.push_back(i);
      continue;
    }
    if (runs_[i].device != Residency::kResident || !runs_[i].device_dirty) continue;
    Status started = StartDeviceWriteBack(i, false);
    if (started.ok()) {
      copying.push_back(i);
    } else if (first_error.ok()) {
      first_error = std::move(started);
    }
  }
  for (size_t i : copying) {
    while (runs_[i].device == Residency::kWritingBack) {
      Status finished = FinishDeviceCopy(lock, i);
      if (!finished.ok() && first_error.ok()) first_error = std::move(finished);
    }
  }
  return first_error;
}

// ---- device prefetch ------------------------------------------------------------------------

// The DEVICE half of trace replay: walks the upcoming events acquired on DEVICE in order of first
// use (a window of at most the device budget) and copies over runs that HOST already holds, while
// the in-flight limit and the device budget (possibly after evicting clean device copies needed
// later) allow. Stops at the first run that cannot be placed, or whose HOST load has not finished
// yet, so copies stay in trace order; the next acquire resumes from there.
void TierManager::IssueDevicePrefetches(size_t acquiring_run) {
  if (!device_ || !cursor_) return;
  CollectDevicePrefetches(acquiring_run);
  if (device_prefetching_.size() >= options_.prefetch_in_flight) return;
  PrefetchLimits limits;
  limits.byte_budget = std::min(options_.lookahead_bytes, device_budget_->capacity());
  limits.max_chunks = options_.prefetch_in_flight - device_prefetching_.size();
  limits.chunk_bytes = [this](ChunkId) { return layout_.options().chunk_bytes; };
  limits.only_tier = Tier::kDevice;
  const auto skip = [this](ChunkId chunk) {
    return runs_[run_of_chunk_[chunk.value]].device != Residency::kAbsent;
  };
  for (ChunkId chunk : cursor_->NextPrefetches(limits, skip)) {
    const size_t run_index = run_of_chunk_[chunk.value];
    const Run& run = runs_[run_index];
    if (run.device != Residency::kAbsent) continue;  // an earlier chunk of its run
    if (run.host != Residency::kResident || HasHostWriter(run)) return;
    if (!ReserveDeviceForPrefetch(run_index, cursor_->NextUseDistance(chunk))) return;
    Status started = StartDevicePrefetch(run_index);
    if (!started.ok()) {
      ZOE_LOG_DEBUG("tier manager: device prefetch not started: {}", started.ToString());
      return;
    }
  }
}

// Applies device copies started by prefetches that have finished and nobody waits for, except
// `acquiring_run`'s; a failed one leaves its run absent on the device with the error, which the
// next device acquire of the run reports. Forgets copies that became demand copies or were
// applied elsewhere.
void TierManager::CollectDevicePrefetches(size_t acquiring_run) {
  std::erase_if(device_prefetching_, [this, acquiring_run](size_t run_index) {
    Run& run = runs_[run_index];
    if (!run.device_prefetch_pending) return true;
    if (run.device_event_claimed || run_index == acquiring_run) return false;
    const bool skip = SkipsWait(DeviceWait::kPrefetchCopy);
    if (!skip && !run.device_event.Ready()) return false;
    Status applied = ApplyDeviceCopy(run_index, skip ? Status::Ok() : run.device_event.Wait());
    if (!applied.ok()) {
      ZOE_LOG_DEBUG("tier manager: device prefetch failed: {}", applied.ToString());
      run.device_copy_error = std::move(applied);
    }
    return true;
  });
}

bool TierManager::ReserveDeviceForPrefetch(size_t run_index, uint64_t distance) {
  const uint64_t bytes = runs_[run_index].bytes;
  for (;;) {
    if (device_budget_->TryReserve(bytes).ok()) return true;
    Result<ChunkId> victim = device_policy_.ChooseVictim();
    if (!victim.ok()) return false;
    const size_t victim_run = run_of_chunk_[victim->value];
    const Run& candidate = runs_[victim_run];
    if (candidate.device != Residency::kResident || candidate.device_dirty ||
        NextUseOfRun(victim_run) <= distance) {
      return false;
    }
    if (!StartDeviceEviction(victim_run).ok()) return false;
  }
}

// The device copy holds a pin on the HOST copy for as long as it exists (StartDeviceLoad gives it
// back, with the device bytes, when the copy cannot start).
Status TierManager::StartDevicePrefetch(size_t run_index) {
  runs_[run_index].device_wanted = false;
  PinHostRun(run_index);
  ZOE_RETURN_IF_ERROR(StartDeviceLoad(run_index));
  if (runs_[run_index].device == Residency::kLoading) {
    runs_[run_index].device_prefetch_pending = true;
    device_prefetching_.push_back(run_index);
  }
  stats_.AddPrefetchIssued();
  return Status::Ok();
}

void TierManager::StartWantedDeviceCopy(size_t run_index) {
  Run& run = runs_[run_index];
  run.device_wanted = false;
  if (!device_ || run.device != Residency::kAbsent || HasHostWriter(run)) return;
  if (!device_budget_->TryReserve(run.bytes).ok()) return;
  Status started = StartDevicePrefetch(run_index);
  if (!started.ok())
    ZOE_LOG_DEBUG("tier manager: device prefetch not started: {}", started.ToString());
}

}  // namespace zoe::offload
