// Description: SwapSpace: preallocation, aligned extents, free and reuse with merging, NoSpace
// messages, striping over two directories, checksummed extents, files removed on close.
#include "io/swap_space.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>

#include <csignal>
#include <cstring>
#include <filesystem>

#include "io/queue.h"
#include "io_test_util.h"

namespace zoe::io {
namespace {

using testing::Request;

std::unique_ptr<SwapSpace> MakeSwap(const std::vector<std::string>& dirs, uint64_t capacity,
                                    SwapOptions options = {}) {
  auto swap = SwapSpace::Create(dirs, capacity, options);
  EXPECT_TRUE(swap.ok()) << swap.status().ToString();
  return swap.ok() ? std::move(swap).value() : nullptr;
}

size_t CountFiles(const std::string& dir) {
  size_t n = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator(dir)) ++n;
  return n;
}

TEST(SwapSpaceTest, PreallocatesItsFilesAndRemovesThemOnClose) {
  testing::TempDir dir;
  auto swap = MakeSwap({dir.path()}, 8 << 20);
  ASSERT_NE(swap, nullptr);
  ASSERT_EQ(CountFiles(dir.path()), 1u);
  struct stat st {};
  ASSERT_EQ(::fstat(swap->files().file(0).fd(), &st), 0);
  EXPECT_GE(static_cast<uint64_t>(st.st_blocks) * 512, 8u << 20);  // blocks reserved, not sparse
  ASSERT_TRUE(swap->Close().ok());
  EXPECT_EQ(CountFiles(dir.path()), 0u);
  EXPECT_TRUE(swap->Close().ok());
  EXPECT_EQ(swap->Allocate(4096).status().code(), StatusCode::kFailedPrecondition);
}

TEST(SwapSpaceTest, DestructorRemovesFiles) {
  testing::TempDir dir;
  { auto swap = MakeSwap({dir.path()}, 1 << 20); }
  EXPECT_EQ(CountFiles(dir.path()), 0u);
}

TEST(SwapSpaceTest, ExtentsAreAlignedFreedAndReused) {
  testing::TempDir dir;
  SwapOptions options;
  options.alignment = 64 << 10;
  auto swap = MakeSwap({dir.path()}, 1 << 20, options);
  auto a = swap->Allocate(1000);
  auto b = swap->Allocate(100 << 10);
  auto c = swap->Allocate(64 << 10);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(a->offset, 0u);
  EXPECT_EQ(a->length, 64u << 10);
  EXPECT_EQ(b->offset, 64u << 10);
  EXPECT_EQ(b->length, 128u << 10);
  EXPECT_EQ(c->offset, 192u << 10);
  EXPECT_EQ(swap->free_bytes(), (1u << 20) - (256u << 10));
  ASSERT_TRUE(swap->Free(*a).ok());
  ASSERT_TRUE(swap->Free(*b).ok());
  // a and b merged: a 192 KiB request fits where they were.
  auto d = swap->Allocate(192 << 10);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->offset, 0u);
  EXPECT_EQ(swap->Free(*a).code(), StatusCode::kInvalidArgument);  // no longer allocated as such
}

TEST(SwapSpaceTest, AllocatingMoreThanIsFreeNamesBytesAskedAndFree) {
  testing::TempDir dir;
  SwapOptions options;
  options.alignment = 4096;
  auto swap = MakeSwap({dir.path()}, 1 << 20, options);
  ASSERT_TRUE(swap->Allocate(768 << 10).ok());
  auto too_big = swap->Allocate(512 << 10);
  ASSERT_FALSE(too_big.ok());
  EXPECT_EQ(too_big.status().code(), StatusCode::kNoSpace);
  const std::string message(too_big.status().message());
  EXPECT_NE(message.find("cannot allocate 524288 bytes"), std::string::npos) << message;
  EXPECT_NE(message.find("262144 of 1048576 bytes free"), std::string::npos) << message;
  EXPECT_EQ(swap->Allocate(0).status().code(), StatusCode::kInvalidArgument);
}

TEST(SwapSpaceTest, CapacityBeyondTheDiskFailsAtCreationWithBytesNeededAndFree) {
  testing::TempDir dir;
  auto swap = SwapSpace::Create({dir.path()}, uint64_t{1} << 60, {});
  ASSERT_FALSE(swap.ok());
  EXPECT_EQ(swap.status().code(), StatusCode::kNoSpace);
  EXPECT_NE(std::string(swap.status().message()).find("needs 1152921504606846976 bytes"),
            std::string::npos)
      << swap.status().ToString();
  EXPECT_EQ(CountFiles(dir.path()), 0u);
}

// A real fallocate failure after the free-space check passed: the file-size limit (ulimit -f,
// with SIGXFSZ ignored) makes fallocate fail with EFBIG. Creation fails naming fallocate, the
// file and the size, and leaves no swap file in either directory.
TEST(SwapSpaceTest, FallocateFailingAtCreationLeavesNoFilesAndNamesTheFile) {
  testing::TempDir a, b;
  struct rlimit saved {};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &saved), 0);
  const auto previous = std::signal(SIGXFSZ, SIG_IGN);
  struct rlimit limited = saved;
  limited.rlim_cur = 1 << 20;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &limited), 0);
  auto swap = SwapSpace::Create({a.path(), b.path()}, 16 << 20, SwapOptions{});
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &saved), 0);
  std::signal(SIGXFSZ, previous);
  ASSERT_FALSE(swap.ok());
  const std::string message = swap.status().ToString();
  EXPECT_EQ(swap.status().sys_errno(), EFBIG) << message;
  EXPECT_NE(message.find("fallocate 8388608 bytes for " + a.path()), std::string::npos) << message;
  EXPECT_EQ(CountFiles(a.path()), 0u);
  EXPECT_EQ(CountFiles(b.path()), 0u);
}

TEST(SwapSpaceTest, RejectsBadArguments) {
  testing::TempDir dir;
  EXPECT_EQ(SwapSpace::Create({}, 1 << 20, {}).status().code(), StatusCode::kInvalidArgument);
  SwapOptions odd;
  odd.alignment = 3000;
  EXPECT_EQ(SwapSpace::Create({dir.path()}, 1 << 20, odd).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(SwapSpace::Create({dir.File("missing")}, 1 << 20, {}).status().code(),
            StatusCode::kNotFound);
}

TEST(SwapSpaceTest, StripedOverTwoDirectoriesWithChecksummedExtents) {
  testing::TempDir first, second;
  SwapOptions options;
  options.files.stripe_unit = 64 << 10;
  options.files.checksum_block = 64 << 10;
  options.alignment = 64 << 10;
  auto swap = MakeSwap({first.path(), second.path()}, 1 << 20, options);
  ASSERT_NE(swap, nullptr);
  EXPECT_EQ(CountFiles(first.path()), 1u);
  EXPECT_EQ(CountFiles(second.path()), 1u);
  std::string why;
  auto queue = testing::MakeQueue(testing::MakeEngine(BackendKind::kAuto, 8, &why));
  auto extent = swap->Allocate(320 << 10);
  ASSERT_TRUE(extent.ok());
  auto data = testing::MakeBuffer(extent->length, 9);
  auto back = testing::MakeBuffer(extent->length);
  ASSERT_TRUE(
      queue->Wait(*queue->Submit(Request(Op::kWrite, swap->files(), extent->offset, data.span())))
          .ok());
  ASSERT_TRUE(
      queue->Wait(*queue->Submit(Request(Op::kRead, swap->files(), extent->offset, back.span())))
          .ok());
  EXPECT_EQ(std::memcmp(back.data(), data.data(), data.size()), 0);
  // A freed extent forgets its checksums: reading it is refused until it is written again.
  ASSERT_TRUE(swap->Free(*extent).ok());
  EXPECT_EQ(
      queue->Wait(*queue->Submit(Request(Op::kRead, swap->files(), extent->offset, back.span())))
          .code(),
      StatusCode::kFailedPrecondition);
}

TEST(SwapSpaceTest, GrowAddsAllocatableSpaceAfterTheEndAndKeepsWrittenExtents) {
  testing::TempDir first, second;
  SwapOptions options;
  options.files.stripe_unit = 64 << 10;
  options.alignment = 64 << 10;
  auto swap = MakeSwap({first.path(), second.path()}, 1 << 20, options);
  ASSERT_NE(swap, nullptr);
  std::string why;
  auto queue = testing::MakeQueue(testing::MakeEngine(BackendKind::kAuto, 8, &why));
  auto head = swap->Allocate(512 << 10);
  ASSERT_TRUE(head.ok());
  auto data = testing::MakeBuffer(head->length, 5);
  ASSERT_TRUE(
      queue->Wait(*queue->Submit(Request(Op::kWrite, swap->files(), head->offset, data.span())))
          .ok());
  EXPECT_EQ(swap->Allocate(1 << 20).status().code(), StatusCode::kNoSpace);

  Result<uint64_t> grown = swap->Grow(700 << 10);  // rounded up to the 64 KiB alignment
  ASSERT_TRUE(grown.ok()) << grown.status().ToString();
  EXPECT_EQ(*grown, (1 << 20) + (704 << 10));
  EXPECT_EQ(swap->capacity(), *grown);
  EXPECT_EQ(swap->free_bytes(), *grown - (512 << 10));
  // The free tail before the growth and the growth are one extent.
  auto tail = swap->Allocate(*grown - (512 << 10));
  ASSERT_TRUE(tail.ok()) << tail.status().ToString();
  EXPECT_EQ(tail->offset, 512u << 10);
  for (size_t i = 0; i < swap->files().file_count(); ++i) {
    struct stat st {};
    ASSERT_EQ(::fstat(swap->files().file(i).fd(), &st), 0);
    EXPECT_GE(static_cast<uint64_t>(st.st_blocks) * 512, swap->files().PerFileBytes(*grown));
  }
  auto fill = testing::MakeBuffer(tail->length, 7);
  ASSERT_TRUE(
      queue->Wait(*queue->Submit(Request(Op::kWrite, swap->files(), tail->offset, fill.span())))
          .ok());
  auto back = testing::MakeBuffer(head->length);
  ASSERT_TRUE(
      queue->Wait(*queue->Submit(Request(Op::kRead, swap->files(), head->offset, back.span())))
          .ok());
  EXPECT_EQ(std::memcmp(back.data(), data.data(), data.size()), 0);
}

TEST(SwapSpaceTest, GrowthBeyondTheDiskFailsNamingTheBytesAndAddsNothing) {
  testing::TempDir dir;
  auto swap = MakeSwap({dir.path()}, 1 << 20);
  ASSERT_NE(swap, nullptr);
  Result<uint64_t> grown = swap->Grow(uint64_t{1} << 60);
  ASSERT_FALSE(grown.ok());
  EXPECT_EQ(grown.status().code(), StatusCode::kNoSpace);
  EXPECT_NE(std::string(grown.status().message()).find("but only"), std::string::npos)
      << grown.status().ToString();
  EXPECT_EQ(swap->capacity(), 1u << 20);
  EXPECT_EQ(swap->free_bytes(), 1u << 20);
  EXPECT_EQ(swap->Grow(0).status().code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(swap->Close().ok());
  EXPECT_EQ(swap->Grow(1 << 20).status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(CountFiles(dir.path()), 0u);
}

}  // namespace
}  // namespace zoe::io
