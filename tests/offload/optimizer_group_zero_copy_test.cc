// Description: OptimizerGroup with the master in the caller's parameters (master_in_params) --
// bit-identical parameters and state to the copy form over several steps (fp32, bf16 and int8
// moments, views cut at odd, unaligned offsets, a segment without gradients), checkpoints that
// load across the two forms, state reads and writes through the caller's buffers, the pinned
// bytes saved, the refusals (NVMe, speculation, non-fp32 views), and steady-state steps that
// fault in no fresh memory.
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "offload/optimizer/optimizer_group.h"
#include "tests/offload/optimizer_group_harness.h"

namespace zoe::offload {
namespace {

using optim::DType;
using testing::Bits;
using testing::GroupHarness;
using testing::HarnessOptions;
using testing::LoadFrom;
using testing::SaveTo;
using testing::StateBits;
using testing::TempDir;

HarnessOptions HostOptions(DType state_dtype, bool zero_copy) {
  HarnessOptions options;
  options.group.placement = Tier::kHost;
  options.group.state_dtype = state_dtype;
  options.group.master_in_params = zero_copy;
  options.threads = 2;
  return options;
}

// The harness's initial buffer is the zero-copy group's master: its fp32 values as bits.
std::vector<uint32_t> MasterBits(const GroupHarness& harness) {
  const std::vector<std::byte>& bytes = harness.initial_params();
  std::vector<uint32_t> bits(bytes.size() / sizeof(float));
  std::memcpy(bits.data(), bytes.data(), bytes.size());
  return bits;
}

std::vector<uint32_t> ParamBits(const GroupHarness& harness) {
  const std::vector<std::byte> bytes = harness.params_bytes();
  std::vector<uint32_t> bits(bytes.size() / sizeof(float));
  std::memcpy(bits.data(), bytes.data(), bytes.size());
  return bits;
}

// A step of the zero-copy group: gradients only, no parameter views (the master is written).
Result<StepReport> StepWithoutParams(GroupHarness& harness, const optim::HyperParams& hyper) {
  const std::vector<GradView> grads = harness.grad_views();
  StepArgs args;
  args.hyper = hyper;
  args.grads = grads;
  return harness.group().Step(args);
}

class ZeroCopyTest : public ::testing::TestWithParam<DType> {};

TEST_P(ZeroCopyTest, MatchesTheCopyFormBitForBit) {
  GroupHarness copy(HostOptions(GetParam(), false));
  GroupHarness zero(HostOptions(GetParam(), true));
  ASSERT_TRUE(copy.ok() && zero.ok());
  for (int step = 1; step <= 5; ++step) {
    copy.NewGradients(step);
    zero.NewGradients(step);
    Result<StepReport> a = copy.Step(copy.Hyper(step));
    Result<StepReport> b = StepWithoutParams(zero, zero.Hyper(step));
    ASSERT_TRUE(a.ok() && b.ok()) << a.status().ToString() << b.status().ToString();
    EXPECT_EQ(a->grad_norm, b->grad_norm);
    ASSERT_EQ(MasterBits(zero), ParamBits(copy)) << "step " << step;
    const StateBits expected = copy.Snapshot();
    const StateBits actual = zero.Snapshot();
    ASSERT_EQ(actual, expected) << "step " << step;
  }
}

TEST_P(ZeroCopyTest, ParameterViewsGivenToTheStepAreWrittenToo) {
  GroupHarness copy(HostOptions(GetParam(), false));
  GroupHarness zero(HostOptions(GetParam(), true));
  ASSERT_TRUE(copy.ok() && zero.ok());
  for (int step = 1; step <= 2; ++step) {
    copy.NewGradients(step);
    zero.NewGradients(step);
    ASSERT_TRUE(copy.Step(copy.Hyper(step)).ok());
    ASSERT_TRUE(zero.Step(zero.Hyper(step)).ok());
  }
  EXPECT_EQ(ParamBits(zero), ParamBits(copy));
  EXPECT_EQ(MasterBits(zero), ParamBits(copy));
}

INSTANTIATE_TEST_SUITE_P(Moments, ZeroCopyTest,
                         ::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kInt8),
                         [](const auto& test_case) {
                           return std::string(DTypeName(test_case.param));
                         });

// A segment without a gradient keeps its master (the caller's bytes) and moments untouched.
TEST(ZeroCopy, SegmentWithoutGradientKeepsItsMaster) {
  HarnessOptions options = HostOptions(DType::kFloat32, true);
  options.group.segments = {30001, 40000, 30002};
  HarnessOptions copy_options = options;
  copy_options.group.master_in_params = false;
  GroupHarness zero(options);
  GroupHarness copy(copy_options);
  ASSERT_TRUE(zero.ok() && copy.ok());
  for (int step = 1; step <= 3; ++step) {
    for (GroupHarness* h : {&zero, &copy}) {
      h->NewGradients(step);
      const auto* grads = reinterpret_cast<const float*>(h->grads());
      // Segment 1 has no gradient on odd steps.
      std::vector<GradView> views = {
          {grads, DType::kFloat32, 30001},
          {step % 2 == 1 ? nullptr : grads + 30001, DType::kFloat32, 40000},
          {grads + 70001, DType::kFloat32, 30002}};
      const std::vector<ParamView> params = h->param_views();
      StepArgs args;
      args.hyper = h->Hyper(step);
      args.grads = views;
      if (h == &copy) args.params = params;
      const std::vector<uint32_t> before = MasterBits(zero);
      ASSERT_TRUE(h->group().Step(args).ok());
      if (h == &zero && step == 1) {
        const std::vector<uint32_t> after = MasterBits(zero);
        EXPECT_TRUE(
            std::equal(before.begin() + 30001, before.begin() + 70001, after.begin() + 30001));
        EXPECT_NE(before[0], after[0]);
      }
    }
    ASSERT_EQ(zero.Snapshot(), copy.Snapshot()) << "step " << step;
    ASSERT_EQ(zero.group().segment_steps()[1], copy.group().segment_steps()[1]);
  }
}

// A master view at an odd element offset of a larger buffer (not 64-byte aligned) steps like an
// aligned one.
TEST(ZeroCopy, UnalignedMasterView) {
  constexpr size_t kCount = 5000;
  std::vector<float> storage(kCount + 3), reference(kCount), grads(kCount);
  for (size_t i = 0; i < kCount; ++i) {
    reference[i] = storage[i + 3] = 0.01f * static_cast<float>(i % 97) - 0.3f;
    grads[i] = 0.001f * static_cast<float>(i % 13) - 0.005f;
  }
  HarnessOptions unused = HostOptions(DType::kFloat32, true);
  unused.count = kCount;
  GroupHarness harness(unused, /*create=*/false);
  ASSERT_TRUE(harness.ok());
  OptimizerGroupOptions options = harness.group_options();
  options.count = kCount;
  OptimizerResources resources{nullptr, nullptr, &harness.pinned()};
  const ParamView master{storage.data() + 3, DType::kFloat32, kCount};
  Result<std::unique_ptr<OptimizerGroup>> zero =
      OptimizerGroup::Create(options, resources, {&master, 1});
  options.master_in_params = false;
  options.name = "copy";
  const ParamView initial{reference.data(), DType::kFloat32, kCount};
  Result<std::unique_ptr<OptimizerGroup>> copy =
      OptimizerGroup::Create(options, resources, {&initial, 1});
  ASSERT_TRUE(zero.ok() && copy.ok()) << zero.status().ToString() << copy.status().ToString();
  const GradView grad{grads.data(), DType::kFloat32, kCount};
  for (int step = 1; step <= 3; ++step) {
    StepArgs args;
    args.hyper = harness.Hyper(step);
    args.grads = {&grad, 1};
    ASSERT_TRUE((*zero)->Step(args).ok());
    const ParamView out{reference.data(), DType::kFloat32, kCount};
    args.params = {&out, 1};
    ASSERT_TRUE((*copy)->Step(args).ok());
  }
  EXPECT_EQ(0, std::memcmp(storage.data() + 3, reference.data(), kCount * sizeof(float)));
}

TEST(ZeroCopy, CheckpointsLoadAcrossTheTwoForms) {
  TempDir dir;
  GroupHarness zero(HostOptions(DType::kFloat32, true));
  GroupHarness copy(HostOptions(DType::kFloat32, false));
  ASSERT_TRUE(zero.ok() && copy.ok());
  for (int step = 1; step <= 2; ++step) {
    zero.NewGradients(step);
    ASSERT_TRUE(StepWithoutParams(zero, zero.Hyper(step)).ok());
  }
  ASSERT_TRUE(SaveTo(dir.File("a"), zero.group()).ok());
  EXPECT_EQ(zero.group().checkpoint_bytes(), copy.group().checkpoint_bytes());
  // Zero copy -> copy: the copy form holds the zero-copy group's master and moments.
  ASSERT_TRUE(LoadFrom(dir.File("a"), copy.group()).ok());
  const StateBits saved = zero.Snapshot();
  EXPECT_EQ(copy.Snapshot(), saved);
  // Steps diverge the zero-copy master; loading the checkpoint back writes the caller's buffer.
  zero.NewGradients(3);
  ASSERT_TRUE(StepWithoutParams(zero, zero.Hyper(3)).ok());
  ASSERT_NE(zero.Snapshot(), saved);
  ASSERT_TRUE(LoadFrom(dir.File("a"), zero.group()).ok());
  EXPECT_EQ(zero.Snapshot(), saved);
  EXPECT_EQ(MasterBits(zero), saved[0]);
  EXPECT_EQ(zero.group().steps_taken(), 2);
  // Copy -> zero copy.
  ASSERT_TRUE(SaveTo(dir.File("b"), copy.group()).ok());
  zero.NewGradients(4);
  ASSERT_TRUE(StepWithoutParams(zero, zero.Hyper(4)).ok());
  ASSERT_TRUE(LoadFrom(dir.File("b"), zero.group()).ok());
  EXPECT_EQ(zero.Snapshot(), copy.Snapshot());
}

TEST(ZeroCopy, StateReadsAndWritesGoThroughTheCallersBuffer) {
  GroupHarness zero(HostOptions(DType::kFloat32, true));
  ASSERT_TRUE(zero.ok());
  std::vector<float> values(1000);
  for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(i);
  ASSERT_TRUE(zero.group().WriteState(StateSlot::kMaster, 12000, values).ok());
  const auto* master = reinterpret_cast<const float*>(zero.initial_params().data());
  EXPECT_EQ(0, std::memcmp(master + 12000, values.data(), values.size() * sizeof(float)));
  std::vector<float> read(values.size());
  ASSERT_TRUE(zero.group().ReadState(StateSlot::kMaster, 12000, read).ok());
  EXPECT_EQ(read, values);
}

TEST(ZeroCopy, SavesFourBytesPerParameterOfPinnedMemory) {
  GroupHarness zero(HostOptions(DType::kFloat32, true));
  GroupHarness copy(HostOptions(DType::kFloat32, false));
  ASSERT_TRUE(zero.ok() && copy.ok());
  EXPECT_GE(copy.group().pinned_bytes() - zero.group().pinned_bytes(), 4 * zero.count());
}

TEST(ZeroCopy, RefusesWhatItCannotServe) {
  HarnessOptions options = HostOptions(DType::kFloat32, false);
  GroupHarness harness(options, /*create=*/false);
  ASSERT_TRUE(harness.ok());
  OptimizerGroupOptions nvme = harness.group_options();
  nvme.master_in_params = true;
  nvme.placement = Tier::kNvme;
  Result<std::unique_ptr<OptimizerGroup>> refused = harness.CreateGroup(nvme);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("HOST"), std::string::npos);

  OptimizerGroupOptions speculative = harness.group_options();
  speculative.master_in_params = true;
  speculative.speculative = true;
  refused = harness.CreateGroup(speculative);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("speculation"), std::string::npos);

  HarnessOptions bf16 = HostOptions(DType::kFloat32, true);
  bf16.param_dtype = DType::kBFloat16;
  GroupHarness bf16_harness(bf16, /*create=*/false);
  ASSERT_TRUE(bf16_harness.ok());
  refused = bf16_harness.CreateGroup(bf16_harness.group_options());
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("bf16"), std::string::npos);
}

long MinorFaults() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_minflt;
}

// Steady-state steps touch only memory they touched before: a step that mapped a scratch area or
// allocated a staging buffer too large for the heap to recycle (glibc maps those afresh every
// time) would fault in its pages on every step. Counts, not times: 20 steps of 2^21 parameters
// may fault in fewer pages than one 128 KiB buffer has.
TEST(StepMemory, SteadyStateStepsFaultInNoFreshPages) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  // The sanitizers' allocators quarantine freed memory and keep shadow pages, so every
  // allocation faults in fresh pages there: the count speaks of glibc's heap only.
  GTEST_SKIP() << "page-fault counts are those of the sanitizer's allocator";
#endif
  for (bool zero_copy : {false, true}) {
    HarnessOptions options = HostOptions(DType::kFloat32, zero_copy);
    options.count = (size_t{1} << 21) + 2053;
    options.pinned_budget = 64 << 20;
    options.group.chunk_elements = size_t{1} << 19;
    options.group.run.tile_elements = size_t{1} << 15;
    GroupHarness harness(options);
    ASSERT_TRUE(harness.ok());
    harness.NewGradients(1);
    for (int step = 1; step <= 3; ++step) {
      ASSERT_TRUE(harness.Step(harness.Hyper(step)).ok());
    }
    const long before = MinorFaults();
    for (int step = 4; step < 24; ++step) {
      ASSERT_TRUE(harness.Step(harness.Hyper(step)).ok());
    }
    EXPECT_LT(MinorFaults() - before, 32) << "zero_copy " << zero_copy;
  }
}

}  // namespace
}  // namespace zoe::offload
