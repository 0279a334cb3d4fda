// Internals of OptimizerGroup shared by its source files (optimizer_group.cc: validation, the
// step and state access; optimizer_group_pipeline.cc: memory, a broken group, accumulation;
// optimizer_group_speculation.cc; optimizer_group_checkpoint.cc: Save and Load). The NVMe
// chunks' I/O, the pipeline buffers and the step plan are units of their own (chunk_pipeline.h,
// pipeline_buffer_pool.h, nvme_slots.h, step_plan.h). Not part of the interface.
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "offload/optimizer/chunk_pipeline.h"
#include "offload/optimizer/chunk_update.h"
#include "offload/optimizer/optimizer_group.h"
#include "offload/optimizer/optimizer_group_layout.h"
#include "offload/optimizer/optimizer_group_scan.h"
#include "offload/optimizer/step_plan.h"

namespace zoe::offload {
namespace detail {

using Clock = std::chrono::steady_clock;

inline double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// A caller's view placed at its element offset in the group.
struct PlacedView {
  size_t offset = 0;
  std::byte* data = nullptr;  // const for gradients; never written through for them. Null for
                              // a gradient view: no gradient for these elements (absent)
  optim::DType dtype = optim::DType::kFloat32;
  size_t count = 0;
  size_t end() const { return offset + count; }
  bool present() const { return data != nullptr; }
};

using PlacedViews = std::vector<PlacedView>;

// The segment holding `element` given the segments' exclusive ends: the first segment ending
// past it (so never an empty one).
inline size_t SegmentAt(std::span<const size_t> segment_ends, size_t element) {
  return static_cast<size_t>(std::upper_bound(segment_ends.begin(), segment_ends.end(), element) -
                             segment_ends.begin());
}

// The view holding `element` (the views cover it).
inline PlacedViews::const_iterator FindView(const PlacedViews& views, size_t element) {
  auto it = std::upper_bound(views.begin(), views.end(), element,
                             [](size_t e, const PlacedView& v) { return e < v.offset; });
  return std::prev(it);
}

inline std::byte* ElementAt(const PlacedView& view, size_t element) {
  return view.data + (element - view.offset) * DTypeSize(view.dtype);
}

// What one step hands to the update of each chunk.
struct StepInputs {
  const optim::HyperParams* hyper;
  std::span<const size_t> segment_ends;   // exclusive end of each segment, ascending
  std::span<const int64_t> segment_step;  // the step each segment takes (its count plus one)
  optim::GradScaling scaling;
  optim::DType state_dtype;
  const PlacedViews* grads;
  const PlacedViews* params;  // empty: no parameters written
  const optim::RunOptions* run;
  // The master in the caller's fp32 parameters (master_in_params); null or empty: in the chunk.
  const PlacedViews* masters = nullptr;
  bool external_master() const { return masters != nullptr && !masters->empty(); }
};

// Elements [from, to) of fp32 views that cover them, gathered into `out` (element `from` at
// out[0]), and the inverse (memmove: a caller may hand a view its own values back).
void GatherFromViews(const PlacedViews& views, size_t from, size_t to, float* out);
void ScatterToViews(const PlacedViews& views, size_t from, size_t to, const float* values);

// Updates one chunk whose state is at `base` in stripes on the kernel threads (chunk_update.h),
// verifying and computing its block checksums as `checksums` asks: the one update path of every
// step, speculative or not.
Status UpdateChunkState(const ChunkRegions& regions, std::byte* base, const StepInputs& in,
                        const ChunkChecksums& checksums = {});

}  // namespace detail

struct OptimizerGroup::Impl {
  // A checkpoint load read and verified but not yet live (OptimizerGroup::PrepareLoad).
  struct PreparedLoad {
    std::vector<size_t> nvme_chunks;  // written to their inactive slots
    std::vector<PinnedBuffer> host;   // the new HOST chunks, in chunk order
    int64_t steps_taken = 0;
    std::vector<int64_t> segment_steps;
    bool in_place = false;      // single slot: the NVMe chunks already hold the checkpoint's state
    std::vector<float> master;  // master_in_params: the checkpoint's master, for every element
  };
  // A step whose chunks are updated as their gradients complete (OptimizerGroup::Speculate).
  struct Speculation {
    // Defined out of line: the member defaults below are usable only once Impl is complete,
    // and std::optional<Speculation> asks whether it is default-constructible before that.
    Speculation();
    optim::HyperParams hyper;
    double loss_scale = 1.0;
    optim::GradScaling scaling;  // the step's own when its gradients are finite and not clipped
    detail::PlacedViews params;  // empty: no parameters written
    std::vector<int64_t> segment_step;
    optim::DType state_dtype = optim::DType::kFloat32;
    optim::RunOptions run;
    std::vector<bool> updated;    // per chunk: its new state waits in its inactive slot or spare
    std::vector<size_t> waiting;  // complete NVMe chunks not updated yet, oldest first
    size_t updated_count = 0;
    Status failure;         // of the first speculative update that failed
    PipelineTotals totals;  // of the speculative updates, added to the Step's report
    bool declined = false;  // backing off: the Step takes the views, no chunk is updated early
  };
  // Lays out the chunks; AllocateState then takes the memory and the extents.
  Impl(const OptimizerGroupOptions& options, OptimizerResources borrowed, uint64_t io_block);
  ~Impl();

  bool on_nvme(size_t chunk) const { return chunk < nvme_count; }
  std::byte* host_state(size_t chunk) { return host[chunk - nvme_count].data(); }
  std::string ChunkName(size_t chunk) const { return pipeline.ChunkName(chunk); }

  // optimizer_group_pipeline.cc: memory, a broken group, accumulation.
  Status AllocateState(uint32_t buffer_count, bool speculative);
  // Single slot: `failure` came after `written` bytes were written in place; if any were, the
  // state may be torn and the group is broken until a checkpoint load commits. Returns `failure`.
  Status BreakIfWritten(Status failure, uint64_t written);
  // FailedPrecondition naming the failure that broke the group, before `what`; OK otherwise.
  Status CheckUsable(std::string_view what) const;
  // Drops a prepared load; one written in place breaks the group (its state is the checkpoint's
  // while its step counts are not).
  void DropPreparedLoad();
  void ResetAccumulation();
  Status CheckCoverage() const;
  Status CheckIdle(std::string_view what) const;
  // optimizer_group_segments.cc: segments and absent gradients.
  // The segment holding `element` (< count): the first whose end is past it.
  size_t SegmentOf(size_t element) const;
  // InvalidArgument unless the absent range [offset, offset + length) is whole segments.
  Status CheckAbsentRange(std::string_view what, size_t index, size_t offset, size_t length) const;
  // Per segment / per chunk: whether some present gradient view overlaps it.
  std::vector<bool> PresentSegments(const detail::PlacedViews& grads) const;
  std::vector<bool> PresentChunks(const detail::PlacedViews& grads) const;
  // optimizer_group_speculation.cc
  // The gradient views overlapping chunk `chunk`, which accumulated views cover.
  detail::PlacedViews ChunkGrads(size_t chunk) const;
  // Updates chunk `chunk`, whose gradients are complete, into its inactive slot or spare.
  // HOST chunks at once; NVMe chunks join `waiting` (SpeculateWaiting), and are updated at once
  // when `read_ahead` (their read started before their gradients completed).
  void SpeculateChunk(size_t chunk, bool read_ahead);
  // Updates the waiting NVMe chunks, all but the newest when `keep_newest`.
  void SpeculateWaiting(bool keep_newest);
  // Read-ahead of a speculative step: starts the reads of the NVMe chunks expected to complete
  // next (in the order they completed in the last accumulation), before their gradients arrive,
  // so a chunk's update can start when its gradient does. At most pipeline buffers - 2 such reads
  // are in flight, so the buffers held by reads of incomplete chunks (these and the newest chunk
  // kept waiting) always leave one for the pipeline.
  void ReadAhead();
  // Frees the buffers of the speculative writes already completed (a failed one is the
  // speculation's failure), without waiting.
  void ReapSpeculativeWrites();
  // The speculated step's inputs for a chunk whose gradient views are `grads`.
  detail::StepInputs SpeculativeInputs(const detail::PlacedViews& grads) const;
  // The parameter views of a speculative step are those given to Speculate: `params` (those given
  // to Step) must be the same or none (InvalidArgument).
  Status UseSpeculatedParams(detail::PlacedViews* params) const;
  // `present` without the chunks speculation updated (unless it failed): what a commit updates.
  std::vector<bool> NotSpeculated(const std::vector<bool>& present) const;
  // Which way the Step goes, once its scaling is known (a failed speculation aside).
  enum class SpeculationOutcome { kNone, kCommit, kDiscard, kRecompute };
  SpeculationOutcome DecideSpeculation(const optim::StepScaling& scaling,
                                       const optim::HyperParams& hyper,
                                       std::span<const int64_t> segment_step) const;
  // Waits for the writes speculative updates left in flight and frees their buffers; a failed
  // one becomes the speculation's failure.
  void FinishSpeculativeWrites();
  // The speculated chunks' parameter views written back from their live master.
  Status RestoreParams();
  // After the Step (`status`: its outcome): counts what became of the speculated chunks into
  // `report` and the totals, adds the speculative I/O to the report, and disarms speculation.
  void EndSpeculation(SpeculationOutcome outcome, const Status& status, StepReport* report);
  // optimizer_group_checkpoint.cc
  Status AllocateLoadStaging(std::vector<PinnedBuffer>* staging);
  // optimizer_group.cc
  Status WriteInitialState(const detail::PlacedViews& params, const optim::RunOptions& run);
  // The views of a step, placed, and the step each segment takes.
  struct StepViews {
    const detail::PlacedViews& grads;
    const detail::PlacedViews& params;
    std::span<const int64_t> segment_step;
  };
  // The Step once its views are placed; fills `report` and returns the step's status.
  Status RunStep(const StepArgs& args, const OptimizerGroupOptions& options, const StepViews& views,
                 StepReport* report);
  Result<optim::StepScaling> ScaleStep(const StepArgs& args, const OptimizerGroupOptions& options,
                                       const detail::PlacedViews& grads);
  StepPlan PlanThisStep(const std::vector<bool>& present_chunks, bool commit) const;
  Status UpdateHostChunks(const StepPlan& plan, const detail::StepInputs& inputs);
  // `commit`: the chunks speculation updated are final; the others present are updated now.
  Status ApplyStep(const detail::StepInputs& inputs, const std::vector<bool>& present_chunks,
                   bool commit, StepReport* report);

  std::string name;
  size_t count;
  Status broken;                     // single slot: the failure that left the state possibly torn
  std::vector<size_t> segment_ends;  // exclusive end of each segment, ascending; last = count
  OptimizerResources resources;
  size_t nvme_count;   // chunks [0, nvme_count) are on NVMe, the rest in HOST
  StateLayout layout;  // its HOST chunks staggered
  // master_in_params: the caller's fp32 parameters, which are the master (borrowed); else empty.
  detail::PlacedViews masters;
  ChunkPipeline pipeline;  // the NVMe chunks: their slots, the buffers, reads ahead, the cache
  std::vector<PinnedBuffer> host;  // chunks [nvme_count, chunk_count)
  // The options the step updates the HOST chunks with: the group's, with StoreMode::kAuto decided
  // for all of them at once (HostRunOptions).
  optim::RunOptions host_run;
  // Gradients handed over by AccumulateGrad for the next step.
  GradScanner scanner;
  std::map<size_t, detail::PlacedView> accumulated;  // by offset
  size_t accumulated_elements = 0;                   // their elements (they do not overlap)
  std::vector<size_t> chunk_covered;                 // elements of each chunk accumulated
  std::vector<size_t> chunk_present;                 // of those, elements with a gradient
  // The NVMe chunks in the order their gradients completed during this accumulation, and during
  // the last one (what ReadAhead expects).
  std::vector<size_t> completion_order;
  std::vector<size_t> expected_completions;

  std::optional<PreparedLoad> prepared_load;

  std::optional<Speculation> speculation;  // armed by Speculate until the Step
  std::vector<PinnedBuffer> host_spare;    // per HOST chunk, with options.speculative
  // When Speculate declines ("Backing off" in optimizer_group.h).
  class SpeculationBackoff {
   public:
    explicit SpeculationBackoff(uint32_t max_declined) : max_(max_declined) {}
    // Whether this Speculate call declines; counts it against the calls left to decline.
    bool Decline();
    // The outcome of a step that speculated: a recompute makes the next calls decline, a commit
    // starts the backing off over, a discard (a skipped step) changes nothing.
    void Record(SpeculationOutcome outcome);

   private:
    uint32_t max_;
    uint32_t remaining_ = 0;  // calls still to decline
    uint32_t next_ = 1;       // calls to decline after the next recompute
  };
  SpeculationStats speculation_totals;
  SpeculationBackoff speculation_backoff;
};

}  // namespace zoe::offload
