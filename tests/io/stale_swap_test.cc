// Description: swap files of a process that died without closing them are removed by the next
// swap space made in their directory; those of a live process, held ones, and files that are not
// zoe's swap files are kept.
#include "io/stale_swap.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "io/swap_space.h"
#include "io_test_util.h"

namespace zoe::io {
namespace {

std::vector<std::string> Names(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir))
    names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

void WriteFile(const std::string& path, size_t bytes) {
  std::ofstream(path) << std::string(bytes, 'x');
}

// A child that makes `spaces` swap spaces of 1 MiB in `dir` and dies without closing them (as
// SIGKILL would leave them); returns its pid, which no longer exists.
pid_t LeaveSwapBehind(const std::string& dir, int spaces = 1) {
  const pid_t child = ::fork();
  if (child == 0) {
    std::vector<std::unique_ptr<SwapSpace>> made;
    for (int i = 0; i < spaces; ++i) {
      auto swap = SwapSpace::Create({dir}, 1 << 20, SwapOptions{});
      if (!swap.ok()) ::_exit(1);
      made.push_back(std::move(swap).value());
    }
    ::_exit(0);  // no destructor runs: the files stay
  }
  int status = 0;
  EXPECT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  return child;
}

// The pid of a process that has ended.
pid_t EndedPid() {
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ::waitpid(child, nullptr, 0);
  return child;
}

TEST(StaleSwap, FilesOfAProcessThatDiedAreRemovedByTheNextSwapSpace) {
  testing::TempDir dir;
  const pid_t dead = LeaveSwapBehind(dir.path());
  const std::vector<std::string> left = Names(dir.path());
  ASSERT_EQ(left.size(), 1u);
  EXPECT_EQ(SwapFileOwner(left[0]), dead);

  auto swap = SwapSpace::Create({dir.path()}, 1 << 20, SwapOptions{});
  ASSERT_TRUE(swap.ok()) << swap.status().ToString();
  const std::vector<std::string> now = Names(dir.path());
  ASSERT_EQ(now.size(), 1u);
  EXPECT_EQ(SwapFileOwner(now[0]), ::getpid()) << "the dead process's file is gone";
}

TEST(StaleSwap, TheSweepCountsWhatItRemoved) {
  testing::TempDir dir;
  LeaveSwapBehind(dir.path(), 2);
  const StaleSweep sweep = RemoveStaleSwapFiles(dir.path());
  EXPECT_EQ(sweep.files, 2u);
  EXPECT_EQ(sweep.bytes, 2u << 20);
  EXPECT_TRUE(Names(dir.path()).empty());
}

TEST(StaleSwap, FilesOfLiveProcessesAreKept) {
  testing::TempDir dir;
  auto mine = SwapSpace::Create({dir.path()}, 1 << 20, SwapOptions{});
  ASSERT_TRUE(mine.ok());
  // Unlocked, but named after this live process.
  WriteFile(dir.path() + "/zoe-swap-" + std::to_string(::getpid()) + "-9999.0.swap", 10);
  EXPECT_EQ(RemoveStaleSwapFiles(dir.path()).files, 0u);
  EXPECT_EQ(Names(dir.path()).size(), 2u);
}

TEST(StaleSwap, AHeldFileIsKeptWhateverItsName) {
  testing::TempDir dir;
  const std::string path =
      dir.path() + "/zoe-optimizer-" + std::to_string(EndedPid()) + "-1.0.swap";
  WriteFile(path, 10);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX), 0);  // as a process in another pid namespace would hold it
  EXPECT_EQ(RemoveStaleSwapFiles(dir.path()).files, 0u);
  ::close(fd);
  EXPECT_EQ(RemoveStaleSwapFiles(dir.path()).files, 1u) << "unlocked, its process gone";
}

TEST(StaleSwap, OnlyNamesSwapSpaceMakesAreConsidered) {
  testing::TempDir dir;
  const std::string dead = std::to_string(EndedPid());
  const std::vector<std::string> others = {"notes.swap",
                                           "zoe-swap-" + dead + "-1.0.txt",
                                           "zoe-swap-" + dead + "-x.0.swap",
                                           "zoe-" + dead + "-1.0.swap" /* no prefix */,
                                           "swap-" + dead + "-1.0.swap",
                                           "zoe-swap--1.0.swap"};
  for (const std::string& name : others) WriteFile(dir.path() + "/" + name, 10);
  std::filesystem::create_directory(dir.path() + "/zoe-swap-" + dead + "-2.0.swap");
  EXPECT_EQ(RemoveStaleSwapFiles(dir.path()).files, 0u);
  EXPECT_EQ(Names(dir.path()).size(), others.size() + 1);
}

TEST(StaleSwap, OwnerIsReadFromTheNameSwapSpaceGives) {
  EXPECT_EQ(SwapFileOwner("zoe-swap-1234-7.0.swap"), 1234);
  EXPECT_EQ(SwapFileOwner("zoe-optimizer-42-0.3.swap"), 42);
  EXPECT_EQ(SwapFileOwner("zoe-swap-0-1.0.swap"), std::nullopt);
  EXPECT_EQ(SwapFileOwner("zoe-swap-1234-7.swap"), std::nullopt);
  EXPECT_EQ(SwapFileOwner("zoe-swap-99999999999-1.0.swap"), std::nullopt);
  EXPECT_EQ(SwapFileOwner("zoe-swap-12a-1.0.swap"), std::nullopt);
}

// Makes `parent`/`name` a directory holding a swap file left by a process that died.
std::string PrivateDirectoryLeftBehind(const std::string& parent, const std::string& name) {
  const std::string dir = parent + "/" + name;
  std::filesystem::create_directory(dir);
  LeaveSwapBehind(dir);
  return dir;
}

TEST(StaleSwap, PrivateDirectoriesOfProcessesThatDiedAreRemovedWithTheirFiles) {
  testing::TempDir parent;
  const std::string first = PrivateDirectoryLeftBehind(parent.path(), "zoe-engine-a1B2c3");
  const std::string second = PrivateDirectoryLeftBehind(parent.path(), "zoe-engine-ZZZZZZ");
  const StaleDirectorySweep sweep = RemoveStalePrivateDirectories(parent.path(), "zoe-engine-");
  EXPECT_EQ(sweep.directories, 2u);
  EXPECT_EQ(sweep.files.files, 2u);
  EXPECT_EQ(sweep.files.bytes, 2u << 20);
  EXPECT_FALSE(std::filesystem::exists(first));
  EXPECT_FALSE(std::filesystem::exists(second));
}

TEST(StaleSwap, APrivateDirectoryWithAHeldFileIsKept) {
  testing::TempDir parent;
  const std::string dir = parent.path() + "/zoe-engine-Locked";
  std::filesystem::create_directory(dir);
  const std::string path = dir + "/zoe-swap-" + std::to_string(EndedPid()) + "-1.0.swap";
  WriteFile(path, 10);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX), 0);  // as an engine in another pid namespace would hold it
  EXPECT_EQ(RemoveStalePrivateDirectories(parent.path(), "zoe-engine-").directories, 0u);
  EXPECT_TRUE(std::filesystem::exists(path));
  ::close(fd);
  EXPECT_EQ(RemoveStalePrivateDirectories(parent.path(), "zoe-engine-").directories, 1u);
  EXPECT_FALSE(std::filesystem::exists(dir));
}

TEST(StaleSwap, PrivateDirectoriesWithOtherContentOtherNamesLinksOrNothingAreKept) {
  testing::TempDir parent;
  const std::string with_other = PrivateDirectoryLeftBehind(parent.path(), "zoe-engine-Other1");
  WriteFile(with_other + "/notes.txt", 10);
  const std::string live = parent.path() + "/zoe-engine-Live01";
  std::filesystem::create_directory(live);
  auto mine = SwapSpace::Create({live}, 1 << 20, SwapOptions{});
  ASSERT_TRUE(mine.ok());
  const std::string empty = parent.path() + "/zoe-engine-Empty1";
  std::filesystem::create_directory(empty);  // perhaps another engine's, just made
  const std::vector<std::string> misnamed = {
      PrivateDirectoryLeftBehind(parent.path(), "zoe-engine-abc"),
      PrivateDirectoryLeftBehind(parent.path(), "zoe-engine-abc-12"),
      PrivateDirectoryLeftBehind(parent.path(), "zoe-step-abc123")};
  const std::string target = PrivateDirectoryLeftBehind(parent.path(), "target");
  std::filesystem::create_directory_symlink(target, parent.path() + "/zoe-engine-Link01");

  const StaleDirectorySweep sweep = RemoveStalePrivateDirectories(parent.path(), "zoe-engine-");
  EXPECT_EQ(sweep.directories, 0u);
  EXPECT_EQ(sweep.files.files, 1u) << "the stale swap file next to notes.txt";
  EXPECT_EQ(Names(with_other), std::vector<std::string>{"notes.txt"});
  EXPECT_EQ(Names(live).size(), 1u);
  EXPECT_TRUE(std::filesystem::exists(empty));
  for (const std::string& dir : misnamed) EXPECT_EQ(Names(dir).size(), 1u) << dir;
  EXPECT_EQ(Names(target).size(), 1u) << "a link is not followed";
}

TEST(StaleSwap, PrivateDirectoryNamesAreThePrefixAndSixCharacters) {
  EXPECT_TRUE(IsPrivateDirectoryName("zoe-engine-aZ09xY", "zoe-engine-"));
  EXPECT_FALSE(IsPrivateDirectoryName("zoe-engine-aZ09x", "zoe-engine-"));
  EXPECT_FALSE(IsPrivateDirectoryName("zoe-engine-aZ09xYz", "zoe-engine-"));
  EXPECT_FALSE(IsPrivateDirectoryName("zoe-engine-aZ.9xY", "zoe-engine-"));
  EXPECT_FALSE(IsPrivateDirectoryName("zoe-enginf-aZ09xY", "zoe-engine-"));
}

TEST(StaleSwap, AMissingDirectorySweepsNothing) {
  EXPECT_EQ(RemoveStaleSwapFiles("/nonexistent/zoe-stale-swap").files, 0u);
}

}  // namespace
}  // namespace zoe::io
