#include "offload/chunk_update.h"

#include <fmt/format.h>

#include <algorithm>
#include <string>
#include <vector>

#include "core/aligned_buffer.h"
#include "io/checksum.h"

namespace zoe::offload {
namespace {

// Block indices [first, last) of the extent that stripe [begin, end) owns in region `r`.
struct BlockRange {
  uint64_t first = 0;
  uint64_t last = 0;
};

BlockRange StripeBlocks(const ChunkRegions& regions, size_t r, size_t begin, size_t end) {
  const uint64_t start = regions.offset[r] + begin * regions.element_bytes[r];
  const uint64_t stop = end == regions.count
                            ? regions.offset[r] + AlignUp(regions.payload(r), kStateRegionAlignment)
                            : regions.offset[r] + end * regions.element_bytes[r];
  return {start / kStripeChecksumBlock, stop / kStripeChecksumBlock};
}

// "file /nvme/a at offset 123 (logical offset 456)" for the block at logical `offset`.
std::string LocateBlock(const io::FileSet* files, uint64_t offset) {
  if (files == nullptr) return fmt::format("logical offset {}", offset);
  std::vector<io::FileSet::Piece> pieces;
  files->Map(offset, kStripeChecksumBlock, &pieces);
  if (pieces.empty()) return fmt::format("logical offset {}", offset);
  return fmt::format("file {} at offset {} (logical offset {})", pieces.front().file->path(),
                     pieces.front().file_offset, offset);
}

// The blocks of a whole scale region (int8 state), which no stripe owns.
BlockRange RegionBlocks(const ChunkRegions& regions, size_t r) {
  return {regions.offset[r] / kStripeChecksumBlock,
          (regions.offset[r] + AlignUp(regions.payload(r), kStateRegionAlignment)) /
              kStripeChecksumBlock};
}

Status VerifyBlocks(const std::byte* state, const ChunkChecksums& checksums, BlockRange blocks) {
  for (uint64_t b = blocks.first; b < blocks.last; ++b) {
    const uint64_t offset = checksums.extent_offset + b * kStripeChecksumBlock;
    const std::span block(state + b * kStripeChecksumBlock, kStripeChecksumBlock);
    if (io::Xxh3(block) == checksums.expected[b]) continue;
    return io::ChecksumTable::CheckBlock(
        block, checksums.expected[b], offset,
        fmt::format("{}, block {} read back from {}", checksums.where, b,
                    LocateBlock(checksums.files, offset)));
  }
  return Status::Ok();
}

void HashBlocks(const std::byte* state, const ChunkChecksums& checksums, BlockRange blocks) {
  for (uint64_t b = blocks.first; b < blocks.last; ++b) {
    checksums.computed[b] =
        io::Xxh3(std::span(state + b * kStripeChecksumBlock, kStripeChecksumBlock));
  }
}

Status VerifyStripe(const ChunkRegions& regions, const std::byte* state,
                    const ChunkChecksums& checksums, size_t begin, size_t end) {
  for (size_t r = 0; r < kElementRegions; ++r) {
    if (!regions.used[r]) continue;
    ZOE_RETURN_IF_ERROR(VerifyBlocks(state, checksums, StripeBlocks(regions, r, begin, end)));
  }
  return Status::Ok();
}

void HashStripe(const ChunkRegions& regions, const std::byte* state,
                const ChunkChecksums& checksums, size_t begin, size_t end) {
  for (size_t r = 0; r < kElementRegions; ++r) {
    if (regions.used[r]) HashBlocks(state, checksums, StripeBlocks(regions, r, begin, end));
  }
}

// The scale regions: small (1/64 of the codes), verified before any stripe and hashed after all.
Status VerifyScales(const ChunkRegions& regions, const std::byte* state,
                    const ChunkChecksums& checksums) {
  for (size_t r = kElementRegions; r < kStateRegions; ++r) {
    if (regions.used[r])
      ZOE_RETURN_IF_ERROR(VerifyBlocks(state, checksums, RegionBlocks(regions, r)));
  }
  return Status::Ok();
}

void HashScales(const ChunkRegions& regions, const std::byte* state,
                const ChunkChecksums& checksums) {
  for (size_t r = kElementRegions; r < kStateRegions; ++r) {
    if (regions.used[r]) HashBlocks(state, checksums, RegionBlocks(regions, r));
  }
}

}  // namespace

size_t StripeElements(const optim::RunOptions& run) {
  const size_t tile = std::max<size_t>(run.tile_elements, 1);
  return (tile + kStripeGranule - 1) / kStripeGranule * kStripeGranule;
}

Status UpdateInStripes(const ChunkRegions& regions, std::byte* state,
                       const ChunkChecksums& checksums, const optim::RunOptions& run,
                       const RangeUpdate& update) {
  const uint64_t blocks = regions.bytes / kStripeChecksumBlock;
  const bool sized = (checksums.expected.empty() || checksums.expected.size() == blocks) &&
                     (checksums.computed.empty() || checksums.computed.size() == blocks);
  if (!sized || regions.bytes % kStripeChecksumBlock != 0) {
    return Status::Internal(
        fmt::format("{}: checksums of {} and {} blocks for an extent of {} bytes", checksums.where,
                    checksums.expected.size(), checksums.computed.size(), regions.bytes));
  }
  if (!checksums.expected.empty()) ZOE_RETURN_IF_ERROR(VerifyScales(regions, state, checksums));
  const size_t stripe = StripeElements(run);
  const size_t stripes = CeilDiv(regions.count, stripe);
  optim::RunOptions one_thread = run;
  one_thread.executor = nullptr;
  std::vector<Status> results(stripes);
  // Each stripe is verified, updated and hashed by one thread, in that order, while it is hot.
  auto run_stripes = [&](size_t first, size_t last) {
    for (size_t s = first; s < last; ++s) {
      const size_t begin = s * stripe;
      const size_t end = std::min(regions.count, begin + stripe);
      Status status;
      if (!checksums.expected.empty()) {
        status = VerifyStripe(regions, state, checksums, begin, end);
      }
      if (status.ok()) status = update(begin, end, one_thread);
      if (status.ok() && !checksums.computed.empty()) {
        HashStripe(regions, state, checksums, begin, end);
      }
      results[s] = std::move(status);
    }
  };
  if (run.executor != nullptr) {
    run.executor->ParallelFor(stripes, 1, run_stripes);
  } else {
    run_stripes(0, stripes);
  }
  for (Status& status : results) {
    if (!status.ok()) return std::move(status);
  }
  if (!checksums.computed.empty()) HashScales(regions, state, checksums);
  return Status::Ok();
}

}  // namespace zoe::offload
