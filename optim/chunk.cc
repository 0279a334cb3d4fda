#include "optim/chunk.h"

#include <unistd.h>

#include <cmath>
#include <string>
#include <vector>

#include "optim/dispatch.h"
#include "optim/kernels.h"

namespace zoe::optim {
namespace {

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

Status CheckLayout(const ChunkLayout& layout) {
  if (layout.state != DType::kF32 && layout.state != DType::kBF16) {
    return Status::InvalidArgument("optimizer state dtype " + std::string(DTypeName(layout.state)) +
                                   " is not supported; allowed: fp32, bf16");
  }
  return Status::Ok();
}

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
  return Status::Ok();
}

}  // namespace

CopySlot CopySlotOf(const std::optional<DType>& copy) {
  if (!copy.has_value()) return CopySlot::kNone;
  switch (*copy) {
    case DType::kF32:
      return CopySlot::kF32;
    case DType::kBF16:
      return CopySlot::kBF16;
    case DType::kF16:
      return CopySlot::kF16;
  }
  return CopySlot::kNone;
}

size_t LastLevelCacheBytes() {
  static const size_t bytes = [] {
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
  if (layout.state == DType::kF32) {
    if (UsesExpAvg(kind) && residue(chunk.exp_avg) != master) return false;
    if (UsesExpAvgSq(kind) && residue(chunk.exp_avg_sq) != master) return false;
  }
  return layout.param_copy != DType::kF32 || residue(chunk.param_copy) == master;
}

// Bytes one update of the chunk reads: master, gradient and the moments.
size_t BytesRead(Kind kind, const ChunkLayout& layout, size_t count) {
  const size_t per_element =
      4 + SizeOf(layout.grad) + SizeOf(layout.state) * static_cast<size_t>(StateTensors(kind));
  return per_element * count;
}

UpdateVariant ChooseVariant(const HyperParams& hyper, const ChunkLayout& layout,
                            const ChunkBuffers& chunk, const RunOptions& run) {
  UpdateVariant variant;
  variant.fast = run.arithmetic == Arithmetic::kFast;
  const bool wanted = run.stores == StoreMode::kStreaming ||
                      (run.stores == StoreMode::kAuto &&
                       BytesRead(hyper.kind, layout, chunk.count) > LastLevelCacheBytes());
  variant.streaming = wanted && WritesCongruent(hyper.kind, layout, chunk);
  return variant;
}

}  // namespace

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
  ZOE_ASSIGN_OR_RETURN(const KernelTable* kernels, ResolveKernels(run));
  const SumSquaresFn sum_squares = kernels->sum_squares[static_cast<int>(grad_dtype)];
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
  ZOE_RETURN_IF_ERROR(CheckLayout(layout));
  return CheckBuffers(hyper.kind, layout, chunk);
}

Status UpdateChunk(const HyperParams& hyper, int64_t step, const ChunkLayout& layout,
                   const ChunkBuffers& chunk, const GradScaling& scaling, const RunOptions& run) {
  ZOE_RETURN_IF_ERROR(ValidateUpdate(hyper, step, layout, chunk, scaling));
  ZOE_ASSIGN_OR_RETURN(const KernelTable* kernels, ResolveKernels(run));
  const UpdateFn update = kernels->update[KernelTable::UpdateIndex(
      hyper.kind, layout.grad, layout.state, CopySlotOf(layout.param_copy),
      ChooseVariant(hyper, layout, chunk, run))];
  const UpdateConstants constants = MakeUpdateConstants(hyper, step, scaling);
  const UpdatePointers pointers{chunk.master, chunk.grad, chunk.exp_avg, chunk.exp_avg_sq,
                                chunk.param_copy};
  ForEachTile(run, chunk.count,
              [&](size_t begin, size_t end) { update(constants, pointers, begin, end); });
  return Status::Ok();
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

Status CastFromF32(const float* src, DType dst_dtype, void* dst, size_t count,
                   const RunOptions& run) {
  if (dst_dtype == DType::kF32) {
    return Status::InvalidArgument("cast from fp32 to fp32; allowed targets: bf16, fp16");
  }
  if (count > 0 && (src == nullptr || dst == nullptr)) {
    return Status::InvalidArgument("cast of " + std::to_string(count) +
                                   " elements got a null buffer");
  }
  ZOE_ASSIGN_OR_RETURN(const KernelTable* kernels, ResolveKernels(run));
  const ConvertFn convert = kernels->from_f32[static_cast<int>(dst_dtype)];
  ForEachTile(run, count, [&](size_t begin, size_t end) { convert(src, dst, begin, end); });
  return Status::Ok();
}

Status CastToF32(const void* src, DType src_dtype, float* dst, size_t count,
                 const RunOptions& run) {
  if (src_dtype == DType::kF32) {
    return Status::InvalidArgument("cast from fp32 to fp32; allowed sources: bf16, fp16");
  }
  if (count > 0 && (src == nullptr || dst == nullptr)) {
    return Status::InvalidArgument("cast of " + std::to_string(count) +
                                   " elements got a null buffer");
  }
  ZOE_ASSIGN_OR_RETURN(const KernelTable* kernels, ResolveKernels(run));
  const ConvertFn convert = kernels->to_f32[static_cast<int>(src_dtype)];
  ForEachTile(run, count, [&](size_t begin, size_t end) { convert(src, dst, begin, end); });
  return Status::Ok();
}

}  // namespace zoe::optim
