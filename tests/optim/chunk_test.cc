// Description: chunk-level entry points: argument checks with clear errors, the gradient scan
// (inf/NaN, norm, clipping, loss scale), skipped steps leaving every byte untouched, and casts.
#include "optim/chunk.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "core/executor.h"
#include "optim_test_util.h"

namespace zoe::optim {
namespace {

using testing::TestChunk;

const ChunkLayout kF32Layout{DType::kFloat32, DType::kFloat32, std::nullopt};

void ExpectInvalid(const Status& status, const std::string& fragment) {
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status.ToString();
  EXPECT_NE(status.message().find(fragment), std::string_view::npos) << status.ToString();
}

TEST(HyperParamsCheck, RejectsOutOfRangeValuesNamingTheField) {
  const auto with = [](auto change) {
    HyperParams h;
    change(h);
    return ValidateHyperParams(h);
  };
  EXPECT_TRUE(with([](HyperParams&) {}).ok());
  ExpectInvalid(with([](HyperParams& h) { h.lr = -1e-3; }), "lr = ");
  ExpectInvalid(with([](HyperParams& h) { h.lr = NAN; }), "lr = ");
  ExpectInvalid(with([](HyperParams& h) { h.beta1 = 1.0; }), "beta1");
  ExpectInvalid(with([](HyperParams& h) { h.beta1 = -0.1; }), "beta1");
  ExpectInvalid(with([](HyperParams& h) { h.beta2 = 1.5; }), "beta2");
  ExpectInvalid(with([](HyperParams& h) { h.eps = 0.0; }), "eps");
  ExpectInvalid(with([](HyperParams& h) { h.eps = -1e-8; }), "eps");
  ExpectInvalid(with([](HyperParams& h) { h.weight_decay = -0.1; }), "weight_decay");
  ExpectInvalid(with([](HyperParams& h) { h.lr_decay = -1; }), "lr_decay");
  EXPECT_TRUE(with([](HyperParams& h) { h.kind = Kind::kLion, h.eps = 0; }).ok())
      << "Lion does not use eps";
  EXPECT_NE(with([](HyperParams& h) { h.beta2 = 1.0; }).message().find("[0, 1)"),
            std::string_view::npos);
}

TEST(UpdateChunkCheck, RejectsBadStepLayoutsAndMissingBuffers) {
  TestChunk chunk(kF32Layout, 8, 1);
  const HyperParams hyper;
  ExpectInvalid(UpdateChunk(hyper, 0, kF32Layout, chunk.buffers(), {}), "step 0");
  ExpectInvalid(
      UpdateChunk(hyper, 1, {DType::kFloat32, DType::kFloat16, std::nullopt}, chunk.buffers(), {}),
      "optimizer state dtype = fp16 is not an element type the optimizer takes; allowed: fp32, "
      "bf16, int8");
  ExpectInvalid(UpdateChunk(hyper, 1, {DType::kFloat32, DType::kFloat32, DType::kFloat32},
                            chunk.buffers(), {}),
                "param_copy buffer");
  ExpectInvalid(UpdateChunk(hyper, 1, {DType::kFloat32, DType::kFloat32, DType::kBFloat16},
                            chunk.buffers(), {}),
                "param_copy buffer");
  ExpectInvalid(UpdateChunk(hyper, 1, kF32Layout, chunk.buffers(), {0.0, 1.0}), "scale factor");
  ExpectInvalid(UpdateChunk(hyper, 1, kF32Layout, chunk.buffers(), {}, {.tile_elements = 0}),
                "tile_elements");
  for (int slot = 0; slot < 4; ++slot) {
    ChunkBuffers buffers = chunk.buffers();
    const char* names[] = {"master", "grad", "exp_avg buffer", "exp_avg_sq"};
    if (slot == 0) buffers.master = nullptr;
    if (slot == 1) buffers.grad = nullptr;
    if (slot == 2) buffers.exp_avg = nullptr;
    if (slot == 3) buffers.exp_avg_sq = nullptr;
    ExpectInvalid(UpdateChunk(hyper, 1, kF32Layout, buffers, {}), names[slot]);
  }
  // Adagrad keeps no exp_avg and Lion no exp_avg_sq: those may be null.
  ChunkBuffers no_avg = chunk.buffers();
  no_avg.exp_avg = nullptr;
  EXPECT_TRUE(UpdateChunk({.kind = Kind::kAdagrad}, 1, kF32Layout, no_avg, {}).ok());
  ChunkBuffers no_avg_sq = chunk.buffers();
  no_avg_sq.exp_avg_sq = nullptr;
  EXPECT_TRUE(UpdateChunk({.kind = Kind::kLion}, 1, kF32Layout, no_avg_sq, {}).ok());
  // An empty chunk needs no buffers at all.
  EXPECT_TRUE(UpdateChunk(hyper, 1, kF32Layout, ChunkBuffers{}, {}).ok());
}

TEST(UpdateChunkCheck, InvalidHyperParamsLeaveStateUntouched) {
  TestChunk chunk(kF32Layout, 33, 2);
  const auto before = chunk.StateBytes();
  HyperParams hyper;
  hyper.lr = -1;
  ExpectInvalid(UpdateChunk(hyper, 1, kF32Layout, chunk.buffers(), {}), "lr");
  EXPECT_TRUE(chunk.StateBytes() == before);
}

TEST(GradScanTest, SumOfSquaresAndNonFiniteDetection) {
  std::vector<float> grad = {3.0f, 4.0f, 0.0f, -12.0f};
  auto scan = ScanGradients(grad.data(), DType::kFloat32, grad.size());
  ASSERT_TRUE(scan.ok());
  EXPECT_EQ(scan->sum_squares, 169.0);
  EXPECT_TRUE(scan->finite());
  for (float bad : {INFINITY, -INFINITY, NAN}) {
    for (size_t at : {0ul, 3ul}) {
      std::vector<float> g = grad;
      g[at] = bad;
      auto s = ScanGradients(g.data(), DType::kFloat32, g.size());
      ASSERT_TRUE(s.ok());
      EXPECT_FALSE(s->finite()) << bad << " at " << at;
    }
  }
  // Values near fp32's maximum square to far below double's: no false positive.
  std::vector<float> huge(100, std::numeric_limits<float>::max());
  EXPECT_TRUE(ScanGradients(huge.data(), DType::kFloat32, huge.size())->finite());
  EXPECT_EQ(ScanGradients(nullptr, DType::kFloat32, 4).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(ScanGradients(nullptr, DType::kFloat32, 0)->sum_squares, 0.0);
}

TEST(GradScanTest, TileLargerThanAnyCountIsOneTile) {
  // A tile length near SIZE_MAX must not wrap the tile arithmetic, on one thread or several.
  std::vector<float> grad(1000);
  for (size_t i = 0; i < grad.size(); ++i) grad[i] = static_cast<float>(i % 7) - 3.0f;
  const double expected = ScanGradients(grad.data(), DType::kFloat32, grad.size())->sum_squares;
  Executor executor(2);
  for (Executor* threads : {static_cast<Executor*>(nullptr), &executor}) {
    RunOptions run;
    run.executor = threads;
    run.tile_elements = std::numeric_limits<size_t>::max();
    auto scan = ScanGradients(grad.data(), DType::kFloat32, grad.size(), run);
    ASSERT_TRUE(scan.ok()) << scan.status().ToString();
    EXPECT_EQ(scan->sum_squares, expected);
  }
}

TEST(GradScanTest, FindsNonFiniteHalfAndBfloatGradients) {
  for (DType type : {DType::kBFloat16, DType::kFloat16}) {
    TestChunk chunk({type, DType::kFloat32, std::nullopt}, 1000, 3);
    EXPECT_TRUE(ScanGradients(chunk.grad.data(), type, 1000)->finite());
    testing::PutElement(chunk.grad.data(), type, 999, NAN);
    EXPECT_FALSE(ScanGradients(chunk.grad.data(), type, 1000)->finite()) << DTypeName(type);
  }
}

TEST(StepScalingTest, UnscalesNormsAndClipsLikeTorch) {
  auto scaling = MakeStepScaling({25.0 * 64.0 * 64.0}, 64.0, 0.0);  // norm 5 after unscale
  ASSERT_TRUE(scaling.ok());
  EXPECT_FALSE(scaling->skip);
  EXPECT_DOUBLE_EQ(scaling->grad_norm, 5.0);
  EXPECT_DOUBLE_EQ(scaling->scaling.inv_loss_scale, 1.0 / 64.0);
  EXPECT_EQ(scaling->scaling.clip_factor, 1.0);
  auto clipped = MakeStepScaling({25.0}, 1.0, 1.0);
  EXPECT_DOUBLE_EQ(clipped->scaling.clip_factor, 1.0 / (5.0 + 1e-6));
  auto unclipped = MakeStepScaling({25.0}, 1.0, 10.0);
  EXPECT_EQ(unclipped->scaling.clip_factor, 1.0);
  auto skipped = MakeStepScaling({INFINITY}, 1.0, 1.0);
  EXPECT_TRUE(skipped->skip);
  ExpectInvalid(MakeStepScaling({1.0}, 0.0, 0.0).status(), "loss_scale");
  ExpectInvalid(MakeStepScaling({1.0}, 1.0, -1.0).status(), "max_grad_norm");
}

// The clip factor and loss scale are applied inside the fused step: an update with scaled
// gradients equals one with gradients pre-multiplied by the same fp32 factor.
TEST(StepChunkTest, ClipAndUnscaleAreFusedIntoTheUpdate) {
  const size_t n = 257;
  TestChunk fused(kF32Layout, n, 4, 0, 100.0f);
  TestChunk manual(kF32Layout, n, 4, 0, 100.0f);
  auto scan = ScanGradients(fused.grad.data(), DType::kFloat32, n);
  auto scaling = MakeStepScaling(*scan, 4.0, 0.5);
  ASSERT_TRUE(scaling.ok());
  ASSERT_LT(scaling->scaling.clip_factor, 1.0);
  auto outcome = StepChunk({}, 1, kF32Layout, fused.buffers(), 4.0, 0.5);
  ASSERT_TRUE(outcome.ok());
  EXPECT_FALSE(outcome->skip);
  const auto factor = static_cast<float>(0.25 * scaling->scaling.clip_factor);
  auto* g = reinterpret_cast<float*>(manual.grad.data());
  for (size_t i = 0; i < n; ++i) g[i] *= factor;
  ASSERT_TRUE(UpdateChunk({}, 1, kF32Layout, manual.buffers(), {}).ok());
  EXPECT_TRUE(fused.StateBytes() == manual.StateBytes());
}

TEST(StepChunkTest, NonFiniteGradientSkipsAndLeavesEveryByteUnchanged) {
  Executor executor(2);
  for (const ChunkLayout& layout : testing::AllLayouts()) {
    for (float bad : {INFINITY, NAN}) {
      TestChunk chunk(layout, 5000, 5);
      testing::PutElement(chunk.grad.data(), layout.grad, 4321, bad);
      const auto before = chunk.StateBytes();
      auto outcome = StepChunk({}, 1, layout, chunk.buffers(), 1024.0, 1.0,
                               {.executor = &executor, .tile_elements = 512});
      ASSERT_TRUE(outcome.ok()) << outcome.status().ToString();
      EXPECT_TRUE(outcome->skip);
      EXPECT_TRUE(std::isinf(outcome->grad_norm));
      EXPECT_TRUE(chunk.StateBytes() == before) << "state changed by a skipped step";
    }
  }
}

// zoe::DType has more element types than the kernels take: every field of a layout, and the
// gradient scan, refuse the others by name, listing the ones allowed there.
TEST(UpdateChunkCheck, RejectsElementTypesTheKernelsDoNotTake) {
  TestChunk chunk(kF32Layout, 8, 1);
  const HyperParams hyper;
  const std::string not_taken = " is not an element type the optimizer takes; allowed: ";
  const std::pair<ChunkLayout, std::string> cases[] = {
      {{DType::kFloat64, DType::kFloat32, std::nullopt},
       "gradient dtype = fp64" + not_taken + "fp32, bf16, fp16"},
      {{DType::kInt8, DType::kFloat32, std::nullopt},
       "gradient dtype = int8" + not_taken + "fp32, bf16, fp16"},
      {{DType::kFloat32, DType::kInt32, std::nullopt},
       "optimizer state dtype = int32" + not_taken + "fp32, bf16, int8"},
      {{DType::kFloat32, DType::kFloat32, DType::kUInt8},
       "param_copy dtype = uint8" + not_taken + "fp32, bf16, fp16"},
      {{DType::kFloat32, static_cast<DType>(200), std::nullopt},
       "optimizer state dtype = unknown (200)" + not_taken + "fp32, bf16, int8"},
  };
  for (const auto& [layout, message] : cases) {
    ExpectInvalid(UpdateChunk(hyper, 1, layout, chunk.buffers(), {}), message);
  }
  ExpectInvalid(ValidateLayout({DType::kFloat8E4M3, DType::kFloat32, std::nullopt}),
                "gradient dtype = fp8_e4m3");
  ExpectInvalid(StepChunk(hyper, 1, {DType::kFloat64, DType::kFloat32, std::nullopt},
                          chunk.buffers(), 1.0, 0.0)
                    .status(),
                "dtype = fp64");
  ExpectInvalid(ScanGradients(chunk.grad.data(), DType::kFloat64, 8).status(),
                "gradient scan dtype = fp64" + not_taken + "fp32, bf16, fp16");
  ExpectInvalid(ScanGradients(chunk.grad.data(), DType::kInt8, 8).status(),
                "gradient scan dtype = int8");
  for (DType grad : kAllDTypes) {
    for (DType state : kStateDTypes) {
      EXPECT_TRUE(ValidateLayout({grad, state, grad}).ok())
          << DTypeName(grad) << "/" << DTypeName(state);
    }
  }
}

TEST(CastTest, CastsRoundTripAndRejectBadArguments) {
  std::vector<float> src = {1.0f, -2.5f, 3.140625f, 65504.0f, 1e-8f};
  for (DType type : {DType::kBFloat16, DType::kFloat16}) {
    std::vector<uint16_t> half(src.size());
    ASSERT_TRUE(CastFromF32(src.data(), type, half.data(), src.size()).ok());
    std::vector<float> back(src.size());
    ASSERT_TRUE(CastToF32(half.data(), type, back.data(), src.size()).ok());
    for (size_t i = 0; i < 3; ++i) EXPECT_EQ(back[i], src[i]) << DTypeName(type);
  }
  ExpectInvalid(CastFromF32(src.data(), DType::kFloat32, nullptr, 1),
                "cast target dtype = fp32 is not an element type the optimizer takes; allowed: "
                "bf16, fp16");
  ExpectInvalid(CastToF32(src.data(), DType::kFloat32, nullptr, 1),
                "cast source dtype = fp32 is not an element type the optimizer takes; allowed: "
                "bf16, fp16");
  std::vector<uint16_t> half(src.size());
  ExpectInvalid(CastFromF32(src.data(), DType::kFloat64, half.data(), src.size()),
                "cast target dtype = fp64");
  ExpectInvalid(CastToF32(half.data(), DType::kInt32, src.data(), src.size()),
                "cast source dtype = int32");
  ExpectInvalid(CastToF32(half.data(), DType::kInt8, src.data(), src.size()),
                "cast source dtype = int8");
  ExpectInvalid(CastFromF32(nullptr, DType::kBFloat16, src.data(), 1), "null");
  ExpectInvalid(CastToF32(nullptr, DType::kFloat16, src.data(), 1), "null");
}

}  // namespace
}  // namespace zoe::optim
