// Covers the step plan (step_plan.h): the pipeline order with reads started ahead first, the
// direction, the reads released, and what a speculation commit leaves to update or makes live.
#include <gtest/gtest.h>

#include <vector>

#include "offload/optimizer/step_plan.h"

namespace zoe::offload {
namespace {

using Chunks = std::vector<size_t>;

TEST(StepPlanTest, PipelineOrderPutsPrefetchedCandidatesFirst) {
  const Chunks prefetched = {3, 0, 5};
  const Chunks candidates = {0, 1, 2, 3};
  EXPECT_EQ(PipelineOrder(prefetched, candidates, 6), (Chunks{3, 0, 1, 2}));
  EXPECT_EQ(PipelineOrder({}, candidates, 6), candidates);
}

TEST(StepPlanTest, ChunksInDirection) {
  const std::vector<bool> wanted = {true, false, true, true, true};  // chunk 4 is HOST
  EXPECT_EQ(ChunksInDirection(wanted, 4, false), (Chunks{0, 2, 3}));
  EXPECT_EQ(ChunksInDirection(wanted, 4, true), (Chunks{3, 2, 0}));
}

TEST(StepPlanTest, PlainStepVisitsPresentChunksAndReleasesAbsentReads) {
  StepPlanInputs in;
  in.nvme_count = 4;
  in.present = {true, false, true, true, true, false};
  in.descending = true;
  in.prefetched = {1, 2};
  const StepPlan plan = PlanStep(in);
  EXPECT_EQ(plan.update, in.present);
  EXPECT_EQ(plan.release, (Chunks{1}));
  EXPECT_EQ(plan.nvme_order, (Chunks{2, 3, 0}));
  EXPECT_TRUE(plan.nvme_commit.empty());
  EXPECT_EQ(plan.host_order, (Chunks{4}));
  EXPECT_EQ(plan.host_commit, std::vector<bool>(6, false));
}

TEST(StepPlanTest, CommitUpdatesOnlyWhatSpeculationDidNot) {
  StepPlanInputs in;
  in.nvme_count = 3;
  in.present = {true, true, true, true, true};
  in.speculated = {true, false, true, false, true};
  in.commit = true;
  in.prefetched = {0, 1};
  const StepPlan plan = PlanStep(in);
  EXPECT_EQ(plan.update, (std::vector<bool>{false, true, false, true, false}));
  EXPECT_EQ(plan.release, (Chunks{0}));
  EXPECT_EQ(plan.nvme_order, (Chunks{1}));
  EXPECT_EQ(plan.nvme_commit, (Chunks{0, 2}));
  EXPECT_EQ(plan.host_order, (Chunks{4, 3}));
  EXPECT_EQ(plan.host_commit, (std::vector<bool>{false, false, false, false, true}));
}

TEST(StepPlanTest, RecomputeIgnoresSpeculation) {
  StepPlanInputs in;
  in.nvme_count = 2;
  in.present = {true, true, true};
  in.speculated = {true, true, true};
  in.commit = false;
  const StepPlan plan = PlanStep(in);
  EXPECT_EQ(plan.update, in.present);
  EXPECT_EQ(plan.nvme_order, (Chunks{0, 1}));
  EXPECT_TRUE(plan.nvme_commit.empty());
  EXPECT_EQ(plan.host_order, (Chunks{2}));
}

TEST(StepPlanTest, WithoutSpeculated) {
  EXPECT_EQ(WithoutSpeculated({true, true, false}, {false, true, true}),
            (std::vector<bool>{true, false, false}));
  EXPECT_EQ(WithoutSpeculated({true, true}, {}), (std::vector<bool>{true, true}));
}

}  // namespace
}  // namespace zoe::offload
