// Description: File and FileSet: O_DIRECT and its alignment, the stripe map (logical offset ->
// file and offset, splitting at stripe boundaries), and argument checks.
#include <gtest/gtest.h>

#include "io/file.h"
#include "io_test_util.h"

namespace zoe::io {
namespace {

TEST(FileTest, OpensWithDirectIoAndReportsItsAlignment) {
  testing::TempDir dir;
  auto file = File::Open(dir.File("f"), {});
  ASSERT_TRUE(file.ok()) << file.status().ToString();
  EXPECT_TRUE((*file)->direct());
  EXPECT_GE((*file)->offset_align(), 512u);
  EXPECT_EQ((*file)->offset_align() & ((*file)->offset_align() - 1), 0u);
  ASSERT_TRUE((*file)->Allocate(1 << 20).ok());
  EXPECT_EQ(*(*file)->Size(), 1u << 20);
}

TEST(FileTest, MissingDirectoryIsNotFoundNamingThePath) {
  testing::TempDir dir;
  auto file = File::Open(dir.File("no/such/file"), {});
  ASSERT_FALSE(file.ok());
  EXPECT_EQ(file.status().code(), StatusCode::kNotFound);
  EXPECT_NE(std::string(file.status().message()).find(dir.File("no/such/file")), std::string::npos);
}

TEST(FileTest, ExclusiveCreateRefusesAnExistingPath) {
  testing::TempDir dir;
  ASSERT_TRUE(File::Open(dir.File("f"), {}).ok());
  OpenOptions options;
  options.exclusive = true;
  EXPECT_FALSE(File::Open(dir.File("f"), options).ok());
}

class StripeMapTest : public ::testing::Test {
 protected:
  void SetUp() override {
    FileSetOptions options;
    options.stripe_unit = 4096;
    set_ = testing::OpenSet({dir_.File("a"), dir_.File("b"), dir_.File("c")}, options);
    ASSERT_NE(set_, nullptr);
  }
  std::vector<FileSet::Piece> Map(uint64_t offset, uint64_t length) {
    std::vector<FileSet::Piece> pieces;
    set_->Map(offset, length, &pieces);
    return pieces;
  }
  testing::TempDir dir_;
  std::unique_ptr<FileSet> set_;
};

TEST_F(StripeMapTest, StripesGoRoundRobin) {
  // Stripe 4 lives in file 4 % 3 = 1, at file offset (4 / 3) * 4096.
  auto pieces = Map(4 * 4096 + 100, 200);
  ASSERT_EQ(pieces.size(), 1u);
  EXPECT_EQ(pieces[0].file, &set_->file(1));
  EXPECT_EQ(pieces[0].file_offset, 4096u + 100);
  EXPECT_EQ(pieces[0].length, 200u);
}

TEST_F(StripeMapTest, RequestsCrossingStripesAreSplit) {
  auto pieces = Map(2048, 3 * 4096);
  ASSERT_EQ(pieces.size(), 4u);
  const uint64_t lengths[] = {2048, 4096, 4096, 2048};
  const size_t files[] = {0, 1, 2, 0};
  const uint64_t file_offsets[] = {2048, 0, 0, 4096};
  uint64_t logical = 2048;
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(pieces[i].length, lengths[i]) << i;
    EXPECT_EQ(pieces[i].file, &set_->file(files[i])) << i;
    EXPECT_EQ(pieces[i].file_offset, file_offsets[i]) << i;
    EXPECT_EQ(pieces[i].logical_offset, logical) << i;
    logical += lengths[i];
  }
}

TEST_F(StripeMapTest, PerFileBytesCoverWholeStripes) {
  EXPECT_EQ(set_->PerFileBytes(3 * 4096), 4096u);
  EXPECT_EQ(set_->PerFileBytes(3 * 4096 + 1), 2u * 4096);
  EXPECT_NE(set_->Describe().find("stripe 4096 B"), std::string::npos);
}

TEST(FileSetTest, SingleFileIsNeverSplit) {
  testing::TempDir dir;
  auto set = testing::OpenSet({dir.File("a")});
  std::vector<FileSet::Piece> pieces;
  set->Map(100, 10 << 20, &pieces);
  ASSERT_EQ(pieces.size(), 1u);
  EXPECT_EQ(pieces[0].file_offset, 100u);
}

TEST(FileSetTest, RejectsStripeUnitsThatBreakDirectIoAlignment) {
  testing::TempDir dir;
  FileSetOptions options;
  options.stripe_unit = 1000;
  auto set = FileSet::Open({dir.File("a"), dir.File("b")}, options);
  ASSERT_FALSE(set.ok());
  EXPECT_EQ(set.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(set.status().message()).find("stripe unit 1000 B"), std::string::npos);
  EXPECT_EQ(FileSet::Open({}, {}).status().code(), StatusCode::kInvalidArgument);
  options.stripe_unit = 0;
  EXPECT_EQ(FileSet::Open({dir.File("a")}, options).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace zoe::io
