// ShardedGroup: one rank's part of an optimizer group sharded across N data-parallel ranks
// (ZeRO stages 1 and 2). The group's `count` elements, concatenated, are cut into N contiguous
// shards: rank r holds elements [floor(r * count / N), floor((r + 1) * count / N)) -- sizes differ
// by at most one element -- in an ordinary OptimizerGroup of its own engine (its own DRAM and NVMe
// path), so each rank keeps 1/N of the master weights and moments.
//
// Segments. The group's segments (a framework's parameters, OptimizerGroupOptions::segments) are
// cut at the shard's edges: the local group has one segment per global segment, in the same order,
// holding its intersection with the shard (0 elements when the parameter lies elsewhere). A
// parameter split across ranks therefore has a piece on each of them, with the same step count.
//
// One step (Step):
//  1. gradients given with the step (every rank's whole local gradient): which segments have a
//     gradient on some rank is agreed by an all-reduce (a segment counts as present when any rank
//     has it; absent elements count as zero on the ranks without it), then the gradient, widened to
//     fp32, is reduce-scattered and divided by N (the average, as DistributedDataParallel does).
//     Both this reduce-scatter and the all-gather of step 3 run in rounds: round k moves elements
//     [k * options.round_elements, (k + 1) * options.round_elements) of every rank's shard
//     (fewer, or none, where a shard ends) through one buffer the group keeps.
//     No gradients: the shard's gradients given to the local group with Engine::AccumulateGrad.
//  2. the local group steps with its scan replaced by the sum of every rank's scan (one all-reduce
//     of the sum of squares, of a failure flag per rank and, where parameters are broadcast, of
//     each rank's parameter layout, which must be rank 0's): every rank skips a non-finite step,
//     and clips by the global norm, together.
//  3. one all-reduce of the outcome (a failure flag per rank); then, when every rank succeeded and
//     the step was not skipped, the updated shards go into the caller's parameter views, each in
//     its dtype: where the collectives offer Broadcast, each rank writes its shard into its own
//     part of the views and every rank's part is broadcast straight into the peers' views (no
//     buffer, no fp32 round trip for the peers' parts); otherwise they are all-gathered (fp32) in
//     rounds and converted into the views. Views of the rank's shard only take its own updated
//     values (written by the step, in their dtype) and nothing is gathered: the caller gathers,
//     e.g. on the device holding the model.
// A rank that fails anywhere still makes every collective call of steps 2 and 3 with its flag set,
// so every rank returns an error within the collectives' own time bounds: the failing rank its
// own error, the others Aborted naming the failed ranks. The failing rank's state is as before the
// step (OptimizerGroup's contract), but ranks that committed keep their update: after a failed
// step the ranks are out of step, and training resumes from a checkpoint.
//
// Memory: besides the shard's buffers (its fp32 gradient and parameters), the group keeps
// world_size x min(round_elements, largest shard) fp32 elements for the collectives' rounds (the
// parameters' all-gather uses them only without Broadcast).
//
// Thread safety: one thread at a time (the collectives are called on the stepping thread).
#pragma once

#include <cstddef>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "core/result.h"
#include "offload/distributed/collectives.h"
#include "offload/engine.h"

namespace zoe::offload {

// Elements [begin, end) of a group of `count` elements held by `rank` of `world_size`.
struct ShardRange {
  size_t begin = 0;
  size_t end = 0;
  size_t size() const { return end - begin; }
};
ShardRange ShardOf(size_t count, int rank, int world_size);

struct ShardedGroupOptions {
  // Elements each rank contributes to one round of the gradients' reduce-scatter and of the
  // parameters' all-gather, > 0.
  size_t round_elements = size_t{1} << 22;
};

struct ShardedStepArgs {
  std::optional<optim::HyperParams> hyper;  // as EngineStepArgs::hyper
  std::span<const GradView> grads;          // the whole group's local gradients; empty: accumulated
  // The whole group's parameters, which receive every rank's updated shard; or this rank's shard
  // only (views covering [shard.begin, shard.end); with one rank, the whole group), which receive
  // its updated values and nothing gathered (the caller gathers them, e.g. on a device; segments
  // without a gradient are left as they were); empty: none written. Every rank passes the same
  // kind.
  std::span<const ParamView> params;
  double loss_scale = 1.0;  // > 0
};

class ShardedGroup {
 public:
  // Creates this rank's group in `engine` from `optim_json` (Engine::CreateGroup's document, whose
  // "segments", if any, are the whole group's) with its master weights from the shard's part of
  // `params` (views covering the whole group). Creation is agreed: when any rank fails, every rank
  // fails (the others Aborted naming it). `engine` and `collectives` must outlive the group.
  static Result<std::unique_ptr<ShardedGroup>> Create(Engine& engine, std::string_view optim_json,
                                                      std::span<const ParamView> params,
                                                      Collectives& collectives,
                                                      const ShardedGroupOptions& options = {});

  // One sharded step (see above). The report is the local group's, with the agreed norm.
  Result<StepReport> Step(const ShardedStepArgs& args);

  // For a rank whose step arguments were refused before Step (e.g. by the C API's conversion):
  // makes the step's first collective call with this rank's failure flag, so the peers stop
  // before their update too, and returns `error`. `with_grads`: whether the step was given
  // gradients (every rank gives them or none).
  Status Abort(Status error, bool with_grads);

  GroupId group() const { return group_; }  // the local group, for the engine's other calls
  ShardRange shard() const { return shard_; }
  size_t count() const { return count_; }
  std::span<const size_t> local_segments() const { return local_segments_; }

 private:
  ShardedGroup(Engine& engine, Collectives& collectives, GroupId group, size_t count,
               std::vector<size_t> segments, const ShardedGroupOptions& options);

  Result<std::vector<GradView>> ReduceGradients(std::span<const GradView> grads);
  // Which global segments have a gradient on some rank; `local` is this rank's failure so far,
  // sent as its flag (the segments' flags are then left out).
  Result<std::vector<bool>> AgreePresence(std::span<const GradView> grads, const Status& local);
  // Every rank's updated shard into `params`: BroadcastParams where the collectives offer
  // Broadcast, else GatherParamsThroughBuffer.
  Status GatherParams(std::span<const ParamView> params);
  // Whether `params` stand for this rank's shard only (ShardedStepArgs::params).
  bool CoversShardOnly(std::span<const ParamView> params) const;
  // Checks the caller's parameter views (the whole group's, or the shard's) and widens the
  // shard's part of them into shard_params_, which the step updates.
  Status WidenCallerParams(std::span<const ParamView> params, bool shard_only);
  // This rank's shard narrowed into its own part of `params`, then one Broadcast of every rank's
  // part of each view straight into the peers' views (each in the view's dtype): no buffer.
  Status BroadcastParams(std::span<const ParamView> params);
  // All-gathers the shards in rounds through round_buffer_ (fp32) and narrows each round into
  // `params`.
  Status GatherParamsThroughBuffer(std::span<const ParamView> params);
  // Round k of the collectives covers elements [k * piece, (k + 1) * piece) of every rank's
  // shard; every rank computes the same rounds from ShardOf.
  struct Rounds {
    std::vector<ShardRange> shards;  // every rank's
    size_t largest = 0;              // elements of the largest shard
    size_t piece = 0;                // elements per rank per round
    size_t buffer_elements() const { return shards.size() * piece; }
    // Fills counts[r] with rank r's elements in the round starting at `first`; returns their sum.
    size_t Counts(size_t first, std::vector<uint64_t>& counts) const;
  };
  Rounds PlanRounds() const;
  // The all-reduce of step 2 / 3: `failed` is this rank's flag; the message names failed peers.
  // `layout`: LayoutFingerprint of the parameter views where they are broadcast (else 0); ranks
  // whose layout differs from rank 0's fail every rank's step, naming them.
  Result<optim::GradScan> AgreeScan(const optim::GradScan& local, bool failed, double layout = 0.0);
  Status AgreeOutcome(const Status& local);

  Engine& engine_;
  Collectives& collectives_;
  GroupId group_;
  size_t count_;
  ShardRange shard_;
  std::vector<size_t> segments_;        // the whole group's
  std::vector<size_t> local_segments_;  // their intersections with the shard
  std::vector<float> shard_grads_;      // fp32, the reduce-scattered gradient
  std::vector<float> shard_params_;     // fp32, the step's updated parameters
  ShardedGroupOptions options_;
  std::vector<float> round_buffer_;  // one round of a collective, kept across steps
};

}  // namespace zoe::offload
