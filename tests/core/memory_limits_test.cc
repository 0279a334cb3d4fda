// ReadMemoryLimits over a folder laid out as /proc and /sys/fs/cgroup: MemAvailable, cgroup v1
// and v2 limits along the process's cgroup path, the tightest room chosen, unlimited and
// unreadable files ignored.
#include "core/memory_limits.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include "core/scratch_dir.h"

namespace zoe {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;

class MemoryLimitsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* base = std::getenv("TMPDIR");
    auto dir = ScratchDir::Create(std::string(base && *base ? base : "/tmp") + "/zoe-memory-");
    ASSERT_TRUE(dir.ok()) << dir.status().ToString();
    dir_ = std::move(dir).value();
    Write("proc/meminfo", "MemTotal:       8388608 kB\nMemAvailable:    4194304 kB\n");
  }

  void Write(const std::string& relative, const std::string& text) {
    const std::filesystem::path path = std::filesystem::path(dir_->path()) / relative;
    std::filesystem::create_directories(path.parent_path());
    std::ofstream(path) << text;
  }

  MemoryLimits Read() const { return ReadMemoryLimits(dir_->path()); }

  std::unique_ptr<ScratchDir> dir_;
};

TEST_F(MemoryLimitsTest, WithoutACgroupTheAvailableMemoryIsUsable) {
  const MemoryLimits limits = Read();
  EXPECT_EQ(limits.available_bytes, 4096 * kMiB);
  EXPECT_FALSE(limits.cgroup_limit_bytes.has_value());
  EXPECT_EQ(limits.usable_bytes(), 4096 * kMiB);
  EXPECT_GT(limits.physical_bytes, 0u);
}

TEST_F(MemoryLimitsTest, WithoutMeminfoThePhysicalMemoryIsAvailable) {
  std::filesystem::remove(std::filesystem::path(dir_->path()) / "proc/meminfo");
  const MemoryLimits limits = Read();
  EXPECT_EQ(limits.available_bytes, limits.physical_bytes);
}

TEST_F(MemoryLimitsTest, AV2LimitLeavesItsRoomUsable) {
  Write("proc/self/cgroup", "0::/jobs/train\n");
  Write("sys/fs/cgroup/jobs/train/memory.max", "1073741824\n");
  Write("sys/fs/cgroup/jobs/train/memory.current", "314572800\n");
  Write("sys/fs/cgroup/jobs/memory.max", "max\n");
  Write("sys/fs/cgroup/jobs/memory.current", "999999999\n");
  const MemoryLimits limits = Read();
  ASSERT_TRUE(limits.cgroup_limit_bytes.has_value());
  EXPECT_EQ(*limits.cgroup_limit_bytes, 1024 * kMiB);
  EXPECT_EQ(limits.cgroup_usage_bytes, 300 * kMiB);
  EXPECT_EQ(limits.cgroup_path, "/sys/fs/cgroup/jobs/train");
  EXPECT_EQ(limits.usable_bytes(), 724 * kMiB);
  EXPECT_NE(limits.Describe().find("/sys/fs/cgroup/jobs/train"), std::string::npos);
}

TEST_F(MemoryLimitsTest, AnAncestorWithLessRoomIsTheLimit) {
  Write("proc/self/cgroup", "0::/jobs/train\n");
  Write("sys/fs/cgroup/jobs/train/memory.max", "2147483648\n");
  Write("sys/fs/cgroup/jobs/train/memory.current", "0\n");
  Write("sys/fs/cgroup/jobs/memory.max", "1073741824\n");
  Write("sys/fs/cgroup/jobs/memory.current", "536870912\n");
  const MemoryLimits limits = Read();
  EXPECT_EQ(limits.usable_bytes(), 512 * kMiB);
  EXPECT_EQ(limits.cgroup_path, "/sys/fs/cgroup/jobs");
}

TEST_F(MemoryLimitsTest, AV1MemoryControllerIsRead) {
  Write("proc/self/cgroup", "5:cpu,cpuacct:/\n4:memory:/box\n0::/\n");
  Write("sys/fs/cgroup/memory/box/memory.limit_in_bytes", "805306368\n");
  Write("sys/fs/cgroup/memory/box/memory.usage_in_bytes", "268435456\n");
  Write("sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n");
  Write("sys/fs/cgroup/memory/memory.usage_in_bytes", "1\n");
  const MemoryLimits limits = Read();
  EXPECT_EQ(limits.usable_bytes(), 512 * kMiB);
  EXPECT_EQ(limits.cgroup_path, "/sys/fs/cgroup/memory/box");
}

TEST_F(MemoryLimitsTest, AvailableMemoryBoundsALooseLimit) {
  Write("proc/self/cgroup", "0::/big\n");
  Write("sys/fs/cgroup/big/memory.max", "68719476736\n");
  Write("sys/fs/cgroup/big/memory.current", "0\n");
  EXPECT_EQ(Read().usable_bytes(), 4096 * kMiB);
}

TEST_F(MemoryLimitsTest, UnreadableOrMalformedCgroupFilesAreNoLimit) {
  Write("proc/self/cgroup", "0::/odd\ngarbage\n");
  Write("sys/fs/cgroup/odd/memory.max", "lots\n");
  Write("sys/fs/cgroup/odd/memory.current", "12\n");
  const MemoryLimits limits = Read();
  EXPECT_FALSE(limits.cgroup_limit_bytes.has_value());
  EXPECT_EQ(limits.usable_bytes(), 4096 * kMiB);
}

TEST(MemoryLimits, TheMachineItRunsOnHasUsableMemory) {
  const MemoryLimits limits = ReadMemoryLimits();
  EXPECT_GT(limits.usable_bytes(), 0u);
  EXPECT_LE(limits.available_bytes, limits.physical_bytes);
}

}  // namespace
}  // namespace zoe
