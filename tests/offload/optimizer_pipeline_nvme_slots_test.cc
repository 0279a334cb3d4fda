// Covers NvmeSlots: the live and write slots with one and two slots, flips and versions, and the
// extents and bytes it reports.
#include <gtest/gtest.h>

#include <vector>

#include "offload/optimizer/nvme_slots.h"

namespace zoe::offload {
namespace {

io::Extent ExtentAt(uint64_t offset, uint64_t length) {
  io::Extent extent;
  extent.offset = offset;
  extent.length = length;
  return extent;
}

TEST(NvmeSlotsTest, TwoSlotsWriteTheInactiveOneAndFlip) {
  NvmeSlots slots(2);
  slots.Resize(2);
  slots.Assign(0, 0, ExtentAt(0, 4096));
  slots.Assign(0, 1, ExtentAt(4096, 4096));
  EXPECT_FALSE(slots.single_slot());
  EXPECT_EQ(slots.live(0), 0);
  EXPECT_EQ(slots.write_slot(0), 1);
  EXPECT_EQ(slots.version(0), 0u);
  const std::vector<size_t> flipped = {0};
  slots.Flip(flipped);
  EXPECT_EQ(slots.live(0), 1);
  EXPECT_EQ(slots.write_slot(0), 0);
  EXPECT_EQ(slots.live_extent(0).offset, 4096u);
  EXPECT_EQ(slots.version(0), 1u);
  EXPECT_EQ(slots.version(1), 0u);  // not flipped
}

TEST(NvmeSlotsTest, OneSlotWritesInPlaceAndOnlyTheVersionAdvances) {
  NvmeSlots slots(1);
  slots.Resize(1);
  slots.Assign(0, 0, ExtentAt(8192, 4096));
  EXPECT_TRUE(slots.single_slot());
  EXPECT_EQ(slots.write_slot(0), 0);
  const std::vector<size_t> flipped = {0, 0};
  slots.Flip(flipped);
  EXPECT_EQ(slots.live(0), 0);
  EXPECT_EQ(slots.version(0), 2u);
  EXPECT_EQ(slots.live_extent(0).offset, 8192u);
}

TEST(NvmeSlotsTest, ReportsItsExtentsAndBytes) {
  NvmeSlots slots(2);
  slots.Resize(2);
  slots.Assign(0, 0, ExtentAt(0, 4096));
  slots.Assign(0, 1, ExtentAt(4096, 4096));
  slots.Assign(1, 0, ExtentAt(8192, 8192));
  EXPECT_EQ(slots.chunk_count(), 2u);
  EXPECT_EQ(slots.extents().size(), 3u);  // chunk 1's second slot was never allocated
  EXPECT_EQ(slots.bytes(), 16384u);
}

}  // namespace
}  // namespace zoe::offload
