#include "offload/optimizer_group_layout.h"

#include <algorithm>

#include "core/aligned_buffer.h"

namespace zoe::offload {

StateLayout::StateLayout(optim::Kind kind, optim::DType state_dtype, size_t count,
                         size_t chunk_elements, uint64_t io_block)
    : kind_(kind),
      state_dtype_(state_dtype),
      count_(count),
      chunk_elements_(chunk_elements),
      io_block_(io_block),
      chunk_count_(CeilDiv(count, chunk_elements)) {}

ChunkRegions StateLayout::chunk(size_t index) const {
  ChunkRegions regions;
  regions.first = index * chunk_elements_;
  regions.count = std::min(chunk_elements_, count_ - regions.first);
  regions.used = {true, optim::UsesExpAvg(kind_), optim::UsesExpAvgSq(kind_)};
  regions.element_bytes = {4, optim::SizeOf(state_dtype_), optim::SizeOf(state_dtype_)};
  uint64_t end = 0;
  for (size_t r = 0; r < kStateRegions; ++r) {
    regions.offset[r] = end;
    end += AlignUp(regions.payload(r), kStateRegionAlignment);
  }
  regions.bytes = AlignUp(end, io_block_);
  return regions;
}

uint64_t StateLayout::payload_bytes() const {
  uint64_t total = 0;
  for (size_t c = 0; c < chunk_count_; ++c) {
    const ChunkRegions regions = chunk(c);
    for (size_t r = 0; r < kStateRegions; ++r) total += regions.payload(r);
  }
  return total;
}

}  // namespace zoe::offload
