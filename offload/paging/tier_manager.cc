#include "offload/paging/tier_manager.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "core/log.h"

namespace zoe::offload {
namespace {

uint64_t ElapsedNanoseconds(std::chrono::steady_clock::time_point since) {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - since)
          .count());
}

Status CheckOptions(const TierManagerOptions& options) {
  if (options.nvme_paths.empty())
    return Status::InvalidArgument(
        "tier manager: nvme_paths is empty; give at least one directory");
  if (options.host_budget_bytes == 0)
    return Status::InvalidArgument("tier manager: host_budget_bytes must be > 0");
  const uint64_t block = options.checksum_block;
  if (block != 0 && (block % 4096 != 0 || options.layout.chunk_bytes % block != 0)) {
    return Status::InvalidArgument(fmt::format(
        "tier manager: checksum_block {} must be a multiple of 4096 that divides chunk_bytes {}",
        block, options.layout.chunk_bytes));
  }
  return Status::Ok();
}

Result<std::unique_ptr<io::Engine>> MakeEngine(const TierManagerOptions& options) {
  if (options.engine_factory) return options.engine_factory();
  io::EngineOptions engine;
  engine.backend = options.io_backend;
  engine.queue_depth = options.queue_depth;
  return io::CreateEngine(engine);
}

// No device tier (nullptr) unless a factory or a backend kind is given.
Result<std::unique_ptr<DeviceBackend>> MakeDevice(const TierManagerOptions& options) {
  if (options.device_factory) return options.device_factory();
  if (options.device_backend.empty()) return std::unique_ptr<DeviceBackend>();
  return CreateDeviceBackend(options.device_backend, options.device_budget_bytes);
}

}  // namespace

Result<std::unique_ptr<TierManager>> TierManager::Create(TierManagerOptions options) {
  ZOE_RETURN_IF_ERROR(CheckOptions(options));
  ZOE_ASSIGN_OR_RETURN(ChunkLayout layout, ChunkLayout::Create(options.layout));
  ZOE_ASSIGN_OR_RETURN(std::unique_ptr<io::Engine> engine, MakeEngine(options));
  ZOE_ASSIGN_OR_RETURN(std::unique_ptr<io::IoQueue> io, io::IoQueue::Create(std::move(engine)));
  io::SwapOptions swap_options;
  swap_options.files.checksum_block = options.checksum_block;
  swap_options.files.stripe_unit = options.stripe_unit;
  swap_options.files.open.direct = options.use_direct;
  swap_options.files.open.refuse_direct_for_testing = options.refuse_direct_for_testing;
  swap_options.alignment = 4096;
  Result<std::unique_ptr<io::SwapSpace>> created =
      io::SwapSpace::Create(options.nvme_paths, options.nvme_capacity_bytes, swap_options);
  if (!created.ok()) {
    return std::move(created).status().WithContext(
        fmt::format("{} = {} bytes", options.nvme_capacity_key, options.nvme_capacity_bytes));
  }
  std::unique_ptr<io::SwapSpace> swap = std::move(created).value();
  PinnedPoolOptions pool_options;
  pool_options.name = "host tier";
  pool_options.budget_bytes = options.host_budget_bytes;
  ZOE_ASSIGN_OR_RETURN(PinnedMemoryPool pool, PinnedMemoryPool::Create(std::move(pool_options)));
  ZOE_ASSIGN_OR_RETURN(std::unique_ptr<DeviceBackend> device, MakeDevice(options));
  std::unique_ptr<DeviceQueue> device_queue;
  if (device) {
    ZOE_ASSIGN_OR_RETURN(device_queue, device->CreateQueue());
    ZOE_LOG_INFO(
        "tier manager: device tier on {}, budget {} bytes", device->name(),
        options.device_budget_bytes ? options.device_budget_bytes : device->capacity_bytes());
  }
  ZOE_LOG_INFO("tier manager: host budget {} bytes, {} bytes of swap on {}, I/O through {}",
               options.host_budget_bytes, options.nvme_capacity_bytes, swap->files().Describe(),
               io->backend());
  return std::unique_ptr<TierManager>(
      new TierManager(std::move(options), std::move(layout), std::move(swap), std::move(io),
                      std::move(pool), std::move(device), std::move(device_queue)));
}

TierManager::TierManager(TierManagerOptions options, ChunkLayout layout,
                         std::unique_ptr<io::SwapSpace> swap, std::unique_ptr<io::IoQueue> io,
                         PinnedMemoryPool pool, std::unique_ptr<DeviceBackend> device,
                         std::unique_ptr<DeviceQueue> device_queue)
    : options_(std::move(options)),
      layout_(std::move(layout)),
      swap_(std::move(swap)),
      device_(std::move(device)),
      device_queue_(std::move(device_queue)),
      io_(std::move(io)) {
  TierSlot& host = slot(Tier::kHost);
  host.backend = MakeHostTier(std::move(pool), *io_, swap_->files());
  host.budget = std::make_unique<Budget>("host budget", options_.host_budget_bytes);
  if (!device_) return;
  TierSlot& device_tier = slot(Tier::kDevice);
  device_tier.backend =
      MakeDeviceTier(*device_, *device_queue_, options_.skipped_device_waits_for_testing);
  const uint64_t budget =
      options_.device_budget_bytes ? options_.device_budget_bytes : device_->capacity_bytes();
  device_tier.budget = std::make_unique<Budget>("device budget", budget);
}

TierManager::~TierManager() {
  if (device_queue_) {
    Status synced = device_queue_->Synchronize();
    if (!synced.ok())
      ZOE_LOG_WARN("tier manager: device copy failed at shutdown: {}", synced.ToString());
  }
  Status drained = io_->WaitAll();
  if (!drained.ok())
    ZOE_LOG_WARN("tier manager: transfer failed at shutdown: {}", drained.ToString());
}

bool TierManager::HasTier(Tier tier) const {
  return (tier == Tier::kDevice || tier == Tier::kHost) && slot(tier).backend != nullptr;
}

uint64_t TierManager::reserved_bytes(Tier tier) const {
  return HasTier(tier) ? slot(tier).budget->reserved() : 0;
}

uint64_t TierManager::budget_bytes(Tier tier) const {
  return HasTier(tier) ? slot(tier).budget->capacity() : 0;
}

// ---- registry -------------------------------------------------------------------------------

Status TierManager::CheckFitsNewRun(const TensorDesc& desc) const {
  const uint64_t chunk = layout_.options().chunk_bytes;
  if (desc.bytes == 0 || desc.bytes > layout_.options().max_tensor_bytes)
    return Status::Ok();  // the layout rejects it with its own message
  const uint64_t run_bytes = (desc.bytes + chunk - 1) / chunk * chunk;
  if (run_bytes > budget_bytes(Tier::kHost)) {
    return Status::OutOfMemory(fmt::format(
        "tensor '{}' of {} bytes needs {} bytes of host memory (whole chunks of {} bytes), more "
        "than the host budget of {} bytes; raise the host budget or register smaller tensors",
        desc.name, desc.bytes, run_bytes, chunk, budget_bytes(Tier::kHost)));
  }
  if (desc.home == Tier::kDevice && HasTier(Tier::kDevice) &&
      run_bytes > budget_bytes(Tier::kDevice)) {
    return Status::OutOfMemory(fmt::format(
        "tensor '{}' of {} bytes with home device needs {} bytes of device memory, more than the "
        "device budget of {} bytes",
        desc.name, desc.bytes, run_bytes, budget_bytes(Tier::kDevice)));
  }
  if (run_bytes > swap_->free_bytes()) {
    const uint64_t capacity = swap_->capacity();
    return Status::NoSpace(fmt::format(
        "tensor '{}' of {} bytes needs {} bytes of NVMe swap space, {} of {} bytes are free; "
        "set {} to at least {} (or leave it out: zoe then grows the space as tensors register)",
        desc.name, desc.bytes, run_bytes, swap_->free_bytes(), capacity, options_.nvme_capacity_key,
        capacity + run_bytes - swap_->free_bytes()));
  }
  return Status::Ok();
}

// A tensor whose first chunk is new starts a run made of every chunk its registration created;
// one placed in an existing chunk joins that chunk's run.
Status TierManager::AddRunIfNew(TensorId tensor) {
  ZOE_ASSIGN_OR_RETURN(const TensorEntry* entry, layout_.tensor(tensor));
  const TensorPiece& first = entry->pieces.front();
  const uint64_t chunk_bytes = layout_.options().chunk_bytes;
  if (first.chunk.value >= run_of_chunk_.size()) {
    const uint64_t chunks = layout_.chunk_count() - first.chunk.value;
    Run run;
    run.first_chunk = first.chunk;
    run.bytes = chunks * chunk_bytes;
    ZOE_ASSIGN_OR_RETURN(run.extent, swap_->Allocate(run.bytes));
    stats_.AddOccupancy(Tier::kNvme, run.bytes);
    runs_.push_back(std::move(run));
    run_of_chunk_.resize(layout_.chunk_count(), runs_.size() - 1);
  }
  const size_t run_index = run_of_chunk_[first.chunk.value];
  Run& run = runs_[run_index];
  run.tensors.push_back(tensor);
  TensorState state;
  state.run = run_index;
  state.run_offset = (first.chunk.value - run.first_chunk.value) * chunk_bytes + first.chunk_offset;
  tensors_.push_back(std::move(state));
  return Status::Ok();
}

Status TierManager::GrowSwapFor(const TensorDesc& desc) {
  if (options_.nvme_growth_bytes == 0) return Status::Ok();
  const uint64_t chunk = layout_.options().chunk_bytes;
  if (desc.bytes == 0 || desc.bytes > layout_.options().max_tensor_bytes) return Status::Ok();
  const uint64_t run_bytes = (desc.bytes + chunk - 1) / chunk * chunk;
  const uint64_t free = swap_->free_bytes();
  if (run_bytes <= free) return Status::Ok();
  Result<uint64_t> grown = swap_->Grow(std::max(run_bytes - free, options_.nvme_growth_bytes));
  if (!grown.ok()) {
    return std::move(grown).status().WithContext(
        fmt::format("growing the tensors' swap space for tensor '{}'", desc.name));
  }
  return Status::Ok();
}

Result<TensorId> TierManager::RegisterTensor(TensorDesc desc) {
  ZOE_RETURN_IF_ERROR(GrowSwapFor(desc));
  std::lock_guard lock(mutex_);
  ZOE_RETURN_IF_ERROR(CheckFitsNewRun(desc));
  ZOE_ASSIGN_OR_RETURN(TensorId id, layout_.Register(std::move(desc)));
  ZOE_RETURN_IF_ERROR(AddRunIfNew(id));
  if (cursor_) ForgetReplay();  // the trace describes another registry now
  return id;
}

Result<TensorId> TierManager::Find(std::string_view name) const {
  std::lock_guard lock(mutex_);
  return layout_.Find(name);
}

Result<const TensorEntry*> TierManager::Entry(TensorId tensor) const {
  return layout_.tensor(tensor);
}

std::string TierManager::Describe(const Run& run) const {
  std::string names;
  for (size_t i = 0; i < run.tensors.size() && i < 3; ++i) {
    Result<const TensorEntry*> entry = layout_.tensor(run.tensors[i]);
    names += fmt::format("{}'{}'", i == 0 ? "" : ", ", entry.ok() ? (*entry)->desc.name : "?");
  }
  if (run.tensors.size() > 3) names += fmt::format(" and {} more", run.tensors.size() - 3);
  return fmt::format("chunk {} ({} bytes at swap offset {}; tensors {})", run.first_chunk.value,
                     run.bytes, run.extent.offset, names);
}

size_t TierManager::waiting_acquires() const {
  std::lock_guard lock(mutex_);
  return waiting_;
}

// ---- acquire and release --------------------------------------------------------------------

Result<void*> TierManager::Acquire(TensorId tensor, Tier tier, Access access) {
  if (!IsValidAccess(access))
    return Status::InvalidArgument("acquire: access must be read, write or read_write");
  if (!IsValidTier(tier))
    return Status::InvalidArgument("acquire: tier must be device, host or nvme");
  if (tier == Tier::kNvme) {
    return Status::InvalidArgument(
        "acquire: NVMe bytes cannot be addressed; acquire on the host tier");
  }
  if (!HasTier(tier)) {
    return Status::NotSupported(
        "acquire: no device tier is configured (set device_backend); acquire on the host tier");
  }
  return AcquireIn(tensor, tier, access);
}

std::future<Result<void*>> TierManager::AcquireAsync(TensorId tensor, Tier tier, Access access) {
  return std::async(std::launch::async,
                    [this, tensor, tier, access] { return Acquire(tensor, tier, access); });
}

Result<void*> TierManager::AcquireIn(TensorId tensor, Tier tier, Access access) {
  std::unique_lock lock(mutex_);
  ZOE_ASSIGN_OR_RETURN(const TensorEntry* entry, Entry(tensor));
  const std::string name = entry->desc.name;
  const Clock::time_point start = Clock::now();
  Progress progress;
  Status brought = Bring(lock, tensor, tier, access, name, &progress, CopyUse::kAcquire);
  if (!brought.ok()) {
    const std::string_view where = tier == Tier::kDevice ? " on the device" : "";
    return std::move(brought).WithContext(fmt::format("acquire tensor '{}'{}", name, where));
  }
  const size_t run_index = tensors_[tensor.value].run;
  Pin(run_index, tier, Tenant::kAcquire);
  if (Writes(access)) ZOE_RETURN_IF_ERROR(MarkDirty(run_index, tier));
  void* data = runs_[run_index].copy(tier).memory.data() + tensors_[tensor.value].run_offset;
  FinishAcquire(tensor, access, tier, start, &progress);
  return data;
}

// Loops until the run's copy in `tier` is resident: each pass either finds it resident, or takes
// over a prefetch in flight, or waits for the transfer in flight, or loads it, or first brings the
// copy above in line. The run may be evicted again between passes by another thread; the loop then
// simply loads it again.
Status TierManager::Bring(std::unique_lock<std::mutex>& lock, TensorId tensor, Tier tier,
                          Access access, const std::string& name, Progress* progress, CopyUse use) {
  const size_t run_index = tensors_[tensor.value].run;
  if (!runs_[run_index].copy(tier).load_error.ok())
    return std::exchange(runs_[run_index].copy(tier).load_error, {});
  for (;;) {
    TierCopy& copy = runs_[run_index].copy(tier);
    const bool staging = use == CopyUse::kStaging;
    if (copy.state == CopyState::kResident &&
        (staging || !NeedsUpperSync(runs_[run_index], tier, access)))
      return Status::Ok();
    if (!progress->advanced && copy.state == CopyState::kLoading) {  // prefetched meanwhile
      copy.pending.origin = Origin::kDemand;  // out of the prefetch in-flight limit
      AdvanceTrace(tensor, access, staging ? Tier::kDevice : tier, run_index);
      progress->advanced = true;
      continue;
    }
    if (copy.state == CopyState::kAbsent && !copy.load_error.ok())  // our load, finished elsewhere
      return std::exchange(copy.load_error, {});
    progress->waited = true;
    ZOE_RETURN_IF_ERROR(BringStep(lock, tensor, tier, access, name, progress, use));
  }
}

Status TierManager::BringStep(std::unique_lock<std::mutex>& lock, TensorId tensor, Tier tier,
                              Access access, const std::string& name, Progress* progress,
                              CopyUse use) {
  const size_t run_index = tensors_[tensor.value].run;
  switch (runs_[run_index].copy(tier).state) {
    case CopyState::kResident:
      return SyncUpperForAcquire(lock, run_index, tier, access, name);
    case CopyState::kAbsent:
      // A staging copy is copied up whole, so it must hold the run's bytes even for a pure write.
      return LoadCopy(lock, tensor, tier, use == CopyUse::kStaging ? Access::kRead : access, name,
                      progress);
    case CopyState::kLoading:
    case CopyState::kWritingBack:
      break;
  }
  return FinishTransfer(lock, run_index, tier);
}

// The copy below first (the staging copy, pinned for as long as this copy exists), then this
// tier's bytes, then the load. Any failure leaves this copy absent.
Status TierManager::LoadCopy(std::unique_lock<std::mutex>& lock, TensorId tensor, Tier tier,
                             Access access, const std::string& name, Progress* progress) {
  const size_t run_index = tensors_[tensor.value].run;
  const std::optional<Tier> below = CachedTierBelow(tier);
  if (below) {
    ZOE_RETURN_IF_ERROR(Bring(lock, tensor, *below, access, name, progress, CopyUse::kStaging));
    if (runs_[run_index].copy(tier).state != CopyState::kAbsent) return Status::Ok();
    if (HasWriterIn(runs_[run_index], *below)) {
      return Status::FailedPrecondition(fmt::format(
          "tensor '{}' shares {} with tensors acquired on the {} for writing; release them there "
          "before acquiring it on the {}",
          name, Describe(runs_[run_index]), TierName(*below), TierName(tier)));
    }
    Pin(run_index, *below, Tenant::kUpperCopy);
  }
  Status reserved = Reserve(lock, tier, runs_[run_index].bytes, name);
  if (reserved.ok() && runs_[run_index].copy(tier).state != CopyState::kAbsent) {
    GiveBackReservation(run_index, tier);  // another thread loaded it meanwhile
    return Status::Ok();
  }
  if (!reserved.ok()) {
    if (below) Unpin(run_index, *below, Tenant::kUpperCopy);
    return reserved;
  }
  progress->loaded = true;
  return StartLoad(run_index, tier, access);
}

void TierManager::Pin(size_t run_index, Tier tier, Tenant tenant) {
  Run& run = runs_[run_index];
  ++run.copy(tier).pins[static_cast<size_t>(tenant)];
  Status pinned = slot(tier).policy.Pin(run.first_chunk);
  if (!pinned.ok()) ZOE_LOG_ERROR("tier manager: {}", pinned.ToString());
}

void TierManager::Unpin(size_t run_index, Tier tier, Tenant tenant) {
  Run& run = runs_[run_index];
  --run.copy(tier).pins[static_cast<size_t>(tenant)];
  Status unpinned = slot(tier).policy.Unpin(run.first_chunk);
  if (!unpinned.ok()) ZOE_LOG_ERROR("tier manager: {}", unpinned.ToString());
  changed_.notify_all();
}

Status TierManager::MarkDirty(size_t run_index, Tier tier) {
  Run& run = runs_[run_index];
  run.copy(tier).dirty = true;
  return slot(tier).policy.MarkDirty(run.first_chunk, true);
}

// Bookkeeping shared by both tiers once the tensor is pinned where it was asked for.
void TierManager::FinishAcquire(TensorId tensor, Access access, Tier tier, Clock::time_point start,
                                Progress* progress) {
  tensors_[tensor.value].acquired.push_back(Acquired{tier, access});
  progress->loaded ? stats_.AddPrefetchMiss() : stats_.AddPrefetchHit();
  if (progress->waited) stats_.AddStall(ElapsedNanoseconds(start));
  // After pinning: prefetches must not evict the run.
  if (!progress->advanced) AdvanceTrace(tensor, access, tier, tensors_[tensor.value].run);
}

Status TierManager::Release(TensorId tensor) {
  std::lock_guard lock(mutex_);
  ZOE_ASSIGN_OR_RETURN(const TensorEntry* entry, Entry(tensor));
  TensorState& state = tensors_[tensor.value];
  if (state.acquired.empty()) {
    return Status::FailedPrecondition(
        fmt::format("release: tensor '{}' is not acquired", entry->desc.name));
  }
  const Acquired acquired = state.acquired.back();
  state.acquired.pop_back();
  Run& run = runs_[state.run];
  // The caller may have written through its pointer until now, also after a Flush that cleaned
  // the run: the copy holds bytes the tier below does not.
  Status marked;
  if (Writes(acquired.access)) {
    run.copy(acquired.tier).dirty = true;
    if (slot(acquired.tier).policy.Contains(run.first_chunk))
      marked = slot(acquired.tier).policy.MarkDirty(run.first_chunk, true);
  }
  Unpin(state.run, acquired.tier, Tenant::kAcquire);
  return marked;
}

// ---- maintenance ----------------------------------------------------------------------------

Status TierManager::Flush() {
  std::unique_lock lock(mutex_);
  Status first_error;
  for (Tier tier : kCopyTiers) {  // DEVICE first: its copies come back into HOST's
    if (!HasTier(tier)) continue;
    Status flushed = FlushTier(lock, tier);
    if (first_error.ok()) first_error = std::move(flushed);
  }
  return first_error.WithContext("flush");
}

// Write-backs other calls started may predate the copies from above: waits for them, so that a
// copy they leave dirty is written again.
void TierManager::WaitForWriteBacks(std::unique_lock<std::mutex>& lock, Tier tier) {
  for (size_t i = 0; i < runs_.size(); ++i) {
    while (runs_[i].copy(tier).state == CopyState::kWritingBack) {
      Status finished = FinishTransfer(lock, i, tier);
      if (!finished.ok())
        ZOE_LOG_WARN("tier manager: flush retries after: {}", finished.ToString());
    }
  }
}

Status TierManager::FlushTier(std::unique_lock<std::mutex>& lock, Tier tier) {
  WaitForWriteBacks(lock, tier);
  Status first_error;
  std::vector<size_t> writing;
  for (size_t i = 0; i < runs_.size(); ++i) {
    const TierCopy& copy = runs_[i].copy(tier);
    if (copy.state != CopyState::kResident || !copy.dirty) continue;
    Status started = StartWriteBack(i, tier, AfterWrite::kStay);
    if (started.ok()) {
      writing.push_back(i);
    } else if (first_error.ok()) {
      first_error = std::move(started);
    }
  }
  for (size_t i : writing) {
    while (runs_[i].copy(tier).state == CopyState::kWritingBack) {
      Status finished = FinishTransfer(lock, i, tier);
      if (!finished.ok() && first_error.ok()) first_error = std::move(finished);
    }
    // A failure applied by another thread waiting on the same write.
    const Status& failed = runs_[i].copy(tier).write_error;
    if (!failed.ok() && first_error.ok()) first_error = failed;
  }
  return first_error;
}

// DEVICE first (its copy pins HOST's), until the run is absent from every cached tier.
Status TierManager::Evict(TensorId tensor) {
  std::unique_lock lock(mutex_);
  ZOE_ASSIGN_OR_RETURN(const TensorEntry* entry, Entry(tensor));
  const std::string name = entry->desc.name;
  const size_t run_index = tensors_[tensor.value].run;
  for (;;) {
    const auto present = std::find_if(kCopyTiers.begin(), kCopyTiers.end(), [&](Tier tier) {
      return runs_[run_index].copy(tier).state != CopyState::kAbsent;
    });
    if (present == kCopyTiers.end()) return Status::Ok();
    ZOE_RETURN_IF_ERROR(EvictStep(lock, run_index, *present, name));
  }
}

Status TierManager::EvictStep(std::unique_lock<std::mutex>& lock, size_t run_index, Tier tier,
                              const std::string& name) {
  const Run& run = runs_[run_index];
  const TierCopy& copy = run.copy(tier);
  if (copy.pinned() > 0) {
    return Status::Busy(fmt::format("evict tensor '{}': {} is pinned{} by {} acquire(s)", name,
                                    Describe(run), tier == Tier::kDevice ? " on the device" : "",
                                    copy.pinned()));
  }
  Status step = copy.state == CopyState::kResident ? StartEviction(run_index, tier)
                                                   : FinishTransfer(lock, run_index, tier);
  if (!step.ok()) return std::move(step).WithContext(fmt::format("evict tensor '{}'", name));
  return Status::Ok();
}

}  // namespace zoe::offload
