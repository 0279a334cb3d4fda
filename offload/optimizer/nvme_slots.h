// NvmeSlots: where each NVMe chunk of an optimizer group keeps its state. A chunk has one or two
// extents (slots); `live` names the one holding the current state, and a write goes to the other
// (with one slot, in place). Flip makes the written slots live and advances each chunk's version,
// so a copy of a chunk's state taken at another version is known to be stale.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "io/swap_space.h"

namespace zoe::offload {

class NvmeSlots {
 public:
  // `slot_count`: 1 or 2 extents per chunk.
  explicit NvmeSlots(uint32_t slot_count) : slot_count_(slot_count) {}

  void Resize(size_t chunks) { chunks_.resize(chunks); }
  size_t chunk_count() const { return chunks_.size(); }
  uint32_t slot_count() const { return slot_count_; }
  bool single_slot() const { return slot_count_ == 1; }

  void Assign(size_t chunk, uint8_t slot, io::Extent extent) {
    chunks_[chunk].slots[slot] = extent;
  }
  const io::Extent& extent(size_t chunk, uint8_t slot) const { return chunks_[chunk].slots[slot]; }
  uint8_t live(size_t chunk) const { return chunks_[chunk].live; }
  // The slot a write of `chunk` goes to: the inactive one, or with one slot the live one.
  uint8_t write_slot(size_t chunk) const;
  const io::Extent& live_extent(size_t chunk) const { return extent(chunk, live(chunk)); }
  uint64_t version(size_t chunk) const { return chunks_[chunk].version; }

  // Makes the slots just written live; with one slot only the version advances.
  void Flip(std::span<const size_t> chunks);
  // Every extent allocated (length > 0), to free them.
  std::vector<io::Extent> extents() const;
  uint64_t bytes() const;

 private:
  struct Chunk {
    std::array<io::Extent, 2> slots;
    uint8_t live = 0;
    uint64_t version = 0;  // counts flips
  };
  uint32_t slot_count_;
  std::vector<Chunk> chunks_;
};

}  // namespace zoe::offload
