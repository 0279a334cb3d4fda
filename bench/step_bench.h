// The engine behind `zoe bench step`: times OptimizerGroup::Step on a group whose state lives on
// NVMe (or in pinned HOST memory) and, in the same run and on the same engine, chunk size and
// queue depth, the parts it overlaps: the same bytes read and written with no compute (io-only)
// and the same kernels on the same chunk sizes from memory (compute-only). With a baseline it
// also times, at the same pinned budget, the synchronous pattern of DeepSpeed's default optimizer
// swapper: for each sub-group, read master, exp_avg and exp_avg_sq from one file per tensor,
// update, write them back, and wait.
//
// Memory stays independent of the parameter count: gradients and initial parameters are one
// chunk-sized buffer that every view of the group points at.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "bench/io_wear.h"
#include "core/result.h"
#include "io/backend.h"
#include "offload/types.h"
#include "optim/types.h"

namespace zoe::cli {

struct StepBenchSpec {
  uint64_t params = uint64_t{256} << 20;
  offload::Tier offload = offload::Tier::kNvme;  // kNvme or kHost ("cpu")
  std::vector<std::string> paths;                // NVMe directories (striped when several)
  std::vector<optim::DType> moment_dtypes = {optim::DType::kFloat32};
  int steps = 3;   // timed steps (median reported)
  int warmup = 1;  // untimed steps before them
  uint32_t buffer_count = 4;
  // Exactly one decides the chunk size: chunk_elements, or else pinned_budget (bytes of pipeline
  // buffers: buffer_count chunks); both 0: a pinned budget of 384 MiB.
  uint64_t chunk_elements = 0;
  uint64_t pinned_budget = 0;
  io::BackendKind backend = io::BackendKind::kAuto;
  uint32_t iodepth = 32;
  unsigned threads = 0;  // kernel threads; 0: one per CPU
  bool baseline = false;
  // One group per entry, for each moment dtype, their steps taken in turn: true verifies a
  // checksum of every block read back from NVMe (the engine's default), false does not.
  std::vector<bool> checksums = {true};
  // > 0: also time whole iterations around an emulated backward pass of this many milliseconds
  // (StepBenchResult::iteration). The groups are then speculative (HOST chunks take a spare).
  double backward_ms = 0;
  double max_grad_norm = 0;  // > 0: the groups clip (the bench's gradients have a norm of ~0.6
                             // per Mi parameters, so a small value clips every step)
  uint32_t slots = 2;        // NVMe extents per chunk: 2 (atomic steps) or 1 (in place)
  // The wear projection: steps a day (empty: the measured step rate around the clock) and the
  // drive capacity in bytes (0: the size of the filesystem of each path).
  std::optional<double> steps_per_day;
  uint64_t drive_capacity = 0;
};

// InvalidArgument naming the first bad field.
Status ValidateStepSpec(const StepBenchSpec& spec);

// Where the baseline's pinned buffer comes from: allocated as DeepSpeed allocates its pinned
// tensors (page-aligned, mlock'ed 4 KiB pages), or from zoe's pinned pool (huge pages).
enum class BaselineMemory : uint8_t { kDeepSpeed, kZoe };

struct BaselineResult {
  BaselineMemory memory = BaselineMemory::kDeepSpeed;
  bool locked = false;  // the buffer is page-locked
  uint64_t subgroup_elements = 0;
  uint64_t pinned_bytes = 0;
  double seconds = 0;  // median per step
  uint64_t bytes_read = 0;
  uint64_t bytes_written = 0;
  uint64_t peak_rss_bytes = 0;
};

// Iterations (backward + step, median seconds) around a backward pass of backward_ms: over that
// time, a wait that leaves the CPU free as a GPU's backward does, the gradients become available
// chunk by chunk, last chunk first; then the step is called.
struct IterationResult {
  double after = 0;        // the step starts after backward (DeepSpeed's default)
  double overlap = 0;      // AccumulateGrad as gradients arrive: the state's reads start
  double speculative = 0;  // Speculate, then AccumulateGrad updates the chunks as they arrive
  double step_alone = 0;   // the step on its own (step_seconds)
  double bound = 0;        // max(backward, step alone): what hiding the step fully would give
  // Of the speculative iterations' chunks: updated speculatively, and recomputed (clipping).
  uint64_t chunks_speculative = 0;
  uint64_t chunks_recomputed = 0;
  // Speculative iterations whose Speculate the group declined, backing off after recomputes.
  uint64_t steps_declined = 0;
};

struct StepBenchResult {
  optim::DType moment_dtype = optim::DType::kFloat32;
  bool checksum = true;         // blocks read back from NVMe verified against their checksums
  uint64_t checksum_block = 0;  // bytes per checksum; 0 when off
  // The I/O-only, compute-only and baseline phases run once per moment dtype; every checksum
  // setting's row repeats them. peak_rss_bytes covers all the groups of a moment dtype.
  std::string backend;
  uint64_t chunk_elements = 0;
  uint64_t chunks = 0;
  uint64_t nvme_chunks = 0;
  double step_seconds = 0;  // median
  uint64_t bytes_read = 0;  // per step
  uint64_t bytes_written = 0;
  uint64_t bytes_reused = 0;   // state found in the pipeline buffers instead of read
  double io_wait_seconds = 0;  // the step's own accounting, at the median step
  double compute_seconds = 0;
  double io_only_seconds = 0;       // median
  double compute_only_seconds = 0;  // median
  uint64_t pinned_bytes = 0;
  uint64_t nvme_bytes = 0;
  uint64_t peak_rss_bytes = 0;  // while the group existed
  // Per NVMe path: bytes the timed steps wrote there (File::bytes_written), per step, and the
  // drive writes per day they project to.
  std::vector<WearProjection> wear;
  std::optional<BaselineResult> baseline;             // on DeepSpeed-style memory
  std::optional<BaselineResult> baseline_zoe_memory;  // the same loop on zoe's pinned memory
  std::optional<IterationResult> iteration;           // with backward_ms
};

struct StepBenchReport {
  StepBenchSpec spec;
  unsigned threads = 0;
  std::string isa;
  std::vector<StepBenchResult> results;  // per moment dtype, then per checksum setting
};

Result<StepBenchReport> RunStepBench(const StepBenchSpec& spec);

// schema_version 1: units in the names (seconds, bytes, gbytes_per_s = 1e9 bytes per second).
nlohmann::json StepReportJson(const StepBenchReport& report);
std::string StepReportTable(const nlohmann::json& json);

}  // namespace zoe::cli
