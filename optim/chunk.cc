#include "optim/chunk.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <string>
#include <vector>

#include "core/topology.h"
#include "optim/dispatch.h"
#include "optim/kernels.h"
#include "optim/quantize.h"

namespace zoe::optim {
namespace {

// The element types CastFromF32 converts fp32 to and CastToF32 converts to fp32.
constexpr DType kCastDTypes[] = {DType::kBFloat16, DType::kFloat16};

Status CheckRange(const char* name, double value, double min, bool min_inclusive, double max,
                  bool max_inclusive, const char* allowed) {
  const bool above = min_inclusive ? value >= min : value > min;
  const bool below = max_inclusive ? value <= max : value < max;
  if (std::isnan(value) || !above || !below) {
    return Status::InvalidArgument("optimizer " + std::string(name) + " = " +
                                   std::to_string(value) + " is out of range; allowed: " + allowed);
  }
  return Status::Ok();
}

Result<const KernelTable*> ResolveKernels(const RunOptions& run) {
  if (run.tile_elements == 0) return Status::InvalidArgument("tile_elements is 0; allowed: >= 1");
  if (run.isa.has_value()) return KernelsFor(*run.isa);
  ZOE_ASSIGN_OR_RETURN(Isa isa, DefaultIsa());
  return KernelsFor(isa);
}

// Calls fn(begin, end) on consecutive tiles of [0, count): on the executor's threads and the
// caller, or on the caller alone.
template <class Fn>
void ForEachTile(const RunOptions& run, size_t count, const Fn& fn) {
  if (run.executor != nullptr) {
    run.executor->ParallelFor(count, run.tile_elements, fn);
    return;
  }
  for (size_t begin = 0; begin < count;) {
    const size_t end = begin + std::min(run.tile_elements, count - begin);  // never wraps
    fn(begin, end);
    begin = end;
  }
}

}  // namespace

UpdateConstants MakeUpdateConstants(const HyperParams& h, int64_t step,
                                    const GradScaling& scaling) {
  UpdateConstants k;
  const auto t = static_cast<double>(step);
  k.grad_scale = static_cast<float>(scaling.inv_loss_scale * scaling.clip_factor);
  k.decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
  k.weight_decay = static_cast<float>(h.weight_decay);
  k.beta1 = static_cast<float>(h.beta1);
  k.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  k.beta2 = static_cast<float>(h.beta2);
  k.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  k.eps = static_cast<float>(h.eps);
  switch (h.kind) {
    case Kind::kAdamW:
    case Kind::kAdam:
      k.neg_step_size = static_cast<float>(-(h.lr / (1.0 - std::pow(h.beta1, t))));
      k.bias_correction2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(h.beta2, t)));
      k.inv_bias_correction2_sqrt = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(h.beta2, t)));
      break;
    case Kind::kAdagrad:
      k.neg_step_size = static_cast<float>(-(h.lr / (1.0 + (t - 1.0) * h.lr_decay)));
      break;
    case Kind::kLion:
      k.neg_step_size = static_cast<float>(-h.lr);
      break;
  }
  return k;
}

namespace {

Status CheckBuffers(Kind kind, const ChunkLayout& layout, const ChunkBuffers& chunk) {
  if (chunk.count == 0) return Status::Ok();
  const auto missing = [&](const char* name) {
    return Status::InvalidArgument(std::string("chunk of ") + std::to_string(chunk.count) +
                                   " elements has no " + name + " buffer (null pointer); " +
                                   std::string(KindName(kind)) + " needs one");
  };
  if (chunk.master == nullptr) return missing("master");
  if (chunk.grad == nullptr) return missing("grad");
  if (UsesExpAvg(kind) && chunk.exp_avg == nullptr) return missing("exp_avg");
  if (UsesExpAvgSq(kind) && chunk.exp_avg_sq == nullptr) return missing("exp_avg_sq");
  if (layout.param_copy.has_value() && chunk.param_copy == nullptr) return missing("param_copy");
  if (layout.state != DType::kInt8) return Status::Ok();
  if (chunk.block_offset >= kQuantBlock) {
    return Status::InvalidArgument("int8 state block_offset " + std::to_string(chunk.block_offset) +
                                   " is out of range; allowed: [0, " + std::to_string(kQuantBlock) +
                                   ")");
  }
  if (UsesExpAvg(kind) && chunk.exp_avg_scale == nullptr) return missing("exp_avg_scale");
  if (UsesExpAvgSq(kind) && chunk.exp_avg_sq_scale == nullptr) return missing("exp_avg_sq_scale");
  if (chunk.read_sums[0] != nullptr && chunk.read_origin % kQuantBlock != chunk.block_offset) {
    return Status::InvalidArgument(
        "int8 state read_origin " + std::to_string(chunk.read_origin) + " and block_offset " +
        std::to_string(chunk.block_offset) + " disagree; allowed: read_origin % " +
        std::to_string(kQuantBlock) + " == block_offset (hashed units must start blocks)");
  }
  return Status::Ok();
}

// Calls fn(first_block, last_block) on consecutive runs of whole blocks, about
// run.tile_elements elements each, like ForEachTile.
template <class Fn>
void ForEachBlockTile(const RunOptions& run, size_t blocks, const Fn& fn) {
  RunOptions in_blocks = run;
  in_blocks.tile_elements = std::max<size_t>(1, run.tile_elements / kQuantBlock);
  ForEachTile(in_blocks, blocks, fn);
}

// Calls fn(begin, end) on tiles of [0, count) that end on multiples of `unit` counted from
// `origin` (element i is element i + origin of the unit grid): the head up to the first such
// boundary on the calling thread, then tiles of run.tile_elements rounded down to whole units
// (at least one; rounding down cannot overflow, whatever the tile size).
template <class Fn>
void ForEachAlignedTile(const RunOptions& run, size_t count, size_t origin, size_t unit,
                        const Fn& fn) {
  const size_t head = std::min(count, (unit - origin % unit) % unit);
  if (head > 0) fn(0, head);
  RunOptions in_units = run;
  in_units.tile_elements = std::max(unit, run.tile_elements / unit * unit);
  ForEachTile(in_units, count - head,
              [&](size_t begin, size_t end) { fn(head + begin, head + end); });
}

}  // namespace

CopySlot CopySlotOf(const std::optional<DType>& copy) {
  if (!copy.has_value()) return CopySlot::kNone;
  switch (*copy) {
    case DType::kFloat32:
      return CopySlot::kF32;
    case DType::kBFloat16:
      return CopySlot::kBF16;
    case DType::kFloat16:
      return CopySlot::kF16;
    default:  // ValidateLayout refuses every other dtype
      return CopySlot::kNone;
  }
}

size_t LastLevelCacheBytes() {
  static const size_t bytes = [] {
    const Result<Topology> topology = SystemTopology();
    if (topology.ok() && topology->last_level_cache_bytes() > 0) {
      return static_cast<size_t>(topology->last_level_cache_bytes());
    }
    for (int name : {_SC_LEVEL4_CACHE_SIZE, _SC_LEVEL3_CACHE_SIZE, _SC_LEVEL2_CACHE_SIZE}) {
      const long size = sysconf(name);
      if (size > 0) return static_cast<size_t>(size);
    }
    return size_t{32} << 20;
  }();
  return bytes;
}

namespace {

// Whether the fp32 arrays an update writes can be streamed: they must share master's alignment
// modulo 64 bytes, so that one scalar prologue aligns them all (kernel_math.h).
bool WritesCongruent(Kind kind, const ChunkLayout& layout, const ChunkBuffers& chunk) {
  const auto residue = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 64; };
  const uintptr_t master = residue(chunk.master);
  if (layout.state == DType::kFloat32) {
    if (UsesExpAvg(kind) && residue(chunk.exp_avg) != master) return false;
    if (UsesExpAvgSq(kind) && residue(chunk.exp_avg_sq) != master) return false;
  }
  return layout.param_copy != DType::kFloat32 || residue(chunk.param_copy) == master;
}

}  // namespace

size_t UpdateBytesRead(Kind kind, const ChunkLayout& layout, size_t count) {
  const size_t per_element = 4 + DTypeSize(layout.grad) +
                             DTypeSize(layout.state) * static_cast<size_t>(StateTensors(kind));
  return per_element * count;
}

StoreMode ResolveStores(StoreMode mode, size_t bytes_read) {
  if (mode != StoreMode::kAuto) return mode;
  return bytes_read > LastLevelCacheBytes() ? StoreMode::kStreaming : StoreMode::kCached;
}

UpdateVariant ChooseUpdateVariant(Kind kind, const ChunkLayout& layout, const ChunkBuffers& chunk,
                                  const RunOptions& run) {
  UpdateVariant variant;
  variant.fast = run.arithmetic == Arithmetic::kFast;
  // The int8 block kernels store with ordinary stores only: each block's fp32 moments are on
  // the stack, in L1, when they are requantized (kernels.h).
  if (layout.state == DType::kInt8) return variant;
  const bool wanted = ResolveStores(run.stores, UpdateBytesRead(kind, layout, chunk.count)) ==
                      StoreMode::kStreaming;
  variant.streaming = wanted && WritesCongruent(kind, layout, chunk);
  return variant;
}

Status ValidateHyperParams(const HyperParams& h) {
  const double inf = INFINITY;
  ZOE_RETURN_IF_ERROR(CheckRange("lr", h.lr, 0.0, true, inf, false, "[0, inf)"));
  ZOE_RETURN_IF_ERROR(CheckRange("beta1", h.beta1, 0.0, true, 1.0, false, "[0, 1)"));
  ZOE_RETURN_IF_ERROR(CheckRange("beta2", h.beta2, 0.0, true, 1.0, false, "[0, 1)"));
  if (h.kind != Kind::kLion) {
    ZOE_RETURN_IF_ERROR(CheckRange("eps", h.eps, 0.0, false, inf, false, "(0, inf)"));
  }
  ZOE_RETURN_IF_ERROR(
      CheckRange("weight_decay", h.weight_decay, 0.0, true, inf, false, "[0, inf)"));
  return CheckRange("lr_decay", h.lr_decay, 0.0, true, inf, false, "[0, inf)");
}

Result<GradScan> ScanGradients(const void* grad, DType grad_dtype, size_t count,
                               const RunOptions& run) {
  if (count > 0 && grad == nullptr) {
    return Status::InvalidArgument("gradient scan of " + std::to_string(count) +
                                   " elements got a null buffer");
  }
  ZOE_RETURN_IF_ERROR(CheckKernelDType(grad_dtype, kAllDTypes, "gradient scan dtype"));
  ZOE_ASSIGN_OR_RETURN(const KernelTable* kernels, ResolveKernels(run));
  const SumSquaresFn sum_squares = kernels->sum_squares[KernelTable::Slot(grad_dtype)];
  // One partial per tile, added in tile order: the result does not depend on which thread ran
  // which tile.
  std::vector<double> partials(count / run.tile_elements + (count % run.tile_elements != 0));
  ForEachTile(run, count, [&](size_t begin, size_t end) {
    partials[begin / run.tile_elements] = sum_squares(grad, begin, end);
  });
  GradScan scan;
  for (double partial : partials) scan.sum_squares += partial;
  return scan;
}

Result<StepScaling> MakeStepScaling(const GradScan& total, double loss_scale,
                                    double max_grad_norm) {
  ZOE_RETURN_IF_ERROR(
      CheckRange("loss_scale", loss_scale, 0.0, false, INFINITY, false, "(0, inf)"));
  ZOE_RETURN_IF_ERROR(
      CheckRange("max_grad_norm", max_grad_norm, 0.0, true, INFINITY, false, "0 (off) or > 0"));
  StepScaling out;
  out.scaling.inv_loss_scale = 1.0 / loss_scale;
  if (!total.finite()) {
    out.skip = true;
    out.grad_norm = INFINITY;
    return out;
  }
  out.grad_norm = std::sqrt(total.sum_squares) / loss_scale;
  if (max_grad_norm > 0.0) {
    const double clip = max_grad_norm / (out.grad_norm + 1e-6);
    if (clip < 1.0) out.scaling.clip_factor = clip;
  }
  return out;
}

Status ValidateLayout(const ChunkLayout& layout) {
  ZOE_RETURN_IF_ERROR(CheckKernelDType(layout.state, kStateDTypes, "optimizer state dtype"));
  ZOE_RETURN_IF_ERROR(CheckKernelDType(layout.grad, kAllDTypes, "gradient dtype"));
  if (!layout.param_copy.has_value()) return Status::Ok();
  return CheckKernelDType(*layout.param_copy, kAllDTypes, "param_copy dtype");
}

Status ValidateUpdate(const HyperParams& hyper, int64_t step, const ChunkLayout& layout,
                      const ChunkBuffers& chunk, const GradScaling& scaling) {
  ZOE_RETURN_IF_ERROR(ValidateHyperParams(hyper));
  if (step < 1) {
    return Status::InvalidArgument(
        "optimizer step " + std::to_string(step) +
        " is out of range; allowed: >= 1 (steps taken, this one included)");
  }
  const double factor = scaling.inv_loss_scale * scaling.clip_factor;
  if (!std::isfinite(factor) || factor <= 0.0) {
    return Status::InvalidArgument(
        "gradient scale factor " + std::to_string(factor) +
        " (inv_loss_scale * clip_factor) is out of range; allowed: (0, inf)");
  }
  ZOE_RETURN_IF_ERROR(ValidateLayout(layout));
  return CheckBuffers(hyper.kind, layout, chunk);
}

Status UpdateChunk(const HyperParams& hyper, int64_t step, const ChunkLayout& layout,
                   const ChunkBuffers& chunk, const GradScaling& scaling, const RunOptions& run) {
  ZOE_RETURN_IF_ERROR(ValidateUpdate(hyper, step, layout, chunk, scaling));
  ZOE_ASSIGN_OR_RETURN(const KernelTable* kernels, ResolveKernels(run));
  const UpdateConstants constants = MakeUpdateConstants(hyper, step, scaling);
  const bool quantized = layout.state == DType::kInt8;
  const CopySlot copy = CopySlotOf(layout.param_copy);
  const UpdateVariant variant = ChooseUpdateVariant(hyper.kind, layout, chunk, run);
  const UpdateFn update = quantized ? kernels->block_update[KernelTable::BlockUpdateIndex(
                                          hyper.kind, layout.grad, copy, variant.fast)]
                                    : kernels->update[KernelTable::UpdateIndex(
                                          hyper.kind, layout.grad, layout.state, copy, variant)];
  UpdatePointers pointers{chunk.master,          chunk.grad,       chunk.exp_avg,
                          chunk.exp_avg_sq,      chunk.param_copy, chunk.exp_avg_scale,
                          chunk.exp_avg_sq_scale};
  // Tiles are cut only where the kernel may start: int8 state at quantization block boundaries,
  // hashed reads at unit boundaries of the hashed arrays (so that no block is cut between two
  // calls; for int8 those are block boundaries too: CheckBuffers).
  size_t origin = 0, unit = 1;
  if (quantized) {
    pointers.block_offset = chunk.block_offset;
    origin = chunk.block_offset;
    unit = kQuantBlock;
  }
  if (chunk.read_sums[0] != nullptr) {
    std::copy(std::begin(chunk.read_sums), std::end(chunk.read_sums), pointers.read_sums);
    pointers.read_origin = chunk.read_origin;
    origin = chunk.read_origin;
    unit = ReadHashElements(layout.state);
  }
  ForEachAlignedTile(run, chunk.count, origin, unit,
                     [&](size_t begin, size_t end) { update(constants, pointers, begin, end); });
  return Status::Ok();
}

bool UpdateHashesReads(Kind kind, DType state, const RunOptions& run) {
  Result<const KernelTable*> kernels = ResolveKernels(run);
  return kernels.ok() && (*kernels)->HashesReads(kind, state);
}

Result<StepScaling> StepChunk(const HyperParams& hyper, int64_t step, const ChunkLayout& layout,
                              const ChunkBuffers& chunk, double loss_scale, double max_grad_norm,
                              const RunOptions& run) {
  ZOE_ASSIGN_OR_RETURN(GradScan scan, ScanGradients(chunk.grad, layout.grad, chunk.count, run));
  ZOE_ASSIGN_OR_RETURN(StepScaling scaling, MakeStepScaling(scan, loss_scale, max_grad_norm));
  if (scaling.skip) return scaling;
  ZOE_RETURN_IF_ERROR(UpdateChunk(hyper, step, layout, chunk, scaling.scaling, run));
  return scaling;
}

// Converts `count` elements between fp32 and `dtype` (bf16 or fp16) on the run's tiles: to fp32
// when `widen`, from fp32 otherwise.
static Status ConvertOnTiles(const void* src, void* dst, size_t count, DType dtype, bool widen,
                             const RunOptions& run) {
  ZOE_RETURN_IF_ERROR(
      CheckKernelDType(dtype, kCastDTypes, widen ? "cast source dtype" : "cast target dtype"));
  if (count > 0 && (src == nullptr || dst == nullptr)) {
    return Status::InvalidArgument("cast of " + std::to_string(count) +
                                   " elements got a null buffer");
  }
  ZOE_ASSIGN_OR_RETURN(const KernelTable* kernels, ResolveKernels(run));
  const size_t slot = KernelTable::Slot(dtype);
  const ConvertFn convert = widen ? kernels->to_f32[slot] : kernels->from_f32[slot];
  ForEachTile(run, count, [&](size_t begin, size_t end) { convert(src, dst, begin, end); });
  return Status::Ok();
}

Status CastFromF32(const float* src, DType dst_dtype, void* dst, size_t count,
                   const RunOptions& run) {
  return ConvertOnTiles(src, dst, count, dst_dtype, /*widen=*/false, run);
}

Status CastToF32(const void* src, DType src_dtype, float* dst, size_t count,
                 const RunOptions& run) {
  return ConvertOnTiles(src, dst, count, src_dtype, /*widen=*/true, run);
}

size_t QuantBlockCount(size_t count, size_t block_offset) {
  if (count == 0) return 0;
  const size_t first = std::min(count, kQuantBlock - block_offset);
  const size_t rest = count - first;
  return 1 + rest / kQuantBlock + (rest % kQuantBlock != 0);
}

QuantBlockRange QuantBlockAt(size_t count, size_t block_offset, size_t block) {
  const size_t first = std::min(count, kQuantBlock - block_offset);
  if (block == 0) return {0, first};
  const size_t begin = first + (block - 1) * kQuantBlock;
  return {begin, std::min(count, begin + kQuantBlock)};
}

namespace {

Status CheckMomentArguments(const char* what, size_t count, size_t block_offset, const void* a,
                            const void* b, const void* c) {
  if (block_offset >= kQuantBlock) {
    return Status::InvalidArgument(
        std::string(what) + ": block_offset " + std::to_string(block_offset) +
        " is out of range; allowed: [0, " + std::to_string(kQuantBlock) + ")");
  }
  if (count > 0 && (a == nullptr || b == nullptr || c == nullptr)) {
    return Status::InvalidArgument(std::string(what) + " of " + std::to_string(count) +
                                   " elements got a null buffer");
  }
  return Status::Ok();
}

// The first value of `values` that the code of `moment` cannot represent, or count.
size_t FirstUnrepresentable(Moment moment, const float* values, size_t count) {
  for (size_t i = 0; i < count; ++i) {
    if (!std::isfinite(values[i]) || (moment == Moment::kExpAvgSq && values[i] < 0.0f)) return i;
  }
  return count;
}

}  // namespace

Status QuantizeMoments(Moment moment, const float* values, size_t count, size_t block_offset,
                       uint8_t* codes, float* scales, const RunOptions& run) {
  ZOE_RETURN_IF_ERROR(
      CheckMomentArguments("int8 quantization", count, block_offset, values, codes, scales));
  const size_t bad = FirstUnrepresentable(moment, values, count);
  if (bad != count) {
    return Status::InvalidArgument("int8 quantization: element " + std::to_string(bad) + " is " +
                                   std::to_string(values[bad]) + "; allowed: finite values" +
                                   (moment == Moment::kExpAvgSq ? ", >= 0 for exp_avg_sq" : ""));
  }
  ZOE_ASSIGN_OR_RETURN(const KernelTable* kernels, ResolveKernels(run));
  const QuantizeBlockFn quantize = kernels->quantize_block[moment == Moment::kExpAvg ? 1 : 0];
  ForEachBlockTile(run, QuantBlockCount(count, block_offset), [&](size_t first, size_t last) {
    for (size_t b = first; b < last; ++b) {
      const QuantBlockRange r = QuantBlockAt(count, block_offset, b);
      quantize(values + r.begin, r.end - r.begin, codes + r.begin, scales + b);
    }
  });
  return Status::Ok();
}

Status DequantizeMoments(Moment moment, const uint8_t* codes, const float* scales, size_t count,
                         size_t block_offset, float* out, const RunOptions& run) {
  ZOE_RETURN_IF_ERROR(
      CheckMomentArguments("int8 dequantization", count, block_offset, codes, scales, out));
  ZOE_ASSIGN_OR_RETURN(const KernelTable* kernels, ResolveKernels(run));
  const DequantizeBlockFn dequantize = kernels->dequantize_block[moment == Moment::kExpAvg ? 1 : 0];
  ForEachBlockTile(run, QuantBlockCount(count, block_offset), [&](size_t first, size_t last) {
    for (size_t b = first; b < last; ++b) {
      const QuantBlockRange r = QuantBlockAt(count, block_offset, b);
      dequantize(codes + r.begin, r.end - r.begin, scales[b], out + r.begin);
    }
  });
  return Status::Ok();
}

}  // namespace zoe::optim
