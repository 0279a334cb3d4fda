// The kernel table: one set of function pointers per instruction-set path, filled by the
// translation units kernels_<isa>.cc (each compiled with its own -m flags) and chosen at run time
// by dispatch.h. Internal to optim/: callers use chunk.h.
#pragma once

#include <cstddef>
#include <cstdint>

#include "optim/types.h"

namespace zoe::optim {

// Per-call constants of an update, derived once from the hyper-parameters and step number in
// double precision and rounded to fp32 (the same roundings torch applies to Python scalars).
struct UpdateConstants {
  float grad_scale = 1.0f;    // inv_loss_scale * clip_factor, applied to every gradient
  float decay = 1.0f;         // 1 - lr * weight_decay (AdamW, Lion)
  float weight_decay = 0.0f;  // L2 coefficient (Adam, Adagrad)
  float beta1 = 0.0f;
  float one_minus_beta1 = 1.0f;
  float beta2 = 0.0f;
  float one_minus_beta2 = 1.0f;
  float neg_step_size =
      0.0f;  // -lr / (1 - beta1^t) (Adam, AdamW); -lr / (1 + (t-1) lr_decay) (Adagrad); -lr (Lion)
  float bias_correction2_sqrt = 1.0f;      // sqrt(1 - beta2^t) (Adam, AdamW)
  float inv_bias_correction2_sqrt = 1.0f;  // 1 / sqrt(1 - beta2^t), rounded once (fast arithmetic)
  float eps = 0.0f;
};

// Base pointers of one chunk; a kernel touches elements [begin, end) of each. Unused slots
// (exp_avg for Adagrad, exp_avg_sq for Lion, param_copy when no copy is asked) may be null.
struct UpdatePointers {
  float* master = nullptr;
  const void* grad = nullptr;
  void* exp_avg = nullptr;
  void* exp_avg_sq = nullptr;
  void* param_copy = nullptr;
  // kInt8 state only: one fp32 scale (absmax) per quantization block, indexed by block. Element
  // i lies in block (i + block_offset) / kQuantBlock (quantize.h): block 0 may be short.
  float* exp_avg_scale = nullptr;
  float* exp_avg_sq_scale = nullptr;
  size_t block_offset = 0;  // [0, kQuantBlock)
  // Optional, for kernels that hash what they read (KernelTable::HashesReads): null, or one
  // array per state array -- [0] master, [1] exp_avg, [2] exp_avg_sq -- that receives the XXH3
  // (io::Xxh3) of each kReadHashBlock-byte block of that array as the kernel read it, before
  // updating it. Element i of the call is element i + read_origin of the hashed arrays: its byte
  // (i + read_origin) * size lies in block (i + read_origin) * size / kReadHashBlock, the index
  // in read_sums. Filled for every block inside elements [AlignUp(begin + o, u) - o,
  // AlignDown(end + o, u) - o) with o = read_origin and u = ReadHashElements(state); other
  // entries are left as they were. All three are given or none. read_origin lets a caller
  // update a piece that starts inside a block with pointers to the piece's first element. With
  // kInt8 state, the moments' arrays are their codes, and read_origin must be congruent to
  // block_offset modulo kQuantBlock (every unit boundary is then a quantization block boundary).
  uint64_t* read_sums[3] = {};
  size_t read_origin = 0;
};

// The block the kernels hash reads in: the state regions' alignment and checksum block.
inline constexpr size_t kReadHashBlock = 4096;
// Elements of one unit of hashed reads: a whole number of blocks of every array hashed (one
// block of each moment, as many of fp32 master as the moment is narrower).
constexpr size_t ReadHashElements(DType state) { return kReadHashBlock / DTypeSize(state); }

// The kinds and states whose kernels hash their reads on a path that can (KernelTable::
// hashes_reads): Adam and AdamW, with fp32, bf16 or int8 state.
constexpr bool HashesReadsOf(Kind kind, DType state) {
  return (kind == Kind::kAdamW || kind == Kind::kAdam) &&
         (state == DType::kFloat32 || state == DType::kBFloat16 || state == DType::kInt8);
}

// Elements [first, last) of a call's [begin, end) that make whole units of `unit` elements,
// counted in the hashed arrays (element i of the call is element i + origin there): the range
// the kernels hash reads in. Empty (first == last) when no whole unit lies inside.
struct WholeUnits {
  size_t first = 0;
  size_t last = 0;
};
constexpr WholeUnits WholeUnitsOf(size_t begin, size_t end, size_t origin, size_t unit) {
  const size_t unit_begin = (begin + origin + unit - 1) / unit * unit;  // >= origin
  const size_t unit_end = (end + origin) / unit * unit;
  if (unit_begin >= unit_end) return {begin, begin};
  return {unit_begin - origin, unit_end - origin};
}

using UpdateFn = void (*)(const UpdateConstants&, const UpdatePointers&, size_t begin, size_t end);
// kInt8 state: updates the whole quantization blocks in [begin, end) (UpdatePointers::
// block_offset places them; begin and end lie on block boundaries or at the array's ends): each
// block's moments are dequantized, updated, and requantized with the block's new absmax. The
// fast entries use Adam's fast arithmetic and normalize by a multiplication with the absmax's
// reciprocal (rounded once) instead of a division. Hashes reads like UpdateFn where HashesReads;
// with read_sums given, read_origin % kQuantBlock must equal block_offset (UpdateChunk checks
// it; the kernel assumes it).
using BlockUpdateFn = UpdateFn;
// One block of at most kQuantBlock elements to and from kInt8 (the unsigned or signed code).
using QuantizeBlockFn = void (*)(const float* values, size_t count, uint8_t* codes, float* scale);
using DequantizeBlockFn = void (*)(const uint8_t* codes, size_t count, float scale, float* out);
// Sum of squares of grad[begin, end) in double, accumulated in a fixed order (eight lanes, element
// i into lane (i - begin) % 8, lanes added pairwise) so every path returns the same bits. It is
// +inf or NaN exactly when some element is not finite.
using SumSquaresFn = double (*)(const void* grad, size_t begin, size_t end);
// Converts src[begin, end) into dst[begin, end).
using ConvertFn = void (*)(const void* src, void* dst, size_t begin, size_t end);
// The roofline probe: a += b, c += b, d += b over [begin, end) (4 fp32 reads, 3 fp32 writes per
// element: AdamW's access pattern). The streaming form writes with non-temporal stores where a,
// c and d share an alignment modulo 64 bytes, prefetches ahead, and ends with a store fence.
using StreamFn = void (*)(float* a, const float* b, float* c, float* d, size_t begin, size_t end);

// Index of a parameter-copy type in the table: none, bf16, fp16, fp32.
enum class CopySlot { kNone = 0, kBF16 = 1, kF16 = 2, kF32 = 3 };

// How an update kernel writes and computes, beside the element types:
//  - fast: Adam/AdamW multiply sqrt(v) by inv_bias_correction2_sqrt instead of dividing by
//    bias_correction2_sqrt (Arithmetic::kFast, see chunk.h for the bound); other kinds ignore it.
//  - streaming: fp32 arrays written (master, fp32 moments, an fp32 copy) that share master's
//    alignment modulo 64 bytes are written with non-temporal stores, which skip the cache: for
//    arrays larger than the last-level cache. The kernel ends with a store fence.
struct UpdateVariant {
  bool fast = false;
  bool streaming = false;
};

// The tables below are laid out by KernelSlot: grad dtypes take slots 0..2 and the fp32/bf16
// states slots 0..1 of the update table.
static_assert(KernelSlot(DType::kFloat32) == 0 && KernelSlot(DType::kBFloat16) == 1 &&
                  KernelSlot(DType::kFloat16) == 2 && KernelSlot(DType::kInt8) == 3,
              "the kernel tables' layout");

struct KernelTable {
  // kind x grad dtype x state dtype x copy x fast x streaming
  static constexpr size_t kUpdates = 4 * 3 * 2 * 4 * 2 * 2;
  // kind x grad dtype x copy x fast (kInt8 state: ordinary stores only)
  static constexpr size_t kBlockUpdates = 4 * 3 * 4 * 2;

  Isa isa = Isa::kScalar;
  UpdateFn update[kUpdates] = {};
  BlockUpdateFn block_update[kBlockUpdates] = {};
  SumSquaresFn sum_squares[3] = {};  // by KernelSlot of the grad dtype
  ConvertFn from_f32[3] = {};        // fp32 -> dtype, by KernelSlot (fp32's unused)
  ConvertFn to_f32[3] = {};          // dtype -> fp32, by KernelSlot (fp32's unused)
  StreamFn stream = nullptr;
  StreamFn stream_nt = nullptr;                // the streaming form of `stream`
  QuantizeBlockFn quantize_block[2] = {};      // [0] unsigned code, [1] signed code
  DequantizeBlockFn dequantize_block[2] = {};  // same
  bool hashes_reads = false;                   // see HashesReads

  // Whether this table's update kernels for `kind` with `state` fill UpdatePointers::read_sums
  // (the AVX-512 paths: hashes_reads, and HashesReadsOf); others ignore it.
  bool HashesReads(Kind kind, DType state) const {
    return hashes_reads && HashesReadsOf(kind, state);
  }

  // grad is one of kAllDTypes, state kFloat32 or kBFloat16 (slots 0 and 1); both enter by
  // KernelSlot.
  static constexpr size_t UpdateIndex(Kind kind, DType grad, DType state, CopySlot copy,
                                      UpdateVariant variant = {}) {
    const size_t element_types = (static_cast<size_t>(kind) * 3 + Slot(grad)) * 2 + Slot(state);
    return ((element_types * 4 + static_cast<size_t>(copy)) * 2 + variant.fast) * 2 +
           variant.streaming;
  }
  static constexpr size_t BlockUpdateIndex(Kind kind, DType grad, CopySlot copy, bool fast) {
    return ((static_cast<size_t>(kind) * 3 + Slot(grad)) * 4 + static_cast<size_t>(copy)) * 2 +
           fast;
  }
  // KernelSlot as an index; callers have checked the dtype (CheckKernelDType).
  static constexpr size_t Slot(DType type) { return static_cast<size_t>(KernelSlot(type)); }
};

// The tables. Only call one whose instruction set the running CPU has (dispatch.h checks).
const KernelTable& ScalarKernelTable();
const KernelTable& Avx2KernelTable();
const KernelTable& Avx512KernelTable();
const KernelTable& Avx512Bf16KernelTable();

}  // namespace zoe::optim
