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
// (midpoints between neighbouring values) below x, found by an eight-step branchless binary
// search that SIMD paths run with gathers and get the same bytes (comparisons are exact).
//
// Internal linkage (constexpr tables) so that every kernel translation unit uses the same bits.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>

namespace zoe::optim {

inline constexpr size_t kQuantBlock = 256;
inline constexpr size_t kQuantCodeSize = 256;

struct QuantCode {
  std::array<float, kQuantCodeSize> value{};  // ascending
  std::array<float, kQuantCodeSize>
      threshold{};  // [j] = midpoint of value[j], value[j+1]; last +inf
};

namespace quant_detail {

constexpr double Pow10(int exponent) {
  double result = 1.0;
  for (int i = 0; i < exponent; ++i) result *= 10.0;
  for (int i = 0; i > exponent; --i) result /= 10.0;
  return result;
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
  for (size_t i = 0; i < kQuantCodeSize; ++i) code.value[i] = static_cast<float>(values[i]);
  for (size_t i = 0; i + 1 < kQuantCodeSize; ++i) {
    code.threshold[i] = static_cast<float>((values[i] + values[i + 1]) / 2.0);
  }
  code.threshold[kQuantCodeSize - 1] = std::numeric_limits<float>::infinity();
  return code;
}

}  // namespace quant_detail

namespace {  // NOLINT: internal linkage on purpose (see convert.h)

// exp_avg and Lion's momentum.
constexpr QuantCode kSignedCode = quant_detail::MakeDynamicCode(true);
// exp_avg_sq and Adagrad's sum of squares (never negative).
constexpr QuantCode kUnsignedCode = quant_detail::MakeDynamicCode(false);

// The byte of `normalized` (in [-1, 1]): the count of a code's thresholds below it.
inline uint8_t QuantizeNormalized(const float* threshold, float normalized) {
  size_t pos = 0;
  for (size_t step = kQuantCodeSize / 2; step > 0; step /= 2) {
    if (normalized > threshold[pos + step - 1]) pos += step;
  }
  return static_cast<uint8_t>(pos);
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
