// Description: IoQueue's ordering of a request after an earlier one (IoRequest::after): the
// follower reaches the engine only once the request it follows has completed, so a read may
// target the buffer a write is still writing from; a failure of the earlier request fails the
// follower without starting it, and a ticket that is unknown is refused.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "io/fault_injection.h"
#include "io/queue.h"
#include "io_test_util.h"

namespace zoe::io {
namespace {

using testing::Request;

constexpr uint64_t kBytes = 1 << 20;

// Numbers every accepted submission and every reaped completion on one clock, per operation and
// offset, so a test can tell whether a transfer went to the engine before another came back.
class RecordingEngine : public EngineWrapper {
 public:
  struct Event {
    uint64_t sequence;
    Op op;
    uint64_t offset;
  };
  using EngineWrapper::EngineWrapper;
  Result<size_t> Submit(std::span<const RawRequest> requests) override {
    Result<size_t> accepted = EngineWrapper::Submit(requests);
    std::lock_guard lock(mutex_);
    for (size_t i = 0; accepted.ok() && i < *accepted; ++i) {
      submitted_.push_back({++clock_, requests[i].op, requests[i].offset});
      ops_[requests[i].tag] = {0, requests[i].op, requests[i].offset};
    }
    return accepted;
  }
  Result<size_t> Reap(std::span<RawCompletion> out, size_t min_completions) override {
    Result<size_t> reaped = EngineWrapper::Reap(out, min_completions);
    std::lock_guard lock(mutex_);
    for (size_t i = 0; reaped.ok() && i < *reaped; ++i) {
      const Event& op = ops_[out[i].tag];
      completed_.push_back({++clock_, op.op, op.offset});
    }
    return reaped;
  }
  // The first submission, or completion, of `op` at `offset` (0: none).
  uint64_t FirstSubmitted(Op op, uint64_t offset) const { return First(submitted_, op, offset); }
  uint64_t FirstCompleted(Op op, uint64_t offset) const { return First(completed_, op, offset); }

 private:
  uint64_t First(const std::vector<Event>& events, Op op, uint64_t offset) const {
    std::lock_guard lock(mutex_);
    for (const Event& e : events) {
      if (e.op == op && e.offset == offset) return e.sequence;
    }
    return 0;
  }

  mutable std::mutex mutex_;
  uint64_t clock_ = 0;
  std::vector<Event> submitted_, completed_;
  std::vector<Event> ops_ = std::vector<Event>(4096);  // by tag (the queue's slot index)
};

class QueueOrderTest : public ::testing::Test {
 protected:
  // recording(gated(faults(a real engine))); `eio_on_write` > 0 fails that write with EIO.
  void Open(uint64_t eio_on_write = 0) {
    std::string why;
    auto real = testing::MakeEngine(BackendKind::kAuto, 8, &why);
    ASSERT_NE(real, nullptr) << why;
    auto faults = std::make_unique<FaultInjectingEngine>(std::move(real), 1);
    if (eio_on_write > 0) {
      faults->AddRule({.kind = FaultKind::kEio, .ops = FaultOps::kWrites, .nth = eio_on_write});
    }
    auto gated = std::make_unique<testing::GatedEngine>(std::move(faults));
    gate_ = gated.get();
    auto recording = std::make_unique<RecordingEngine>(std::move(gated));
    recorder_ = recording.get();
    queue_ = testing::MakeQueue(std::move(recording));
    files_ = testing::OpenSet({dir_.File("data")});
    ASSERT_NE(files_, nullptr);
  }

  IoRequest After(IoRequest request, Ticket ticket) {
    request.after = ticket;
    return request;
  }

  // Submits a write of `data` at offset 0 and, behind it, a read of the same bytes into `back`:
  // their tickets (0 for one whose submission failed).
  std::pair<Ticket, Ticket> WriteThenReadBack(std::span<std::byte> data,
                                              std::span<std::byte> back) {
    Result<Ticket> write = queue_->Submit(Request(Op::kWrite, *files_, 0, data));
    if (!write.ok()) return {0, 0};
    Result<Ticket> read = queue_->Submit(After(Request(Op::kRead, *files_, 0, back), *write));
    return {*write, read.ok() ? *read : 0};
  }

  testing::TempDir dir_;
  std::unique_ptr<IoQueue> queue_;
  std::unique_ptr<FileSet> files_;
  testing::GatedEngine* gate_ = nullptr;
  RecordingEngine* recorder_ = nullptr;
};

// The pipeline's pattern: the next chunk is read into the buffer the last one is written from.
TEST_F(QueueOrderTest, ReadIntoAWritesBufferStartsOnlyOnceTheWriteCompleted) {
  Open();
  auto buffer = testing::MakeBuffer(kBytes, 1);
  auto other = testing::MakeBuffer(kBytes, 2);
  // What the read will find, written around the queue (whose completions are gated).
  const int fd = ::open(files_->file(0).path().c_str(), O_WRONLY);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::pwrite(fd, other.data(), kBytes, kBytes), static_cast<ssize_t>(kBytes));
  ::close(fd);
  auto write = queue_->Submit(Request(Op::kWrite, *files_, 0, buffer.span()));
  ASSERT_TRUE(write.ok());
  auto read = queue_->Submit(After(Request(Op::kRead, *files_, kBytes, buffer.span()), *write));
  ASSERT_TRUE(read.ok()) << read.status().ToString();

  EXPECT_FALSE(queue_->Poll(*read).has_value());
  EXPECT_EQ(recorder_->FirstSubmitted(Op::kRead, kBytes), 0u) << "the read went to the engine "
                                                                 "while its write was in flight";
  gate_->Open();
  ASSERT_TRUE(queue_->Wait(*read).ok());
  ASSERT_TRUE(queue_->Wait(*write).ok());
  EXPECT_GT(recorder_->FirstSubmitted(Op::kRead, kBytes), recorder_->FirstCompleted(Op::kWrite, 0));
  EXPECT_EQ(std::memcmp(buffer.data(), other.data(), kBytes), 0);  // what the read brought
  auto back = testing::MakeBuffer(kBytes, 0);
  ASSERT_TRUE(queue_->Wait(*queue_->Submit(Request(Op::kRead, *files_, 0, back.span()))).ok());
  const auto written = testing::MakeBuffer(kBytes, 1);
  EXPECT_EQ(std::memcmp(back.data(), written.data(), kBytes), 0);  // the write was not disturbed
}

TEST_F(QueueOrderTest, FollowersOfAFailedRequestFailWithItsStatusWithoutStarting) {
  Open(/*eio_on_write=*/1);
  auto buffer = testing::MakeBuffer(kBytes, 1);
  auto write = queue_->Submit(Request(Op::kWrite, *files_, 0, buffer.span()));
  ASSERT_TRUE(write.ok());
  auto read = queue_->Submit(After(Request(Op::kRead, *files_, kBytes, buffer.span()), *write));
  ASSERT_TRUE(read.ok());
  // A chain: the second follower follows the first one.
  auto rewrite = queue_->Submit(After(Request(Op::kWrite, *files_, kBytes, buffer.span()), *read));
  ASSERT_TRUE(rewrite.ok());
  gate_->Open();

  for (Ticket follower : {*read, *rewrite}) {
    const Status status = queue_->Wait(follower);
    EXPECT_EQ(status.code(), StatusCode::kIoError) << status.ToString();
    const std::string message(status.message());
    EXPECT_NE(message.find("not started: the request it follows failed"), std::string::npos)
        << message;
    EXPECT_NE(message.find(files_->file(0).path()), std::string::npos) << message;
  }
  EXPECT_EQ(recorder_->FirstSubmitted(Op::kRead, kBytes), 0u);
  EXPECT_EQ(recorder_->FirstSubmitted(Op::kWrite, kBytes), 0u);

  // Following the failed write once it is done (not yet collected) fails at once, the same way.
  auto late = queue_->Submit(After(Request(Op::kRead, *files_, kBytes, buffer.span()), *write));
  ASSERT_TRUE(late.ok());
  EXPECT_EQ(queue_->Wait(*late).code(), StatusCode::kIoError);
  EXPECT_EQ(recorder_->FirstSubmitted(Op::kRead, kBytes), 0u);

  EXPECT_EQ(queue_->Wait(*write).code(), StatusCode::kIoError);
  // Collected: the ticket is unknown now, and a request that follows it is refused.
  auto unknown = queue_->Submit(After(Request(Op::kRead, *files_, 0, buffer.span()), *write));
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(unknown.status().message()).find("unknown"), std::string::npos)
      << unknown.status().ToString();
  EXPECT_EQ(queue_->stats().requests, 4u);  // the refused one was never queued
  EXPECT_EQ(queue_->stats().followers, 3u);
}

TEST_F(QueueOrderTest, FollowingASuccessfulRequestThatIsDoneStartsAtOnce) {
  Open();
  gate_->Open();
  auto buffer = testing::MakeBuffer(kBytes, 3);
  auto first_back = testing::MakeBuffer(kBytes, 0), second_back = testing::MakeBuffer(kBytes, 0);
  const auto [write, first] = WriteThenReadBack(buffer.span(), first_back.span());
  ASSERT_TRUE(write != 0 && first != 0);
  ASSERT_TRUE(queue_->Wait(first).ok());  // so the write is done, and not yet collected
  auto second = queue_->Submit(After(Request(Op::kRead, *files_, 0, second_back.span()), write));
  ASSERT_TRUE(second.ok());
  ASSERT_TRUE(queue_->Wait(*second).ok());
  ASSERT_TRUE(queue_->Wait(write).ok());
  EXPECT_EQ(queue_->stats().requests, 3u);
  EXPECT_EQ(queue_->stats().followers, 2u);  // both reads: a request with no `after` is none
  EXPECT_EQ(std::memcmp(first_back.data(), buffer.data(), kBytes), 0);
  EXPECT_EQ(std::memcmp(second_back.data(), buffer.data(), kBytes), 0);
}

TEST_F(QueueOrderTest, ABatchWithAnUnknownTicketToFollowIsRefusedWhole) {
  Open();
  gate_->Open();
  auto buffer = testing::MakeBuffer(2 * kBytes, 5);
  const IoRequest requests[] = {
      Request(Op::kWrite, *files_, 0, buffer.span().subspan(0, kBytes)),
      After(Request(Op::kWrite, *files_, kBytes, buffer.span().subspan(kBytes)), 12345)};
  std::vector<Ticket> tickets;
  const Status refused = queue_->SubmitBatch(requests, &tickets);
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument) << refused.ToString();
  EXPECT_NE(std::string(refused.message()).find("follows I/O ticket 12345"), std::string::npos)
      << refused.ToString();
  EXPECT_TRUE(tickets.empty());
  EXPECT_EQ(queue_->stats().requests, 0u);
  EXPECT_EQ(queue_->stats().followers, 0u);
  EXPECT_EQ(recorder_->FirstSubmitted(Op::kWrite, 0), 0u);
}

// With nobody waiting, the queue's own reaper releases the follower and completes it; WaitAll
// covers held requests; buffers cannot be registered while a request and its follower are
// pending.
TEST_F(QueueOrderTest, HeldFollowersCompleteWithoutAWaiterAndCountAsInFlight) {
  Open();
  auto buffer = testing::MakeBuffer(kBytes, 6);
  auto back = testing::MakeBuffer(kBytes, 0);
  const auto [write, read] = WriteThenReadBack(buffer.span(), back.span());
  ASSERT_TRUE(write != 0 && read != 0);
  BufferRegion region{back.data(), back.size()};
  EXPECT_EQ(queue_->RegisterBuffers(std::span(&region, 1)).code(), StatusCode::kFailedPrecondition);
  gate_->Open();
  std::optional<Status> polled;
  while (!(polled = queue_->Poll(read)).has_value()) std::this_thread::yield();
  EXPECT_TRUE(polled->ok()) << polled->ToString();
  EXPECT_EQ(std::memcmp(back.data(), buffer.data(), kBytes), 0);

  auto rewrite = queue_->Submit(After(Request(Op::kWrite, *files_, kBytes, back.span()), write));
  ASSERT_TRUE(rewrite.ok());
  EXPECT_TRUE(queue_->WaitAll().ok());
  EXPECT_EQ(queue_->Poll(write)->code(), StatusCode::kInvalidArgument);  // WaitAll collected it
  EXPECT_TRUE(queue_->RegisterBuffers(std::span(&region, 1)).ok());
}

TEST_F(QueueOrderTest, DestroyingTheQueueWaitsForHeldFollowers) {
  Open();
  auto buffer = testing::MakeBuffer(kBytes, 4);
  auto back = testing::MakeBuffer(kBytes, 0);
  const auto [write, read] = WriteThenReadBack(buffer.span(), back.span());
  ASSERT_TRUE(write != 0 && read != 0);
  gate_->Open();
  queue_.reset();  // must not hang, and must leave no transfer in flight
  EXPECT_EQ(std::memcmp(back.data(), buffer.data(), kBytes), 0);
}

}  // namespace
}  // namespace zoe::io
