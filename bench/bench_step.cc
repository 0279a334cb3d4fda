// zoe bench step: the offloaded optimizer step (OptimizerGroup::Step) against its own I/O-only
// and compute-only times measured in the same run, and optionally against a DeepSpeed-style
// synchronous swapper at the same pinned budget (bench/step_bench.h).
#include <fmt/format.h>

#include <algorithm>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "bench/command.h"
#include "bench/step_bench.h"
#include "core/config.h"
#include "core/vocabulary.h"

namespace zoe::cli {
namespace {

struct StepCliOptions {
  std::string params = "256M";
  std::string offload = "nvme";
  std::vector<std::string> paths;
  std::string moment_dtype = "fp32";
  int steps = 3;
  int warmup = 1;
  uint32_t buffer_count = 4;
  std::string chunk_elements;
  std::string pinned_budget;
  std::string backend = "auto";
  uint32_t iodepth = 32;
  unsigned threads = 0;
  bool baseline = false;
  std::vector<std::string> checksum = {"on"};
  uint32_t slots = 2;
  std::optional<double> steps_per_day;
  std::string drive_capacity;
  std::string output_format = "text";
  double backward_ms = 0;
  double max_grad_norm = 0;
};

// "fp32", "bf16", "int8" or a comma list of them (each run in turn); "both" is fp32,bf16.
Result<std::vector<optim::DType>> ParseMomentDTypes(const std::string& list) {
  if (list == "both")
    return std::vector<optim::DType>{optim::DType::kFloat32, optim::DType::kBFloat16};
  std::vector<optim::DType> dtypes;
  size_t begin = 0;
  while (begin <= list.size()) {
    const size_t comma = std::min(list.find(',', begin), list.size());
    const std::string word = list.substr(begin, comma - begin);
    if (std::find(kMomentDTypeNames.begin(), kMomentDTypeNames.end(), word) ==
        kMomentDTypeNames.end()) {
      return Status::InvalidArgument(fmt::format(
          "--moment-dtype: '{}' is not a moment dtype; allowed: {}, a comma list of them (e.g. "
          "{}), or both (fp32,bf16)",
          word, JoinNames(kMomentDTypeNames), fmt::join(kMomentDTypeNames, ",")));
    }
    ZOE_ASSIGN_OR_RETURN(optim::DType dtype, ParseDType(word));
    dtypes.push_back(dtype);
    begin = comma + 1;
  }
  return dtypes;
}

Result<StepBenchSpec> ToSpec(const StepCliOptions& o) {
  StepBenchSpec spec;
  ZOE_ASSIGN_OR_RETURN(spec.params, config::ParseSizeString(o.params));
  spec.offload = o.offload == "cpu" ? offload::Tier::kHost : offload::Tier::kNvme;
  spec.paths = o.paths;
  ZOE_ASSIGN_OR_RETURN(spec.moment_dtypes, ParseMomentDTypes(o.moment_dtype));
  spec.steps = o.steps;
  spec.warmup = o.warmup;
  spec.buffer_count = o.buffer_count;
  if (!o.chunk_elements.empty()) {
    ZOE_ASSIGN_OR_RETURN(spec.chunk_elements, config::ParseSizeString(o.chunk_elements));
  }
  if (!o.pinned_budget.empty()) {
    ZOE_ASSIGN_OR_RETURN(spec.pinned_budget, config::ParseSizeString(o.pinned_budget));
  }
  ZOE_ASSIGN_OR_RETURN(spec.backend, io::ParseBackend(o.backend));
  spec.iodepth = o.iodepth;
  spec.threads = o.threads;
  spec.baseline = o.baseline;
  spec.checksums.clear();
  for (const std::string& word : o.checksum) spec.checksums.push_back(word == "on");
  spec.backward_ms = o.backward_ms;
  spec.max_grad_norm = o.max_grad_norm;
  spec.slots = o.slots;
  spec.steps_per_day = o.steps_per_day;
  if (!o.drive_capacity.empty()) {
    ZOE_ASSIGN_OR_RETURN(spec.drive_capacity, config::ParseSizeString(o.drive_capacity));
    if (spec.drive_capacity == 0) {
      return Status::InvalidArgument("--drive-capacity 0; allowed: a size > 0 (e.g. 1.6TB)");
    }
  }
  ZOE_RETURN_IF_ERROR(ValidateStepSpec(spec));
  return spec;
}

void Attach(CLI::App& bench) {
  auto o = std::make_shared<StepCliOptions>();
  CLI::App* cmd = bench.add_subcommand(
      "step", "offloaded optimizer step vs its I/O-only and compute-only time");
  cmd->add_option("--params", o->params, "parameters in the group (e.g. 256M, 1G; binary units)");
  cmd->add_option("--offload", o->offload, "where the state lives: nvme or cpu (pinned DRAM)")
      ->check(CLI::IsMember({"nvme", "cpu"}));
  cmd->add_option("--path", o->paths,
                  "directory for the NVMe state (repeat to stripe); default: a temporary "
                  "directory under /var/tmp");
  cmd->add_option("--moment-dtype", o->moment_dtype,
                  "fp32, bf16, int8, or a comma list of them run in turn (e.g. fp32,bf16,int8); "
                  "both = fp32,bf16");
  cmd->add_option("--steps", o->steps, "timed steps (median reported)");
  cmd->add_option("--warmup", o->warmup, "untimed steps before them");
  cmd->add_option("--buffer-count", o->buffer_count, "pinned pipeline buffers (>= 2)");
  auto* chunk = cmd->add_option("--chunk-elements", o->chunk_elements,
                                "elements per chunk (a multiple of 4096)");
  cmd->add_option("--pinned-budget", o->pinned_budget,
                  "bytes of pipeline buffers; sets the chunk size (default 384M)")
      ->excludes(chunk);
  cmd->add_option("--backend", o->backend, "io_uring, libaio, psync or auto");
  cmd->add_option("--iodepth", o->iodepth, "I/O queue depth");
  cmd->add_option("--threads", o->threads, "kernel threads (0: one per CPU)");
  cmd->add_flag("--baseline", o->baseline,
                "also run a synchronous DeepSpeed-style swapper at the same pinned budget");
  cmd->add_option("--checksum", o->checksum,
                  "verify checksums of the state read back: on (default), off, or on,off: two "
                  "groups stepped in turn, the cost of checksums measured in one run")
      ->delimiter(',')
      ->check(CLI::IsMember({"on", "off"}));
  cmd->add_option("--backward-ms", o->backward_ms,
                  "also time iterations around an emulated backward of this many ms: the step "
                  "after it, overlapped with it, and speculative (0: off)");
  cmd->add_option("--max-grad-norm", o->max_grad_norm,
                  "clip the gradients' global norm to this (0: no clipping)");
  cmd->add_option("--slots", o->slots,
                  "NVMe extents per chunk: 2 (default, atomic steps) or 1 (in place, half the "
                  "space; a failed step needs a checkpoint load)")
      ->check(CLI::IsMember({1, 2}));
  cmd->add_option("--steps-per-day", o->steps_per_day,
                  "step rate for the SSD wear projection (default: the measured step time "
                  "around the clock)");
  cmd->add_option("--drive-capacity", o->drive_capacity,
                  "drive capacity for drive writes per day, e.g. 1.6TB (default: the size of "
                  "the filesystem of each --path)");
  cmd->add_option("--output-format", o->output_format, "text or json")
      ->check(CLI::IsMember({"text", "table", "json"}));
  cmd->callback([o] {
    Result<StepBenchSpec> spec = ToSpec(*o);
    Result<StepBenchReport> report =
        spec.ok() ? RunStepBench(*spec) : Result<StepBenchReport>(spec.status());
    if (!report.ok()) {
      std::cerr << "zoe bench step: " << report.status().ToString() << "\n";
      SetExitCode(1);
      return;
    }
    const nlohmann::json json = StepReportJson(*report);
    if (o->output_format == "json") {
      std::cout << json.dump(1) << "\n";
    } else {
      std::cout << StepReportTable(json);
    }
  });
}

const CommandRegistrar kRegistrar{Command{Parent::kBench, Attach}};

}  // namespace
}  // namespace zoe::cli
