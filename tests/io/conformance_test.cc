// Description: one conformance suite over every backend x direct/buffered x pinned/pageable x
// single/striped file set, checking every byte read and written against a reference.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <random>
#include <tuple>

#include "io/queue.h"
#include "io_test_util.h"

namespace zoe::io {
namespace {

using testing::FillPattern;
using testing::Request;

constexpr uint64_t kBytes = 3 << 20;
constexpr uint64_t kStripe = 64 << 10;
constexpr uint32_t kDepth = 4;

struct Params {
  BackendKind backend;
  bool direct;
  bool pinned;
  bool striped;
};

class ConformanceTest : public ::testing::TestWithParam<std::tuple<BackendKind, bool, bool, bool>> {
 protected:
  void SetUp() override {
    const auto& [backend, direct, pinned, striped] = GetParam();
    params_ = Params{backend, direct, pinned, striped};
    std::string why;
    auto engine = testing::MakeEngine(backend, kDepth, &why);
    if (engine == nullptr) GTEST_SKIP() << BackendName(backend) << " unavailable: " << why;
    queue_ = testing::MakeQueue(std::move(engine));
    FileSetOptions options;
    options.open.direct = direct;
    options.stripe_unit = kStripe;
    std::vector<std::string> paths = {dir_.File("a")};
    if (striped) paths.push_back(dir_.File("b"));
    files_ = testing::OpenSet(paths, options);
    ASSERT_NE(files_, nullptr);
    ASSERT_EQ(files_->direct(), direct);
  }

  // A buffer as the parameters ask: mlock()ed or plain pageable memory.
  std::span<std::byte> Buffer(size_t bytes, uint64_t seed) {
    if (params_.pinned) {
      locked_.push_back(std::make_unique<testing::LockedBuffer>(bytes, seed));
      return locked_.back()->buffer().span();
    }
    pageable_.push_back(testing::MakeBuffer(bytes, seed));
    return pageable_.back().span();
  }

  // Writes `data` at `offset` as requests of `chunk` bytes submitted in one batch.
  void WriteChunks(uint64_t offset, std::span<std::byte> data, uint64_t chunk) {
    std::vector<IoRequest> requests;
    for (uint64_t done = 0; done < data.size(); done += chunk) {
      requests.push_back(Request(Op::kWrite, *files_, offset + done, data.subspan(done, chunk)));
    }
    std::vector<Ticket> tickets;
    ASSERT_TRUE(queue_->SubmitBatch(requests, &tickets).ok());
    for (Ticket t : tickets) ASSERT_TRUE(queue_->Wait(t).ok());
  }

  // Reads the bytes at logical [offset, offset + out.size()) straight from the files with pread.
  void ReadDirectly(uint64_t offset, std::span<std::byte> out) {
    std::vector<FileSet::Piece> pieces;
    files_->Map(offset, out.size(), &pieces);
    for (const auto& piece : pieces) {
      const int fd = ::open(piece.file->path().c_str(), O_RDONLY);
      ASSERT_GE(fd, 0);
      ASSERT_EQ(::pread(fd, out.data() + (piece.logical_offset - offset), piece.length,
                        static_cast<off_t>(piece.file_offset)),
                static_cast<ssize_t>(piece.length));
      ::close(fd);
    }
  }

  Params params_{};
  testing::TempDir dir_;
  std::unique_ptr<IoQueue> queue_;
  std::unique_ptr<FileSet> files_;
  std::vector<std::unique_ptr<testing::LockedBuffer>> locked_;
  std::vector<AlignedBuffer> pageable_;
};

TEST_P(ConformanceTest, ReadsBackEveryByteWritten) {
  auto written = Buffer(kBytes, 7);
  WriteChunks(0, written, 256 << 10);  // 12 requests through a queue of depth 4
  auto read = Buffer(kBytes, 0);
  // Read with a different split: requests cross stripe boundaries and end mid-stripe.
  const uint64_t chunk = 768 << 10;
  std::vector<Ticket> tickets;
  for (uint64_t off = 0; off < kBytes; off += chunk) {
    auto t = queue_->Submit(Request(Op::kRead, *files_, off, read.subspan(off, chunk)));
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    tickets.push_back(*t);
  }
  for (auto it = tickets.rbegin(); it != tickets.rend(); ++it) ASSERT_TRUE(queue_->Wait(*it).ok());
  EXPECT_EQ(std::memcmp(read.data(), written.data(), kBytes), 0);
}

TEST_P(ConformanceTest, WrittenBytesAreOnDiskWhereTheStripeMapSays) {
  auto written = Buffer(kBytes, 11);
  WriteChunks(0, written, 1 << 20);
  auto on_disk = testing::MakeBuffer(kBytes);
  ReadDirectly(0, on_disk.span());
  EXPECT_EQ(std::memcmp(on_disk.data(), written.data(), kBytes), 0);
}

TEST_P(ConformanceTest, RandomOverwritesMatchAReference) {
  std::vector<std::byte> reference(kBytes);
  auto initial = Buffer(kBytes, 3);
  std::memcpy(reference.data(), initial.data(), kBytes);
  WriteChunks(0, initial, 512 << 10);
  std::mt19937_64 random(42);
  for (int i = 0; i < 24; ++i) {
    const uint64_t blocks = 1 + random() % 40;
    const uint64_t offset = (random() % (kBytes / 4096 - blocks)) * 4096;
    auto patch = Buffer(blocks * 4096, 100 + i);
    std::memcpy(reference.data() + offset, patch.data(), patch.size());
    WriteChunks(offset, patch, patch.size());
  }
  auto read = Buffer(kBytes, 0);
  auto ticket = queue_->Submit(Request(Op::kRead, *files_, 0, read));
  ASSERT_TRUE(ticket.ok());
  ASSERT_TRUE(queue_->Wait(*ticket).ok());
  EXPECT_EQ(std::memcmp(read.data(), reference.data(), kBytes), 0);
}

TEST_P(ConformanceTest, ReadsDataWrittenByPwrite) {
  auto expected = testing::MakeBuffer(kBytes, 5);
  // Lay the reference out with plain pwrite, following the stripe map.
  std::vector<FileSet::Piece> pieces;
  files_->Map(0, kBytes, &pieces);
  for (const auto& piece : pieces) {
    const int fd = ::open(piece.file->path().c_str(), O_WRONLY);
    ASSERT_EQ(::pwrite(fd, expected.data() + piece.logical_offset, piece.length,
                       static_cast<off_t>(piece.file_offset)),
              static_cast<ssize_t>(piece.length));
    ::close(fd);
  }
  auto read = Buffer(kBytes, 0);
  ASSERT_TRUE(queue_->Wait(*queue_->Submit(Request(Op::kRead, *files_, 0, read))).ok());
  EXPECT_EQ(std::memcmp(read.data(), expected.data(), kBytes), 0);
}

std::string Name(const ::testing::TestParamInfo<ConformanceTest::ParamType>& info) {
  const auto& [backend, direct, pinned, striped] = info.param;
  return std::string(BackendName(backend)) + (direct ? "_direct" : "_buffered") +
         (pinned ? "_pinned" : "_pageable") + (striped ? "_striped" : "_single");
}

INSTANTIATE_TEST_SUITE_P(AllBackends, ConformanceTest,
                         ::testing::Combine(::testing::Values(BackendKind::kIoUring,
                                                              BackendKind::kLibaio,
                                                              BackendKind::kPsync),
                                            ::testing::Bool(), ::testing::Bool(),
                                            ::testing::Bool()),
                         Name);

}  // namespace
}  // namespace zoe::io
