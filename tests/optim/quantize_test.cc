// Description: int8 moments (optim/quantize.h): the dynamic codes, quantize/dequantize round trips
// within the codes' stated error, the block layout, every instruction-set path of the fused
// int8 update against the scalar reference (bit-identical), and the argument checks.
#include "optim/quantize.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/executor.h"
#include "optim/chunk.h"
#include "optim_test_util.h"

namespace zoe::optim {
namespace {

using testing::DefaultHyper;
using testing::SupportedIsas;

TEST(QuantCode, SignedCodeIsSortedSymmetricWithZeroAndOne) {
  for (size_t i = 0; i + 1 < kQuantCodeSize; ++i) {
    EXPECT_LT(kSignedCode.value[i], kSignedCode.value[i + 1]) << i;
    EXPECT_GT(kSignedCode.threshold[i], kSignedCode.value[i]) << i;
    EXPECT_LT(kSignedCode.threshold[i], kSignedCode.value[i + 1]) << i;
  }
  EXPECT_EQ(kSignedCode.value[255], 1.0f);
  EXPECT_EQ(kSignedCode.value[127], 0.0f);
  EXPECT_TRUE(std::isinf(kSignedCode.threshold[255]));
  // 127 negative values mirroring the positive ones below 1.
  for (size_t i = 0; i < 127; ++i) EXPECT_EQ(kSignedCode.value[i], -kSignedCode.value[254 - i]);
  // Seven decades: the smallest magnitude is 10^-6 * 0.55.
  EXPECT_NEAR(kSignedCode.value[128], 0.55e-6f, 1e-12f);
}

TEST(QuantCode, UnsignedCodeIsSortedNonNegativeAndFiner) {
  EXPECT_EQ(kUnsignedCode.value[0], 0.0f);
  EXPECT_EQ(kUnsignedCode.value[255], 1.0f);
  for (size_t i = 0; i + 1 < kQuantCodeSize; ++i) {
    EXPECT_LT(kUnsignedCode.value[i], kUnsignedCode.value[i + 1]) << i;
  }
  // The stated errors: the top decade holds 64 (signed) or 128 (unsigned) values over [0.1, 1].
  EXPECT_NEAR(MaxQuantError(kSignedCode), 0.9 / 64 / 2, 1e-4);
  EXPECT_NEAR(MaxQuantError(kUnsignedCode), 0.9 / 128 / 2, 1e-4);
}

TEST(QuantCode, NearestValueIsChosen) {
  for (const QuantCode* code : {&kSignedCode, &kUnsignedCode}) {
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> unit(code == &kSignedCode ? -1.0f : 0.0f, 1.0f);
    for (int n = 0; n < 20000; ++n) {
      const float x = n % 2 == 0 ? unit(rng) : unit(rng) * 1e-4f;
      const uint8_t byte = QuantizeNormalized(code->threshold.data(), x);
      const float error = std::fabs(code->value[byte] - x);
      for (size_t j = 0; j < kQuantCodeSize; ++j) {
        ASSERT_LE(error, std::fabs(code->value[j] - x) * (1 + 1e-6f)) << x << " " << j;
      }
    }
  }
}

// The floats at which the byte of either the binary search (QuantizeNormalized) or the bucket
// lookup can change, with a neighbour on each side: every threshold, every bucket boundary, the
// ends of the range. Between two neighbouring points of this list both are constant (the search
// changes only at thresholds, the lookup only there and at bucket boundaries), so agreeing on
// all of them is agreeing on every float of [0, 1].
std::vector<float> CriticalMagnitudes(const QuantCode& code) {
  std::vector<float> points = {0.0f, std::numeric_limits<float>::denorm_min(),
                               std::numeric_limits<float>::min(), 1e-30f, 1.0f};
  const auto around = [&](float x) {
    points.push_back(std::nextafter(x, 0.0f));
    points.push_back(x);
    if (x < 1.0f) points.push_back(std::nextafter(x, 2.0f));
  };
  for (size_t i = 0; i + 1 < kQuantCodeSize; ++i) {
    if (code.threshold[i] > 0.0f) around(code.threshold[i]);
  }
  for (int32_t key = code.first_key; key <= kQuantLastKey; ++key) {
    around(std::bit_cast<float>(static_cast<uint32_t>(key) << kQuantLowBits));
  }
  return points;
}

TEST(QuantCode, BucketLookupEqualsTheBinarySearchOnEveryFloat) {
  static_assert(kQuantLastKey - kUnsignedCode.first_key < static_cast<int32_t>(kQuantBuckets));
  for (float x : CriticalMagnitudes(kUnsignedCode)) {
    ASSERT_EQ(QuantizeUnsignedByte(kUnsignedCode, x),
              QuantizeNormalized(kUnsignedCode.threshold.data(), x))
        << x;
  }
  for (float x : CriticalMagnitudes(kSignedCode)) {
    for (float signed_x : {x, -x}) {
      ASSERT_EQ(QuantizeSignedByte(kSignedCode, signed_x),
                QuantizeNormalized(kSignedCode.threshold.data(), signed_x))
          << signed_x;
    }
  }
  // Outside the code's range the lookup stays in its table: negative values take the unsigned
  // code's 0, as the search does; NaN and values above 1 the byte of 1.
  EXPECT_EQ(QuantizeUnsignedByte(kUnsignedCode, -0.5f), 0);
  EXPECT_EQ(QuantizeUnsignedByte(kUnsignedCode, -0.0f), 0);
  EXPECT_EQ(QuantizeUnsignedByte(kUnsignedCode, NAN), 255);
  EXPECT_EQ(QuantizeUnsignedByte(kUnsignedCode, INFINITY), 255);
  EXPECT_EQ(QuantizeSignedByte(kSignedCode, 2.0f), 255);
  EXPECT_EQ(QuantizeSignedByte(kSignedCode, -INFINITY), 0);
}

// Every path's quantizer against the definition on the critical floats: blocks whose first
// element is the block's absmax 1 (so each normalized value is the element itself), quantized
// by QuantizeMoments. exp_avg_sq goes through a square root, so its elements are squares of the
// wanted roots (sqrt(x * x) == x for these floats).
TEST(QuantizeMoments, EveryPathQuantizesTheCriticalFloatsToTheNearestCode) {
  for (Moment moment : {Moment::kExpAvg, Moment::kExpAvgSq}) {
    const bool is_signed = moment == Moment::kExpAvg;
    const QuantCode& code = is_signed ? kSignedCode : kUnsignedCode;
    std::vector<float> normalized;
    for (float x : CriticalMagnitudes(code)) {
      // Roots whose square underflows (the tiniest floats, all below the code's smallest
      // threshold) cannot be given through exp_avg_sq.
      if (!is_signed && std::sqrt(x * x) != x) continue;
      if (normalized.size() % kQuantBlock == 0) normalized.push_back(1.0f);
      normalized.push_back(x);
      if (!is_signed) continue;
      if (normalized.size() % kQuantBlock == 0) normalized.push_back(1.0f);
      normalized.push_back(-x);
    }
    std::vector<float> values(normalized);
    if (!is_signed) {
      for (size_t i = 0; i < values.size(); ++i) values[i] = normalized[i] * normalized[i];
    }
    for (Isa isa : SupportedIsas()) {
      SCOPED_TRACE(std::string(IsaName(isa)) + (is_signed ? " signed" : " unsigned"));
      RunOptions run;
      run.isa = isa;
      std::vector<uint8_t> codes(values.size());
      std::vector<float> scales(QuantBlockCount(values.size(), 0));
      ASSERT_TRUE(
          QuantizeMoments(moment, values.data(), values.size(), 0, codes.data(), scales.data(), run)
              .ok());
      for (float scale : scales) ASSERT_EQ(scale, 1.0f);
      for (size_t i = 0; i < values.size(); ++i) {
        ASSERT_EQ(codes[i], QuantizeNormalized(code.threshold.data(), normalized[i]))
            << i << " " << normalized[i];
      }
    }
  }
}

TEST(QuantBlocks, LayoutFollowsTheOffset) {
  EXPECT_EQ(QuantBlockCount(0, 0), 0u);
  EXPECT_EQ(QuantBlockCount(256, 0), 1u);
  EXPECT_EQ(QuantBlockCount(257, 0), 2u);
  EXPECT_EQ(QuantBlockCount(256, 1), 2u);
  EXPECT_EQ(QuantBlockCount(10, 250), 2u);
  EXPECT_EQ(QuantBlockAt(10, 250, 0).end, 6u);
  EXPECT_EQ(QuantBlockAt(10, 250, 1).begin, 6u);
  EXPECT_EQ(QuantBlockAt(10, 250, 1).end, 10u);
  EXPECT_EQ(QuantBlockAt(1000, 100, 1).begin, 156u);
  EXPECT_EQ(QuantBlockAt(1000, 100, 1).end, 412u);
}

// Values over seven decades with an outlier per block, and an all-zero block.
std::vector<float> MomentValues(Moment moment, size_t count, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::vector<float> values(count);
  for (size_t i = 0; i < count; ++i) {
    const float magnitude = std::pow(10.0f, -7.0f * std::fabs(unit(rng)));
    values[i] =
        moment == Moment::kExpAvg ? unit(rng) * magnitude : std::fabs(unit(rng)) * magnitude;
    if (i % 300 == 17) values[i] *= 50.0f;
  }
  for (size_t i = 512; i < std::min<size_t>(count, 768); ++i) values[i] = 0.0f;
  return values;
}

TEST(QuantizeMoments, RoundTripIsWithinTheStatedErrorOnEveryPath) {
  for (Moment moment : {Moment::kExpAvg, Moment::kExpAvgSq}) {
    const QuantCode& code = moment == Moment::kExpAvg ? kSignedCode : kUnsignedCode;
    for (size_t offset : {size_t{0}, size_t{37}}) {
      const size_t count = 3000;
      const std::vector<float> values = MomentValues(moment, count, 3);
      const size_t blocks = QuantBlockCount(count, offset);
      std::vector<uint8_t> reference_codes;
      std::vector<float> reference_scales;
      for (Isa isa : SupportedIsas()) {
        SCOPED_TRACE(IsaName(isa));
        RunOptions run;
        run.isa = isa;
        run.tile_elements = 1024;
        std::vector<uint8_t> codes(count);
        std::vector<float> scales(blocks), back(count);
        ASSERT_TRUE(
            QuantizeMoments(moment, values.data(), count, offset, codes.data(), scales.data(), run)
                .ok());
        ASSERT_TRUE(
            DequantizeMoments(moment, codes.data(), scales.data(), count, offset, back.data(), run)
                .ok());
        for (size_t b = 0; b < blocks; ++b) {
          const QuantBlockRange r = QuantBlockAt(count, offset, b);
          float absmax = 0.0f;
          for (size_t i = r.begin; i < r.end; ++i) absmax = std::max(absmax, std::fabs(values[i]));
          // exp_avg_sq is stored as its square root: the scale is sqrt(absmax), and an error
          // of e * sqrt(absmax) in the root is at most (2e + e^2) * absmax in the moment.
          const float e = MaxQuantError(code);
          const bool root = moment == Moment::kExpAvgSq;
          ASSERT_EQ(scales[b], root ? std::sqrt(absmax) : absmax) << b;
          const float bound = (root ? 2 * e + e * e : e) * absmax * (1 + 1e-5f);
          for (size_t i = r.begin; i < r.end; ++i) {
            ASSERT_LE(std::fabs(back[i] - values[i]), bound) << i;
            if (absmax == 0.0f) {
              ASSERT_EQ(back[i], 0.0f);
            }
          }
        }
        if (reference_codes.empty()) {
          reference_codes = codes;
          reference_scales = scales;
        } else {
          EXPECT_EQ(codes, reference_codes);
          EXPECT_EQ(scales, reference_scales);
        }
      }
    }
  }
}

// Every byte of both codes at every position of a 64-code group (the byte-permute path of
// avx512bf16 dequantizes 64 at once: group g holds code (p + g) mod 256 at position p, 256
// groups), then codes in the vector and scalar tails, dequantizes to value * scale (squared for
// exp_avg_sq) on every path this CPU has.
TEST(QuantizeMoments, EveryCodeDequantizesToItsValueOnEveryPath) {
  for (Moment moment : {Moment::kExpAvg, Moment::kExpAvgSq}) {
    const QuantCode& code = moment == Moment::kExpAvg ? kSignedCode : kUnsignedCode;
    for (size_t offset : {size_t{0}, size_t{37}}) {
      const size_t count = 64 * 256 + 16 + 5;
      std::vector<uint8_t> codes(count);
      for (size_t i = 0; i < count; ++i) codes[i] = static_cast<uint8_t>(i % 64 + i / 64);
      const size_t blocks = QuantBlockCount(count, offset);
      std::vector<float> scales(blocks);
      for (size_t b = 0; b < blocks; ++b) scales[b] = 0.75f + 0.5f * static_cast<float>(b);
      for (Isa isa : SupportedIsas()) {
        SCOPED_TRACE(std::string(IsaName(isa)) + " offset " + std::to_string(offset));
        RunOptions run;
        run.isa = isa;
        std::vector<float> back(count);
        ASSERT_TRUE(
            DequantizeMoments(moment, codes.data(), scales.data(), count, offset, back.data(), run)
                .ok());
        for (size_t b = 0; b < blocks; ++b) {
          const QuantBlockRange r = QuantBlockAt(count, offset, b);
          for (size_t i = r.begin; i < r.end; ++i) {
            const float x = code.value[codes[i]] * scales[b];
            const float expected = moment == Moment::kExpAvg ? x : x * x;
            ASSERT_EQ(std::bit_cast<uint32_t>(back[i]), std::bit_cast<uint32_t>(expected))
                << i << " code " << int{codes[i]};
          }
        }
      }
    }
  }
}

TEST(QuantizeMoments, RejectsWhatTheCodeCannotHold) {
  std::vector<float> values(10, 0.5f);
  std::vector<uint8_t> codes(10);
  std::vector<float> scales(2);
  values[3] = -1.0f;
  Status negative =
      QuantizeMoments(Moment::kExpAvgSq, values.data(), 10, 0, codes.data(), scales.data());
  EXPECT_EQ(negative.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(negative.ToString().find("element 3"), std::string::npos) << negative.ToString();
  EXPECT_TRUE(
      QuantizeMoments(Moment::kExpAvg, values.data(), 10, 0, codes.data(), scales.data()).ok());
  values[4] = NAN;
  EXPECT_EQ(
      QuantizeMoments(Moment::kExpAvg, values.data(), 10, 0, codes.data(), scales.data()).code(),
      StatusCode::kInvalidArgument);
  Status offset =
      QuantizeMoments(Moment::kExpAvg, values.data(), 10, 256, codes.data(), scales.data());
  EXPECT_EQ(offset.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(offset.ToString().find("allowed: [0, 256)"), std::string::npos);
  EXPECT_EQ(DequantizeMoments(Moment::kExpAvg, codes.data(), nullptr, 10, 0, values.data()).code(),
            StatusCode::kInvalidArgument);
}

// A chunk with int8 moments: master, gradient and copy as the fp32 tests, moments quantized from
// the same random values.
struct Int8Chunk {
  Int8Chunk(Kind kind, const ChunkLayout& chunk_layout, size_t elements, size_t offset,
            uint32_t seed)
      : layout(chunk_layout),
        count(elements),
        block_offset(offset),
        fp32(ChunkLayout{chunk_layout.grad, DType::kFloat32, chunk_layout.param_copy}, elements,
             seed),
        exp_avg(count),
        exp_avg_sq(count),
        exp_avg_scale(QuantBlockCount(count, offset)),
        exp_avg_sq_scale(QuantBlockCount(count, offset)) {
    auto* m = reinterpret_cast<float*>(fp32.exp_avg.data());
    auto* v = reinterpret_cast<float*>(fp32.exp_avg_sq.data());
    EXPECT_TRUE(
        QuantizeMoments(Moment::kExpAvg, m, count, offset, exp_avg.data(), exp_avg_scale.data())
            .ok());
    EXPECT_TRUE(QuantizeMoments(Moment::kExpAvgSq, v, count, offset, exp_avg_sq.data(),
                                exp_avg_sq_scale.data())
                    .ok());
    if (!UsesExpAvg(kind)) std::fill(exp_avg_scale.begin(), exp_avg_scale.end(), 0.0f);
  }

  ChunkBuffers buffers() {
    ChunkBuffers b = fp32.buffers();
    b.exp_avg = exp_avg.data();
    b.exp_avg_sq = exp_avg_sq.data();
    b.block_offset = block_offset;
    b.exp_avg_scale = exp_avg_scale.data();
    b.exp_avg_sq_scale = exp_avg_sq_scale.data();
    return b;
  }

  std::vector<std::byte> StateBytes() const {
    std::vector<std::byte> bytes = fp32.StateBytes();
    const auto append = [&](const void* data, size_t n) {
      const auto* p = static_cast<const std::byte*>(data);
      bytes.insert(bytes.end(), p, p + n);
    };
    append(exp_avg.data(), exp_avg.size());
    append(exp_avg_sq.data(), exp_avg_sq.size());
    append(exp_avg_scale.data(), exp_avg_scale.size() * 4);
    append(exp_avg_sq_scale.data(), exp_avg_sq_scale.size() * 4);
    return bytes;
  }

  ChunkLayout layout;
  size_t count;
  size_t block_offset;
  testing::TestChunk fp32;
  std::vector<uint8_t> exp_avg, exp_avg_sq;
  std::vector<float> exp_avg_scale, exp_avg_sq_scale;
};

std::vector<ChunkLayout> Int8Layouts() {
  std::vector<ChunkLayout> layouts;
  for (DType grad : kAllDTypes) {
    for (std::optional<DType> copy :
         {std::optional<DType>(), std::optional(DType::kBFloat16), std::optional(DType::kFloat16),
          std::optional(DType::kFloat32)}) {
      layouts.push_back(ChunkLayout{grad, DType::kInt8, copy});
    }
  }
  return layouts;
}

TEST(Int8Update, EveryPathMatchesTheScalarReferenceBitForBit) {
  const size_t count = 1000;  // blocks of 256 and a short one, vector tails
  for (Kind kind : kAllKinds) {
    for (const ChunkLayout& layout : Int8Layouts()) {
      for (size_t offset : {size_t{0}, size_t{200}}) {
        SCOPED_TRACE(std::string(KindName(kind)) + " grad " + std::string(DTypeName(layout.grad)) +
                     " offset " + std::to_string(offset));
        std::vector<std::byte> reference;
        for (Isa isa : SupportedIsas()) {
          Int8Chunk chunk(kind, layout, count, offset, 11);
          RunOptions run;
          run.isa = isa;
          run.tile_elements = 512;
          for (int64_t step = 1; step <= 3; ++step) {
            ASSERT_TRUE(
                UpdateChunk(DefaultHyper(kind), step, layout, chunk.buffers(), {0.5, 1.0}, run)
                    .ok());
          }
          if (reference.empty()) {
            reference = chunk.StateBytes();
          } else {
            EXPECT_TRUE(chunk.StateBytes() == reference) << IsaName(isa);
          }
        }
      }
    }
  }
}

// The fused int8 update tracks the fp32 one: after many steps from zero moments the masters
// differ by a small fraction of the distance they travelled.
TEST(Int8Update, TracksTheFp32Update) {
  const size_t count = 4096;
  for (Kind kind : kAllKinds) {
    SCOPED_TRACE(KindName(kind));
    const ChunkLayout f32{DType::kFloat32, DType::kFloat32, std::nullopt};
    const ChunkLayout i8{DType::kFloat32, DType::kInt8, std::nullopt};
    testing::TestChunk exact(f32, count, 5);
    Int8Chunk quantized(kind, i8, count, 0, 5);
    std::memset(exact.exp_avg.data(), 0, 4 * count);
    std::memset(exact.exp_avg_sq.data(), 0, 4 * count);
    std::fill(quantized.exp_avg_scale.begin(), quantized.exp_avg_scale.end(), 0.0f);
    std::fill(quantized.exp_avg_sq_scale.begin(), quantized.exp_avg_sq_scale.end(), 0.0f);
    std::vector<float> start(count);
    for (size_t i = 0; i < count; ++i) start[i] = exact.Master(i);
    std::mt19937 rng(9);
    std::normal_distribution<float> noise(0.0f, 1.0f);
    auto* grad_exact = reinterpret_cast<float*>(exact.grad.data());
    auto* grad_quantized = reinterpret_cast<float*>(quantized.fp32.grad.data());
    const HyperParams hyper = DefaultHyper(kind);
    for (int64_t step = 1; step <= 50; ++step) {
      // A gradient pulling each weight to 0, plus noise.
      for (size_t i = 0; i < count; ++i) {
        grad_exact[i] = exact.Master(i) + 0.1f * noise(rng);
        grad_quantized[i] = grad_exact[i] - exact.Master(i) + quantized.fp32.Master(i);
      }
      ASSERT_TRUE(UpdateChunk(hyper, step, f32, exact.buffers(), {}).ok());
      ASSERT_TRUE(UpdateChunk(hyper, step, i8, quantized.buffers(), {}).ok());
    }
    double travelled = 0.0, difference = 0.0;
    for (size_t i = 0; i < count; ++i) {
      travelled += std::fabs(exact.Master(i) - start[i]);
      difference += std::fabs(exact.Master(i) - quantized.fp32.Master(i));
    }
    EXPECT_GT(travelled, 0.0);
    EXPECT_LT(difference, 0.05 * travelled) << difference << " of " << travelled;
  }
}

// Splitting a chunk at a block boundary and updating the parts (with their own offsets and
// scales) gives the bytes of one update: the block grid and the scale indices agree.
TEST(Int8Update, SplitAtABlockBoundaryEqualsOneUpdate) {
  const size_t count = 900, offset = 100, split = 156 + 256;  // blocks [0,156) [156,412) ...
  const ChunkLayout layout{DType::kFloat32, DType::kInt8, std::nullopt};
  const HyperParams hyper = DefaultHyper(Kind::kAdamW);
  Int8Chunk whole(Kind::kAdamW, layout, count, offset, 4);
  Int8Chunk parts(Kind::kAdamW, layout, count, offset, 4);
  ASSERT_TRUE(UpdateChunk(hyper, 1, layout, whole.buffers(), {}).ok());
  ChunkBuffers first = parts.buffers();
  first.count = split;
  ChunkBuffers second = parts.buffers();
  second.master += split;
  second.grad = reinterpret_cast<const float*>(second.grad) + split;
  second.exp_avg = static_cast<uint8_t*>(second.exp_avg) + split;
  second.exp_avg_sq = static_cast<uint8_t*>(second.exp_avg_sq) + split;
  second.exp_avg_scale += 2;
  second.exp_avg_sq_scale += 2;
  second.block_offset = 0;
  second.count = count - split;
  ASSERT_TRUE(UpdateChunk(hyper, 1, layout, second, {}).ok());
  ASSERT_TRUE(UpdateChunk(hyper, 1, layout, first, {}).ok());
  EXPECT_TRUE(parts.StateBytes() == whole.StateBytes());
}

// Tiles only cut a chunk at block boundaries, whatever their size: tiles of one element, of a
// block and a half and of SIZE_MAX elements (which must not wrap when rounded to blocks), on the
// calling thread and on an executor, give the bytes of the default tiles.
TEST(Int8Update, AnyTileSizeGivesTheSameBytes) {
  const size_t count = 3000, offset = 100;
  const ChunkLayout layout{DType::kFloat32, DType::kInt8, std::nullopt};
  const HyperParams hyper = DefaultHyper(Kind::kAdamW);
  Int8Chunk reference(Kind::kAdamW, layout, count, offset, 9);
  ASSERT_TRUE(UpdateChunk(hyper, 1, layout, reference.buffers(), {}).ok());
  Executor executor(2);
  for (Executor* threads : {static_cast<Executor*>(nullptr), &executor}) {
    for (size_t tile : {size_t{1}, size_t{384}, SIZE_MAX}) {
      Int8Chunk chunk(Kind::kAdamW, layout, count, offset, 9);
      RunOptions run;
      run.executor = threads;
      run.tile_elements = tile;
      ASSERT_TRUE(UpdateChunk(hyper, 1, layout, chunk.buffers(), {}, run).ok());
      EXPECT_TRUE(chunk.StateBytes() == reference.StateBytes())
          << "tile " << tile << (threads != nullptr ? " on an executor" : "");
    }
  }
}

// The int8 block kernels write an fp32 parameter copy in their own pass: the master's bits.
TEST(Int8Update, Fp32CopyIsTheMasterWrittenInTheSamePass) {
  const size_t count = 700;
  const ChunkLayout layout{DType::kBFloat16, DType::kInt8, DType::kFloat32};
  for (Kind kind : kAllKinds) {
    for (Isa isa : SupportedIsas()) {
      SCOPED_TRACE(std::string(KindName(kind)) + " " + std::string(IsaName(isa)));
      Int8Chunk chunk(kind, layout, count, 30, 8);
      RunOptions run;
      run.isa = isa;
      ASSERT_TRUE(UpdateChunk(DefaultHyper(kind), 2, layout, chunk.buffers(), {}, run).ok());
      EXPECT_EQ(std::memcmp(chunk.fp32.copy.data(), chunk.fp32.master.data(), 4 * count), 0);
    }
  }
}

// The block kernels have ordinary stores only: the chooser never picks streaming for int8
// state, and a run asking for it gives the bytes of the default run. Fast arithmetic is taken.
TEST(Int8Update, StreamingStoresAreNotUsedAndFastArithmeticIsChosen) {
  const size_t count = 1000;
  const ChunkLayout layout{DType::kFloat32, DType::kInt8, DType::kFloat32};
  RunOptions streaming;
  streaming.stores = StoreMode::kStreaming;
  RunOptions fast_streaming = streaming;
  fast_streaming.arithmetic = Arithmetic::kFast;
  for (Kind kind : kAllKinds) {
    SCOPED_TRACE(KindName(kind));
    Int8Chunk plain(kind, layout, count, 0, 6);
    Int8Chunk asked(kind, layout, count, 0, 6);
    EXPECT_FALSE(ChooseUpdateVariant(kind, layout, asked.buffers(), streaming).streaming);
    const UpdateVariant variant =
        ChooseUpdateVariant(kind, layout, asked.buffers(), fast_streaming);
    EXPECT_TRUE(variant.fast);
    EXPECT_FALSE(variant.streaming);
    for (int64_t step = 1; step <= 3; ++step) {
      ASSERT_TRUE(UpdateChunk(DefaultHyper(kind), step, layout, plain.buffers(), {}).ok());
      ASSERT_TRUE(
          UpdateChunk(DefaultHyper(kind), step, layout, asked.buffers(), {}, streaming).ok());
    }
    EXPECT_TRUE(asked.StateBytes() == plain.StateBytes());
  }
  // fp32 state does take the variant asked for (the chooser is not stuck on exact).
  testing::TestChunk fp32({DType::kFloat32, DType::kFloat32, DType::kFloat32}, count, 6);
  EXPECT_TRUE(ChooseUpdateVariant(Kind::kAdamW, fp32.layout, fp32.buffers(), fast_streaming).fast);
}

// Fast arithmetic (Adam's reciprocal bias correction, quantization by the absmax's reciprocal):
// the same bytes on every path, and masters that stay close to exact arithmetic's.
TEST(Int8Update, FastArithmeticIsBitIdenticalAcrossPathsAndCloseToExact) {
  const size_t count = 1000;
  for (Kind kind : kAllKinds) {
    for (const ChunkLayout& layout :
         {ChunkLayout{DType::kFloat32, DType::kInt8, std::nullopt},
          ChunkLayout{DType::kBFloat16, DType::kInt8, DType::kBFloat16}}) {
      SCOPED_TRACE(std::string(KindName(kind)) + " grad " + std::string(DTypeName(layout.grad)));
      Int8Chunk exact(kind, layout, count, 100, 12);
      std::vector<float> start(count);
      for (size_t i = 0; i < count; ++i) start[i] = exact.fp32.Master(i);
      for (int64_t step = 1; step <= 5; ++step) {
        ASSERT_TRUE(UpdateChunk(DefaultHyper(kind), step, layout, exact.buffers(), {}).ok());
      }
      std::vector<std::byte> reference;
      for (Isa isa : SupportedIsas()) {
        Int8Chunk fast(kind, layout, count, 100, 12);
        RunOptions run;
        run.isa = isa;
        run.arithmetic = Arithmetic::kFast;
        for (int64_t step = 1; step <= 5; ++step) {
          ASSERT_TRUE(UpdateChunk(DefaultHyper(kind), step, layout, fast.buffers(), {}, run).ok());
        }
        if (reference.empty()) {
          reference = fast.StateBytes();
          double travelled = 0.0, difference = 0.0;
          for (size_t i = 0; i < count; ++i) {
            travelled += std::fabs(exact.fp32.Master(i) - start[i]);
            difference += std::fabs(exact.fp32.Master(i) - fast.fp32.Master(i));
          }
          EXPECT_GT(travelled, 0.0);
          EXPECT_LT(difference, 0.01 * travelled) << difference << " of " << travelled;
        } else {
          EXPECT_TRUE(fast.StateBytes() == reference) << IsaName(isa);
        }
      }
    }
  }
}

TEST(Int8Update, ChecksItsBuffers) {
  const ChunkLayout layout{DType::kFloat32, DType::kInt8, std::nullopt};
  Int8Chunk chunk(Kind::kAdamW, layout, 300, 0, 1);
  ChunkBuffers buffers = chunk.buffers();
  buffers.exp_avg_sq_scale = nullptr;
  Status missing = UpdateChunk(DefaultHyper(Kind::kAdamW), 1, layout, buffers, {});
  EXPECT_EQ(missing.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(missing.ToString().find("exp_avg_sq_scale"), std::string::npos);
  // Lion keeps no exp_avg_sq, so it needs no scale for it.
  EXPECT_TRUE(UpdateChunk(DefaultHyper(Kind::kLion), 1, layout, buffers, {}).ok());
  buffers = chunk.buffers();
  buffers.block_offset = 256;
  EXPECT_EQ(UpdateChunk(DefaultHyper(Kind::kAdamW), 1, layout, buffers, {}).code(),
            StatusCode::kInvalidArgument);
  const ChunkLayout int8_grad{DType::kInt8, DType::kInt8, std::nullopt};
  EXPECT_EQ(UpdateChunk(DefaultHyper(Kind::kAdamW), 1, int8_grad, chunk.buffers(), {}).code(),
            StatusCode::kInvalidArgument);
  const ChunkLayout int8_copy{DType::kFloat32, DType::kInt8, DType::kInt8};
  Status copy = UpdateChunk(DefaultHyper(Kind::kAdamW), 1, int8_copy, chunk.buffers(), {});
  EXPECT_EQ(copy.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(copy.ToString().find("param_copy dtype = int8 is not an element type the optimizer "
                                 "takes; allowed: fp32, bf16, fp16"),
            std::string::npos)
      << copy.ToString();
}

}  // namespace
}  // namespace zoe::optim
