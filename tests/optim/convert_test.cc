// Description: fp32 <-> bf16/fp16 conversions: known roundings and special values, and every
// SIMD path (F16C, AVX-512, native bf16) agreeing with the scalar definition on all 16-bit
// patterns and on a wide sample of fp32 patterns.
#include "optim/convert.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "optim/dispatch.h"
#include "optim_test_util.h"

namespace zoe::optim {
namespace {

TEST(Convert, Bf16RoundsToNearestEvenAndFlushesSubnormals) {
  EXPECT_EQ(FloatToBf16(1.0f), 0x3f80);
  EXPECT_EQ(FloatToBf16(BitsFloat(0x3f808000)), 0x3f80);  // tie, even stays
  EXPECT_EQ(FloatToBf16(BitsFloat(0x3f818000)), 0x3f82);  // tie, odd rounds up
  EXPECT_EQ(FloatToBf16(BitsFloat(0x3f808001)), 0x3f81);
  EXPECT_EQ(FloatToBf16(-INFINITY), 0xff80);
  EXPECT_EQ(FloatToBf16(BitsFloat(0x7f7fffff)), 0x7f80);  // rounds up to infinity
  EXPECT_EQ(FloatToBf16(BitsFloat(0x00000001)), 0x0000);  // subnormal -> +0
  EXPECT_EQ(FloatToBf16(BitsFloat(0x80400000)), 0x8000);  // subnormal -> -0
  EXPECT_EQ(FloatToBf16(BitsFloat(0x7f800001)), 0x7fc0);  // signalling NaN is quieted
  EXPECT_EQ(Bf16ToFloat(0x4049), 3.140625f);
}

TEST(Convert, F16RoundsToNearestEvenWithSubnormals) {
  EXPECT_EQ(FloatToF16(1.0f), 0x3c00);
  EXPECT_EQ(FloatToF16(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToF16(65520.0f), 0x7c00);  // halfway to the next binade: rounds to infinity
  EXPECT_EQ(FloatToF16(65519.0f), 0x7bff);
  EXPECT_EQ(FloatToF16(0x1p-24f), 0x0001);  // smallest subnormal
  EXPECT_EQ(FloatToF16(0x1p-25f), 0x0000);  // tie to even: zero
  EXPECT_EQ(FloatToF16(0x1.8p-25f), 0x0001);
  EXPECT_EQ(FloatToF16(-0x1p-14f), 0x8400);  // smallest normal
  EXPECT_EQ(FloatToF16(NAN) & 0x7e00, 0x7e00);
  EXPECT_EQ(F16ToFloat(0x0001), 0x1p-24f);
  EXPECT_EQ(F16ToFloat(0xfc00), -INFINITY);
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = F16ToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(FloatToF16(f), h) << std::hex << h;
  }
}

// fp32 patterns: every 16-bit pattern shifted into each half, plus a stride through all 2^32.
std::vector<float> SampleFloats() {
  std::vector<float> values;
  for (uint32_t h = 0; h < 0x10000; ++h) {
    values.push_back(BitsFloat(h << 16));
    values.push_back(BitsFloat((h << 16) | 0x8000));
    values.push_back(BitsFloat((h << 16) | 0x7fff));
    values.push_back(BitsFloat(h));
  }
  for (uint64_t bits = 0; bits < (uint64_t{1} << 32); bits += 40503) {
    values.push_back(BitsFloat(static_cast<uint32_t>(bits)));
  }
  return values;
}

TEST(Convert, EverySimdPathMatchesScalarBitForBit) {
  const std::vector<float> floats = SampleFloats();
  std::vector<uint16_t> halves(0x10000);
  for (uint32_t h = 0; h < 0x10000; ++h) halves[h] = static_cast<uint16_t>(h);
  const KernelTable& scalar = ScalarKernelTable();
  for (Isa isa : testing::SupportedIsas()) {
    const KernelTable* table = *KernelsFor(isa);
    for (DType type : {DType::kBFloat16, DType::kFloat16}) {
      const int t = static_cast<int>(type);
      std::vector<uint16_t> expected(floats.size()), actual(floats.size());
      scalar.from_f32[t](floats.data(), expected.data(), 0, floats.size());
      table->from_f32[t](floats.data(), actual.data(), 0, floats.size());
      for (size_t i = 0; i < floats.size(); ++i) {
        ASSERT_EQ(actual[i], expected[i]) << IsaName(isa) << " fp32->" << DTypeName(type)
                                          << " of bits 0x" << std::hex << FloatBits(floats[i]);
      }
      std::vector<float> wide_expected(halves.size()), wide_actual(halves.size());
      scalar.to_f32[t](halves.data(), wide_expected.data(), 0, halves.size());
      table->to_f32[t](halves.data(), wide_actual.data(), 0, halves.size());
      for (size_t i = 0; i < halves.size(); ++i) {
        ASSERT_EQ(FloatBits(wide_actual[i]), FloatBits(wide_expected[i]))
            << IsaName(isa) << " " << DTypeName(type) << "->fp32 of 0x" << std::hex << i;
      }
    }
  }
}

}  // namespace
}  // namespace zoe::optim
