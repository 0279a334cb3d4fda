// OptimizerGroup: the offloaded optimizer state of one parameter group (fp32 master weights and
// the moments) and the pipelined step that streams it through the CPU kernels.
//
// Layout. The group's `count` parameters are cut into chunks of `chunk_elements` (the last one
// shorter). A chunk's whole state -- master (fp32), exp_avg and exp_avg_sq (state_dtype), each
// region starting on a 4096-byte boundary (in HOST chunks a few cache lines past one), and for
// int8 moments the scales of their quantization blocks (optimizer_group_layout.h) -- is one
// aligned extent, so one read and one write move it. A chunk lives on NVMe or in pinned HOST
// memory: placement kHost keeps every chunk in HOST; kNvme puts the first
// round(nvme_ratio * chunks) chunks on NVMe and the rest in HOST (DeepSpeed's
// offload_optimizer.ratio).
//
// Atomic steps. Every NVMe chunk owns two extents ("slots"); a step reads the live slot and writes
// the other one, and flips which slot is live only when every write of the step succeeded. HOST
// chunks are updated in place, after every NVMe write of the step succeeded. So a step either
// applies to the whole group or, when any read, write or checksum fails, leaves the state exactly
// as it was before the step and returns the error naming the group and the chunk.
//
// Single slot. With `slots` 1 an NVMe chunk owns one extent and a step writes its state back in
// place, halving the NVMe space (DeepSpeed's layout). The price is atomicity: a step (or a
// WriteState, or a checkpoint load) that fails after its first write may leave some chunks
// updated and others not, or a chunk torn. Such a failure is returned as it happens and the
// group is then broken: Step, AccumulateGrad, ReadState, WriteState and Save are
// FailedPrecondition naming the first failure until a checkpoint load commits, which rewrites
// every chunk. A failure before any write (a failed read, a skipped step) leaves the group usable
// as with two slots. A checkpoint load writes the chunks in place too, so a load whose later part
// fails, or a prepared load that is discarded, breaks the group the same way.
//
// Pipeline. Step first scans every gradient (non-finite check, global norm, clipping; the sum
// is taken in the same tiles and order as optim::ScanGradients over one buffer, however the views
// are cut, so the norm and the clip factor are bit-identical to an in-memory step), then
// streams the NVMe chunks through `buffer_count` pinned buffers: while chunk i is updated on all
// kernel threads, chunk i+1 (and further, up to the free buffers) is being read and chunk i-1
// written. A skipped step (a non-finite gradient) reads and writes nothing and does not advance the
// step counter.
//
// Caller buffers. Gradients and parameters are given as lists of views in host memory that,
// concatenated, cover the group's `count` elements; the two lists may be cut differently. Views
// are borrowed for the call (for AccumulateGrad: until the Step that consumes them returns).
// Updated parameters are written in each view's dtype (fp32 copies the master; bf16/fp16 are
// written by the fused kernel) as each chunk is updated: after a failed step the views of the
// chunks updated before the failure already hold their new values while the state does not; the
// next successful step writes every view again. A step's parameter view with null data is not
// written (the master and moments of its elements are still updated): a caller that holds only
// some parameters in memory passes those.
//
// Master in the caller's parameters (options.master_in_params). The fp32 parameters given to
// Create ARE the master weights (as DeepSpeed's CPU Adam keeps them): the group borrows them for
// its whole life, updates them in place in the kernel's pass, and its chunks hold only the
// moments, saving 4 bytes per parameter and the write-back copy. Every chunk must be in HOST
// (placement kHost), the initial views fp32, and speculation off (its spare copy of a chunk cannot
// hold a master that lives outside it); InvalidArgument naming the first violation otherwise.
// ReadState, WriteState, Save and Load address the master in the caller's memory, so state reads,
// state dicts and checkpoint files are the same as without the option (a checkpoint written by
// one form loads into the other). The caller must keep the buffers alive and in place; writing
// them between steps changes the master (as an in-place write to a torch parameter changes
// DeepSpeed's). A step needs no parameter views then (given ones are written as usual).
//
// Speculation (options.speculative). After Speculate(args) gives a step's hyper-parameters, loss
// scale and parameter views ahead of its gradients, every chunk whose gradients AccumulateGrad
// completes is updated at once, assuming finite gradients and no clipping: an NVMe chunk through
// the pipeline into its inactive slot (not flipped), a HOST chunk into its spare buffer (a second
// copy of every HOST chunk, taken from the pinned pool at Create and counted in pinned_bytes()),
// its parameter views written as a step writes them. Reads run ahead of the gradients: the
// NVMe chunks expected next (those that completed next in the previous accumulation) are read
// as pipeline buffers free up -- at most buffer_count - 2 of them, checked at Speculate and at
// each AccumulateGrad -- and a chunk read ahead is updated as soon as it completes. A chunk not
// read ahead has its read started when it completes, and is updated when the next NVMe chunk
// completes (or the gradients cover the group), so that read overlaps the wait for that gradient.
// Each write stays in flight while the next chunks are updated; the buffers of finished writes go
// to reads ahead, and the Step waits for the rest. The previous version stays untouched until
// the Step that follows decides, once the global inf/NaN check and norm are known:
//  - finite, clip factor 1 and the same hyper-parameters and loss scale: commit -- the remaining
//    chunks are updated as in any step and every slot flips (spares swapped in) at once;
//  - a non-finite gradient: discard -- the step is skipped, nothing changed; the parameter views
//    of the updated chunks are written back from their (untouched) master, which is what the step
//    before wrote there;
//  - clipping active (or other hyper-parameters): recompute -- the whole step runs again from the
//    untouched version with the real clip factor.
// Each way the state and parameter views are bit-identical to the same step without speculation.
//
// Backing off. A recompute costs the speculative updates and their writes on top of the step, and
// clipping that is active on one step is usually active on the next (early in training, or with
// a small max_grad_norm), so after a step that recomputed, the next Speculate calls decline: 1
// after the first such step, then 2, 4, ... up to options.max_speculation_backoff while the steps
// that speculate keep recomputing; a step that commits starts over at 1. A declined Speculate
// keeps its hyper-parameters and parameter views for the Step, and AccumulateGrad still starts
// the reads of completed chunks (the overlap without the updates). Results do not depend on it.
// A speculative update that fails (I/O, checksum) is reported by the Step, which then changes
// nothing and keeps the gradients, like any failed step. Speculation costs, besides the spares,
// the writes of the chunks it recomputes or discards.
//
// Thread safety: one thread at a time per group (the engine serialises calls); the group borrows
// the resources it was created with, which may be shared with other groups.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/executor.h"
#include "core/pinned_memory.h"
#include "core/result.h"
#include "io/queue.h"
#include "io/swap_space.h"
#include "offload/optimizer/optimizer_group_layout.h"
#include "offload/types.h"
#include "optim/chunk.h"
#include "optim/types.h"

namespace zoe::offload {

class CheckpointWriter;
class CheckpointReader;

// A borrowed host buffer of `count` elements of `dtype`. A GradView with null `data` and
// `count` > 0 says that those elements have no gradient in this step (see "Segments" above).
struct GradView {
  const void* data = nullptr;
  optim::DType dtype = optim::DType::kFloat32;
  size_t count = 0;
};
struct ParamView {
  void* data = nullptr;
  optim::DType dtype = optim::DType::kFloat32;
  size_t count = 0;
};

struct OptimizerGroupOptions {
  std::string name;  // non-empty; named in errors, statistics and checkpoints
  optim::Kind kind = optim::Kind::kAdamW;
  optim::DType state_dtype = optim::DType::kFloat32;  // moments: kFloat32, kBFloat16 or kInt8
  size_t count = 0;                                   // parameters, > 0
  // Lengths of the segments, in element order, summing to `count` (a length may be 0, for a
  // parameter without elements). Empty: one segment, the whole group.
  std::vector<size_t> segments;
  double max_grad_norm = 0.0;               // > 0 clips the global norm; 0: no clipping
  Tier placement = Tier::kNvme;             // kNvme or kHost
  double nvme_ratio = 1.0;                  // (0, 1], with kNvme
  size_t chunk_elements = size_t{1} << 23;  // the pipeline unit, > 0
  uint32_t buffer_count = 4;                // pinned pipeline buffers, >= 2
  bool speculative = false;                 // allows Speculate; HOST chunks get spare buffers
  // Speculate calls declined after a recompute, at most ("Backing off"); 0: never declines.
  uint32_t max_speculation_backoff = 64;
  uint32_t slots = 2;  // NVMe extents per chunk: 2 (atomic steps) or 1 (in place, "Single slot")
  bool master_in_params = false;  // the initial parameters are the master ("Master in the caller's
                                  // parameters"); borrowed for the group's life
  optim::RunOptions run;          // kernel threads, ISA, tile size
};

// What a group borrows; all must outlive it. `io` and `swap` are needed only when some chunk is
// on NVMe.
struct OptimizerResources {
  io::IoQueue* io = nullptr;
  io::SwapSpace* swap = nullptr;
  PinnedMemoryPool* pinned = nullptr;  // pipeline buffers and HOST chunks come from it
};

struct StepArgs {
  optim::HyperParams hyper;           // hyper.kind must be the group's kind
  std::span<const GradView> grads;    // empty: the gradients given to AccumulateGrad
  std::span<const ParamView> params;  // empty: no parameters written
  double loss_scale = 1.0;            // > 0; gradients are divided by it
  // Set by a sharded group (offload/distributed/sharded_group.h): called once, after the gradients
  // are scanned and before anything is read for the update, with this group's scan; returns the
  // scan the step uses instead (the sum over every rank's shard, so all ranks skip and clip alike).
  // An error fails the step with the state unchanged. Empty: the group's own scan.
  std::function<Result<optim::GradScan>(const optim::GradScan& local)> agree_scan;
};

struct StepReport {
  bool skipped = false;         // a gradient was inf/NaN: nothing changed
  double grad_norm = 0.0;       // of the unscaled present gradients (inf when skipped)
  int64_t steps_taken = 0;      // after this call
  size_t segments_updated = 0;  // segments with a gradient in this step (0 when skipped)
  uint64_t bytes_read = 0;      // NVMe bytes
  // State the step found still in its pinned buffers, left there by the step before (which
  // wrote it), instead of reading it again.
  uint64_t bytes_reused = 0;
  uint64_t bytes_written = 0;
  double seconds = 0.0;          // the whole call
  double io_wait_seconds = 0.0;  // time the pipeline waited for reads or writes
  double compute_seconds = 0.0;  // time in the update kernels
  // Speculation (see above): chunks updated speculatively before this Step, and of those the
  // ones whose update was final (committed), done again (recomputed) or dropped (discarded).
  size_t chunks_speculative = 0;
  size_t chunks_committed = 0;
  size_t chunks_recomputed = 0;
  size_t chunks_discarded = 0;
};

// Speculation counts of a group since it was created, summed over its steps.
struct SpeculationStats {
  uint64_t steps = 0;           // steps that speculated
  uint64_t steps_declined = 0;  // Speculate calls declined while backing off
  uint64_t chunks_speculative = 0;
  uint64_t chunks_committed = 0;
  uint64_t chunks_recomputed = 0;
  uint64_t chunks_discarded = 0;
};

// Which state array ReadState and WriteState address.
enum class StateSlot : uint8_t { kMaster = 0, kExpAvg = 1, kExpAvgSq = 2 };

// The pinned bytes a group takes from its pool: `buffers` pipeline buffers of `buffer_bytes`
// (one chunk each, for its NVMe chunks) and its HOST chunks, `host_bytes` (twice when
// speculative).
struct PinnedNeed {
  size_t buffers = 0;
  uint64_t buffer_bytes = 0;
  uint64_t host_bytes = 0;
  uint64_t total() const { return buffers * buffer_bytes + host_bytes; }
};

// What OptimizerGroup::Create, before it allocates, finds a group with `options` needs from a
// pool of `page`-byte pages when its state regions align to `io_block` (4096, or the swap's
// checksum block).
PinnedNeed GroupPinnedNeed(const OptimizerGroupOptions& options, uint64_t page, uint64_t io_block);

// "[offset, offset + count)" for a message, without wrapping: a range that ends past 2^64 - 1
// prints as "[offset, offset + count)" with both numbers.
std::string DescribeElementRange(uint64_t offset, uint64_t count);

// The longest group name: a group's checkpoint file is "<name>.state", and a file name has at
// most NAME_MAX (255) bytes.
inline constexpr size_t kMaxGroupNameBytes = 255 - 6;

// Ok when a checkpoint can be saved under group `name`: its file "<name>.state" passes
// CheckCheckpointFileName (the rule every save applies). InvalidArgument naming the rule and
// kMaxGroupNameBytes otherwise. Group creation applies it.
Status CheckGroupName(std::string_view name);

// The largest step count a group or segment may hold: the step after it, one more, is the count
// its bias correction uses and must fit an int64_t.
inline constexpr int64_t kMaxStepCount = std::numeric_limits<int64_t>::max() - 1;

// Ok for a step count in [0, kMaxStepCount]; otherwise InvalidArgument "<what> = <steps> is out
// of range; allowed: [0, kMaxStepCount]".
Status CheckStepCount(std::string_view what, int64_t steps);

class OptimizerGroup {
 public:
  // Validates the options (InvalidArgument naming the field and its allowed range), checks that
  // the swap space and the pinned budget can hold the state (NoSpace / OutOfMemory giving the
  // bytes needed and free), allocates the chunks and writes the initial state: master from
  // `initial_params` (which must cover `count`; bf16/fp16 widened exactly), moments zero. A view
  // with null data leaves its elements' master zero, for WriteState to fill (a caller whose
  // parameters do not fit in memory at once writes them one at a time); not with
  // master_in_params.
  static Result<std::unique_ptr<OptimizerGroup>> Create(OptimizerGroupOptions options,
                                                        OptimizerResources resources,
                                                        std::span<const ParamView> initial_params);
  // Waits for transfers in flight and frees the extents.
  ~OptimizerGroup();
  OptimizerGroup(const OptimizerGroup&) = delete;
  OptimizerGroup& operator=(const OptimizerGroup&) = delete;

  // One step (see the contract above).
  Result<StepReport> Step(const StepArgs& args);

  // Hands over gradients [offset, offset + grad.count) ahead of the Step that consumes them
  // (StepArgs::grads empty): scans them at once and, for every chunk they complete, starts reading
  // its state into a free pipeline buffer, so the step that follows waits only for what is still
  // in flight. Ranges must not overlap; the next Step needs them to cover the whole group
  // (FailedPrecondition naming the first missing range otherwise; the gradients stay). Until that
  // Step, a Step with gradients, WriteState, Save and Load are FailedPrecondition. A read started
  // here that fails is reported by the Step. A Step that fails keeps the gradients, so it can be
  // retried (after a skipped or successful step they are consumed). With speculation armed
  // (Speculate), every chunk completed is also updated at once; see "Speculation".
  Status AccumulateGrad(size_t offset, const GradView& grad);
  // Drops the gradients given to AccumulateGrad since the last Step (and speculation armed for
  // it): the reads they started are released, the state is unchanged, and the next Step needs
  // gradients again. For a caller abandoning an iteration after a failure.
  void DiscardGradients();
  // The scan of the gradients given to AccumulateGrad since the last Step, as that Step takes it
  // (their sum of squares, still multiplied by the loss scale; inf or NaN when one is not
  // finite): for a caller that clips several groups by the norm of them all. FailedPrecondition
  // until the gradients cover the group.
  Result<optim::GradScan> AccumulatedScan() const;

  // Arms speculation for the next step (see "Speculation"): args.hyper, args.loss_scale and
  // args.params (borrowed until that Step returns) are used to update each chunk as AccumulateGrad
  // completes it; args.grads must be empty. FailedPrecondition unless options.speculative and no
  // gradient is accumulated yet; InvalidArgument for bad arguments, as Step. The Step that
  // follows must use accumulated gradients and give either no parameter views or the same ones.
  // Drops a prepared checkpoint load (its inactive slots would be overwritten).
  Status Speculate(const StepArgs& args);
  const SpeculationStats& speculation_stats() const;

  // Copies state elements [offset, offset + out.size()) out as fp32 / in from fp32 (rounded to the
  // state dtype for the moments). For state dicts and tests; each call reads (and writes) every
  // chunk it touches. WriteState is atomic like a step.
  Status ReadState(StateSlot slot, size_t offset, std::span<float> out) const;
  Status WriteState(StateSlot slot, size_t offset, std::span<const float> values);

  // Chunk reads AccumulateGrad started that the next Step will consume (0 outside accumulation).
  size_t reads_started() const;

  // Steps that updated the group: not skipped, and with at least one segment present.
  int64_t steps_taken() const { return steps_taken_; }
  // Sets steps_taken and the step count of every segment to `steps` (CheckStepCount passed).
  void set_steps_taken(int64_t steps);
  // The step count of each segment (the bias correction of its next update uses it plus one).
  std::span<const int64_t> segment_steps() const { return segment_steps_; }
  // Sets every segment's step count (one entry per segment, each passing CheckStepCount;
  // InvalidArgument naming the first bad entry otherwise) and steps_taken to the largest of them.
  Status SetSegmentSteps(std::span<const int64_t> steps);
  size_t segment_count() const { return segment_steps_.size(); }
  const OptimizerGroupOptions& options() const { return options_; }
  size_t count() const { return options_.count; }
  size_t chunk_count() const;
  size_t nvme_chunk_count() const;
  // Where each chunk's regions lie (chunks [nvme_chunk_count(), chunk_count()) are the HOST ones).
  const StateLayout& layout() const;
  uint64_t pinned_bytes() const;  // pipeline buffers plus HOST chunks
  uint64_t nvme_bytes() const;    // every slot of every NVMe chunk
  // The failure that broke a single-slot group (see "Single slot"); OK while it is usable.
  const Status& broken() const;

  // Identity written into checkpoints and compared on load: name, kind, count, state dtype,
  // chunk_elements (a checkpoint loads into a group with the same identity only).
  nlohmann::json Identity() const;
  // The size of the file Save writes: the used regions of every chunk, without padding.
  uint64_t checkpoint_bytes() const;
  // Streams the state chunk by chunk into the file "<name>.state" of `writer` (never the whole
  // state in memory), with the identity, steps_taken, and the segments' lengths and step counts
  // in the file's metadata. A checkpoint without segment step counts (older ones) loads with
  // every segment at steps_taken; one whose segments differ from the group's is
  // FailedPrecondition naming both.
  Status Save(CheckpointWriter& writer) const;
  // Reads the group's file from `reader` into the inactive slots, verifying the checksum, and
  // makes it live only when all of it was read and verified; on any error nothing changes.
  // FailedPrecondition naming both identities when the checkpoint is of another group.
  // PrepareLoad then CommitLoad.
  Status Load(CheckpointReader& reader);
  // Load in two phases, so that several groups load all or nothing: PrepareLoad does everything
  // that can fail -- the identity check, FailedPrecondition while gradients are accumulated, the
  // NVMe chunks written to their inactive slots, the HOST chunks read into staging buffers, the
  // checksum verified by EndFile -- and changes nothing a caller can observe. CommitLoad then
  // makes the prepared state live (flips the slots, swaps the staging buffers in, sets the step
  // count, drops reads that gradients accumulated since PrepareLoad started from the old state)
  // and cannot fail; it does nothing when no load is prepared. A prepared load that is not
  // committed is dropped by DiscardLoad, the next PrepareLoad, Step or WriteState: its inactive
  // slots are simply never made live.
  //
  // Memory: the staging buffers of the HOST chunks come from the group's pinned pool, so a load
  // needs, besides the group's own memory, pinned budget for a second copy of its HOST chunks
  // until CommitLoad (they replace the old ones then); OutOfMemory naming the bytes otherwise,
  // with nothing changed. Loading in place instead would leave a half-loaded state after a late
  // read or checksum error.
  Status PrepareLoad(CheckpointReader& reader);
  void CommitLoad();
  void DiscardLoad();

 private:
  struct Impl;
  OptimizerGroup(OptimizerGroupOptions options, std::unique_ptr<Impl> impl);
  Status CheckStepArgs(const StepArgs& args) const;
  Status CheckCheckpoint(const CheckpointReader& reader, int64_t* steps,
                         std::vector<int64_t>* segment_steps) const;
  Status CheckSegmentSteps(const CheckpointReader& reader, const nlohmann::json& meta,
                           int64_t steps, std::vector<int64_t>* segment_steps) const;
  Status CheckStateRange(StateSlot slot, size_t offset, size_t length) const;
  Status CheckAbsentViews(std::span<const GradView> grads) const;
  void CountStep(const std::vector<bool>& present_segments, StepReport* report);
  // Stores the part of `values` (state elements from `offset`) that falls in `chunk` into region
  // `region` of the chunk's state at `state`.
  Status CheckQuantizable(StateSlot slot, size_t offset, std::span<const float> values) const;
  Status StoreState(size_t chunk, std::byte* state, size_t region, size_t offset,
                    std::span<const float> values) const;

  OptimizerGroupOptions options_;
  std::unique_ptr<Impl> impl_;
  int64_t steps_taken_ = 0;
  std::vector<int64_t> segment_steps_;  // one per segment
};

}  // namespace zoe::offload
