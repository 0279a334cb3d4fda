// The AVX2 path (compiled with -mavx2 -mfma -mf16c -ffp-contract=off; see optim/CMakeLists.txt):
// eight floats per operation, fp16 through F16C, bf16 rounding emulated with integer
// instructions exactly as convert.h defines it.
#include <immintrin.h>

#include "optim/kernel_math.h"

namespace zoe::optim {
namespace {

struct Avx2Ops {
  using F = __m256;
  static constexpr size_t kWidth = 8;

  static F Set(float x) { return _mm256_set1_ps(x); }
  static F LoadF32(const float* p) { return _mm256_loadu_ps(p); }
  static F LoadBf16(const uint16_t* p) {
    const __m256i wide =
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static F LoadF16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void StoreF32(float* p, F x) { _mm256_storeu_ps(p, x); }
  static void StreamF32(float* p, F x) { _mm256_stream_ps(p, x); }  // p 32-byte aligned
  static void StoreBf16(uint16_t* p, F x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), ToBf16(x));
  }
  static void StoreF16(uint16_t* p, F x) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static F Add(F a, F b) { return _mm256_add_ps(a, b); }
  static F Sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F Mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F Div(F a, F b) { return _mm256_div_ps(a, b); }
  static F Sqrt(F a) { return _mm256_sqrt_ps(a); }
  static F Sign(F a) {
    const F one = _mm256_set1_ps(1.0f);
    const F zero = _mm256_setzero_ps();
    const F positive = _mm256_and_ps(_mm256_cmp_ps(a, zero, _CMP_GT_OQ), one);
    const F negative = _mm256_and_ps(_mm256_cmp_ps(a, zero, _CMP_LT_OQ), one);
    return _mm256_sub_ps(positive, negative);
  }
  static F Abs(F a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
  static F Max(F a, F b) { return _mm256_max_ps(a, b); }
  static float ReduceMax(F a) {
    alignas(32) float lanes[kWidth];
    _mm256_store_ps(lanes, a);
    float result = lanes[0];
    for (size_t i = 1; i < kWidth; ++i) result = lanes[i] > result ? lanes[i] : result;
    return result;
  }
  // values[codes[0..7]] by a gather.
  static F Dequantize(const uint8_t* codes, const float* values) {
    const __m256i index =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes)));
    return _mm256_i32gather_ps(values, index, 4);
  }
  // quantize.h's QuantizeSignedByte / QuantizeUnsignedByte on eight lanes: one gather of the
  // lanes' bucket entries, then the same integer operations.
  template <bool kSigned>
  static void StoreQuantized(uint8_t* codes, F normalized, const QuantCode& code) {
    const __m256i bits = _mm256_castps_si256(normalized);
    const __m256i magnitude =
        kSigned ? _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)) : bits;
    const __m256i first_key = _mm256_set1_epi32(code.first_key);
    __m256i key = _mm256_srai_epi32(magnitude, kQuantLowBits);
    key = _mm256_min_epi32(_mm256_max_epi32(key, first_key), _mm256_set1_epi32(kQuantLastKey));
    const __m256i entry = _mm256_i32gather_epi32(reinterpret_cast<const int*>(code.bucket.data()),
                                                 _mm256_sub_epi32(key, first_key), 4);
    const __m256i low = _mm256_and_si256(magnitude, _mm256_set1_epi32(kQuantLowMask));
    const __m256i threshold_low =
        _mm256_and_si256(entry, _mm256_set1_epi32((1 << kQuantCountShift) - 1));
    const __m256i below = _mm256_srli_epi32(entry, kQuantCountShift);
    // Both operands are below 2^24: signed comparisons are exact. cmpgt gives -1 where true.
    const __m256i passed = _mm256_cmpgt_epi32(low, threshold_low);  // low > threshold
    __m256i result = _mm256_sub_epi32(below, passed);
    if constexpr (kSigned) {
      const __m256i c127 = _mm256_set1_epi32(127);
      // below + (low >= threshold) = below + 1 + (threshold > low ? -1 : 0)
      const __m256i at_most = _mm256_add_epi32(_mm256_add_epi32(below, _mm256_set1_epi32(1)),
                                               _mm256_cmpgt_epi32(threshold_low, low));
      const __m256i negative = _mm256_sub_epi32(c127, _mm256_min_epi32(at_most, c127));
      const __m256i positive = _mm256_add_epi32(c127, result);
      result = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(positive),
                                                    _mm256_castsi256_ps(negative), normalized));
    }
    // Every lane is below 256: both packs are plain narrowings, in lane order.
    const __m128i words =
        _mm_packus_epi32(_mm256_castsi256_si128(result), _mm256_extracti128_si256(result, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(codes), _mm_packus_epi16(words, words));
  }

  // convert.h's FloatToBf16 on eight lanes, narrowed to 16 bits.
  static __m128i ToBf16(F x) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i magnitude = _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff));
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i bias = _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff));
    __m256i result = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
    const __m256i is_nan = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7f800000));
    const __m256i nan = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
    result = _mm256_blendv_epi8(result, nan, is_nan);
    const __m256i is_tiny = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x00800000), magnitude);
    const __m256i zero = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x8000));
    result = _mm256_blendv_epi8(result, zero, is_tiny);
    // Every lane now holds a value below 2^16, so unsigned saturation is a plain narrowing; the
    // permute undoes packus's per-128-bit-lane interleave.
    const __m256i packed = _mm256_packus_epi32(result, _mm256_setzero_si256());
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0xd8));
  }

  struct Lanes {
    __m256d low;   // lanes 0..3
    __m256d high;  // lanes 4..7
  };
  static Lanes ZeroLanes() { return {_mm256_setzero_pd(), _mm256_setzero_pd()}; }
  static Lanes AddSquares(Lanes acc, F x) {
    const __m256d low = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
    const __m256d high = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    // A fused multiply-add gives the bits of a multiply and an add: the square is exact in double.
    return {_mm256_fmadd_pd(low, low, acc.low), _mm256_fmadd_pd(high, high, acc.high)};
  }
  static void StoreLanes(Lanes acc, double* out) {
    _mm256_storeu_pd(out, acc.low);
    _mm256_storeu_pd(out + 4, acc.high);
  }
};

constexpr KernelTable kAvx2Table = MakeKernelTable<Avx2Ops>(Isa::kAvx2);

}  // namespace

const KernelTable& Avx2KernelTable() { return kAvx2Table; }

}  // namespace zoe::optim
