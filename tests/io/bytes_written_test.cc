// Description: the bytes each file of a FileSet has had written (File::bytes_written, the wear
// a drive sees): exact for striped writes, short writes counted once by what they moved, failed
// writes and reads not at all.
#include <gtest/gtest.h>

#include "io/fault_injection.h"
#include "io/queue.h"
#include "io_test_util.h"

namespace zoe::io {
namespace {

using testing::Request;

class BytesWrittenTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    auto engine = testing::MakeEngine(BackendKind::kPsync, 8, &why);
    ASSERT_NE(engine, nullptr) << why;
    auto faulty = std::make_unique<FaultInjectingEngine>(std::move(engine), 1);
    faults_ = faulty.get();
    queue_ = testing::MakeQueue(std::move(faulty), {});
    FileSetOptions options;
    options.stripe_unit = 65536;
    files_ = testing::OpenSet({dir_.File("a"), dir_.File("b")}, options);
  }

  Status Run(Op op, uint64_t offset, std::span<std::byte> data) {
    Result<Ticket> ticket = queue_->Submit(Request(op, *files_, offset, data));
    if (!ticket.ok()) return ticket.status();
    return queue_->Wait(*ticket);
  }

  uint64_t Written(size_t file) const { return files_->file(file).bytes_written(); }

  testing::TempDir dir_;
  FaultInjectingEngine* faults_ = nullptr;
  std::unique_ptr<IoQueue> queue_;
  std::unique_ptr<FileSet> files_;
};

TEST_F(BytesWrittenTest, StripedWritesCountOnTheFileThatHoldsThem) {
  auto data = testing::MakeBuffer(5 * 65536, 3);
  ASSERT_TRUE(Run(Op::kWrite, 0, data.span()).ok());  // stripes 0, 2, 4 on a; 1, 3 on b
  EXPECT_EQ(Written(0), 3u * 65536);
  EXPECT_EQ(Written(1), 2u * 65536);
  ASSERT_TRUE(Run(Op::kWrite, 65536, data.span().subspan(0, 4096)).ok());  // stripe 1: b
  EXPECT_EQ(Written(1), 2u * 65536 + 4096);
  ASSERT_TRUE(Run(Op::kRead, 0, data.span()).ok());
  EXPECT_EQ(Written(0) + Written(1), 5u * 65536 + 4096);  // reads do not count
}

TEST_F(BytesWrittenTest, ShortWritesCountWhatTheyMovedAndFailedWritesNothing) {
  auto data = testing::MakeBuffer(65536, 4);
  faults_->AddRule(FaultRule{FaultKind::kShortTransfer, FaultOps::kWrites, 1, 0, 1});
  ASSERT_TRUE(Run(Op::kWrite, 0, data.span()).ok());  // half, then the rest resubmitted
  EXPECT_EQ(queue_->stats().short_transfers, 1u);
  EXPECT_EQ(Written(0), 65536u);
  faults_->AddRule(FaultRule{FaultKind::kEio, FaultOps::kWrites, 1, 0, 1});
  EXPECT_EQ(Run(Op::kWrite, 0, data.span()).code(), StatusCode::kIoError);
  EXPECT_EQ(Written(0), 65536u);
  EXPECT_EQ(Written(1), 0u);
}

}  // namespace
}  // namespace zoe::io
