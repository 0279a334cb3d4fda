// Description: every instruction-set path and thread count gives the scalar reference's exact
// bytes, for every optimizer, dtype layout, odd size, tail and unaligned offset.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "core/executor.h"
#include "optim/chunk.h"
#include "optim_test_util.h"

namespace zoe::optim {
namespace {

using testing::AllLayouts;
using testing::DefaultHyper;
using testing::SupportedIsas;
using testing::TestChunk;

std::string Describe(Kind kind, const ChunkLayout& layout, size_t count, size_t offset) {
  return std::string(KindName(kind)) + " grad=" + std::string(DTypeName(layout.grad)) +
         " state=" + std::string(DTypeName(layout.state)) +
         " copy=" + (layout.param_copy ? std::string(DTypeName(*layout.param_copy)) : "none") +
         " count=" + std::to_string(count) + " offset=" + std::to_string(offset);
}

// Runs `steps` steps with a changing learning rate and a gradient scale, returns every state byte.
std::vector<std::byte> RunSteps(Kind kind, const ChunkLayout& layout, size_t count, size_t offset,
                                const RunOptions& run, int steps = 3) {
  TestChunk chunk(layout, count, /*seed=*/static_cast<uint32_t>(count * 31 + offset), offset);
  HyperParams hyper = DefaultHyper(kind);
  for (int step = 1; step <= steps; ++step) {
    hyper.lr *= 0.5;
    const GradScaling scaling{1.0 / 1024.0, 0.75};
    Status status = UpdateChunk(hyper, step, layout, chunk.buffers(), scaling, run);
    EXPECT_TRUE(status.ok()) << status.ToString();
  }
  return chunk.StateBytes();
}

class IsaParity : public ::testing::TestWithParam<Kind> {};

TEST_P(IsaParity, EveryPathMatchesScalarBitForBit) {
  const Kind kind = GetParam();
  for (const ChunkLayout& layout : AllLayouts()) {
    for (size_t count : {0ul, 1ul, 15ul, 17ul, 33ul, 1000ul}) {
      for (size_t offset : {0ul, 1ul, 3ul}) {
        const auto expected = RunSteps(kind, layout, count, offset, {.isa = Isa::kScalar});
        for (Isa isa : SupportedIsas()) {
          const auto actual = RunSteps(kind, layout, count, offset, {.isa = isa});
          ASSERT_TRUE(actual == expected)
              << IsaName(isa) << " differs from scalar: " << Describe(kind, layout, count, offset);
        }
      }
    }
  }
}

std::string KindParamName(const ::testing::TestParamInfo<Kind>& param) {
  return std::string(KindName(param.param));
}

INSTANTIATE_TEST_SUITE_P(AllKinds, IsaParity, ::testing::ValuesIn(kAllKinds), KindParamName);

// The paths the tests above cover are the ones this machine has; ZOE_REQUIRE_ISAS (a comma list
// of IsaName spellings; scripts/run-tests.sh names those of the machines CI runs on) makes a
// machine that would cover fewer fail here instead of passing silently. Scalar is always covered.
TEST(IsaParityCoverage, EveryRequiredPathIsCovered) {
  const std::vector<Isa> covered = SupportedIsas();
  std::string names;
  for (const Isa isa : covered) names += std::string(names.empty() ? "" : ",") += IsaName(isa);
  RecordProperty("isas_covered", names);
  EXPECT_NE(std::find(covered.begin(), covered.end(), Isa::kScalar), covered.end());
  const char* required = std::getenv("ZOE_REQUIRE_ISAS");
  std::string_view rest = required != nullptr ? required : "";
  while (!rest.empty()) {
    const size_t comma = rest.find(',');
    const std::string_view name = rest.substr(0, comma);
    rest = comma == std::string_view::npos ? "" : rest.substr(comma + 1);
    Result<Isa> isa = ParseIsa(name);
    ASSERT_TRUE(isa.ok()) << isa.status().ToString();
    EXPECT_NE(std::find(covered.begin(), covered.end(), *isa), covered.end())
        << "ZOE_REQUIRE_ISAS names " << name << ", which this machine lacks (covered: " << names
        << ")";
  }
}

// A large odd size crosses many tiles, on several threads, with a tail in the last tile.
TEST(IsaParityLarge, MillionPlusThreeOnThreadsMatchesScalar) {
  const size_t count = (size_t{1} << 20) + 3;
  Executor executor(2);
  for (const ChunkLayout& layout :
       {ChunkLayout{DType::kFloat32, DType::kFloat32, std::nullopt},
        ChunkLayout{DType::kFloat16, DType::kBFloat16, DType::kBFloat16}}) {
    const auto expected = RunSteps(Kind::kAdamW, layout, count, 1,
                                   {.isa = Isa::kScalar, .tile_elements = 4096}, /*steps=*/1);
    for (Isa isa : SupportedIsas()) {
      if (isa == Isa::kScalar) continue;
      const auto actual =
          RunSteps(Kind::kAdamW, layout, count, 1,
                   {.executor = &executor, .isa = isa, .tile_elements = 4093}, /*steps=*/1);
      ASSERT_TRUE(actual == expected)
          << IsaName(isa) << " differs: " << Describe(Kind::kAdamW, layout, count, 1);
    }
  }
}

// The gradient sum of squares is defined lane by lane, so paths, thread counts and offsets agree
// exactly for a given tile size.
TEST(IsaParityScan, SumOfSquaresIsIdenticalOnEveryPath) {
  Executor executor(2);
  for (DType grad : kAllDTypes) {
    for (size_t count : {0ul, 1ul, 7ul, 17ul, 63ul, 64ul, 65ul, 129ul, 100003ul}) {
      TestChunk chunk({grad, DType::kFloat32, std::nullopt}, count, 7, 1, 100.0f);
      auto expected = ScanGradients(chunk.grad.data(), grad, count,
                                    {.isa = Isa::kScalar, .tile_elements = 1000});
      ASSERT_TRUE(expected.ok());
      for (Isa isa : SupportedIsas()) {
        auto actual = ScanGradients(chunk.grad.data(), grad, count,
                                    {.executor = &executor, .isa = isa, .tile_elements = 1000});
        ASSERT_TRUE(actual.ok());
        EXPECT_EQ(actual->sum_squares, expected->sum_squares)
            << IsaName(isa) << " " << DTypeName(grad) << " count=" << count;
      }
    }
  }
}

// The sum of squares written as its definition reads (kernel_math.h, SumSquares): the call's
// range read as two streams, the first `half` elements (half the range rounded down to a multiple
// of 32) and the rest; element k of stream s to lane k % 8 of accumulator 2s + (k / 16) % 2; the
// lanes, then the chains, added in pairs.
double DefinedSumOfSquares(const float* grad, size_t count) {
  const size_t half = count / 2 / 32 * 32;
  double lanes[4][8] = {};
  for (size_t j = 0; j < count; ++j) {
    const size_t stream = j < half ? 0 : 1;
    const size_t k = j - stream * half;
    const double x = grad[j];
    lanes[2 * stream + (k / 16) % 2][k % 8] += x * x;
  }
  double chains[4];
  for (size_t c = 0; c < 4; ++c) {
    const double* l = lanes[c];
    chains[c] = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
  }
  return (chains[0] + chains[1]) + (chains[2] + chains[3]);
}

// Every path adds in the defined order, whatever the length of a tile (around the streams' split
// and the vectors' widths) and wherever it starts.
TEST(IsaParityScan, SumOfSquaresFollowsItsDefinitionOnEveryPath) {
  std::vector<float> grad(100003);
  for (size_t i = 0; i < grad.size(); ++i) {
    const float magnitude = 1.0f / static_cast<float>(1 + (i * 2654435761u) % 9973);
    grad[i] = i % 3 == 0 ? -magnitude * 1e4f : magnitude;
  }
  for (size_t tile : {1ul, 31ul, 32ul, 33ul, 63ul, 64ul, 65ul, 95ul, 96ul, 127ul, 129ul, 1000ul,
                      4099ul, 100003ul}) {
    double expected = 0.0;  // ScanGradients adds one partial per tile, in tile order
    for (size_t begin = 0; begin < grad.size(); begin += tile) {
      expected += DefinedSumOfSquares(grad.data() + begin, std::min(tile, grad.size() - begin));
    }
    for (Isa isa : SupportedIsas()) {
      auto actual = ScanGradients(grad.data(), DType::kFloat32, grad.size(),
                                  {.isa = isa, .tile_elements = tile});
      ASSERT_TRUE(actual.ok());
      EXPECT_EQ(actual->sum_squares, expected) << IsaName(isa) << " tile=" << tile;
    }
  }
}

}  // namespace
}  // namespace zoe::optim
