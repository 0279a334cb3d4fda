// Description: faults on checkpoint reads (CheckpointReaderOptions::fault_for_testing) — EIO on
// open and read names the file and offset, a damaged read is Corruption at EndFile, EINTR and
// short reads load correctly; an optimizer group whose load fails keeps its state and step count
// and steps on as if nothing happened (two slots), or refuses work until a good load (one slot).
#include <gtest/gtest.h>

#include <cerrno>
#include <string>
#include <vector>

#include "offload/checkpoint/checkpoint_store.h"
#include "offload/optimizer/chunk_update.h"
#include "tests/offload/optimizer_group_harness.h"
#include "tests/offload/temp_dir.h"

namespace zoe::offload {
namespace {

using testing::GroupHarness;
using testing::HarnessOptions;
using testing::Reference;
using testing::SaveTo;
using testing::TempDir;

constexpr std::string_view kStateFile = "g.state";

// Fails or damages the `nth` call of `call` on a file whose path ends with kStateFile.
CheckpointReaderOptions FaultOn(CheckpointSyscall call, int fault, int nth = 1) {
  CheckpointReaderOptions options;
  auto seen = std::make_shared<int>(0);
  options.fault_for_testing = [=](CheckpointSyscall c, const std::string& path) {
    const bool state =
        path.size() >= kStateFile.size() &&
        path.compare(path.size() - kStateFile.size(), kStateFile.size(), kStateFile) == 0;
    if (c != call || !state) return 0;
    return ++*seen == nth ? fault : 0;
  };
  return options;
}

Status LoadWith(const std::string& dir, OptimizerGroup& group, CheckpointReaderOptions options) {
  ZOE_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader,
                       CheckpointReader::Open(dir, std::move(options)));
  return group.Load(*reader);
}

HarnessOptions Options(uint32_t slots) {
  HarnessOptions options;
  options.checksum_block = kStripeChecksumBlock;
  options.group.slots = slots;
  options.group.nvme_ratio = 0.7;  // NVMe chunks and HOST chunks
  return options;
}

// A group saved after step 0 and stepped once more, so its state differs from the checkpoint.
struct SavedAndSteppedOn {
  explicit SavedAndSteppedOn(uint32_t slots) : harness(Options(slots)), reference(harness) {
    for (int step = 0; step < 2; ++step) {
      harness.NewGradients(step);
      EXPECT_TRUE(harness.Step(harness.Hyper(step)).ok());
      EXPECT_TRUE(reference.Step(harness.Hyper(step), harness));
      if (step == 0) {
        EXPECT_TRUE(SaveTo(dir.File("ckpt"), harness.group()).ok());
      }
    }
  }
  TempDir dir;
  GroupHarness harness;
  Reference reference;
};

struct ReadFault {
  const char* name;
  CheckpointSyscall call;
  int fault;
  StatusCode code;
  const char* message;
};

class CheckpointReadFaultTest : public ::testing::TestWithParam<ReadFault> {};

TEST_P(CheckpointReadFaultTest, TwoSlotGroupKeepsItsStateAndStepsOn) {
  const ReadFault& f = GetParam();
  SavedAndSteppedOn s(2);
  ASSERT_TRUE(s.harness.ok());
  const testing::StateBits before = s.harness.Snapshot();
  const Status loaded =
      LoadWith(s.dir.File("ckpt"), s.harness.group(), FaultOn(f.call, f.fault, 2));
  ASSERT_FALSE(loaded.ok());
  EXPECT_EQ(loaded.code(), f.code) << loaded.ToString();
  EXPECT_NE(loaded.ToString().find(f.message), std::string::npos) << loaded.ToString();
  EXPECT_NE(loaded.ToString().find(std::string(kStateFile)), std::string::npos)
      << loaded.ToString();
  EXPECT_EQ(s.harness.Snapshot(), before);
  EXPECT_EQ(s.harness.group().steps_taken(), 2);
  EXPECT_TRUE(s.harness.group().broken().ok());
  s.harness.NewGradients(2);
  Result<StepReport> next = s.harness.Step(s.harness.Hyper(2));
  ASSERT_TRUE(next.ok()) << next.status().ToString();
  ASSERT_TRUE(s.reference.Step(s.harness.Hyper(2), s.harness));
  s.harness.ExpectMatches(s.reference);
}

INSTANTIATE_TEST_SUITE_P(Faults, CheckpointReadFaultTest,
                         ::testing::Values(ReadFault{"EioOnRead", CheckpointSyscall::kRead, EIO,
                                                     StatusCode::kIoError, "Input/output error"},
                                           ReadFault{"CorruptRead", CheckpointSyscall::kRead,
                                                     CheckpointReaderOptions::kCorruptRead,
                                                     StatusCode::kCorruption, "checksum mismatch"}),
                         [](const ::testing::TestParamInfo<ReadFault>& param_info) {
                           return std::string(param_info.param.name);
                         });

TEST(CheckpointReadFault, FailedOpenIsAnErrorNamingTheFileAndChangesNothing) {
  SavedAndSteppedOn s(2);
  ASSERT_TRUE(s.harness.ok());
  const testing::StateBits before = s.harness.Snapshot();
  const Status loaded =
      LoadWith(s.dir.File("ckpt"), s.harness.group(), FaultOn(CheckpointSyscall::kOpen, EIO, 1));
  EXPECT_EQ(loaded.code(), StatusCode::kIoError) << loaded.ToString();
  EXPECT_NE(loaded.ToString().find("open "), std::string::npos) << loaded.ToString();
  EXPECT_EQ(s.harness.Snapshot(), before);
  EXPECT_EQ(s.harness.group().steps_taken(), 2);
}

TEST(CheckpointReadFault, EintrAndShortReadsLoadTheCheckpoint) {
  for (int fault : {EINTR, CheckpointReaderOptions::kShortRead}) {
    SavedAndSteppedOn s(2);
    ASSERT_TRUE(s.harness.ok());
    const Status loaded =
        LoadWith(s.dir.File("ckpt"), s.harness.group(), FaultOn(CheckpointSyscall::kRead, fault));
    ASSERT_TRUE(loaded.ok()) << fault << ": " << loaded.ToString();
    EXPECT_EQ(s.harness.group().steps_taken(), 1);
  }
}

TEST(CheckpointReadFault, SingleSlotGroupRefusesWorkUntilAGoodLoad) {
  SavedAndSteppedOn s(1);
  ASSERT_TRUE(s.harness.ok());
  // The damage is found by the checksum at the end of the file, after the NVMe chunks were
  // written in place.
  const Status loaded =
      LoadWith(s.dir.File("ckpt"), s.harness.group(),
               FaultOn(CheckpointSyscall::kRead, CheckpointReaderOptions::kCorruptRead));
  EXPECT_EQ(loaded.code(), StatusCode::kCorruption) << loaded.ToString();
  EXPECT_FALSE(s.harness.group().broken().ok());
  std::vector<float> values(8);
  EXPECT_EQ(s.harness.group().ReadState(StateSlot::kMaster, 0, values).code(),
            StatusCode::kFailedPrecondition);
  const Status good = LoadWith(s.dir.File("ckpt"), s.harness.group(), {});
  ASSERT_TRUE(good.ok()) << good.ToString();
  EXPECT_TRUE(s.harness.group().broken().ok());
  EXPECT_EQ(s.harness.group().steps_taken(), 1);
}

}  // namespace
}  // namespace zoe::offload
