// Description: speculative steps of an OptimizerGroup -- chunks updated as AccumulateGrad
// completes them, then committed, discarded (a non-finite gradient) or recomputed (clipping) --
// give state and parameters bit-identical to the same steps without speculation, in HOST and on
// NVMe with checksums on; a fault during a speculative step leaves the previous state; the
// speculation counts; backing off after recomputes; argument errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "io/fault_injection.h"
#include "offload/optimizer/chunk_update.h"
#include "offload/optimizer/optimizer_group.h"
#include "tests/offload/optimizer_group_harness.h"

namespace zoe::offload {
namespace {

using testing::GroupHarness;
using testing::HarnessOptions;

struct Placement {
  const char* name;
  Tier tier;
  double nvme_ratio;  // with kNvme: the rest of the chunks stay in HOST
  optim::DType param_dtype;
};

void PrintTo(const Placement& p, std::ostream* os) { *os << p.name; }

HarnessOptions SpeculationOptions(const Placement& placement, double max_grad_norm) {
  HarnessOptions options;
  options.checksum_block = kStripeChecksumBlock;
  options.param_dtype = placement.param_dtype;
  options.threads = 2;
  options.group.placement = placement.tier;
  options.group.nvme_ratio = placement.nvme_ratio;
  options.group.max_grad_norm = max_grad_norm;
  // Every step speculates (the tests of the mechanism); BackingOff* turn the back-off on.
  options.group.max_speculation_backoff = 0;
  return options;
}

enum class Arrival { kLastToFirst, kFirstToLast };

// The gradient views handed over last to first (as backward produces them), or first to last.
Status AccumulateInOrder(GroupHarness& harness, Arrival arrival) {
  const std::vector<GradView> views = harness.grad_views();
  std::vector<size_t> offsets(views.size(), 0);
  for (size_t i = 1; i < views.size(); ++i) offsets[i] = offsets[i - 1] + views[i - 1].count;
  for (size_t k = 0; k < views.size(); ++k) {
    const size_t i = arrival == Arrival::kLastToFirst ? views.size() - 1 - k : k;
    ZOE_RETURN_IF_ERROR(harness.group().AccumulateGrad(offsets[i], views[i]));
  }
  return Status::Ok();
}

// Arms speculation for a step with `hyper` that writes the harness's parameter views.
Status Speculate(GroupHarness& harness, const optim::HyperParams& hyper) {
  const std::vector<ParamView> params = harness.param_views();
  StepArgs args;
  args.hyper = hyper;
  args.params = params;
  return harness.group().Speculate(args);
}

// Speculate, then the gradient views handed over last to first, then the Step on them.
Result<StepReport> SpeculativeStep(GroupHarness& harness, const optim::HyperParams& hyper) {
  ZOE_RETURN_IF_ERROR(Speculate(harness, hyper));
  ZOE_RETURN_IF_ERROR(AccumulateInOrder(harness, Arrival::kLastToFirst));
  return harness.StepAccumulated(hyper);
}

class SpeculationTest : public ::testing::TestWithParam<Placement> {
 protected:
  // Runs `steps` steps on a speculative group and on a plain one (gradients given with the step),
  // the gradients of step `poisoned` (if any) holding a NaN in the chunk handed over last, and
  // checks after each that both hold the same bits. Returns the speculative reports, and the
  // speculative group's totals in `totals` if given. `max_backoff`: the group's back-off.
  std::vector<StepReport> RunBoth(double max_grad_norm, int steps, int poisoned = -1,
                                  uint32_t max_backoff = 0, SpeculationStats* totals = nullptr) {
    HarnessOptions options = SpeculationOptions(GetParam(), max_grad_norm);
    GroupHarness plain(options);
    options.group.speculative = true;
    options.group.max_speculation_backoff = max_backoff;
    GroupHarness speculative(options);
    EXPECT_TRUE(plain.ok() && speculative.ok());
    std::vector<StepReport> reports;
    if (!plain.ok() || !speculative.ok()) return reports;
    for (int step = 0; step < steps; ++step) {
      plain.NewGradients(step);
      speculative.NewGradients(step);
      if (step == poisoned) {
        plain.PoisonGradient(3, std::numeric_limits<float>::quiet_NaN());
        speculative.PoisonGradient(3, std::numeric_limits<float>::quiet_NaN());
      }
      Result<StepReport> expected = plain.Step(plain.Hyper(step));
      Result<StepReport> report = SpeculativeStep(speculative, speculative.Hyper(step));
      EXPECT_TRUE(expected.ok()) << expected.status().ToString();
      EXPECT_TRUE(report.ok()) << report.status().ToString();
      if (!expected.ok() || !report.ok()) return reports;
      EXPECT_EQ(report->skipped, expected->skipped);
      EXPECT_EQ(report->grad_norm, expected->grad_norm);
      EXPECT_EQ(report->steps_taken, expected->steps_taken);
      EXPECT_TRUE(speculative.Snapshot() == plain.Snapshot()) << "state differs after " << step;
      EXPECT_TRUE(speculative.params_bytes() == plain.params_bytes())
          << "parameters differ after step " << step;
      reports.push_back(*report);
    }
    if (totals != nullptr) *totals = speculative.group().speculation_stats();
    return reports;
  }
};

TEST_P(SpeculationTest, UnclippedFiniteStepsCommitEveryChunk) {
  const std::vector<StepReport> reports = RunBoth(/*max_grad_norm=*/0.0, 3);
  ASSERT_EQ(reports.size(), 3u);
  for (const StepReport& report : reports) {
    EXPECT_EQ(report.chunks_speculative, 7u) << "every chunk was completed by AccumulateGrad";
    EXPECT_EQ(report.chunks_committed, 7u);
    EXPECT_EQ(report.chunks_recomputed + report.chunks_discarded, 0u);
  }
}

// Clipping engages on the steps with full-size gradients (step 0 and 3), nowhere else.
TEST_P(SpeculationTest, ClippedStepsAreRecomputedFromTheUntouchedVersion) {
  const std::vector<StepReport> reports = RunBoth(/*max_grad_norm=*/150.0, 4);
  ASSERT_EQ(reports.size(), 4u);
  for (int step = 0; step < 4; ++step) {
    const bool clipped = step % 3 == 0;
    EXPECT_EQ(reports[step].chunks_recomputed, clipped ? 7u : 0u) << step;
    EXPECT_EQ(reports[step].chunks_committed, clipped ? 0u : 7u) << step;
  }
}

// Clipping on every step (a max_grad_norm below every step's norm): after each recompute the
// next 1, 2, 4, 8 Speculate calls decline, so steps 0, 2, 5 and 10 of 12 speculate; a declined
// step updates nothing early and still equals the plain step.
TEST_P(SpeculationTest, BackingOffDeclinesAfterEachRecomputeDoublingTheRun) {
  SpeculationStats totals;
  const std::vector<StepReport> reports =
      RunBoth(/*max_grad_norm=*/1e-3, 12, /*poisoned=*/-1, /*max_backoff=*/64, &totals);
  ASSERT_EQ(reports.size(), 12u);
  for (int step = 0; step < 12; ++step) {
    const bool speculates = step == 0 || step == 2 || step == 5 || step == 10;
    EXPECT_EQ(reports[step].chunks_speculative, speculates ? 7u : 0u) << step;
    EXPECT_EQ(reports[step].chunks_recomputed, speculates ? 7u : 0u) << step;
  }
  EXPECT_EQ(totals.steps, 4u);
  EXPECT_EQ(totals.steps_declined, 8u);
}

// Clipping on steps 0, 3 and 6 only: each recompute declines the next call, and the commit after
// it starts the back-off over, so the run never grows to two: steps 1 and 4 decline.
TEST_P(SpeculationTest, BackingOffStartsOverAfterACommit) {
  SpeculationStats totals;
  const std::vector<StepReport> reports =
      RunBoth(/*max_grad_norm=*/150.0, 7, /*poisoned=*/-1, /*max_backoff=*/64, &totals);
  ASSERT_EQ(reports.size(), 7u);
  for (int step = 0; step < 7; ++step) {
    const bool declined = step == 1 || step == 4;
    EXPECT_EQ(reports[step].chunks_speculative, declined ? 0u : 7u) << step;
    EXPECT_EQ(reports[step].chunks_committed, declined || step % 3 == 0 ? 0u : 7u) << step;
  }
  EXPECT_EQ(totals.steps, 5u);
  EXPECT_EQ(totals.steps_declined, 2u);
}

// The longest run of declined calls is max_speculation_backoff: with 2, clipping on every step
// speculates on steps 0, 2, 5, 8, 11.
TEST_P(SpeculationTest, BackingOffIsBoundedByTheOption) {
  SpeculationStats totals;
  const std::vector<StepReport> reports =
      RunBoth(/*max_grad_norm=*/1e-3, 12, /*poisoned=*/-1, /*max_backoff=*/2, &totals);
  ASSERT_EQ(reports.size(), 12u);
  for (int step = 0; step < 12; ++step) {
    const bool speculates = step == 0 || step == 2 || step == 5 || step == 8 || step == 11;
    EXPECT_EQ(reports[step].chunks_speculative, speculates ? 7u : 0u) << step;
  }
  EXPECT_EQ(totals.steps, 5u);
  EXPECT_EQ(totals.steps_declined, 7u);
}

TEST_P(SpeculationTest, NonFiniteGradientInTheLastChunkDiscardsTheStep) {
  const std::vector<StepReport> reports = RunBoth(/*max_grad_norm=*/0.0, 3, /*poisoned=*/1);
  ASSERT_EQ(reports.size(), 3u);
  EXPECT_TRUE(reports[1].skipped);
  EXPECT_EQ(reports[1].chunks_speculative, 7u);
  EXPECT_EQ(reports[1].chunks_discarded, 7u);
  EXPECT_EQ(reports[1].chunks_committed, 0u);
  EXPECT_EQ(reports[2].chunks_committed, 7u);
}

struct SpeculativeFault {
  const char* name;
  io::FaultKind kind;
  io::FaultOps ops;
  uint64_t nth;
  StatusCode code;
};

// A fault during a speculative step, with the placements that do I/O: NVMe chunks beside HOST
// ones (nvme_ratio 0.75: 5 of the 7 chunks on NVMe). Without clipping the step commits what was
// updated early; with clipping (max_grad_norm 150 engages on step 0) the Step recomputes every
// chunk from its untouched version, reading and writing each NVMe chunk again.
struct FaultCase {
  Placement placement;
  double max_grad_norm;
};
void PrintTo(const FaultCase& c, std::ostream* os) {
  *os << c.placement.name << (c.max_grad_norm > 0 ? "_clipped" : "");
}

class SpeculationFaultTest : public ::testing::TestWithParam<FaultCase> {
 protected:
  // Runs one speculative step with `fault` armed and checks: the Step reports it naming the
  // chunk, exactly one fault was injected, the state is the previous one, no step was taken, and
  // retrying the step (the gradients stay) matches the plain group bit for bit.
  void ExpectFaultLeavesThePreviousState(const SpeculativeFault& fault) {
    SCOPED_TRACE(fault.name);
    HarnessOptions options = SpeculationOptions(GetParam().placement, GetParam().max_grad_norm);
    GroupHarness plain(options);
    options.inject_faults = true;
    options.group.speculative = true;
    GroupHarness speculative(options);
    ASSERT_TRUE(plain.ok() && speculative.ok());
    plain.NewGradients(0);
    speculative.NewGradients(0);
    const testing::StateBits before = speculative.Snapshot();
    speculative.FailOnce(fault.kind, fault.ops, fault.nth);
    Result<StepReport> failed = SpeculativeStep(speculative, speculative.Hyper(0));
    ASSERT_EQ(failed.status().code(), fault.code) << failed.status().ToString();
    EXPECT_NE(failed.status().message().find("optimizer group 'g': chunk"), std::string::npos)
        << failed.status().ToString();
    EXPECT_EQ(speculative.faults()->injected(), 1u);
    EXPECT_TRUE(speculative.Snapshot() == before);
    EXPECT_EQ(speculative.group().steps_taken(), 0);
    const SpeculationStats& stats = speculative.group().speculation_stats();
    EXPECT_EQ(stats.steps, 1u);
    EXPECT_EQ(stats.chunks_committed, 0u);
    Result<StepReport> retried = speculative.StepAccumulated(speculative.Hyper(0));
    ASSERT_TRUE(retried.ok()) << retried.status().ToString();
    EXPECT_EQ(retried->chunks_speculative, 0u);
    Result<StepReport> expected = plain.Step(plain.Hyper(0));
    ASSERT_TRUE(expected.ok()) << expected.status().ToString();
    EXPECT_EQ(retried->grad_norm, expected->grad_norm);
    EXPECT_TRUE(speculative.Snapshot() == plain.Snapshot());
    EXPECT_TRUE(speculative.params_bytes() == plain.params_bytes());
  }
};

// A read, a write or a checksum of a speculative update fails -- found while AccumulateGrad goes
// on, or (the last write) only by the Step: the Step reports it naming the chunk, the state is
// the previous one, the gradients stay, and retrying the step matches the plain group.
TEST_P(SpeculationFaultTest, FaultDuringTheEarlyUpdatesLeavesThePreviousState) {
  const SpeculativeFault faults[] = {
      {"second write", io::FaultKind::kEio, io::FaultOps::kWrites, 2, StatusCode::kIoError},
      {"last write", io::FaultKind::kEnospc, io::FaultOps::kWrites, 5, StatusCode::kNoSpace},
      {"third read", io::FaultKind::kEio, io::FaultOps::kReads, 3, StatusCode::kIoError},
      {"corrupted read", io::FaultKind::kCorruption, io::FaultOps::kReads, 1,
       StatusCode::kCorruption},
  };
  for (const SpeculativeFault& fault : faults) ExpectFaultLeavesThePreviousState(fault);
}

// With clipping the early updates (reads and writes 1-5) are redone by the Step from the
// untouched version (reads and writes 6-10): a fault there leaves the previous state too.
class SpeculationRecomputeFaultTest : public SpeculationFaultTest {};

TEST_P(SpeculationRecomputeFaultTest, FaultDuringTheRecomputeLeavesThePreviousState) {
  const SpeculativeFault faults[] = {
      {"first recompute read", io::FaultKind::kEio, io::FaultOps::kReads, 6, StatusCode::kIoError},
      {"corrupted recompute read", io::FaultKind::kCorruption, io::FaultOps::kReads, 8,
       StatusCode::kCorruption},
      {"second recompute write", io::FaultKind::kEio, io::FaultOps::kWrites, 7,
       StatusCode::kIoError},
      {"last recompute write", io::FaultKind::kEnospc, io::FaultOps::kWrites, 10,
       StatusCode::kNoSpace},
  };
  for (const SpeculativeFault& fault : faults) ExpectFaultLeavesThePreviousState(fault);
}

std::string FaultCaseName(const ::testing::TestParamInfo<FaultCase>& info) {
  return std::string(info.param.placement.name) + (info.param.max_grad_norm > 0 ? "_clipped" : "");
}
constexpr Placement kNvmeFp32{"nvme_fp32", Tier::kNvme, 0.75, optim::DType::kFloat32};
constexpr Placement kNvmeBf16{"nvme_bf16", Tier::kNvme, 0.75, optim::DType::kBFloat16};

INSTANTIATE_TEST_SUITE_P(NvmeBesideHost, SpeculationFaultTest,
                         ::testing::Values(FaultCase{kNvmeFp32, 0.0}, FaultCase{kNvmeBf16, 0.0},
                                           FaultCase{kNvmeFp32, 150.0},
                                           FaultCase{kNvmeBf16, 150.0}),
                         FaultCaseName);
INSTANTIATE_TEST_SUITE_P(NvmeBesideHostClipped, SpeculationRecomputeFaultTest,
                         ::testing::Values(FaultCase{kNvmeFp32, 150.0},
                                           FaultCase{kNvmeBf16, 150.0}),
                         FaultCaseName);

TEST_P(SpeculationTest, TotalsAddUpOverSteps) {
  HarnessOptions options = SpeculationOptions(GetParam(), 150.0);
  options.group.speculative = true;
  GroupHarness harness(options);
  ASSERT_TRUE(harness.ok());
  for (int step = 0; step < 3; ++step) {
    harness.NewGradients(step);
    if (step == 2) harness.PoisonGradient(5, std::numeric_limits<float>::infinity());
    ASSERT_TRUE(SpeculativeStep(harness, harness.Hyper(step)).ok());
  }
  const SpeculationStats& stats = harness.group().speculation_stats();
  EXPECT_EQ(stats.steps, 3u);
  EXPECT_EQ(stats.chunks_speculative, 21u);
  EXPECT_EQ(stats.chunks_recomputed, 7u);  // step 0 clips
  EXPECT_EQ(stats.chunks_committed, 7u);
  EXPECT_EQ(stats.chunks_discarded, 7u);
}

INSTANTIATE_TEST_SUITE_P(
    Placements, SpeculationTest,
    ::testing::Values(Placement{"dram_fp32", Tier::kHost, 1.0, optim::DType::kFloat32},
                      Placement{"dram_bf16", Tier::kHost, 1.0, optim::DType::kBFloat16},
                      Placement{"nvme_fp32", Tier::kNvme, 0.75, optim::DType::kFloat32},
                      Placement{"nvme_bf16", Tier::kNvme, 0.75, optim::DType::kBFloat16}),
    [](const auto& param_info) { return std::string(param_info.param.name); });

// ---- segments without a gradient ---------------------------------------------------------------

// Segments of 100003 elements in chunks of 16384 (segment 1 holds chunk 1 whole; segment 3 ends
// mid-chunk), and which have a gradient at each step.
const std::vector<size_t> kSegments = {10000, 30000, 7, 19993, 40003};

std::vector<bool> PresentAt(int step) {
  return {true, step % 2 == 1, step >= 3, step % 3 != 0, true};
}

// The harness's gradients as views: a present segment whole, an absent one with null data.
std::vector<GradView> SegmentViews(const GroupHarness& harness, const std::vector<bool>& present) {
  std::vector<GradView> views;
  const auto* grads = reinterpret_cast<const float*>(harness.grads());
  size_t begin = 0;
  for (size_t s = 0; s < kSegments.size(); ++s) {
    views.push_back({present[s] ? grads + begin : nullptr, optim::DType::kFloat32, kSegments[s]});
    begin += kSegments[s];
  }
  return views;
}

// Chunks partly or wholly without a gradient: speculation updates, commits, recomputes and
// discards only what a plain step would touch, so the absent segments' state, parameters and
// step counts stay as they are.
TEST(SpeculationSegmentsTest, AbsentSegmentsMatchThePlainStep) {
  HarnessOptions options = SpeculationOptions({"nvme", Tier::kNvme, 0.75, optim::DType::kBFloat16},
                                              /*max_grad_norm=*/100.0);
  options.group.segments = kSegments;
  GroupHarness plain(options);
  options.group.speculative = true;
  GroupHarness speculative(options);
  ASSERT_TRUE(plain.ok() && speculative.ok());
  for (int step = 0; step < 6; ++step) {
    SCOPED_TRACE(step);
    plain.NewGradients(step);
    speculative.NewGradients(step);
    if (step == 4) {
      plain.PoisonGradient(1, std::numeric_limits<float>::quiet_NaN());
      speculative.PoisonGradient(1, std::numeric_limits<float>::quiet_NaN());
    }
    const std::vector<GradView> views = SegmentViews(plain, PresentAt(step));
    const std::vector<ParamView> plain_params = plain.param_views();
    StepArgs args;
    args.hyper = plain.Hyper(step);
    args.grads = views;
    args.params = plain_params;
    ASSERT_TRUE(plain.group().Step(args).ok());

    const std::vector<ParamView> params = speculative.param_views();
    args.grads = {};
    args.params = params;
    ASSERT_TRUE(speculative.group().Speculate(args).ok());
    const std::vector<GradView> spec_views = SegmentViews(speculative, PresentAt(step));
    size_t offset = speculative.count();
    for (size_t i = spec_views.size(); i-- > 0;) {
      offset -= spec_views[i].count;
      ASSERT_TRUE(speculative.group().AccumulateGrad(offset, spec_views[i]).ok());
    }
    Result<StepReport> report = speculative.group().Step(args);
    ASSERT_TRUE(report.ok()) << report.status().ToString();
    EXPECT_EQ(report->chunks_speculative,
              report->chunks_committed + report->chunks_recomputed + report->chunks_discarded);
    EXPECT_TRUE(speculative.Snapshot() == plain.Snapshot());
    EXPECT_TRUE(speculative.params_bytes() == plain.params_bytes());
    EXPECT_TRUE(
        std::ranges::equal(speculative.group().segment_steps(), plain.group().segment_steps()));
  }
  const SpeculationStats& stats = speculative.group().speculation_stats();
  EXPECT_GT(stats.chunks_committed, 0u);
  EXPECT_GT(stats.chunks_recomputed, 0u);
  EXPECT_GT(stats.chunks_discarded, 0u);
}

// ---- read-ahead --------------------------------------------------------------------------------

// Seven chunks, all on NVMe, through four pipeline buffers: two reads ahead at most.
HarnessOptions ReadAheadOptions() {
  HarnessOptions options =
      SpeculationOptions({"nvme", Tier::kNvme, 1.0, optim::DType::kFloat32}, 0.0);
  options.group.buffer_count = 4;
  return options;
}

// Speculate starts the reads of the two NVMe chunks whose gradients completed first in the last
// accumulation (two reads with four pipeline buffers, which still hold the four chunks written
// last), before any gradient comes. Gradients that then come in another order (first to last,
// while the reads of the last chunks are held) give the plain step's bits all the same, every
// chunk updated speculatively.
TEST(SpeculationReadAheadTest, ReadsOfTheExpectedChunksStartBeforeTheirGradients) {
  HarnessOptions options = ReadAheadOptions();
  GroupHarness plain(options);
  options.group.speculative = true;
  GroupHarness speculative(options);
  ASSERT_TRUE(plain.ok() && speculative.ok());
  ASSERT_EQ(speculative.group().nvme_chunk_count(), 7u);
  for (int step = 0; step < 4; ++step) {
    plain.NewGradients(step);
    speculative.NewGradients(step);
    const Arrival arrival = step == 2 ? Arrival::kFirstToLast : Arrival::kLastToFirst;
    const uint64_t requests = speculative.queue_stats().requests;
    const optim::HyperParams hyper = speculative.Hyper(step);
    ASSERT_TRUE(Speculate(speculative, hyper).ok());
    // Step 0 has no order to expect; the reads of step 3 expect step 2's first-to-last order.
    EXPECT_EQ(speculative.queue_stats().requests - requests, step == 0 ? 0u : 2u) << step;
    ASSERT_TRUE(AccumulateInOrder(speculative, arrival).ok());
    Result<StepReport> report = speculative.StepAccumulated(hyper);
    Result<StepReport> expected = plain.Step(plain.Hyper(step));
    ASSERT_TRUE(expected.ok()) << expected.status().ToString();
    ASSERT_TRUE(report.ok()) << report.status().ToString();
    EXPECT_EQ(report->chunks_committed, 7u);
    EXPECT_TRUE(speculative.Snapshot() == plain.Snapshot()) << "state differs after " << step;
    EXPECT_TRUE(speculative.params_bytes() == plain.params_bytes()) << step;
  }
}

// State written between Speculate and the first gradient: the reads already started ahead hold
// the state before it and are not the write's own, so the write drops them, and the speculative
// step matches a plain one on the written state.
TEST(SpeculationReadAheadTest, StateWrittenAfterSpeculateIsWhatTheStepUpdates) {
  HarnessOptions options = ReadAheadOptions();
  GroupHarness plain(options);
  options.group.speculative = true;
  GroupHarness speculative(options);
  ASSERT_TRUE(plain.ok() && speculative.ok());
  // Chunks 0 and 1, while the reads ahead are those of chunks 4 and 5 (completed first).
  const std::vector<float> written(2 * 16384, 0.25f);
  for (int step = 0; step < 3; ++step) {
    plain.NewGradients(step);
    speculative.NewGradients(step);
    const optim::HyperParams hyper = speculative.Hyper(step);
    ASSERT_TRUE(Speculate(speculative, hyper).ok());
    if (step > 0) {
      const uint64_t requests = speculative.queue_stats().requests;
      ASSERT_TRUE(speculative.group().WriteState(StateSlot::kExpAvg, 0, written).ok());
      ASSERT_TRUE(plain.group().WriteState(StateSlot::kExpAvg, 0, written).ok());
      EXPECT_GT(speculative.queue_stats().requests, requests);
    }
    ASSERT_TRUE(AccumulateInOrder(speculative, Arrival::kLastToFirst).ok());
    Result<StepReport> report = speculative.StepAccumulated(hyper);
    Result<StepReport> expected = plain.Step(plain.Hyper(step));
    ASSERT_TRUE(expected.ok()) << expected.status().ToString();
    ASSERT_TRUE(report.ok()) << report.status().ToString();
    EXPECT_TRUE(speculative.Snapshot() == plain.Snapshot()) << "state differs after " << step;
    EXPECT_TRUE(speculative.params_bytes() == plain.params_bytes()) << step;
  }
}

// ---- arguments and memory ---------------------------------------------------------------------

TEST(SpeculationArgsTest, RefusedWhereItCannotApply) {
  HarnessOptions options =
      SpeculationOptions({"nvme", Tier::kNvme, 1.0, optim::DType::kFloat32}, 0);
  GroupHarness off(options);
  ASSERT_TRUE(off.ok());
  StepArgs args;
  args.hyper = off.Hyper(0);
  Status refused = off.group().Speculate(args);
  EXPECT_EQ(refused.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(refused.message(),
            "optimizer group 'g': speculation is off; create the group with speculative on");

  options.group.speculative = true;
  GroupHarness on(options);
  ASSERT_TRUE(on.ok());
  on.NewGradients(0);
  const std::vector<GradView> grads = on.grad_views();
  args.grads = grads;
  EXPECT_EQ(on.group().Speculate(args).code(), StatusCode::kInvalidArgument);
  args.grads = {};
  args.loss_scale = 0.0;
  EXPECT_EQ(on.group().Speculate(args).code(), StatusCode::kInvalidArgument);
  args.loss_scale = 1.0;
  ASSERT_TRUE(on.group().AccumulateGrad(0, grads[0]).ok());
  EXPECT_EQ(on.group().Speculate(args).code(), StatusCode::kFailedPrecondition)
      << "gradients are already accumulated";
}

TEST(SpeculationArgsTest, AStepWithOtherParameterViewsIsRefusedAndChangesNothing) {
  HarnessOptions options =
      SpeculationOptions({"dram", Tier::kHost, 1.0, optim::DType::kFloat32}, 0);
  options.group.speculative = true;
  GroupHarness harness(options);
  ASSERT_TRUE(harness.ok());
  harness.NewGradients(0);
  StepArgs args;
  args.hyper = harness.Hyper(0);
  ASSERT_TRUE(harness.group().Speculate(args).ok());  // no parameter views
  ASSERT_TRUE(harness.AccumulateAll());
  const testing::StateBits before = harness.Snapshot();
  Result<StepReport> refused = harness.StepAccumulated(harness.Hyper(0));
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(harness.Snapshot() == before);
  args.params = {};
  Result<StepReport> done = harness.group().Step(args);
  ASSERT_TRUE(done.ok()) << done.status().ToString();
  EXPECT_EQ(done->chunks_committed, 7u);
}

TEST(SpeculationArgsTest, HostChunksTakeASpareFromThePinnedBudget) {
  HarnessOptions options =
      SpeculationOptions({"dram", Tier::kHost, 1.0, optim::DType::kFloat32}, 0);
  GroupHarness plain(options);
  options.group.speculative = true;
  GroupHarness speculative(options);
  ASSERT_TRUE(plain.ok() && speculative.ok());
  EXPECT_EQ(speculative.group().pinned_bytes(), 2 * plain.group().pinned_bytes());
  EXPECT_EQ(speculative.pinned().used_bytes(), 2 * plain.pinned().used_bytes());
  options.pinned_budget = plain.pinned().used_bytes() + 4096;
  GroupHarness tight(options, /*create=*/false);
  ASSERT_TRUE(tight.ok());
  Result<std::unique_ptr<OptimizerGroup>> refused = tight.CreateGroup(tight.group_options());
  EXPECT_EQ(refused.status().code(), StatusCode::kOutOfMemory);
}

}  // namespace
}  // namespace zoe::offload
