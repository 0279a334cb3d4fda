// The engine behind `zoe bench offload`: emulates training iterations over layers whose weights
// live on NVMe and are paged through the tier manager, under several prefetch/eviction policies,
// and measures the same bytes read without compute as the I/O-only peer.
//
// One iteration is forward over layers 0..L-1, then backward L-1..0. Each step acquires the layer's
// weights on DEVICE (the host stand-in where there is no GPU) for reading, "computes" for
// compute_ms, and releases them. Compute either sleeps (the default: the CPU stays free, so the
// measurement is about I/O scheduling; the last 0.5 ms spins so a late wake-up is not counted as
// compute) or spins on the clock throughout (a busy core, as a CPU-side framework would have).
//
// Policies:
//   none+lru   no trace: every acquire pulls its layer on demand; LRU eviction.
//   trace+lru  the first warm-up iteration records a trace; then prefetch by the trace (HOST and
//              DEVICE look-ahead) with LRU eviction.
//   trace+opt  the same, with eviction by farthest next use in the trace (Belady/OPT).
// Each policy runs on a fresh tier manager over fresh swap files, with the layers written once
// before its first iteration (not measured).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/result.h"
#include "io/backend.h"
#include "offload/stats.h"

namespace zoe::cli {

enum class ComputeMode { kSleep, kSpin };

struct OffloadBenchSpec {
  uint32_t layers = 32;
  uint64_t layer_bytes = uint64_t{64} << 20;
  uint32_t device_budget_layers = 4;
  uint32_t host_budget_layers = 8;  // pinned HOST memory, inclusive of the device copies
  double compute_ms = 50;
  ComputeMode compute = ComputeMode::kSleep;
  uint32_t warmup = 1;  // the first one records the trace
  uint32_t iterations = 3;
  std::string dir;  // swap files go here
  io::BackendKind backend = io::BackendKind::kAuto;
  uint32_t queue_depth = 32;
  uint32_t lookahead_layers = 0;  // 0: host_budget_layers - 1
  uint32_t prefetch_in_flight = 4;
  std::vector<std::string> policies = {"none+lru", "trace+lru", "trace+opt"};
};

Status ValidateOffloadSpec(const OffloadBenchSpec& spec);

// Per-iteration means of the tier manager's counters over the measured iterations.
struct PolicyTraffic {
  double nvme_to_host_bytes = 0;
  double host_to_nvme_bytes = 0;
  double host_to_device_bytes = 0;
  double device_to_host_bytes = 0;
  double prefetches_issued = 0;
  double prefetch_hits = 0;
  double prefetch_misses = 0;
};

struct PolicyResult {
  std::string policy;
  std::vector<double> iteration_seconds;  // each measured iteration
  std::vector<double> stall_seconds;      // time spent waiting inside acquire, per iteration
  // Wall time inside Acquire (the stall plus the bookkeeping and prefetch issue done there) and
  // inside Release, per iteration.
  std::vector<double> acquire_seconds;
  std::vector<double> release_seconds;
  std::vector<double> compute_seconds;  // measured: at least 2 * L * compute_ms
  double median_iteration_seconds = 0;
  double median_stall_seconds = 0;
  double median_acquire_seconds = 0;
  double median_release_seconds = 0;
  double median_compute_seconds = 0;
  PolicyTraffic traffic;
  double hit_rate = 0;           // hits / (hits + misses)
  double io_only_seconds = 0;    // nvme_to_host_bytes at the I/O-only bandwidth
  double peak_host_bytes = 0;    // never above the HOST budget
  double peak_device_bytes = 0;  // never above the DEVICE budget
};

// The peer: the layers of one iteration (forward then backward, 2L reads of layer_bytes) read
// straight from swap files through the same I/O backend and queue depth, with
// prefetch_in_flight reads in flight, no compute, no tier manager.
struct IoOnlyResult {
  std::string backend;
  uint64_t bytes = 0;  // per pass
  double seconds = 0;  // median pass
  double bytes_per_s = 0;
};

struct OffloadBenchResult {
  OffloadBenchSpec spec;
  std::string io_backend;
  std::string device;
  double compute_seconds = 0;  // 2 * L * compute_ms
  IoOnlyResult io_only;
  std::vector<PolicyResult> policies;
};

Result<OffloadBenchResult> RunOffloadBench(const OffloadBenchSpec& spec);

// The median of the samples (the mean of the middle two for an even count); 0 when empty.
double MedianOf(std::vector<double> samples);

}  // namespace zoe::cli
