// Running fio with the same parameters as a `zoe bench io` job, on the same files, so the two
// figures come from the same machine state in the same invocation.
#pragma once

#include <string>
#include <vector>

#include "bench/io_bench.h"
#include "core/result.h"

namespace zoe::cli {

struct FioResult {
  std::string ioengine;
  std::string command;
  double bw_bytes = 0;
  double iops = 0;
  uint64_t buffer_bytes = 0;  // fio allocates iodepth x bs per job
  LatencyUs lat;              // fio's completion latency percentiles, and max total latency
};

// The fio path when fio is on PATH; empty otherwise.
std::string FindFio();

// The fio ioengine matching a zoe backend: io_uring, libaio or psync.
std::string FioEngineFor(const std::string& zoe_backend);

// fio's command line for `spec` on `files` (one list per job; a job with several files is given
// them all, which fio visits round robin rather than striping).
std::vector<std::string> FioArguments(const std::string& fio, const IoBenchSpec& spec,
                                      const std::string& ioengine,
                                      const std::vector<std::vector<std::string>>& files);

// Parses fio's --output-format=json for a group-reported job.
Result<FioResult> ParseFioJson(const std::string& text, bool write);

Result<FioResult> RunFio(const IoBenchSpec& spec, const std::string& zoe_backend,
                         const std::vector<std::vector<std::string>>& files);

}  // namespace zoe::cli
