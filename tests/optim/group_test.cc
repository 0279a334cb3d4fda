// Description: Group, the in-memory parameter group: owned zeroed state, a step counter that
// skipped steps do not advance, per-call hyper-parameters and argument checks.
#include "optim/group.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "core/executor.h"
#include "optim_test_util.h"

namespace zoe::optim {
namespace {

TEST(GroupTest, StepsMatchTheChunkEntryPointAndCountSteps) {
  Executor executor(2);
  const ChunkLayout layout{DType::kBFloat16, DType::kBFloat16, DType::kBFloat16};
  const size_t n = 10007;
  auto group = Group::Create({.kind = Kind::kAdamW,
                              .layout = layout,
                              .count = n,
                              .run = {.executor = &executor, .tile_elements = 1024}});
  ASSERT_TRUE(group.ok()) << group.status().ToString();
  testing::TestChunk via_group(layout, n, 9);
  testing::TestChunk via_chunks(layout, n, 9);
  std::memset(via_chunks.exp_avg.data(), 0, 2 * n);  // a new group's state is zero
  std::memset(via_chunks.exp_avg_sq.data(), 0, 2 * n);
  HyperParams hyper = testing::DefaultHyper(Kind::kAdamW);
  for (int step = 1; step <= 3; ++step) {
    hyper.lr = 1e-3 / step;
    auto outcome = (*group)->Step(hyper, reinterpret_cast<float*>(via_group.master.data()),
                                  via_group.grad.data(), via_group.copy.data(), 2.0);
    ASSERT_TRUE(outcome.ok());
    ASSERT_TRUE(UpdateChunk(hyper, step, layout, via_chunks.buffers(), {0.5, 1.0}).ok());
  }
  EXPECT_EQ((*group)->steps_taken(), 3);
  EXPECT_EQ(std::memcmp(via_group.master.data(), via_chunks.master.data(), 4 * n), 0);
  EXPECT_EQ(std::memcmp((*group)->exp_avg(), via_chunks.exp_avg.data(), 2 * n), 0);
  EXPECT_EQ(std::memcmp((*group)->exp_avg_sq(), via_chunks.exp_avg_sq.data(), 2 * n), 0);
  EXPECT_EQ(std::memcmp(via_group.copy.data(), via_chunks.copy.data(), 2 * n), 0);
}

TEST(GroupTest, SkippedStepDoesNotAdvanceTheCounter) {
  auto group = Group::Create({.kind = Kind::kLion, .count = 64});
  ASSERT_TRUE(group.ok());
  EXPECT_EQ((*group)->exp_avg_sq(), nullptr);  // Lion keeps one moment
  std::vector<float> master(64, 1.0f), grad(64, 0.5f);
  HyperParams hyper = testing::DefaultHyper(Kind::kLion);
  ASSERT_FALSE((*group)->Step(hyper, master.data(), grad.data())->skip);
  grad[10] = NAN;
  const std::vector<float> before = master;
  auto skipped = (*group)->Step(hyper, master.data(), grad.data());
  ASSERT_TRUE(skipped.ok());
  EXPECT_TRUE(skipped->skip);
  EXPECT_EQ(master, before);
  EXPECT_EQ((*group)->steps_taken(), 1);
  EXPECT_EQ((*group)->steps_skipped(), 1);
}

// A Group keeps fp32 or bf16 moments and checks its whole layout when created.
TEST(GroupTest, CreateRejectsElementTypesItDoesNotTake) {
  const std::string not_taken = " is not an element type the optimizer takes; allowed: ";
  const std::pair<ChunkLayout, std::string> cases[] = {
      {{DType::kFloat32, DType::kInt8, std::nullopt}, "optimizer state dtype = int8"},
      {{DType::kFloat32, DType::kInt32, std::nullopt}, "optimizer state dtype = int32"},
      {{DType::kFloat64, DType::kFloat32, std::nullopt}, "gradient dtype = fp64"},
      {{DType::kFloat32, DType::kBFloat16, DType::kBool}, "param_copy dtype = bool"},
  };
  const std::string allowed[] = {"fp32, bf16", "fp32, bf16, int8", "fp32, bf16, fp16",
                                 "fp32, bf16, fp16"};
  for (size_t i = 0; i < std::size(cases); ++i) {
    const Status status = Group::Create({.layout = cases[i].first, .count = 4}).status();
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(status.message(), cases[i].second + not_taken + allowed[i]);
  }
}

TEST(GroupTest, RejectsBadOptionsAndMismatchedCalls) {
  EXPECT_EQ(Group::Create({.layout = {DType::kFloat32, DType::kFloat16, std::nullopt}, .count = 4})
                .status()
                .code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(Group::Create({.count = 4, .run = {.tile_elements = 0}}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(Group::Create({.count = SIZE_MAX / 2}).status().code(), StatusCode::kInvalidArgument);
  auto group = Group::Create({.kind = Kind::kAdam, .count = 4, .max_grad_norm = 1.0});
  ASSERT_TRUE(group.ok());
  std::vector<float> master(4), grad(4);
  EXPECT_EQ((*group)->Step({.kind = Kind::kAdamW}, master.data(), grad.data()).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(
      (*group)->Step({.kind = Kind::kAdam, .lr = -1}, master.data(), grad.data()).status().code(),
      StatusCode::kInvalidArgument);
  EXPECT_EQ((*group)
                ->Step({.kind = Kind::kAdam}, master.data(), grad.data(), nullptr, 0.0)
                .status()
                .code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ((*group)->steps_taken(), 0);
}

}  // namespace
}  // namespace zoe::optim
