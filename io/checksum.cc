#include "io/checksum.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <string>

#include "io/xxh3_isa.h"

namespace zoe::io {

namespace {

using Xxh3Function = uint64_t (*)(const void*, size_t);

uint64_t Xxh3Baseline(const void* data, size_t length) { return XXH3_64bits(data, length); }

// The widest XXH3 path this CPU runs: checksums are hashed on the optimizer's kernel threads
// beside the update, where the baseline SSE2 path would cost about three times as much.
Xxh3Function PickXxh3() {
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) {
    return detail::Xxh3Avx512;
  }
  if (__builtin_cpu_supports("avx2")) return detail::Xxh3Avx2;
  return Xxh3Baseline;
}

}  // namespace

uint64_t Xxh3(std::span<const std::byte> data) {
  static const Xxh3Function xxh3 = PickXxh3();
  return xxh3(data.data(), data.size());
}

Status ChecksumTable::CheckCovers(uint64_t offset, uint64_t length, std::string_view where) const {
  if (offset % block_size_ == 0 && length % block_size_ == 0) return Status::Ok();
  return Status::InvalidArgument(fmt::format(
      "{}: extent [{}, {}) is checksummed per {}-byte block, so offset and length must be "
      "multiples of {}",
      where, offset, offset + length, block_size_, block_size_));
}

uint64_t& ChecksumTable::SlotFor(uint64_t block) {
  const uint64_t page = block / kBlocksPerPage;
  if (page >= pages_.size()) pages_.resize(page + 1);
  if (!pages_[page]) pages_[page] = std::make_unique<Page>();
  pages_[page]->written.set(block % kBlocksPerPage);
  return pages_[page]->sums[block % kBlocksPerPage];
}

void ChecksumTable::Record(uint64_t offset, std::span<const std::byte> data) {
  std::vector<uint64_t> sums(BlocksIn(data.size()));
  for (uint64_t i = 0; i < sums.size(); ++i) {
    sums[i] = Xxh3(data.subspan(i * block_size_, block_size_));
  }
  RecordSums(offset, sums);
}

void ChecksumTable::RecordSums(uint64_t offset, std::span<const uint64_t> sums) {
  const uint64_t first = offset / block_size_;
  std::lock_guard lock(mutex_);
  for (uint64_t i = 0; i < sums.size(); ++i) SlotFor(first + i) = sums[i];
}

Status ChecksumTable::Lookup(uint64_t block, uint64_t* sum, uint64_t offset, uint64_t length,
                             std::string_view where) const {
  const uint64_t page = block / kBlocksPerPage;
  if (page < pages_.size() && pages_[page] && pages_[page]->written.test(block % kBlocksPerPage)) {
    *sum = pages_[page]->sums[block % kBlocksPerPage];
    return Status::Ok();
  }
  return Status::FailedPrecondition(
      fmt::format("{}: extent [{}, {}) block at offset {} was never written, so it has no checksum",
                  where, offset, offset + length, block * block_size_));
}

Status ChecksumTable::Expected(uint64_t offset, std::span<uint64_t> out,
                               std::string_view where) const {
  const uint64_t first = offset / block_size_;
  std::lock_guard lock(mutex_);
  for (uint64_t i = 0; i < out.size(); ++i) {
    ZOE_RETURN_IF_ERROR(Lookup(first + i, &out[i], offset, out.size() * block_size_, where));
  }
  return Status::Ok();
}

Status ChecksumTable::CheckBlock(std::span<const std::byte> block, uint64_t expected,
                                 uint64_t block_offset, std::string_view where) {
  return CheckSum(Xxh3(block), expected, block_offset, block.size(), where);
}

Status ChecksumTable::CheckSum(uint64_t actual, uint64_t expected, uint64_t block_offset,
                               uint64_t block_size, std::string_view where) {
  if (actual == expected) return Status::Ok();
  return Status::Corruption(fmt::format(
      "{}: checksum mismatch in the block at offset {} ({} bytes): xxh3 expected {:#018x}, read "
      "{:#018x}",
      where, block_offset, block_size, expected, actual));
}

Status ChecksumTable::Verify(uint64_t offset, std::span<const std::byte> data,
                             std::string_view where) const {
  std::vector<uint64_t> expected(BlocksIn(data.size()));
  ZOE_RETURN_IF_ERROR(Expected(offset, expected, where));
  const std::string extent =
      fmt::format("{}: extent [{}, {})", where, offset, offset + data.size());
  for (uint64_t i = 0; i < expected.size(); ++i) {
    ZOE_RETURN_IF_ERROR(CheckBlock(data.subspan(i * block_size_, block_size_), expected[i],
                                   offset + i * block_size_, extent));
  }
  return Status::Ok();
}

void ChecksumTable::Forget(uint64_t offset, uint64_t length) {
  std::lock_guard lock(mutex_);
  for (uint64_t b = offset / block_size_; b < (offset + length) / block_size_; ++b) {
    const uint64_t page = b / kBlocksPerPage;
    if (page < pages_.size() && pages_[page]) pages_[page]->written.reset(b % kBlocksPerPage);
  }
}

}  // namespace zoe::io
