// Description: the fault campaign -- the workload of campaign.h run in forked children with EIO,
// ENOSPC, short transfers, corrupted reads, EINTR/EAGAIN and refused O_DIRECT injected, by
// countdown (fail the 1st operation, then the 2nd, ... until a run completes clean) and one in N
// with seeds; each test prints its table and fails on a swallowed error, an error no fault
// explains, a silent corruption, an engine still failing after the faults stopped, a crash or a
// hang.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <ostream>
#include <string>
#include <vector>

#include "reliability/campaign_run.h"

namespace zoe::reliability {

// Found by argument-dependent lookup (so outside the unnamed namespace): a failing case names its
// countdown instead of printing its bytes.
void PrintTo(const Countdown& c, std::ostream* os) { *os << CountdownName(c); }

namespace {

// A campaign table must be clean: every injected error reached a caller, every error is
// explained by a fault, no acknowledged data differs from the shadow, the engine works again
// once the faults stop, nothing crashed or hung.
void ExpectClean(const Tally& tally) {
  EXPECT_EQ(tally.refused, 0u) << "an engine still failed after the faults stopped";
  EXPECT_EQ(tally.swallowed, 0u) << "an injected error never reached a caller";
  EXPECT_EQ(tally.unexplained, 0u) << "a call failed with an error no injected fault explains";
  EXPECT_EQ(tally.silent, 0u) << "acknowledged data differs from the shadow";
  EXPECT_EQ(tally.crashes, 0u);
  EXPECT_EQ(tally.hangs, 0u);
  EXPECT_TRUE(tally.Clean());
}

void Print(const Tally& tally, const std::string& title) {
  fmt::print("{}", tally.Table(title));
  std::fflush(stdout);
}

// ---- the workload without faults ----------------------------------------------------------------

TEST(FaultCampaign, WorkloadRunsCleanWithoutFaults) {
  for (const bool refuse_direct : {false, true}) {
    FaultPlan plan;
    plan.refuse_direct = refuse_direct;
    const ForkedResult result = RunCase(plan);
    ASSERT_EQ(result.exit, ExitKind::kNormal) << result.detail;
    const Outcome& o = result.outcome;
    EXPECT_TRUE(o.completed);
    EXPECT_TRUE(o.final_pass_ok) << o.first_problem;
    EXPECT_EQ(o.errors_reported + o.other_errors, 0u) << o.first_problem;
    EXPECT_EQ(o.silent_corruptions, 0u) << o.first_problem;
    EXPECT_EQ(o.injected_errors, 0u);
    EXPECT_GT(o.requests, 50u);  // the workload does reach the disk
  }
}

// The runner itself: a child that crashes or hangs is counted as such, not taken for a result.
TEST(FaultCampaign, RunnerCountsCrashesAndHangs) {
  const ForkedResult crashed = RunForked([]() -> Outcome { std::abort(); }, kCaseDeadline);
  EXPECT_EQ(crashed.exit, ExitKind::kCrashed);
  EXPECT_NE(crashed.detail.find("signal"), std::string::npos) << crashed.detail;
  const ForkedResult hung = RunForked(
      []() -> Outcome {
        for (;;) ::pause();
      },
      std::chrono::milliseconds(200));
  EXPECT_EQ(hung.exit, ExitKind::kHung);
  const ForkedResult normal = RunForked([] { return Outcome{.requests = 42}; }, kCaseDeadline);
  EXPECT_EQ(normal.exit, ExitKind::kNormal);
  EXPECT_EQ(normal.outcome.requests, 42u);
}

// A run that completed but whose engine still failed once the faults stopped is not clean, even
// when every injected error was reported: the engine must work again after the faults.
TEST(FaultCampaign, AnEngineStillFailingAfterTheFaultsIsNotClean) {
  ForkedResult refused;
  refused.outcome = Outcome{.requests = 10,
                            .injected_errors = 1,
                            .errors_reported = 1,
                            .completed = true,
                            .final_pass_ok = false};
  std::snprintf(refused.outcome.first_problem, sizeof(refused.outcome.first_problem), "%s",
                "final pass: read tensor 3 failed");
  Tally tally;
  tally.Add("EIO on tensor I/O, operation 4", refused);
  EXPECT_EQ(tally.refused, 1u);
  EXPECT_FALSE(tally.Clean());
  ASSERT_EQ(tally.problems.size(), 1u);
  EXPECT_NE(tally.problems[0].find("still failing after the faults stopped"), std::string::npos)
      << tally.problems[0];
  ForkedResult recovered = refused;
  recovered.outcome.final_pass_ok = true;
  Tally clean;
  clean.Add("EIO on tensor I/O, operation 4", recovered);
  EXPECT_TRUE(clean.Clean());
}

// ---- countdown ------------------------------------------------------------------------------

class FaultCountdown : public ::testing::TestWithParam<Countdown> {};

// Fails operation 1, then 2, 3, ... of the target (one fault per run) until a run injects nothing:
// the workload then completed clean. The small campaign stops after 12 operations.
TEST_P(FaultCountdown, EveryOperationFailsInTurn) {
  const Countdown& c = GetParam();
  const CountdownResult result = RunCountdown(c, SmallCampaign() ? 12 : 2000);
  Print(result.tally,
        fmt::format("countdown: {} ({} runs{})", CountdownName(c), result.tally.cases,
                    result.finished ? ", the last one clean" : ", range limit reached"));
  ExpectClean(result.tally);
  if (!SmallCampaign()) {
    EXPECT_TRUE(result.finished) << "more operations than the countdown's limit";
  }
  EXPECT_GT(result.tally.injected, 0u);
}

INSTANTIATE_TEST_SUITE_P(Campaign, FaultCountdown, ::testing::ValuesIn(CampaignCountdowns()),
                         [](const ::testing::TestParamInfo<Countdown>& param_info) {
                           std::string name = CountdownName(param_info.param);
                           for (char& ch : name) {
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           }
                           return name;
                         });

// ---- one in N -------------------------------------------------------------------------------

// Every kind at once on every target, each with its own chance, and O_DIRECT refused in every
// other run; seeds 1..40 (8 in the small campaign, ZOE_CAMPAIGN_SEEDS when set).
TEST(FaultCampaign, OneInNWithSeeds) {
  const char* wanted = std::getenv("ZOE_CAMPAIGN_SEEDS");
  const uint64_t seeds = wanted != nullptr ? std::strtoull(wanted, nullptr, 10)
                         : SmallCampaign() ? 8
                                           : 40;
  const Tally tally = RunOneInN(seeds);
  Print(tally, fmt::format("one in N: every kind on every target, {} seeds", seeds));
  ExpectClean(tally);
  EXPECT_GT(tally.injected, seeds);
}

}  // namespace
}  // namespace zoe::reliability
