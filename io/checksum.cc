#include "io/checksum.h"

#include <fmt/format.h>
#include <xxhash.h>

namespace zoe::io {

uint64_t Xxh3(std::span<const std::byte> data) { return XXH3_64bits(data.data(), data.size()); }

Status ChecksumTable::CheckCovers(uint64_t offset, uint64_t length, std::string_view where) const {
  if (offset % block_size_ == 0 && length % block_size_ == 0) return Status::Ok();
  return Status::InvalidArgument(fmt::format(
      "{}: extent [{}, {}) is checksummed per {}-byte block, so offset and length must be "
      "multiples of {}",
      where, offset, offset + length, block_size_, block_size_));
}

void ChecksumTable::Record(uint64_t offset, std::span<const std::byte> data) {
  const uint64_t first = offset / block_size_;
  const uint64_t blocks = data.size() / block_size_;
  std::lock_guard lock(mutex_);
  for (uint64_t i = 0; i < blocks; ++i) {
    sums_[first + i] = Xxh3(data.subspan(i * block_size_, block_size_));
  }
}

Status ChecksumTable::Verify(uint64_t offset, std::span<const std::byte> data,
                             std::string_view where) const {
  const uint64_t first = offset / block_size_;
  const uint64_t blocks = data.size() / block_size_;
  for (uint64_t i = 0; i < blocks; ++i) {
    const uint64_t block_offset = (first + i) * block_size_;
    uint64_t expected;
    {
      std::lock_guard lock(mutex_);
      auto it = sums_.find(first + i);
      if (it == sums_.end()) {
        return Status::FailedPrecondition(fmt::format(
            "{}: extent [{}, {}) block at offset {} was never written, so it has no checksum",
            where, offset, offset + data.size(), block_offset));
      }
      expected = it->second;
    }
    const uint64_t actual = Xxh3(data.subspan(i * block_size_, block_size_));
    if (actual != expected) {
      return Status::Corruption(fmt::format(
          "{}: checksum mismatch in extent [{}, {}), block at offset {} ({} bytes): xxh3 "
          "expected {:#018x}, read {:#018x}",
          where, offset, offset + data.size(), block_offset, block_size_, expected, actual));
    }
  }
  return Status::Ok();
}

void ChecksumTable::Forget(uint64_t offset, uint64_t length) {
  std::lock_guard lock(mutex_);
  for (uint64_t b = offset / block_size_; b < (offset + length) / block_size_; ++b) sums_.erase(b);
}

}  // namespace zoe::io
