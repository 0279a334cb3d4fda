// Description: a disk that fills during a checkpoint save, on a real tmpfs mounted by the test:
// a save whose size is known fails before writing, NoSpace naming the directory and the bytes
// needed and available; a save that runs out mid-write (size unknown, or the room taken after the
// check) fails NoSpace with the same figures. Each time the previous checkpoint still loads with
// what was saved and no partial version is left; the engine's save checks its groups' sizes.
#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/mount.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "offload/checkpoint/checkpoint_store.h"
#include "offload/engine.h"
#include "tests/offload/temp_dir.h"

namespace zoe::offload {
namespace {

using ::testing::HasSubstr;
using ::testing::MatchesRegex;
using Json = nlohmann::json;

// A tmpfs of `size` mounted on a fresh temporary directory, unmounted again; mounted() is false
// when mounting was refused (not root, or no CAP_SYS_ADMIN in a container).
class TmpfsMount {
 public:
  explicit TmpfsMount(const std::string& size)
      : path_(std::filesystem::path(root_.File("x")).parent_path()) {
    const std::string options = "size=" + size;
    mounted_ = ::mount("tmpfs", path_.c_str(), "tmpfs", 0, options.c_str()) == 0;
    if (!mounted_) refusal_ = std::strerror(errno);
  }
  ~TmpfsMount() {
    if (mounted_) ::umount2(path_.c_str(), MNT_DETACH);
  }
  bool mounted() const { return mounted_; }
  const std::string& refusal() const { return refusal_; }
  std::string File(const std::string& name) const { return root_.File(name); }

 private:
  testing::TempDir root_;
  const std::string path_;
  bool mounted_ = false;
  std::string refusal_;
};

uint64_t AvailableBytes(const std::string& path) {
  struct statvfs vfs {};
  EXPECT_EQ(::statvfs(path.c_str(), &vfs), 0) << path;
  return uint64_t{vfs.f_bavail} * vfs.f_frsize;
}

// Every entry of a checkpoint root, sorted: {"LATEST", "v000001"} after one clean save.
std::vector<std::string> Entries(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir))
    names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

std::vector<std::byte> Pattern(size_t bytes, unsigned seed) {
  std::vector<std::byte> out(bytes);
  for (size_t i = 0; i < bytes; ++i) out[i] = std::byte((i * 131 + seed * 17 + (i >> 12)) & 0xff);
  return out;
}

// Writes one file "state" of `data` as a save of `dir`; the writer is returned uncommitted.
Status WriteState(CheckpointWriter& writer, const std::vector<std::byte>& data) {
  ZOE_RETURN_IF_ERROR(writer.BeginFile("state"));
  for (size_t at = 0; at < data.size(); at += 64 << 10) {
    const size_t length = std::min<size_t>(64 << 10, data.size() - at);
    ZOE_RETURN_IF_ERROR(writer.Append(std::span(data).subspan(at, length)));
  }
  return writer.EndFile();
}

Status Save(const std::string& dir, const std::vector<std::byte>& data,
            CheckpointWriterOptions options = {}) {
  ZOE_ASSIGN_OR_RETURN(auto writer,
                       CheckpointWriter::Begin(dir, {{"seed", 1}}, std::move(options)));
  ZOE_RETURN_IF_ERROR(WriteState(*writer, data));
  return writer->Commit();
}

// The checkpoint LATEST names loads and holds exactly `expected`.
void ExpectLoads(const std::string& dir, const std::vector<std::byte>& expected) {
  Result<std::unique_ptr<CheckpointReader>> reader = CheckpointReader::Open(dir);
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  std::vector<std::byte> data(expected.size());
  ASSERT_TRUE((*reader)->BeginFile("state").ok());
  ASSERT_TRUE((*reader)->Read(data).ok());
  const Status verified = (*reader)->EndFile();
  ASSERT_TRUE(verified.ok()) << verified.ToString();
  EXPECT_TRUE(data == expected);
}

class CheckpointNoSpaceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!tmpfs_.mounted()) GTEST_SKIP() << "mount -t tmpfs refused: " << tmpfs_.refusal();
    dir_ = tmpfs_.File("ckpt");
    const Status first = Save(dir_, first_, Sizes(first_.size()));
    ASSERT_TRUE(first.ok()) << first.ToString();
  }

  static CheckpointWriterOptions Sizes(uint64_t bytes) {
    CheckpointWriterOptions options;
    options.expected_file_sizes = {bytes};
    return options;
  }

  TmpfsMount tmpfs_{"1M"};
  std::string dir_;
  const std::vector<std::byte> first_ = Pattern(400 << 10, 1);
  const std::vector<std::byte> second_ = Pattern(700 << 10, 2);
};

TEST(CheckpointSpaceNeededTest, CountsWholeBlocksOfEveryFileManifestAndLatest) {
  const Json metadata = {{"k", std::string(1000, 'x')}};
  const uint64_t needed = CheckpointSpaceNeeded(std::vector<uint64_t>{1, 4097}, metadata, 4096);
  EXPECT_EQ(needed % 4096, 0u);
  // The data's blocks (1 + 2), a manifest of at least the metadata, LATEST and the directory.
  EXPECT_GE(needed, (3 + 1 + 2) * 4096u);
  EXPECT_LT(needed, (3 + 8 + 2) * 4096u);
  EXPECT_GT(CheckpointSpaceNeeded(std::vector<uint64_t>{1, 4097, 1}, metadata, 4096), needed);
  // Sizes whose sum wraps around 64 bits saturate instead of looking small.
  const uint64_t huge = std::numeric_limits<uint64_t>::max() - 100;
  EXPECT_EQ(CheckpointSpaceNeeded(std::vector<uint64_t>{huge, huge}, metadata, 4096),
            std::numeric_limits<uint64_t>::max());
}

// Needs no small file system: sizes whose sum wraps around 64 bits exceed any disk.
TEST(CheckpointSpaceNeededTest, SizesBeyondAnyDiskAreRefusedNotWrapped) {
  testing::TempDir temp;
  const std::string dir = temp.File("ckpt");
  CheckpointWriterOptions first;
  first.expected_file_sizes = {4096};
  ASSERT_TRUE(Save(dir, Pattern(4096, 1), std::move(first)).ok());
  CheckpointWriterOptions options;
  options.expected_file_sizes = {uint64_t{1} << 63, uint64_t{1} << 63};
  Result<std::unique_ptr<CheckpointWriter>> writer =
      CheckpointWriter::Begin(dir, {}, std::move(options));
  ASSERT_FALSE(writer.ok());
  EXPECT_EQ(writer.status().code(), StatusCode::kNoSpace);
  EXPECT_THAT(
      std::string(writer.status().message()),
      HasSubstr("needs " + std::to_string(std::numeric_limits<uint64_t>::max()) + " bytes"));
  EXPECT_EQ(Entries(dir), (std::vector<std::string>{"LATEST", "v000001"}));
}

TEST_F(CheckpointNoSpaceTest, SaveOfKnownSizeThatDoesNotFitFailsBeforeWriting) {
  const uint64_t available = AvailableBytes(dir_);
  const uint64_t needed =
      CheckpointSpaceNeeded(std::vector<uint64_t>{second_.size()}, Json{{"seed", 1}}, 4096);
  ASSERT_GT(needed, available);
  Result<std::unique_ptr<CheckpointWriter>> writer =
      CheckpointWriter::Begin(dir_, {{"seed", 1}}, Sizes(second_.size()));
  ASSERT_FALSE(writer.ok());
  const Status& status = writer.status();
  EXPECT_EQ(status.code(), StatusCode::kNoSpace) << status.ToString();
  EXPECT_EQ(status.sys_errno(), ENOSPC);
  const std::string message(status.message());
  EXPECT_THAT(message, HasSubstr("checkpoint " + dir_ + ": the save needs " +
                                 std::to_string(needed) + " bytes"));
  EXPECT_THAT(message, HasSubstr("only " + std::to_string(available) + " bytes are available"));
  EXPECT_THAT(message, HasSubstr("the checkpoint it holds is unchanged"));
  EXPECT_EQ(Entries(dir_), (std::vector<std::string>{"LATEST", "v000001"}));
  ExpectLoads(dir_, first_);
}

TEST_F(CheckpointNoSpaceTest, SaveOfUnknownSizeRunningOutMidWriteLeavesThePreviousOne) {
  const uint64_t available = AvailableBytes(dir_);
  {
    Result<std::unique_ptr<CheckpointWriter>> writer = CheckpointWriter::Begin(dir_, {});
    ASSERT_TRUE(writer.ok()) << writer.status().ToString();
    const Status status = WriteState(**writer, second_);
    ASSERT_EQ(status.code(), StatusCode::kNoSpace) << status.ToString();
    EXPECT_EQ(status.sys_errno(), ENOSPC);
    const std::string message(status.message());
    EXPECT_THAT(message, HasSubstr("out of space in " + dir_ + " after "));
    EXPECT_THAT(message, HasSubstr("the save's size was not given, " + std::to_string(available) +
                                   " bytes were available there when it began"));
    EXPECT_THAT(message, HasSubstr((*writer)->version_path() + "/state at offset"));
    // The save is over: later calls say so instead of writing on.
    EXPECT_EQ((*writer)->Commit().code(), StatusCode::kFailedPrecondition);
  }
  EXPECT_EQ(Entries(dir_), (std::vector<std::string>{"LATEST", "v000001"}));
  ExpectLoads(dir_, first_);
  // The room the failed save took is free again: a save that fits succeeds.
  const std::vector<std::byte> third = Pattern(300 << 10, 3);
  ASSERT_TRUE(Save(dir_, third, Sizes(third.size())).ok());
  ExpectLoads(dir_, third);
}

// The check passes, then something else fills the disk before the first write: the write's
// ENOSPC carries what the save needs and what was available when it began.
TEST_F(CheckpointNoSpaceTest, RoomTakenAfterTheCheckIsNoSpaceWithTheFigures) {
  const std::vector<std::byte> fits = Pattern(200 << 10, 4);
  const uint64_t available = AvailableBytes(dir_);
  const uint64_t needed =
      CheckpointSpaceNeeded(std::vector<uint64_t>{fits.size()}, Json{{"seed", 1}}, 4096);
  ASSERT_LT(needed, available);
  const std::string filler = tmpfs_.File("filler");
  CheckpointWriterOptions options = Sizes(fits.size());
  options.fault_for_testing = [&](CheckpointSyscall call, const std::string&) {
    if (call != CheckpointSyscall::kWrite || std::filesystem::exists(filler)) return 0;
    const int fd = ::open(filler.c_str(), O_WRONLY | O_CREAT, 0600);
    EXPECT_GE(fd, 0);
    EXPECT_EQ(::posix_fallocate(fd, 0, static_cast<off_t>(AvailableBytes(dir_) - (64 << 10))), 0);
    ::close(fd);
    return 0;  // the write itself runs, and meets the full disk
  };
  {
    Result<std::unique_ptr<CheckpointWriter>> writer =
        CheckpointWriter::Begin(dir_, {{"seed", 1}}, std::move(options));
    ASSERT_TRUE(writer.ok()) << writer.status().ToString();
    const Status status = WriteState(**writer, fits);
    ASSERT_EQ(status.code(), StatusCode::kNoSpace) << status.ToString();
    EXPECT_THAT(std::string(status.message()), HasSubstr("out of space in " + dir_ + " after "));
    EXPECT_THAT(std::string(status.message()),
                HasSubstr("the save needs " + std::to_string(needed) + " bytes, " +
                          std::to_string(available) + " bytes were available there"));
  }
  EXPECT_EQ(Entries(dir_), (std::vector<std::string>{"LATEST", "v000001"}));
  ExpectLoads(dir_, first_);
}

// A save that crashed left a large ".tmp" version: the next save removes it before it measures
// the room, so a save that fits only without it succeeds.
TEST_F(CheckpointNoSpaceTest, LeftoverOfACrashedSaveIsRemovedBeforeTheCheck) {
  const std::string leftover = dir_ + "/v000002.tmp";
  ASSERT_EQ(::mkdir(leftover.c_str(), 0755), 0);
  const int fd = ::open((leftover + "/state").c_str(), O_WRONLY | O_CREAT, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::posix_fallocate(fd, 0, 500 << 10), 0);
  ::close(fd);
  const std::vector<std::byte> third = Pattern(300 << 10, 3);
  ASSERT_LT(AvailableBytes(dir_), third.size());
  const Status saved = Save(dir_, third, Sizes(third.size()));
  ASSERT_TRUE(saved.ok()) << saved.ToString();
  EXPECT_EQ(Entries(dir_), (std::vector<std::string>{"LATEST", "v000002"}));
  ExpectLoads(dir_, third);
}

// ENOSPC injected at each later step of a save of known size (creating its file, syncing it,
// writing the manifest) carries the figures; statvfs failing is an error naming the directory,
// before anything is created. The previous checkpoint loads each time.
struct InjectedFault {
  CheckpointSyscall call;
  std::string path_suffix;  // the fault hits the first such call on a path ending so
  int error;
};

class CheckpointInjectedNoSpaceTest : public ::testing::TestWithParam<InjectedFault> {};

TEST_P(CheckpointInjectedNoSpaceTest, FailsWithTheFiguresAndKeepsThePreviousCheckpoint) {
  testing::TempDir root;
  const std::string dir = root.File("ckpt");
  const std::vector<std::byte> first = Pattern(64 << 10, 1);
  const std::vector<std::byte> second = Pattern(96 << 10, 2);
  ASSERT_TRUE(Save(dir, first).ok());
  const InjectedFault fault = GetParam();
  bool fired = false;
  CheckpointWriterOptions options;
  options.expected_file_sizes = {second.size()};
  options.fault_for_testing = [&](CheckpointSyscall call, const std::string& path) {
    if (fired || call != fault.call || !path.ends_with(fault.path_suffix)) return 0;
    fired = true;
    return fault.error;
  };
  const Status status = Save(dir, second, std::move(options));
  ASSERT_TRUE(fired);
  const std::string message(status.message());
  if (fault.error == ENOSPC) {
    EXPECT_EQ(status.code(), StatusCode::kNoSpace) << status.ToString();
    EXPECT_THAT(message, HasSubstr("out of space in " + dir + " after "));
    EXPECT_THAT(message, HasSubstr("(the save needs "));
    EXPECT_THAT(message, HasSubstr("the checkpoint it holds is unchanged"));
  } else {
    EXPECT_EQ(status.code(), StatusCode::kIoError) << status.ToString();
    EXPECT_THAT(message, HasSubstr("statvfs " + dir));
  }
  EXPECT_EQ(Entries(dir), (std::vector<std::string>{"LATEST", "v000001"}));
  ExpectLoads(dir, first);
}

INSTANTIATE_TEST_SUITE_P(
    Steps, CheckpointInjectedNoSpaceTest,
    ::testing::Values(InjectedFault{CheckpointSyscall::kOpen, "/state", ENOSPC},
                      InjectedFault{CheckpointSyscall::kFsync, "/state", ENOSPC},
                      InjectedFault{CheckpointSyscall::kWrite, "/manifest.json", ENOSPC},
                      InjectedFault{CheckpointSyscall::kStatvfs, "/ckpt", EIO}));

// ---- the engine --------------------------------------------------------------------------------

constexpr size_t kParams = 40000;  // AdamW in fp32: 480000 bytes of checkpoint

std::unique_ptr<Engine> MakeEngine(const std::string& nvme_dir) {
  const Json document = {{"zero_optimization",
                          {{"sub_group_size", 8192},
                           {"offload_optimizer", {{"device", "nvme"}, {"nvme_path", nvme_dir}}}}},
                         {"aio", {{"backend", "psync"}, {"queue_depth", 8}}},
                         {"zoe",
                          {{"chunk_size", "64K"},
                           {"host_budget", "32M"},
                           {"tensor_swap_bytes", "1M"},
                           {"device", "host"}}}};
  Result<std::unique_ptr<Engine>> engine = Engine::CreateFromJson(document.dump());
  EXPECT_TRUE(engine.ok()) << engine.status().ToString();
  return engine.ok() ? std::move(engine).value() : nullptr;
}

Status Step(Engine& engine, GroupId group, int seed) {
  std::vector<float> grads(kParams);
  for (size_t i = 0; i < kParams; ++i)
    grads[i] = std::sin(static_cast<float>(i * 7 + seed)) * 0.05f;
  const GradView view{grads.data(), optim::DType::kFloat32, grads.size()};
  EngineStepArgs args;
  args.grads = std::span(&view, 1);
  return engine.Step(group, args).status();
}

std::vector<float> Master(const Engine& engine, GroupId group) {
  std::vector<float> out(kParams);
  EXPECT_TRUE(engine.ReadState(group, StateSlot::kMaster, 0, out).ok());
  return out;
}

TEST(EngineCheckpointNoSpaceTest, SecondSaveThatDoesNotFitIsNoSpaceAndTheFirstStillLoads) {
  TmpfsMount tmpfs("768K");
  if (!tmpfs.mounted()) GTEST_SKIP() << "mount -t tmpfs refused: " << tmpfs.refusal();
  testing::TempDir nvme;
  std::unique_ptr<Engine> engine = MakeEngine(std::filesystem::path(nvme.File("x")).parent_path());
  ASSERT_NE(engine, nullptr);
  std::vector<float> params(kParams, 0.5f);
  const ParamView view{params.data(), optim::DType::kFloat32, params.size()};
  Result<GroupId> group = engine->CreateGroup(R"({"name": "g"})", std::span(&view, 1));
  ASSERT_TRUE(group.ok()) << group.status().ToString();
  ASSERT_TRUE(Step(*engine, *group, 1).ok());
  const std::string ckpt = tmpfs.File("ckpt");
  const Status first = engine->SaveCheckpoint(ckpt);
  ASSERT_TRUE(first.ok()) << first.ToString();
  const std::vector<float> saved = Master(*engine, *group);

  ASSERT_TRUE(Step(*engine, *group, 2).ok());
  const std::vector<float> stepped = Master(*engine, *group);
  const Status second = engine->SaveCheckpoint(ckpt);
  ASSERT_EQ(second.code(), StatusCode::kNoSpace) << second.ToString();
  EXPECT_THAT(std::string(second.message()),
              MatchesRegex("checkpoint " + ckpt +
                           ": the save needs [0-9]+ bytes \\(480000 bytes of data in 1 file, "
                           "the manifest and LATEST\\) but only " +
                           std::to_string(AvailableBytes(ckpt)) +
                           " bytes are available there; the checkpoint it holds is unchanged"));
  EXPECT_EQ(Entries(ckpt), (std::vector<std::string>{"LATEST", "v000001"}));
  // The refused save changed nothing in the engine; the first checkpoint loads.
  EXPECT_EQ(Master(*engine, *group), stepped);
  const Status loaded = engine->LoadCheckpoint(ckpt);
  ASSERT_TRUE(loaded.ok()) << loaded.ToString();
  EXPECT_EQ(Master(*engine, *group), saved);
  EXPECT_EQ(*engine->GroupSteps(*group), 1);
}

}  // namespace
}  // namespace zoe::offload
