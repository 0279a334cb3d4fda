// Description: what happens when an engine's Submit takes nothing: IoQueue retries a refusal
// with nothing in flight and fails it only after max_retries, naming path and offset; io_uring
// leaves nothing in flight from a Submit that failed, so the caller may reuse its tags and
// buffers.
#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "io_test_util.h"

namespace zoe::io {
namespace {

using testing::Request;

// Accepts nothing for its first `refusals` Submit calls (the way libaio answers EAGAIN when the
// kernel is short of resources), then forwards to the real engine.
class RefusingEngine : public EngineWrapper {
 public:
  RefusingEngine(std::unique_ptr<Engine> target, int refusals)
      : EngineWrapper(std::move(target)), refusals_left_(refusals) {}

  Result<size_t> Submit(std::span<const RawRequest> requests) override {
    ++submits_;
    if (refusals_left_ > 0) {
      --refusals_left_;
      return size_t{0};
    }
    return EngineWrapper::Submit(requests);
  }
  int submits() const { return submits_.load(); }

 private:
  std::atomic<int> refusals_left_;
  std::atomic<int> submits_{0};
};

class RefusalTest : public ::testing::Test {
 protected:
  // A queue over a refusing engine of the default backend, and one file.
  RefusingEngine* Open(int refusals, uint32_t max_retries) {
    std::string why;
    auto engine = testing::MakeEngine(BackendKind::kAuto, 8, &why);
    EXPECT_NE(engine, nullptr) << why;
    auto refusing = std::make_unique<RefusingEngine>(std::move(engine), refusals);
    RefusingEngine* raw = refusing.get();
    QueueOptions options;
    options.max_retries = max_retries;
    queue_ = testing::MakeQueue(std::move(refusing), options);
    files_ = testing::OpenSet({dir_.File("data")});
    return raw;
  }

  testing::TempDir dir_;
  std::unique_ptr<IoQueue> queue_;
  std::unique_ptr<FileSet> files_;
};

TEST_F(RefusalTest, TransientRefusalWithNothingInFlightIsRetried) {
  RefusingEngine* engine = Open(/*refusals=*/3, /*max_retries=*/16);
  ASSERT_NE(queue_, nullptr);
  auto data = testing::MakeBuffer(8192, 21);
  Result<Ticket> write = queue_->Submit(Request(Op::kWrite, *files_, 0, data.span()));
  ASSERT_TRUE(write.ok()) << write.status().ToString();
  ASSERT_TRUE(queue_->Wait(*write).ok());
  EXPECT_EQ(engine->submits(), 4);
  EXPECT_EQ(queue_->stats().retries, 3u);
  auto back = testing::MakeBuffer(8192);
  ASSERT_TRUE(queue_->Wait(*queue_->Submit(Request(Op::kRead, *files_, 0, back.span()))).ok());
  EXPECT_EQ(std::memcmp(back.data(), data.data(), data.size()), 0);
}

TEST_F(RefusalTest, PersistentRefusalFailsAfterMaxRetriesNamingPathAndOffset) {
  RefusingEngine* engine = Open(/*refusals=*/4, /*max_retries=*/3);
  ASSERT_NE(queue_, nullptr);
  auto data = testing::MakeBuffer(4096, 22);
  Result<Ticket> refused = queue_->Submit(Request(Op::kWrite, *files_, 8192, data.span()));
  ASSERT_TRUE(refused.ok()) << refused.status().ToString();
  const Status status = queue_->Wait(*refused);
  ASSERT_FALSE(status.ok());
  EXPECT_EQ(status.code(), StatusCode::kIoError);
  const std::string message(status.message());
  EXPECT_NE(message.find(files_->file(0).path()), std::string::npos) << message;
  EXPECT_NE(message.find("offset 8192"), std::string::npos) << message;
  EXPECT_NE(message.find("after 3 retries"), std::string::npos) << message;
  EXPECT_EQ(engine->submits(), 4);
  // The engine accepts again: the next request goes through.
  Result<Ticket> accepted = queue_->Submit(Request(Op::kWrite, *files_, 0, data.span()));
  ASSERT_TRUE(accepted.ok());
  EXPECT_TRUE(queue_->Wait(*accepted).ok());
}

// The descriptors of every io_uring instance in this process.
std::set<int> RingDescriptors() {
  std::set<int> rings;
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return rings;
  while (dirent* entry = ::readdir(dir)) {
    if (entry->d_name[0] == '.') continue;
    char target[256] = {};
    const std::string link = std::string("/proc/self/fd/") + entry->d_name;
    const ssize_t n = ::readlink(link.c_str(), target, sizeof(target) - 1);
    if (n > 0 && std::string(target, n) == "anon_inode:[io_uring]")
      rings.insert(std::stoi(entry->d_name));
  }
  ::closedir(dir);
  return rings;
}

// Makes every io_uring_enter on one ring fail (EOPNOTSUPP) by putting /dev/null in place of the
// ring's descriptor, until Restore puts the ring back. The mappings keep the ring alive meanwhile.
class RingOutage {
 public:
  explicit RingOutage(int ring_fd) : ring_fd_(ring_fd), saved_(::dup(ring_fd)) {
    const int null_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    EXPECT_GE(null_fd, 0);
    EXPECT_EQ(::dup2(null_fd, ring_fd_), ring_fd_);
    ::close(null_fd);
  }
  ~RingOutage() { Restore(); }
  void Restore() {
    if (saved_ < 0) return;
    EXPECT_EQ(::dup2(saved_, ring_fd_), ring_fd_);
    ::close(saved_);
    saved_ = -1;
  }

 private:
  int ring_fd_;
  int saved_;
};

// A fresh io_uring engine and the descriptor of its ring, or nullptr when io_uring cannot run.
std::unique_ptr<Engine> MakeUringEngine(uint32_t depth, int* ring_fd, std::string* why) {
  const std::set<int> before = RingDescriptors();
  Result<std::unique_ptr<Engine>> engine = CreateUringEngine(depth);
  if (!engine.ok()) {
    *why = engine.status().ToString();
    return nullptr;
  }
  std::vector<int> added;
  for (int fd : RingDescriptors())
    if (before.count(fd) == 0) added.push_back(fd);
  if (added.size() != 1) {
    *why = "cannot tell the new ring's descriptor from /proc/self/fd";
    return nullptr;
  }
  *ring_fd = added.front();
  return std::move(engine).value();
}

TEST(UringSubmitFailureTest, FailedSubmitLeavesNothingInFlight) {
  int ring_fd = -1;
  std::string why;
  std::unique_ptr<Engine> engine = MakeUringEngine(4, &ring_fd, &why);
  if (engine == nullptr) GTEST_SKIP() << why;
  testing::TempDir dir;
  const std::string path = dir.File("data");
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  ASSERT_GE(fd, 0);
  auto contents = testing::MakeBuffer(3 * 4096, 23);
  ASSERT_EQ(::pwrite(fd, contents.data(), contents.size(), 0),
            static_cast<ssize_t>(contents.size()));
  auto refused_buffer = testing::MakeBuffer(4096);
  auto later_buffer = testing::MakeBuffer(2 * 4096);

  RingOutage outage(ring_fd);
  const RawRequest refused{Op::kRead, fd, 0, refused_buffer.data(), 4096, /*tag=*/1};
  Result<size_t> failed = engine->Submit(std::span(&refused, 1));
  ASSERT_FALSE(failed.ok());
  EXPECT_NE(std::string(failed.status().message()).find("io_uring_submit"), std::string::npos)
      << failed.status().ToString();
  outage.Restore();

  // Nothing of the failed call is in flight: the next submissions carry only their own requests
  // (the first reusing the refused tag, as IoQueue reuses slots), and each completes once.
  const RawRequest reused{Op::kRead, fd, 4096, later_buffer.data(), 4096, /*tag=*/1};
  const RawRequest other{Op::kRead, fd, 8192, later_buffer.data() + 4096, 4096, /*tag=*/2};
  ASSERT_EQ(*engine->Submit(std::span(&reused, 1)), 1u);
  ASSERT_EQ(*engine->Submit(std::span(&other, 1)), 1u);
  std::map<uint64_t, int> completions;
  std::vector<RawCompletion> out(8);
  size_t seen = 0;
  while (seen < 2) {
    Result<size_t> reaped = engine->Reap(out, 1);
    ASSERT_TRUE(reaped.ok()) << reaped.status().ToString();
    for (size_t i = 0; i < *reaped; ++i) {
      EXPECT_EQ(out[i].result, 4096) << "tag " << out[i].tag;
      ++completions[out[i].tag];
    }
    seen += *reaped;
  }
  // Anything the kernel still had queued from the failed call has completed by now.
  const RawRequest last{Op::kRead, fd, 0, later_buffer.data(), 4096, /*tag=*/3};
  ASSERT_EQ(*engine->Submit(std::span(&last, 1)), 1u);
  while (completions[3] == 0) {
    Result<size_t> reaped = engine->Reap(out, 1);
    ASSERT_TRUE(reaped.ok()) << reaped.status().ToString();
    for (size_t i = 0; i < *reaped; ++i) ++completions[out[i].tag];
  }
  Result<size_t> stray = engine->Reap(out, 0);
  ASSERT_TRUE(stray.ok());
  for (size_t i = 0; i < *stray; ++i) ++completions[out[i].tag];
  EXPECT_EQ(completions, (std::map<uint64_t, int>{{1, 1}, {2, 1}, {3, 1}}));
  // The refused read never reached its buffer.
  const auto zeros = testing::MakeBuffer(4096);
  EXPECT_EQ(std::memcmp(refused_buffer.data(), zeros.data(), 4096), 0);
  ::close(fd);
}

TEST(UringSubmitFailureTest, QueueFailsTheRequestAndKeepsWorkingAfterTheRingRecovers) {
  int ring_fd = -1;
  std::string why;
  std::unique_ptr<Engine> engine = MakeUringEngine(4, &ring_fd, &why);
  if (engine == nullptr) GTEST_SKIP() << why;
  auto queue = testing::MakeQueue(std::move(engine));
  testing::TempDir dir;
  auto files = testing::OpenSet({dir.File("data")});
  ASSERT_NE(files, nullptr);
  auto refused_data = testing::MakeBuffer(4096, 24);
  auto data = testing::MakeBuffer(4096, 25);

  RingOutage outage(ring_fd);
  Result<Ticket> refused = queue->Submit(Request(Op::kWrite, *files, 0, refused_data.span()));
  ASSERT_TRUE(refused.ok());
  const Status status = queue->Wait(*refused);
  ASSERT_FALSE(status.ok());
  const std::string message(status.message());
  EXPECT_NE(message.find(files->file(0).path()), std::string::npos) << message;
  EXPECT_NE(message.find("offset 0"), std::string::npos) << message;
  outage.Restore();

  // The refused write's slot is reused at once; only the new write may reach the file.
  ASSERT_TRUE(queue->Wait(*queue->Submit(Request(Op::kWrite, *files, 4096, data.span()))).ok());
  auto back = testing::MakeBuffer(2 * 4096);
  ASSERT_TRUE(queue->Wait(*queue->Submit(Request(Op::kRead, *files, 0, back.span()))).ok());
  const auto zeros = testing::MakeBuffer(4096);
  EXPECT_EQ(std::memcmp(back.data(), zeros.data(), 4096), 0);
  EXPECT_EQ(std::memcmp(back.data() + 4096, data.data(), 4096), 0);
  EXPECT_TRUE(queue->WaitAll().ok());
}

}  // namespace
}  // namespace zoe::io
