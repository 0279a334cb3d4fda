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
  // quantize.h's QuantizeNormalized on eight lanes: the binary search gathers each lane's
  // threshold and adds the step where the lane is above it.
  static void StoreQuantized(uint8_t* codes, F normalized, const float* threshold) {
    __m256i pos = _mm256_setzero_si256();
    for (int step = static_cast<int>(kQuantCodeSize / 2); step > 0; step /= 2) {
      const __m256i probe = _mm256_add_epi32(pos, _mm256_set1_epi32(step - 1));
      const F above =
          _mm256_cmp_ps(normalized, _mm256_i32gather_ps(threshold, probe, 4), _CMP_GT_OQ);
      pos = _mm256_add_epi32(pos,
                             _mm256_and_si256(_mm256_castps_si256(above), _mm256_set1_epi32(step)));
    }
    // Every lane is below 256: both packs are plain narrowings, in lane order.
    const __m128i words =
        _mm_packus_epi32(_mm256_castsi256_si128(pos), _mm256_extracti128_si256(pos, 1));
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
    return {_mm256_add_pd(acc.low, _mm256_mul_pd(low, low)),
            _mm256_add_pd(acc.high, _mm256_mul_pd(high, high))};
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
