// Per-block xxh3 checksums of the data written to a file set, verified when the blocks are read
// back, so a block that comes back different is an error naming the extent, never silently wrong
// data. The table lives in memory next to the file set: swap files never outlive the process
// that wrote them, so the checksums need not be stored on disk.
//
// Who hashes. By default the I/O queue hashes a written buffer when its write completes and
// verifies a read buffer before its Wait returns (Record / Verify). A caller that touches the
// data anyway -- the optimizer step updates every byte of a chunk it reads and writes -- can
// hash it while it is in cache instead: it hands the sums of a write to the queue, which
// records them when the write succeeds (RecordSums), and verifies a read itself (Expected, then
// CheckBlock on each block before using it).
//
// Storage: eight bytes per block that was ever written, in pages of kBlocksPerPage blocks
// allocated on first use, indexed by block number (no hashing of keys, no per-block node).
#pragma once

#include <bitset>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace zoe::io {

uint64_t Xxh3(std::span<const std::byte> data);

class ChecksumTable {
 public:
  explicit ChecksumTable(uint64_t block_size) : block_size_(block_size) {}

  uint64_t block_size() const { return block_size_; }
  // Blocks in `length` bytes (a multiple of the block size).
  uint64_t BlocksIn(uint64_t length) const { return length / block_size_; }

  // InvalidArgument unless [offset, offset + length) covers whole blocks.
  Status CheckCovers(uint64_t offset, uint64_t length, std::string_view where) const;

  // Remembers the checksum of every block of `data`, written at logical `offset` (whole blocks).
  void Record(uint64_t offset, std::span<const std::byte> data);
  // Remembers checksums the caller computed (Xxh3 of each block), the blocks from `offset` on.
  void RecordSums(uint64_t offset, std::span<const uint64_t> sums);

  // Compares every block of `data`, read from logical `offset`, with what was recorded.
  // Corruption names `where`, the extent and the first bad block; a block never written is a
  // FailedPrecondition.
  Status Verify(uint64_t offset, std::span<const std::byte> data, std::string_view where) const;
  // Copies the recorded checksums of the blocks from `offset` on into `out` (one per block), for
  // a caller that verifies the data itself; FailedPrecondition for a block never written.
  Status Expected(uint64_t offset, std::span<uint64_t> out, std::string_view where) const;
  // Corruption naming `where` and the block at logical `block_offset` unless `block` hashes to
  // `expected`.
  static Status CheckBlock(std::span<const std::byte> block, uint64_t expected,
                           uint64_t block_offset, std::string_view where);
  // Corruption naming `where` and the block of `block_size` bytes at logical `block_offset` unless
  // `actual` (the Xxh3 of the block as read, computed elsewhere) is `expected`.
  static Status CheckSum(uint64_t actual, uint64_t expected, uint64_t block_offset,
                         uint64_t block_size, std::string_view where);

  // Drops the checksums of [offset, offset + length) (an extent that was freed).
  void Forget(uint64_t offset, uint64_t length);

 private:
  static constexpr uint64_t kBlocksPerPage = 4096;
  struct Page {
    uint64_t sums[kBlocksPerPage];
    std::bitset<kBlocksPerPage> written;
  };

  // The slot of block `block`, creating its page; the mutex is held.
  uint64_t& SlotFor(uint64_t block);
  // The recorded sum of `block` or FailedPrecondition; the mutex is held.
  Status Lookup(uint64_t block, uint64_t* sum, uint64_t offset, uint64_t length,
                std::string_view where) const;

  const uint64_t block_size_;
  mutable std::mutex mutex_;
  std::vector<std::unique_ptr<Page>> pages_;  // by block / kBlocksPerPage; null: none written
};

}  // namespace zoe::io
