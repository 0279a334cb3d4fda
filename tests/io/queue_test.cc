// Description: IoQueue's own contract: validation before submission, per-request tickets
// (wait for one, poll, wait all), completion callbacks, many threads submitting at once,
// registered buffers and files, batching, and checksums computed and verified by the caller.
#include "io/queue.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "io_test_util.h"

namespace zoe::io {
namespace {

using testing::Request;

class QueueTest : public ::testing::Test {
 protected:
  void SetUp() override { Open(BackendKind::kAuto, {}); }

  void Open(BackendKind backend, QueueOptions options, uint32_t depth = 8) {
    std::string why;
    auto engine = testing::MakeEngine(backend, depth, &why);
    ASSERT_NE(engine, nullptr) << why;
    queue_ = testing::MakeQueue(std::move(engine), std::move(options));
    files_ = testing::OpenSet({dir_.File("data")});
    ASSERT_NE(files_, nullptr);
  }

  Status WriteAndWait(uint64_t offset, std::span<std::byte> data) {
    Result<Ticket> ticket = queue_->Submit(Request(Op::kWrite, *files_, offset, data));
    if (!ticket.ok()) return ticket.status();
    return queue_->Wait(*ticket);
  }

  testing::TempDir dir_;
  std::unique_ptr<IoQueue> queue_;
  std::unique_ptr<FileSet> files_;
};

TEST_F(QueueTest, RejectsMisalignedOffsetBeforeSubmission) {
  ASSERT_TRUE(files_->direct());
  auto buffer = testing::MakeBuffer(8192, 1);
  Result<Ticket> ticket = queue_->Submit(Request(Op::kWrite, *files_, 100, buffer.span()));
  ASSERT_FALSE(ticket.ok());
  EXPECT_EQ(ticket.status().code(), StatusCode::kInvalidArgument);
  const std::string message(ticket.status().message());
  EXPECT_NE(message.find(files_->file(0).path()), std::string::npos) << message;
  EXPECT_NE(message.find("offset 100 (misaligned)"), std::string::npos) << message;
  EXPECT_EQ(queue_->stats().requests, 0u);
}

TEST_F(QueueTest, RejectsMisalignedLengthAndBufferAddress) {
  auto buffer = testing::MakeBuffer(16384, 1);
  Result<Ticket> short_length =
      queue_->Submit(Request(Op::kRead, *files_, 0, buffer.span().subspan(0, 1000)));
  ASSERT_FALSE(short_length.ok());
  EXPECT_NE(std::string(short_length.status().message()).find("length 1000 (misaligned)"),
            std::string::npos);
  Result<Ticket> odd_address =
      queue_->Submit(Request(Op::kRead, *files_, 0, buffer.span().subspan(8, 8192)));
  ASSERT_FALSE(odd_address.ok());
  EXPECT_NE(std::string(odd_address.status().message()).find("misaligned: yes"), std::string::npos)
      << odd_address.status().message();
}

TEST_F(QueueTest, BufferedFilesAcceptAnyAlignment) {
  FileSetOptions options;
  options.open.direct = false;
  auto buffered = testing::OpenSet({dir_.File("buffered")}, options);
  auto data = testing::MakeBuffer(8192, 9);
  auto write = queue_->Submit(Request(Op::kWrite, *buffered, 3, data.span().subspan(1, 1001)));
  ASSERT_TRUE(write.ok()) << write.status().ToString();
  ASSERT_TRUE(queue_->Wait(*write).ok());
  auto back = testing::MakeBuffer(8192);
  ASSERT_TRUE(
      queue_->Wait(*queue_->Submit(Request(Op::kRead, *buffered, 3, back.span().subspan(5, 1001))))
          .ok());
  EXPECT_EQ(std::memcmp(back.data() + 5, data.data() + 1, 1001), 0);
}

TEST_F(QueueTest, RejectsEmptyAndFilelessRequests) {
  EXPECT_EQ(queue_->Submit(Request(Op::kRead, *files_, 0, {})).status().code(),
            StatusCode::kInvalidArgument);
  auto buffer = testing::MakeBuffer(4096);
  EXPECT_EQ(queue_->Submit(IoRequest{Op::kRead, nullptr, 0, buffer.span()}).status().code(),
            StatusCode::kInvalidArgument);
}

TEST_F(QueueTest, ABatchWithOneInvalidRequestQueuesNothing) {
  auto buffer = testing::MakeBuffer(3 * 4096, 2);
  std::vector<IoRequest> requests = {
      Request(Op::kWrite, *files_, 0, buffer.span().subspan(0, 4096)),
      Request(Op::kWrite, *files_, 17, buffer.span().subspan(4096, 4096))};
  std::vector<Ticket> tickets;
  EXPECT_FALSE(queue_->SubmitBatch(requests, &tickets).ok());
  EXPECT_TRUE(tickets.empty());
  EXPECT_EQ(queue_->stats().requests, 0u);
}

TEST_F(QueueTest, WaitsForOneRequestAndPollsOthers) {
  auto data = testing::MakeBuffer(64 * 4096, 3);
  std::vector<IoRequest> requests;
  for (int i = 0; i < 64; ++i)
    requests.push_back(Request(Op::kWrite, *files_, i * 4096, data.span().subspan(i * 4096, 4096)));
  std::vector<Ticket> tickets;
  ASSERT_TRUE(queue_->SubmitBatch(requests, &tickets).ok());
  ASSERT_EQ(tickets.size(), 64u);
  EXPECT_TRUE(queue_->Wait(tickets[40]).ok());
  // A collected ticket is forgotten.
  EXPECT_EQ(queue_->Wait(tickets[40]).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(queue_->Poll(tickets[40])->code(), StatusCode::kInvalidArgument);
  int collected = 0;
  while (collected < 10) {
    for (int i = 0; i < 10; ++i) {
      if (tickets[i] == 0) continue;
      std::optional<Status> status = queue_->Poll(tickets[i]);
      if (!status) continue;
      EXPECT_TRUE(status->ok());
      tickets[i] = 0;
      ++collected;
    }
  }
  EXPECT_TRUE(queue_->WaitAll().ok());
  EXPECT_EQ(queue_->Wait(tickets[63]).code(), StatusCode::kInvalidArgument);
}

TEST_F(QueueTest, UnknownTicketIsAnError) {
  Status status = queue_->Wait(12345);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(status.message()).find("12345"), std::string::npos);
}

TEST_F(QueueTest, CallbackSeesEveryRequestBeforeWaitReturns) {
  std::atomic<int> calls{0};
  std::atomic<Ticket> last{0};
  QueueOptions options;
  options.on_complete = [&](Ticket t, const Status& s) {
    EXPECT_TRUE(s.ok());
    last = t;
    ++calls;
  };
  Open(BackendKind::kAuto, options);
  auto data = testing::MakeBuffer(16 * 4096, 4);
  std::vector<Ticket> tickets;
  for (int i = 0; i < 16; ++i) {
    tickets.push_back(*queue_->Submit(
        Request(Op::kWrite, *files_, i * 4096, data.span().subspan(i * 4096, 4096))));
  }
  ASSERT_TRUE(queue_->WaitAll().ok());
  EXPECT_EQ(calls.load(), 16);
  ASSERT_TRUE(
      queue_->Wait(*queue_->Submit(Request(Op::kRead, *files_, 0, data.span().subspan(0, 4096))))
          .ok());
  EXPECT_EQ(calls.load(), 17);
  EXPECT_GT(last.load(), tickets.back());
}

TEST_F(QueueTest, ManyThreadsSubmitAndWaitAtOnce) {
  constexpr int kThreads = 4;
  constexpr int kPerThread = 32;
  auto data = testing::MakeBuffer(kThreads * kPerThread * 4096, 5);
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        const uint64_t block = t * kPerThread + i;
        auto ticket = queue_->Submit(
            Request(Op::kWrite, *files_, block * 4096, data.span().subspan(block * 4096, 4096)));
        if (!ticket.ok() || !queue_->Wait(*ticket).ok()) ++failures;
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(failures.load(), 0);
  auto back = testing::MakeBuffer(data.size());
  ASSERT_TRUE(queue_->Wait(*queue_->Submit(Request(Op::kRead, *files_, 0, back.span()))).ok());
  EXPECT_EQ(std::memcmp(back.data(), data.data(), data.size()), 0);
}

TEST_F(QueueTest, RegisteredBuffersAndFilesCarryData) {
  Open(BackendKind::kIoUring, {});
  auto data = testing::MakeBuffer(1 << 20, 6);
  auto back = testing::MakeBuffer(1 << 20);
  BufferRegion regions[] = {{data.data(), data.size()}, {back.data(), back.size()}};
  ASSERT_TRUE(queue_->RegisterBuffers(regions).ok());
  queue_->RegisterFiles(*files_);
  ASSERT_TRUE(WriteAndWait(0, data.span()).ok());
  ASSERT_TRUE(queue_->Wait(*queue_->Submit(Request(Op::kRead, *files_, 0, back.span()))).ok());
  EXPECT_EQ(std::memcmp(back.data(), data.data(), data.size()), 0);
  queue_->UnregisterFiles(*files_);
  EXPECT_NE(queue_->engine().features().find("registered"), std::string::npos)
      << queue_->engine().features();
}

TEST_F(QueueTest, InFlightRequestsPollAsPendingAndBlockBufferRegistration) {
  std::string why;
  auto gated =
      std::make_unique<testing::GatedEngine>(testing::MakeEngine(BackendKind::kAuto, 8, &why));
  testing::GatedEngine* gate = gated.get();
  queue_ = testing::MakeQueue(std::move(gated));
  auto data = testing::MakeBuffer(1 << 20, 6);
  auto ticket = queue_->Submit(Request(Op::kWrite, *files_, 0, data.span()));
  ASSERT_TRUE(ticket.ok());
  EXPECT_FALSE(queue_->Poll(*ticket).has_value());
  BufferRegion region{data.data(), data.size()};
  EXPECT_EQ(queue_->RegisterBuffers(std::span(&region, 1)).code(), StatusCode::kFailedPrecondition);
  gate->Open();
  EXPECT_TRUE(queue_->Wait(*ticket).ok());
  EXPECT_TRUE(queue_->RegisterBuffers(std::span(&region, 1)).ok());
}

TEST_F(QueueTest, BatchGoesToTheEngineInFewCalls) {
  Open(BackendKind::kAuto, {}, 16);
  auto data = testing::MakeBuffer(16 * 65536, 8);
  std::vector<IoRequest> requests;
  for (int i = 0; i < 16; ++i)
    requests.push_back(
        Request(Op::kWrite, *files_, i * 65536, data.span().subspan(i * 65536, 65536)));
  std::vector<Ticket> tickets;
  ASSERT_TRUE(queue_->SubmitBatch(requests, &tickets).ok());
  ASSERT_TRUE(queue_->WaitAll().ok());
  EXPECT_EQ(queue_->stats().engine_submits, 1u);
  EXPECT_EQ(queue_->stats().pieces, 16u);
}

// A caller that hashes the data itself: the queue records its sums for a write and leaves the
// verification of a read to it, so a block damaged on disk reaches the caller unverified and the
// caller's own check (ChecksumTable::CheckBlock) is what catches it.
TEST_F(QueueTest, CallerComputedChecksumsAreRecordedAndCallerVerifiedReadsAreLeftAlone) {
  FileSetOptions options;
  options.checksum_block = 4096;
  std::unique_ptr<FileSet> files = testing::OpenSet({dir_.File("summed")}, options);
  ASSERT_NE(files, nullptr);
  ChecksumTable& table = *files->checksums();
  auto data = testing::MakeBuffer(3 * 4096, 7);
  std::vector<uint64_t> sums;
  for (size_t i = 0; i < 3; ++i) sums.push_back(Xxh3(data.span().subspan(i * 4096, 4096)));
  IoRequest write = Request(Op::kWrite, *files, 0, data.span());
  write.caller_sums = std::span(sums).subspan(0, 2);
  EXPECT_EQ(queue_->Submit(write).status().code(), StatusCode::kInvalidArgument);
  write.caller_sums = sums;
  Result<Ticket> written = queue_->Submit(write);
  ASSERT_TRUE(written.ok()) << written.status().ToString();
  ASSERT_TRUE(queue_->Wait(*written).ok());
  std::vector<uint64_t> recorded(3);
  ASSERT_TRUE(table.Expected(0, recorded, "r").ok());
  EXPECT_EQ(recorded, sums);

  // Damage block 1 on disk behind the queue's back.
  const int fd = ::open(files->file(0).path().c_str(), O_WRONLY);
  ASSERT_GE(fd, 0);
  const char junk = 'x';
  ASSERT_EQ(::pwrite(fd, &junk, 1, 4096 + 9), 1);
  ::close(fd);
  auto back = testing::MakeBuffer(3 * 4096, 0);
  IoRequest read = Request(Op::kRead, *files, 0, back.span());
  Result<Ticket> by_queue = queue_->Submit(read);
  ASSERT_TRUE(by_queue.ok());
  EXPECT_EQ(queue_->Wait(*by_queue).code(), StatusCode::kCorruption);
  IoRequest bad_read = read;
  bad_read.caller_sums = sums;  // sums are for writes
  EXPECT_EQ(queue_->Submit(bad_read).status().code(), StatusCode::kInvalidArgument);
  read.caller_verifies = true;
  Result<Ticket> by_caller = queue_->Submit(read);
  ASSERT_TRUE(by_caller.ok());
  ASSERT_TRUE(queue_->Wait(*by_caller).ok());
  EXPECT_TRUE(ChecksumTable::CheckBlock(back.span().subspan(0, 4096), recorded[0], 0, "r").ok());
  EXPECT_EQ(
      ChecksumTable::CheckBlock(back.span().subspan(4096, 4096), recorded[1], 4096, "r").code(),
      StatusCode::kCorruption);
}

TEST_F(QueueTest, ReadPastEndOfFileNamesPathAndOffset) {
  auto data = testing::MakeBuffer(8192, 1);
  ASSERT_TRUE(WriteAndWait(0, data.span().subspan(0, 4096)).ok());
  Status status = queue_->Wait(*queue_->Submit(Request(Op::kRead, *files_, 0, data.span())));
  EXPECT_EQ(status.code(), StatusCode::kIoError);
  EXPECT_NE(std::string(status.message()).find("offset 4096"), std::string::npos)
      << status.ToString();
  EXPECT_NE(std::string(status.message()).find("end of file"), std::string::npos)
      << status.ToString();
}

}  // namespace
}  // namespace zoe::io
