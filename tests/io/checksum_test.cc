// Description: ChecksumTable: per-block xxh3 recorded on write and verified on read; mismatches
// name the extent and block; whole-block coverage is required; freed blocks are forgotten.
#include "io/checksum.h"

#include <gtest/gtest.h>

#include "io_test_util.h"

namespace zoe::io {
namespace {

TEST(ChecksumTest, VerifiesWhatWasRecorded) {
  ChecksumTable table(4096);
  auto data = testing::MakeBuffer(3 * 4096, 1);
  table.Record(8192, data.span());
  EXPECT_TRUE(table.Verify(8192, data.span(), "read f").ok());
  EXPECT_TRUE(table.Verify(12288, data.span().subspan(4096, 4096), "read f").ok());
}

TEST(ChecksumTest, OneFlippedBitIsCorruptionNamingExtentAndBlock) {
  ChecksumTable table(4096);
  auto data = testing::MakeBuffer(3 * 4096, 1);
  table.Record(0, data.span());
  data.data()[2 * 4096 + 7] ^= std::byte{1};
  Status status = table.Verify(0, data.span(), "read /swap/a");
  EXPECT_EQ(status.code(), StatusCode::kCorruption);
  const std::string message(status.message());
  EXPECT_NE(message.find("read /swap/a"), std::string::npos) << message;
  EXPECT_NE(message.find("extent [0, 12288)"), std::string::npos) << message;
  EXPECT_NE(message.find("block at offset 8192"), std::string::npos) << message;
}

TEST(ChecksumTest, UnwrittenAndForgottenBlocksAreRefused) {
  ChecksumTable table(4096);
  auto data = testing::MakeBuffer(2 * 4096, 1);
  EXPECT_EQ(table.Verify(0, data.span(), "r").code(), StatusCode::kFailedPrecondition);
  table.Record(0, data.span());
  table.Forget(4096, 4096);
  EXPECT_TRUE(table.Verify(0, data.span().subspan(0, 4096), "r").ok());
  EXPECT_EQ(table.Verify(0, data.span(), "r").code(), StatusCode::kFailedPrecondition);
}

TEST(ChecksumTest, CoverageMustBeWholeBlocks) {
  ChecksumTable table(4096);
  EXPECT_TRUE(table.CheckCovers(4096, 8192, "w").ok());
  EXPECT_EQ(table.CheckCovers(4096, 100, "w").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(table.CheckCovers(512, 4096, "w").code(), StatusCode::kInvalidArgument);
}

TEST(ChecksumTest, Xxh3DependsOnEveryByte) {
  auto data = testing::MakeBuffer(4096, 3);
  const uint64_t before = Xxh3(data.span());
  data.data()[4095] ^= std::byte{0x80};
  EXPECT_NE(Xxh3(data.span()), before);
}

}  // namespace
}  // namespace zoe::io
