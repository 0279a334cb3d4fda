#include "offload/optimizer/optimizer_group.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <iterator>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/aligned_buffer.h"
#include "core/log.h"
#include "offload/optimizer/chunk_update.h"
#include "offload/optimizer/optimizer_group_impl.h"
#include "optim/quantize.h"

namespace zoe::offload {
namespace {

using detail::Clock;
using detail::ElementAt;
using detail::FindView;
using detail::PlacedView;
using detail::PlacedViews;
using detail::SecondsSince;
using detail::SegmentAt;
using detail::StepInputs;
using detail::UpdateChunkState;
using optim::DType;

bool IsKnownKind(optim::Kind kind) {
  return std::find(std::begin(optim::kAllKinds), std::end(optim::kAllKinds), kind) !=
         std::end(optim::kAllKinds);
}

// Indexed by StateSlot's value (core/vocabulary.h's mechanism).
constexpr std::array<std::string_view, 3> kSlotNames = {"master", "exp_avg", "exp_avg_sq"};
static_assert(kSlotNames.size() == static_cast<size_t>(StateSlot::kExpAvgSq) + 1);

std::string_view SlotName(StateSlot slot) { return NameIn(kSlotNames, slot); }

// A gradient view may have null data (no gradient for its elements); other views may not.
Status CheckView(const std::string& group, std::string_view what, size_t index, const void* data,
                 DType dtype, size_t count, bool absent_allowed) {
  ZOE_RETURN_IF_ERROR(optim::CheckKernelDType(
      dtype, optim::kAllDTypes,
      fmt::format("optimizer group '{}': {} view {} dtype", group, what, index)));
  if (count > 0 && data == nullptr && !absent_allowed) {
    return Status::InvalidArgument(
        fmt::format("optimizer group '{}': {} view {} of {} elements has a null buffer", group,
                    what, index, count));
  }
  return Status::Ok();
}

// Places views back to back; they must cover exactly `count` elements. Empty views are dropped.
// Views with null data are allowed (kept, as absent) where `absent_allowed`.
template <class View>
Result<PlacedViews> PlaceViews(const std::string& group, std::string_view what,
                               std::span<const View> views, size_t count, bool absent_allowed) {
  PlacedViews placed;
  size_t offset = 0;
  for (size_t i = 0; i < views.size(); ++i) {
    const View& view = views[i];
    ZOE_RETURN_IF_ERROR(
        CheckView(group, what, i, view.data, view.dtype, view.count, absent_allowed));
    if (view.count == 0) continue;
    if (view.count > count - offset) {
      return Status::InvalidArgument(fmt::format(
          "optimizer group '{}': {} view {} of {} elements starts at element {}, past the end of "
          "the group's {}",
          group, what, i, view.count, offset, count));
    }
    placed.push_back(
        {offset, static_cast<std::byte*>(const_cast<void*>(view.data)), view.dtype, view.count});
    offset += view.count;
  }
  if (offset != count) {
    return Status::InvalidArgument(
        fmt::format("optimizer group '{}': the {} views hold {} elements; the group has {}", group,
                    what, offset, count));
  }
  return placed;
}

// Fills a chunk's extent: master from the caller's parameters (widened exactly; zero under an
// absent view), moments and padding zero. An external master is the caller's parameters already.
Status FillInitialState(const ChunkRegions& regions, std::byte* base, const PlacedViews& params,
                        const optim::RunOptions& run) {
  std::memset(base, 0, regions.bytes);
  if (regions.master_external) return Status::Ok();
  auto* master = reinterpret_cast<float*>(base + regions.offset[0]);
  const size_t end = regions.first + regions.count;
  for (auto view = FindView(params, regions.first); view != params.end() && view->offset < end;
       ++view) {
    if (!view->present()) continue;
    const size_t from = std::max(regions.first, view->offset);
    const size_t to = std::min(end, view->end());
    float* dst = master + (from - regions.first);
    if (view->dtype == DType::kFloat32) {
      std::memcpy(dst, ElementAt(*view, from), (to - from) * sizeof(float));
    } else {
      ZOE_RETURN_IF_ERROR(
          optim::CastToF32(ElementAt(*view, from), view->dtype, dst, to - from, run));
    }
  }
  return Status::Ok();
}

// int8 state: the scales and block offset of a piece starting at chunk element `k` (a block
// start: pieces start at segment starts and stripe starts, both block boundaries).
void SetBlockScales(const ChunkRegions& regions, std::byte* base, size_t k,
                    optim::ChunkBuffers* buffers) {
  const size_t block = regions.BlockAt(k);
  buffers->block_offset = k % optim::kQuantBlock;
  if (regions.used[kExpAvgScaleRegion]) {
    buffers->exp_avg_scale =
        reinterpret_cast<float*>(base + regions.offset[kExpAvgScaleRegion]) + block;
  }
  if (regions.used[kExpAvgSqScaleRegion]) {
    buffers->exp_avg_sq_scale =
        reinterpret_cast<float*>(base + regions.offset[kExpAvgSqScaleRegion]) + block;
  }
}

// Updates elements [from, to) of the chunk whose state is at `base` with gradient view `grad`
// and step `step`, writing the parameter view `param` (null: none) in its dtype, fp32 included,
// in the kernel's own pass over the elements while they are in cache. `master`: the caller's fp32
// view holding the master of [from, to) (master_in_params), or null for the chunk's own.
// `sums`: null, or where the kernel stores the hashes of the chunk's master and moments as it
// reads them (chunk_update.h; the master must be the chunk's own).
Status UpdatePiece(const ChunkRegions& regions, std::byte* base, const StepInputs& in,
                   const PlacedView& grad, const PlacedView* param, const PlacedView* master,
                   size_t from, size_t to, int64_t step, const optim::RunOptions& run,
                   const ReadSums* sums = nullptr) {
  const size_t k = from - regions.first;
  const size_t state_bytes = DTypeSize(in.state_dtype);
  optim::ChunkLayout layout;
  layout.grad = grad.dtype;
  layout.state = in.state_dtype;
  if (param != nullptr) layout.param_copy = param->dtype;
  optim::ChunkBuffers buffers;
  buffers.master = master != nullptr ? reinterpret_cast<float*>(ElementAt(*master, from))
                                     : reinterpret_cast<float*>(base + regions.offset[0]) + k;
  buffers.grad = ElementAt(grad, from);
  if (regions.used[1]) buffers.exp_avg = base + regions.offset[1] + k * state_bytes;
  if (regions.used[2]) buffers.exp_avg_sq = base + regions.offset[2] + k * state_bytes;
  if (param != nullptr) buffers.param_copy = ElementAt(*param, from);
  buffers.count = to - from;
  if (in.state_dtype == DType::kInt8) SetBlockScales(regions, base, k, &buffers);
  if (sums != nullptr) {
    std::copy(std::begin(sums->region), std::end(sums->region), buffers.read_sums);
    buffers.read_origin = k;  // the regions' element k: their blocks count from element 0
  }
  return optim::UpdateChunk(*in.hyper, step, layout, buffers, in.scaling, run);
}

// One piece of a chunk range: elements [from, to) (absolute) under one gradient view, parameter
// view, external master view and segment.
struct Piece {
  size_t from = 0;
  size_t to = 0;
  const PlacedView* grad = nullptr;
  const PlacedView* param = nullptr;   // null: no parameters written
  const PlacedView* master = nullptr;  // null: the chunk's own master
  int64_t step = 0;                    // the segment's
};

// Calls fn(piece) on every piece of elements [begin, end) (relative to the chunk), in order: the
// range split at every gradient view, parameter view, external master view and segment
// boundary. Stops at fn's first error.
template <class Fn>
Status ForEachPiece(const ChunkRegions& regions, const StepInputs& in, size_t begin, size_t end,
                    const Fn& fn) {
  const size_t last = regions.first + end;
  auto grad = FindView(*in.grads, regions.first + begin);
  const bool with_params = !in.params->empty();
  auto param = with_params ? FindView(*in.params, regions.first + begin) : in.params->end();
  const bool external = in.external_master();
  auto master =
      external ? FindView(*in.masters, regions.first + begin) : PlacedViews::const_iterator();
  for (size_t pos = regions.first + begin; pos < last;) {
    const size_t segment = SegmentAt(in.segment_ends, pos);
    const size_t piece_end = std::min({last, grad->end(), with_params ? param->end() : last,
                                       external ? master->end() : last, in.segment_ends[segment]});
    const bool written = with_params && param->present();  // an absent view is not written
    ZOE_RETURN_IF_ERROR(fn(Piece{pos, piece_end, &*grad, written ? &*param : nullptr,
                                 external ? &*master : nullptr, in.segment_step[segment]}));
    pos = piece_end;
    if (pos == grad->end()) ++grad;
    if (with_params && pos == param->end()) ++param;
    if (external && pos == master->end()) ++master;
  }
  return Status::Ok();
}

}  // namespace

// Elements [from, to) of fp32 views that cover them, copied into `out` (element `from` at out[0]).
void detail::GatherFromViews(const PlacedViews& views, size_t from, size_t to, float* out) {
  for (auto view = FindView(views, from); view != views.end() && view->offset < to; ++view) {
    const size_t a = std::max(from, view->offset), b = std::min(to, view->end());
    std::memmove(out + (a - from), ElementAt(*view, a), (b - a) * sizeof(float));
  }
}

// The inverse: `values` (element `from` at values[0]) copied into the views.
void detail::ScatterToViews(const PlacedViews& views, size_t from, size_t to, const float* values) {
  for (auto view = FindView(views, from); view != views.end() && view->offset < to; ++view) {
    const size_t a = std::max(from, view->offset), b = std::min(to, view->end());
    std::memmove(ElementAt(*view, a), values + (a - from), (b - a) * sizeof(float));
  }
}

namespace {

// int8 state, a block [from, to) that gradient or parameter views cut: its gradients are
// gathered (widened exactly to fp32) and its parameters scattered (with the kernels' rounding)
// through staging buffers, so the block is updated in one call, as if one view held it.
Status UpdateStagedBlock(const ChunkRegions& regions, std::byte* base, const StepInputs& in,
                         size_t from, size_t to, int64_t step, const optim::RunOptions& run) {
  std::array<float, optim::kQuantBlock> grad_buffer;
  std::array<float, optim::kQuantBlock> param_buffer;
  for (auto view = FindView(*in.grads, from); view != in.grads->end() && view->offset < to;
       ++view) {
    const size_t a = std::max(from, view->offset), b = std::min(to, view->end());
    // Absent gradients are whole segments, and a block lies in one segment.
    if (!view->present()) return Status::Ok();
    if (view->dtype == DType::kFloat32) {
      std::memcpy(&grad_buffer[a - from], ElementAt(*view, a), (b - a) * sizeof(float));
    } else {
      ZOE_RETURN_IF_ERROR(
          optim::CastToF32(ElementAt(*view, a), view->dtype, &grad_buffer[a - from], b - a, run));
    }
  }
  const PlacedView grad{from, reinterpret_cast<std::byte*>(grad_buffer.data()), DType::kFloat32,
                        to - from};
  const PlacedView param{from, reinterpret_cast<std::byte*>(param_buffer.data()), DType::kFloat32,
                         to - from};
  // An external master cut by the caller's views is staged the same way, in and out.
  std::array<float, optim::kQuantBlock> master_buffer;
  const PlacedView master{from, reinterpret_cast<std::byte*>(master_buffer.data()), DType::kFloat32,
                          to - from};
  const bool external = in.external_master();
  if (external) detail::GatherFromViews(*in.masters, from, to, master_buffer.data());
  const bool with_params = !in.params->empty();
  ZOE_RETURN_IF_ERROR(UpdatePiece(regions, base, in, grad, with_params ? &param : nullptr,
                                  external ? &master : nullptr, from, to, step, run));
  if (external) detail::ScatterToViews(*in.masters, from, to, master_buffer.data());
  if (!with_params) return Status::Ok();
  for (auto view = FindView(*in.params, from); view != in.params->end() && view->offset < to;
       ++view) {
    if (!view->present()) continue;  // not written
    const size_t a = std::max(from, view->offset), b = std::min(to, view->end());
    if (view->dtype == DType::kFloat32) {
      std::memcpy(ElementAt(*view, a), &param_buffer[a - from], (b - a) * sizeof(float));
    } else {
      ZOE_RETURN_IF_ERROR(optim::CastFromF32(&param_buffer[a - from], view->dtype,
                                             ElementAt(*view, a), b - a, run));
    }
  }
  return Status::Ok();
}

// int8 state: ForEachPiece's pieces regrouped into whole quantization blocks. A piece that a
// gradient, parameter or master view ends inside a block becomes the blocks before that one, and
// the cut block, which fn gets with `staged` set (its views are found again by
// UpdateStagedBlock); the pieces after it start where the cut block ends. Every block of
// [begin, end) is in exactly one piece, and in one segment.
template <class Fn>
Status ForEachQuantizedPiece(const ChunkRegions& regions, const StepInputs& in, size_t begin,
                             size_t end, const Fn& fn) {
  size_t covered = regions.first + begin;  // the elements before it went to fn
  return ForEachPiece(regions, in, begin, end, [&](Piece piece) {
    if (piece.to <= covered) return Status::Ok();  // inside the cut block before it
    piece.from = std::max(piece.from, covered);    // a block start: the views are the piece's
    const size_t segment_end =
        std::min(regions.first + end, in.segment_ends[SegmentAt(in.segment_ends, piece.from)]);
    const size_t relative_end = piece.to - regions.first;
    if (piece.to == segment_end || relative_end % optim::kQuantBlock == 0) {
      covered = piece.to;
      return fn(piece, /*staged=*/false);
    }
    // The block holding piece.to starts at a multiple of kQuantBlock, or at piece.from.
    const size_t cut = std::max(
        piece.from, regions.first + relative_end / optim::kQuantBlock * optim::kQuantBlock);
    if (cut > piece.from) {
      Piece direct = piece;
      direct.to = cut;
      ZOE_RETURN_IF_ERROR(fn(direct, /*staged=*/false));
    }
    piece.from = cut;
    piece.to = std::min(segment_end, regions.first + CeilDiv(relative_end, optim::kQuantBlock) *
                                                         optim::kQuantBlock);
    covered = piece.to;
    return fn(piece, /*staged=*/true);
  });
}

// Updates elements [begin, end) (relative to the chunk) of one chunk whose state is at `base`,
// on the calling thread: UpdatePiece on each piece that has a gradient (ForEachPiece, or
// ForEachQuantizedPiece for int8 state, whose cut blocks go through UpdateStagedBlock), with its
// segment's step (bias correction); a piece without one (absent) is left as it is, state and
// parameter view alike. The update is elementwise, so the result is the same as one call per
// segment. `sums`: as UpdatePiece's, for every piece updated unstaged.
Status UpdateChunkRange(const ChunkRegions& regions, std::byte* base, const StepInputs& in,
                        size_t begin, size_t end, const optim::RunOptions& run,
                        const ReadSums* sums = nullptr) {
  const auto update = [&](const Piece& piece) {
    if (!piece.grad->present()) return Status::Ok();
    return UpdatePiece(regions, base, in, *piece.grad, piece.param, piece.master, piece.from,
                       piece.to, piece.step, run, sums);
  };
  if (in.state_dtype != DType::kInt8) return ForEachPiece(regions, in, begin, end, update);
  return ForEachQuantizedPiece(regions, in, begin, end, [&](const Piece& piece, bool staged) {
    if (staged) return UpdateStagedBlock(regions, base, in, piece.from, piece.to, piece.step, run);
    return update(piece);
  });
}

// The ranges UpdateChunkRange runs the kernel on with `sums` (relative to the chunk): its
// unstaged pieces that have a gradient.
void UpdatedRanges(const ChunkRegions& regions, const StepInputs& in, size_t begin, size_t end,
                   std::vector<ElementRange>* ranges) {
  const auto add = [&](const Piece& piece) {
    if (piece.grad->present()) {
      ranges->push_back({piece.from - regions.first, piece.to - regions.first});
    }
    return Status::Ok();
  };
  if (in.state_dtype != DType::kInt8) {
    (void)ForEachPiece(regions, in, begin, end, add);
    return;
  }
  (void)ForEachQuantizedPiece(regions, in, begin, end, [&](const Piece& piece, bool staged) {
    return staged ? Status::Ok() : add(piece);
  });
}

// The segments' lengths must add up to the group's count.
Status CheckSegments(const OptimizerGroupOptions& o) {
  size_t total = 0;
  for (size_t length : o.segments) {
    if (length > o.count - total) {
      return Status::InvalidArgument(fmt::format(
          "optimizer group '{}': the {} segments hold more than the group's {} elements; allowed: "
          "segment lengths that add up to count",
          o.name, o.segments.size(), o.count));
    }
    total += length;
  }
  if (o.segments.empty() || total == o.count) return Status::Ok();
  return Status::InvalidArgument(
      fmt::format("optimizer group '{}': the {} segments hold {} elements, the group {}; allowed: "
                  "segment lengths that add up to count",
                  o.name, o.segments.size(), total, o.count));
}

// The exclusive end of every segment; one segment, the whole group, when none are given.
std::vector<size_t> SegmentEnds(const OptimizerGroupOptions& o) {
  if (o.segments.empty()) return {o.count};
  std::vector<size_t> ends;
  ends.reserve(o.segments.size());
  size_t end = 0;
  for (size_t length : o.segments) ends.push_back(end += length);
  return ends;
}

Status CheckOptions(const OptimizerGroupOptions& o, const OptimizerResources& r) {
  const std::string& n = o.name;
  auto bad = [&](std::string message) {
    return Status::InvalidArgument(fmt::format("optimizer group '{}': {}", n, message));
  };
  if (o.name.empty()) return Status::InvalidArgument("optimizer group: name is empty");
  ZOE_RETURN_IF_ERROR(CheckGroupName(o.name));
  if (!IsKnownKind(o.kind)) {
    return bad(fmt::format("kind {} is unknown; allowed: adamw, adam, adagrad, lion",
                           static_cast<int>(o.kind)));
  }
  ZOE_RETURN_IF_ERROR(optim::CheckKernelDType(o.state_dtype, optim::kStateDTypes,
                                              fmt::format("optimizer group '{}': state_dtype", n)));
  if (o.count == 0 || o.count > (size_t{1} << 48)) {
    return bad(fmt::format("count {} is out of range; allowed: [1, 2^48]", o.count));
  }
  if (!(o.max_grad_norm >= 0.0) || !std::isfinite(o.max_grad_norm)) {
    return bad(
        fmt::format("max_grad_norm {} is out of range; allowed: 0 (off) or > 0", o.max_grad_norm));
  }
  if (o.placement != Tier::kNvme && o.placement != Tier::kHost) {
    return bad(
        fmt::format("placement {} is not supported; allowed: nvme, host", TierName(o.placement)));
  }
  if (o.placement == Tier::kNvme && !(o.nvme_ratio > 0.0 && o.nvme_ratio <= 1.0)) {
    return bad(fmt::format("nvme_ratio {} is out of range; allowed: (0, 1]", o.nvme_ratio));
  }
  if (o.chunk_elements == 0) return bad("chunk_elements is 0; allowed: >= 1");
  ZOE_RETURN_IF_ERROR(CheckSegments(o));
  if (o.slots != 1 && o.slots != 2) {
    return bad(fmt::format("slots {} is out of range; allowed: 1 (in place) or 2 (atomic steps)",
                           o.slots));
  }
  if (o.buffer_count < 2) {
    return bad(fmt::format("buffer_count {} is out of range; allowed: >= 2", o.buffer_count));
  }
  if (o.run.tile_elements == 0) return bad("run.tile_elements is 0; allowed: >= 1");
  if (o.master_in_params && o.placement != Tier::kHost) {
    return bad(fmt::format(
        "the master in the caller's parameters (master_in_params) needs every chunk in HOST; "
        "placement is {} (allowed with it: host, offload_optimizer.device = cpu)",
        TierName(o.placement)));
  }
  if (o.master_in_params && o.speculative) {
    return bad(
        "speculation and the master in the caller's parameters (master_in_params) "
        "exclude each other; allowed: one of them");
  }
  if (r.pinned == nullptr) return bad("no pinned memory pool given");
  return Status::Ok();
}

// master_in_params: the initial views are the master, so they must be fp32.
Status CheckMasterViews(const std::string& group, std::span<const ParamView> views) {
  for (size_t i = 0; i < views.size(); ++i) {
    if (views[i].count == 0 || views[i].dtype == DType::kFloat32) continue;
    return Status::InvalidArgument(fmt::format(
        "optimizer group '{}': initial parameter view {} is {}; the master in the caller's "
        "parameters (master_in_params) needs fp32 views",
        group, i, DTypeName(views[i].dtype)));
  }
  return Status::Ok();
}

size_t NvmeChunkCount(const OptimizerGroupOptions& o, size_t chunks) {
  if (o.placement != Tier::kNvme) return 0;
  const auto rounded =
      static_cast<size_t>(std::llround(o.nvme_ratio * static_cast<double>(chunks)));
  return std::min(rounded, chunks);
}

// Whether the update of a chunk can verify its reads in the kernel: the path hashes reads for
// the kind and state, and master and moments are all in the chunk.
bool KernelVerifiesReads(const StepInputs& in) {
  return !in.external_master() && optim::UpdateHashesReads(in.hyper->kind, in.state_dtype, *in.run);
}

// The step updates the HOST chunks in one pass, stripe by stripe: whether what it writes can stay
// cached until the next step reads it depends on the bytes of the whole pass, not of one
// stripe, so zoe.stores = "auto" (StoreMode::kAuto) is decided for all of them (gradients counted
// as fp32). NVMe chunks keep the per-call decision: each stripe is hashed right after its update,
// from the cache. The default, kCached, stays as it is.
optim::RunOptions HostRunOptions(const OptimizerGroupOptions& options, size_t host_elements) {
  optim::RunOptions run = options.run;
  const optim::ChunkLayout layout{.grad = DType::kFloat32, .state = options.state_dtype};
  run.stores =
      optim::ResolveStores(run.stores, optim::UpdateBytesRead(options.kind, layout, host_elements));
  return run;
}

}  // namespace

Status detail::UpdateChunkState(const ChunkRegions& regions, std::byte* base, const StepInputs& in,
                                const ChunkChecksums& checksums) {
  if (!checksums.expected.empty() && KernelVerifiesReads(in)) {
    HashingRangeUpdate update;
    update.unit = optim::ReadHashElements(in.state_dtype);
    update.ranges = [&](size_t begin, size_t end, std::vector<ElementRange>* ranges) {
      UpdatedRanges(regions, in, begin, end, ranges);
    };
    update.update = [&](size_t begin, size_t end, const optim::RunOptions& run,
                        const ReadSums& sums) {
      return UpdateChunkRange(regions, base, in, begin, end, run, &sums);
    };
    return UpdateInStripes(regions, base, checksums, *in.run, update);
  }
  return UpdateInStripes(regions, base, checksums, *in.run,
                         [&](size_t begin, size_t end, const optim::RunOptions& run) {
                           return UpdateChunkRange(regions, base, in, begin, end, run);
                         });
}

OptimizerGroup::Impl::Impl(const OptimizerGroupOptions& options, OptimizerResources borrowed,
                           uint64_t io_block)
    : name(options.name),
      count(options.count),
      segment_ends(SegmentEnds(options)),
      resources(borrowed),
      nvme_count(NvmeChunkCount(options, CeilDiv(options.count, options.chunk_elements))),
      layout(options.kind, options.state_dtype, options.count, options.chunk_elements, io_block,
             segment_ends, options.master_in_params, /*first_host_chunk=*/nvme_count),
      pipeline(options.name, layout, nvme_count, options.slots, borrowed),
      host_run(HostRunOptions(
          options, options.count - std::min(options.count, nvme_count * layout.chunk_elements()))),
      scanner(options.count, options.run.tile_elements),
      chunk_covered(layout.chunk_count(), 0),
      chunk_present(layout.chunk_count(), 0),
      speculation_backoff(options.max_speculation_backoff) {}

// Master from the caller's parameters, moments zero: NVMe chunks through the pipeline (written
// to their inactive slot, then made live), HOST chunks in place.
Status OptimizerGroup::Impl::WriteInitialState(const detail::PlacedViews& params,
                                               const optim::RunOptions& run) {
  std::vector<size_t> order(nvme_count);
  for (size_t c = 0; c < nvme_count; ++c) order[c] = c;
  PipelineTotals totals;
  ZOE_RETURN_IF_ERROR(pipeline.Run(
      order, /*read=*/false,
      [&](size_t chunk, std::byte* state, const ChunkChecksums&) {
        return FillInitialState(layout.chunk(chunk), state, params, run);
      },
      &totals));
  pipeline.slots().Flip(order);
  for (size_t c = nvme_count; c < layout.chunk_count(); ++c) {
    ZOE_RETURN_IF_ERROR(FillInitialState(layout.chunk(c), host_state(c), params, run));
  }
  return Status::Ok();
}

// The pinned bytes of a group with `options` laid out as `layout`, `nvme_count` chunks on NVMe.
static PinnedNeed PinnedNeedOf(const OptimizerGroupOptions& options, const StateLayout& layout,
                               size_t nvme_count, uint64_t page) {
  PinnedNeed need;
  need.buffers = std::min<size_t>(options.buffer_count, nvme_count);
  need.buffer_bytes = AlignUp(layout.max_chunk_bytes(), page);
  for (size_t c = nvme_count; c < layout.chunk_count(); ++c) {
    // Speculation keeps a spare of every HOST chunk for its new state.
    need.host_bytes += (options.speculative ? 2 : 1) * AlignUp(layout.chunk(c).bytes, page);
  }
  return need;
}

PinnedNeed GroupPinnedNeed(const OptimizerGroupOptions& options, uint64_t page, uint64_t io_block) {
  if (options.count == 0 || options.chunk_elements == 0) return PinnedNeed{};
  const size_t nvme_count = NvmeChunkCount(options, CeilDiv(options.count, options.chunk_elements));
  const StateLayout layout(options.kind, options.state_dtype, options.count, options.chunk_elements,
                           io_block, SegmentEnds(options), options.master_in_params,
                           /*first_host_chunk=*/nvme_count);
  return PinnedNeedOf(options, layout, nvme_count, page);
}

// NoSpace / OutOfMemory before anything is allocated, with the bytes needed and free.
static Status CheckCapacity(const OptimizerGroupOptions& options, const StateLayout& layout,
                            size_t nvme_count, const OptimizerResources& resources) {
  const PinnedNeed need = PinnedNeedOf(options, layout, nvme_count, resources.pinned->alignment());
  uint64_t swap_bytes = 0;
  for (size_t c = 0; c < nvme_count; ++c) swap_bytes += options.slots * layout.chunk(c).bytes;
  const uint64_t pinned_free =
      resources.pinned->budget_bytes() -
      std::min(resources.pinned->budget_bytes(), resources.pinned->used_bytes());
  if (need.total() > pinned_free) {
    const std::string buffers =
        need.buffers == 0
            ? std::string()
            : fmt::format("{} pipeline buffers of {} bytes and ", need.buffers, need.buffer_bytes);
    return Status::OutOfMemory(fmt::format(
        "optimizer group '{}' needs {} bytes of pinned memory ({}{} bytes of HOST chunks); pool "
        "'{}' has {} of its {} bytes free",
        options.name, need.total(), buffers, need.host_bytes, resources.pinned->name(), pinned_free,
        resources.pinned->budget_bytes()));
  }
  if (swap_bytes > 0 && swap_bytes > resources.swap->free_bytes()) {
    return Status::NoSpace(fmt::format(
        "optimizer group '{}' needs {} bytes of NVMe swap space ({} chunks, {} slot(s) each); "
        "{} of {} bytes are free",
        options.name, swap_bytes, nvme_count, options.slots, resources.swap->free_bytes(),
        resources.swap->capacity()));
  }
  return Status::Ok();
}

// ---- OptimizerGroup -------------------------------------------------------------------------

OptimizerGroup::OptimizerGroup(OptimizerGroupOptions options, std::unique_ptr<Impl> impl)
    : options_(std::move(options)),
      impl_(std::move(impl)),
      segment_steps_(impl_->segment_ends.size(), 0) {}
OptimizerGroup::~OptimizerGroup() = default;

Result<std::unique_ptr<OptimizerGroup>> OptimizerGroup::Create(
    OptimizerGroupOptions options, OptimizerResources resources,
    std::span<const ParamView> initial_params) {
  ZOE_RETURN_IF_ERROR(CheckOptions(options, resources));
  // Absent initial values (master zero until WriteState) need the master inside the group.
  ZOE_ASSIGN_OR_RETURN(PlacedViews params,
                       PlaceViews(options.name, "initial parameter", initial_params, options.count,
                                  /*absent_allowed=*/!options.master_in_params));
  if (options.master_in_params) ZOE_RETURN_IF_ERROR(CheckMasterViews(options.name, initial_params));
  const size_t chunks = CeilDiv(options.count, options.chunk_elements);
  const bool uses_nvme = NvmeChunkCount(options, chunks) > 0;
  if (uses_nvme && (resources.io == nullptr || resources.swap == nullptr)) {
    return Status::InvalidArgument(fmt::format(
        "optimizer group '{}': {} chunks are placed on NVMe but no I/O queue or swap space was "
        "given",
        options.name, NvmeChunkCount(options, chunks)));
  }
  uint64_t io_block = kStateRegionAlignment;
  if (uses_nvme) {
    if (const io::ChecksumTable* sums = resources.swap->files().checksums()) {
      const uint64_t block = sums->block_size();
      if (block % kStateRegionAlignment != 0 || (block & (block - 1)) != 0) {
        return Status::InvalidArgument(fmt::format(
            "optimizer group '{}': the swap space's checksum block of {} bytes is not a power of "
            "two multiple of 4096",
            options.name, block));
      }
      io_block = block;
    }
  }
  auto impl = std::make_unique<Impl>(options, resources, io_block);
  ZOE_RETURN_IF_ERROR(CheckCapacity(options, impl->layout, impl->nvme_count, resources));
  if (options.master_in_params) impl->masters = params;
  ZOE_RETURN_IF_ERROR(impl->AllocateState(options.buffer_count, options.speculative));
  ZOE_RETURN_IF_ERROR(impl->WriteInitialState(params, options.run));
  ZOE_LOG_DEBUG("optimizer group '{}': {} parameters in {} chunks, {} on NVMe", options.name,
                options.count, impl->layout.chunk_count(), impl->nvme_count);
  return std::unique_ptr<OptimizerGroup>(new OptimizerGroup(std::move(options), std::move(impl)));
}

Result<StepReport> OptimizerGroup::Step(const StepArgs& args) {
  const Clock::time_point start = Clock::now();
  ZOE_RETURN_IF_ERROR(CheckStepArgs(args));
  Impl& impl = *impl_;
  impl.DropPreparedLoad();
  ZOE_RETURN_IF_ERROR(impl.CheckUsable("step"));
  PlacedViews grads;
  if (args.grads.empty()) {
    ZOE_RETURN_IF_ERROR(impl.CheckCoverage());
    for (const auto& [offset, view] : impl.accumulated) grads.push_back(view);
  } else {
    if (!impl.accumulated.empty()) {
      return Status::FailedPrecondition(fmt::format(
          "optimizer group '{}': step with gradients while {} accumulated gradient views wait; "
          "call Step with no gradients to use them",
          options_.name, impl.accumulated.size()));
    }
    ZOE_ASSIGN_OR_RETURN(grads, PlaceViews(options_.name, "gradient", args.grads, count(),
                                           /*absent_allowed=*/true));
    ZOE_RETURN_IF_ERROR(CheckAbsentViews(args.grads));
    impl.speculation.reset();  // armed, but no gradient came through AccumulateGrad
  }
  PlacedViews params;
  if (!args.params.empty()) {
    ZOE_ASSIGN_OR_RETURN(params, PlaceViews(options_.name, "parameter", args.params, count(),
                                            /*absent_allowed=*/true));
  }
  if (impl.speculation) ZOE_RETURN_IF_ERROR(impl.UseSpeculatedParams(&params));
  const std::vector<bool> present_segments = impl.PresentSegments(grads);
  std::vector<int64_t> segment_step(segment_steps_.size());
  for (size_t s = 0; s < segment_step.size(); ++s) segment_step[s] = segment_steps_[s] + 1;
  StepReport report;
  const Status status = impl.RunStep(args, options_, {grads, params, segment_step}, &report);
  // A step that failed on accumulated gradients keeps them (their reads were consumed), so the
  // caller can retry it; gradients given with the step are the caller's to give again.
  if (!status.ok() && args.grads.empty() && impl.broken.ok()) return status;
  impl.ResetAccumulation();
  if (!status.ok()) return status;
  if (!report.skipped) CountStep(present_segments, &report);
  report.steps_taken = steps_taken_;
  report.seconds = SecondsSince(start);
  return report;
}

// From here on the gradients are consumed, whatever the outcome. The chunks speculation updated
// are read only if the step turns out to need them again.
Status OptimizerGroup::Impl::RunStep(const StepArgs& args, const OptimizerGroupOptions& options,
                                     const StepViews& views, StepReport* report) {
  const std::vector<bool> present_chunks = PresentChunks(views.grads);
  FinishSpeculativeWrites();
  pipeline.StartStepReads(NotSpeculated(present_chunks));
  const Result<optim::StepScaling> scaling = ScaleStep(args, options, views.grads);
  Status status = scaling.status();
  SpeculationOutcome outcome = SpeculationOutcome::kNone;
  if (speculation && !speculation->failure.ok()) {
    status = speculation->failure;
  } else if (scaling.ok()) {
    report->skipped = scaling->skip;
    report->grad_norm = scaling->grad_norm;
    if (speculation) outcome = DecideSpeculation(*scaling, args.hyper, views.segment_step);
    if (!scaling->skip) {
      const StepInputs inputs{&args.hyper,      segment_ends,        views.segment_step,
                              scaling->scaling, options.state_dtype, &views.grads,
                              &views.params,    &options.run,        &masters};
      status = ApplyStep(inputs, present_chunks, outcome == SpeculationOutcome::kCommit, report);
    } else if (outcome == SpeculationOutcome::kDiscard) {
      status = RestoreParams();
    }
  }
  if (speculation) EndSpeculation(outcome, status, report);
  return status;
}

// Gradients given with the step are scanned now (accumulated ones were as they came); the
// scaling follows from the total scan, agreed with the other ranks when the caller asks.
Result<optim::StepScaling> OptimizerGroup::Impl::ScaleStep(const StepArgs& args,
                                                           const OptimizerGroupOptions& options,
                                                           const PlacedViews& grads) {
  if (!args.grads.empty()) {
    std::vector<GradScanner::Piece> pieces;
    pieces.reserve(grads.size());
    for (const PlacedView& view : grads) {
      pieces.push_back({view.offset, view.data, view.dtype, view.count});
    }
    ZOE_RETURN_IF_ERROR(scanner.Add(pieces, options.run));
  }
  Result<optim::GradScan> scan = scanner.Total();
  if (args.agree_scan) scan = args.agree_scan(*scan);
  if (!scan.ok()) return scan.status();
  return optim::MakeStepScaling(*scan, args.loss_scale, options.max_grad_norm);
}

// The plan of this step, from the reads started ahead and what speculation updated.
StepPlan OptimizerGroup::Impl::PlanThisStep(const std::vector<bool>& present_chunks,
                                            bool commit) const {
  StepPlanInputs in;
  in.nvme_count = nvme_count;
  in.present = present_chunks;
  if (commit) in.speculated = speculation->updated;
  in.commit = commit;
  in.descending = pipeline.descending();
  in.prefetched = pipeline.PrefetchedChunks();
  return PlanStep(in);
}

// NVMe chunks through the pipeline, then (once every write succeeded) the flip and the HOST
// chunks in place. UpdateChunk fails only on arguments, which the first chunk checks, so the HOST
// pass cannot fail half way.
Status OptimizerGroup::Impl::ApplyStep(const StepInputs& inputs,
                                       const std::vector<bool>& present_chunks, bool commit,
                                       StepReport* report) {
  const StepPlan plan = PlanThisStep(present_chunks, commit);
  pipeline.ReleasePrefetchedChunks(plan.release);
  PipelineTotals totals;
  Status applied = pipeline.Run(
      plan.nvme_order, /*read=*/true,
      [&](size_t chunk, std::byte* state, const ChunkChecksums& checksums) {
        return UpdateChunkState(layout.chunk(chunk), state, inputs, checksums);
      },
      &totals, /*fn_hashes=*/true);
  ZOE_RETURN_IF_ERROR(BreakIfWritten(std::move(applied), totals.bytes_written));
  pipeline.slots().Flip(plan.nvme_order);
  pipeline.slots().Flip(plan.nvme_commit);
  pipeline.CommitCache();
  const Clock::time_point start = Clock::now();
  ZOE_RETURN_IF_ERROR(UpdateHostChunks(plan, inputs));
  report->bytes_read = totals.bytes_read;
  report->bytes_reused = totals.bytes_reused;
  report->bytes_written = totals.bytes_written;
  report->io_wait_seconds = totals.io_wait_seconds;
  report->compute_seconds = totals.compute_seconds + SecondsSince(start);
  return Status::Ok();
}

// Last chunk first: the gradient scan just read the gradients in ascending order, so the last
// ones are the likeliest to be still in the cache when their update reads them again.
Status OptimizerGroup::Impl::UpdateHostChunks(const StepPlan& plan, const StepInputs& inputs) {
  StepInputs host_inputs = inputs;
  host_inputs.run = &host_run;
  for (size_t c : plan.host_order) {
    if (plan.host_commit[c]) std::swap(host[c - nvme_count], host_spare[c - nvme_count]);
    if (!plan.update[c]) continue;
    ZOE_RETURN_IF_ERROR(
        UpdateChunkState(layout.chunk(c), host_state(c), host_inputs).WithContext(ChunkName(c)));
  }
  return Status::Ok();
}

Status OptimizerGroup::CheckStepArgs(const StepArgs& args) const {
  if (args.hyper.kind != options_.kind) {
    return Status::InvalidArgument(fmt::format(
        "optimizer group '{}': step with optimizer {} on a group created for {}", options_.name,
        IsKnownKind(args.hyper.kind) ? optim::KindName(args.hyper.kind) : "unknown",
        optim::KindName(options_.kind)));
  }
  ZOE_RETURN_IF_ERROR(optim::ValidateHyperParams(args.hyper)
                          .WithContext(fmt::format("optimizer group '{}'", options_.name)));
  if (!(args.loss_scale > 0.0) || !std::isfinite(args.loss_scale)) {
    return Status::InvalidArgument(
        fmt::format("optimizer group '{}': loss_scale {} is out of range; allowed: (0, inf)",
                    options_.name, args.loss_scale));
  }
  return Status::Ok();
}

void OptimizerGroup::DiscardGradients() { impl_->ResetAccumulation(); }

Result<optim::GradScan> OptimizerGroup::AccumulatedScan() const {
  const Impl& impl = *impl_;
  ZOE_RETURN_IF_ERROR(impl.CheckUsable("scan the accumulated gradients"));
  ZOE_RETURN_IF_ERROR(impl.CheckCoverage());
  return impl.scanner.Total();
}

Status OptimizerGroup::AccumulateGrad(size_t offset, const GradView& grad) {
  Impl& impl = *impl_;
  ZOE_RETURN_IF_ERROR(impl.CheckUsable("accumulate gradients"));
  ZOE_RETURN_IF_ERROR(CheckView(options_.name, "accumulated gradient", 0, grad.data, grad.dtype,
                                grad.count, /*absent_allowed=*/true));
  if (grad.count == 0) {
    return Status::InvalidArgument(fmt::format(
        "optimizer group '{}': accumulated gradient at offset {} is empty", options_.name, offset));
  }
  if (offset > count() || grad.count > count() - offset) {
    return Status::InvalidArgument(fmt::format(
        "optimizer group '{}': accumulated gradient [{}, {}) is outside the group's [0, {})",
        options_.name, offset, offset + grad.count, count()));
  }
  if (grad.data == nullptr) {
    ZOE_RETURN_IF_ERROR(impl.CheckAbsentRange("accumulated gradient", 0, offset, grad.count));
  }
  const PlacedView view{offset, static_cast<std::byte*>(const_cast<void*>(grad.data)), grad.dtype,
                        grad.count};
  auto next = impl.accumulated.lower_bound(offset);
  const PlacedView* clash = nullptr;
  if (next != impl.accumulated.end() && next->first < view.end()) clash = &next->second;
  if (next != impl.accumulated.begin() && std::prev(next)->second.end() > offset) {
    clash = &std::prev(next)->second;
  }
  if (clash != nullptr) {
    return Status::InvalidArgument(fmt::format(
        "optimizer group '{}': accumulated gradient [{}, {}) overlaps [{}, {}) given before",
        options_.name, offset, view.end(), clash->offset, clash->end()));
  }
  const GradScanner::Piece piece{offset, grad.data, grad.dtype, grad.count};
  ZOE_RETURN_IF_ERROR(impl.scanner.Add({&piece, 1}, options_.run));
  impl.accumulated.emplace(offset, view);
  impl.accumulated_elements += view.count;
  for (size_t c = impl.layout.ChunkOf(offset); c <= impl.layout.ChunkOf(view.end() - 1); ++c) {
    const ChunkRegions regions = impl.layout.chunk(c);
    const size_t from = std::max(offset, regions.first);
    const size_t to = std::min(view.end(), regions.first + regions.count);
    impl.chunk_covered[c] += to - from;
    if (view.present()) impl.chunk_present[c] += to - from;
    const bool complete = impl.chunk_covered[c] == regions.count;
    if (!complete || impl.chunk_present[c] == 0) continue;
    const bool read_ahead = impl.on_nvme(c) && impl.pipeline.IsPrefetched(c);
    if (impl.on_nvme(c)) {
      impl.completion_order.push_back(c);
      if (!read_ahead) impl.pipeline.StartPrefetch(c);
    }
    if (impl.speculation) impl.SpeculateChunk(c, read_ahead);
  }
  // Once the gradients cover the group none will follow: the chunk kept waiting is due now.
  if (impl.speculation && impl.accumulated_elements == count()) {
    impl.SpeculateWaiting(/*keep_newest=*/false);
  }
  impl.ReadAhead();
  return Status::Ok();
}

Status OptimizerGroup::Speculate(const StepArgs& args) {
  Impl& impl = *impl_;
  if (!options_.speculative) {
    return Status::FailedPrecondition(fmt::format(
        "optimizer group '{}': speculation is off; create the group with speculative on",
        options_.name));
  }
  ZOE_RETURN_IF_ERROR(CheckStepArgs(args));
  if (!args.grads.empty()) {
    return Status::InvalidArgument(
        fmt::format("optimizer group '{}': speculate takes no gradients; hand them over with "
                    "AccumulateGrad",
                    options_.name));
  }
  ZOE_RETURN_IF_ERROR(impl.CheckIdle("speculate"));
  PlacedViews params;
  if (!args.params.empty()) {
    ZOE_ASSIGN_OR_RETURN(params, PlaceViews(options_.name, "parameter", args.params, count(),
                                            /*absent_allowed=*/false));
  }
  // Finite gradients of norm 0 give the scaling of every step that is neither skipped nor clipped.
  ZOE_ASSIGN_OR_RETURN(
      optim::StepScaling scaling,
      optim::MakeStepScaling(optim::GradScan{}, args.loss_scale, options_.max_grad_norm));
  impl.prepared_load.reset();
  Impl::Speculation& s = impl.speculation.emplace();
  s.hyper = args.hyper;
  s.loss_scale = args.loss_scale;
  s.scaling = scaling.scaling;
  s.params = std::move(params);
  s.segment_step.resize(segment_steps_.size());
  for (size_t i = 0; i < segment_steps_.size(); ++i) s.segment_step[i] = segment_steps_[i] + 1;
  s.state_dtype = options_.state_dtype;
  s.run = options_.run;
  s.updated.assign(impl.layout.chunk_count(), false);
  s.declined = impl.speculation_backoff.Decline();
  impl.ReadAhead();
  return Status::Ok();
}

const SpeculationStats& OptimizerGroup::speculation_stats() const {
  return impl_->speculation_totals;
}

Status OptimizerGroup::CheckStateRange(StateSlot slot, size_t offset, size_t length) const {
  const auto index = static_cast<size_t>(slot);
  if (index >= kStateRegions) {
    return Status::InvalidArgument(
        fmt::format("optimizer group '{}': unknown state slot {}", options_.name, index));
  }
  if (!impl_->layout.chunk(0).used[index]) {
    return Status::InvalidArgument(fmt::format("optimizer group '{}': {} keeps no {}",
                                               options_.name, optim::KindName(options_.kind),
                                               SlotName(slot)));
  }
  if (offset > count() || length > count() - offset) {
    return Status::InvalidArgument(
        fmt::format("optimizer group '{}': state range {} is outside the group's [0, {})",
                    options_.name, DescribeElementRange(offset, length), count()));
  }
  return Status::Ok();
}

namespace {

// int8 state: calls fn(widened_from, widened_to, from, to) for each stretch of chunk elements
// [from, to) (relative to the chunk) between block splits, widened to whole blocks; the scales of
// a widened stretch are contiguous from regions.BlockAt(widened_from) on.
template <class Fn>
Status ForEachQuantizedRun(const ChunkRegions& regions, size_t from, size_t to, const Fn& fn) {
  std::vector<size_t> bounds = {0};
  bounds.insert(bounds.end(), regions.block_splits.begin(), regions.block_splits.end());
  bounds.push_back(regions.count);
  for (size_t i = 0; i + 1 < bounds.size(); ++i) {
    const size_t a = std::max(from, bounds[i]), b = std::min(to, bounds[i + 1]);
    if (a >= b) continue;
    const size_t wide_a = std::max(bounds[i], a / optim::kQuantBlock * optim::kQuantBlock);
    const size_t wide_b =
        std::min(bounds[i + 1], CeilDiv(b, optim::kQuantBlock) * optim::kQuantBlock);
    ZOE_RETURN_IF_ERROR(fn(wide_a, wide_b, a, b));
  }
  return Status::Ok();
}

size_t ScaleRegionOf(size_t r) { return r == 1 ? kExpAvgScaleRegion : kExpAvgSqScaleRegion; }
optim::Moment MomentOf(size_t r) {
  return r == 1 ? optim::Moment::kExpAvg : optim::Moment::kExpAvgSq;
}

// Dequantizes chunk elements [from, to) of int8 region `r` (1 or 2) into out.
Status ReadQuantized(const ChunkRegions& regions, const std::byte* state, size_t r, size_t from,
                     size_t to, float* out) {
  const auto* codes = reinterpret_cast<const uint8_t*>(state + regions.offset[r]);
  const auto* scales = reinterpret_cast<const float*>(state + regions.offset[ScaleRegionOf(r)]);
  std::vector<float> block_values;
  return ForEachQuantizedRun(regions, from, to, [&](size_t wa, size_t wb, size_t a, size_t b) {
    block_values.resize(wb - wa);
    ZOE_RETURN_IF_ERROR(optim::DequantizeMoments(MomentOf(r), codes + wa,
                                                 scales + regions.BlockAt(wa), wb - wa,
                                                 wa % optim::kQuantBlock, block_values.data()));
    std::copy(block_values.begin() + (a - wa), block_values.begin() + (b - wa), out + (a - from));
    return Status::Ok();
  });
}

// Stores values[0, to - from) as chunk elements [from, to) of int8 region `r`: each block it
// touches is dequantized, overwritten where asked and requantized (an element of a partly
// written block keeps its value within the code's error, its byte when the absmax holds).
Status WriteQuantized(const ChunkRegions& regions, std::byte* state, size_t r, size_t from,
                      size_t to, const float* values) {
  auto* codes = reinterpret_cast<uint8_t*>(state + regions.offset[r]);
  auto* scales = reinterpret_cast<float*>(state + regions.offset[ScaleRegionOf(r)]);
  std::vector<float> block_values;
  return ForEachQuantizedRun(regions, from, to, [&](size_t wa, size_t wb, size_t a, size_t b) {
    const size_t block = regions.BlockAt(wa), offset = wa % optim::kQuantBlock;
    block_values.resize(wb - wa);
    ZOE_RETURN_IF_ERROR(optim::DequantizeMoments(MomentOf(r), codes + wa, scales + block, wb - wa,
                                                 offset, block_values.data()));
    std::copy(values + (a - from), values + (b - from), block_values.begin() + (a - wa));
    return optim::QuantizeMoments(MomentOf(r), block_values.data(), wb - wa, offset, codes + wa,
                                  scales + block);
  });
}

}  // namespace

Status OptimizerGroup::ReadState(StateSlot slot, size_t offset, std::span<float> out) const {
  ZOE_RETURN_IF_ERROR(CheckStateRange(slot, offset, out.size()));
  Impl& impl = *impl_;
  ZOE_RETURN_IF_ERROR(impl.CheckUsable("read state"));
  const auto r = static_cast<size_t>(slot);
  const size_t end = offset + out.size();
  if (slot == StateSlot::kMaster && !impl.masters.empty()) {
    detail::GatherFromViews(impl.masters, offset, end, out.data());
    return Status::Ok();
  }
  AlignedBuffer staging;
  for (size_t pos = offset; pos < end;) {
    const size_t c = impl.layout.ChunkOf(pos);
    const ChunkRegions regions = impl.layout.chunk(c);
    const std::byte* state = nullptr;
    if (impl.on_nvme(c)) {
      if (staging.empty()) {
        ZOE_ASSIGN_OR_RETURN(staging, AlignedBuffer::Allocate(impl.layout.max_chunk_bytes()));
      }
      ZOE_RETURN_IF_ERROR(impl.pipeline.ReadChunk(c, staging.data()));
      state = staging.data();
    } else {
      state = impl.host_state(c);
    }
    const size_t to = std::min(end, regions.first + regions.count);
    if (options_.state_dtype == optim::DType::kInt8 && r != 0) {
      ZOE_RETURN_IF_ERROR(ReadQuantized(regions, state, r, pos - regions.first, to - regions.first,
                                        out.data() + (pos - offset)));
      pos = to;
      continue;
    }
    const std::byte* src =
        state + regions.offset[r] + (pos - regions.first) * regions.element_bytes[r];
    float* dst = out.data() + (pos - offset);
    if (regions.element_bytes[r] == sizeof(float)) {
      std::memcpy(dst, src, (to - pos) * sizeof(float));
    } else {
      ZOE_RETURN_IF_ERROR(optim::CastToF32(src, options_.state_dtype, dst, to - pos));
    }
    pos = to;
  }
  return Status::Ok();
}

// Stores values[from - offset, to - offset) into region `r` of a chunk's state.
Status OptimizerGroup::StoreState(size_t chunk, std::byte* state, size_t r, size_t offset,
                                  std::span<const float> values) const {
  const ChunkRegions regions = impl_->layout.chunk(chunk);
  const size_t from = std::max(offset, regions.first);
  const size_t to = std::min(offset + values.size(), regions.first + regions.count);
  if (r == 0 && regions.master_external) {
    detail::ScatterToViews(impl_->masters, from, to, values.data() + (from - offset));
    return Status::Ok();
  }
  if (options_.state_dtype == optim::DType::kInt8 && r != 0) {
    return WriteQuantized(regions, state, r, from - regions.first, to - regions.first,
                          values.data() + (from - offset));
  }
  std::byte* dst = state + regions.offset[r] + (from - regions.first) * regions.element_bytes[r];
  const float* src = values.data() + (from - offset);
  if (regions.element_bytes[r] == sizeof(float)) {
    std::memcpy(dst, src, (to - from) * sizeof(float));
    return Status::Ok();
  }
  return optim::CastFromF32(src, options_.state_dtype, dst, to - from);
}

// NVMe chunks: read, modify, write to the inactive slot, flip once all succeeded; then HOST.
Status OptimizerGroup::WriteState(StateSlot slot, size_t offset, std::span<const float> values) {
  ZOE_RETURN_IF_ERROR(CheckStateRange(slot, offset, values.size()));
  Impl& impl = *impl_;
  ZOE_RETURN_IF_ERROR(impl.CheckIdle("write state"));
  // Reads a speculation started ahead of its gradients hold the state before this write (and
  // the pipeline below would take them for its own).
  impl.pipeline.ReleasePrefetched();
  impl.DropPreparedLoad();
  ZOE_RETURN_IF_ERROR(impl.CheckUsable("write state"));
  if (values.empty()) return Status::Ok();
  const auto r = static_cast<size_t>(slot);
  ZOE_RETURN_IF_ERROR(CheckQuantizable(slot, offset, values));
  const size_t first = impl.layout.ChunkOf(offset);
  const size_t last = impl.layout.ChunkOf(offset + values.size() - 1);
  std::vector<size_t> nvme_chunks;
  for (size_t c = first; c <= last && impl.on_nvme(c); ++c) nvme_chunks.push_back(c);
  PipelineTotals totals;
  Status stored = impl.pipeline.Run(
      nvme_chunks, /*read=*/true,
      [&](size_t chunk, std::byte* state, const ChunkChecksums&) {
        return StoreState(chunk, state, r, offset, values);
      },
      &totals);
  ZOE_RETURN_IF_ERROR(impl.BreakIfWritten(std::move(stored), totals.bytes_written));
  impl.pipeline.slots().Flip(nvme_chunks);
  for (size_t c = std::max(first, impl.nvme_count); c <= last; ++c) {
    ZOE_RETURN_IF_ERROR(StoreState(c, impl.host_state(c), r, offset, values));
  }
  return Status::Ok();
}

// int8 moments hold finite values, exp_avg_sq's none below zero: checked before anything is
// written, so a bad value loses nothing.
Status OptimizerGroup::CheckQuantizable(StateSlot slot, size_t offset,
                                        std::span<const float> values) const {
  if (options_.state_dtype != optim::DType::kInt8 || slot == StateSlot::kMaster)
    return Status::Ok();
  for (size_t i = 0; i < values.size(); ++i) {
    if (std::isfinite(values[i]) && (slot == StateSlot::kExpAvg || values[i] >= 0.0f)) continue;
    return Status::InvalidArgument(fmt::format(
        "optimizer group '{}': {} element {} is {}; allowed with int8 moments: finite values{}",
        options_.name, SlotName(slot), offset + i, values[i],
        slot == StateSlot::kExpAvgSq ? ", >= 0" : ""));
  }
  return Status::Ok();
}

// Absent views (null data) must be whole segments; PlaceViews checked everything else.
Status OptimizerGroup::CheckAbsentViews(std::span<const GradView> grads) const {
  size_t offset = 0;
  for (size_t i = 0; i < grads.size(); ++i) {
    if (grads[i].data == nullptr && grads[i].count > 0) {
      ZOE_RETURN_IF_ERROR(impl_->CheckAbsentRange("gradient", i, offset, grads[i].count));
    }
    offset += grads[i].count;
  }
  return Status::Ok();
}

// A step that updated some segment counts for the group and for each segment it updated.
void OptimizerGroup::CountStep(const std::vector<bool>& present_segments, StepReport* report) {
  for (size_t s = 0; s < present_segments.size(); ++s) {
    if (!present_segments[s]) continue;
    ++segment_steps_[s];
    ++report->segments_updated;
  }
  if (report->segments_updated > 0) ++steps_taken_;
}

std::string DescribeElementRange(uint64_t offset, uint64_t count) {
  if (count <= std::numeric_limits<uint64_t>::max() - offset)
    return fmt::format("[{}, {})", offset, offset + count);
  return fmt::format("[{}, {} + {})", offset, offset, count);
}

Status CheckStepCount(std::string_view what, int64_t steps) {
  if (steps >= 0 && steps <= kMaxStepCount) return Status::Ok();
  return Status::InvalidArgument(fmt::format(
      "{} = {} is out of range; allowed: [0, {}] (the next step, one more, must fit int64)", what,
      steps, kMaxStepCount));
}

void OptimizerGroup::set_steps_taken(int64_t steps) {
  steps_taken_ = steps;
  std::fill(segment_steps_.begin(), segment_steps_.end(), steps);
}

Status OptimizerGroup::SetSegmentSteps(std::span<const int64_t> steps) {
  if (steps.size() != segment_steps_.size()) {
    return Status::InvalidArgument(
        fmt::format("optimizer group '{}': {} segment step counts given; the group has {} segments",
                    options_.name, steps.size(), segment_steps_.size()));
  }
  for (size_t s = 0; s < steps.size(); ++s) {
    Status valid = CheckStepCount(fmt::format("segment {} step count", s), steps[s]);
    if (!valid.ok())
      return std::move(valid).WithContext(fmt::format("optimizer group '{}'", options_.name));
  }
  std::copy(steps.begin(), steps.end(), segment_steps_.begin());
  steps_taken_ = steps.empty() ? 0 : *std::max_element(steps.begin(), steps.end());
  return Status::Ok();
}

size_t OptimizerGroup::reads_started() const {
  return impl_->pipeline.buffers().count(BufferState::kPrefetched);
}
size_t OptimizerGroup::chunk_count() const { return impl_->layout.chunk_count(); }
size_t OptimizerGroup::nvme_chunk_count() const { return impl_->nvme_count; }
const StateLayout& OptimizerGroup::layout() const { return impl_->layout; }
uint64_t OptimizerGroup::pinned_bytes() const {
  uint64_t total = impl_->pipeline.buffers().pinned_bytes();
  for (const PinnedBuffer& buffer : impl_->host) total += buffer.size();
  for (const PinnedBuffer& buffer : impl_->host_spare) total += buffer.size();
  return total;
}
const Status& OptimizerGroup::broken() const { return impl_->broken; }
uint64_t OptimizerGroup::nvme_bytes() const { return impl_->pipeline.slots().bytes(); }
}  // namespace zoe::offload
