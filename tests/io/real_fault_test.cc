// Description: real (not injected) faults: ENOSPC on a 1 MiB tmpfs, both when a swap space is
// created and mid-write; a short write and then EFBIG under RLIMIT_FSIZE in a forked child.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>

#include "io/queue.h"
#include "io/swap_space.h"
#include "io_test_util.h"

namespace zoe::io {
namespace {

using testing::Request;

// A 1 MiB tmpfs mounted on a temporary directory, unmounted again; skips when mounting is refused.
class SmallTmpfs {
 public:
  SmallTmpfs() { mounted_ = ::mount("tmpfs", dir_.path().c_str(), "tmpfs", 0, "size=1M") == 0; }
  ~SmallTmpfs() {
    if (mounted_) ::umount2(dir_.path().c_str(), MNT_DETACH);
  }
  bool mounted() const { return mounted_; }
  const std::string& path() const { return dir_.path(); }

 private:
  testing::TempDir dir_;
  bool mounted_ = false;
};

TEST(RealFaultTest, SwapSpaceLargerThanTheFilesystemFailsAtCreation) {
  SmallTmpfs tmpfs;
  if (!tmpfs.mounted()) GTEST_SKIP() << "mount -t tmpfs refused: " << std::strerror(errno);
  SwapOptions options;
  options.alignment = 4096;
  auto swap = SwapSpace::Create({tmpfs.path()}, 4 << 20, options);
  ASSERT_FALSE(swap.ok());
  EXPECT_EQ(swap.status().code(), StatusCode::kNoSpace);
  const std::string message(swap.status().message());
  EXPECT_NE(message.find("needs 4194304 bytes"), std::string::npos) << message;
  EXPECT_NE(message.find("bytes are free"), std::string::npos) << message;
  // Nothing is left behind.
  EXPECT_TRUE(std::filesystem::is_empty(tmpfs.path()));
}

TEST(RealFaultTest, WritingPastAFullFilesystemIsNoSpaceWithPathAndOffset) {
  SmallTmpfs tmpfs;
  if (!tmpfs.mounted()) GTEST_SKIP() << "mount -t tmpfs refused";
  auto files = testing::OpenSet({tmpfs.path() + "/data"});
  std::string why;
  auto queue = testing::MakeQueue(testing::MakeEngine(BackendKind::kAuto, 4, &why));
  auto data = testing::MakeBuffer(2 << 20, 1);
  Status status = queue->Wait(*queue->Submit(Request(Op::kWrite, *files, 0, data.span())));
  ASSERT_EQ(status.code(), StatusCode::kNoSpace) << status.ToString();
  EXPECT_EQ(status.sys_errno(), ENOSPC);
  EXPECT_NE(std::string(status.message()).find(tmpfs.path() + "/data at offset"), std::string::npos)
      << status.ToString();
}

// RLIMIT_FSIZE makes a write that crosses the limit come back short and the next one fail with
// EFBIG (SIGXFSZ ignored). Runs in a child so the limit does not touch the test process.
TEST(RealFaultTest, FileSizeLimitGivesAShortWriteThenEfbig) {
  testing::TempDir dir;
  const std::string path = dir.File("limited");
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::signal(SIGXFSZ, SIG_IGN);
    rlimit limit{512 << 10, 512 << 10};
    if (::setrlimit(RLIMIT_FSIZE, &limit) != 0) ::_exit(2);
    Result<std::unique_ptr<FileSet>> files = FileSet::Open({path}, {});
    Result<std::unique_ptr<Engine>> engine = CreateEngine(EngineOptions{});
    if (!files.ok() || !engine.ok()) ::_exit(3);
    auto queue = IoQueue::Create(std::move(engine).value());
    if (!queue.ok()) ::_exit(4);
    Result<AlignedBuffer> data = AlignedBuffer::Allocate(1 << 20);
    if (!data.ok()) ::_exit(5);
    std::memset(data->data(), 0x7b, data->size());
    Result<Ticket> ticket = (*queue)->Submit(IoRequest{Op::kWrite, files->get(), 0, data->span()});
    if (!ticket.ok()) ::_exit(6);
    Status status = (*queue)->Wait(*ticket);
    const bool short_then_efbig =
        status.sys_errno() == EFBIG && (*queue)->stats().short_transfers == 1 &&
        std::string(status.message()).find("at offset 524288") != std::string::npos;
    ::_exit(short_then_efbig ? 0 : 7);
  }
  int wstatus = 0;
  ASSERT_EQ(::waitpid(child, &wstatus, 0), child);
  ASSERT_TRUE(WIFEXITED(wstatus));
  EXPECT_EQ(WEXITSTATUS(wstatus), 0);
  // The first half reached the disk.
  EXPECT_EQ(std::filesystem::file_size(path), 512u << 10);
}

}  // namespace
}  // namespace zoe::io
