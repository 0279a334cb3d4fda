// Description: StateLayout -- where a chunk's regions lie in its extent: NVMe chunks keep every
// region on a 4096-byte boundary (their stripes hash whole blocks of each region), HOST chunks
// stagger their regions so no two of them share an address modulo 4096, and in both the regions
// are vector-aligned, disjoint and inside the extent.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "offload/optimizer/chunk_update.h"
#include "offload/optimizer/optimizer_group_layout.h"
#include "tests/offload/optimizer_group_harness.h"

namespace zoe::offload {
namespace {

using optim::DType;
using optim::Kind;

struct LayoutCase {
  Kind kind;
  DType state;
  bool external_master;
};

const LayoutCase kCases[] = {
    {Kind::kAdamW, DType::kFloat32, false},   {Kind::kAdamW, DType::kFloat32, true},
    {Kind::kAdamW, DType::kBFloat16, false},  {Kind::kAdamW, DType::kInt8, false},
    {Kind::kAdagrad, DType::kFloat32, false}, {Kind::kLion, DType::kInt8, true},
};

// Regions holding bytes of the extent, in offset order (the layout's region order).
std::vector<size_t> StoredRegions(const ChunkRegions& regions) {
  std::vector<size_t> stored;
  for (size_t r = 0; r < kStateRegions; ++r) {
    if (regions.used[r] && !(r == 0 && regions.master_external)) stored.push_back(r);
  }
  return stored;
}

void ExpectDisjointAlignedAndInside(const ChunkRegions& regions, uint64_t io_block) {
  EXPECT_EQ(regions.bytes % io_block, 0u);
  uint64_t end = 0;
  for (size_t r : StoredRegions(regions)) {
    EXPECT_EQ(regions.offset[r] % 64, 0u) << "region " << r;
    EXPECT_GE(regions.offset[r], end) << "region " << r << " overlaps the one before";
    end = regions.offset[r] + regions.payload(r);
  }
  EXPECT_LE(end, regions.bytes);
}

TEST(StateLayout, NvmeChunksKeepRegionsOnBoundariesAndHostChunksStaggerThem) {
  constexpr size_t kChunk = 40960;  // 10 stripe granules
  constexpr size_t kCount = 3 * kChunk + 1000;
  constexpr size_t kFirstHost = 2;
  for (const LayoutCase& c : kCases) {
    SCOPED_TRACE(::testing::Message() << optim::KindName(c.kind) << ", " << DTypeName(c.state)
                                      << (c.external_master ? ", external master" : ""));
    const std::vector<size_t> segment_ends = {kChunk / 2 + 7, kCount};
    const StateLayout layout(c.kind, c.state, kCount, kChunk, 4096, segment_ends, c.external_master,
                             kFirstHost);
    ASSERT_EQ(layout.chunk_count(), 4u);
    for (size_t index = 0; index < layout.chunk_count(); ++index) {
      SCOPED_TRACE(::testing::Message() << "chunk " << index);
      const ChunkRegions regions = layout.chunk(index);
      ExpectDisjointAlignedAndInside(regions, 4096);
      const std::vector<size_t> stored = StoredRegions(regions);
      for (size_t r : stored) {
        const uint64_t expected =
            index < kFirstHost ? 0 : r * kHostRegionStagger % kStateRegionAlignment;
        EXPECT_EQ(regions.offset[r] % kStateRegionAlignment, expected) << "region " << r;
      }
      if (index < kFirstHost) continue;
      for (size_t i = 0; i < stored.size(); ++i) {
        for (size_t j = i + 1; j < stored.size(); ++j) {
          EXPECT_NE(regions.offset[stored[i]] % 4096, regions.offset[stored[j]] % 4096)
              << "regions " << stored[i] << " and " << stored[j];
        }
      }
    }
  }
}

TEST(StateLayout, TheStaggerChangesNeitherPayloadsNorThePipelineBuffer) {
  constexpr size_t kChunk = 8192;
  constexpr size_t kCount = 5 * kChunk - 100;
  for (const LayoutCase& c : kCases) {
    SCOPED_TRACE(::testing::Message() << optim::KindName(c.kind) << ", " << DTypeName(c.state));
    const std::vector<size_t> segment_ends = {300, kCount};
    const StateLayout unstaggered(c.kind, c.state, kCount, kChunk, 8192, segment_ends,
                                  c.external_master);
    const StateLayout mixed(c.kind, c.state, kCount, kChunk, 8192, segment_ends, c.external_master,
                            /*first_host_chunk=*/3);
    const StateLayout host(c.kind, c.state, kCount, kChunk, 8192, segment_ends, c.external_master,
                           /*first_host_chunk=*/0);
    EXPECT_EQ(mixed.payload_bytes(), unstaggered.payload_bytes());
    EXPECT_EQ(host.payload_bytes(), unstaggered.payload_bytes());
    for (size_t index = 0; index < unstaggered.chunk_count(); ++index) {
      for (size_t r = 0; r < kStateRegions; ++r) {
        EXPECT_EQ(host.chunk(index).payload(r), unstaggered.chunk(index).payload(r));
      }
      // A pipeline buffer holds every NVMe chunk of the mixed layout.
      if (index < 3) {
        EXPECT_LE(mixed.chunk(index).bytes, mixed.max_chunk_bytes());
      }
      ExpectDisjointAlignedAndInside(host.chunk(index), 8192);
    }
  }
}

// A pipeline buffer holds the longest chunk, which with int8 state is not always the first: a
// segment start inside a later chunk splits a block there, and its scales take another 4 KiB.
TEST(StateLayout, ThePipelineBufferHoldsTheLongestChunk) {
  constexpr size_t kChunk = size_t{1} << 18;  // 1024 blocks: the scales fill 4096 bytes exactly
  constexpr size_t kCount = 3 * kChunk;
  const std::vector<size_t> segment_ends = {kChunk + 100, kCount};  // splits a block of chunk 1
  const StateLayout layout(Kind::kAdamW, DType::kInt8, kCount, kChunk, 4096, segment_ends);
  ASSERT_GT(layout.chunk(1).bytes, layout.chunk(0).bytes);
  for (size_t index = 0; index < layout.chunk_count(); ++index) {
    EXPECT_LE(layout.chunk(index).bytes, layout.max_chunk_bytes()) << "chunk " << index;
  }
}

// A group staggers its HOST chunks and only those: its NVMe chunks are laid out as the swap space
// was sized (unstaggered), and the group still steps to the reference's bits.
TEST(StateLayout, AGroupStaggersItsHostChunksOnly) {
  testing::HarnessOptions options;
  options.checksum_block = kStripeChecksumBlock;
  options.group.nvme_ratio = 0.6;  // 7 chunks: some on NVMe, the rest in HOST
  testing::GroupHarness harness(options);
  ASSERT_TRUE(harness.ok());
  const OptimizerGroup& group = harness.group();
  ASSERT_GT(group.nvme_chunk_count(), 0u);
  ASSERT_LT(group.nvme_chunk_count(), group.chunk_count());
  const StateLayout& layout = group.layout();
  const StateLayout unstaggered(options.group.kind, options.group.state_dtype, group.count(),
                                options.group.chunk_elements, layout.io_block());
  for (size_t index = 0; index < group.chunk_count(); ++index) {
    SCOPED_TRACE(::testing::Message() << "chunk " << index);
    const ChunkRegions regions = layout.chunk(index);
    if (index < group.nvme_chunk_count()) {
      EXPECT_EQ(regions.offset, unstaggered.chunk(index).offset);
      EXPECT_EQ(regions.bytes, unstaggered.chunk(index).bytes);
    } else {
      EXPECT_EQ(regions.offset[1] % 4096, kHostRegionStagger);
      EXPECT_EQ(regions.offset[2] % 4096, 2 * kHostRegionStagger);
    }
  }
  testing::Reference reference(harness);
  for (int step = 0; step < 3; ++step) {
    harness.NewGradients(step);
    ASSERT_TRUE(harness.Step(harness.Hyper(step)).ok());
    ASSERT_TRUE(reference.Step(harness.Hyper(step), harness));
  }
  harness.ExpectMatches(reference);
}

}  // namespace
}  // namespace zoe::offload
