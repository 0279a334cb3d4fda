// The NVMe slots of an optimizer group's chunks and their versions (nvme_slots.h).
#include "offload/optimizer/nvme_slots.h"

namespace zoe::offload {

uint8_t NvmeSlots::write_slot(size_t chunk) const {
  const uint8_t live_slot = live(chunk);
  return slot_count_ == 2 ? live_slot ^ 1 : live_slot;
}

void NvmeSlots::Flip(std::span<const size_t> chunks) {
  for (size_t c : chunks) {
    if (slot_count_ == 2) chunks_[c].live ^= 1;
    ++chunks_[c].version;
  }
}

std::vector<io::Extent> NvmeSlots::extents() const {
  std::vector<io::Extent> all;
  for (const Chunk& chunk : chunks_) {
    for (const io::Extent& extent : chunk.slots) {
      if (extent.length > 0) all.push_back(extent);
    }
  }
  return all;
}

uint64_t NvmeSlots::bytes() const {
  uint64_t total = 0;
  for (const Chunk& chunk : chunks_) total += chunk.slots[0].length + chunk.slots[1].length;
  return total;
}

}  // namespace zoe::offload
