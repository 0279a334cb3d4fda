// Description: the update variants beside the element types -- the fp32 parameter copy written in
// the update's pass, streaming (non-temporal) stores and fast arithmetic -- on every
// instruction-set path against the scalar reference, with odd sizes and unaligned views.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/executor.h"
#include "core/topology.h"
#include "optim/chunk.h"
#include "optim_test_util.h"

namespace zoe::optim {
namespace {

using testing::AllLayouts;
using testing::DefaultHyper;
using testing::SupportedIsas;
using testing::TestChunk;

constexpr size_t kCounts[] = {0, 1, 15, 17, 33, 1000, 4099};
constexpr size_t kOffsets[] = {0, 1, 3};

std::string Describe(Kind kind, const ChunkLayout& layout, size_t count, size_t offset) {
  return std::string(KindName(kind)) + " grad=" + std::string(DTypeName(layout.grad)) +
         " state=" + std::string(DTypeName(layout.state)) +
         " copy=" + (layout.param_copy ? std::string(DTypeName(*layout.param_copy)) : "none") +
         " count=" + std::to_string(count) + " offset=" + std::to_string(offset);
}

// Three steps with a changing learning rate and a gradient scale on `chunk`.
void RunSteps(Kind kind, TestChunk& chunk, const ChunkBuffers& buffers, const RunOptions& run) {
  HyperParams hyper = DefaultHyper(kind);
  for (int step = 1; step <= 3; ++step) {
    hyper.lr *= 0.5;
    const Status status =
        UpdateChunk(hyper, step, chunk.layout, buffers, {1.0 / 1024.0, 0.75}, run);
    ASSERT_TRUE(status.ok()) << status.ToString();
  }
}

std::vector<std::byte> StateAfterSteps(Kind kind, const ChunkLayout& layout, size_t count,
                                       size_t offset, const RunOptions& run) {
  TestChunk chunk(layout, count, static_cast<uint32_t>(count * 31 + offset), offset);
  RunSteps(kind, chunk, chunk.buffers(), run);
  return chunk.StateBytes();
}

// Distance in units in the last place between two finite floats of the same sign.
int64_t UlpDistance(float a, float b) {
  int32_t x, y;
  std::memcpy(&x, &a, 4);
  std::memcpy(&y, &b, 4);
  return std::llabs(static_cast<int64_t>(x) - static_cast<int64_t>(y));
}

class KernelVariants : public ::testing::TestWithParam<Kind> {};

// The fp32 copy holds the master's bits, and master and moments are those of an update without
// a copy: the fused write-back changes nothing else.
TEST_P(KernelVariants, Fp32CopyIsTheMasterWrittenInTheSamePass) {
  const Kind kind = GetParam();
  for (Isa isa : SupportedIsas()) {
    for (DType state : {DType::kFloat32, DType::kBFloat16}) {
      for (size_t count : kCounts) {
        for (size_t offset : kOffsets) {
          const ChunkLayout with_copy{DType::kFloat32, state, DType::kFloat32};
          const ChunkLayout without{DType::kFloat32, state, std::nullopt};
          TestChunk copied(with_copy, count, 11, offset);
          TestChunk plain(without, count, 11, offset);
          RunSteps(kind, copied, copied.buffers(), {.isa = isa});
          RunSteps(kind, plain, plain.buffers(), {.isa = isa});
          const std::string where =
              std::string(IsaName(isa)) + " " + Describe(kind, with_copy, count, offset);
          ASSERT_EQ(std::memcmp(copied.copy.data(), copied.master.data(), 4 * count), 0) << where;
          ASSERT_EQ(std::memcmp(copied.master.data(), plain.master.data(), 4 * count), 0) << where;
          const size_t state_bytes = DTypeSize(state) * count;
          ASSERT_EQ(std::memcmp(copied.exp_avg.data(), plain.exp_avg.data(), state_bytes), 0)
              << where;
          ASSERT_EQ(std::memcmp(copied.exp_avg_sq.data(), plain.exp_avg_sq.data(), state_bytes), 0)
              << where;
        }
      }
    }
  }
}

// Streaming stores write the same bytes as ordinary ones on every path, whatever the alignment
// of the views (the kernel steps element by element up to an aligned address).
TEST_P(KernelVariants, StreamingStoresWriteTheScalarReferenceBytes) {
  const Kind kind = GetParam();
  for (const ChunkLayout& layout : AllLayouts()) {
    for (size_t count : kCounts) {
      for (size_t offset : kOffsets) {
        const auto expected = StateAfterSteps(kind, layout, count, offset,
                                              {.isa = Isa::kScalar, .stores = StoreMode::kCached});
        for (Isa isa : SupportedIsas()) {
          const auto actual = StateAfterSteps(kind, layout, count, offset,
                                              {.isa = isa, .stores = StoreMode::kStreaming});
          ASSERT_TRUE(actual == expected)
              << IsaName(isa)
              << " streaming differs from scalar: " << Describe(kind, layout, count, offset);
        }
      }
    }
  }
}

// Views whose fp32 arrays are not congruent modulo 64 bytes cannot all be aligned at once; a
// streaming request then writes with ordinary stores (an unaligned non-temporal store would
// fault) and gives the same bytes.
TEST_P(KernelVariants, StreamingWithIncongruentViewsGivesTheSameBytes) {
  const Kind kind = GetParam();
  const ChunkLayout layout{DType::kFloat32, DType::kFloat32, DType::kFloat32};
  const size_t count = 4099;
  const auto run_with = [&](const RunOptions& run) {
    // Same seed and count: the same values, at element offsets 1 and 2 from a 64-byte boundary.
    TestChunk a(layout, count, 5, 1);
    TestChunk b(layout, count, 5, 2);
    ChunkBuffers buffers = a.buffers();
    buffers.exp_avg = b.exp_avg.data();
    buffers.exp_avg_sq = b.exp_avg_sq.data();
    RunSteps(kind, a, buffers, run);
    std::vector<std::byte> bytes = a.StateBytes();
    const std::vector<std::byte> moments = b.StateBytes();
    bytes.insert(bytes.end(), moments.begin(), moments.end());
    return bytes;
  };
  const auto expected = run_with({.isa = Isa::kScalar});
  for (Isa isa : SupportedIsas()) {
    EXPECT_TRUE(run_with({.isa = isa, .stores = StoreMode::kStreaming}) == expected)
        << IsaName(isa);
  }
}

// The kinds fast arithmetic changes: Adam and AdamW (it leaves the others as they are, which
// FastArithmeticStaysWithinTheStatedBoundOfExact checks bit for bit).
class FastKernelVariants : public KernelVariants {};

// Fast arithmetic is itself bit-identical across paths: the same correctly rounded operations.
TEST_P(FastKernelVariants, FastArithmeticIsIdenticalOnEveryPath) {
  const Kind kind = GetParam();
  for (const ChunkLayout& layout : AllLayouts()) {
    for (size_t count : kCounts) {
      for (size_t offset : kOffsets) {
        const RunOptions scalar{.isa = Isa::kScalar, .arithmetic = Arithmetic::kFast};
        const auto expected = StateAfterSteps(kind, layout, count, offset, scalar);
        for (Isa isa : SupportedIsas()) {
          for (StoreMode stores : {StoreMode::kCached, StoreMode::kStreaming}) {
            const auto actual =
                StateAfterSteps(kind, layout, count, offset,
                                {.isa = isa, .arithmetic = Arithmetic::kFast, .stores = stores});
            ASSERT_TRUE(actual == expected)
                << IsaName(isa)
                << " fast differs from scalar fast: " << Describe(kind, layout, count, offset);
          }
        }
      }
    }
  }
}

// Against exact arithmetic, one step at several step numbers: moments bit-identical; master
// within kFastMasterUlps (Adam, AdamW) wherever the step changed it by at most a quarter of its
// magnitude (the stated condition); everything bit-identical for the kinds fast arithmetic does
// not change.
TEST_P(KernelVariants, FastArithmeticStaysWithinTheStatedBoundOfExact) {
  const Kind kind = GetParam();
  const bool adam = kind == Kind::kAdam || kind == Kind::kAdamW;
  const ChunkLayout layout{DType::kFloat32, DType::kFloat32, std::nullopt};
  const size_t count = 100003;
  const HyperParams hyper = DefaultHyper(kind);
  for (Isa isa : SupportedIsas()) {
    for (int64_t step : {1, 5, 1000}) {
      TestChunk exact(layout, count, 3, 1);
      TestChunk fast(layout, count, 3, 1);
      std::vector<float> before(count);
      for (size_t i = 0; i < count; ++i) before[i] = exact.Master(i);
      ASSERT_TRUE(UpdateChunk(hyper, step, layout, exact.buffers(), {}, {.isa = isa}).ok());
      ASSERT_TRUE(UpdateChunk(hyper, step, layout, fast.buffers(), {},
                              {.isa = isa, .arithmetic = Arithmetic::kFast})
                      .ok());
      const std::string where = std::string(IsaName(isa)) + " step " + std::to_string(step);
      ASSERT_EQ(std::memcmp(exact.exp_avg.data(), fast.exp_avg.data(), 4 * count), 0) << where;
      ASSERT_EQ(std::memcmp(exact.exp_avg_sq.data(), fast.exp_avg_sq.data(), 4 * count), 0)
          << where;
      int64_t worst = 0;
      size_t differing = 0, checked = 0;
      for (size_t i = 0; i < count; ++i) {
        if (!adam) {
          worst = std::max(worst, UlpDistance(exact.Master(i), fast.Master(i)));
          continue;
        }
        if (std::fabs(exact.Master(i) - before[i]) > std::fabs(before[i]) / 4) continue;
        const int64_t ulps = UlpDistance(exact.Master(i), fast.Master(i));
        worst = std::max(worst, ulps);
        differing += ulps != 0;
        ++checked;
      }
      if (!adam) {
        EXPECT_EQ(worst, 0) << where << ": fast arithmetic changed " << KindName(kind);
        continue;
      }
      EXPECT_GT(checked, count * 9 / 10) << where;
      EXPECT_LE(worst, kFastMasterUlps) << where;
      // The reciprocal really is used: some weights differ (a guard against testing exact twice).
      EXPECT_GT(differing, 0u) << where;
    }
  }
}

// The update term alone (master 0, no decay): within kFastUpdateUlps of exact's.
TEST(KernelVariantsFast, UpdateTermWithinTheStatedUlpsOfExact) {
  const ChunkLayout layout{DType::kFloat32, DType::kFloat32, std::nullopt};
  const size_t count = 100003;
  HyperParams hyper = DefaultHyper(Kind::kAdamW);
  hyper.weight_decay = 0.0;
  for (Isa isa : SupportedIsas()) {
    TestChunk exact(layout, count, 9);
    TestChunk fast(layout, count, 9);
    std::memset(exact.master.data(), 0, 4 * count);
    std::memset(fast.master.data(), 0, 4 * count);
    for (int64_t step : {1, 7, 1000}) {
      ASSERT_TRUE(UpdateChunk(hyper, step, layout, exact.buffers(), {}, {.isa = isa}).ok());
      ASSERT_TRUE(UpdateChunk(hyper, step, layout, fast.buffers(), {},
                              {.isa = isa, .arithmetic = Arithmetic::kFast})
                      .ok());
      for (size_t i = 0; i < count; ++i) {
        ASSERT_LE(UlpDistance(exact.Master(i), fast.Master(i)), kFastUpdateUlps)
            << IsaName(isa) << " step " << step << " element " << i;
      }
      std::memset(exact.master.data(), 0, 4 * count);
      std::memset(fast.master.data(), 0, 4 * count);
    }
  }
}

std::string KindParamName(const ::testing::TestParamInfo<Kind>& param) {
  return std::string(KindName(param.param));
}

INSTANTIATE_TEST_SUITE_P(AllKinds, KernelVariants, ::testing::ValuesIn(kAllKinds), KindParamName);
INSTANTIATE_TEST_SUITE_P(FastKinds, FastKernelVariants,
                         ::testing::Values(Kind::kAdam, Kind::kAdamW), KindParamName);

// Many odd tiles on two threads, streaming forced and chosen automatically, fp32 copy: every tile
// starts unaligned, so every tile has its own scalar prologue.
TEST(KernelVariantsLarge, StreamingOnThreadsMatchesScalar) {
  const size_t count = (size_t{1} << 20) + 3;
  const ChunkLayout layout{DType::kBFloat16, DType::kFloat32, DType::kFloat32};
  Executor executor(2);
  const auto expected = StateAfterSteps(Kind::kAdamW, layout, count, 1, {.isa = Isa::kScalar});
  for (Isa isa : SupportedIsas()) {
    for (StoreMode stores : {StoreMode::kStreaming, StoreMode::kAuto}) {
      const auto actual = StateAfterSteps(
          Kind::kAdamW, layout, count, 1,
          {.executor = &executor, .isa = isa, .tile_elements = 4093, .stores = stores});
      ASSERT_TRUE(actual == expected) << IsaName(isa) << " stores " << static_cast<int>(stores);
    }
  }
}

TEST(ArithmeticNames, RoundTripAndUnknownNamesListTheAllowedOnes) {
  for (Arithmetic arithmetic : {Arithmetic::kExact, Arithmetic::kFast}) {
    auto parsed = ParseArithmetic(ArithmeticName(arithmetic));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, arithmetic);
  }
  auto bad = ParseArithmetic("approximate");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("allowed: exact, fast"), std::string::npos);
  EXPECT_NE(bad.status().message().find("approximate"), std::string::npos);
}

// hwloc's figure where it names a cache (on virtual machines sysconf may give the host's).
TEST(LastLevelCache, SizeIsTheTopologysOrTheStatedDefault) {
  EXPECT_GE(LastLevelCacheBytes(), 1u << 16);
  const Result<Topology> topology = SystemTopology();
  if (topology.ok() && topology->last_level_cache_bytes() > 0) {
    EXPECT_EQ(LastLevelCacheBytes(), topology->last_level_cache_bytes());
  }
}

// kAuto streams a pass whose reads exceed the last-level cache and caches one that fits; an
// explicit mode is kept whatever the bytes.
TEST(LastLevelCache, AutoStoresFollowThePassBytes) {
  const size_t cache = LastLevelCacheBytes();
  EXPECT_EQ(ResolveStores(StoreMode::kAuto, cache), StoreMode::kCached);
  EXPECT_EQ(ResolveStores(StoreMode::kAuto, cache + 1), StoreMode::kStreaming);
  for (size_t bytes : {size_t{0}, cache + 1}) {
    EXPECT_EQ(ResolveStores(StoreMode::kCached, bytes), StoreMode::kCached);
    EXPECT_EQ(ResolveStores(StoreMode::kStreaming, bytes), StoreMode::kStreaming);
  }
  // AdamW reads master, gradient and both moments; Adagrad one moment; bf16 halves what it holds.
  const ChunkLayout fp32{DType::kFloat32, DType::kFloat32, std::nullopt};
  const ChunkLayout bf16{DType::kBFloat16, DType::kBFloat16, std::nullopt};
  EXPECT_EQ(UpdateBytesRead(Kind::kAdamW, fp32, 10), 160u);
  EXPECT_EQ(UpdateBytesRead(Kind::kAdagrad, fp32, 10), 120u);
  EXPECT_EQ(UpdateBytesRead(Kind::kAdamW, bf16, 10), 100u);
}

}  // namespace
}  // namespace zoe::optim
