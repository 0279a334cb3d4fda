// StateLayout: where an optimizer group's state lives inside each chunk's extent.
//
// The group's `count` parameters are cut into chunks of `chunk_elements` (the last one shorter).
// A chunk's extent holds up to five regions, in this order: master (fp32), exp_avg and
// exp_avg_sq (the state dtype), and for int8 state the fp32 scales of exp_avg's and exp_avg_sq's
// quantization blocks, each starting on a 4096-byte boundary (in chunks held in host memory a few
// cache lines past one: "Staggered host chunks"); a region the optimizer kind does
// not use (Adagrad's exp_avg, Lion's exp_avg_sq, the scales of other state types) takes no
// bytes. The extent's length is rounded up to `io_block` (4096, or the swap space's checksum
// block), so one aligned read and one aligned write move a chunk's whole state.
//
// Quantization blocks (int8 state). A chunk's blocks start at every multiple of kQuantBlock
// (relative to the chunk's first element) and at every segment start, so a block never holds
// elements of two segments (a segment without a gradient keeps every byte of its state, scales
// included) and never straddles a stripe (stripes start at multiples of 4096 elements). A block
// cut by a segment start is split in two, each with its own scale.
//
// Staggered host chunks. The regions of a chunk held in host memory (index >= the layout's
// `first_host_chunk`) start kHostRegionStagger * r bytes (modulo 4096) past a 4096-byte boundary
// instead of on it. Host chunks are 2 MiB-aligned and backed by huge pages where the kernel has
// them (core/io_memory.h), and regions of power-of-two sizes would then put master, exp_avg and
// exp_avg_sq, which an update streams side by side, into the same cache sets: the update of a
// DRAM group ran up to a third slower that way (docs/benchmarks-optim.md). Chunks on NVMe keep
// every region on a 4096-byte boundary: their stripes are verified and hashed in whole 4096-byte
// blocks of each region. Checkpoints hold payloads, not extents, so no file depends on it.
//
// External master. When the master weights are the caller's fp32 parameters (a group created with
// master_in_params), the master region takes no bytes of the extent (its offset is 0 and nothing
// is stored there) but keeps its payload: a checkpoint holds the master either way, so the file is
// the same whichever form wrote it.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "optim/types.h"

namespace zoe::offload {

// ceil(value / divisor) for divisor > 0, without the overflow of (value + divisor - 1) / divisor
// when divisor is near SIZE_MAX.
inline constexpr size_t CeilDiv(size_t value, size_t divisor) {
  return value / divisor + (value % divisor != 0 ? 1 : 0);
}

inline constexpr uint64_t kStateRegionAlignment = 4096;
// 21 cache lines: regions 0, 1, 2 of a host chunk start 0, 1344 and 2688 bytes past a boundary.
inline constexpr uint64_t kHostRegionStagger = 1344;
// No chunk is held in host memory (a layout used only to size NVMe extents).
inline constexpr size_t kNoHostChunks = SIZE_MAX;
// master, exp_avg, exp_avg_sq (StateSlot order): one entry per element.
inline constexpr size_t kElementRegions = 3;
// ... then exp_avg's and exp_avg_sq's block scales (int8 state): one fp32 per block.
inline constexpr size_t kExpAvgScaleRegion = 3;
inline constexpr size_t kExpAvgSqScaleRegion = 4;
inline constexpr size_t kStateRegions = 5;

struct ChunkRegions {
  size_t first = 0;  // the group's first element in this chunk
  size_t count = 0;  // elements in this chunk
  std::array<bool, kStateRegions> used{};
  std::array<uint64_t, kStateRegions> offset{};         // byte offset inside the extent
  std::array<uint64_t, kStateRegions> element_bytes{};  // 4 for master and scales, the state's
  uint64_t bytes = 0;                                   // the extent's length
  bool master_external = false;  // the master lives in the caller's memory, not in the extent
  // int8 state: the chunk's quantization blocks, and the segment starts (relative to `first`,
  // ascending) that are not multiples of kQuantBlock, each of which splits a block.
  size_t block_count = 0;
  std::span<const size_t> block_splits;

  // Bytes of region `r` that hold elements or scales (without the alignment padding).
  uint64_t payload(size_t r) const {
    if (!used[r]) return 0;
    return (r < kElementRegions ? count : block_count) * element_bytes[r];
  }
  // int8 state: the block starting at chunk element `element` (a multiple of kQuantBlock or a
  // segment start): its index among the chunk's blocks.
  size_t BlockAt(size_t element) const;
};

class StateLayout {
 public:
  // Preconditions (checked by the group): count > 0, chunk_elements > 0, io_block a power of two
  // and a multiple of 4096, state dtype kFloat32, kBFloat16 or kInt8. `segment_ends`: the exclusive
  // end of each segment, ascending, the last one `count` (only kInt8 uses them). `external_master`:
  // the extents hold no master (see "External master"). `first_host_chunk`: chunks from this
  // index on are held in host memory and staggered (see "Staggered host chunks").
  StateLayout(optim::Kind kind, optim::DType state_dtype, size_t count, size_t chunk_elements,
              uint64_t io_block, std::span<const size_t> segment_ends = {},
              bool external_master = false, size_t first_host_chunk = kNoHostChunks);

  size_t chunk_count() const { return chunk_count_; }
  size_t chunk_elements() const { return chunk_elements_; }
  uint64_t io_block() const { return io_block_; }
  ChunkRegions chunk(size_t index) const;
  // The chunk holding `element` (< count).
  size_t ChunkOf(size_t element) const { return element / chunk_elements_; }
  // The longest extent of any chunk: the size of a pipeline buffer. Not always the first chunk's:
  // with int8 state a chunk whose segment starts split more blocks has more scales.
  uint64_t max_chunk_bytes() const { return max_chunk_bytes_; }
  // Bytes of every chunk's payload (no padding): the size of a checkpoint file.
  uint64_t payload_bytes() const;

 private:
  // kInt8: fills block_splits_ and split_begin_ from the segment ends.
  void FindBlockSplits(std::span<const size_t> segment_ends);

  optim::Kind kind_;
  optim::DType state_dtype_;
  size_t count_;
  size_t chunk_elements_;
  uint64_t io_block_;
  bool external_master_;
  size_t first_host_chunk_;
  size_t chunk_count_;
  uint64_t max_chunk_bytes_ = 0;
  // kInt8: every segment start that splits a block, relative to its chunk, grouped by chunk:
  // chunk c's are block_splits_[split_begin_[c], split_begin_[c + 1]).
  std::vector<size_t> block_splits_;
  std::vector<size_t> split_begin_;
};

}  // namespace zoe::offload
