// The AVX-512 vector policy for kernel_math.h, shared by kernels_avx512.cc (bf16 rounding
// emulated with integer instructions) and kernels_avx512_bf16.cc (native vcvtneps2bf16, chosen
// by defining ZOE_AVX512_NATIVE_BF16 before including this file; that path also defines
// ZOE_AVX512_VBMI, for int8 dequantization by byte permutes). Both give convert.h's bits.
// Included only by translation units compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq.
#pragma once

#include <immintrin.h>

#include <array>
#include <cstddef>
#include <cstdint>

#include "io/xxh3_block_avx512.h"
#include "optim/quantize.h"

namespace zoe::optim {
namespace {  // NOLINT: internal linkage on purpose (see convert.h)

#if defined(ZOE_AVX512_VBMI) && !defined(__AVX512VBMI__)
#error "ZOE_AVX512_VBMI needs a translation unit compiled with -mavx512vbmi"
#endif

#if defined(ZOE_AVX512_VBMI)
// Avx512Ops::Dequantize64's permutation of the codes: byte 16a + 4b + d takes code 16b + 4a + d.
constexpr std::array<uint8_t, 64> MakeUnpackOrder() {
  std::array<uint8_t, 64> order{};
  for (size_t s = 0; s < 64; ++s) {
    order[s] = static_cast<uint8_t>(s % 16 / 4 * 16 + s / 16 * 4 + s % 4);
  }
  return order;
}
alignas(64) constexpr std::array<uint8_t, 64> kUnpackOrder = MakeUnpackOrder();
#endif

struct Avx512Ops {
  using F = __m512;
  static constexpr size_t kWidth = 16;

  static F Set(float x) { return _mm512_set1_ps(x); }
  static F LoadF32(const float* p) { return _mm512_loadu_ps(p); }
  static F LoadBf16(const uint16_t* p) {
    const __m512i wide =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static F LoadF16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void StoreF32(float* p, F x) { _mm512_storeu_ps(p, x); }
  static void StreamF32(float* p, F x) { _mm512_stream_ps(p, x); }  // p 64-byte aligned
  static void StoreBf16(uint16_t* p, F x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), ToBf16(x));
  }
  static void StoreF16(uint16_t* p, F x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static F Add(F a, F b) { return _mm512_add_ps(a, b); }
  static F Sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F Mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F Div(F a, F b) { return _mm512_div_ps(a, b); }
  static F Sqrt(F a) { return _mm512_sqrt_ps(a); }
  static F Sign(F a) {
    const F zero = _mm512_setzero_ps();
    const __mmask16 positive = _mm512_cmp_ps_mask(a, zero, _CMP_GT_OQ);
    const __mmask16 negative = _mm512_cmp_ps_mask(a, zero, _CMP_LT_OQ);
    const F plus = _mm512_maskz_mov_ps(positive, _mm512_set1_ps(1.0f));
    return _mm512_mask_mov_ps(plus, negative, _mm512_set1_ps(-1.0f));
  }
  static F Abs(F a) { return _mm512_abs_ps(a); }
  static F Max(F a, F b) { return _mm512_max_ps(a, b); }
  // Lane by lane (max is exact, so the order does not matter): _mm512_reduce_max_ps trips
  // GCC 12's uninitialized warning inside its own header.
  static float ReduceMax(F a) {
    alignas(64) float lanes[kWidth];
    _mm512_store_ps(lanes, a);
    float result = lanes[0];
    for (size_t i = 1; i < kWidth; ++i) result = lanes[i] > result ? lanes[i] : result;
    return result;
  }
  // values[codes[0..15]] by a gather.
  static F Dequantize(const uint8_t* codes, const float* values) {
    const __m512i index =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
    return _mm512_i32gather_ps(index, values, 4);
  }
#if defined(ZOE_AVX512_VBMI)
  // values[codes[0..63]] into out[0..3] (sixteen lanes each, in order), without a gather: each
  // byte of the 32-bit values is looked up in its 256-byte plane (QuantCode::value_planes) by two
  // two-register byte permutes (codes below 128, and above, chosen by the code's top bit), then
  // the four planes are interleaved back into dwords. The interleaving unpacks work within
  // 128-bit lanes: out[q] lane 4L + d takes byte 16L + 4q + d of the planes, so the codes are
  // first permuted to put code 16q + 4L + d there (kUnpackOrder, its own inverse).
  static void Dequantize64(const uint8_t* codes, const QuantCode& code, F out[4]) {
    const __m512i order = _mm512_load_si512(kUnpackOrder.data());
    const __m512i c = _mm512_permutexvar_epi8(order, _mm512_loadu_si512(codes));
    const __mmask64 upper_half = _mm512_movepi8_mask(c);
    __m512i plane[4];
    for (size_t p = 0; p < 4; ++p) {
      const uint8_t* bytes = code.value_planes[p].data();
      const __m512i lower =
          _mm512_permutex2var_epi8(_mm512_loadu_si512(bytes), c, _mm512_loadu_si512(bytes + 64));
      const __m512i upper = _mm512_permutex2var_epi8(_mm512_loadu_si512(bytes + 128), c,
                                                     _mm512_loadu_si512(bytes + 192));
      plane[p] = _mm512_mask_mov_epi8(lower, upper_half, upper);
    }
    const __m512i low01 = _mm512_unpacklo_epi8(plane[0], plane[1]);
    const __m512i high01 = _mm512_unpackhi_epi8(plane[0], plane[1]);
    const __m512i low23 = _mm512_unpacklo_epi8(plane[2], plane[3]);
    const __m512i high23 = _mm512_unpackhi_epi8(plane[2], plane[3]);
    out[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(low01, low23));
    out[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(low01, low23));
    out[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(high01, high23));
    out[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(high01, high23));
  }
  static constexpr size_t kDequantizeWidth = 64;
  static_assert(kDequantizeWidth == 4 * kWidth, "Dequantize64 fills four vectors");
#endif

  // quantize.h's QuantizeSignedByte / QuantizeUnsignedByte on sixteen lanes: one gather of the
  // lanes' bucket entries, then the same integer operations.
  template <bool kSigned>
  static void StoreQuantized(uint8_t* codes, F normalized, const QuantCode& code) {
    const __m512i bits = _mm512_castps_si512(normalized);
    const __m512i magnitude =
        kSigned ? _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)) : bits;
    const __m512i first_key = _mm512_set1_epi32(code.first_key);
    __m512i key = _mm512_srai_epi32(magnitude, kQuantLowBits);
    key = _mm512_min_epi32(_mm512_max_epi32(key, first_key), _mm512_set1_epi32(kQuantLastKey));
    const __m512i entry =
        _mm512_i32gather_epi32(_mm512_sub_epi32(key, first_key), code.bucket.data(), 4);
    const __m512i low = _mm512_and_si512(magnitude, _mm512_set1_epi32(kQuantLowMask));
    const __m512i threshold_low =
        _mm512_and_si512(entry, _mm512_set1_epi32((1 << kQuantCountShift) - 1));
    const __m512i below = _mm512_srli_epi32(entry, kQuantCountShift);
    const __m512i one = _mm512_set1_epi32(1);
    const __mmask16 passed = _mm512_cmpgt_epu32_mask(low, threshold_low);
    __m512i result = _mm512_mask_add_epi32(below, passed, below, one);
    if constexpr (kSigned) {
      const __m512i c127 = _mm512_set1_epi32(127);
      const __mmask16 reached = _mm512_cmpge_epu32_mask(low, threshold_low);
      const __m512i at_most = _mm512_mask_add_epi32(below, reached, below, one);
      const __m512i negative = _mm512_sub_epi32(c127, _mm512_min_epu32(at_most, c127));
      result = _mm512_mask_mov_epi32(_mm512_add_epi32(c127, result), _mm512_movepi32_mask(bits),
                                     negative);
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes), _mm512_cvtepi32_epi8(result));
  }

#if defined(ZOE_AVX512_NATIVE_BF16)
  static __m256i ToBf16(F x) { return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x)); }
#else
  // convert.h's FloatToBf16 on sixteen lanes, narrowed to 16 bits.
  static __m256i ToBf16(F x) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i magnitude = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
    const __m512i high = _mm512_srli_epi32(bits, 16);
    const __m512i bias =
        _mm512_add_epi32(_mm512_and_si512(high, _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7fff));
    __m512i result = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
    const __mmask16 is_nan = _mm512_cmpgt_epi32_mask(magnitude, _mm512_set1_epi32(0x7f800000));
    result = _mm512_mask_or_epi32(result, is_nan, high, _mm512_set1_epi32(0x40));
    const __mmask16 is_tiny = _mm512_cmplt_epi32_mask(magnitude, _mm512_set1_epi32(0x00800000));
    result = _mm512_mask_and_epi32(result, is_tiny, high, _mm512_set1_epi32(0x8000));
    return _mm512_cvtepi32_epi16(result);
  }
#endif

  // Hashing of reads (kernel_math.h, UpdateHashingReads): one vector of fp32 is one XXH3 stripe.
  using ReadHasher = io::Xxh3BlockHasher;
  static __m512i LoadStripe(const void* p) { return _mm512_loadu_si512(p); }

  using Lanes = __m512d;  // lanes 0..7
  static Lanes ZeroLanes() { return _mm512_setzero_pd(); }
  // A fused multiply-add gives the bits of a multiply and an add: the square is exact in double.
  static Lanes AddSquares(Lanes acc, F x) {
    const __m512d low = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    const __m512d high =
        _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    return _mm512_fmadd_pd(high, high, _mm512_fmadd_pd(low, low, acc));
  }
  static void StoreLanes(Lanes acc, double* out) { _mm512_storeu_pd(out, acc); }
};

}  // namespace
}  // namespace zoe::optim
