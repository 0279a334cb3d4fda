// `zoe bench offload`: emulated training iterations over layers paged from NVMe through the tier
// manager, for the policies none+lru, trace+lru and trace+opt, against the I/O-only time of the
// same bytes and the total compute time measured in the same run (see bench/offload_bench.h).
#include <fmt/format.h>
#include <stdlib.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>

#include "bench/command.h"
#include "bench/offload_bench.h"
#include "core/config.h"
#include "core/scratch_dir.h"

namespace zoe::cli {
namespace {

struct OffloadCommandOptions {
  uint32_t layers = 32;
  std::string layer_bytes = "64M";
  uint32_t device_budget = 4;
  uint32_t host_budget = 8;
  double compute_ms = 50;
  std::string compute = "sleep";
  uint32_t warmup = 1;
  uint32_t iterations = 3;
  std::string path;
  std::string backend = "auto";
  uint32_t queue_depth = 32;
  uint32_t lookahead = 0;
  uint32_t prefetch_in_flight = 4;
  std::vector<std::string> policies = {"none+lru", "trace+lru", "trace+opt"};
  std::string output_format = "table";
};

Result<OffloadBenchSpec> MakeSpec(const OffloadCommandOptions& o, const std::string& dir) {
  OffloadBenchSpec spec;
  spec.layers = o.layers;
  ZOE_ASSIGN_OR_RETURN(spec.layer_bytes, config::ParseSizeString(o.layer_bytes));
  spec.device_budget_layers = o.device_budget;
  spec.host_budget_layers = o.host_budget;
  spec.compute_ms = o.compute_ms;
  spec.compute = o.compute == "spin" ? ComputeMode::kSpin : ComputeMode::kSleep;
  spec.warmup = o.warmup;
  spec.iterations = o.iterations;
  spec.dir = dir;
  ZOE_ASSIGN_OR_RETURN(spec.backend, io::ParseBackend(o.backend));
  spec.queue_depth = o.queue_depth;
  spec.lookahead_layers = o.lookahead;
  spec.prefetch_in_flight = o.prefetch_in_flight;
  spec.policies = o.policies;
  ZOE_RETURN_IF_ERROR(ValidateOffloadSpec(spec));
  return spec;
}

const PolicyResult* FindPolicy(const OffloadBenchResult& r, const std::string& name) {
  for (const PolicyResult& p : r.policies)
    if (p.policy == name) return &p;
  return nullptr;
}

// The targets, where the policies they compare were run.
nlohmann::json Targets(const OffloadBenchResult& r) {
  nlohmann::json targets = nlohmann::json::object();
  const PolicyResult* none = FindPolicy(r, "none+lru");
  const PolicyResult* lru = FindPolicy(r, "trace+lru");
  const PolicyResult* opt = FindPolicy(r, "trace+opt");
  if (opt == nullptr) return targets;
  const double bound = std::max(r.compute_seconds, opt->io_only_seconds);
  targets["iteration_over_bound"] = opt->median_iteration_seconds / bound;
  targets["iteration_within_1_1x_bound"] = opt->median_iteration_seconds <= 1.1 * bound;
  if (none != nullptr) {
    const double ratio = none->median_stall_seconds > 0
                             ? opt->median_stall_seconds / none->median_stall_seconds
                             : 0.0;
    targets["stall_over_none_lru"] = ratio;
    targets["stall_at_most_0_1x_none_lru"] =
        opt->median_stall_seconds <= 0.1 * none->median_stall_seconds;
  }
  if (lru != nullptr) {
    targets["nvme_read_bytes_over_trace_lru"] =
        lru->traffic.nvme_to_host_bytes > 0
            ? opt->traffic.nvme_to_host_bytes / lru->traffic.nvme_to_host_bytes
            : 0.0;
    targets["reads_no_more_than_trace_lru"] =
        opt->traffic.nvme_to_host_bytes <= lru->traffic.nvme_to_host_bytes;
  }
  return targets;
}

nlohmann::json ToJson(const OffloadBenchResult& r) {
  const OffloadBenchSpec& s = r.spec;
  nlohmann::json policies = nlohmann::json::array();
  for (const PolicyResult& p : r.policies) {
    const PolicyTraffic& t = p.traffic;
    policies.push_back(
        {{"policy", p.policy},
         {"iteration_seconds", p.median_iteration_seconds},
         {"iteration_seconds_each", p.iteration_seconds},
         {"stall_seconds", p.median_stall_seconds},
         {"stall_seconds_each", p.stall_seconds},
         {"acquire_seconds", p.median_acquire_seconds},
         {"release_seconds", p.median_release_seconds},
         {"compute_seconds_measured", p.median_compute_seconds},
         {"io_only_seconds", p.io_only_seconds},
         {"bound_seconds", std::max(r.compute_seconds, p.io_only_seconds)},
         {"bytes_per_iteration",
          {{"nvme_to_host", t.nvme_to_host_bytes},
           {"host_to_nvme", t.host_to_nvme_bytes},
           {"host_to_device", t.host_to_device_bytes},
           {"device_to_host", t.device_to_host_bytes}}},
         {"prefetch",
          {{"issued", t.prefetches_issued},
           {"hits", t.prefetch_hits},
           {"misses", t.prefetch_misses},
           {"hit_rate", p.hit_rate}}},
         {"peak_occupancy_bytes", {{"host", p.peak_host_bytes}, {"device", p.peak_device_bytes}}}});
  }
  return {
      {"schema_version", 1},
      {"config",
       {{"layers", s.layers},
        {"layer_bytes", s.layer_bytes},
        {"device_budget_layers", s.device_budget_layers},
        {"host_budget_layers", s.host_budget_layers},
        {"compute_ms", s.compute_ms},
        {"compute", s.compute == ComputeMode::kSleep ? "sleep" : "spin"},
        {"warmup", s.warmup},
        {"iterations", s.iterations},
        {"queue_depth", s.queue_depth},
        {"lookahead_layers", s.lookahead_layers ? s.lookahead_layers : s.host_budget_layers - 1},
        {"prefetch_in_flight", s.prefetch_in_flight},
        {"path", s.dir},
        {"io_backend", r.io_backend},
        {"device", r.device}}},
      {"compute_seconds", r.compute_seconds},
      {"io_only",
       {{"backend", r.io_only.backend},
        {"bytes", r.io_only.bytes},
        {"seconds", r.io_only.seconds},
        {"bytes_per_s", r.io_only.bytes_per_s}}},
      {"results", policies},
      {"targets", Targets(r)}};
}

void PrintTable(const OffloadBenchResult& r) {
  const OffloadBenchSpec& s = r.spec;
  fmt::print(
      "{} layers x {:.1f} MiB, device budget {} layers, host budget {} layers, compute {} ms per "
      "layer ({}), I/O through {}, device: {}\n",
      s.layers, static_cast<double>(s.layer_bytes) / (1 << 20), s.device_budget_layers,
      s.host_budget_layers, s.compute_ms, s.compute == ComputeMode::kSleep ? "sleep" : "spin",
      r.io_backend, r.device);
  fmt::print("total compute {:.3f} s; I/O only: {:.3f} s for {:.1f} MiB (fwd+bwd), {:.2f} GB/s\n",
             r.compute_seconds, r.io_only.seconds, static_cast<double>(r.io_only.bytes) / (1 << 20),
             r.io_only.bytes_per_s / 1e9);
  fmt::print("{:<10} {:>8} {:>8} {:>9} {:>9} {:>9} {:>7} {:>11} {:>11} {:>11} {:>7}\n", "policy",
             "iter s", "stall s", "acquire s", "release s", "io-only s", "x bound", "nvme->host",
             "host->dev", "host->nvme", "hits");
  for (const PolicyResult& p : r.policies) {
    const double bound = std::max(r.compute_seconds, p.io_only_seconds);
    fmt::print(
        "{:<10} {:>8.3f} {:>8.3f} {:>9.3f} {:>9.3f} {:>9.3f} {:>7.2f} {:>7.0f} MiB {:>7.0f} MiB "
        "{:>7.0f} MiB {:>6.1f}%\n",
        p.policy, p.median_iteration_seconds, p.median_stall_seconds, p.median_acquire_seconds,
        p.median_release_seconds, p.io_only_seconds, p.median_iteration_seconds / bound,
        p.traffic.nvme_to_host_bytes / (1 << 20), p.traffic.host_to_device_bytes / (1 << 20),
        p.traffic.host_to_nvme_bytes / (1 << 20), 100 * p.hit_rate);
  }
  const nlohmann::json targets = Targets(r);
  if (targets.contains("stall_over_none_lru")) {
    fmt::print("trace+opt stall / none+lru stall: {:.3f} (target <= 0.1)\n",
               targets["stall_over_none_lru"].get<double>());
  }
  if (targets.contains("iteration_over_bound")) {
    fmt::print("trace+opt iteration / max(compute, io-only): {:.3f} (target <= 1.1)\n",
               targets["iteration_over_bound"].get<double>());
  }
  if (targets.contains("nvme_read_bytes_over_trace_lru")) {
    fmt::print("trace+opt NVMe reads / trace+lru NVMe reads: {:.3f} (target <= 1)\n",
               targets["nvme_read_bytes_over_trace_lru"].get<double>());
  }
}

void Run(const OffloadCommandOptions& options) {
  std::unique_ptr<ScratchDir> scratch;
  std::string dir = options.path;
  if (dir.empty()) {
    Result<std::unique_ptr<ScratchDir>> created = ScratchDir::Create("/var/tmp/zoe-bench-offload.");
    if (!created.ok()) {
      std::cerr << "zoe bench offload: " << created.status().ToString() << "\n";
      SetExitCode(1);
      return;
    }
    scratch = std::move(*created);
    dir = scratch->path();
  }
  Result<OffloadBenchSpec> spec = MakeSpec(options, dir);
  Result<OffloadBenchResult> result =
      spec.ok() ? RunOffloadBench(*spec) : Result<OffloadBenchResult>(spec.status());
  if (!result.ok()) {
    std::cerr << "zoe bench offload: " << result.status().ToString() << "\n";
    SetExitCode(1);
    return;
  }
  if (options.output_format == "json") {
    std::cout << ToJson(*result).dump(1) << "\n";
  } else {
    PrintTable(*result);
  }
}

void Attach(CLI::App& bench) {
  auto o = std::make_shared<OffloadCommandOptions>();
  CLI::App* cmd = bench.add_subcommand(
      "offload", "training iterations over layers paged from NVMe, per prefetch/eviction policy");
  cmd->add_option("--layers", o->layers, "layers in the emulated model");
  cmd->add_option("--layer-bytes", o->layer_bytes, "weights per layer (e.g. 64M)");
  cmd->add_option("--device-budget", o->device_budget, "device memory, in layers");
  cmd->add_option("--host-budget", o->host_budget,
                  "pinned host memory, in layers (more than --device-budget)");
  cmd->add_option("--compute-ms", o->compute_ms, "compute per layer and pass, in milliseconds");
  cmd->add_option("--compute", o->compute, "how compute passes the time: sleep or spin")
      ->check(CLI::IsMember({"sleep", "spin"}));
  cmd->add_option("--warmup", o->warmup, "untimed iterations per policy (the first records)");
  cmd->add_option("--iterations", o->iterations, "timed iterations per policy (median reported)");
  cmd->add_option("--path", o->path, "directory for the swap files (default: under /var/tmp)");
  cmd->add_option("--backend", o->backend, "I/O backend: auto, io_uring, libaio or psync");
  cmd->add_option("--queue-depth", o->queue_depth, "I/O engine queue depth");
  cmd->add_option("--lookahead", o->lookahead,
                  "prefetch look-ahead in layers (default: host budget - 1)");
  cmd->add_option("--prefetch-in-flight", o->prefetch_in_flight,
                  "prefetches in flight at once (each for HOST and DEVICE)");
  cmd->add_option("--policy", o->policies, "none+lru, trace+lru, trace+opt (repeatable)");
  cmd->add_option("--output-format", o->output_format, "table or json")
      ->check(CLI::IsMember({"table", "json"}));
  cmd->callback([o] { Run(*o); });
}

const CommandRegistrar kRegistrar{Command{Parent::kBench, Attach}};

}  // namespace
}  // namespace zoe::cli
