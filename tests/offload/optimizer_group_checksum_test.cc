// Description: OptimizerGroup with checksums verified and computed by the update's stripes —
// bytes damaged on disk between steps are Corruption naming the group, chunk, slot, file and
// offset and change nothing; a damaged read a step never used is not kept as a cached state;
// the stripes cover every block of odd-sized chunks.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "io/checksum.h"
#include "offload/optimizer/chunk_update.h"
#include "offload/optimizer/optimizer_group.h"
#include "optim/group.h"
#include "tests/offload/optimizer_group_harness.h"

namespace zoe::offload {
namespace {

using testing::GroupHarness;
using testing::HarnessOptions;
using testing::Reference;

HarnessOptions StripeChecksumOptions() {
  HarnessOptions options;
  options.checksum_block = kStripeChecksumBlock;
  options.threads = 2;
  return options;
}

// Flips one byte in every checksum block of every swap file: bit rot under the whole state.
void DamageEveryBlock(io::SwapSpace& swap) {
  for (size_t i = 0; i < swap.files().file_count(); ++i) {
    const std::string& path = swap.files().file(i).path();
    const int fd = ::open(path.c_str(), O_RDWR);
    ASSERT_GE(fd, 0) << path;
    const off_t size = ::lseek(fd, 0, SEEK_END);
    for (off_t at = 100; at < size; at += static_cast<off_t>(kStripeChecksumBlock)) {
      unsigned char byte = 0;
      ASSERT_EQ(::pread(fd, &byte, 1, at), 1);
      byte ^= 0x5a;
      ASSERT_EQ(::pwrite(fd, &byte, 1, at), 1);
    }
    ASSERT_EQ(::fsync(fd), 0);
    ::close(fd);
  }
}

TEST(OptimizerGroupChecksumTest, DamageOnDiskIsCorruptionNamingChunkSlotFileAndOffset) {
  GroupHarness harness(StripeChecksumOptions());
  ASSERT_TRUE(harness.ok());
  Reference reference(harness);
  for (int step = 0; step < 2; ++step) {
    harness.NewGradients(step);
    ASSERT_TRUE(harness.Step(harness.Hyper(step)).ok());
    ASSERT_TRUE(reference.Step(harness.Hyper(step), harness));
  }
  harness.ExpectMatches(reference);
  const std::vector<std::byte> params_before = harness.params_bytes();
  DamageEveryBlock(harness.swap());

  harness.NewGradients(2);
  Result<StepReport> failed = harness.Step(harness.Hyper(2));
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), StatusCode::kCorruption) << failed.status().ToString();
  const std::string message(failed.status().message());
  for (const std::string& part :
       {std::string("optimizer group 'g': chunk "), std::string("slot "),
        "read back from file " + harness.swap().files().file(0).path() + " at offset ",
        std::string("checksum mismatch")}) {
    EXPECT_NE(message.find(part), std::string::npos) << part << " missing from: " << message;
  }
  EXPECT_EQ(harness.group().steps_taken(), 2);
  // No chunk flipped: a retry meets the same damage instead of a half-applied step.
  Result<StepReport> retried = harness.Step(harness.Hyper(2));
  EXPECT_EQ(retried.status().code(), StatusCode::kCorruption);
  EXPECT_EQ(harness.group().steps_taken(), 2);
}

// A read AccumulateGrad started is left to the step to verify. When the step is skipped (a
// non-finite gradient), the read would be kept as the chunk's cached state and used as it is by
// the next step: it must be verified first, and a damaged one dropped and read again.
TEST(OptimizerGroupChecksumTest, DamagedReadOfASkippedStepIsNotCachedForTheNext) {
  HarnessOptions options = StripeChecksumOptions();
  options.inject_faults = true;
  GroupHarness harness(options);
  ASSERT_TRUE(harness.ok());
  Reference reference(harness);
  harness.NewGradients(0);
  ASSERT_TRUE(harness.Step(harness.Hyper(0)).ok());
  ASSERT_TRUE(reference.Step(harness.Hyper(0), harness));

  // The first chunks' reads start during accumulation; the first of them comes back damaged.
  harness.FailOnce(io::FaultKind::kCorruption, io::FaultOps::kReads, 1);
  harness.NewGradients(1);
  harness.PoisonGradient(harness.count() - 1, std::numeric_limits<float>::infinity());
  ASSERT_TRUE(harness.AccumulateAll());
  Result<StepReport> skipped = harness.StepAccumulated(harness.Hyper(1));
  ASSERT_TRUE(skipped.ok()) << skipped.status().ToString();
  EXPECT_TRUE(skipped->skipped);
  EXPECT_EQ(harness.faults()->injected(), 1u);

  harness.NewGradients(2);
  Result<StepReport> next = harness.Step(harness.Hyper(2));
  ASSERT_TRUE(next.ok()) << next.status().ToString();
  ASSERT_TRUE(reference.Step(harness.Hyper(2), harness));
  harness.ExpectMatches(reference);
}

// Adds one to every byte of elements [begin, end) in each element region the chunk uses: an
// update whose result a hash taken before it would miss.
void BumpElements(const ChunkRegions& regions, std::byte* extent, size_t begin, size_t end) {
  for (size_t r = 0; r < kElementRegions; ++r) {
    if (!regions.used[r]) continue;
    for (uint64_t at = regions.offset[r] + begin * regions.element_bytes[r];
         at < regions.offset[r] + end * regions.element_bytes[r]; ++at) {
      extent[at] = std::byte(static_cast<unsigned>(extent[at]) + 1);
    }
  }
}

// Every block of a chunk's extent is hashed by exactly one stripe, after the update of its
// elements, whatever the element count, state dtype and tile size: the sums the stripes compute
// equal those of the whole updated extent.
TEST(OptimizerGroupChecksumTest, StripesHashEveryBlockOfTheExtent) {
  for (optim::DType state : {optim::DType::kFloat32, optim::DType::kBFloat16}) {
    for (optim::Kind kind : {optim::Kind::kAdamW, optim::Kind::kAdagrad, optim::Kind::kLion}) {
      for (size_t count : {size_t{1}, size_t{4095}, size_t{4096}, size_t{12289}, size_t{40000}}) {
        const StateLayout layout(kind, state, count, count, kStripeChecksumBlock);
        const ChunkRegions regions = layout.chunk(0);
        std::vector<std::byte> extent(regions.bytes);
        for (size_t i = 0; i < extent.size(); ++i) extent[i] = std::byte(i * 131 % 251);
        std::vector<uint64_t> computed(regions.bytes / kStripeChecksumBlock, 0);
        ChunkChecksums checksums;
        checksums.computed = computed;
        optim::RunOptions run;
        run.tile_elements = 5000;  // stripes of 8192 elements
        std::vector<bool> updated(count, false);
        ASSERT_TRUE(UpdateInStripes(regions, extent.data(), checksums, run,
                                    [&](size_t begin, size_t end, const optim::RunOptions&) {
                                      for (size_t e = begin; e < end; ++e) updated[e] = true;
                                      BumpElements(regions, extent.data(), begin, end);
                                      return Status::Ok();
                                    })
                        .ok());
        EXPECT_EQ(std::count(updated.begin(), updated.end(), true), static_cast<long>(count));
        for (size_t b = 0; b < computed.size(); ++b) {
          const uint64_t whole =
              io::Xxh3(std::span(extent).subspan(b * kStripeChecksumBlock, kStripeChecksumBlock));
          ASSERT_EQ(computed[b], whole)
              << "block " << b << " count " << count << " kind " << static_cast<int>(kind);
        }
      }
    }
  }
}

TEST(OptimizerGroupChecksumTest, AStripeWhoseBlocksDoNotVerifyIsNotUpdated) {
  const StateLayout layout(optim::Kind::kAdamW, optim::DType::kFloat32, 20000, 20000,
                           kStripeChecksumBlock);
  const ChunkRegions regions = layout.chunk(0);
  std::vector<std::byte> extent(regions.bytes, std::byte{7});
  std::vector<uint64_t> expected(regions.bytes / kStripeChecksumBlock);
  for (size_t b = 0; b < expected.size(); ++b) {
    expected[b] =
        io::Xxh3(std::span(extent).subspan(b * kStripeChecksumBlock, kStripeChecksumBlock));
  }
  // Element 9000's exp_avg_sq lives in stripe 1 (elements [8192, 16384)).
  extent[regions.offset[2] + 9000 * 4] ^= std::byte{1};
  ChunkChecksums checksums;
  checksums.expected = expected;
  checksums.where = "chunk 0, slot 1";
  optim::RunOptions run;
  run.tile_elements = 8192;
  std::vector<size_t> stripes_updated;
  const Status status = UpdateInStripes(regions, extent.data(), checksums, run,
                                        [&](size_t begin, size_t, const optim::RunOptions&) {
                                          stripes_updated.push_back(begin / 8192);
                                          return Status::Ok();
                                        });
  EXPECT_EQ(status.code(), StatusCode::kCorruption);
  EXPECT_NE(status.message().find("chunk 0, slot 1"), std::string_view::npos) << status.ToString();
  EXPECT_EQ(stripes_updated, (std::vector<size_t>{0, 2}));
}

}  // namespace
}  // namespace zoe::offload
