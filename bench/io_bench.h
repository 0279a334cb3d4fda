// The engine behind `zoe bench io`: runs one fio-like job (sequential or random reads or writes
// of fixed-size blocks at a given queue depth) through io::IoQueue on temporary files, and
// measures throughput and per-request latency.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/result.h"
#include "io/backend.h"

namespace zoe::cli {

struct IoBenchSpec {
  std::string rw = "read";  // read | write | randread | randwrite
  uint64_t bs = 1 << 20;    // bytes per request
  uint32_t iodepth = 16;    // requests in flight per job
  uint32_t jobs = 1;        // independent jobs (threads), each with its own file(s) and queue
  uint64_t size = uint64_t{1} << 30;  // bytes per job (one pass unless runtime_s is set)
  std::vector<std::string> dirs;      // directories; several stripe each job's file set
  uint64_t stripe_unit = 1 << 20;
  io::BackendKind backend = io::BackendKind::kAuto;
  bool direct = true;
  bool verify = false;   // xxh3 per block: verified on every read; writes are read back
  double runtime_s = 0;  // > 0: run for this long, wrapping around the file
  // Free slots gathered before they are refilled in one SubmitBatch (a batch of contiguous
  // requests reaches the block layer together and is merged there); 0: iodepth / 4.
  uint32_t submit_batch = 0;
};

// Expands sweep axes such as {"bs=256K,1M", "iodepth=4,16"} into the grid of specs, the first
// axis varying slowest. Keys: bs, iodepth, jobs, submit_batch, rw, backend. Every spec of the
// grid is validated; a bad axis, key or value is InvalidArgument naming it.
Result<std::vector<IoBenchSpec>> ExpandSweep(const IoBenchSpec& base,
                                             const std::vector<std::string>& axes);

struct LatencyUs {
  double p50 = 0, p90 = 0, p99 = 0, p999 = 0, max = 0;
};

struct IoBenchResult {
  IoBenchSpec spec;
  std::string backend;        // the backend that ran
  bool direct = false;        // whether O_DIRECT was active on every file
  uint64_t bytes = 0;         // bytes transferred in the measured phase
  uint64_t buffer_bytes = 0;  // I/O buffer memory used: jobs x iodepth x bs
  double seconds = 0;
  double bw_bytes = 0;  // bytes per second
  double iops = 0;
  LatencyUs lat;
};

bool IsWrite(const std::string& rw);
bool IsRandom(const std::string& rw);
Status ValidateSpec(const IoBenchSpec& spec);

struct BenchJob;

// A prepared run: every job's files opened and laid out (each block written once, not measured),
// ready to be measured, and measured again, with peer tools run on the same files in between.
// The files are removed on destruction.
class IoBench {
 public:
  static Result<std::unique_ptr<IoBench>> Prepare(const IoBenchSpec& spec);
  ~IoBench();

  // The paths of each job's files (one per --path).
  std::vector<std::vector<std::string>> files() const;
  // The backend the jobs' queues run on.
  std::string backend() const;
  // Runs the measured phase of every job at once.
  Result<IoBenchResult> Measure();

 private:
  explicit IoBench(IoBenchSpec spec);

  IoBenchSpec spec_;
  std::vector<std::unique_ptr<BenchJob>> jobs_;
};

// Prepare, then Measure once.
Result<IoBenchResult> RunIoBench(const IoBenchSpec& spec);

// Percentiles of latencies in nanoseconds, in microseconds (nearest rank).
LatencyUs Percentiles(std::vector<uint64_t> latencies_ns);

}  // namespace zoe::cli
