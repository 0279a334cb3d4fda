// The update of one chunk's state, cut into stripes that the kernel threads take in turn. A
// thread that takes a stripe verifies the checksums of the stripe's blocks as read from disk,
// updates the stripe, and hashes the updated blocks for the write that follows -- all while the
// stripe is in its cache, so checksums cost no extra pass over memory and run on the threads
// that touch the data anyway instead of on the I/O completion path.
//
// Stripes. A stripe is a range of elements [begin, end) of the chunk; its blocks are, in each
// region the optimizer uses, the bytes of those elements. Stripes start at multiples of
// kStripeGranule elements, so in every region (whose element size is 1, 2 or 4 bytes and which
// starts on a 4096-byte boundary) a stripe starts on a block boundary when blocks are 4096
// bytes; the last stripe also owns each region's alignment padding. Every block of the element
// regions thus belongs to exactly one stripe. The scale regions of int8 state (a 4-byte scale
// per 256-element block: too few bytes per stripe to own whole blocks) are verified before the
// first stripe and hashed after the last. A stripe's quantization blocks lie inside it (blocks
// start at every multiple of 256 elements), so no two threads update one block.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>

#include "core/status.h"
#include "io/file.h"
#include "offload/optimizer_group_layout.h"
#include "optim/chunk.h"

namespace zoe::offload {

inline constexpr size_t kStripeGranule = 4096;  // elements
// The only checksum block the stripes can hash: the regions' alignment.
inline constexpr uint64_t kStripeChecksumBlock = kStateRegionAlignment;

// What the update of one chunk does with checksums. Both spans hold one entry per block of the
// chunk's extent (regions.bytes / kStripeChecksumBlock) or are empty.
struct ChunkChecksums {
  std::span<const uint64_t> expected;  // of the state as read from disk; empty: not verified
  std::span<uint64_t> computed;        // filled with the updated state's; empty: not computed
  // For the message of a mismatch: where the chunk's extent lives.
  const io::FileSet* files = nullptr;
  uint64_t extent_offset = 0;  // logical offset of the extent in `files`
  std::string where;           // names the slot (the caller adds the group and chunk)
};

// Updates elements [begin, end) of the chunk (relative to its first element) on the calling
// thread with `run` (its executor is null).
using RangeUpdate = std::function<Status(size_t begin, size_t end, const optim::RunOptions& run)>;

// Runs `update` over every stripe of the chunk on run.executor's threads (or the calling thread),
// verifying `checksums.expected` before a stripe is updated and filling `checksums.computed`
// after. The first failure in stripe order is returned: Corruption naming `where`, the file and
// offset of the first bad block, or the update's error. A stripe whose blocks failed to verify is
// not updated; other stripes may have been, so on failure the state must not be used.
Status UpdateInStripes(const ChunkRegions& regions, std::byte* state,
                       const ChunkChecksums& checksums, const optim::RunOptions& run,
                       const RangeUpdate& update);

// Elements per stripe for `run`: its tile size rounded up to kStripeGranule.
size_t StripeElements(const optim::RunOptions& run);

}  // namespace zoe::offload
