// StateLayout: where an optimizer group's state lives inside each chunk's extent.
//
// The group's `count` parameters are cut into chunks of `chunk_elements` (the last one shorter).
// A chunk's extent holds up to three regions, in this order: master (fp32), exp_avg and
// exp_avg_sq (the state dtype), each starting on a 4096-byte boundary; a region the optimizer
// kind does not use (Adagrad's exp_avg, Lion's exp_avg_sq) takes no bytes. The extent's length
// is rounded up to `io_block` (4096, or the swap space's checksum block), so one aligned read and
// one aligned write move a chunk's whole state.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

#include "optim/types.h"

namespace zoe::offload {

// ceil(value / divisor) for divisor > 0, without the overflow of (value + divisor - 1) / divisor
// when divisor is near SIZE_MAX.
inline constexpr size_t CeilDiv(size_t value, size_t divisor) {
  return value / divisor + (value % divisor != 0 ? 1 : 0);
}

inline constexpr uint64_t kStateRegionAlignment = 4096;
inline constexpr size_t kStateRegions = 3;  // master, exp_avg, exp_avg_sq (StateSlot order)

struct ChunkRegions {
  size_t first = 0;  // the group's first element in this chunk
  size_t count = 0;  // elements in this chunk
  std::array<bool, kStateRegions> used{};
  std::array<uint64_t, kStateRegions> offset{};         // byte offset inside the extent
  std::array<uint64_t, kStateRegions> element_bytes{};  // 4 for master, the state dtype's size
  uint64_t bytes = 0;                                   // the extent's length

  // Bytes of region `r` that hold elements (without the alignment padding).
  uint64_t payload(size_t r) const { return used[r] ? count * element_bytes[r] : 0; }
};

class StateLayout {
 public:
  // Preconditions (checked by the group): count > 0, chunk_elements > 0, io_block a power of two
  // and a multiple of 4096, state dtype kF32 or kBF16.
  StateLayout(optim::Kind kind, optim::DType state_dtype, size_t count, size_t chunk_elements,
              uint64_t io_block);

  size_t chunk_count() const { return chunk_count_; }
  size_t chunk_elements() const { return chunk_elements_; }
  uint64_t io_block() const { return io_block_; }
  ChunkRegions chunk(size_t index) const;
  // The chunk holding `element` (< count).
  size_t ChunkOf(size_t element) const { return element / chunk_elements_; }
  // The longest extent (the first chunk's): the size of a pipeline buffer.
  uint64_t max_chunk_bytes() const { return chunk(0).bytes; }
  // Bytes of every chunk's payload (no padding): the size of a checkpoint file.
  uint64_t payload_bytes() const;

 private:
  optim::Kind kind_;
  optim::DType state_dtype_;
  size_t count_;
  size_t chunk_elements_;
  uint64_t io_block_;
  size_t chunk_count_;
};

}  // namespace zoe::offload
