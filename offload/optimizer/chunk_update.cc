#include "offload/optimizer/chunk_update.h"

#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <span>
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

// Verifies the blocks of the range that `skip` (empty: none) does not mark.
Status VerifyBlocks(const std::byte* state, const ChunkChecksums& checksums, BlockRange blocks,
                    std::span<const uint8_t> skip = {}) {
  for (uint64_t b = blocks.first; b < blocks.last; ++b) {
    if (!skip.empty() && skip[b] != 0) continue;
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
                    const ChunkChecksums& checksums, size_t begin, size_t end,
                    std::span<const uint8_t> skip = {}) {
  for (size_t r = 0; r < kElementRegions; ++r) {
    if (!regions.used[r]) continue;
    ZOE_RETURN_IF_ERROR(VerifyBlocks(state, checksums, StripeBlocks(regions, r, begin, end), skip));
  }
  return Status::Ok();
}

// The reads of one chunk hashed by a HashingRangeUpdate's kernel. `read` holds, per block of the
// extent, the kernel's sum of the block as read; `hashed` marks the blocks it hashes whole.
struct HashedReads {
  std::span<uint64_t> read;
  std::span<uint8_t> hashed;
  ReadSums sums;  // `read` at each element region's first block
};

// Marks in `hashed` the blocks the kernel hashes in `ranges` (HashingRangeUpdate::ranges).
void MarkHashed(const ChunkRegions& regions, size_t unit, std::span<const ElementRange> ranges,
                std::span<uint8_t> hashed) {
  for (const ElementRange& range : ranges) {
    const size_t first = CeilDiv(range.begin, unit) * unit;
    const size_t last = range.end / unit * unit;
    if (first >= last) continue;
    for (size_t r = 0; r < kElementRegions; ++r) {
      const uint64_t from = regions.offset[r] + first * regions.element_bytes[r];
      const uint64_t to = regions.offset[r] + last * regions.element_bytes[r];
      std::fill(hashed.begin() + static_cast<ptrdiff_t>(from / kStripeChecksumBlock),
                hashed.begin() + static_cast<ptrdiff_t>(to / kStripeChecksumBlock), uint8_t{1});
    }
  }
}

// Compares the kernel's sums of the stripe's hashed blocks with the expected ones.
Status CompareHashed(const ChunkRegions& regions, const ChunkChecksums& checksums,
                     const HashedReads& reads, size_t begin, size_t end) {
  for (size_t r = 0; r < kElementRegions; ++r) {
    const BlockRange blocks = StripeBlocks(regions, r, begin, end);
    for (uint64_t b = blocks.first; b < blocks.last; ++b) {
      if (reads.hashed[b] == 0 || reads.read[b] == checksums.expected[b]) continue;
      const uint64_t offset = checksums.extent_offset + b * kStripeChecksumBlock;
      return io::ChecksumTable::CheckSum(
          reads.read[b], checksums.expected[b], offset, kStripeChecksumBlock,
          fmt::format("{}, block {} read back from {}", checksums.where, b,
                      LocateBlock(checksums.files, offset)));
    }
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

size_t StripeElements(const optim::RunOptions& run, bool hashing) {
  size_t tile = std::max<size_t>(run.tile_elements, 1);
  if (hashing) tile = std::min(tile, kMaxHashedStripeElements);
  return (tile + kStripeGranule - 1) / kStripeGranule * kStripeGranule;
}

namespace {

// One stripe's verify-update-hash, run by the thread that took it: returns its first failure.
using StripeFn = std::function<Status(size_t begin, size_t end)>;

Status CheckSized(const ChunkRegions& regions, const ChunkChecksums& checksums) {
  const uint64_t blocks = regions.bytes / kStripeChecksumBlock;
  const bool sized = (checksums.expected.empty() || checksums.expected.size() == blocks) &&
                     (checksums.computed.empty() || checksums.computed.size() == blocks);
  if (sized && regions.bytes % kStripeChecksumBlock == 0) return Status::Ok();
  return Status::Internal(fmt::format("{}: checksums of {} and {} blocks for an extent of {} bytes",
                                      checksums.where, checksums.expected.size(),
                                      checksums.computed.size(), regions.bytes));
}

// Verifies the scale regions, runs `stripe_fn` on every stripe on run.executor's threads (or
// the calling thread) and hashes the scale regions: the first failure in stripe order.
Status RunStripes(const ChunkRegions& regions, const std::byte* state,
                  const ChunkChecksums& checksums, const optim::RunOptions& run,
                  const StripeFn& stripe_fn) {
  if (!checksums.expected.empty()) ZOE_RETURN_IF_ERROR(VerifyScales(regions, state, checksums));
  const bool hashing = !checksums.expected.empty() || !checksums.computed.empty();
  const size_t stripe = StripeElements(run, hashing);
  const size_t stripes = CeilDiv(regions.count, stripe);
  std::vector<Status> results(stripes);
  auto run_stripes = [&](size_t first, size_t last) {
    for (size_t s = first; s < last; ++s) {
      const size_t begin = s * stripe;
      results[s] = stripe_fn(begin, std::min(regions.count, begin + stripe));
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

optim::RunOptions OnCallingThread(const optim::RunOptions& run) {
  optim::RunOptions one_thread = run;
  one_thread.executor = nullptr;
  return one_thread;
}

}  // namespace

Status UpdateInStripes(const ChunkRegions& regions, std::byte* state,
                       const ChunkChecksums& checksums, const optim::RunOptions& run,
                       const RangeUpdate& update) {
  ZOE_RETURN_IF_ERROR(CheckSized(regions, checksums));
  const optim::RunOptions one_thread = OnCallingThread(run);
  // Each stripe is verified, updated and hashed by one thread, in that order, while it is hot.
  return RunStripes(regions, state, checksums, run, [&](size_t begin, size_t end) {
    Status status;
    if (!checksums.expected.empty()) status = VerifyStripe(regions, state, checksums, begin, end);
    if (status.ok()) status = update(begin, end, one_thread);
    if (status.ok() && !checksums.computed.empty()) {
      HashStripe(regions, state, checksums, begin, end);
    }
    return status;
  });
}

Status UpdateInStripes(const ChunkRegions& regions, std::byte* state,
                       const ChunkChecksums& checksums, const optim::RunOptions& run,
                       const HashingRangeUpdate& update) {
  ZOE_RETURN_IF_ERROR(CheckSized(regions, checksums));
  for (size_t r = 0; r < kElementRegions; ++r) {
    if (!regions.used[r] || update.unit == 0) {
      return Status::Internal(fmt::format(
          "{}: an update that hashes its reads needs master and both moments in the chunk",
          checksums.where));
    }
  }
  if (checksums.expected.empty()) {
    return UpdateInStripes(regions, state, checksums, run,
                           [&](size_t begin, size_t end, const optim::RunOptions& one_thread) {
                             return update.update(begin, end, one_thread, ReadSums{});
                           });
  }
  // The kernel's sums of the reads go where the written blocks' sums go after the comparison
  // (each block's entry is overwritten by its stripe, after its stripe compared it).
  const size_t blocks = regions.bytes / kStripeChecksumBlock;
  std::vector<uint64_t> own_read;
  if (checksums.computed.empty()) own_read.resize(blocks);
  std::vector<uint8_t> hashed(blocks, 0);
  HashedReads reads{
      checksums.computed.empty() ? std::span(own_read) : checksums.computed, std::span(hashed), {}};
  for (size_t r = 0; r < kElementRegions; ++r) {
    reads.sums.region[r] = reads.read.data() + regions.offset[r] / kStripeChecksumBlock;
  }
  const optim::RunOptions one_thread = OnCallingThread(run);
  return RunStripes(regions, state, checksums, run, [&](size_t begin, size_t end) {
    std::vector<ElementRange> ranges;
    update.ranges(begin, end, &ranges);
    MarkHashed(regions, update.unit, ranges, reads.hashed);
    ZOE_RETURN_IF_ERROR(VerifyStripe(regions, state, checksums, begin, end, reads.hashed));
    ZOE_RETURN_IF_ERROR(update.update(begin, end, one_thread, reads.sums));
    ZOE_RETURN_IF_ERROR(CompareHashed(regions, checksums, reads, begin, end));
    if (!checksums.computed.empty()) HashStripe(regions, state, checksums, begin, end);
    return Status::Ok();
  });
}

}  // namespace zoe::offload
