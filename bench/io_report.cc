#include "bench/io_report.h"

#include <fmt/format.h>

namespace zoe::cli {
namespace {

constexpr const char* kHeader =
    "{:<10} {:>8} {:>7} {:>4} {:<9} {:<6} {:>8} {:>8} {:>10} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} "
    "{:>9}\n";

std::string Line(const std::string& rw, const std::string& bs, const std::string& qd,
                 const std::string& jobs, const std::string& backend, const std::string& direct,
                 double bw, double iops, const LatencyUs& lat, uint64_t buffer,
                 const std::string& ratio) {
  return fmt::format(kHeader, rw, bs, qd, jobs, backend, direct, fmt::format("{:.3f}", bw / 1e9),
                     fmt::format("{:.3f}", bw / (1u << 30)), fmt::format("{:.1f}", iops),
                     fmt::format("{:.0f}", lat.p50), fmt::format("{:.0f}", lat.p90),
                     fmt::format("{:.0f}", lat.p99), fmt::format("{:.0f}", lat.p999),
                     fmt::format("{:.0f}", lat.max), FormatBytes(buffer), ratio);
}

nlohmann::ordered_json LatencyJson(const LatencyUs& lat) {
  return {
      {"p50", lat.p50}, {"p90", lat.p90}, {"p99", lat.p99}, {"p99.9", lat.p999}, {"max", lat.max}};
}

}  // namespace

std::string FormatBytes(uint64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int unit = 0;
  while (unit < 4 && bytes >= 1024 && bytes % 1024 == 0) {
    bytes /= 1024;
    ++unit;
  }
  return fmt::format("{} {}", bytes, units[unit]);
}

std::string FormatTable(const std::vector<IoBenchRow>& rows) {
  std::string out =
      fmt::format(kHeader, "rw", "bs", "iodepth", "jobs", "backend", "direct", "GB/s", "GiB/s",
                  "IOPS", "p50 µs", "p90 µs", "p99 µs", "p99.9 µs", "max µs", "buffer", "zoe/fio");
  for (const IoBenchRow& row : rows) {
    const IoBenchResult& r = row.zoe;
    const std::string ratio = row.fio && row.fio->bw_bytes > 0
                                  ? fmt::format("{:.2f}", r.bw_bytes / row.fio->bw_bytes)
                                  : "";
    out += Line(r.spec.rw, FormatBytes(r.spec.bs), std::to_string(r.spec.iodepth),
                std::to_string(r.spec.jobs), r.backend, r.direct ? "yes" : "no", r.bw_bytes, r.iops,
                r.lat, r.buffer_bytes, ratio);
    if (row.fio) {
      const FioResult& f = *row.fio;
      out += Line("  fio", "", "", "", f.ioengine, r.spec.direct ? "yes" : "no", f.bw_bytes, f.iops,
                  f.lat, f.buffer_bytes, "");
    }
  }
  return out;
}

nlohmann::ordered_json ToJson(const std::vector<IoBenchRow>& rows) {
  nlohmann::ordered_json jobs = nlohmann::ordered_json::array();
  for (const IoBenchRow& row : rows) {
    const IoBenchResult& r = row.zoe;
    nlohmann::ordered_json job = {{"rw", r.spec.rw},
                                  {"bs", r.spec.bs},
                                  {"iodepth", r.spec.iodepth},
                                  {"jobs", r.spec.jobs},
                                  {"backend", r.backend},
                                  {"direct", r.direct},
                                  {"bytes", r.bytes},
                                  {"buffer_bytes", r.buffer_bytes},
                                  {"bw_bytes", r.bw_bytes},
                                  {"iops", r.iops},
                                  {"lat_us", LatencyJson(r.lat)}};
    if (row.fio) {
      const FioResult& f = *row.fio;
      job["fio"] = {{"ioengine", f.ioengine},
                    {"bw_bytes", f.bw_bytes},
                    {"iops", f.iops},
                    {"buffer_bytes", f.buffer_bytes},
                    {"lat_us", LatencyJson(f.lat)},
                    {"ratio", f.bw_bytes > 0 ? r.bw_bytes / f.bw_bytes : 0.0}};
    }
    jobs.push_back(std::move(job));
  }
  return {{"schema_version", 1}, {"jobs", std::move(jobs)}};
}

}  // namespace zoe::cli
