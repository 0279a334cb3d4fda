// The chunk-level optimizer step: what the offloaded pipeline calls on each chunk of a parameter
// group, and what the in-memory Group (group.h) is built from.
//
// A step over several chunks is two passes, because a step is skipped as a whole:
//   1. ScanGradients on every chunk, CombineScans, then MakeGradScaling (non-finite check,
//      global L2 norm, clip factor, loss-scale unscale);
//   2. UpdateChunk on every chunk with that scaling, unless the step was skipped.
// StepChunk fuses both for a group that is a single chunk.
//
// Kernels run on the calling thread, or split into tiles of RunOptions::tile_elements across an
// Executor (the caller takes tiles too). Results are bit-identical across instruction-set paths
// and thread counts for fp32 and 16-bit types alike (kernel_math.h).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>

#include "core/executor.h"
#include "core/hyper_params.h"
#include "core/result.h"
#include "optim/kernels.h"
#include "optim/types.h"

namespace zoe::optim {

// Hyper-parameters of one call (core/hyper_params.h); schedulers may change them from step to
// step.
using HyperParams = zoe::HyperParams;

// Returns InvalidArgument naming the first bad field and its allowed range.
Status ValidateHyperParams(const HyperParams& hyper);

// Element types of a chunk's buffers; UpdateChunk refuses others with an InvalidArgument naming
// the field, the dtype and the allowed ones (CheckKernelDType).
struct ChunkLayout {
  DType grad = DType::kFloat32;  // one of kAllDTypes
  DType state =
      DType::kFloat32;  // one of kStateDTypes: bf16 halves the state bytes, int8 quantize.h
  // One of kAllDTypes: also write the updated parameter there, in the same pass (fp32 included:
  // the copy is then the master's bits).
  std::optional<DType> param_copy;
};

// Ok when every dtype of `layout` is one the kernels take there.
Status ValidateLayout(const ChunkLayout& layout);

// A chunk's buffers, all `count` elements long, borrowed for the call. Any alignment is accepted.
// exp_avg is unused (may be null) for Adagrad; exp_avg_sq (Adagrad: its sum of squares) for Lion.
struct ChunkBuffers {
  float* master = nullptr;     // fp32 master weights, updated in place
  const void* grad = nullptr;  // layout.grad, read only
  void* exp_avg = nullptr;     // layout.state, updated in place
  void* exp_avg_sq = nullptr;  // layout.state, updated in place
  void* param_copy = nullptr;  // *layout.param_copy, written (required when set)
  size_t count = 0;
  // kInt8 state only. Quantization blocks: element 0 starts one, which ends at the next multiple
  // of kQuantBlock of (element + block_offset); the following ones are kQuantBlock long (the
  // last one shorter). One fp32 scale per block of each moment the kind uses, updated in place.
  size_t block_offset = 0;  // [0, kQuantBlock)
  float* exp_avg_scale = nullptr;
  float* exp_avg_sq_scale = nullptr;
  // Optional, where UpdateHashesReads: null, or one array per state array ([0] master, [1]
  // exp_avg, [2] exp_avg_sq) that receives the XXH3 of each 4096-byte block of that array as
  // read before the update. master, exp_avg and exp_avg_sq point at element read_origin of the
  // arrays hashed, whose blocks are counted from their element 0: filled for every block inside
  // elements [AlignUp(read_origin, u), AlignDown(read_origin + count, u)) of them, with u =
  // ReadHashElements(layout.state) (kernels.h); other entries are left as they were. kInt8
  // state: the moments' codes are hashed, and read_origin % kQuantBlock must equal block_offset.
  uint64_t* read_sums[3] = {};
  size_t read_origin = 0;
};

// The quantization blocks of `count` kInt8 elements starting at `block_offset` (ChunkBuffers).
size_t QuantBlockCount(size_t count, size_t block_offset);
// Elements [begin, end) of block `block` of that layout.
struct QuantBlockRange {
  size_t begin = 0;
  size_t end = 0;
};
QuantBlockRange QuantBlockAt(size_t count, size_t block_offset, size_t block);

// Which code a kInt8 moment uses: signed for exp_avg (and Lion's momentum), unsigned for
// exp_avg_sq (and Adagrad's sum of squares).
enum class Moment { kExpAvg, kExpAvgSq };

// Factor every gradient is multiplied by before use: inv_loss_scale * clip_factor.
struct GradScaling {
  double inv_loss_scale = 1.0;
  double clip_factor = 1.0;
};

// Elements per tile a kernel thread takes. Each tile restarts the hardware prefetchers' streams
// (an AdamW update reads four arrays and writes three), so tiles are long: 256 Ki elements, 1 MiB
// of each fp32 array; updates and scans measured faster than with 32 Ki (docs/benchmarks-optim.md).
inline constexpr size_t kDefaultTileElements = size_t{1} << 18;

// How an update writes its fp32 arrays (zoe::StoreMode, core/vocabulary.h). Streaming
// (non-temporal) stores skip the cache, which saves reading each written line first, and are
// slower for data already in the cache (an offloaded chunk's stripe, just read); kAuto streams only
// a pass that reads more than LastLevelCacheBytes(). Whether streaming beats ordinary stores on
// arrays larger than the cache depends on the machine: on the virtual machines measured here
// ordinary stores were faster (docs/benchmarks-optim.md), so they are the default; `zoe bench
// adam` reports both. Results do not depend on the choice (see UpdateVariant in kernels.h).

// Arithmetic::kFast bound. In fast mode exp_avg and exp_avg_sq are bit-identical to exact mode;
// the denominator is within 2 ulp of exact mode's, so the update term lr * m_hat / denom is
// within 3 ulp of it, and a master weight the update changes by at most a quarter of its
// magnitude (every practical step: lr * |m_hat / denom| is about lr) is within 2 ulp of exact
// mode's. Every instruction-set path gives the same bits in either mode. With int8 moments, fast
// mode also normalizes each block by a multiplication with the reciprocal of its absmax, so a
// code may differ from exact mode's where an element lies within an ulp of a threshold.
inline constexpr int kFastUpdateUlps = 3;
inline constexpr int kFastMasterUlps = 2;

struct RunOptions {
  Executor* executor = nullptr;  // null: run on the calling thread only
  std::optional<Isa> isa;        // unset: DefaultIsa() (cpuid, or ZOE_ISA)
  // > 0. Updates do not depend on it; the gradient scan's sum is defined tile by tile
  // (ScanGradients), so its low bits do.
  size_t tile_elements = kDefaultTileElements;
  // Exact by default: the bits torch.optim computes, which tests, state_dict round trips with
  // torch and users comparing runs rely on. Fast is an option (zoe.arithmetic = "fast").
  Arithmetic arithmetic = Arithmetic::kExact;
  StoreMode stores = StoreMode::kCached;  // zoe.stores
};

// Size of the last-level cache this process's CPUs can use: hwloc's (Topology::
// last_level_cache_bytes), else sysconf's, else 32 MiB where the system does not say.
size_t LastLevelCacheBytes();

// Bytes an update of `count` elements reads: master, gradient and the moments of `kind`.
size_t UpdateBytesRead(Kind kind, const ChunkLayout& layout, size_t count);

// `mode` with kAuto decided for a pass of updates that read `bytes_read` in all: kStreaming when
// they exceed LastLevelCacheBytes() (what the pass writes is evicted before anything reads it
// again), else kCached. kCached and kStreaming are returned as they are.
StoreMode ResolveStores(StoreMode mode, size_t bytes_read);

// Sum of squares of raw (still loss-scaled) gradients; +inf or NaN when any is not finite.
struct GradScan {
  double sum_squares = 0.0;
  bool finite() const { return std::isfinite(sum_squares); }
};

// grad_dtype is one of kAllDTypes (InvalidArgument otherwise).
Result<GradScan> ScanGradients(const void* grad, DType grad_dtype, size_t count,
                               const RunOptions& run = {});
inline GradScan CombineScans(GradScan a, GradScan b) { return {a.sum_squares + b.sum_squares}; }

// The outcome of the scan of a whole step.
struct StepScaling {
  bool skip = false;       // a gradient was inf or NaN: update nothing, report the skip
  double grad_norm = 0.0;  // L2 norm of the unscaled gradients (inf when skipped)
  GradScaling scaling;     // to pass to UpdateChunk
};

// loss_scale > 0 (the factor the loss was multiplied by; 1 for none). max_grad_norm > 0 clips
// like torch.nn.utils.clip_grad_norm_ (clip = max_norm / (norm + 1e-6) when below 1); 0 disables
// clipping. Other values are InvalidArgument.
Result<StepScaling> MakeStepScaling(const GradScan& total, double loss_scale, double max_grad_norm);

// Applies one step (`step` >= 1 counts steps taken, this one included: bias correction uses it)
// to every element of `chunk`. Checks arguments; does not check gradients for inf/NaN (the scan
// does).
Status UpdateChunk(const HyperParams& hyper, int64_t step, const ChunkLayout& layout,
                   const ChunkBuffers& chunk, const GradScaling& scaling,
                   const RunOptions& run = {});

// Whether UpdateChunk fills ChunkBuffers::read_sums for `kind` with `state` on run's path (the
// AVX-512 Adam and AdamW kernels with fp32, bf16 or int8 state); an unresolvable path is false.
bool UpdateHashesReads(Kind kind, DType state, const RunOptions& run);

// The argument checks of UpdateChunk (hyper-parameters, step, layout, buffers, scale), for other
// launchers of the same update (optim/cuda/adamw.h).
Status ValidateUpdate(const HyperParams& hyper, int64_t step, const ChunkLayout& layout,
                      const ChunkBuffers& chunk, const GradScaling& scaling);

// The fp32 constants of one step, computed in double and rounded once (kernels.h).
UpdateConstants MakeUpdateConstants(const HyperParams& hyper, int64_t step,
                                    const GradScaling& scaling);
CopySlot CopySlotOf(const std::optional<DType>& copy);
// The kernel variant UpdateChunk runs: run.arithmetic, and streaming stores per run.stores where
// the fp32 arrays written are congruent to master modulo 64 bytes. kInt8 state gets run.arithmetic
// and always ordinary stores, the only stores its block kernels have.
UpdateVariant ChooseUpdateVariant(Kind kind, const ChunkLayout& layout, const ChunkBuffers& chunk,
                                  const RunOptions& run);

// Scan + update of a single-chunk group. When a gradient is not finite nothing is written and
// the outcome says skip; the caller then does not advance its step counter.
Result<StepScaling> StepChunk(const HyperParams& hyper, int64_t step, const ChunkLayout& layout,
                              const ChunkBuffers& chunk, double loss_scale, double max_grad_norm,
                              const RunOptions& run = {});

// Casts fp32 `src` to `dst_dtype` (bf16/fp16) with the kernels' rounding, tile-parallel: the
// separate cast pass that a fused param_copy avoids, and a helper for the device copy. Another
// dtype (fp32 included) is an InvalidArgument, as for CastToF32's `src_dtype`.
Status CastFromF32(const float* src, DType dst_dtype, void* dst, size_t count,
                   const RunOptions& run = {});
// Widens bf16/fp16 `src` to fp32 exactly.
Status CastToF32(const void* src, DType src_dtype, float* dst, size_t count,
                 const RunOptions& run = {});

// Quantizes fp32 `values` into kInt8 `codes` and `scales` (QuantBlockCount of them) laid out as
// ChunkBuffers describes; DequantizeMoments is the inverse within e * absmax per element for
// exp_avg and (2e + e^2) * absmax for exp_avg_sq (stored as its square root), e being
// MaxQuantError of the moment's code and absmax the largest magnitude of the element's block.
// exp_avg_sq values must not be negative (InvalidArgument otherwise); neither may hold inf or NaN.
Status QuantizeMoments(Moment moment, const float* values, size_t count, size_t block_offset,
                       uint8_t* codes, float* scales, const RunOptions& run = {});
Status DequantizeMoments(Moment moment, const uint8_t* codes, const float* scales, size_t count,
                         size_t block_offset, float* out, const RunOptions& run = {});

}  // namespace zoe::optim
