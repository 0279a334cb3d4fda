// Description: backend names and parsing, what DescribeBackends and ProbePath report for
// `zoe info`, and the raw engines' own contract (tags and raw results returned unchanged).
#include "io/backend.h"

#include <gtest/gtest.h>

#include <cstring>

#include "io_test_util.h"

namespace zoe::io {
namespace {

TEST(BackendTest, NamesRoundTripAndUnknownNamesListTheAllowedOnes) {
  for (BackendKind kind :
       {BackendKind::kAuto, BackendKind::kIoUring, BackendKind::kLibaio, BackendKind::kPsync}) {
    auto parsed = ParseBackend(BackendName(kind));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, kind);
  }
  auto bad = ParseBackend("spdk");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(std::string(bad.status().message()).find("auto, io_uring, libaio, psync"),
            std::string::npos);
}

TEST(BackendTest, DescribeListsTheChainWithPsyncAlwaysAvailable) {
  auto backends = DescribeBackends();
  ASSERT_EQ(backends.size(), 3u);
  EXPECT_EQ(backends[0].kind, BackendKind::kIoUring);
  EXPECT_EQ(backends[2].kind, BackendKind::kPsync);
  EXPECT_TRUE(backends[2].available);
  for (const auto& b : backends) EXPECT_EQ(b.available, b.reason.empty()) << BackendName(b.kind);
  if (backends[0].available) {
    EXPECT_NE(
        std::find(backends[0].features.begin(), backends[0].features.end(), "IORING_OP_READ/WRITE"),
        backends[0].features.end());
  }
  EXPECT_NE(FormatBackends(backends).find("psync"), std::string::npos);
}

TEST(BackendTest, ProbePathReportsDirectIoAndLeavesNothingBehind) {
  testing::TempDir dir;
  auto info = ProbePath(dir.path());
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  EXPECT_TRUE(info->accepts_direct);
  EXPECT_GE(info->dio_offset_align, 512u);
  EXPECT_GT(info->free_bytes, 0u);
  EXPECT_FALSE(info->filesystem.empty());
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
  EXPECT_NE(FormatPathInfo(*info).find("O_DIRECT accepted"), std::string::npos);
  EXPECT_EQ(ProbePath(dir.File("missing")).status().code(), StatusCode::kNotFound);
}

class RawEngineTest : public ::testing::TestWithParam<BackendKind> {};

// Raw engines report per-request results unchanged: tags, byte counts and -errno.
TEST_P(RawEngineTest, ReportsTagsAndRawResults) {
  std::string why;
  auto engine = testing::MakeEngine(GetParam(), 4, &why);
  if (engine == nullptr) GTEST_SKIP() << why;
  testing::TempDir dir;
  auto file = File::Open(dir.File("f"), {});
  ASSERT_TRUE(file.ok());
  auto data = testing::MakeBuffer(8192, 1);
  RawRequest requests[] = {
      {Op::kWrite, (*file)->fd(), 0, data.data(), 8192, 77},
      {Op::kWrite, (*file)->fd(), 100, data.data(), 4096, 78},  // misaligned offset
      {Op::kRead, -1, 0, data.data(), 4096, 79}};               // bad descriptor
  auto accepted = engine->Submit(requests);
  ASSERT_TRUE(accepted.ok()) << accepted.status().ToString();
  size_t total = *accepted;
  // libaio refuses a bad descriptor at io_submit: resubmit what was not taken one at a time.
  std::vector<RawCompletion> synthetic;
  while (total < 3) {
    auto more = engine->Submit(std::span(requests).subspan(total));
    if (more.ok() && *more > 0) {
      total += *more;
    } else {
      synthetic.push_back({requests[total].tag, -static_cast<int64_t>(EBADF)});
      ++total;
    }
  }
  std::vector<RawCompletion> out(4);
  size_t reaped = 0;
  while (reaped + synthetic.size() < 3) {
    auto n = engine->Reap(std::span(out).subspan(reaped), 1);
    ASSERT_TRUE(n.ok());
    reaped += *n;
  }
  out.resize(reaped);
  out.insert(out.end(), synthetic.begin(), synthetic.end());
  std::sort(out.begin(), out.end(), [](auto& a, auto& b) { return a.tag < b.tag; });
  EXPECT_EQ(out[0].tag, 77u);
  EXPECT_EQ(out[0].result, 8192);
  EXPECT_EQ(out[1].tag, 78u);
  EXPECT_EQ(out[1].result, -EINVAL);
  EXPECT_EQ(out[2].tag, 79u);
  EXPECT_EQ(out[2].result, -EBADF);
}

INSTANTIATE_TEST_SUITE_P(AllBackends, RawEngineTest,
                         ::testing::Values(BackendKind::kIoUring, BackendKind::kLibaio,
                                           BackendKind::kPsync),
                         [](const auto& param_info) {
                           return std::string(BackendName(param_info.param));
                         });

}  // namespace
}  // namespace zoe::io
