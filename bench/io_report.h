// Output of `zoe bench io`: a human table (GB/s and GiB/s, IOPS, latency percentiles in µs,
// backend, O_DIRECT, buffer memory) and the JSON document with schema_version 1.
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "bench/io_bench.h"
#include "bench/io_fio.h"

namespace zoe::cli {

struct IoBenchRow {
  IoBenchResult zoe;
  std::optional<FioResult> fio;
};

std::string FormatBytes(uint64_t bytes);  // "1 MiB", "256 KiB", "1536 B"
std::string FormatTable(const std::vector<IoBenchRow>& rows);
// {"schema_version":1,"jobs":[{"rw","bs","iodepth","jobs","backend","direct","bytes",
//  "buffer_bytes","bw_bytes","iops","lat_us":{"p50","p90","p99","p99.9","max"}}]}; a job run
// with --compare-fio also has "fio": {"ioengine","bw_bytes","iops","buffer_bytes","lat_us",
// "ratio"} where ratio = zoe bw_bytes / fio bw_bytes.
nlohmann::ordered_json ToJson(const std::vector<IoBenchRow>& rows);

}  // namespace zoe::cli
