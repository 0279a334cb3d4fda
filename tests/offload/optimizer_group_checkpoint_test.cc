// Description: OptimizerGroup Save/Load through the checkpoint store — round trip, resume equals
// uninterrupted, checkpoints of other groups refused, corrupted files and I/O faults change
// nothing.
#include <gtest/gtest.h>

#include <fstream>
#include <string>

#include "offload/checkpoint/checkpoint_store.h"
#include "offload/optimizer/optimizer_group.h"
#include "tests/offload/optimizer_group_harness.h"

namespace zoe::offload {
namespace {

using optim::DType;
using testing::GroupHarness;
using testing::HarnessOptions;
using testing::LoadFrom;
using testing::SaveTo;
using testing::TempDir;

HarnessOptions CheckpointOptions() {
  HarnessOptions options;
  options.group.nvme_ratio = 0.5;  // NVMe and HOST chunks
  options.group.state_dtype = DType::kBFloat16;
  options.inject_faults = true;
  options.checksum_block = 4096;
  return options;
}

void Steps(GroupHarness& harness, int first, int end) {
  for (int step = first; step < end; ++step) {
    harness.NewGradients(step);
    Result<StepReport> report = harness.Step(harness.Hyper(step));
    ASSERT_TRUE(report.ok()) << report.status().ToString();
  }
}

// The live version's state file of the group named "g".
std::string StateFile(const std::string& dir) {
  std::ifstream latest(dir + "/LATEST");
  std::string version;
  std::getline(latest, version);
  return dir + "/" + version + "/g.state";
}

TEST(OptimizerGroupCheckpointTest, LoadedGroupContinuesExactlyLikeTheSavedOne) {
  TempDir checkpoints;
  const std::string dir = checkpoints.File("ckpt");
  GroupHarness saved(CheckpointOptions());
  GroupHarness loaded(CheckpointOptions());
  ASSERT_TRUE(saved.ok() && loaded.ok());
  Steps(saved, 0, 3);
  ASSERT_TRUE(SaveTo(dir, saved.group()).ok());
  Result<std::unique_ptr<CheckpointReader>> reader = CheckpointReader::Open(dir);
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  Result<nlohmann::json> metadata = (*reader)->file_metadata("g.state");
  ASSERT_TRUE(metadata.ok()) << metadata.status().ToString();
  EXPECT_EQ((*metadata)["identity"], saved.group().Identity());
  EXPECT_EQ((*metadata)["steps_taken"], 3);

  Status load = loaded.group().Load(**reader);
  ASSERT_TRUE(load.ok()) << load.ToString();
  EXPECT_EQ(loaded.group().steps_taken(), 3);
  EXPECT_EQ(loaded.Snapshot(), saved.Snapshot());

  Steps(saved, 3, 6);
  Steps(loaded, 3, 6);
  EXPECT_EQ(loaded.group().steps_taken(), 6);
  EXPECT_EQ(loaded.Snapshot(), saved.Snapshot());
  EXPECT_EQ(loaded.params_bytes(), saved.params_bytes());
}

// A step keeps the chunks it wrote last in its pipeline buffers for the next step. State written
// in between (WriteState) must not be served from there, neither to the next step nor to a
// checkpoint: the group whose buffers may hold the old state continues exactly like one whose
// buffers were emptied by a checkpoint round trip before the same writes.
TEST(OptimizerGroupCheckpointTest, StateWrittenBetweenStepsIsNotServedFromThePipelineBuffers) {
  TempDir checkpoints;
  HarnessOptions options = CheckpointOptions();
  options.group.nvme_ratio = 1.0;
  GroupHarness written(options);
  GroupHarness control(options);
  GroupHarness restored(options);
  ASSERT_TRUE(written.ok() && control.ok() && restored.ok());
  Steps(written, 0, 3);
  Steps(control, 0, 3);
  ASSERT_TRUE(SaveTo(checkpoints.File("round-trip"), control.group()).ok());
  ASSERT_TRUE(LoadFrom(checkpoints.File("round-trip"), control.group()).ok());
  // Steps alternate direction (0..6, 6..0, 0..6), so the three buffers now hold chunks 4 to 6.
  // Each WriteState below moves one chunk through the same buffer, so at least one of the two
  // written chunks keeps an old copy in another buffer.
  const std::vector<float> masters(100, 0.25f);  // in chunk 5
  const std::vector<float> moments(50, 0.5f);    // in chunk 6, the short last one
  for (GroupHarness* harness : {&written, &control}) {
    ASSERT_TRUE(harness->group().WriteState(StateSlot::kMaster, 5 * 16384 + 10, masters).ok());
    ASSERT_TRUE(harness->group().WriteState(StateSlot::kExpAvg, 6 * 16384 + 7, moments).ok());
  }
  ASSERT_TRUE(SaveTo(checkpoints.File("written"), written.group()).ok());
  ASSERT_TRUE(LoadFrom(checkpoints.File("written"), restored.group()).ok());
  EXPECT_EQ(restored.Snapshot(), control.Snapshot());

  written.NewGradients(3);
  Result<StepReport> report = written.Step(written.Hyper(3));
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_GT(report->bytes_reused, 0u);  // chunks nobody wrote still come from the buffers
  EXPECT_GT(report->bytes_read, 0u);    // the two written ones are read again
  Steps(control, 3, 4);
  EXPECT_EQ(written.Snapshot(), control.Snapshot());
  Steps(written, 4, 6);
  Steps(control, 4, 6);
  EXPECT_EQ(written.Snapshot(), control.Snapshot());
  EXPECT_EQ(written.params_bytes(), control.params_bytes());
}

TEST(OptimizerGroupCheckpointTest, CheckpointOfAnotherGroupIsRefusedAndChangesNothing) {
  TempDir checkpoints;
  const std::string dir = checkpoints.File("ckpt");
  GroupHarness saved(CheckpointOptions());
  ASSERT_TRUE(saved.ok());
  Steps(saved, 0, 2);
  ASSERT_TRUE(SaveTo(dir, saved.group()).ok());

  HarnessOptions other_chunks = CheckpointOptions();
  other_chunks.group.chunk_elements = 8192;
  GroupHarness differently_cut(other_chunks);
  ASSERT_TRUE(differently_cut.ok());
  const auto before = differently_cut.Snapshot();
  Status refused = LoadFrom(dir, differently_cut.group());
  EXPECT_EQ(refused.code(), StatusCode::kFailedPrecondition) << refused.ToString();
  EXPECT_NE(refused.message().find(saved.group().Identity().dump()), std::string::npos)
      << refused.ToString();
  EXPECT_NE(refused.message().find(differently_cut.group().Identity().dump()), std::string::npos)
      << refused.ToString();
  EXPECT_EQ(differently_cut.Snapshot(), before);
  EXPECT_EQ(differently_cut.group().steps_taken(), 0);

  HarnessOptions other_name = CheckpointOptions();
  other_name.group.name = "h";
  GroupHarness renamed(other_name);
  ASSERT_TRUE(renamed.ok());
  Status missing = LoadFrom(dir, renamed.group());
  EXPECT_EQ(missing.code(), StatusCode::kFailedPrecondition) << missing.ToString();
  EXPECT_NE(missing.message().find("holds no state of this group"), std::string::npos)
      << missing.ToString();
  EXPECT_NE(missing.message().find("g.state"), std::string::npos) << missing.ToString();
}

TEST(OptimizerGroupCheckpointTest, CorruptedCheckpointIsRefusedAndChangesNothing) {
  TempDir checkpoints;
  const std::string dir = checkpoints.File("ckpt");
  GroupHarness saved(CheckpointOptions());
  GroupHarness target(CheckpointOptions());
  ASSERT_TRUE(saved.ok() && target.ok());
  Steps(saved, 0, 2);
  ASSERT_TRUE(SaveTo(dir, saved.group()).ok());
  Steps(target, 0, 1);
  const auto before = target.Snapshot();

  // Flip one byte near the end of the file: in a HOST chunk, read after every NVMe chunk was
  // already written to its inactive slot.
  const std::string path = StateFile(dir);
  std::string bytes = testing::ReadBytes(path);
  ASSERT_FALSE(bytes.empty()) << path;
  bytes[bytes.size() - 100] ^= 0x40;
  testing::WriteBytes(path, bytes);

  Status load = LoadFrom(dir, target.group());
  EXPECT_EQ(load.code(), StatusCode::kCorruption) << load.ToString();
  EXPECT_EQ(target.Snapshot(), before);
  EXPECT_EQ(target.group().steps_taken(), 1);
}

TEST(OptimizerGroupCheckpointTest, WriteFaultDuringLoadChangesNothing) {
  TempDir checkpoints;
  const std::string dir = checkpoints.File("ckpt");
  GroupHarness saved(CheckpointOptions());
  GroupHarness target(CheckpointOptions());
  ASSERT_TRUE(saved.ok() && target.ok());
  Steps(saved, 0, 2);
  ASSERT_TRUE(SaveTo(dir, saved.group()).ok());
  const auto before = target.Snapshot();
  target.FailOnce(io::FaultKind::kEio, io::FaultOps::kWrites, 3);
  Status load = LoadFrom(dir, target.group());
  EXPECT_EQ(load.code(), StatusCode::kIoError) << load.ToString();
  EXPECT_NE(load.message().find("optimizer group 'g': chunk 2"), std::string::npos)
      << load.ToString();
  EXPECT_EQ(target.Snapshot(), before);
  ASSERT_TRUE(LoadFrom(dir, target.group()).ok());
  EXPECT_EQ(target.Snapshot(), saved.Snapshot());
}

TEST(OptimizerGroupCheckpointTest, ReadFaultDuringSaveIsReportedAndTheOldCheckpointStays) {
  TempDir checkpoints;
  const std::string dir = checkpoints.File("ckpt");
  GroupHarness saved(CheckpointOptions());
  ASSERT_TRUE(saved.ok());
  ASSERT_TRUE(SaveTo(dir, saved.group()).ok());
  Steps(saved, 0, 1);
  saved.FailOnce(io::FaultKind::kEio, io::FaultOps::kReads, 2);
  Status save = SaveTo(dir, saved.group());
  EXPECT_EQ(save.code(), StatusCode::kIoError) << save.ToString();
  EXPECT_NE(save.message().find("chunk 1"), std::string::npos) << save.ToString();
  Result<std::unique_ptr<CheckpointReader>> reader = CheckpointReader::Open(dir);
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  Result<nlohmann::json> metadata = (*reader)->file_metadata("g.state");
  ASSERT_TRUE(metadata.ok());
  EXPECT_EQ((*metadata)["steps_taken"], 0);
}

TEST(OptimizerGroupCheckpointTest, SaveAndLoadWaitForAccumulatedGradientsToBeStepped) {
  TempDir checkpoints;
  const std::string dir = checkpoints.File("ckpt");
  GroupHarness harness(CheckpointOptions());
  ASSERT_TRUE(harness.ok());
  ASSERT_TRUE(SaveTo(dir, harness.group()).ok());
  harness.NewGradients(0);
  ASSERT_TRUE(harness.group().AccumulateGrad(0, harness.grad_views().front()).ok());
  EXPECT_EQ(SaveTo(dir, harness.group()).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(LoadFrom(dir, harness.group()).code(), StatusCode::kFailedPrecondition);
}

TEST(OptimizerGroupCheckpointTest, PreparedLoadChangesNothingUntilCommitted) {
  TempDir checkpoints;
  const std::string dir = checkpoints.File("ckpt");
  GroupHarness saved(CheckpointOptions());
  GroupHarness target(CheckpointOptions());
  ASSERT_TRUE(saved.ok() && target.ok());
  Steps(saved, 0, 2);
  ASSERT_TRUE(SaveTo(dir, saved.group()).ok());
  Steps(target, 0, 1);
  const auto before = target.Snapshot();
  Result<std::unique_ptr<CheckpointReader>> reader = CheckpointReader::Open(dir);
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();

  ASSERT_TRUE(target.group().PrepareLoad(**reader).ok());
  EXPECT_EQ(target.Snapshot(), before);
  EXPECT_EQ(target.group().steps_taken(), 1);
  target.group().DiscardLoad();
  target.group().CommitLoad();  // nothing prepared: no change
  EXPECT_EQ(target.Snapshot(), before);
  EXPECT_EQ(target.group().steps_taken(), 1);

  ASSERT_TRUE(target.group().PrepareLoad(**reader).ok());
  target.group().CommitLoad();
  EXPECT_EQ(target.Snapshot(), saved.Snapshot());
  EXPECT_EQ(target.group().steps_taken(), 2);
}

TEST(OptimizerGroupCheckpointTest, StepDropsAPreparedLoad) {
  TempDir checkpoints;
  const std::string dir = checkpoints.File("ckpt");
  GroupHarness saved(CheckpointOptions());
  GroupHarness target(CheckpointOptions());
  ASSERT_TRUE(saved.ok() && target.ok());
  Steps(saved, 0, 2);
  ASSERT_TRUE(SaveTo(dir, saved.group()).ok());
  Result<std::unique_ptr<CheckpointReader>> reader = CheckpointReader::Open(dir);
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  ASSERT_TRUE(target.group().PrepareLoad(**reader).ok());
  Steps(target, 0, 1);
  const auto stepped = target.Snapshot();
  target.group().CommitLoad();
  EXPECT_EQ(target.Snapshot(), stepped);
  EXPECT_EQ(target.group().steps_taken(), 1);
}

// Gradients accumulated between PrepareLoad and CommitLoad start reads of the state before the
// load; the step after the commit must update the loaded state, as a group that loaded first and
// accumulated after does.
TEST(OptimizerGroupCheckpointTest, ReadsStartedBeforeACommittedLoadAreNotUsedByTheStep) {
  TempDir checkpoints;
  const std::string dir = checkpoints.File("ckpt");
  HarnessOptions options = CheckpointOptions();
  options.group.nvme_ratio = 1.0;
  GroupHarness saved(options);
  GroupHarness target(options);
  GroupHarness control(options);
  ASSERT_TRUE(saved.ok() && target.ok() && control.ok());
  Steps(saved, 0, 2);
  ASSERT_TRUE(SaveTo(dir, saved.group()).ok());
  Steps(target, 0, 3);  // a different state, so stale reads would show
  ASSERT_TRUE(LoadFrom(dir, control.group()).ok());
  Result<std::unique_ptr<CheckpointReader>> reader = CheckpointReader::Open(dir);
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();

  ASSERT_TRUE(target.group().PrepareLoad(**reader).ok());
  for (GroupHarness* harness : {&target, &control}) {
    harness->NewGradients(2);
    ASSERT_TRUE(harness->AccumulateAll());
  }
  ASSERT_GT(target.group().reads_started(), 0u);
  target.group().CommitLoad();
  EXPECT_EQ(target.group().reads_started(), 0u);
  EXPECT_EQ(target.group().steps_taken(), 2);
  for (GroupHarness* harness : {&target, &control}) {
    Result<StepReport> report = harness->StepAccumulated(harness->Hyper(2));
    ASSERT_TRUE(report.ok()) << report.status().ToString();
    EXPECT_EQ(report->steps_taken, 3);
  }
  EXPECT_EQ(target.Snapshot(), control.Snapshot());
  EXPECT_EQ(target.params_bytes(), control.params_bytes());
}

// HOST chunks are staged in the pinned pool: a budget that holds the state once but not twice
// refuses the load before anything changes.
TEST(OptimizerGroupCheckpointTest, StagingBeyondThePinnedBudgetIsOutOfMemoryAndChangesNothing) {
  TempDir checkpoints;
  const std::string dir = checkpoints.File("ckpt");
  HarnessOptions host_only = CheckpointOptions();
  host_only.group.placement = Tier::kHost;
  GroupHarness saved(host_only);
  ASSERT_TRUE(saved.ok());
  Steps(saved, 0, 2);
  ASSERT_TRUE(SaveTo(dir, saved.group()).ok());
  const uint64_t state_bytes = saved.pinned().used_bytes();
  ASSERT_GT(state_bytes, 0u);

  HarnessOptions tight = host_only;
  tight.pinned_budget = state_bytes + state_bytes / 2;
  GroupHarness target(tight);
  ASSERT_TRUE(target.ok());
  const auto before = target.Snapshot();
  Status load = LoadFrom(dir, target.group());
  EXPECT_EQ(load.code(), StatusCode::kOutOfMemory) << load.ToString();
  EXPECT_NE(load.message().find("HOST chunks"), std::string::npos) << load.ToString();
  EXPECT_EQ(target.Snapshot(), before);
  EXPECT_EQ(target.group().steps_taken(), 0);
  EXPECT_EQ(target.pinned().used_bytes(), state_bytes);

  HarnessOptions roomy = host_only;
  roomy.pinned_budget = 2 * state_bytes;
  GroupHarness fits(roomy);
  ASSERT_TRUE(fits.ok());
  ASSERT_TRUE(LoadFrom(dir, fits.group()).ok());
  EXPECT_EQ(fits.Snapshot(), saved.Snapshot());
  EXPECT_EQ(fits.pinned().used_bytes(), state_bytes);
}

}  // namespace
}  // namespace zoe::offload
