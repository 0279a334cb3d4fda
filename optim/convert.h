// Scalar conversions between fp32 and the 16-bit formats, defined bit for bit so that every SIMD
// path can reproduce them exactly:
//  - fp32 -> bf16 follows the Intel SDM definition of VCVTNEPS2BF16: round to nearest even;
//    zero and fp32 subnormals become a zero of the same sign; infinities stay; a NaN keeps its
//    top bits with the quiet bit set.
//  - fp32 -> fp16 is IEEE round to nearest even with fp16 subnormals, as VCVTPS2PH with
//    imm8 = _MM_FROUND_TO_NEAREST_INT does; a NaN keeps its top payload bits, quieted.
//  - bf16 -> fp32 and fp16 -> fp32 are exact (a NaN comes back quieted, as VCVTPH2PS does).
//
// Everything here has internal linkage: the file is compiled into translation units built for
// different instruction sets, and a shared inline symbol could otherwise be resolved to a copy
// that uses instructions the running CPU lacks.
#pragma once

#include <cstdint>
#include <cstring>

namespace zoe::optim {
namespace {  // NOLINT: internal linkage on purpose (see above)

inline uint32_t FloatBits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

inline float BitsFloat(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

inline uint16_t FloatToBf16(float value) {
  const uint32_t bits = FloatBits(value);
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);  // NaN
  if (magnitude < 0x00800000u)
    return static_cast<uint16_t>((bits >> 16) & 0x8000u);  // 0, subnormal
  const uint32_t rounding_bias = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding_bias) >> 16);
}

inline float Bf16ToFloat(uint16_t value) { return BitsFloat(static_cast<uint32_t>(value) << 16); }

// Round to nearest even by integer arithmetic for normal fp16 results, and by an fp32 addition
// that lines the value up with the fp16 subnormal grid for subnormal ones.
inline uint16_t FloatToF16(float value) {
  uint32_t bits = FloatBits(value);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  bits &= 0x7fffffffu;
  if (bits > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((bits >> 13) & 0x3ffu));
  if (bits >= 0x47800000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65536: overflow
  if (bits < 0x38800000u) {             // below 2^-14: fp16 subnormal or zero
    const uint32_t magic = 126u << 23;  // 0.5f: its ulp is 2^-24, the fp16 subnormal step
    return static_cast<uint16_t>(sign | (FloatBits(BitsFloat(bits) + BitsFloat(magic)) - magic));
  }
  const uint32_t mantissa_odd = (bits >> 13) & 1u;
  bits += (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu + mantissa_odd;
  return static_cast<uint16_t>(sign | (bits >> 13));
}

inline float F16ToFloat(uint16_t value) {
  const uint32_t sign = static_cast<uint32_t>(value & 0x8000u) << 16;
  const uint32_t exponent = (value >> 10) & 0x1fu;
  const uint32_t mantissa = value & 0x3ffu;
  if (exponent == 0x1f) {
    const uint32_t quiet = mantissa != 0 ? 0x00400000u : 0u;
    return BitsFloat(sign | 0x7f800000u | quiet | (mantissa << 13));
  }
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24 is exact in fp32
    return BitsFloat(sign | FloatBits(static_cast<float>(mantissa) * 0x1p-24f));
  }
  return BitsFloat(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

}  // namespace
}  // namespace zoe::optim
