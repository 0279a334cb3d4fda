// The optimizer arithmetic, written once over a vector policy V and instantiated by every
// kernels_<isa>.cc with its own V (ScalarOps below, Avx2Ops, Avx512Ops).
//
// Why every path gives the same fp32 bits: each element goes through the same sequence of IEEE
// single-precision operations (add, sub, mul, div, sqrt: all correctly rounded, in scalar and
// SIMD form alike), no fused multiply-add is used anywhere, and every kernel translation unit is
// compiled with -ffp-contract=off so the compiler cannot fuse a multiply and an add behind our
// back. Conversions to 16-bit formats are defined bit for bit in convert.h. Tails shorter than a
// vector go through ScalarOps, which by the same argument gives the same bits. The order of
// operations follows torch.optim's single-tensor implementations (see each rule below).
//
// Fast arithmetic (UpdateVariant::fast) replaces Adam's division by sqrt(1 - beta2^t) with a
// multiplication by its reciprocal: still a fixed sequence of correctly rounded operations, so
// the paths stay bit-identical to each other in that mode too, and within the bound chunk.h states
// of the exact mode.
//
// Streaming (UpdateVariant::streaming) changes only how fp32 arrays are written: non-temporal
// stores on full, aligned vectors, which leave the bits as they are.
//
// Internal linkage throughout: see convert.h.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <type_traits>
#include <utility>

#include "optim/convert.h"
#include "optim/kernels.h"
#include "optim/quantize.h"

namespace zoe::optim {
namespace {  // NOLINT: internal linkage on purpose

// The width-1 policy: plain floats. Also the tail of every SIMD path.
struct ScalarOps {
  using F = float;
  static constexpr size_t kWidth = 1;
  static F Set(float x) { return x; }
  static F LoadF32(const float* p) { return *p; }
  static F LoadBf16(const uint16_t* p) { return Bf16ToFloat(*p); }
  static F LoadF16(const uint16_t* p) { return F16ToFloat(*p); }
  static void StoreF32(float* p, F x) { *p = x; }
  static void StreamF32(float* p, F x) { *p = x; }  // no scalar non-temporal store is worth it
  static void StoreBf16(uint16_t* p, F x) { *p = FloatToBf16(x); }
  static void StoreF16(uint16_t* p, F x) { *p = FloatToF16(x); }
  static F Add(F a, F b) { return a + b; }
  static F Sub(F a, F b) { return a - b; }
  static F Mul(F a, F b) { return a * b; }
  static F Div(F a, F b) { return a / b; }
  // The builtin, not std::sqrt: an unoptimised build would emit std::sqrt as a weak symbol
  // shared with baseline translation units (see convert.h).
  static F Sqrt(F a) { return __builtin_sqrtf(a); }
  // -1, 0 or +1 (0 for zero and NaN).
  static F Sign(F a) { return static_cast<float>(a > 0.0f) - static_cast<float>(a < 0.0f); }
  static F Abs(F a) { return __builtin_fabsf(a); }
  static F Max(F a, F b) { return a > b ? a : b; }
  static float ReduceMax(F a) { return a; }
  // values[*codes]: the dequantized code, before its block's scale.
  static F Dequantize(const uint8_t* codes, const float* values) { return values[*codes]; }
  // The byte of normalized (in [-1, 1]; [0, 1] for the unsigned code) by the bucket lookup.
  template <bool kSigned>
  static void StoreQuantized(uint8_t* codes, F normalized, const QuantCode& code) {
    *codes =
        kSigned ? QuantizeSignedByte(code, normalized) : QuantizeUnsignedByte(code, normalized);
  }
};

template <class V, DType D>
typename V::F Load(const void* base, size_t i) {
  if constexpr (D == DType::kFloat32) {
    return V::LoadF32(static_cast<const float*>(base) + i);
  } else if constexpr (D == DType::kBFloat16) {
    return V::LoadBf16(static_cast<const uint16_t*>(base) + i);
  } else {
    return V::LoadF16(static_cast<const uint16_t*>(base) + i);
  }
}

// A streaming fp32 store needs a full vector at an address aligned to its width; the update loop
// guarantees that for every fp32 array it writes when it streams (see Update).
template <class V, DType D, bool kStreaming = false>
void Store(void* base, size_t i, typename V::F x) {
  if constexpr (D == DType::kFloat32 && kStreaming) {
    V::StreamF32(static_cast<float*>(base) + i, x);
  } else if constexpr (D == DType::kFloat32) {
    V::StoreF32(static_cast<float*>(base) + i, x);
  } else if constexpr (D == DType::kBFloat16) {
    V::StoreBf16(static_cast<uint16_t*>(base) + i, x);
  } else {
    V::StoreF16(static_cast<uint16_t*>(base) + i, x);
  }
}

template <class V, CopySlot C, bool kStreaming>
void StoreCopy(void* base, size_t i, typename V::F x) {
  if constexpr (C == CopySlot::kBF16) {
    Store<V, DType::kBFloat16>(base, i, x);
  } else if constexpr (C == CopySlot::kF16) {
    Store<V, DType::kFloat16>(base, i, x);
  } else if constexpr (C == CopySlot::kF32) {
    Store<V, DType::kFloat32, kStreaming>(base, i, x);
  }
}

// The kInt8 block being updated. The update leaves its new moments in two fp32 buffers (element
// i at [i - begin]) until the block is requantized. kDequantized: the block's moments were
// dequantized into those buffers before the update (paths that dequantize 64 codes at once);
// otherwise each load dequantizes its vector with the block's old scale (paths that gather: a
// gather beside the update's arithmetic overlaps with it, in a loop of its own it does not).
template <bool kPrefilled>
struct BlockPointers : UpdatePointers {
  static constexpr bool kDequantized = kPrefilled;
  float exp_avg_scale_old = 0.0f;
  float exp_avg_sq_scale_old = 0.0f;
  float* exp_avg_block = nullptr;
  float* exp_avg_sq_block = nullptr;
  size_t begin = 0;
};

// Moment loads and stores: in place for fp32/bf16 state; for kInt8, from the block's codes or
// its fp32 buffers (BlockPointers) and to the buffers. kSq picks exp_avg_sq, else exp_avg. int8
// exp_avg_sq holds the square root of the moment (quantize.h): stored through a square root,
// loaded through a square (both correctly rounded, so every path agrees).
template <class V, DType S, bool kSq, class P>
typename V::F LoadMoment(const P& p, size_t i) {
  if constexpr (S == DType::kInt8) {
    if constexpr (P::kDequantized) {
      return V::LoadF32((kSq ? p.exp_avg_sq_block : p.exp_avg_block) + (i - p.begin));
    } else {
      const QuantCode& code = kSq ? kUnsignedCode : kSignedCode;
      const auto* codes = static_cast<const uint8_t*>(kSq ? p.exp_avg_sq : p.exp_avg);
      const typename V::F x = V::Mul(V::Dequantize(codes + i, code.value.data()),
                                     V::Set(kSq ? p.exp_avg_sq_scale_old : p.exp_avg_scale_old));
      if constexpr (kSq) {
        return V::Mul(x, x);  // the square root is what is stored
      } else {
        return x;
      }
    }
  } else {
    return Load<V, S>(kSq ? p.exp_avg_sq : p.exp_avg, i);
  }
}

// kInt8 moments go to the block's buffer on the stack (requantized there, never streamed).
template <class V, DType S, bool kSq, bool kStreaming, class P>
void StoreMoment(const P& p, size_t i, typename V::F x) {
  if constexpr (S == DType::kInt8) {
    static_assert(!kStreaming, "int8 blocks are updated with ordinary stores");
    if constexpr (kSq) {
      V::StoreF32(p.exp_avg_sq_block + (i - p.begin), V::Sqrt(x));
    } else {
      V::StoreF32(p.exp_avg_block + (i - p.begin), x);
    }
  } else {
    Store<V, S, kStreaming>(kSq ? p.exp_avg_sq : p.exp_avg, i, x);
  }
}

// Adam / AdamW on V::kWidth elements at i. torch 1.13 _single_tensor_adam(w):
//   AdamW: p *= 1 - lr*wd          Adam: g += wd*p
//   m = m*b1 + (1-b1)*g;  v = v*b2 + ((1-b2)*g)*g
//   denom = sqrt(v) / sqrt(1-b2^t) + eps;  p += (-lr/(1-b1^t) * m) / denom
// Fast arithmetic: denom = sqrt(v) * (1 / sqrt(1-b2^t)) + eps, the reciprocal rounded once.
template <class V, bool kDecoupled, DType G, DType S, CopySlot C, UpdateVariant kVariant, class P>
void AdamStep(const UpdateConstants& k, const P& p, size_t i) {
  using F = typename V::F;
  F g = V::Mul(Load<V, G>(p.grad, i), V::Set(k.grad_scale));
  F w = V::LoadF32(p.master + i);
  if constexpr (kDecoupled) {
    w = V::Mul(w, V::Set(k.decay));
  } else {
    g = V::Add(g, V::Mul(w, V::Set(k.weight_decay)));
  }
  F m = LoadMoment<V, S, false>(p, i);
  F v = LoadMoment<V, S, true>(p, i);
  m = V::Add(V::Mul(m, V::Set(k.beta1)), V::Mul(g, V::Set(k.one_minus_beta1)));
  v = V::Add(V::Mul(v, V::Set(k.beta2)), V::Mul(V::Mul(V::Set(k.one_minus_beta2), g), g));
  F corrected;
  if constexpr (kVariant.fast) {
    corrected = V::Mul(V::Sqrt(v), V::Set(k.inv_bias_correction2_sqrt));
  } else {
    corrected = V::Div(V::Sqrt(v), V::Set(k.bias_correction2_sqrt));
  }
  const F denom = V::Add(corrected, V::Set(k.eps));
  w = V::Add(w, V::Div(V::Mul(V::Set(k.neg_step_size), m), denom));
  constexpr bool kStreaming = kVariant.streaming;
  Store<V, DType::kFloat32, kStreaming>(p.master, i, w);
  StoreMoment<V, S, false, kStreaming>(p, i, m);
  StoreMoment<V, S, true, kStreaming>(p, i, v);
  StoreCopy<V, C, kStreaming>(p.param_copy, i, w);
}

// Adagrad, torch 1.13 _single_tensor_adagrad with lr_decay folded into neg_step_size:
//   g += wd*p;  s += g*g;  p += (-clr * g) / (sqrt(s) + eps)
template <class V, DType G, DType S, CopySlot C, bool kStreaming, class P>
void AdagradStep(const UpdateConstants& k, const P& p, size_t i) {
  using F = typename V::F;
  F g = V::Mul(Load<V, G>(p.grad, i), V::Set(k.grad_scale));
  F w = V::LoadF32(p.master + i);
  g = V::Add(g, V::Mul(w, V::Set(k.weight_decay)));
  F s = LoadMoment<V, S, true>(p, i);
  s = V::Add(s, V::Mul(g, g));
  const F denom = V::Add(V::Sqrt(s), V::Set(k.eps));
  w = V::Add(w, V::Div(V::Mul(V::Set(k.neg_step_size), g), denom));
  Store<V, DType::kFloat32, kStreaming>(p.master, i, w);
  StoreMoment<V, S, true, kStreaming>(p, i, s);
  StoreCopy<V, C, kStreaming>(p.param_copy, i, w);
}

// Lion (Chen et al. 2023, Algorithm 2 with decoupled decay):
//   p *= 1 - lr*wd;  c = m*b1 + (1-b1)*g;  p += -lr * sign(c);  m = m*b2 + (1-b2)*g
template <class V, DType G, DType S, CopySlot C, bool kStreaming, class P>
void LionStep(const UpdateConstants& k, const P& p, size_t i) {
  using F = typename V::F;
  const F g = V::Mul(Load<V, G>(p.grad, i), V::Set(k.grad_scale));
  F w = V::Mul(V::LoadF32(p.master + i), V::Set(k.decay));
  F m = LoadMoment<V, S, false>(p, i);
  const F c = V::Add(V::Mul(m, V::Set(k.beta1)), V::Mul(g, V::Set(k.one_minus_beta1)));
  w = V::Add(w, V::Mul(V::Set(k.neg_step_size), V::Sign(c)));
  m = V::Add(V::Mul(m, V::Set(k.beta2)), V::Mul(g, V::Set(k.one_minus_beta2)));
  Store<V, DType::kFloat32, kStreaming>(p.master, i, w);
  StoreMoment<V, S, false, kStreaming>(p, i, m);
  StoreCopy<V, C, kStreaming>(p.param_copy, i, w);
}

template <class V, Kind K, DType G, DType S, CopySlot C, UpdateVariant kVariant, class P>
void StepAt(const UpdateConstants& k, const P& p, size_t i) {
  if constexpr (K == Kind::kAdamW || K == Kind::kAdam) {
    AdamStep<V, K == Kind::kAdamW, G, S, C, kVariant>(k, p, i);
  } else if constexpr (K == Kind::kAdagrad) {
    AdagradStep<V, G, S, C, kVariant.streaming>(k, p, i);
  } else {
    LionStep<V, G, S, C, kVariant.streaming>(k, p, i);
  }
}

// Bytes ahead of the current element that the streaming loops prefetch each array they read:
// enough to cover memory latency at one vector per few nanoseconds, and far less than L1.
inline constexpr size_t kPrefetchBytes = 1024;

template <class T>
void PrefetchAhead(const T* base, size_t i) {
  __builtin_prefetch(reinterpret_cast<const char*>(base + i) + kPrefetchBytes, 0, 0);
}

// The arrays a step at element i reads, prefetched kPrefetchBytes ahead.
template <Kind K, DType G, DType S>
void PrefetchStep(const UpdatePointers& p, size_t i) {
  PrefetchAhead(p.master, i);
  PrefetchAhead(static_cast<const std::byte*>(p.grad), i * DTypeSize(G));
  if constexpr (UsesExpAvg(K))
    PrefetchAhead(static_cast<const std::byte*>(p.exp_avg), i * DTypeSize(S));
  if constexpr (UsesExpAvgSq(K)) {
    PrefetchAhead(static_cast<const std::byte*>(p.exp_avg_sq), i * DTypeSize(S));
  }
}

// Full vectors first, then the tail element by element through ScalarOps. Streaming first steps
// element by element up to the first element whose master address is aligned to a vector (the
// caller makes every fp32 array written congruent to master modulo 64 bytes, so they are all
// aligned there), prefetches the arrays it reads, and fences its non-temporal stores at the end
// so they are ordered before whatever the caller does next (another thread may read them).
// P is UpdatePointers, or BlockPointers for one kInt8 block (UpdateBlock: exact, never streaming).
template <class V, Kind K, DType G, DType S, CopySlot C, UpdateVariant kVariant,
          class P = UpdatePointers>
void UpdateRange(const UpdateConstants& k, const P& p, size_t begin, size_t end) {
  static_assert(S != DType::kInt8 || !kVariant.streaming, "int8 blocks have ordinary stores only");
  constexpr UpdateVariant kTail{kVariant.fast, false};
  size_t i = begin;
  if constexpr (kVariant.streaming) {
    constexpr size_t kVectorBytes = V::kWidth * sizeof(float);
    for (; i < end && reinterpret_cast<uintptr_t>(p.master + i) % kVectorBytes != 0; ++i) {
      StepAt<ScalarOps, K, G, S, C, kTail>(k, p, i);
    }
    for (; i + V::kWidth <= end; i += V::kWidth) {
      PrefetchStep<K, G, S>(p, i);
      StepAt<V, K, G, S, C, kVariant>(k, p, i);
    }
  } else {
    for (; i + V::kWidth <= end; i += V::kWidth) StepAt<V, K, G, S, C, kVariant>(k, p, i);
  }
  for (; i < end; ++i) StepAt<ScalarOps, K, G, S, C, kTail>(k, p, i);
  if constexpr (kVariant.streaming) _mm_sfence();
}

// A vector policy that can hash what it loads (Avx512Ops).
template <class V>
concept ReadHashingOps = requires {
  typename V::ReadHasher;
};

// Whether V hashes what Update (UpdateBlocks for kInt8) reads for kind K with state S
// (KernelTable::HashesReads).
template <class V, Kind K, DType S>
constexpr bool kHashesReads = ReadHashingOps<V>&& HashesReadsOf(K, S);

// Feeds the stripe at `address` (byte `offset` of its array) to `hasher`; when it completes a
// block, stores the block's hash at sums[block].
template <class V, class H>
void HashStripe(H& hasher, const void* address, size_t offset, uint64_t* sums) {
  if (hasher.Consume(V::LoadStripe(address))) sums[offset / kReadHashBlock] = hasher.Finish();
}

// The update of [begin, end), whole units of ReadHashElements(S) from a unit boundary (counted
// in the hashed arrays: element index plus p.read_origin), hashing master, exp_avg and exp_avg_sq
// as each vector step reads them: one fp32 vector is one 64-byte stripe of master (and of fp32
// moments); a bf16 moment stripe covers two vectors and is hashed at the first of them, before
// either is overwritten. The step loads the same bytes again from L1. Streams only where master is
// aligned to a vector (then every vector step is).
template <class V, Kind K, DType G, DType S, CopySlot C, UpdateVariant kVariant>
void UpdateHashingUnits(const UpdateConstants& k, const UpdatePointers& p, size_t begin,
                        size_t end) {
  static_assert(S != DType::kInt8, "int8 blocks hash their reads in UpdateBlocks");
  typename V::ReadHasher master, exp_avg, exp_avg_sq;
  constexpr size_t kMomentBytes = DTypeSize(S);
  constexpr size_t kVectorsPerMomentStripe = S == DType::kBFloat16 ? 2 : 1;
  for (size_t i = begin, vector = 0; i < end; i += V::kWidth, ++vector) {
    if constexpr (kVariant.streaming) PrefetchStep<K, G, S>(p, i);
    const size_t element = i + p.read_origin;  // in the hashed arrays
    HashStripe<V>(master, p.master + i, element * sizeof(float), p.read_sums[0]);
    if (vector % kVectorsPerMomentStripe == 0) {
      const size_t offset = i * kMomentBytes;
      HashStripe<V>(exp_avg, static_cast<const std::byte*>(p.exp_avg) + offset,
                    element * kMomentBytes, p.read_sums[1]);
      HashStripe<V>(exp_avg_sq, static_cast<const std::byte*>(p.exp_avg_sq) + offset,
                    element * kMomentBytes, p.read_sums[2]);
    }
    StepAt<V, K, G, S, C, kVariant>(k, p, i);
  }
  if constexpr (kVariant.streaming) _mm_sfence();
}

// UpdateFn. Where the path hashes reads and read_sums is given: the units of whole blocks inside
// [begin, end) through UpdateHashingUnits, the elements before and after them as usual (the
// same bits either way: only the loads differ).
template <class V, Kind K, DType G, DType S, CopySlot C, UpdateVariant kVariant,
          class P = UpdatePointers>
void Update(const UpdateConstants& k, const P& p, size_t begin, size_t end) {
  if constexpr (kHashesReads<V, K, S> && std::is_same_v<P, UpdatePointers>) {
    if (p.read_sums[0] != nullptr) {
      const auto [first, last] = WholeUnitsOf(begin, end, p.read_origin, ReadHashElements(S));
      if (first < last) {
        UpdateRange<V, K, G, S, C, kVariant>(k, p, begin, first);
        const bool aligned = reinterpret_cast<uintptr_t>(p.master + first) % (V::kWidth * 4) == 0;
        if (kVariant.streaming && !aligned) {
          UpdateHashingUnits<V, K, G, S, C, UpdateVariant{kVariant.fast, false}>(k, p, first, last);
        } else {
          UpdateHashingUnits<V, K, G, S, C, kVariant>(k, p, first, last);
        }
        return UpdateRange<V, K, G, S, C, kVariant>(k, p, last, end);
      }
    }
  }
  UpdateRange<V, K, G, S, C, kVariant>(k, p, begin, end);
}

// Quantizes the n (<= kQuantBlock) fp32 values x into codes[0, n) with the signed or unsigned
// code, storing the block's absmax to *scale. The absmax is a maximum (exact, order-free) and
// each byte is the exact nearest-code count of x / absmax (one correctly rounded division, then
// integer operations: quantize.h), so every path gives the same bytes. An all-zero block gets
// scale 0 and the code of 0. kFast multiplies by the reciprocal of the absmax (rounded once)
// instead of dividing: the same bytes on every path, each at most about one ulp of the element
// further from the nearest code than with the division.
template <class V, bool kSigned, bool kFast = false>
void QuantizeBlock(const float* x, size_t n, uint8_t* codes, float* scale) {
  const QuantCode& code = kSigned ? kSignedCode : kUnsignedCode;
  float absmax = 0.0f;
  size_t i = 0;
  if constexpr (V::kWidth > 1) {
    auto acc = V::Set(0.0f);
    for (; i + V::kWidth <= n; i += V::kWidth) acc = V::Max(acc, V::Abs(V::LoadF32(x + i)));
    absmax = V::ReduceMax(acc);
  }
  for (; i < n; ++i) absmax = ScalarOps::Max(absmax, ScalarOps::Abs(x[i]));
  const float divisor = absmax > 0.0f ? absmax : 1.0f;
  const float reciprocal = 1.0f / divisor;
  const auto normalize = [&](auto ops, auto value) {
    using Ops = decltype(ops);
    if constexpr (kFast) {
      return Ops::Mul(value, Ops::Set(reciprocal));
    } else {
      return Ops::Div(value, Ops::Set(divisor));
    }
  };
  i = 0;
  for (; i + V::kWidth <= n; i += V::kWidth) {
    V::template StoreQuantized<kSigned>(codes + i, normalize(V{}, V::LoadF32(x + i)), code);
  }
  for (; i < n; ++i) {
    ScalarOps::StoreQuantized<kSigned>(codes + i, normalize(ScalarOps{}, x[i]), code);
  }
  *scale = absmax;
}

// A vector policy that dequantizes V::kDequantizeWidth codes at once without a gather.
template <class V>
concept WideDequantizeOps = requires(const uint8_t* codes, typename V::F* out) {
  V::Dequantize64(codes, kSignedCode, out);
  V::kDequantizeWidth;
};

// Dequantizes the n codes of one block with its scale into out[0, n).
template <class V>
void DequantizeBlock(const uint8_t* codes, size_t n, const QuantCode& code, float scale,
                     float* out) {
  size_t i = 0;
  if constexpr (WideDequantizeOps<V>) {
    for (; i + V::kDequantizeWidth <= n; i += V::kDequantizeWidth) {
      typename V::F values[V::kDequantizeWidth / V::kWidth];
      V::Dequantize64(codes + i, code, values);
      for (size_t v = 0; v < std::size(values); ++v) {
        V::StoreF32(out + i + v * V::kWidth, V::Mul(values[v], V::Set(scale)));
      }
    }
  }
  for (; i + V::kWidth <= n; i += V::kWidth) {
    V::StoreF32(out + i, V::Mul(V::Dequantize(codes + i, code.value.data()), V::Set(scale)));
  }
  for (; i < n; ++i) out[i] = code.value[codes[i]] * scale;
}

// A moment block from and to its stored form: exp_avg (kSigned) as is, exp_avg_sq (unsigned)
// through its square root.
template <class V, bool kSigned>
void QuantizeBlockOf(const float* x, size_t n, uint8_t* codes, float* scale) {
  if constexpr (kSigned) {
    QuantizeBlock<V, true>(x, n, codes, scale);
  } else {
    alignas(64) float roots[kQuantBlock];
    size_t i = 0;
    for (; i + V::kWidth <= n; i += V::kWidth) V::StoreF32(roots + i, V::Sqrt(V::LoadF32(x + i)));
    for (; i < n; ++i) roots[i] = ScalarOps::Sqrt(x[i]);
    QuantizeBlock<V, false>(roots, n, codes, scale);
  }
}

// A moment block in its stored form to fp32: exp_avg (kSigned) as is, exp_avg_sq (unsigned)
// squared back from its stored square root.
template <class V, bool kSigned>
void DequantizeBlockOf(const uint8_t* codes, size_t n, float scale, float* out) {
  DequantizeBlock<V>(codes, n, kSigned ? kSignedCode : kUnsignedCode, scale, out);
  if constexpr (!kSigned) {
    size_t i = 0;
    for (; i + V::kWidth <= n; i += V::kWidth) {
      const auto root = V::LoadF32(out + i);
      V::StoreF32(out + i, V::Mul(root, root));
    }
    for (; i < n; ++i) out[i] = out[i] * out[i];
  }
}

// The hashers of one unit of kInt8 reads (ReadHashElements(kInt8) elements: four blocks of
// master, one of each moment's codes), fed by the unit's quantization blocks in order.
template <class V>
struct UnitHashers {
  typename V::ReadHasher master, exp_avg, exp_avg_sq;
};
// No hashing.
struct NoHashers {};

// Feeds the two moments' codes of elements [begin, end) of one quantization block (whole
// stripes: a full block) to the unit's hashers, before either is dequantized. The two chains
// alternate, so their latencies overlap.
template <class V>
void HashBlockCodes(const UpdatePointers& p, size_t begin, size_t end, UnitHashers<V>& hashers) {
  const auto* exp_avg = static_cast<const uint8_t*>(p.exp_avg);
  const auto* exp_avg_sq = static_cast<const uint8_t*>(p.exp_avg_sq);
  for (size_t i = begin; i < end; i += 64) {
    HashStripe<V>(hashers.exp_avg, exp_avg + i, i + p.read_origin, p.read_sums[1]);
    HashStripe<V>(hashers.exp_avg_sq, exp_avg_sq + i, i + p.read_origin, p.read_sums[2]);
  }
}

// UpdateRange of one whole block whose master is hashed as the update reads it: one fp32 vector
// is one 64-byte stripe, fed to the unit's master hasher just before its step, so the hash's
// dependency chain overlaps with the update's arithmetic instead of running alone.
template <class V, Kind K, DType G, CopySlot C, bool kFast, class P>
void UpdateRangeHashingMaster(const UpdateConstants& k, const P& p, size_t begin, size_t end,
                              UnitHashers<V>& hashers) {
  static_assert(V::kWidth * sizeof(float) == 64, "one vector of master is one XXH3 stripe");
  for (size_t i = begin; i < end; i += V::kWidth) {
    HashStripe<V>(hashers.master, p.master + i, (i + p.read_origin) * sizeof(float),
                  p.read_sums[0]);
    StepAt<V, K, G, DType::kInt8, C, UpdateVariant{kFast, false}>(k, p, i);
  }
}

// One kInt8 block [begin, end), block number `block`: the same per-element arithmetic as fp32
// state on its dequantized moments (dequantized first where V does it 64 codes at a time, else as
// they are loaded: BlockPointers), kept in fp32 buffers on the stack and requantized once the
// block's new absmax is known. Ordinary stores only (the buffers stay in L1); kFast is Adam's fast
// arithmetic and QuantizeBlock's reciprocal. An fp32 parameter copy (CopySlot::kF32) is written
// in the same pass, like the other copies. With UnitHashers (a whole block of a hashed unit), the
// block's codes are hashed before they are dequantized and its master as the update loads it.
template <class V, Kind K, DType G, CopySlot C, bool kFast, class Hashers>
void UpdateBlock(const UpdateConstants& k, const UpdatePointers& base, size_t begin, size_t end,
                 size_t block, Hashers& hashers) {
  constexpr bool kHashing = !std::is_same_v<Hashers, NoHashers>;
  if constexpr (kHashing) HashBlockCodes<V>(base, begin, end, hashers);
  alignas(64) float exp_avg[kQuantBlock];
  alignas(64) float exp_avg_sq[kQuantBlock];
  constexpr bool kPrefill = WideDequantizeOps<V>;
  BlockPointers<kPrefill> p;
  static_cast<UpdatePointers&>(p) = base;
  p.begin = begin;
  p.exp_avg_block = exp_avg;
  p.exp_avg_sq_block = exp_avg_sq;
  if constexpr (UsesExpAvg(K)) {
    p.exp_avg_scale_old = base.exp_avg_scale[block];
    if constexpr (kPrefill) {
      DequantizeBlockOf<V, true>(static_cast<const uint8_t*>(base.exp_avg) + begin, end - begin,
                                 p.exp_avg_scale_old, exp_avg);
    }
  }
  if constexpr (UsesExpAvgSq(K)) {
    p.exp_avg_sq_scale_old = base.exp_avg_sq_scale[block];
    if constexpr (kPrefill) {
      DequantizeBlockOf<V, false>(static_cast<const uint8_t*>(base.exp_avg_sq) + begin, end - begin,
                                  p.exp_avg_sq_scale_old, exp_avg_sq);
    }
  }
  if constexpr (kHashing) {
    UpdateRangeHashingMaster<V, K, G, C, kFast>(k, p, begin, end, hashers);
  } else {
    UpdateRange<V, K, G, DType::kInt8, C, UpdateVariant{kFast, false}>(k, p, begin, end);
  }
  if constexpr (UsesExpAvg(K)) {
    QuantizeBlock<V, true, kFast>(exp_avg, end - begin, static_cast<uint8_t*>(base.exp_avg) + begin,
                                  base.exp_avg_scale + block);
  }
  if constexpr (UsesExpAvgSq(K)) {
    QuantizeBlock<V, false, kFast>(exp_avg_sq, end - begin,
                                   static_cast<uint8_t*>(base.exp_avg_sq) + begin,
                                   base.exp_avg_sq_scale + block);
  }
}

// Every block of [begin, end) in turn (both on block boundaries of p.block_offset's layout).
template <class V, Kind K, DType G, CopySlot C, bool kFast, class Hashers>
void UpdateBlocksOf(const UpdateConstants& k, const UpdatePointers& p, size_t begin, size_t end,
                    Hashers& hashers) {
  for (size_t i = begin; i < end;) {
    const size_t block = (i + p.block_offset) / kQuantBlock;
    const size_t block_end = std::min(end, (block + 1) * kQuantBlock - p.block_offset);
    UpdateBlock<V, K, G, C, kFast>(k, p, i, block_end, block, hashers);
    i = block_end;
  }
}

// BlockUpdateFn. Where the path hashes reads and read_sums is given: the whole units inside
// [begin, end) with a fresh UnitHashers each (a unit boundary is a block boundary: kernels.h),
// the blocks before and after them unhashed (the same bits either way).
template <class V, Kind K, DType G, CopySlot C, bool kFast>
void UpdateBlocks(const UpdateConstants& k, const UpdatePointers& p, size_t begin, size_t end) {
  NoHashers none;
  if constexpr (kHashesReads<V, K, DType::kInt8>) {
    if (p.read_sums[0] != nullptr) {
      constexpr size_t kUnit = ReadHashElements(DType::kInt8);
      const auto [first, last] = WholeUnitsOf(begin, end, p.read_origin, kUnit);
      if (first < last) {
        UpdateBlocksOf<V, K, G, C, kFast>(k, p, begin, first, none);
        for (size_t unit = first; unit < last; unit += kUnit) {
          UnitHashers<V> hashers;
          UpdateBlocksOf<V, K, G, C, kFast>(k, p, unit, unit + kUnit, hashers);
        }
        return UpdateBlocksOf<V, K, G, C, kFast>(k, p, last, end, none);
      }
    }
  }
  UpdateBlocksOf<V, K, G, C, kFast>(k, p, begin, end, none);
}

// The range is read as two streams, which the memory system serves faster than one: the first
// `half` elements (half the range rounded down to a multiple of 2 * kTurn) and the rest. Element k
// of stream s (counted from the stream's start) is added to lane k % 8 of accumulator
// 2 * s + (k / kTurn) % 2, in increasing k. A 16-wide vector feeds one accumulator its first
// eight elements, then its next eight; an 8-wide vector half of that. The four accumulators are
// independent chains of additions, so their latency overlaps and the scan runs at memory speed.
// Products of two floats are exact in double, and every lane receives its elements in the same
// order on every path (the scalar tail continues each lane where the vectors stopped), so the sum
// is the same bits on every path.
template <class V, DType G>
double SumSquares(const void* grad, size_t begin, size_t end) {
  constexpr size_t kChains = 4;
  constexpr size_t kTurn = 16;  // consecutive elements of a stream one accumulator takes
  const size_t half = (end - begin) / 2 / (2 * kTurn) * (2 * kTurn);
  const size_t second = begin + half;  // stream 1's first element
  double lanes[kChains][8] = {};
  size_t k = 0;  // elements of each stream added by the vector loops
  if constexpr (V::kWidth >= 8) {
    static_assert(kTurn % V::kWidth == 0);
    using Lanes = decltype(V::ZeroLanes());
    Lanes acc[kChains];
    for (Lanes& a : acc) a = V::ZeroLanes();
    const auto add_turn = [&](Lanes& a, size_t first) {
      for (size_t v = 0; v < kTurn; v += V::kWidth)
        a = V::AddSquares(a, Load<V, G>(grad, first + v));
    };
    for (; k < half; k += 2 * kTurn) {
      add_turn(acc[0], begin + k);
      add_turn(acc[2], second + k);
      add_turn(acc[1], begin + k + kTurn);
      add_turn(acc[3], second + k + kTurn);
    }
    for (; second + k + kTurn <= end; k += kTurn) add_turn(acc[2 + (k / kTurn) % 2], second + k);
    for (size_t c = 0; c < kChains; ++c) V::StoreLanes(acc[c], lanes[c]);
  }
  const auto add_scalar = [&](size_t stream, size_t first, size_t i_end, size_t from) {
    for (size_t i = first + from; i < i_end; ++i) {
      const size_t j = i - first;
      const double x = Load<ScalarOps, G>(grad, i);
      lanes[2 * stream + (j / kTurn) % 2][j % 8] += x * x;
    }
  };
  add_scalar(0, begin, second, std::min(k, half));
  add_scalar(1, second, end, k);
  double chains[kChains];
  for (size_t c = 0; c < kChains; ++c) {
    const double* l = lanes[c];
    chains[c] = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
  }
  return (chains[0] + chains[1]) + (chains[2] + chains[3]);
}

template <class V, DType From, DType To>
void Convert(const void* src, void* dst, size_t begin, size_t end) {
  size_t i = begin;
  for (; i + V::kWidth <= end; i += V::kWidth) Store<V, To>(dst, i, Load<V, From>(src, i));
  for (; i < end; ++i) Store<ScalarOps, To>(dst, i, Load<ScalarOps, From>(src, i));
}

// The roofline probe. Streaming (when a, c and d are congruent modulo 64 bytes, else it falls
// back to plain stores) uses the update loop's techniques: scalar steps up to a's vector
// alignment, prefetch of the four arrays read, non-temporal stores of the three written, a fence.
template <class V, bool kStreaming>
void Stream(float* a, const float* b, float* c, float* d, size_t begin, size_t end) {
  size_t i = begin;
  if constexpr (kStreaming) {
    const auto residue = [](const float* x) { return reinterpret_cast<uintptr_t>(x) % 64; };
    if (residue(a) != residue(c) || residue(a) != residue(d)) {
      return Stream<V, false>(a, b, c, d, begin, end);
    }
    for (; i < end && reinterpret_cast<uintptr_t>(a + i) % (V::kWidth * sizeof(float)) != 0; ++i) {
      a[i] += b[i];
      c[i] += b[i];
      d[i] += b[i];
    }
  }
  for (; i + V::kWidth <= end; i += V::kWidth) {
    if constexpr (kStreaming) {
      PrefetchAhead(a, i);
      PrefetchAhead(b, i);
      PrefetchAhead(c, i);
      PrefetchAhead(d, i);
    }
    const auto x = V::LoadF32(b + i);
    Store<V, DType::kFloat32, kStreaming>(a, i, V::Add(V::LoadF32(a + i), x));
    Store<V, DType::kFloat32, kStreaming>(c, i, V::Add(V::LoadF32(c + i), x));
    Store<V, DType::kFloat32, kStreaming>(d, i, V::Add(V::LoadF32(d + i), x));
  }
  for (; i < end; ++i) {
    a[i] += b[i];
    c[i] += b[i];
    d[i] += b[i];
  }
  if constexpr (kStreaming) _mm_sfence();
}

template <class V, size_t I>
constexpr UpdateFn UpdateEntry() {
  // I = ((((kind * 3 + grad) * 2 + state) * 4 + copy) * 2 + fast) * 2 + streaming, as
  // KernelTable::UpdateIndex, with grad and state as KernelSlot numbers.
  constexpr auto kind = static_cast<Kind>(I / 96);
  constexpr DType grad = kKernelSlotDTypes[I / 32 % 3];
  constexpr DType state = kKernelSlotDTypes[I / 16 % 2];
  constexpr auto copy = static_cast<CopySlot>(I / 4 % 4);
  // Fast arithmetic changes only Adam's rule, and the scalar path has nothing to stream: those
  // entries share the plain instantiation.
  constexpr bool adam = kind == Kind::kAdamW || kind == Kind::kAdam;
  constexpr UpdateVariant variant{adam && I / 2 % 2 == 1, V::kWidth > 1 && I % 2 == 1};
  return &Update<V, kind, grad, state, copy, variant>;
}

// Entries [kBase, kBase + sizeof...(I)): one fold per optimizer kind, because clang limits a
// fold expression to 256 operands.
template <class V, size_t kBase, size_t... I>
constexpr void FillUpdates(KernelTable& table, std::index_sequence<I...>) {
  ((table.update[kBase + I] = UpdateEntry<V, kBase + I>()), ...);
}

template <class V, size_t I>
constexpr BlockUpdateFn BlockUpdateEntry() {
  // I = ((kind * 3 + grad) * 4 + copy) * 2 + fast, as KernelTable::BlockUpdateIndex, with grad as
  // a KernelSlot number.
  constexpr auto kind = static_cast<Kind>(I / 24);
  constexpr DType grad = kKernelSlotDTypes[I / 8 % 3];
  constexpr auto copy = static_cast<CopySlot>(I / 2 % 4);
  return &UpdateBlocks<V, kind, grad, copy, I % 2 == 1>;
}

template <class V, size_t... I>
constexpr void FillBlockUpdates(KernelTable& table, std::index_sequence<I...>) {
  ((table.block_update[I] = BlockUpdateEntry<V, I>()), ...);
}

template <class V>
constexpr KernelTable MakeKernelTable(Isa isa) {
  KernelTable table;
  table.isa = isa;
  constexpr size_t kPerKind = KernelTable::kUpdates / std::size(kAllKinds);
  static_assert(kPerKind * std::size(kAllKinds) == KernelTable::kUpdates);
  FillUpdates<V, 0 * kPerKind>(table, std::make_index_sequence<kPerKind>());
  FillUpdates<V, 1 * kPerKind>(table, std::make_index_sequence<kPerKind>());
  FillUpdates<V, 2 * kPerKind>(table, std::make_index_sequence<kPerKind>());
  FillUpdates<V, 3 * kPerKind>(table, std::make_index_sequence<kPerKind>());
  FillBlockUpdates<V>(table, std::make_index_sequence<KernelTable::kBlockUpdates>());
  table.sum_squares[KernelTable::Slot(DType::kFloat32)] = &SumSquares<V, DType::kFloat32>;
  table.sum_squares[KernelTable::Slot(DType::kBFloat16)] = &SumSquares<V, DType::kBFloat16>;
  table.sum_squares[KernelTable::Slot(DType::kFloat16)] = &SumSquares<V, DType::kFloat16>;
  table.from_f32[KernelTable::Slot(DType::kBFloat16)] =
      &Convert<V, DType::kFloat32, DType::kBFloat16>;
  table.from_f32[KernelTable::Slot(DType::kFloat16)] =
      &Convert<V, DType::kFloat32, DType::kFloat16>;
  table.to_f32[KernelTable::Slot(DType::kBFloat16)] =
      &Convert<V, DType::kBFloat16, DType::kFloat32>;
  table.to_f32[KernelTable::Slot(DType::kFloat16)] = &Convert<V, DType::kFloat16, DType::kFloat32>;
  table.stream = &Stream<V, false>;
  table.stream_nt = &Stream<V, V::kWidth != 1>;
  table.quantize_block[0] = &QuantizeBlockOf<V, false>;
  table.quantize_block[1] = &QuantizeBlockOf<V, true>;
  table.dequantize_block[0] = &DequantizeBlockOf<V, false>;
  table.dequantize_block[1] = &DequantizeBlockOf<V, true>;
  table.hashes_reads = ReadHashingOps<V>;
  return table;
}

}  // namespace
}  // namespace zoe::optim
