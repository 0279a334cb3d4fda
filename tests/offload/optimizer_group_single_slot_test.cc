// Description: OptimizerGroup with one slot per NVMe chunk (state updated in place) — the same
// bits as two slots over several steps with a DRAM/NVMe mix and checksums on, half the NVMe
// space, and under fault injection: a step that fails after its first write is reported, every
// later step, read and write refuses, and loading a checkpoint makes the group usable again; a
// failure before any write leaves it usable.
#include <gtest/gtest.h>

#include <limits>
#include <string>
#include <vector>

#include "offload/engine_setup.h"
#include "offload/optimizer/chunk_update.h"
#include "offload/optimizer/optimizer_group.h"
#include "tests/offload/optimizer_group_harness.h"
#include "tests/offload/temp_dir.h"

namespace zoe::offload {
namespace {

using testing::GroupHarness;
using testing::HarnessOptions;
using testing::LoadFrom;
using testing::Reference;
using testing::SaveTo;
using testing::TempDir;

// 7 chunks, 5 of them on NVMe, checksums hashed in the update's stripes.
HarnessOptions MixedOptions(uint32_t slots) {
  HarnessOptions options;
  options.checksum_block = kStripeChecksumBlock;
  options.threads = 2;
  options.group.slots = slots;
  options.group.nvme_ratio = 0.7;
  return options;
}

HarnessOptions FaultyOptions() {
  HarnessOptions options = MixedOptions(1);
  options.inject_faults = true;
  options.group.nvme_ratio = 1.0;
  return options;
}

// Steps both harnesses (and the reference) with the same gradients; step 3 goes through
// AccumulateGrad, step 4 has a non-finite gradient and is skipped.
void StepBoth(GroupHarness& one, GroupHarness& two, Reference& reference, int step) {
  one.NewGradients(step);
  two.NewGradients(step);
  if (step == 4) {
    one.PoisonGradient(17, std::numeric_limits<float>::quiet_NaN());
    two.PoisonGradient(17, std::numeric_limits<float>::quiet_NaN());
  }
  Result<StepReport> a = step == 3 && one.AccumulateAll() ? one.StepAccumulated(one.Hyper(step))
                                                          : one.Step(one.Hyper(step));
  Result<StepReport> b = two.Step(two.Hyper(step));
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  EXPECT_EQ(a->skipped, step == 4);
  EXPECT_EQ(a->bytes_written, b->bytes_written);
  if (!a->skipped) {
    ASSERT_TRUE(reference.Step(one.Hyper(step), one));
  }
}

TEST(OptimizerGroupSingleSlotTest, StepsAreBitIdenticalToTwoSlots) {
  GroupHarness one(MixedOptions(1));
  GroupHarness two(MixedOptions(2));
  ASSERT_TRUE(one.ok() && two.ok());
  ASSERT_EQ(one.group().nvme_chunk_count(), 5u);
  ASSERT_LT(one.group().nvme_chunk_count(), one.group().chunk_count());
  Reference reference(one);
  for (int step = 0; step < 6; ++step) {
    StepBoth(one, two, reference, step);
    EXPECT_EQ(one.Snapshot(), two.Snapshot()) << "after step " << step;
    EXPECT_TRUE(one.params_bytes() == two.params_bytes()) << "after step " << step;
  }
  one.ExpectMatches(reference);
  EXPECT_EQ(one.group().steps_taken(), 5);
  EXPECT_TRUE(one.group().broken().ok());
}

TEST(OptimizerGroupSingleSlotTest, ReservesHalfTheNvmeBytes) {
  GroupHarness one(MixedOptions(1));
  GroupHarness two(MixedOptions(2));
  ASSERT_TRUE(one.ok() && two.ok());
  const uint64_t used_one = one.swap().capacity() - one.swap().free_bytes();
  const uint64_t used_two = two.swap().capacity() - two.swap().free_bytes();
  EXPECT_GT(used_one, 0u);
  EXPECT_EQ(2 * used_one, used_two);
  EXPECT_EQ(2 * one.group().nvme_bytes(), two.group().nvme_bytes());
  EXPECT_EQ(one.group().nvme_bytes(), used_one);
  EXPECT_EQ(2 * GroupSwapBytes(one.group_options(), 4096),
            GroupSwapBytes(two.group_options(), 4096));
}

TEST(OptimizerGroupSingleSlotTest, SlotsOtherThanOneOrTwoAreRefused) {
  GroupHarness harness(MixedOptions(2), /*create=*/false);
  ASSERT_TRUE(harness.ok());
  OptimizerGroupOptions options = harness.group_options();
  options.slots = 3;
  Result<std::unique_ptr<OptimizerGroup>> group = harness.CreateGroup(options);
  ASSERT_FALSE(group.ok());
  EXPECT_EQ(group.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(group.status().ToString().find("slots 3 is out of range; allowed: 1"),
            std::string::npos)
      << group.status().ToString();
}

// Every call that reads or changes the state refuses, naming the first failure.
void ExpectRefusesWork(GroupHarness& harness, std::string_view first_failure) {
  OptimizerGroup& group = harness.group();
  ASSERT_FALSE(group.broken().ok());
  std::vector<Status> refusals;
  refusals.push_back(harness.Step(harness.Hyper(9)).status());
  std::vector<float> values(10);
  refusals.push_back(group.ReadState(StateSlot::kMaster, 0, values));
  refusals.push_back(group.WriteState(StateSlot::kExpAvg, 0, values));
  refusals.push_back(group.AccumulateGrad(0, harness.grad_views()[0]));
  TempDir dir;
  refusals.push_back(SaveTo(dir.File("ckpt"), group));
  for (const Status& refused : refusals) {
    EXPECT_EQ(refused.code(), StatusCode::kFailedPrecondition) << refused.ToString();
    const std::string text = refused.ToString();
    EXPECT_NE(text.find("load a checkpoint"), std::string::npos) << text;
    EXPECT_NE(text.find(first_failure), std::string::npos) << text;
  }
}

// A single-slot group after two steps, a checkpoint of it, and the reference at that point.
struct Checkpointed {
  explicit Checkpointed(const HarnessOptions& options) : harness(options), reference(harness) {
    for (int step = 0; step < 2; ++step) {
      harness.NewGradients(step);
      EXPECT_TRUE(harness.Step(harness.Hyper(step)).ok());
      EXPECT_TRUE(reference.Step(harness.Hyper(step), harness));
    }
    EXPECT_TRUE(SaveTo(dir.File("ckpt"), harness.group()).ok());
  }
  // Loads the checkpoint, then steps 2 and 3 must match the reference bit for bit.
  void ExpectRecovers() {
    Status loaded = LoadFrom(dir.File("ckpt"), harness.group());
    ASSERT_TRUE(loaded.ok()) << loaded.ToString();
    EXPECT_TRUE(harness.group().broken().ok());
    EXPECT_EQ(harness.group().steps_taken(), 2);
    for (int step = 2; step < 4; ++step) {
      harness.NewGradients(step);
      Result<StepReport> stepped = harness.Step(harness.Hyper(step));
      ASSERT_TRUE(stepped.ok()) << stepped.status().ToString();
      ASSERT_TRUE(reference.Step(harness.Hyper(step), harness));
    }
    harness.ExpectMatches(reference);
  }
  TempDir dir;
  GroupHarness harness;
  Reference reference;
};

TEST(OptimizerGroupSingleSlotTest, WriteFailureMidStepBreaksTheGroupUntilACheckpointLoads) {
  Checkpointed c(FaultyOptions());
  ASSERT_TRUE(c.harness.ok());
  // The third chunk's write fails with EIO: two chunks are already updated in place.
  c.harness.FailOnce(io::FaultKind::kEio, io::FaultOps::kWrites, 3);
  c.harness.NewGradients(2);
  Result<StepReport> failed = c.harness.Step(c.harness.Hyper(2));
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), StatusCode::kIoError) << failed.status().ToString();
  EXPECT_EQ(c.harness.faults()->injected(), 1u);
  EXPECT_EQ(c.harness.group().steps_taken(), 2);
  ExpectRefusesWork(c.harness, "optimizer group 'g': chunk 2");
  c.ExpectRecovers();
}

TEST(OptimizerGroupSingleSlotTest, ChecksumMismatchAfterTheFirstWriteBreaksTheGroup) {
  Checkpointed c(FaultyOptions());
  ASSERT_TRUE(c.harness.ok());
  // The three pipeline buffers still hold the chunks the last step wrote, so the step starts with
  // them and reads only once a buffer's write is done: its second read comes back damaged after
  // chunks were written in place.
  c.harness.FailOnce(io::FaultKind::kCorruption, io::FaultOps::kReads, 2);
  c.harness.NewGradients(2);
  Result<StepReport> failed = c.harness.Step(c.harness.Hyper(2));
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), StatusCode::kCorruption) << failed.status().ToString();
  ExpectRefusesWork(c.harness, "checksum mismatch");
  c.ExpectRecovers();
}

TEST(OptimizerGroupSingleSlotTest, FailureBeforeAnyWriteLeavesTheGroupUsable) {
  Checkpointed c(FaultyOptions());
  ASSERT_TRUE(c.harness.ok());
  // A load leaves nothing cached, so the step's first read is of the first chunk it updates.
  ASSERT_TRUE(LoadFrom(c.dir.File("ckpt"), c.harness.group()).ok());
  c.harness.FailOnce(io::FaultKind::kEio, io::FaultOps::kReads, 1);
  c.harness.NewGradients(2);
  Result<StepReport> failed = c.harness.Step(c.harness.Hyper(2));
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), StatusCode::kIoError);
  EXPECT_TRUE(c.harness.group().broken().ok()) << c.harness.group().broken().ToString();
  Result<StepReport> retried = c.harness.Step(c.harness.Hyper(2));
  ASSERT_TRUE(retried.ok()) << retried.status().ToString();
  ASSERT_TRUE(c.reference.Step(c.harness.Hyper(2), c.harness));
  c.harness.ExpectMatches(c.reference);
}

TEST(OptimizerGroupSingleSlotTest, LoadFailingAfterItsFirstWriteBreaksTheGroupAndARetryRecovers) {
  Checkpointed c(FaultyOptions());
  ASSERT_TRUE(c.harness.ok());
  // The load writes the chunks in place; the fourth write fails.
  c.harness.FailOnce(io::FaultKind::kEio, io::FaultOps::kWrites, 4);
  Status failed = LoadFrom(c.dir.File("ckpt"), c.harness.group());
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.code(), StatusCode::kIoError) << failed.ToString();
  ExpectRefusesWork(c.harness, "optimizer group 'g': chunk 3");
  c.ExpectRecovers();
}

TEST(OptimizerGroupSingleSlotTest, WriteStateFailingAfterItsFirstWriteBreaksTheGroup) {
  Checkpointed c(FaultyOptions());
  ASSERT_TRUE(c.harness.ok());
  // Exp_avg of every chunk: the second chunk's write fails after the first was written in place.
  c.harness.FailOnce(io::FaultKind::kEio, io::FaultOps::kWrites, 2);
  const std::vector<float> values(c.harness.count(), 0.25f);
  const Status failed = c.harness.group().WriteState(StateSlot::kExpAvg, 0, values);
  EXPECT_EQ(failed.code(), StatusCode::kIoError) << failed.ToString();
  ExpectRefusesWork(c.harness, "Input/output error");
  c.ExpectRecovers();
}

TEST(OptimizerGroupSingleSlotTest, DiscardedInPlaceLoadBreaksTheGroup) {
  Checkpointed c(FaultyOptions());
  ASSERT_TRUE(c.harness.ok());
  Result<std::unique_ptr<CheckpointReader>> reader = CheckpointReader::Open(c.dir.File("ckpt"));
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  ASSERT_TRUE(c.harness.group().PrepareLoad(**reader).ok());
  c.harness.group().DiscardLoad();
  ExpectRefusesWork(c.harness, "discarded before it was committed");
  c.ExpectRecovers();
}

}  // namespace
}  // namespace zoe::offload
