// Per-block xxh3 checksums of the data written to a file set, verified when the blocks are read
// back, so a block that comes back different is an error naming the extent, never silently wrong
// data. The table lives in memory next to the file set: swap files never outlive the process
// that wrote them, so the checksums need not be stored on disk.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <span>
#include <string_view>
#include <unordered_map>

#include "core/status.h"

namespace zoe::io {

uint64_t Xxh3(std::span<const std::byte> data);

class ChecksumTable {
 public:
  explicit ChecksumTable(uint64_t block_size) : block_size_(block_size) {}

  uint64_t block_size() const { return block_size_; }

  // InvalidArgument unless [offset, offset + length) covers whole blocks.
  Status CheckCovers(uint64_t offset, uint64_t length, std::string_view where) const;

  // Remembers the checksum of every block of `data`, written at logical `offset` (whole blocks).
  void Record(uint64_t offset, std::span<const std::byte> data);

  // Compares every block of `data`, read from logical `offset`, with what was recorded.
  // Corruption names `where`, the extent and the first bad block; a block never written is a
  // FailedPrecondition.
  Status Verify(uint64_t offset, std::span<const std::byte> data, std::string_view where) const;

  // Drops the checksums of [offset, offset + length) (an extent that was freed).
  void Forget(uint64_t offset, uint64_t length);

 private:
  const uint64_t block_size_;
  mutable std::mutex mutex_;
  std::unordered_map<uint64_t, uint64_t> sums_;  // block index -> xxh3 of the block
};

}  // namespace zoe::io
