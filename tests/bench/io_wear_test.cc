// Description: the SSD wear projection of `zoe bench step` — bytes a day and drive writes per
// day from bytes per step, step rate and drive capacity, worked out by hand; bad inputs refused
// naming the path; the default capacity is the filesystem's size.
#include "bench/io_wear.h"

#include <gtest/gtest.h>
#include <sys/statvfs.h>

#include <limits>
#include <string>

namespace zoe::cli {
namespace {

TEST(WearTest, DriveWritesPerDayIsBytesPerDayOverCapacity) {
  // 3 GB a step, one step every 10 s around the clock (8640 a day), a 1.6 TB drive:
  // 25.92 TB a day, 16.2 drive writes per day.
  const Result<WearProjection> wear =
      ProjectWear({"/nvme0", 3'000'000'000, 1'600'000'000'000, StepsPerDayAt(10.0)});
  ASSERT_TRUE(wear.ok()) << wear.status().ToString();
  EXPECT_EQ(wear->path, "/nvme0");
  EXPECT_DOUBLE_EQ(wear->steps_per_day, 8640.0);
  EXPECT_DOUBLE_EQ(wear->bytes_written_per_day, 25'920'000'000'000.0);
  EXPECT_DOUBLE_EQ(wear->drive_writes_per_day, 16.2);
  const nlohmann::json json = WearJson(*wear);
  EXPECT_EQ(json["bytes_written_per_step"].get<uint64_t>(), 3'000'000'000u);
  EXPECT_EQ(json["drive_capacity_bytes"].get<uint64_t>(), 1'600'000'000'000u);
  EXPECT_DOUBLE_EQ(json["drive_writes_per_day"].get<double>(), 16.2);
}

TEST(WearTest, AGivenStepRateAndNoWritesGiveZero) {
  const Result<WearProjection> idle = ProjectWear({"/a", 0, 1 << 30, 1000.0});
  ASSERT_TRUE(idle.ok());
  EXPECT_EQ(idle->drive_writes_per_day, 0.0);
  const Result<WearProjection> five = ProjectWear({"/a", 1 << 20, 1 << 30, 5120.0});
  ASSERT_TRUE(five.ok());
  EXPECT_DOUBLE_EQ(five->drive_writes_per_day, 5.0);  // 5120 MiB a day on 1 GiB
  EXPECT_EQ(StepsPerDayAt(0.0), 0.0);
  EXPECT_DOUBLE_EQ(StepsPerDayAt(0.5), 172800.0);
}

TEST(WearTest, ZeroCapacityAndBadStepRatesAreRefused) {
  const Result<WearProjection> no_capacity = ProjectWear({"/nvme1", 4096, 0, 10.0});
  ASSERT_FALSE(no_capacity.ok());
  EXPECT_EQ(no_capacity.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(no_capacity.status().ToString().find("/nvme1"), std::string::npos);
  EXPECT_NE(no_capacity.status().ToString().find("--drive-capacity"), std::string::npos);
  for (double rate :
       {-1.0, std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN()}) {
    const Result<WearProjection> bad = ProjectWear({"/nvme1", 4096, 1 << 30, rate});
    ASSERT_FALSE(bad.ok()) << rate;
    EXPECT_NE(bad.status().ToString().find("--steps-per-day"), std::string::npos);
  }
}

TEST(WearTest, FilesystemBytesIsTheSizeStatvfsReports) {
  struct statvfs vfs {};
  ASSERT_EQ(::statvfs("/var/tmp", &vfs), 0);
  const Result<uint64_t> bytes = FilesystemBytes("/var/tmp");
  ASSERT_TRUE(bytes.ok()) << bytes.status().ToString();
  EXPECT_EQ(*bytes, uint64_t{vfs.f_blocks} * vfs.f_frsize);
  EXPECT_GT(*bytes, 0u);
  const Result<uint64_t> missing = FilesystemBytes("/nonexistent/zoe-wear");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().ToString().find("/nonexistent/zoe-wear"), std::string::npos);
}

}  // namespace
}  // namespace zoe::cli
