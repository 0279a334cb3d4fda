// TierManager: the registry of offloaded tensors and the residency of their bytes between device
// memory (DEVICE), pinned host memory (HOST) and NVMe swap space (NVME), with budgets that are
// never exceeded.
//
// Units. Tensors are packed into fixed-size chunks by ChunkLayout. The manager moves "runs": the
// chunks created together by one registration (one chunk for a small tensor, ceil(bytes / chunk)
// consecutive chunks for a large one). A run is placed contiguously in memory, so every tensor,
// including one spread over several chunks, is handed out as a single pointer. Later small tensors
// placed in a run's last chunk share that run.
//
// Contract:
//  - RegisterTensor places a tensor and reserves NVMe swap space for any new run at once, so "no
//    space" and "larger than the HOST budget" show at registration, never mid-training.
//  - Acquire(tensor, HOST, access) returns a pointer to the tensor's bytes once they are resident
//    and pins them until the matching Release. A tensor never written reads as zeros. Writing
//    (kWrite, kReadWrite) marks the run dirty; a clean run is evicted for free, a dirty one is
//    written to NVMe before its memory is reused. A pure write of a tensor that has its run to
//    itself skips the read.
//  - Back-pressure: when the HOST (or DEVICE) budget is full, Acquire evicts unpinned runs (least
//    recently used first, or by next use while a trace is replayed) and waits for their
//    write-backs. When every resident run is pinned it waits for a Release, at most
//    TierManagerOptions::busy_timeout, then fails with Busy naming the tensor.
//  - An acquire waits only for the transfer it needs. Transfers in flight belong to no thread:
//    whichever thread first needs one to finish waits on its ticket and applies the result.
//  - I/O failures (EIO, ENOSPC, checksum mismatch) surface from the call that needed the
//    transfer, with the tensor named. A failed write-back keeps the run resident and dirty, so no
//    written data is lost; a failed read leaves the run absent so a later acquire retries.
//  - Release(tensor) undoes the most recent Acquire of that tensor.
//  - DEVICE (when a device backend is configured) is inclusive: a run resident on the device keeps
//    its HOST copy resident and pinned, which is also the staging buffer of NVMe -> DEVICE, so it
//    counts against the HOST budget. Acquire(tensor, DEVICE) brings the run to HOST first, then
//    copies it over; device eviction copies a dirty run back into its HOST copy (which becomes
//    dirty) and frees a clean one at once. Acquiring on HOST a run the device holds dirty copies it
//    back first; acquiring it on HOST for writing drops the device copy. Both fail with
//    FailedPrecondition while the device copy is pinned and dirty (or, for a HOST write, pinned).
//    Conversely, a run with an outstanding HOST write acquire is not copied to the device: a
//    DEVICE acquire of any of its tensors fails with FailedPrecondition, and prefetches skip it.
//  - Traces. TraceBegin(name)/TraceEnd() bracket one iteration. The first time a name is seen
//    (or after the replay asked for re-recording) the iteration's acquires are recorded; TraceEnd
//    stores the trace and starts replaying it. While replaying, each acquire advances a
//    TraceCursor and prefetches the next runs within lookahead_bytes and prefetch_in_flight,
//    evicting for them only clean runs needed later than they are; eviction picks the run whose
//    next use is farthest (Belady/OPT) on DEVICE and on HOST (or the least recently used one with
//    EvictionKind::kLru). A trace keeps the tier of each acquire: runs the trace next uses on
//    DEVICE are also copied there ahead of time once they are resident on HOST, within the device
//    budget and the same look-ahead and in-flight limits, evicting only clean device copies needed
//    later. A failed prefetch (HOST or DEVICE) is reported by the acquire that needs that run and
//    by no other. A later TraceBegin(name) restarts the replay, or records afresh when the last
//    iteration mismatched too often. Without a trace eviction is LRU.
//  - Thread-safe: every public function may be called from any thread; one mutex guards the
//    state and is never held while waiting for I/O.
//
// Shape. A run holds one TierCopy per cached tier (offload/paging/tier_residency.h): its state
// (Absent, Loading, Resident, WritingBack), dirtiness, pins per tenant, the pending transfer and
// the thread that claimed it, and its errors; every state change goes through Transition. NVMe
// presence is the run's own fact (on_nvme). HOST and DEVICE sit behind one TierBackend
// (offload/paging/tier_backend.h), so each operation below takes the tier it works on; the
// inclusive rule (a DEVICE copy pins and stages through its HOST copy) is the one place the tiers
// differ (tier_coherence.cc). Transfers: tier_transfers.cc; trace replay and prefetch:
// tier_prefetch.cc.
#pragma once

#include <array>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/device.h"
#include "core/pinned_memory.h"
#include "core/result.h"
#include "io/backend.h"
#include "io/engine.h"
#include "io/queue.h"
#include "io/swap_space.h"
#include "offload/budget.h"
#include "offload/optimizer/chunk_layout.h"
#include "offload/paging/eviction_policy.h"
#include "offload/paging/tier_backend.h"
#include "offload/paging/tier_residency.h"
#include "offload/paging/trace.h"
#include "offload/paging/trace_cursor.h"
#include "offload/stats.h"
#include "offload/types.h"

namespace zoe::offload {

struct TierManagerOptions {
  // The device tier: "" for none, else a kind for CreateDeviceBackend ("host", "auto", "cuda").
  std::string device_backend;
  uint64_t device_budget_bytes = 0;  // 0 with a CUDA backend: the memory free on the device
  // Makes the device backend instead of device_backend (e.g. a stand-in with fault injection).
  std::function<Result<std::unique_ptr<DeviceBackend>>()> device_factory;
  uint64_t host_budget_bytes = uint64_t{1} << 30;  // pinned DRAM for resident runs
  ChunkLayoutOptions layout;                       // chunk size and tensor alignment
  std::vector<std::string> nvme_paths;             // swap directories (striped); at least one
  uint64_t nvme_capacity_bytes = uint64_t{4} << 30;
  // 0: the swap space stays nvme_capacity_bytes and a registration beyond it is refused (naming
  // `nvme_capacity_key` and the size that would fit). Else a registration that does not fit
  // grows it first, by at least this many bytes (io::SwapSpace::Grow).
  uint64_t nvme_growth_bytes = 0;
  std::string nvme_capacity_key = "nvme_capacity_bytes";  // the setting refusals name
  io::BackendKind io_backend = io::BackendKind::kAuto;
  uint32_t queue_depth = 32;
  uint64_t checksum_block = 0;  // 0: no checksums; else xxh3 per block (a multiple of 4096)
  uint64_t stripe_unit = uint64_t{1} << 20;  // bytes per nvme_paths entry before the next
  bool use_direct = true;  // O_DIRECT swap files (buffered where the filesystem refuses it)
  bool refuse_direct_for_testing = false;  // see io::OpenOptions
  // How long an acquire waits for a Release when every resident run is pinned before it fails
  // with Busy.
  std::chrono::nanoseconds busy_timeout = std::chrono::seconds(10);
  // Trace replay: the bytes of upcoming chunks the look-ahead spans, the prefetches that may be in
  // flight at once, and how the cursor matches and decides to re-record.
  uint64_t lookahead_bytes = uint64_t{256} << 20;
  uint32_t prefetch_in_flight = 8;  // each for HOST loads and for DEVICE copies
  TraceCursorOptions trace_cursor;
  // How a replayed trace picks eviction victims (core/vocabulary.h): by farthest next use or, for
  // comparison, least recently used (prefetching still follows the trace).
  EvictionKind eviction = EvictionKind::kOpt;
  // Makes the raw I/O engine instead of io::CreateEngine (e.g. to wrap it in a
  // FaultInjectingEngine). Empty: io::CreateEngine with io_backend and queue_depth.
  std::function<Result<std::unique_ptr<io::Engine>>()> engine_factory;
  // Test-only: DeviceWait bits whose waits are left out (a copy is taken as finished without
  // waiting for its event). 0 in production.
  uint8_t skipped_device_waits_for_testing = 0;
};

class TierManager {
 public:
  // Checks the options, opens the swap space (reserving nvme_capacity_bytes) and the I/O queue.
  static Result<std::unique_ptr<TierManager>> Create(TierManagerOptions options);
  // Waits for every transfer in flight; dirty data is not written (call Flush first to keep it).
  ~TierManager();
  TierManager(const TierManager&) = delete;
  TierManager& operator=(const TierManager&) = delete;

  // Places a tensor (see ChunkLayout::Register for what is rejected). OutOfMemory when its run
  // would not fit the HOST budget; NoSpace when the swap space cannot hold a new run of it.
  Result<TensorId> RegisterTensor(TensorDesc desc);
  Result<TensorId> Find(std::string_view name) const;

  // Makes the tensor resident in `tier` (DEVICE or HOST) and returns its bytes, pinned until
  // Release. Blocks for transfers and back-pressure (see the contract above). NotSupported for
  // DEVICE without a device tier; InvalidArgument for NVME.
  Result<void*> Acquire(TensorId tensor, Tier tier, Access access);
  // The same, run on another thread; the future holds what Acquire returns.
  std::future<Result<void*>> AcquireAsync(TensorId tensor, Tier tier, Access access);
  // Unpins the tensor's most recent acquire. FailedPrecondition when it is not acquired. Releasing
  // a write acquire marks the run dirty again on its tier, so writes made after a Flush are kept.
  Status Release(TensorId tensor);

  // A hint: starts reading the tensor's run into HOST if it is absent and fits the budget now
  // without evicting anything; never waits. For DEVICE, also copies the run to the device once it
  // is on HOST (at once when it is, when its load completes otherwise) if the device budget has
  // room then, again without evicting. Unknown tensors and tiers are still errors; NVME hints, and
  // DEVICE hints without a device tier, do nothing.
  Status Prefetch(TensorId tensor, Tier tier);
  // Copies every dirty device run to HOST, then writes every dirty HOST run to NVMe, and waits
  // (also for such copies and writes other calls started); the runs stay resident, clean.
  // Callers must not write into acquired memory while Flush runs.
  Status Flush();
  // Moves the tensor's run out of DEVICE and HOST (written back first when dirty). Busy while it
  // is pinned on either.
  Status Evict(TensorId tensor);

  // See the contract above. TraceBegin fails while a recording is open; TraceEnd fails when no
  // TraceBegin is open.
  Status TraceBegin(std::string_view name);
  Status TraceEnd();
  // True while the current iteration is being recorded (not replayed).
  bool trace_recording() const;
  // Writes a recorded trace to `path` (see offload/paging/trace.h for the format).
  Status TraceSave(std::string_view name, const std::string& path) const;
  // Reads a trace recorded against the same registrations and keeps it under its name, which is
  // returned; TraceBegin(name) then replays it.
  Result<std::string> TraceLoad(const std::string& path);

  const Stats& stats() const { return stats_; }
  nlohmann::json StatsJson() const { return stats_.ToJson(); }
  uint64_t host_reserved_bytes() const { return reserved_bytes(Tier::kHost); }
  uint64_t host_budget_bytes() const { return budget_bytes(Tier::kHost); }
  uint64_t device_reserved_bytes() const { return reserved_bytes(Tier::kDevice); }
  uint64_t device_budget_bytes() const { return budget_bytes(Tier::kDevice); }
  // The same for any tier: 0 for NVME and for a tier that is not configured.
  uint64_t reserved_bytes(Tier tier) const;
  uint64_t budget_bytes(Tier tier) const;
  // The swap files of the tensors, one per NVMe path (their bytes_written: the wear).
  const io::FileSet& swap_files() const { return swap_->files(); }
  bool has_device() const { return device_ != nullptr; }
  // The device backend's name ("" without a device tier) and whether it is a real GPU (device
  // addresses are then not host addresses).
  std::string device_name() const { return device_ ? device_->name() : std::string(); }
  bool device_is_gpu() const { return device_ && device_->is_real_gpu(); }
  // Whether [data, data + bytes) overlaps the device tier's memory (DeviceBackend::Holds).
  bool HoldsDeviceMemory(const void* data, uint64_t bytes) const {
    return device_ && device_->Holds(data, bytes);
  }
  std::string_view io_backend() const { return io_->backend(); }
  // Acquires currently waiting for a Release because every resident run (HOST or DEVICE) is
  // pinned.
  size_t waiting_acquires() const;

 private:
  using Clock = std::chrono::steady_clock;

  // The consecutive chunks created by one registration, moved as one unit.
  struct Run {
    ChunkId first_chunk;  // also the run's key in the eviction policies
    uint64_t bytes = 0;
    io::Extent extent;
    std::vector<TensorId> tensors;
    bool on_nvme = false;  // the backing store holds the run (its extent was written once)
    std::array<TierCopy, kCopyTierCount> copies;  // by CopyIndex; the DEVICE copy pins HOST's

    TierCopy& copy(Tier tier) { return copies[CopyIndex(tier)]; }
    const TierCopy& copy(Tier tier) const { return copies[CopyIndex(tier)]; }
  };

  // What the manager keeps for one cached tier.
  struct TierSlot {
    explicit TierSlot(Tier tier) : policy(tier) {}
    std::unique_ptr<TierBackend> backend;  // null: the tier is not configured
    std::unique_ptr<Budget> budget;
    EvictionPolicy policy;
    std::vector<size_t> prefetching;  // runs whose prefetch into the tier may still be in flight
  };

  // One outstanding acquire: where, and whether the caller may write through its pointer.
  struct Acquired {
    Tier tier = Tier::kHost;
    Access access = Access::kRead;
  };

  struct TensorState {
    size_t run = 0;
    uint64_t run_offset = 0;
    std::vector<Acquired> acquired;  // outstanding acquires, most recent last
  };

  // How far one acquire got, for statistics and the trace.
  struct Progress {
    bool waited = false;
    bool loaded = false;
    bool advanced = false;
  };

  // What a copy is brought in for: an acquire in its tier (which also brings the copy above in
  // line), or staging the copy above (always read whole, whatever the access; the copy above is
  // left alone).
  enum class CopyUse : uint8_t { kAcquire, kStaging };

  TierManager(TierManagerOptions options, ChunkLayout layout, std::unique_ptr<io::SwapSpace> swap,
              std::unique_ptr<io::IoQueue> io, PinnedMemoryPool pool,
              std::unique_ptr<DeviceBackend> device, std::unique_ptr<DeviceQueue> device_queue);

  TierSlot& slot(Tier tier) { return tiers_[CopyIndex(tier)]; }
  const TierSlot& slot(Tier tier) const { return tiers_[CopyIndex(tier)]; }
  bool HasTier(Tier tier) const;  // a configured cached tier

  // ---- registry (tier_manager.cc)
  Status CheckFitsNewRun(const TensorDesc& desc) const;
  // Grows the swap space when `desc` could need more than is free and growth is allowed
  // (TierManagerOptions::nvme_growth_bytes); called without mutex_ held (it may fallocate).
  Status GrowSwapFor(const TensorDesc& desc);
  Status AddRunIfNew(TensorId tensor);
  Result<const TensorEntry*> Entry(TensorId tensor) const;
  std::string Describe(const Run& run) const;

  // ---- acquire (tier_manager.cc)
  Result<void*> AcquireIn(TensorId tensor, Tier tier, Access access);
  // Returns with the lock held and the run's copy in `tier` resident (not pinned yet); for
  // kAcquire also with the copy above in line for `access`.
  Status Bring(std::unique_lock<std::mutex>& lock, TensorId tensor, Tier tier, Access access,
               const std::string& name, Progress* progress, CopyUse use);
  Status BringStep(std::unique_lock<std::mutex>& lock, TensorId tensor, Tier tier, Access access,
                   const std::string& name, Progress* progress, CopyUse use);
  // Stages the copy below (pinning it), reserves `tier`'s bytes and starts the load.
  Status LoadCopy(std::unique_lock<std::mutex>& lock, TensorId tensor, Tier tier, Access access,
                  const std::string& name, Progress* progress);
  void FinishAcquire(TensorId tensor, Access access, Tier tier, Clock::time_point start,
                     Progress* progress);
  void Pin(size_t run_index, Tier tier, Tenant tenant);
  void Unpin(size_t run_index, Tier tier, Tenant tenant);
  Status MarkDirty(size_t run_index, Tier tier);
  Status EvictStep(std::unique_lock<std::mutex>& lock, size_t run_index, Tier tier,
                   const std::string& name);
  Status FlushTier(std::unique_lock<std::mutex>& lock, Tier tier);
  void WaitForWriteBacks(std::unique_lock<std::mutex>& lock, Tier tier);

  // ---- the inclusive tiers (tier_coherence.cc)
  // True while an acquire for writing in `tier` of one of the run's tensors is outstanding: the
  // run must not be copied up from `tier` then.
  bool HasWriterIn(const Run& run, Tier tier) const;
  // What an acquire in `tier` must do first about the copy above; false when nothing.
  bool NeedsUpperSync(const Run& run, Tier tier, Access access) const;
  Status SyncUpperForAcquire(std::unique_lock<std::mutex>& lock, size_t run_index, Tier tier,
                             Access access, const std::string& name);
  // Back-pressure of `tier` when all of its copies are pinned: evicts a copy above, which gives
  // back its pin. `*unpinned` is false when every copy above is pinned too.
  Status EvictUpperCopy(std::unique_lock<std::mutex>& lock, Tier tier, bool* unpinned);
  // Records what a finished write-back of the copy in `tier` made true in the tier below.
  Status MarkWrittenBelow(size_t run_index, Tier tier);
  // The bytes below the run's copies: its swap offset and its HOST copy.
  LowerCopy LowerOf(Run& run);

  // ---- transfers (tier_transfers.cc)
  // Reserves `tier`'s bytes, evicting and waiting as needed.
  Status Reserve(std::unique_lock<std::mutex>& lock, Tier tier, uint64_t bytes,
                 std::string_view who);
  Status ReserveStep(std::unique_lock<std::mutex>& lock, Tier tier, uint64_t bytes,
                     bool* progressed);
  Status BusyError(Tier tier, uint64_t bytes, std::string_view who) const;
  // Requires reserved bytes (and a pin on the copy below, if any); gives them back on failure.
  Status StartLoad(size_t run_index, Tier tier, Access access);
  Status FillWithoutRead(size_t run_index, Tier tier);
  // Starts evicting an unpinned resident copy: a clean one is freed at once, a dirty one starts
  // its write-back.
  Status StartEviction(size_t run_index, Tier tier);
  Status StartWriteBack(size_t run_index, Tier tier, AfterWrite then);
  // Waits outside the lock for the copy's transfer (or for whoever waits on it) and applies it.
  Status FinishTransfer(std::unique_lock<std::mutex>& lock, size_t run_index, Tier tier);
  Status ApplyTransfer(size_t run_index, Tier tier, Status outcome);
  Status ApplyLoad(size_t run_index, Tier tier, Status outcome);
  Status ApplyWrite(size_t run_index, Tier tier, Status outcome);
  // Waits for any transfer of `tier` to finish; false when none is in flight.
  bool FinishAnyTransfer(std::unique_lock<std::mutex>& lock, Tier tier, Status* outcome);
  // Moves the copy by `event` (kFreed, kLoadFailed) and gives back its memory and bytes.
  void FreeCopy(size_t run_index, Tier tier, CopyEvent event);
  void ReleaseCopyMemory(size_t run_index, Tier tier);
  void GiveBackReservation(size_t run_index, Tier tier);

  // ---- traces and prefetch (tier_prefetch.cc)
  Status HintCopy(size_t run_index, Tier tier);
  // Records the acquire while recording, or advances the replay and issues its prefetches.
  // `acquiring_run` (the run being acquired, loading or pinned) is never made evictable here.
  void AdvanceTrace(TensorId tensor, Access access, Tier tier, size_t acquiring_run);
  void CountMatch(AcquireMatch match);
  void IssuePrefetches(Tier tier, size_t acquiring_run);
  PrefetchLimits LookAheadLimits(Tier tier) const;
  // Applies prefetches into `tier` that have completed and nobody waits for, except
  // `acquiring_run`'s; forgets finished ones.
  void CollectPrefetches(Tier tier, size_t acquiring_run);
  // Makes room for a prefetch of a chunk needed in `distance` events by evicting clean copies
  // needed later; false when that is not possible now.
  bool ReserveForPrefetch(size_t run_index, Tier tier, uint64_t distance);
  // Requires reserved bytes in `tier` and, above HOST, a resident HOST copy; gives the bytes back
  // on failure.
  Status StartPrefetch(size_t run_index, Tier tier);
  // After a load into the tier below: starts the copy a hint asked for, if `tier` has room now.
  void StartWantedCopy(size_t run_index, Tier tier);
  uint64_t NextUseOfRun(size_t run_index) const;
  Status StartReplay(const Trace& trace);
  void ForgetReplay();

  const TierManagerOptions options_;
  ChunkLayout layout_;
  std::unique_ptr<io::SwapSpace> swap_;
  Stats stats_;
  std::unique_ptr<DeviceBackend> device_;  // outlives tiers_ and runs_ (their device memory)

  mutable std::mutex mutex_;
  std::condition_variable changed_;
  // By CopyIndex. Their backends keep spare memory of freed copies; declared after device_:
  // destroyed before it.
  std::array<TierSlot, kCopyTierCount> tiers_{TierSlot(Tier::kDevice), TierSlot(Tier::kHost)};
  std::vector<Run> runs_;
  std::vector<size_t> run_of_chunk_;
  std::vector<TensorState> tensors_;
  size_t waiting_ = 0;
  TraceSet traces_;
  std::optional<TraceCursor> cursor_;  // while replaying
  bool open_iteration_ = false;        // between TraceBegin and TraceEnd
  bool warned_trace_full_ = false;

  std::unique_ptr<DeviceQueue> device_queue_;  // destroyed before runs_: waits for its copies
  std::unique_ptr<io::IoQueue> io_;            // last: destroyed first, waiting for its transfers
};

}  // namespace zoe::offload
