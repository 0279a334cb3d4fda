#include "reliability/campaign_run.h"

#include <fmt/format.h>
#include <stdlib.h>

#include <array>
#include <memory>
#include <utility>

#include "core/scratch_dir.h"
#include "core/vocabulary.h"

namespace zoe::reliability {

void Tally::Add(const std::string& name, const ForkedResult& result) {
  ++cases;
  if (result.exit != ExitKind::kNormal) {
    ++(result.exit == ExitKind::kHung ? hangs : crashes);
    problems.push_back(fmt::format("{}: {}", name, result.detail));
    return;
  }
  const Outcome& o = result.outcome;
  injected += o.injected_errors + o.injected_recoverable;
  reported += o.errors_reported;
  silent += o.silent_corruptions;
  refused += o.final_pass_ok ? 0 : 1;
  const bool swallowed_here = o.injected_errors > 0 && o.errors_reported == 0;
  const bool unexplained_here = o.injected_errors == 0 && o.errors_reported > 0;
  if (swallowed_here) swallowed += o.injected_errors;
  if (unexplained_here) unexplained += o.errors_reported;
  unexplained += o.other_errors;
  if (!unexplained_here && o.silent_corruptions == 0) recovered += o.injected_recoverable;
  const bool refused_here = o.completed && !o.final_pass_ok;
  const bool bad = swallowed_here || unexplained_here || o.other_errors > 0 ||
                   o.silent_corruptions > 0 || !o.completed || refused_here;
  if (bad) {
    problems.push_back(fmt::format(
        "{}: injected {} errors + {} recoverable, reported {}, other {}, silent {}{}{}: {} {}",
        name, o.injected_errors, o.injected_recoverable, o.errors_reported, o.other_errors,
        o.silent_corruptions, o.completed ? "" : ", did not complete",
        refused_here ? ", still failing after the faults stopped" : "", o.first_problem,
        o.first_error[0] != '\0' ? fmt::format("(first error: {})", o.first_error) : ""));
  }
}

void Tally::Merge(const Tally& other) {
  cases += other.cases;
  injected += other.injected;
  reported += other.reported;
  recovered += other.recovered;
  refused += other.refused;
  swallowed += other.swallowed;
  unexplained += other.unexplained;
  silent += other.silent;
  crashes += other.crashes;
  hangs += other.hangs;
  problems.insert(problems.end(), other.problems.begin(), other.problems.end());
}

bool Tally::Clean() const {
  return refused == 0 && swallowed == 0 && unexplained == 0 && silent == 0 && crashes == 0 &&
         hangs == 0;
}

std::string Tally::Table(const std::string& title) const {
  std::string out =
      fmt::format("\n{}{}\n", title,
                  SmallCampaign() ? " (small campaign: sanitizers or ZOE_CAMPAIGN_SMALL)" : "");
  out += fmt::format("  {:>6} {:>9} {:>9} {:>10} {:>8} {:>10} {:>12} {:>7} {:>8} {:>6}\n", "cases",
                     "injected", "reported", "recovered", "refused", "swallowed", "unexplained",
                     "silent", "crashes", "hangs");
  out += fmt::format("  {:>6} {:>9} {:>9} {:>10} {:>8} {:>10} {:>12} {:>7} {:>8} {:>6}\n", cases,
                     injected, reported, recovered, refused, swallowed, unexplained, silent,
                     crashes, hangs);
  for (const std::string& problem : problems) out += fmt::format("  ! {}\n", problem);
  return out;
}

namespace {

// Where the cases' scratch directories go: $TMPDIR, else /var/tmp.
std::string ScratchBase() {
  const char* tmp = std::getenv("TMPDIR");
  return fmt::format("{}/zoe-campaign-", tmp != nullptr && *tmp != '\0' ? tmp : "/var/tmp");
}

}  // namespace

ForkedResult RunCase(const FaultPlan& plan) {
  Result<std::unique_ptr<ScratchDir>> dir = ScratchDir::Create(ScratchBase());
  if (!dir.ok()) {
    return ForkedResult{ExitKind::kCrashed, {}, "no scratch directory: " + dir.status().ToString()};
  }
  const std::string path = (*dir)->path();  // removed after the child is gone
  return RunForked([&] { return RunWorkload(plan, path); }, kCaseDeadline);
}

// Indexed by io::FaultKind's value (core/vocabulary.h's mechanism).
constexpr std::array<std::string_view, 6> kFaultKindNames = {
    "EIO", "ENOSPC", "EINTR", "EAGAIN", "short transfer", "corrupted read"};
static_assert(kFaultKindNames.size() == static_cast<size_t>(io::FaultKind::kCorruption) + 1);

std::string_view FaultKindName(io::FaultKind kind) { return NameIn(kFaultKindNames, kind); }

std::string CountdownName(const Countdown& c) {
  const char* target = c.target == Target::kTensors     ? "tensor"
                       : c.target == Target::kOptimizer ? "optimizer"
                                                        : "checkpoint";
  return fmt::format("{} on {} {}", FaultKindName(c.kind), target,
                     c.ops == io::FaultOps::kAll     ? "I/O"
                     : c.ops == io::FaultOps::kReads ? "reads"
                                                     : "writes");
}

std::vector<Countdown> CampaignCountdowns() {
  using io::FaultKind;
  using io::FaultOps;
  return {
      {FaultKind::kEio, FaultOps::kAll, Target::kTensors},
      {FaultKind::kEio, FaultOps::kAll, Target::kOptimizer},
      {FaultKind::kEnospc, FaultOps::kWrites, Target::kTensors},
      {FaultKind::kEnospc, FaultOps::kWrites, Target::kOptimizer},
      {FaultKind::kShortTransfer, FaultOps::kAll, Target::kTensors},
      {FaultKind::kShortTransfer, FaultOps::kAll, Target::kOptimizer},
      {FaultKind::kCorruption, FaultOps::kReads, Target::kTensors},
      {FaultKind::kCorruption, FaultOps::kReads, Target::kOptimizer},
      {FaultKind::kEio, FaultOps::kAll, Target::kCheckpoint},
      {FaultKind::kEnospc, FaultOps::kWrites, Target::kCheckpoint},
      {FaultKind::kShortTransfer, FaultOps::kWrites, Target::kCheckpoint},
  };
}

CountdownResult RunCountdown(const Countdown& c, uint64_t limit) {
  CountdownResult result;
  for (uint64_t nth = 1; nth <= limit && !result.finished; ++nth) {
    FaultPlan plan;
    plan.seed = nth;
    plan.rules.push_back({c.target, io::FaultRule{c.kind, c.ops, nth, 0, 1}});
    const ForkedResult run = RunCase(plan);
    result.tally.Add(fmt::format("{} #{}", CountdownName(c), nth), run);
    const bool injected = run.exit != ExitKind::kNormal ||
                          run.outcome.injected_errors + run.outcome.injected_recoverable > 0;
    result.finished = !injected;
  }
  return result;
}

Tally RunOneInN(uint64_t seeds) {
  const std::pair<io::FaultKind, uint64_t> chances[] = {
      {io::FaultKind::kEio, 60},           {io::FaultKind::kEnospc, 80},
      {io::FaultKind::kShortTransfer, 12}, {io::FaultKind::kCorruption, 60},
      {io::FaultKind::kEintr, 25},         {io::FaultKind::kEagain, 25}};
  Tally tally;
  for (uint64_t seed = 1; seed <= seeds; ++seed) {
    FaultPlan plan;
    plan.seed = seed;
    plan.refuse_direct = seed % 2 == 0;
    for (const Target target : {Target::kTensors, Target::kOptimizer, Target::kCheckpoint}) {
      for (const auto& [kind, one_in] : chances) {
        const io::FaultOps ops = kind == io::FaultKind::kEnospc       ? io::FaultOps::kWrites
                                 : kind == io::FaultKind::kCorruption ? io::FaultOps::kReads
                                                                      : io::FaultOps::kAll;
        plan.rules.push_back({target, io::FaultRule{kind, ops, 0, one_in}});
      }
    }
    tally.Add(fmt::format("one-in-N seed {}", seed), RunCase(plan));
  }
  return tally;
}

}  // namespace zoe::reliability
