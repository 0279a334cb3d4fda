#include "offload/optimizer/optimizer_group_layout.h"

#include <algorithm>

#include "core/aligned_buffer.h"
#include "optim/quantize.h"

namespace zoe::offload {

size_t ChunkRegions::BlockAt(size_t element) const {
  const auto splits_before = static_cast<size_t>(
      std::lower_bound(block_splits.begin(), block_splits.end(), element) - block_splits.begin());
  return CeilDiv(element, optim::kQuantBlock) + splits_before;
}

StateLayout::StateLayout(optim::Kind kind, optim::DType state_dtype, size_t count,
                         size_t chunk_elements, uint64_t io_block,
                         std::span<const size_t> segment_ends, bool external_master,
                         size_t first_host_chunk)
    : kind_(kind),
      state_dtype_(state_dtype),
      count_(count),
      chunk_elements_(chunk_elements),
      io_block_(io_block),
      external_master_(external_master),
      first_host_chunk_(first_host_chunk),
      chunk_count_(CeilDiv(count, chunk_elements)),
      split_begin_(chunk_count_ + 1, 0) {
  if (state_dtype == optim::DType::kInt8) FindBlockSplits(segment_ends);
  for (size_t c = 0; c < chunk_count_; ++c) {
    max_chunk_bytes_ = std::max(max_chunk_bytes_, chunk(c).bytes);
  }
}

void StateLayout::FindBlockSplits(std::span<const size_t> segment_ends) {
  // Segment starts are the ends of every segment but the last (repeated by empty segments).
  std::vector<size_t> chunk_of_split;
  size_t previous = 0;
  for (size_t s = 0; s + 1 < segment_ends.size(); ++s) {
    const size_t start = segment_ends[s];
    if (start == previous || start >= count_) continue;
    previous = start;
    const size_t relative = start % chunk_elements_;
    if (relative % optim::kQuantBlock == 0) continue;
    block_splits_.push_back(relative);
    chunk_of_split.push_back(start / chunk_elements_);
  }
  for (size_t chunk : chunk_of_split) ++split_begin_[chunk + 1];
  for (size_t c = 0; c < chunk_count_; ++c) split_begin_[c + 1] += split_begin_[c];
}

ChunkRegions StateLayout::chunk(size_t index) const {
  ChunkRegions regions;
  regions.first = index * chunk_elements_;
  regions.count = std::min(chunk_elements_, count_ - regions.first);
  const bool quantized = state_dtype_ == optim::DType::kInt8;
  regions.used = {true, optim::UsesExpAvg(kind_), optim::UsesExpAvgSq(kind_),
                  quantized && optim::UsesExpAvg(kind_), quantized && optim::UsesExpAvgSq(kind_)};
  regions.element_bytes = {4, DTypeSize(state_dtype_), DTypeSize(state_dtype_), 4, 4};
  if (quantized) {
    regions.block_splits = std::span(block_splits_.data() + split_begin_[index],
                                     split_begin_[index + 1] - split_begin_[index]);
    regions.block_count = CeilDiv(regions.count, optim::kQuantBlock) + regions.block_splits.size();
  }
  regions.master_external = external_master_;
  const bool staggered = index >= first_host_chunk_;
  uint64_t end = 0;
  for (size_t r = 0; r < kStateRegions; ++r) {
    const uint64_t stagger = staggered ? r * kHostRegionStagger % kStateRegionAlignment : 0;
    regions.offset[r] = AlignUp(end, kStateRegionAlignment) + stagger;
    if (r == 0 && external_master_) continue;  // no bytes in the extent
    end = regions.offset[r] + regions.payload(r);
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
