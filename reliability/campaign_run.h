// The fault campaign as a whole: the countdowns (fail operation 1, then 2, ... of one kind on one
// target until a run completes clean) and the one-in-N runs with seeds, each case a forked run of
// the workload (campaign.h) in a scratch directory, tallied into the campaign's table. Used by
// tests/reliability/fault_campaign_test.cc, which expects a clean table, and by
// `zoe fault-campaign`, which prints it.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "reliability/campaign.h"

namespace zoe::reliability {

inline constexpr std::chrono::milliseconds kCaseDeadline{60'000};

// What was injected and what became of it, over many cases.
struct Tally {
  uint64_t cases = 0;
  uint64_t injected = 0;     // every fault, recoverable or not
  uint64_t reported = 0;     // calls that returned the error an injected fault causes
  uint64_t recovered = 0;    // recoverable faults absorbed with the data still right
  uint64_t refused = 0;      // runs whose engine still failed after the faults stopped
  uint64_t swallowed = 0;    // error faults in runs where no call reported an error
  uint64_t unexplained = 0;  // errors no injected fault explains, or of an unexpected code
  uint64_t silent = 0;       // acknowledged data that differs from the shadow
  uint64_t crashes = 0;
  uint64_t hangs = 0;
  std::vector<std::string> problems;

  void Add(const std::string& name, const ForkedResult& result);
  void Merge(const Tally& other);
  // No run refusing work after the faults stopped, no swallowed or unexplained error, silent
  // corruption, crash or hang.
  bool Clean() const;
  // The table under `title`, then a line per problem ("!").
  std::string Table(const std::string& title) const;
};

// Runs the workload with `plan` in a fresh scratch directory in a forked child.
ForkedResult RunCase(const FaultPlan& plan);

std::string_view FaultKindName(io::FaultKind kind);

struct Countdown {
  io::FaultKind kind;
  io::FaultOps ops;
  Target target;
};
std::string CountdownName(const Countdown& c);  // "EIO on optimizer I/O"

// Every countdown the campaign runs: each kind on each target it applies to.
std::vector<Countdown> CampaignCountdowns();

struct CountdownResult {
  Tally tally;
  bool finished = false;  // a run injected nothing: the workload completed clean
};
// Fails operation 1, 2, ... up to `limit` of the countdown's target, one fault per run, until a
// run injects nothing.
CountdownResult RunCountdown(const Countdown& c, uint64_t limit);

// Every kind at once on every target, each with its own chance, O_DIRECT refused in every other
// run; seeds 1..`seeds`.
Tally RunOneInN(uint64_t seeds);

}  // namespace zoe::reliability
