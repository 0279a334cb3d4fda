// Description: what IoQueue does when Engine::Reap itself fails: a few failures in a row are
// retried and the requests complete; max_reap_failures in a row fail every request in flight,
// queued or following one with the reap's error within a bounded time, and the queue then
// refuses new requests with the same error instead of hanging.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <string>

#include "io_test_util.h"

namespace zoe::io {
namespace {

using testing::Request;

// Fails its first `failures` Reap calls with EIO (as a broken ring would), then forwards.
class FailingReapEngine : public EngineWrapper {
 public:
  FailingReapEngine(std::unique_ptr<Engine> target, int failures)
      : EngineWrapper(std::move(target)), failures_left_(failures) {}
  Result<size_t> Reap(std::span<RawCompletion> out, size_t min_completions) override {
    ++reaps_;
    if (failures_left_.fetch_sub(1) > 0) {
      return Status::IoError("injected: reaping completions failed", EIO);
    }
    return EngineWrapper::Reap(out, min_completions);
  }
  int reaps() const { return reaps_.load(); }

 private:
  std::atomic<int> failures_left_;
  std::atomic<int> reaps_{0};
};

class ReapFailureTest : public ::testing::Test {
 protected:
  FailingReapEngine* Open(int failures, uint32_t max_reap_failures) {
    std::string why;
    auto engine = testing::MakeEngine(BackendKind::kAuto, 4, &why);
    EXPECT_NE(engine, nullptr) << why;
    auto failing = std::make_unique<FailingReapEngine>(std::move(engine), failures);
    FailingReapEngine* raw = failing.get();
    QueueOptions options;
    options.max_reap_failures = max_reap_failures;
    queue_ = testing::MakeQueue(std::move(failing), options);
    files_ = testing::OpenSet({dir_.File("data")});
    return raw;
  }

  testing::TempDir dir_;
  std::unique_ptr<FileSet> files_;
  std::unique_ptr<IoQueue> queue_;  // destroyed before files_: it waits for its requests
};

TEST_F(ReapFailureTest, FailuresBelowTheBoundAreRetriedAndTheDataArrives) {
  FailingReapEngine* engine = Open(/*failures=*/3, /*max_reap_failures=*/16);
  ASSERT_NE(queue_, nullptr);
  auto data = testing::MakeBuffer(8192, 5);
  ASSERT_TRUE(queue_->Wait(*queue_->Submit(Request(Op::kWrite, *files_, 0, data.span()))).ok());
  EXPECT_GE(engine->reaps(), 4);
  auto back = testing::MakeBuffer(8192);
  ASSERT_TRUE(queue_->Wait(*queue_->Submit(Request(Op::kRead, *files_, 0, back.span()))).ok());
  EXPECT_EQ(std::memcmp(back.data(), data.data(), data.size()), 0);
}

TEST_F(ReapFailureTest, PersistentFailureFailsEveryRequestAndRefusesNewOnesWithoutHanging) {
  FailingReapEngine* engine = Open(/*failures=*/1 << 30, /*max_reap_failures=*/6);
  ASSERT_NE(queue_, nullptr);
  // More requests than the queue depth (4): some are in flight, some queued, one follows.
  std::vector<AlignedBuffer> buffers;
  std::vector<Ticket> tickets;
  for (int i = 0; i < 6; ++i) {
    buffers.push_back(testing::MakeBuffer(4096, 10 + i));
    Result<Ticket> ticket =
        queue_->Submit(Request(Op::kWrite, *files_, 4096u * i, buffers.back().span()));
    ASSERT_TRUE(ticket.ok()) << ticket.status().ToString();
    tickets.push_back(*ticket);
  }
  IoRequest follower = Request(Op::kWrite, *files_, 0, buffers.front().span());
  follower.after = tickets.back();
  Result<Ticket> following = queue_->Submit(follower);
  ASSERT_TRUE(following.ok()) << following.status().ToString();
  tickets.push_back(*following);

  const auto start = std::chrono::steady_clock::now();
  for (const Ticket ticket : tickets) {
    const Status status = queue_->Wait(ticket);
    EXPECT_EQ(status.code(), StatusCode::kIoError) << status.ToString();
    EXPECT_NE(status.ToString().find("reaping completions"), std::string::npos)
        << status.ToString();
  }
  // 6 failures with back-offs of 1, 2, 4, 8, 16 ms: well under a second, even on a loaded CI box.
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  EXPECT_EQ(engine->reaps(), 6);

  Result<Ticket> refused = queue_->Submit(Request(Op::kRead, *files_, 0, buffers[1].span()));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kIoError);
  EXPECT_NE(refused.status().ToString().find("accepts no more"), std::string::npos)
      << refused.status().ToString();
}

}  // namespace
}  // namespace zoe::io
