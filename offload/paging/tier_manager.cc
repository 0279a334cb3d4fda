#include "offload/paging/tier_manager.h"

#include <fmt/format.h>

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
  ZOE_ASSIGN_OR_RETURN(
      std::unique_ptr<io::SwapSpace> swap,
      io::SwapSpace::Create(options.nvme_paths, options.nvme_capacity_bytes, swap_options));
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
      pool_(std::move(pool)),
      host_budget_("host budget", options_.host_budget_bytes),
      device_(std::move(device)),
      device_queue_(std::move(device_queue)),
      io_(std::move(io)) {
  if (device_) {
    const uint64_t budget =
        options_.device_budget_bytes ? options_.device_budget_bytes : device_->capacity_bytes();
    device_budget_ = std::make_unique<Budget>("device budget", budget);
  }
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

// ---- registry -------------------------------------------------------------------------------

Status TierManager::CheckFitsNewRun(const TensorDesc& desc) const {
  const uint64_t chunk = layout_.options().chunk_bytes;
  if (desc.bytes == 0 || desc.bytes > layout_.options().max_tensor_bytes)
    return Status::Ok();  // the layout rejects it with its own message
  const uint64_t run_bytes = (desc.bytes + chunk - 1) / chunk * chunk;
  if (run_bytes > host_budget_.capacity()) {
    return Status::OutOfMemory(fmt::format(
        "tensor '{}' of {} bytes needs {} bytes of host memory (whole chunks of {} bytes), more "
        "than the host budget of {} bytes; raise the host budget or register smaller tensors",
        desc.name, desc.bytes, run_bytes, chunk, host_budget_.capacity()));
  }
  if (desc.home == Tier::kDevice && device_budget_ && run_bytes > device_budget_->capacity()) {
    return Status::OutOfMemory(fmt::format(
        "tensor '{}' of {} bytes with home device needs {} bytes of device memory, more than the "
        "device budget of {} bytes",
        desc.name, desc.bytes, run_bytes, device_budget_->capacity()));
  }
  if (run_bytes > swap_->free_bytes()) {
    return Status::NoSpace(fmt::format(
        "tensor '{}' of {} bytes needs {} bytes of NVMe swap space, {} of {} bytes are free",
        desc.name, desc.bytes, run_bytes, swap_->free_bytes(), swap_->capacity()));
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

Result<TensorId> TierManager::RegisterTensor(TensorDesc desc) {
  std::lock_guard lock(mutex_);
  ZOE_RETURN_IF_ERROR(CheckFitsNewRun(desc));
  ZOE_ASSIGN_OR_RETURN(TensorId id, layout_.Register(std::move(desc)));
  ZOE_RETURN_IF_ERROR(AddRunIfNew(id));
  if (cursor_) {  // the trace describes another registry now
    cursor_.reset();
    host_policy_.SetNextUse({});
    device_policy_.SetNextUse({});
  }
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
  switch (tier) {
    case Tier::kHost:
      return AcquireHost(tensor, access);
    case Tier::kDevice:
      return AcquireDevice(tensor, access);
    case Tier::kNvme:
      return Status::InvalidArgument(
          "acquire: NVMe bytes cannot be addressed; acquire on the host tier");
  }
  return Status::InvalidArgument("acquire: tier must be device, host or nvme");
}

std::future<Result<void*>> TierManager::AcquireAsync(TensorId tensor, Tier tier, Access access) {
  return std::async(std::launch::async,
                    [this, tensor, tier, access] { return Acquire(tensor, tier, access); });
}

// Loops until the tensor's run is resident: each pass either finds it resident, or waits for the
// transfer in flight, or reserves memory and starts the load, or first brings the device copy in
// line. The run may be evicted again between passes by another thread; the loop then simply loads
// it again.
Status TierManager::BringToHost(std::unique_lock<std::mutex>& lock, TensorId tensor, Access access,
                                const std::string& name, Progress* progress, HostUse use) {
  const size_t run_index = tensors_[tensor.value].run;
  const bool staging = use == HostUse::kDeviceStaging;
  // A staging copy is copied to the device whole, so it must hold the run's bytes even when the
  // device acquire only writes.
  const Access load_access = staging ? Access::kRead : access;
  if (!runs_[run_index].load_error.ok()) return std::exchange(runs_[run_index].load_error, {});
  for (;;) {
    Run& run = runs_[run_index];
    if (run.host == Residency::kResident && (staging || !NeedsDeviceSync(run, access)))
      return Status::Ok();
    if (!progress->advanced && run.host == Residency::kLoading) {  // prefetch meanwhile
      run.prefetch_pending = false;  // a demand load now: it leaves the prefetch in-flight limit
      AdvanceTrace(tensor, access, staging ? Tier::kDevice : Tier::kHost, run_index);
      progress->advanced = true;
      continue;
    }
    Status step;
    progress->waited = true;
    if (run.host == Residency::kResident) {
      step = SyncDeviceForHost(lock, run_index, access, name);
    } else if (run.host == Residency::kAbsent) {
      if (!run.load_error.ok()) return std::exchange(run.load_error, {});  // our load, finished
      step = ReserveHost(lock, runs_[run_index].bytes, name);
      if (step.ok() && runs_[run_index].host != Residency::kAbsent) {
        step = host_budget_.Release(runs_[run_index].bytes);  // someone else loaded it meanwhile
        changed_.notify_all();  // the bytes may be what another ReserveHost waits for
      } else if (step.ok()) {
        step = StartLoad(run_index, load_access);
        progress->loaded = true;
      }
    } else {
      step = FinishTransfer(lock, run_index);
    }
    if (!step.ok()) return step;
  }
}

void TierManager::PinHostRun(size_t run_index) {
  Run& run = runs_[run_index];
  ++run.pins;
  Status pinned = host_policy_.Pin(run.first_chunk);
  if (!pinned.ok()) ZOE_LOG_ERROR("tier manager: {}", pinned.ToString());
}

void TierManager::UnpinHostRun(size_t run_index) {
  Run& run = runs_[run_index];
  --run.pins;
  Status unpinned = host_policy_.Unpin(run.first_chunk);
  if (!unpinned.ok()) ZOE_LOG_ERROR("tier manager: {}", unpinned.ToString());
  changed_.notify_all();
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

Result<void*> TierManager::AcquireHost(TensorId tensor, Access access) {
  std::unique_lock lock(mutex_);
  ZOE_ASSIGN_OR_RETURN(const TensorEntry* entry, Entry(tensor));
  const std::string name = entry->desc.name;
  const Clock::time_point start = Clock::now();
  Progress progress;
  Status brought = BringToHost(lock, tensor, access, name, &progress);
  if (!brought.ok())
    return std::move(brought).WithContext(fmt::format("acquire tensor '{}'", name));
  const size_t run_index = tensors_[tensor.value].run;
  PinHostRun(run_index);
  Run& run = runs_[run_index];
  if (Writes(access)) {
    run.dirty = true;
    ZOE_RETURN_IF_ERROR(host_policy_.MarkDirty(run.first_chunk, true));
  }
  void* data = run.memory.data() + tensors_[tensor.value].run_offset;
  FinishAcquire(tensor, access, Tier::kHost, start, &progress);
  return data;
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
  // the run: the run holds bytes the next tier down does not.
  const bool wrote = Writes(acquired.access);
  if (acquired.tier == Tier::kHost) {
    Status marked;
    if (wrote) {
      run.dirty = true;
      if (host_policy_.Contains(run.first_chunk))
        marked = host_policy_.MarkDirty(run.first_chunk, true);
    }
    UnpinHostRun(state.run);
    return marked;
  }
  Status marked;
  if (wrote) {
    run.device_dirty = true;
    if (device_policy_.Contains(run.first_chunk))
      marked = device_policy_.MarkDirty(run.first_chunk, true);
  }
  --run.device_pins;
  changed_.notify_all();
  Status unpinned = device_policy_.Unpin(run.first_chunk);
  return marked.ok() ? unpinned : marked;
}

// ---- transfers ------------------------------------------------------------------------------

// Requires reserved HOST bytes for the run. A run never written to NVMe starts as zeros; a pure
// write of a run's only tensor needs no read; anything else is read from the run's extent.
Status TierManager::StartLoad(size_t run_index, Access access) {
  Run& run = runs_[run_index];
  Result<PinnedBuffer> memory = TakeHostMemory(run.bytes);
  if (!memory.ok()) {
    Status ignored = host_budget_.Release(run.bytes);
    (void)ignored;
    changed_.notify_all();
    return std::move(memory).status();
  }
  run.memory = std::move(memory).value();
  stats_.AddOccupancy(Tier::kHost, run.bytes);
  const bool overwritten = access == Access::kWrite && run.tensors.size() == 1;
  if (!run.on_nvme || overwritten) {
    if (!run.on_nvme) std::memset(run.memory.data(), 0, run.bytes);
    run.host = Residency::kResident;
    return host_policy_.Insert(run.first_chunk, false);
  }
  io::IoRequest request{io::Op::kRead, &swap_->files(), run.extent.offset,
                        run.memory.span().first(run.bytes)};
  Result<io::Ticket> ticket = io_->Submit(request);
  if (!ticket.ok()) {
    FreeHost(run_index);
    return std::move(ticket).status().WithContext("read " + Describe(run));
  }
  run.host = Residency::kLoading;
  run.ticket = *ticket;
  run.ticket_claimed = false;
  return Status::Ok();
}

Status TierManager::StartWriteBack(size_t run_index, bool evict_after) {
  Run& run = runs_[run_index];
  io::IoRequest request{io::Op::kWrite, &swap_->files(), run.extent.offset,
                        run.memory.span().first(run.bytes)};
  Result<io::Ticket> ticket = io_->Submit(request);
  if (!ticket.ok()) return std::move(ticket).status().WithContext("write back " + Describe(run));
  run.host = Residency::kWritingBack;
  run.ticket = *ticket;
  run.ticket_claimed = false;
  run.evict_after_write = evict_after;
  return Status::Ok();
}

Status TierManager::StartEviction(size_t run_index) {
  Run& run = runs_[run_index];
  ZOE_RETURN_IF_ERROR(host_policy_.Remove(run.first_chunk));
  if (run.host == Residency::kWritingBack) {  // a flush is writing it: free it when done
    run.evict_after_write = true;
    return Status::Ok();
  }
  if (!run.dirty) {
    FreeHost(run_index);
    stats_.AddEviction(Tier::kHost, false);
    changed_.notify_all();
    return Status::Ok();
  }
  Status started = StartWriteBack(run_index, true);
  if (!started.ok()) {
    Status restored = host_policy_.Insert(run.first_chunk, true);
    (void)restored;
  }
  return started;
}

void TierManager::FreeHost(size_t run_index) {
  Run& run = runs_[run_index];
  KeepHostMemory(run.bytes, std::move(run.memory));
  run.memory = PinnedBuffer();
  run.host = Residency::kAbsent;
  run.device_wanted = false;
  Status released = host_budget_.Release(run.bytes);
  Status subtracted = stats_.SubtractOccupancy(Tier::kHost, run.bytes);
  if (!released.ok() || !subtracted.ok())
    ZOE_LOG_ERROR("tier manager: host accounting broken: {} {}", released.ToString(),
                  subtracted.ToString());
  changed_.notify_all();  // wakes ReserveHost waiters
}

Result<PinnedBuffer> TierManager::TakeHostMemory(uint64_t bytes) {
  for (auto it = spare_host_.begin(); it != spare_host_.end(); ++it) {
    if (it->first != bytes) continue;
    PinnedBuffer memory = std::move(it->second);
    spare_host_.erase(it);
    return memory;
  }
  Result<PinnedBuffer> memory = pool_.Allocate(bytes);
  if (memory.ok() || spare_host_.empty()) return memory;
  spare_host_.clear();  // spares of other sizes hold the pool's budget
  return pool_.Allocate(bytes);
}

void TierManager::KeepHostMemory(uint64_t bytes, PinnedBuffer memory) {
  if (!memory.empty()) spare_host_.emplace_back(bytes, std::move(memory));
}

// Exactly one thread waits on a ticket (IoQueue collects it on Wait); the others sleep on the
// condition variable until that thread has applied the outcome.
Status TierManager::FinishTransfer(std::unique_lock<std::mutex>& lock, size_t run_index) {
  Run& run = runs_[run_index];
  if (run.ticket_claimed) {
    changed_.wait(lock);
    return Status::Ok();
  }
  run.ticket_claimed = true;
  const io::Ticket ticket = run.ticket;
  lock.unlock();
  Status outcome = io_->Wait(ticket);
  lock.lock();
  return ApplyTransfer(run_index, std::move(outcome));
}

Status TierManager::ApplyTransfer(size_t run_index, Status outcome) {
  Run& run = runs_[run_index];
  run.ticket = 0;
  run.ticket_claimed = false;
  changed_.notify_all();
  if (run.host == Residency::kLoading) {
    run.prefetch_pending = false;
    if (!outcome.ok()) {
      FreeHost(run_index);
      return std::move(outcome).WithContext("read " + Describe(run));
    }
    run.host = Residency::kResident;
    stats_.AddTransfer(Link::kNvmeToHost, run.bytes);
    ZOE_RETURN_IF_ERROR(host_policy_.Insert(run.first_chunk, false));
    if (run.device_wanted) StartWantedDeviceCopy(run_index);
    return Status::Ok();
  }
  const bool evict = run.evict_after_write;
  const bool rewritten = run.rewritten_while_writing;
  run.evict_after_write = false;
  run.rewritten_while_writing = false;
  run.host = Residency::kResident;
  if (!outcome.ok()) {  // keep the only copy of the data resident and dirty
    run.write_error = outcome;
    if (!host_policy_.Contains(run.first_chunk))
      ZOE_RETURN_IF_ERROR(host_policy_.Insert(run.first_chunk, true));
    return std::move(outcome).WithContext("write back " + Describe(run));
  }
  run.dirty = rewritten;  // NVMe may hold a mix of old and new bytes: write it again
  run.on_nvme = true;
  run.write_error = Status::Ok();
  stats_.AddTransfer(Link::kHostToNvme, run.bytes);
  if (evict && !rewritten) {
    FreeHost(run_index);
    stats_.AddEviction(Tier::kHost, true);
    return Status::Ok();
  }
  if (host_policy_.Contains(run.first_chunk))
    return host_policy_.MarkDirty(run.first_chunk, rewritten);
  return host_policy_.Insert(run.first_chunk, rewritten);
}

// Prefers write-backs that free memory, then loads nobody waits for (prefetches); a transfer
// another thread already waits on is waited for through the condition variable. Only a
// write-back's failure is returned: a failed load frees its memory all the same, and its error
// belongs to the acquire of that run, not to the caller.
bool TierManager::FinishAnyTransfer(std::unique_lock<std::mutex>& lock, Status* outcome) {
  size_t chosen = runs_.size();
  bool any_claimed = false;
  for (size_t i = 0; i < runs_.size(); ++i) {
    const Run& run = runs_[i];
    if (run.ticket == 0) continue;
    if (run.ticket_claimed) {
      any_claimed = true;
      continue;
    }
    if (chosen == runs_.size() || run.evict_after_write) chosen = i;
    if (run.evict_after_write) break;
  }
  if (chosen != runs_.size()) {
    const bool load = runs_[chosen].host == Residency::kLoading;
    Status finished = FinishTransfer(lock, chosen);
    if (load && !finished.ok()) {
      // A read the caller did not ask for (a prefetch, or another acquire's load): the run is
      // absent again and its own acquire reports the error.
      ZOE_LOG_WARN("tier manager: {}", finished.ToString());
      runs_[chosen].load_error = std::exchange(finished, Status::Ok());
    }
    *outcome = std::move(finished);
    return true;
  }
  if (any_claimed) changed_.wait(lock);
  return any_claimed;
}

// Back-pressure. Evicts least-recently-used unpinned runs until the bytes being freed cover the
// shortfall, then waits for those write-backs. When every HOST run is pinned, evicts an unpinned
// device copy, which gives back its HOST pin. With nothing evictable and nothing in flight, only
// a Release can help: waits for one, at most busy_timeout.
Status TierManager::ReserveHost(std::unique_lock<std::mutex>& lock, uint64_t bytes,
                                std::string_view who) {
  Clock::time_point deadline = Clock::now() + options_.busy_timeout;
  for (;;) {
    Status reserved = host_budget_.TryReserve(bytes);
    if (reserved.ok() || reserved.code() == StatusCode::kOutOfMemory) return reserved;
    uint64_t freeing = 0;
    for (const Run& run : runs_)
      if (run.host == Residency::kWritingBack && run.evict_after_write) freeing += run.bytes;
    Result<ChunkId> victim = host_policy_.ChooseVictim();
    const bool enough_in_flight = host_budget_.available() + freeing >= bytes;
    Status finished;
    if (!(victim.ok() && !enough_in_flight) && FinishAnyTransfer(lock, &finished)) {
      ZOE_RETURN_IF_ERROR(finished);
      deadline = Clock::now() + options_.busy_timeout;
      continue;
    }
    if (victim.ok()) {
      ZOE_RETURN_IF_ERROR(StartEviction(run_of_chunk_[victim->value]));
      deadline = Clock::now() + options_.busy_timeout;
      continue;
    }
    bool unpinned = false;
    ZOE_RETURN_IF_ERROR(EvictDeviceCopyForHost(lock, &unpinned));
    if (unpinned) {
      deadline = Clock::now() + options_.busy_timeout;
      continue;
    }
    ++waiting_;
    const std::cv_status woken = changed_.wait_until(lock, deadline);
    --waiting_;
    if (woken == std::cv_status::timeout && host_budget_.available() < bytes &&
        !host_policy_.ChooseVictim().ok()) {
      return Status::Busy(fmt::format(
          "'{}' needs {} bytes of host memory but {} of {} bytes are held by pinned chunks and "
          "none was released for {} ms; release tensors or raise the host budget",
          who, bytes, host_budget_.reserved(), host_budget_.capacity(),
          std::chrono::duration_cast<std::chrono::milliseconds>(options_.busy_timeout).count()));
    }
  }
}

// ---- hints and maintenance ------------------------------------------------------------------

Status TierManager::Prefetch(TensorId tensor, Tier tier) {
  std::lock_guard lock(mutex_);
  ZOE_ASSIGN_OR_RETURN(const TensorEntry* entry, Entry(tensor));
  if (!IsValidTier(tier))
    return Status::InvalidArgument("prefetch: tier must be device, host or nvme");
  // NVMe always holds the run; without a device tier a DEVICE hint has nowhere to go.
  if (tier == Tier::kNvme || (tier == Tier::kDevice && !device_)) return Status::Ok();
  const std::string context = fmt::format("prefetch tensor '{}'", entry->desc.name);
  const size_t run_index = tensors_[tensor.value].run;
  Run& run = runs_[run_index];
  if (tier == Tier::kDevice) {
    if (run.device != Residency::kAbsent || HasHostWriter(run)) return Status::Ok();
    if (run.host == Residency::kResident) {
      CollectDevicePrefetches(runs_.size());
      if (!device_budget_->TryReserve(run.bytes).ok()) return Status::Ok();
      return StartDevicePrefetch(run_index).WithContext(context);
    }
    run.device_wanted = true;  // the copy follows the HOST load
  }
  if (run.host != Residency::kAbsent) return Status::Ok();
  CollectPrefetches(runs_.size());
  if (!host_budget_.TryReserve(run.bytes).ok()) {
    run.device_wanted = false;
    return Status::Ok();
  }
  return StartPrefetch(run_index).WithContext(context);
}

Status TierManager::StartPrefetch(size_t run_index) {
  ZOE_RETURN_IF_ERROR(StartLoad(run_index, Access::kRead));
  if (runs_[run_index].host == Residency::kLoading) {
    runs_[run_index].prefetch_pending = true;
    prefetching_.push_back(run_index);
  }
  stats_.AddPrefetchIssued();
  return Status::Ok();
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
    cursor_.reset();
    host_policy_.SetNextUse({});
    device_policy_.SetNextUse({});
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
  host_policy_.SetNextUse(next_use);
  device_policy_.SetNextUse(next_use);
  return Status::Ok();
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

void TierManager::AdvanceTrace(TensorId tensor, Access access, Tier tier, size_t acquiring_run) {
  if (!traces_.recording() && !cursor_) return;
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
  for (const TraceEvent& event : *events) {
    switch (cursor_->OnAcquire(event)) {
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
  IssueTracePrefetches(acquiring_run);
}

void TierManager::CollectPrefetches(size_t acquiring_run) {
  std::erase_if(prefetching_, [this, acquiring_run](size_t run_index) {
    Run& run = runs_[run_index];
    if (!run.prefetch_pending) return true;
    if (run.ticket_claimed || run_index == acquiring_run) return false;
    std::optional<Status> outcome = io_->Poll(run.ticket);
    if (!outcome) return false;
    Status applied = ApplyTransfer(run_index, std::move(*outcome));
    if (!applied.ok()) {
      ZOE_LOG_DEBUG("tier manager: prefetch failed: {}", applied.ToString());
      run.load_error = std::move(applied);
    }
    return true;
  });
}

// HOST first: a device copy can only start from a run resident on HOST.
void TierManager::IssueTracePrefetches(size_t acquiring_run) {
  IssueHostPrefetches(acquiring_run);
  IssueDevicePrefetches(acquiring_run);
}

// Walks the look-ahead window of the trace in order of first use and starts loads for absent
// runs while the in-flight limit and the budget (possibly after evicting clean runs needed later)
// allow; stops at the first run that cannot be placed, so prefetches stay in trace order.
void TierManager::IssueHostPrefetches(size_t acquiring_run) {
  CollectPrefetches(acquiring_run);
  if (prefetching_.size() >= options_.prefetch_in_flight) return;
  PrefetchLimits limits;
  limits.byte_budget = options_.lookahead_bytes;
  limits.max_chunks = options_.prefetch_in_flight - prefetching_.size();
  limits.chunk_bytes = [this](ChunkId) { return layout_.options().chunk_bytes; };
  const auto skip = [this](ChunkId chunk) {
    return runs_[run_of_chunk_[chunk.value]].host != Residency::kAbsent;
  };
  for (ChunkId chunk : cursor_->NextPrefetches(limits, skip)) {
    const size_t run_index = run_of_chunk_[chunk.value];
    if (runs_[run_index].host != Residency::kAbsent) continue;  // an earlier chunk of its run
    if (!ReserveForPrefetch(run_index, cursor_->NextUseDistance(chunk))) return;
    Status started = StartPrefetch(run_index);
    if (!started.ok()) {
      ZOE_LOG_DEBUG("tier manager: prefetch not started: {}", started.ToString());
      return;
    }
  }
}

bool TierManager::ReserveForPrefetch(size_t run_index, uint64_t distance) {
  const uint64_t bytes = runs_[run_index].bytes;
  for (;;) {
    if (host_budget_.TryReserve(bytes).ok()) return true;
    Result<ChunkId> victim = host_policy_.ChooseVictim();
    if (!victim.ok()) return false;
    const size_t victim_run = run_of_chunk_[victim->value];
    const Run& candidate = runs_[victim_run];
    if (candidate.host != Residency::kResident || candidate.dirty ||
        NextUseOfRun(victim_run) <= distance) {
      return false;
    }
    if (!StartEviction(victim_run).ok()) return false;
  }
}

Status TierManager::Flush() {
  std::unique_lock lock(mutex_);
  Status first_error = FlushDevice(lock);
  // Write-backs other calls started may predate the copies from the device: wait for them, so
  // that a run they leave dirty is written again below.
  for (size_t i = 0; i < runs_.size(); ++i) {
    while (runs_[i].host == Residency::kWritingBack) {
      Status finished = FinishTransfer(lock, i);
      if (!finished.ok())
        ZOE_LOG_WARN("tier manager: flush retries after: {}", finished.ToString());
    }
  }
  std::vector<size_t> writing;
  for (size_t i = 0; i < runs_.size(); ++i) {
    if (runs_[i].host != Residency::kResident || !runs_[i].dirty) continue;
    Status started = StartWriteBack(i, false);
    if (started.ok()) {
      writing.push_back(i);
    } else if (first_error.ok()) {
      first_error = std::move(started);
    }
  }
  for (size_t i : writing) {
    while (runs_[i].host == Residency::kWritingBack) {
      Status finished = FinishTransfer(lock, i);
      if (!finished.ok() && first_error.ok()) first_error = std::move(finished);
    }
    // A failure applied by another thread waiting on the same write.
    if (!runs_[i].write_error.ok() && first_error.ok()) first_error = runs_[i].write_error;
  }
  return first_error.WithContext("flush");
}

Status TierManager::Evict(TensorId tensor) {
  std::unique_lock lock(mutex_);
  ZOE_ASSIGN_OR_RETURN(const TensorEntry* entry, Entry(tensor));
  const std::string name = entry->desc.name;
  const size_t run_index = tensors_[tensor.value].run;
  for (;;) {
    Run& run = runs_[run_index];
    if (run.device != Residency::kAbsent) {
      if (run.device_pins > 0) {
        return Status::Busy(
            fmt::format("evict tensor '{}': {} is pinned on the device by {} "
                        "acquire(s)",
                        name, Describe(run), run.device_pins));
      }
      Status step = run.device == Residency::kResident ? StartDeviceEviction(run_index)
                                                       : FinishDeviceCopy(lock, run_index);
      if (!step.ok()) return std::move(step).WithContext(fmt::format("evict tensor '{}'", name));
      continue;
    }
    if (run.host == Residency::kAbsent) return Status::Ok();
    if (run.pins > 0) {
      return Status::Busy(fmt::format("evict tensor '{}': {} is pinned by {} acquire(s)", name,
                                      Describe(run), run.pins));
    }
    Status step;
    if (run.host == Residency::kResident) {
      step = StartEviction(run_index);
    } else {
      step = FinishTransfer(lock, run_index);
    }
    if (!step.ok()) return std::move(step).WithContext(fmt::format("evict tensor '{}'", name));
  }
}

}  // namespace zoe::offload
