#include "bench/io_wear.h"

#include <fmt/format.h>
#include <sys/statvfs.h>

#include <cerrno>
#include <cmath>

namespace zoe::cli {

Result<WearProjection> ProjectWear(const WearInput& input) {
  if (input.drive_capacity_bytes == 0) {
    return Status::InvalidArgument(fmt::format(
        "wear of {}: drive capacity 0 bytes; allowed: > 0 (--drive-capacity)", input.path));
  }
  if (!(input.steps_per_day >= 0.0) || !std::isfinite(input.steps_per_day)) {
    return Status::InvalidArgument(
        fmt::format("wear of {}: {} steps per day; allowed: a finite number >= 0 "
                    "(--steps-per-day)",
                    input.path, input.steps_per_day));
  }
  WearProjection wear;
  wear.path = input.path;
  wear.bytes_written_per_step = input.bytes_written_per_step;
  wear.drive_capacity_bytes = input.drive_capacity_bytes;
  wear.steps_per_day = input.steps_per_day;
  wear.bytes_written_per_day =
      static_cast<double>(input.bytes_written_per_step) * input.steps_per_day;
  wear.drive_writes_per_day =
      wear.bytes_written_per_day / static_cast<double>(input.drive_capacity_bytes);
  return wear;
}

double StepsPerDayAt(double step_seconds) {
  return step_seconds > 0.0 ? kSecondsPerDay / step_seconds : 0.0;
}

Result<uint64_t> FilesystemBytes(const std::string& path) {
  struct statvfs vfs {};
  if (::statvfs(path.c_str(), &vfs) != 0) return Status::FromErrno(errno, "statvfs " + path);
  return uint64_t{vfs.f_blocks} * vfs.f_frsize;
}

nlohmann::json WearJson(const WearProjection& wear) {
  return {{"path", wear.path},
          {"bytes_written_per_step", wear.bytes_written_per_step},
          {"drive_capacity_bytes", wear.drive_capacity_bytes},
          {"steps_per_day", wear.steps_per_day},
          {"bytes_written_per_day", wear.bytes_written_per_day},
          {"drive_writes_per_day", wear.drive_writes_per_day}};
}

}  // namespace zoe::cli
