// Speculation of an optimizer group (optimizer_group.h, "Speculation"): chunks updated as their
// gradients complete, into the slot or spare buffer that the step would write anyway, and the
// decision the Step takes once the gradients' global check and norm are known.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "core/aligned_buffer.h"
#include "offload/optimizer/optimizer_group_impl.h"

namespace zoe::offload {

OptimizerGroup::Impl::Speculation::Speculation() = default;

using detail::ElementAt;
using detail::FindView;
using detail::PlacedView;
using detail::PlacedViews;
using detail::StepInputs;

namespace {

// Writes the elements of chunk `regions` that have a gradient in `grads` into the parameter
// views, from the master at `state`: fp32 copied, bf16/fp16 cast with the kernels' rounding, which
// is what the fused update wrote there.
Status WriteParamsFromMaster(const ChunkRegions& regions, const std::byte* state,
                             const PlacedViews& grads, const PlacedViews& params,
                             const optim::RunOptions& run) {
  const auto* master = reinterpret_cast<const float*>(state + regions.offset[0]);
  const size_t end = regions.first + regions.count;
  auto grad = FindView(grads, regions.first);
  auto param = FindView(params, regions.first);
  for (size_t pos = regions.first; pos < end;) {
    const size_t piece_end = std::min({end, grad->end(), param->end()});
    const float* src = master + (pos - regions.first);
    const bool written = grad->present() && param->present();
    if (written && param->dtype == optim::DType::kFloat32) {
      std::memcpy(ElementAt(*param, pos), src, (piece_end - pos) * sizeof(float));
    } else if (written) {
      ZOE_RETURN_IF_ERROR(
          optim::CastFromF32(src, param->dtype, ElementAt(*param, pos), piece_end - pos, run));
    }
    pos = piece_end;
    if (pos == grad->end()) ++grad;
    if (pos == param->end()) ++param;
  }
  return Status::Ok();
}

}  // namespace

PlacedViews OptimizerGroup::Impl::ChunkGrads(size_t chunk) const {
  const ChunkRegions regions = layout.chunk(chunk);
  PlacedViews views;
  auto it = accumulated.upper_bound(regions.first);
  if (it != accumulated.begin()) --it;
  for (; it != accumulated.end() && it->first < regions.first + regions.count; ++it) {
    if (it->second.end() > regions.first) views.push_back(it->second);
  }
  return views;
}

StepInputs OptimizerGroup::Impl::SpeculativeInputs(const PlacedViews& grads) const {
  const Speculation& s = *speculation;
  return StepInputs{&s.hyper,      segment_ends, s.segment_step, s.scaling,
                    s.state_dtype, &grads,       &s.params,      &s.run};
}

void OptimizerGroup::Impl::SpeculateChunk(size_t chunk, bool read_ahead) {
  Speculation& s = *speculation;
  if (!s.failure.ok()) return;  // the Step reports it and recomputes nothing
  if (s.declined) return;       // the read AccumulateGrad started is all
  if (on_nvme(chunk)) {
    // A chunk read ahead has had its read in flight since before its gradient came: it is due
    // now. Otherwise its read just started, and it waits for the next gradient (or the Step).
    s.waiting.push_back(chunk);
    SpeculateWaiting(/*keep_newest=*/!read_ahead);
    return;
  }
  // The spare receives the new state; the live buffer stays as it was until the commit.
  const PlacedViews grads = ChunkGrads(chunk);
  std::byte* spare = host_spare[chunk - nvme_count].data();
  std::memcpy(spare, host_state(chunk), layout.chunk(chunk).bytes);
  s.failure = detail::UpdateChunkState(layout.chunk(chunk), spare, SpeculativeInputs(grads))
                  .WithContext(ChunkName(chunk));
  if (!s.failure.ok()) return;
  s.updated[chunk] = true;
  ++s.updated_count;
}

// Through the pipeline like any step's chunks: their reads (AccumulateGrad started them as the
// chunks completed, or the pipeline starts them) are verified, the chunks updated and written,
// with their checksums, to their inactive slots -- not flipped, so the live ones keep the
// previous version. The newest chunk is kept waiting while more gradients may come: its read,
// just started, then has until the next gradient arrives, instead of holding up this call. The
// last writes are left in flight (speculative_writes) to overlap the next update; a failed one
// is found when its buffer is needed again or by the Step.
void OptimizerGroup::Impl::SpeculateWaiting(bool keep_newest) {
  Speculation& s = *speculation;
  const size_t due = s.waiting.size() - (keep_newest && !s.waiting.empty() ? 1 : 0);
  if (due == 0 || !s.failure.ok()) return;
  // The pipeline takes the reads in flight for due chunks first, in their order; the newest
  // chunk's read stays prefetched, aside.
  const std::vector<size_t> prefetched = pipeline.PrefetchedChunks();
  const std::vector<size_t> order =
      PipelineOrder(prefetched, std::span(s.waiting).first(due), nvme_count);
  s.waiting.erase(s.waiting.begin(), s.waiting.begin() + static_cast<ptrdiff_t>(due));
  s.failure = pipeline.Run(
      order, /*read=*/true,
      [&](size_t c, std::byte* state, const ChunkChecksums& checksums) {
        const PlacedViews grads = ChunkGrads(c);
        return detail::UpdateChunkState(layout.chunk(c), state, SpeculativeInputs(grads),
                                        checksums);
      },
      &s.totals, /*fn_hashes=*/true, /*keep_writes=*/true);
  if (!s.failure.ok()) return;
  for (size_t c : order) s.updated[c] = true;
  s.updated_count += order.size();
}

// Frees the buffers of the speculative writes that have completed, oldest first, without
// waiting; a failed one becomes the speculation's failure.
void OptimizerGroup::Impl::ReapSpeculativeWrites() {
  Status written = pipeline.ReapWrites();
  if (!written.ok() && speculation->failure.ok()) speculation->failure = std::move(written);
}

void OptimizerGroup::Impl::ReadAhead() {
  if (!speculation || speculation->declined || !speculation->failure.ok()) return;
  ReapSpeculativeWrites();
  if (!speculation->failure.ok()) return;
  const size_t limit = pipeline.buffers().size() > 2 ? pipeline.buffers().size() - 2 : 0;
  auto complete = [&](size_t c) { return chunk_covered[c] == layout.chunk(c).count; };
  // Reads held for chunks that are not due: incomplete, or complete without a gradient.
  const std::vector<size_t> prefetched = pipeline.PrefetchedChunks();
  size_t ahead =
      static_cast<size_t>(std::count_if(prefetched.begin(), prefetched.end(), [&](size_t c) {
        return !complete(c) || chunk_present[c] == 0;
      }));
  for (size_t i = completion_order.size(); i < expected_completions.size(); ++i) {
    if (ahead >= limit || !pipeline.buffers().any_free()) return;
    const size_t c = expected_completions[i];
    if (!on_nvme(c) || complete(c) || pipeline.IsPrefetched(c)) continue;
    pipeline.StartPrefetch(c);
    if (pipeline.IsPrefetched(c)) ++ahead;
  }
}

void OptimizerGroup::Impl::FinishSpeculativeWrites() {
  Status written = pipeline.FinishWrites();
  if (!written.ok() && speculation && speculation->failure.ok()) {
    speculation->failure = std::move(written);
  }
}

std::vector<bool> OptimizerGroup::Impl::NotSpeculated(const std::vector<bool>& present) const {
  if (!speculation || !speculation->failure.ok()) return present;
  return WithoutSpeculated(present, speculation->updated);
}

// The parameter views of a speculative step are those given to Speculate: `params` (those given
// to Step) must be the same or none.
Status OptimizerGroup::Impl::UseSpeculatedParams(PlacedViews* params) const {
  const PlacedViews& speculated = speculation->params;
  const bool same = std::equal(params->begin(), params->end(), speculated.begin(), speculated.end(),
                               [](const PlacedView& a, const PlacedView& b) {
                                 return a.offset == b.offset && a.data == b.data &&
                                        a.dtype == b.dtype && a.count == b.count;
                               });
  if (!params->empty() && !same) {
    return Status::InvalidArgument(fmt::format(
        "optimizer group '{}': a speculative step got other parameter views than those given to "
        "Speculate; allowed: the same views, or none",
        name));
  }
  *params = speculated;
  return Status::Ok();
}

OptimizerGroup::Impl::SpeculationOutcome OptimizerGroup::Impl::DecideSpeculation(
    const optim::StepScaling& scaling, const optim::HyperParams& hyper,
    std::span<const int64_t> segment_step) const {
  const Speculation& s = *speculation;
  if (scaling.skip) return SpeculationOutcome::kDiscard;
  const bool same_scaling = scaling.scaling.inv_loss_scale == s.scaling.inv_loss_scale &&
                            scaling.scaling.clip_factor == s.scaling.clip_factor;
  const bool same_hyper = hyper.kind == s.hyper.kind && hyper.lr == s.hyper.lr &&
                          hyper.beta1 == s.hyper.beta1 && hyper.beta2 == s.hyper.beta2 &&
                          hyper.eps == s.hyper.eps && hyper.weight_decay == s.hyper.weight_decay &&
                          hyper.lr_decay == s.hyper.lr_decay;
  const bool same_steps = std::equal(segment_step.begin(), segment_step.end(),
                                     s.segment_step.begin(), s.segment_step.end());
  return same_scaling && same_hyper && same_steps ? SpeculationOutcome::kCommit
                                                  : SpeculationOutcome::kRecompute;
}

// The live master of an NVMe chunk is read back (verified) into a buffer of its own: the
// pipeline buffers may hold the step's reads.
Status OptimizerGroup::Impl::RestoreParams() {
  const Speculation& s = *speculation;
  if (s.params.empty()) return Status::Ok();
  AlignedBuffer staging;
  for (size_t c = 0; c < s.updated.size(); ++c) {
    if (!s.updated[c]) continue;
    const std::byte* state = nullptr;
    if (on_nvme(c)) {
      if (staging.empty()) {
        ZOE_ASSIGN_OR_RETURN(staging, AlignedBuffer::Allocate(layout.max_chunk_bytes()));
      }
      ZOE_RETURN_IF_ERROR(pipeline.ReadChunk(c, staging.data()));
      state = staging.data();
    } else {
      state = host_state(c);
    }
    ZOE_RETURN_IF_ERROR(
        WriteParamsFromMaster(layout.chunk(c), state, ChunkGrads(c), s.params, s.run)
            .WithContext(ChunkName(c)));
  }
  return Status::Ok();
}

bool OptimizerGroup::Impl::SpeculationBackoff::Decline() {
  if (remaining_ == 0) return false;
  --remaining_;
  return true;
}

void OptimizerGroup::Impl::SpeculationBackoff::Record(SpeculationOutcome outcome) {
  if (outcome == SpeculationOutcome::kCommit) {
    next_ = 1;
  } else if (outcome == SpeculationOutcome::kRecompute) {
    remaining_ = std::min(next_, max_);
    next_ = std::min(next_ * 2, std::max(max_, 1u));
  }
}

void OptimizerGroup::Impl::EndSpeculation(SpeculationOutcome outcome, const Status& status,
                                          StepReport* report) {
  const Speculation& s = *speculation;
  report->chunks_speculative = s.updated_count;
  if (!status.ok() || outcome == SpeculationOutcome::kDiscard) {
    report->chunks_discarded = s.updated_count;
  } else if (outcome == SpeculationOutcome::kCommit) {
    report->chunks_committed = s.updated_count;
  } else {
    report->chunks_recomputed = s.updated_count;
  }
  report->bytes_read += s.totals.bytes_read;
  report->bytes_reused += s.totals.bytes_reused;
  report->bytes_written += s.totals.bytes_written;
  report->io_wait_seconds += s.totals.io_wait_seconds;
  report->compute_seconds += s.totals.compute_seconds;
  SpeculationStats& t = speculation_totals;
  if (s.declined) {
    ++t.steps_declined;
    speculation.reset();
    return;
  }
  if (status.ok()) speculation_backoff.Record(outcome);
  ++t.steps;
  t.chunks_speculative += report->chunks_speculative;
  t.chunks_committed += report->chunks_committed;
  t.chunks_recomputed += report->chunks_recomputed;
  t.chunks_discarded += report->chunks_discarded;
  speculation.reset();
}

}  // namespace zoe::offload
