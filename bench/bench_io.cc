// `zoe bench io`: fio-like throughput and latency of zoe's I/O engine on temporary files, with
// a parameter sweep, a side-by-side fio run and a tuning mode that prints a zoe config block.
#include <fmt/format.h>
#include <stdlib.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <iostream>
#include <map>
#include <sstream>

#include "bench/command.h"
#include "bench/io_bench.h"
#include "bench/io_fio.h"
#include "bench/io_report.h"
#include "core/config.h"
#include "core/scratch_dir.h"

namespace zoe::cli {
namespace {

struct IoCommandOptions {
  std::string rw = "read";
  std::string bs = "1M";
  uint32_t iodepth = 16;
  uint32_t jobs = 1;
  std::string size = "1G";
  std::vector<std::string> paths;
  std::string stripe = "1M";
  std::string backend = "auto";
  int direct = 1;
  std::string verify;
  double runtime = 0;
  uint32_t submit_batch = 0;
  std::vector<std::string> sweep;
  std::string output_format = "table";
  bool compare_fio = false;
  bool tune = false;
};

// --runtime and --stripe, refused with the rule when they cannot be run (a negative or NaN
// runtime ran one pass; a stripe unit off the 4 KiB grid failed deep in the striping).
Status CheckRuntimeAndStripe(double runtime, uint64_t stripe_unit) {
  if (!(runtime >= 0) || !std::isfinite(runtime)) {
    return Status::InvalidArgument(fmt::format(
        "--runtime {} is not allowed; allowed: seconds > 0, or 0 for one pass", runtime));
  }
  if (stripe_unit == 0 || stripe_unit % 4096 != 0) {
    return Status::InvalidArgument(fmt::format(
        "--stripe {} bytes is not allowed; allowed: a positive multiple of 4096 (4K, 1M, ...)",
        stripe_unit));
  }
  return Status::Ok();
}

Result<IoBenchSpec> BaseSpec(const IoCommandOptions& o, const std::vector<std::string>& dirs) {
  IoBenchSpec spec;
  spec.rw = o.rw;
  ZOE_ASSIGN_OR_RETURN(spec.bs, config::ParseSizeString(o.bs));
  ZOE_ASSIGN_OR_RETURN(spec.size, config::ParseSizeString(o.size));
  ZOE_ASSIGN_OR_RETURN(spec.stripe_unit, config::ParseSizeString(o.stripe));
  ZOE_RETURN_IF_ERROR(CheckRuntimeAndStripe(o.runtime, spec.stripe_unit));
  ZOE_ASSIGN_OR_RETURN(spec.backend, io::ParseBackend(o.backend));
  spec.iodepth = o.iodepth;
  spec.jobs = o.jobs;
  spec.dirs = dirs;
  spec.direct = o.direct != 0;
  spec.verify = !o.verify.empty();
  spec.runtime_s = o.runtime;
  spec.submit_batch = o.submit_batch;
  return spec;
}

void Progress(size_t done, size_t total, const IoBenchSpec& spec) {
  constexpr size_t kWidth = 30;
  const size_t filled = total == 0 ? kWidth : done * kWidth / total;
  std::cerr << fmt::format("\r[{}{}] {}/{} {} bs={} iodepth={} jobs={}   ",
                           std::string(filled, '#'), std::string(kWidth - filled, ' '), done, total,
                           spec.rw, FormatBytes(spec.bs), spec.iodepth, spec.jobs)
            << std::flush;
  if (done == total) std::cerr << "\n";
}

FioResult MeanOf(const FioResult& a, const FioResult& b) {
  FioResult out = a;
  auto mean = [](double x, double y) { return (x + y) / 2; };
  out.bw_bytes = mean(a.bw_bytes, b.bw_bytes);
  out.iops = mean(a.iops, b.iops);
  out.lat =
      LatencyUs{mean(a.lat.p50, b.lat.p50), mean(a.lat.p90, b.lat.p90), mean(a.lat.p99, b.lat.p99),
                mean(a.lat.p999, b.lat.p999), std::max(a.lat.max, b.lat.max)};
  return out;
}

// With --compare-fio, fio runs on the same files right before and right after zoe, and its
// figures are the mean of the two runs, so neither tool gains from running second (the host
// below a virtual disk may cache what was just read or written).
Result<IoBenchRow> RunOne(const IoBenchSpec& spec, bool compare_fio) {
  ZOE_ASSIGN_OR_RETURN(auto bench, IoBench::Prepare(spec));
  if (!compare_fio) {
    ZOE_ASSIGN_OR_RETURN(IoBenchResult result, bench->Measure());
    return IoBenchRow{std::move(result), std::nullopt};
  }
  ZOE_ASSIGN_OR_RETURN(FioResult before, RunFio(spec, bench->backend(), bench->files()));
  ZOE_ASSIGN_OR_RETURN(IoBenchResult result, bench->Measure());
  ZOE_ASSIGN_OR_RETURN(FioResult after, RunFio(spec, bench->backend(), bench->files()));
  return IoBenchRow{std::move(result), MeanOf(before, after)};
}

Result<std::vector<IoBenchRow>> RunGrid(const std::vector<IoBenchSpec>& grid, bool compare_fio,
                                        bool progress) {
  std::vector<IoBenchRow> rows;
  for (size_t i = 0; i < grid.size(); ++i) {
    if (progress) Progress(i, grid.size(), grid[i]);
    ZOE_ASSIGN_OR_RETURN(IoBenchRow row, RunOne(grid[i], compare_fio));
    rows.push_back(std::move(row));
  }
  if (progress) Progress(grid.size(), grid.size(), grid.back());
  return rows;
}

std::string DescribeDirs(const std::vector<std::string>& dirs) {
  std::string out;
  for (const std::string& dir : dirs) {
    Result<io::PathInfo> info = io::ProbePath(dir);
    out +=
        info.ok() ? io::FormatPathInfo(*info) : "  " + dir + ": " + info.status().ToString() + "\n";
  }
  return out;
}

// Sweeps block size and queue depth for sequential reads and writes and prints the setting with
// the best geometric mean of the two as a zoe "aio" config block.
std::string TuneReport(const std::vector<IoBenchRow>& rows) {
  std::map<std::pair<uint64_t, uint32_t>, std::pair<double, double>>
      by_setting;  // (bs, qd) -> (read, write)
  std::string backend;
  bool direct = true;
  for (const IoBenchRow& row : rows) {
    auto& entry = by_setting[{row.zoe.spec.bs, row.zoe.spec.iodepth}];
    (IsWrite(row.zoe.spec.rw) ? entry.second : entry.first) = row.zoe.bw_bytes;
    backend = row.zoe.backend;
    direct = direct && row.zoe.direct;
  }
  std::pair<uint64_t, uint32_t> best{};
  double best_score = -1;
  for (const auto& [setting, bw] : by_setting) {
    const double score = std::sqrt(bw.first * bw.second);
    if (score > best_score) {
      best_score = score;
      best = setting;
    }
  }
  const auto& bw = by_setting[best];
  return fmt::format(
      "best: block_size {}, queue_depth {} (read {:.3f} GB/s, write {:.3f} GB/s)\n"
      "paste into the zoe config:\n"
      "\"aio\": {{\n"
      "  \"backend\": \"{}\",\n"
      "  \"block_size\": {},\n"
      "  \"queue_depth\": {},\n"
      "  \"intra_op_parallelism\": 1,\n"
      "  \"single_submit\": false,\n"
      "  \"overlap_events\": true,\n"
      "  \"use_direct\": {}\n"
      "}}\n",
      FormatBytes(best.first), best.second, bw.first / 1e9, bw.second / 1e9, backend, best.first,
      best.second, direct ? "true" : "false");
}

Status Run(IoCommandOptions o) {
  std::unique_ptr<ScratchDir> scratch;
  std::vector<std::string> dirs = o.paths;
  if (dirs.empty()) {
    ZOE_ASSIGN_OR_RETURN(scratch, ScratchDir::Create("/tmp/zoe-bench."));
    dirs.push_back(scratch->path());
  }
  ZOE_ASSIGN_OR_RETURN(IoBenchSpec base, BaseSpec(o, dirs));
  std::vector<std::string> axes = o.sweep;
  if (o.tune) axes = {"rw=write,read", "bs=256K,1M,4M", "iodepth=4,16,32,64"};
  ZOE_ASSIGN_OR_RETURN(std::vector<IoBenchSpec> grid, ExpandSweep(base, axes));
  const bool json = o.output_format == "json";
  const bool progress = grid.size() > 1 && !json;
  ZOE_ASSIGN_OR_RETURN(std::vector<IoBenchRow> rows, RunGrid(grid, o.compare_fio, progress));
  if (json) {
    std::cout << ToJson(rows).dump(2) << "\n";
    return Status::Ok();
  }
  std::cout << "zoe bench io on:\n" << DescribeDirs(dirs) << FormatTable(rows);
  if (o.compare_fio) {
    for (const IoBenchRow& row : rows) {
      if (row.fio) std::cout << "fio command: " << row.fio->command << "\n";
    }
  }
  if (o.tune) std::cout << TuneReport(rows);
  return Status::Ok();
}

void Attach(CLI::App& bench) {
  auto options = std::make_shared<IoCommandOptions>();
  CLI::App* cmd = bench.add_subcommand("io", "measure block I/O throughput and latency (fio-like)");
  cmd->add_option("--rw", options->rw, "read | write | randread | randwrite")
      ->check(CLI::IsMember({"read", "write", "randread", "randwrite"}));
  cmd->add_option("--bs", options->bs, "bytes per request (4K, 1M, ...)");
  cmd->add_option("--iodepth", options->iodepth, "requests in flight per job")
      ->check(CLI::Range(1, 4096));
  cmd->add_option("--jobs", options->jobs, "independent jobs, each with its own files")
      ->check(CLI::Range(1, 256));
  cmd->add_option("--size", options->size, "bytes per job");
  cmd->add_option("--path", options->paths,
                  "directory for the temporary test files; repeat or comma-separate to stripe "
                  "(default: a temporary directory under /tmp)")
      ->delimiter(',');
  cmd->add_option("--stripe", options->stripe, "stripe unit when several --path are given");
  cmd->add_option("--backend", options->backend, "auto | io_uring | libaio | psync")
      ->check(CLI::IsMember({"auto", "io_uring", "libaio", "psync"}));
  cmd->add_option("--direct", options->direct,
                  "1: O_DIRECT (buffered fallback where refused); 0: page cache")
      ->check(CLI::Range(0, 1));
  cmd->add_option("--verify", options->verify, "xxh3: checksum every block")
      ->check(CLI::IsMember({"xxh3"}));
  cmd->add_option("--runtime", options->runtime,
                  "seconds to run, wrapping around the file (default: one pass)");
  cmd->add_option(
         "--submit-batch", options->submit_batch,
         "completed requests gathered before refilling them in one submission (default iodepth/4)")
      ->check(CLI::Range(0, 4096));
  cmd->add_option("--sweep", options->sweep,
                  "grid to run, e.g. --sweep bs=256K,1M,4M iodepth=4,16,64");
  cmd->add_option("--output-format", options->output_format, "table | json")
      ->check(CLI::IsMember({"table", "json"}));
  cmd->add_flag("--compare-fio", options->compare_fio,
                "also run fio with the same parameters on the same files");
  cmd->add_flag("--tune", options->tune,
                "sweep block size and queue depth and print the best as a zoe config block");
  cmd->callback([options] {
    Status status = Run(*options);
    if (!status.ok()) {
      std::cerr << "zoe bench io: " << status.ToString() << "\n";
      SetExitCode(1);
    }
  });
}

const CommandRegistrar kRegisterIo(Command{Parent::kBench, Attach});

}  // namespace
}  // namespace zoe::cli
