// The update of one chunk's state, cut into stripes that the kernel threads take in turn. A
// thread that takes a stripe verifies the checksums of the stripe's blocks as read from disk,
// updates the stripe, and hashes the updated blocks for the write that follows -- all while the
// stripe is in its cache, so checksums cost no extra pass over memory and run on the threads
// that touch the data anyway instead of on the I/O completion path. Where the update kernel
// hashes what it loads (HashingRangeUpdate), the read side costs no pass of its own either: the
// kernel's hashes are compared after the stripe's update, before the chunk is written or used.
//
// Stripes. A stripe is a range of elements [begin, end) of the chunk; its blocks are, in each
// region the optimizer uses, the bytes of those elements. Stripes start at multiples of
// kStripeGranule elements, so in every region (whose element size is 1, 2 or 4 bytes and which
// starts on a 4096-byte boundary in an NVMe chunk, the only ones with checksums) a stripe starts on
// a block boundary when blocks are 4096 bytes; the last stripe also owns each region's alignment
// padding. Every block of the element regions thus belongs to exactly one stripe. The scale regions
// of int8 state (a 4-byte scale per 256-element block: too few bytes per stripe to own whole
// blocks) are verified before the first stripe and hashed after the last. A stripe's quantization
// blocks lie inside it (blocks start at every multiple of 256 elements), so no two threads update
// one block.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "core/status.h"
#include "io/file.h"
#include "offload/optimizer/optimizer_group_layout.h"
#include "optim/chunk.h"

namespace zoe::offload {

inline constexpr size_t kStripeGranule = 4096;  // elements
// The longest stripe whose blocks are verified or hashed: its state (384 KiB with fp32 moments)
// stays in the thread's L2 cache from its update to its hashing.
inline constexpr size_t kMaxHashedStripeElements = size_t{1} << 15;
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

// Elements [begin, end) of a chunk.
struct ElementRange {
  size_t begin = 0;
  size_t end = 0;
};

// Where an update kernel stores the hashes of the state it reads (optim::UpdateHashesReads): one
// array per element region 0..2 (master, exp_avg, exp_avg_sq), indexed by the region's blocks
// (a block of kStripeChecksumBlock bytes counted from the region's first byte).
struct ReadSums {
  uint64_t* region[3] = {};
};

// An update whose kernel hashes the master and moments it reads, so that a stripe is verified
// while the kernel reads it instead of in a pass before. The three element regions must be used.
struct HashingRangeUpdate {
  size_t unit = 0;  // elements of one hashed unit: optim::ReadHashElements(state)
  // Appends to `ranges` the ranges of [begin, end) (ascending, disjoint) that `update` runs the
  // kernel on with the sums: the kernel hashes every block inside each range's whole units
  // [AlignUp(range.begin, unit), AlignDown(range.end, unit)), the block indices counted from the
  // regions' starts. A range may be cut into several kernel calls only at unit boundaries.
  std::function<void(size_t begin, size_t end, std::vector<ElementRange>* ranges)> ranges;
  // Updates elements [begin, end) like RangeUpdate, handing `sums` to the kernel for the ranges.
  std::function<Status(size_t begin, size_t end, const optim::RunOptions& run,
                       const ReadSums& sums)>
      update;
};

// UpdateInStripes with an update that hashes its reads. When checksums.expected is given, each
// stripe's blocks that the kernel hashes whole are compared with what it computed after the
// stripe's update (before anything of the chunk is returned), and only the other blocks -- those
// a range boundary cuts, those of ranges the update skips, the alignment padding -- are verified
// in a pass before. On Corruption the stripe that holds the bad block may have been updated too:
// as with any failure, the state must not be used or written. Without expected sums the reads
// are not hashed.
Status UpdateInStripes(const ChunkRegions& regions, std::byte* state,
                       const ChunkChecksums& checksums, const optim::RunOptions& run,
                       const HashingRangeUpdate& update);

// Elements per stripe for `run`: its tile size, at most kMaxHashedStripeElements when the stripes
// are verified or hashed (`hashing`), rounded up to kStripeGranule.
size_t StripeElements(const optim::RunOptions& run, bool hashing);

}  // namespace zoe::offload
