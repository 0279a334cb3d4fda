// 8-bit moments: the block-wise dynamic quantization of exp_avg and exp_avg_sq.
//
// A moment tensor is cut into blocks of at most kQuantBlock elements; each block stores one fp32
// scale (its largest magnitude, "absmax") and one byte per element, the index of the nearest
// value of a 256-entry code to element / absmax. The codes are the dynamic tree codes of the
// published 8-bit optimizers (Dettmers et al., "8-bit Optimizers via Block-wise Quantization",
// 2022): seven decades of magnitude, 10^-6 .. 1, each holding twice the values of the one below
// (values 10^(i-6) * (0.1 + 0.9 (j + 1/2) / n) for decade i with n values), plus 0 and 1. The
// signed code (exp_avg, Lion's momentum) spends its 254 values on both signs (n = 2^i), the
// unsigned one (exp_avg_sq, Adagrad's sum) on positive values only (n = 2^(i+1)), so it resolves
// the second moment twice as finely. Small values keep their relative precision where a linear
// code would round them to zero, which is what makes 8-bit Adam train like fp32 Adam. exp_avg_sq
// is stored as its square root (the kernels take the root before quantizing and square after
// dequantizing): second moments are squares of gradients and span twice the decades, and one
// rounded to zero under a non-zero exp_avg would make its step m / eps.
//
// Why 256 elements per block: a block's absmax sets the resolution of all its elements, so an
// outlier costs precision to fewer neighbours in small blocks; 256 keeps the scales at 1/64 byte
// per element and moment (a parameter's state is 4 + 1 + 1 + 1/32 bytes), the two block buffers
// of the fused kernel (2 KiB) in L1, and divides the 4096-element stripe granule of the offloaded
// step, so a block never straddles a stripe.
//
// Bytes are indices into the code sorted ascending, so the tables below are all a kernel needs:
// value[byte] dequantizes; the byte of a normalized x in [-1, 1] is the number of thresholds
// (midpoints between neighbouring values) below x (QuantizeNormalized, a binary search: the
// definition). The kernels find that count without searching (QuantizeUnsignedByte,
// QuantizeSignedByte): a float's bits above its low kQuantLowBits (exponent and the top seven
// mantissa bits) name a bucket, a range of floats 2^-7 of its binade wide, narrower than the
// gap between any two thresholds of either code, so a bucket holds at most one of them. One
// 32-bit entry per bucket holds how many thresholds lie below the bucket and the low bits of the
// one inside it, if any; one lookup and one integer comparison give the exact count (floats of
// one sign order as their bits do). Same integer operations on every path, so the same bytes.
//
// Internal linkage (constexpr tables) so that every kernel translation unit uses the same bits.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <limits>

namespace zoe::optim {

inline constexpr size_t kQuantBlock = 256;
inline constexpr size_t kQuantCodeSize = 256;

// The bucket table (see the top of this file). A bucket key is a float's bits shifted right by
// kQuantLowBits; the table covers keys kQuantFirstKey(code) .. kQuantLastKey (the bucket of 1.0),
// the first of them empty and below every positive threshold, so clamping a key into the range
// is exact for every float of magnitude at most 1.
inline constexpr int kQuantLowBits = 16;
inline constexpr uint32_t kQuantLowMask = (uint32_t{1} << kQuantLowBits) - 1;
inline constexpr int32_t kQuantLastKey = static_cast<int32_t>(0x3f800000u >> kQuantLowBits);
inline constexpr size_t kQuantBuckets = 2944;  // enough for both codes (static_assert below)
// An entry: (positive thresholds below the bucket) << kQuantCountShift | the low bits of the
// bucket's threshold, or kQuantNoThreshold (above any low bits) when it holds none.
inline constexpr int kQuantCountShift = 24;
inline constexpr uint32_t kQuantNoThreshold = kQuantLowMask + 1;

struct QuantCode {
  std::array<float, kQuantCodeSize> value{};  // ascending
  std::array<float, kQuantCodeSize>
      threshold{};  // [j] = midpoint of value[j], value[j+1]; last +inf
  // Bucket table over the positive thresholds (all of the unsigned code's, the signed code's
  // upper 128); bucket[key - first_key].
  int32_t first_key = 0;
  std::array<uint32_t, kQuantBuckets> bucket{};
  // value's bits as four byte planes: value_planes[p][j] is byte p (little-endian) of value[j].
  // What a byte-permute dequantization looks up in place of a gather (avx512_ops.h).
  std::array<std::array<uint8_t, kQuantCodeSize>, 4> value_planes{};
};

namespace quant_detail {

constexpr double Pow10(int exponent) {
  double result = 1.0;
  for (int i = 0; i < exponent; ++i) result *= 10.0;
  for (int i = 0; i > exponent; --i) result /= 10.0;
  return result;
}

constexpr int32_t KeyOf(float x) {
  return static_cast<int32_t>(std::bit_cast<uint32_t>(x) >> kQuantLowBits);
}

// The bucket table of `code`, its thresholds filled in. Throws (a compile error in a constant
// expression) when a bucket would hold two thresholds.
constexpr void FillBuckets(QuantCode& code) {
  size_t first = 0;  // the first positive threshold
  while (!(code.threshold[first] > 0.0f)) ++first;
  code.first_key = KeyOf(code.threshold[first]) - 1;  // an empty bucket below them all
  if (kQuantLastKey - code.first_key + 1 > static_cast<int32_t>(kQuantBuckets)) {
    throw "kQuantBuckets is too small for this code";
  }
  size_t next = first;  // the next threshold not yet placed
  for (int32_t key = code.first_key; key <= kQuantLastKey; ++key) {
    uint32_t entry = static_cast<uint32_t>(next - first) << kQuantCountShift | kQuantNoThreshold;
    if (next + 1 < kQuantCodeSize && KeyOf(code.threshold[next]) == key) {
      entry = static_cast<uint32_t>(next - first) << kQuantCountShift |
              (std::bit_cast<uint32_t>(code.threshold[next]) & kQuantLowMask);
      ++next;
      if (next + 1 < kQuantCodeSize && KeyOf(code.threshold[next]) == key) {
        throw "two thresholds in one bucket: use more mantissa bits per key";
      }
    }
    code.bucket[static_cast<size_t>(key - code.first_key)] = entry;
  }
  if (next + 1 != kQuantCodeSize) throw "a threshold above 1";
}

constexpr QuantCode MakeDynamicCode(bool is_signed) {
  std::array<double, kQuantCodeSize> values{};
  size_t size = 0;
  values[size++] = 0.0;
  values[size++] = 1.0;
  for (int decade = 0; decade < 7; ++decade) {
    const int count = is_signed ? (1 << decade) : (2 << decade);
    for (int j = 0; j < count; ++j) {
      const double mean = 0.1 + 0.9 * (j + 0.5) / count;
      const double value = Pow10(decade - 6) * mean;
      values[size++] = value;
      if (is_signed) values[size++] = -value;
    }
  }
  std::sort(values.begin(), values.end());
  QuantCode code;
  for (size_t i = 0; i < kQuantCodeSize; ++i) {
    code.value[i] = static_cast<float>(values[i]);
    const auto bits = std::bit_cast<uint32_t>(code.value[i]);
    for (size_t p = 0; p < 4; ++p) code.value_planes[p][i] = static_cast<uint8_t>(bits >> (8 * p));
  }
  for (size_t i = 0; i + 1 < kQuantCodeSize; ++i) {
    code.threshold[i] = static_cast<float>((values[i] + values[i + 1]) / 2.0);
  }
  code.threshold[kQuantCodeSize - 1] = std::numeric_limits<float>::infinity();
  FillBuckets(code);
  return code;
}

}  // namespace quant_detail

namespace {  // NOLINT: internal linkage on purpose (see convert.h)

// exp_avg and Lion's momentum.
constexpr QuantCode kSignedCode = quant_detail::MakeDynamicCode(true);
// exp_avg_sq and Adagrad's sum of squares (never negative).
constexpr QuantCode kUnsignedCode = quant_detail::MakeDynamicCode(false);

// The byte of `normalized` (in [-1, 1]): the count of a code's thresholds below it. The
// definition the kernels' bucket lookups below are tested against.
inline uint8_t QuantizeNormalized(const float* threshold, float normalized) {
  size_t pos = 0;
  for (size_t step = kQuantCodeSize / 2; step > 0; step /= 2) {
    if (normalized > threshold[pos + step - 1]) pos += step;
  }
  return static_cast<uint8_t>(pos);
}

// The entry of the bucket of a float whose bits are `bits` (as a signed integer: negative floats
// clamp to the empty first bucket, NaN and values above 1 to the bucket of 1.0).
inline uint32_t BucketEntry(const QuantCode& code, int32_t bits) {
  const int32_t key = std::clamp(bits >> kQuantLowBits, code.first_key, kQuantLastKey);
  return code.bucket[static_cast<size_t>(key - code.first_key)];
}

// How many of the code's positive thresholds lie below (kAtMost: at or below) the non-negative
// float whose bits are `bits`: the bucket's count, plus one when its threshold is passed.
template <bool kAtMost>
uint32_t PositiveThresholdsBelow(const QuantCode& code, int32_t bits) {
  const uint32_t entry = BucketEntry(code, bits);
  const uint32_t low = static_cast<uint32_t>(bits) & kQuantLowMask;
  const uint32_t threshold_low = entry & ((uint32_t{1} << kQuantCountShift) - 1);
  const bool passed = kAtMost ? low >= threshold_low : low > threshold_low;
  return (entry >> kQuantCountShift) + static_cast<uint32_t>(passed);
}

// QuantizeNormalized(kUnsignedCode.threshold, x) for x in [0, 1] (and 0 for negative x), by
// one bucket lookup. The scalar reference of the SIMD paths' StoreQuantized.
inline uint8_t QuantizeUnsignedByte(const QuantCode& code, float x) {
  return static_cast<uint8_t>(PositiveThresholdsBelow<false>(code, std::bit_cast<int32_t>(x)));
}

// QuantizeNormalized(kSignedCode.threshold, x) for x in [-1, 1]. The code is symmetric about
// value[127] = 0 except for its top value 1: x >= 0 is 127 plus the positive thresholds below x;
// x < 0 (sign bit set) is 127 less the mirrored thresholds at or below |x| (a threshold equal to
// |x| mirrors one equal to x, which is not below it), of which there are 127.
inline uint8_t QuantizeSignedByte(const QuantCode& code, float x) {
  const auto bits = std::bit_cast<int32_t>(x);
  const int32_t magnitude = bits & 0x7fffffff;
  if (bits < 0) {
    return static_cast<uint8_t>(127 -
                                std::min(PositiveThresholdsBelow<true>(code, magnitude), 127u));
  }
  return static_cast<uint8_t>(127 + PositiveThresholdsBelow<false>(code, magnitude));
}

}  // namespace

// The largest error of one element, as a fraction of its block's absmax: half the widest gap
// between neighbouring values, or the distance from -1 to the most negative value.
constexpr float MaxQuantError(const QuantCode& code) {
  double worst = code.value[0] < 0.0f ? 1.0 + code.value[0] : 0.0;
  for (size_t i = 0; i + 1 < kQuantCodeSize; ++i) {
    worst = std::max(worst, (static_cast<double>(code.value[i + 1]) - code.value[i]) / 2.0);
  }
  return static_cast<float>(worst);
}

}  // namespace zoe::optim
