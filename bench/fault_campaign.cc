// zoe fault-campaign: the fault campaign of tests/reliability run from the command line -- every
// countdown (fail operation 1, 2, ... of one fault kind on one target until the workload runs
// clean) and the one-in-N runs with seeds -- each case in a forked child, with its table printed
// as it finishes and a total at the end. Exit status 1 when a table is not clean (a swallowed or
// unexplained error, a silent corruption, a crash or a hang).
#include <fmt/format.h>

#include <cstdio>
#include <memory>
#include <string>

#include "bench/command.h"
#include "reliability/campaign_run.h"

namespace zoe::cli {
namespace {

struct CampaignCliOptions {
  uint64_t countdown_limit = 2000;
  uint64_t seeds = 40;
  bool no_countdown = false;
  bool no_one_in_n = false;
};

void PrintTable(const reliability::Tally& tally, const std::string& title) {
  std::fputs(tally.Table(title).c_str(), stdout);
  std::fflush(stdout);
}

void Run(const CampaignCliOptions& o) {
  reliability::Tally total;
  if (!o.no_countdown) {
    for (const reliability::Countdown& c : reliability::CampaignCountdowns()) {
      const reliability::CountdownResult result = reliability::RunCountdown(c, o.countdown_limit);
      PrintTable(result.tally,
                 fmt::format("countdown: {} ({} runs{})", reliability::CountdownName(c),
                             result.tally.cases,
                             result.finished ? ", the last one clean" : ", range limit reached"));
      total.Merge(result.tally);
    }
  }
  if (!o.no_one_in_n) {
    const reliability::Tally tally = reliability::RunOneInN(o.seeds);
    PrintTable(tally, fmt::format("one in N: every kind on every target, {} seeds", o.seeds));
    total.Merge(tally);
  }
  // The total repeats no problems: each was printed under its own table.
  reliability::Tally summary = total;
  summary.problems.clear();
  PrintTable(summary, fmt::format("total: {}", summary.Clean() ? "clean" : "NOT CLEAN"));
  if (!total.Clean()) SetExitCode(1);
}

void Attach(CLI::App& root) {
  auto o = std::make_shared<CampaignCliOptions>();
  CLI::App* cmd = root.add_subcommand(
      "fault-campaign",
      "inject EIO, ENOSPC, short transfers, corrupted reads, EINTR/EAGAIN and refused O_DIRECT "
      "into a seeded workload and check that every error reaches the caller and no data is "
      "silently corrupted");
  cmd->add_option("--countdown-limit", o->countdown_limit,
                  "operations each countdown fails at most (1, 2, ... until a run is clean)")
      ->check(CLI::Range(uint64_t{1}, uint64_t{1} << 20));
  cmd->add_option("--seeds", o->seeds, "seeds of the one-in-N runs")
      ->check(CLI::Range(uint64_t{0}, uint64_t{1} << 20));
  cmd->add_flag("--no-countdown", o->no_countdown, "skip the countdowns");
  cmd->add_flag("--no-one-in-n", o->no_one_in_n, "skip the one-in-N runs");
  cmd->callback([o] { Run(*o); });
}

const CommandRegistrar kRegistrar{Command{Parent::kRoot, Attach}};

}  // namespace
}  // namespace zoe::cli
