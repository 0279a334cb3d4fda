// Description: every failure mode through FaultInjectingEngine under the real IoQueue: EIO and
// ENOSPC carry path and offset, EINTR/EAGAIN are retried, short transfers are resubmitted,
// corrupted reads are caught by checksums, faults repeat with a seed; and the fallbacks for
// refused O_DIRECT and unavailable io_uring/libaio.
#include "io/fault_injection.h"

#include <gtest/gtest.h>

#include <cstring>

#include "io/queue.h"
#include "io_test_util.h"

namespace zoe::io {
namespace {

using testing::Request;

class FaultTest : public ::testing::TestWithParam<BackendKind> {
 protected:
  void SetUp() override { Open({}, 0); }

  void Open(QueueOptions options, uint64_t checksum_block, uint64_t seed = 1) {
    queue_.reset();
    std::string why;
    auto engine = testing::MakeEngine(GetParam(), 8, &why);
    if (engine == nullptr) GTEST_SKIP() << why;
    auto faulty = std::make_unique<FaultInjectingEngine>(std::move(engine), seed);
    faults_ = faulty.get();
    queue_ = testing::MakeQueue(std::move(faulty), std::move(options));
    FileSetOptions file_options;
    file_options.checksum_block = checksum_block;
    files_.reset();
    files_ = testing::OpenSet({dir_.File("data")}, file_options);
  }

  Status Run(Op op, uint64_t offset, std::span<std::byte> data) {
    Result<Ticket> ticket = queue_->Submit(Request(op, *files_, offset, data));
    if (!ticket.ok()) return ticket.status();
    return queue_->Wait(*ticket);
  }

  testing::TempDir dir_;
  FaultInjectingEngine* faults_ = nullptr;
  std::unique_ptr<IoQueue> queue_;
  std::unique_ptr<FileSet> files_;
};

TEST_P(FaultTest, EioFailsOnlyTheChosenRequestAndNamesPathAndOffset) {
  faults_->AddRule(FaultRule{FaultKind::kEio, FaultOps::kWrites, /*nth=*/3});
  auto data = testing::MakeBuffer(6 * 65536, 1);
  std::vector<IoRequest> requests;
  for (int i = 0; i < 6; ++i)
    requests.push_back(
        Request(Op::kWrite, *files_, i * 65536, data.span().subspan(i * 65536, 65536)));
  std::vector<Ticket> tickets;
  ASSERT_TRUE(queue_->SubmitBatch(requests, &tickets).ok());
  for (int i = 0; i < 6; ++i) {
    Status status = queue_->Wait(tickets[i]);
    if (i != 2) {
      EXPECT_TRUE(status.ok()) << i << ": " << status.ToString();
      continue;
    }
    EXPECT_EQ(status.code(), StatusCode::kIoError);
    EXPECT_EQ(status.sys_errno(), EIO);
    const std::string message(status.message());
    EXPECT_NE(message.find("write " + files_->file(0).path() + " at offset 131072"),
              std::string::npos)
        << message;
  }
  EXPECT_EQ(faults_->injected(), 1u);
}

TEST_P(FaultTest, EnospcIsNoSpace) {
  faults_->AddRule(FaultRule{FaultKind::kEnospc, FaultOps::kWrites, 1});
  auto data = testing::MakeBuffer(65536, 1);
  Status status = Run(Op::kWrite, 65536, data.span());
  EXPECT_EQ(status.code(), StatusCode::kNoSpace);
  EXPECT_NE(std::string(status.message()).find("at offset 65536"), std::string::npos)
      << status.ToString();
}

TEST_P(FaultTest, EintrAndEagainAreRetried) {
  faults_->AddRule(FaultRule{FaultKind::kEintr, FaultOps::kAll, 0, /*one_in=*/2, /*max_faults=*/6});
  faults_->AddRule(FaultRule{FaultKind::kEagain, FaultOps::kAll, 0, 3, 6});
  auto data = testing::MakeBuffer(16 * 4096, 2);
  for (int i = 0; i < 16; ++i)
    ASSERT_TRUE(Run(Op::kWrite, i * 4096, data.span().subspan(i * 4096, 4096)).ok());
  auto back = testing::MakeBuffer(16 * 4096);
  ASSERT_TRUE(Run(Op::kRead, 0, back.span()).ok());
  EXPECT_EQ(std::memcmp(back.data(), data.data(), back.size()), 0);
  EXPECT_GT(faults_->injected(), 0u);
  EXPECT_EQ(queue_->stats().retries, faults_->injected());
}

TEST_P(FaultTest, RetriesAreBounded) {
  QueueOptions options;
  options.max_retries = 3;
  Open(options, 0);
  faults_->AddRule(FaultRule{FaultKind::kEintr, FaultOps::kAll, 0, 1});  // every operation
  auto data = testing::MakeBuffer(4096, 2);
  Status status = Run(Op::kWrite, 0, data.span());
  EXPECT_FALSE(status.ok());
  EXPECT_EQ(status.sys_errno(), EINTR);
  EXPECT_NE(std::string(status.message()).find("after 3 retries"), std::string::npos)
      << status.ToString();
  EXPECT_EQ(faults_->injected(), 4u);
}

TEST_P(FaultTest, ShortTransfersAreResubmittedUntilComplete) {
  faults_->AddRule(FaultRule{FaultKind::kShortTransfer, FaultOps::kAll, 0, 1});  // every operation
  auto data = testing::MakeBuffer(1 << 20, 3);
  ASSERT_TRUE(Run(Op::kWrite, 0, data.span()).ok());
  auto back = testing::MakeBuffer(1 << 20);
  ASSERT_TRUE(Run(Op::kRead, 0, back.span()).ok());
  EXPECT_EQ(std::memcmp(back.data(), data.data(), data.size()), 0);
  // 1 MiB halves down to 4 KiB: 8 short transfers each way, then the final 4 KiB goes whole.
  EXPECT_EQ(queue_->stats().short_transfers, 16u);
}

TEST_P(FaultTest, CorruptedReadIsCaughtByChecksumNamingTheExtent) {
  Open({}, 65536);
  faults_->AddRule(FaultRule{FaultKind::kCorruption, FaultOps::kReads, 2});
  auto data = testing::MakeBuffer(4 * 65536, 4);
  ASSERT_TRUE(Run(Op::kWrite, 0, data.span()).ok());
  auto back = testing::MakeBuffer(4 * 65536);
  ASSERT_TRUE(Run(Op::kRead, 0, back.span()).ok());  // first read is clean
  Status status = Run(Op::kRead, 0, back.span());
  EXPECT_EQ(status.code(), StatusCode::kCorruption);
  const std::string message(status.message());
  EXPECT_NE(message.find("extent [0, 262144)"), std::string::npos) << message;
  EXPECT_NE(message.find("block at offset 131072"), std::string::npos) << message;
  EXPECT_NE(message.find(files_->file(0).path()), std::string::npos) << message;
}

TEST_P(FaultTest, ChecksummedRequestsMustCoverWholeBlocks) {
  Open({}, 65536);
  auto data = testing::MakeBuffer(65536, 4);
  Status status = Run(Op::kWrite, 4096, data.span());
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(status.message()).find("multiples of 65536"), std::string::npos)
      << status.ToString();
}

TEST_P(FaultTest, ReadOfUnwrittenChecksummedBlockIsRefused) {
  Open({}, 4096);
  auto data = testing::MakeBuffer(8192, 4);
  ASSERT_TRUE(Run(Op::kWrite, 0, data.span().subspan(0, 4096)).ok());
  ASSERT_TRUE(::ftruncate(files_->file(0).fd(), 8192) == 0);
  EXPECT_EQ(Run(Op::kRead, 0, data.span()).code(), StatusCode::kFailedPrecondition);
}

// The same seed picks the same operations; the injected count is a function of the seed.
TEST_P(FaultTest, OneInNIsReproducibleWithTheSameSeed) {
  auto run = [&](uint64_t seed) {
    Open({}, 0, seed);
    faults_->AddRule(FaultRule{FaultKind::kEio, FaultOps::kWrites, 0, 4});
    auto data = testing::MakeBuffer(4096, 5);
    std::string pattern;
    for (int i = 0; i < 64; ++i) pattern += Run(Op::kWrite, i * 4096, data.span()).ok() ? '.' : 'x';
    return pattern;
  };
  const std::string first = run(17);
  EXPECT_EQ(first, run(17));
  EXPECT_NE(first.find('x'), std::string::npos);
  EXPECT_NE(first.find('.'), std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(AllBackends, FaultTest,
                         ::testing::Values(BackendKind::kIoUring, BackendKind::kLibaio,
                                           BackendKind::kPsync),
                         [](const auto& param_info) {
                           return std::string(BackendName(param_info.param));
                         });

TEST(FallbackTest, RefusedDirectIoFallsBackToBufferedAndStillWorks) {
  testing::TempDir dir;
  FileSetOptions options;
  options.open.refuse_direct_for_testing = true;
  auto files = testing::OpenSet({dir.File("data")}, options);
  ASSERT_NE(files, nullptr);
  EXPECT_FALSE(files->direct());
  EXPECT_EQ(files->file(0).offset_align(), 1u);
  std::string why;
  auto queue = testing::MakeQueue(testing::MakeEngine(BackendKind::kAuto, 4, &why));
  auto data = testing::MakeBuffer(3 * 4096, 6);
  auto back = testing::MakeBuffer(3 * 4096);
  // Unaligned requests are fine on a buffered file.
  ASSERT_TRUE(
      queue->Wait(*queue->Submit(Request(Op::kWrite, *files, 10, data.span().subspan(0, 5000))))
          .ok());
  ASSERT_TRUE(
      queue->Wait(*queue->Submit(Request(Op::kRead, *files, 10, back.span().subspan(0, 5000))))
          .ok());
  EXPECT_EQ(std::memcmp(back.data(), data.data(), 5000), 0);
}

TEST(FallbackTest, UnavailableIoUringFallsBackToLibaio) {
  EngineOptions options;
  options.refuse_for_testing = {BackendKind::kIoUring};
  auto engine = CreateEngine(options);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  EXPECT_EQ((*engine)->name(), "libaio");
}

TEST(FallbackTest, WithoutIoUringAndLibaioPsyncRuns) {
  EngineOptions options;
  options.refuse_for_testing = {BackendKind::kIoUring, BackendKind::kLibaio};
  auto engine = CreateEngine(options);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  EXPECT_EQ((*engine)->name(), "psync");
}

TEST(FallbackTest, NothingAvailableNamesEveryReason) {
  EngineOptions options;
  options.refuse_for_testing = {BackendKind::kIoUring, BackendKind::kLibaio, BackendKind::kPsync};
  auto engine = CreateEngine(options);
  ASSERT_FALSE(engine.ok());
  EXPECT_EQ(engine.status().code(), StatusCode::kNotSupported);
  const std::string message(engine.status().message());
  for (const char* name : {"io_uring", "libaio", "psync"})
    EXPECT_NE(message.find(name), std::string::npos) << message;
}

TEST(FallbackTest, ANamedBackendThatCannotRunIsAnErrorNotAFallback) {
  EngineOptions options;
  options.backend = BackendKind::kIoUring;
  options.refuse_for_testing = {BackendKind::kIoUring};
  auto engine = CreateEngine(options);
  ASSERT_FALSE(engine.ok());
  EXPECT_EQ(engine.status().code(), StatusCode::kPermissionDenied);
  EXPECT_NE(std::string(engine.status().message()).find("io_uring"), std::string::npos);
}

TEST(FallbackTest, QueueDepthOutOfRangeIsRejected) {
  EngineOptions options;
  options.queue_depth = 0;
  EXPECT_EQ(CreateEngine(options).status().code(), StatusCode::kInvalidArgument);
  options.queue_depth = 5000;
  EXPECT_EQ(CreateEngine(options).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace zoe::io
