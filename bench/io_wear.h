// SSD wear of an offloaded optimizer step: from the bytes a step writes to each NVMe path, the
// bytes written per day at a given step rate and the drive writes per day (DWPD, the endurance
// unit drive makers rate SSDs in: a drive's capacity written once a day) for a drive capacity.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/result.h"

namespace zoe::cli {

inline constexpr double kSecondsPerDay = 86400.0;

struct WearInput {
  std::string path;
  uint64_t bytes_written_per_step = 0;
  uint64_t drive_capacity_bytes = 0;  // > 0
  double steps_per_day = 0.0;         // >= 0
};

struct WearProjection {
  std::string path;
  uint64_t bytes_written_per_step = 0;
  uint64_t drive_capacity_bytes = 0;
  double steps_per_day = 0.0;
  double bytes_written_per_day = 0.0;  // bytes_written_per_step * steps_per_day
  double drive_writes_per_day = 0.0;   // bytes_written_per_day / drive_capacity_bytes
};

// InvalidArgument naming the path when the capacity is 0 or the step rate negative or not finite.
Result<WearProjection> ProjectWear(const WearInput& input);

// Steps a day when a step of `step_seconds` (> 0) runs around the clock.
double StepsPerDayAt(double step_seconds);

// The size of the filesystem holding `path` (statvfs: f_blocks * f_frsize), the default drive
// capacity. IoError naming the path when statvfs fails.
Result<uint64_t> FilesystemBytes(const std::string& path);

// {"path", "bytes_written_per_step", "drive_capacity_bytes", "steps_per_day",
//  "bytes_written_per_day", "drive_writes_per_day"}
nlohmann::json WearJson(const WearProjection& wear);

}  // namespace zoe::cli
