// AlignedBuffer: an owned, aligned block of host memory (the unit every O_DIRECT transfer and
// SIMD kernel works on). Move-only; freed on destruction. Pinning is layered on top by
// core/pinned_memory.h.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "core/result.h"

namespace zoe {

class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  AlignedBuffer(AlignedBuffer&& other) noexcept;
  AlignedBuffer& operator=(AlignedBuffer&& other) noexcept;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer();

  // Allocates `bytes` (rounded up to a multiple of `alignment`) aligned to `alignment`, a power of
  // two. The memory is not initialised. bytes == 0 gives an empty buffer.
  static Result<AlignedBuffer> Allocate(size_t bytes, size_t alignment = 4096);

  std::byte* data() { return data_; }
  const std::byte* data() const { return data_; }
  size_t size() const { return size_; }
  size_t alignment() const { return alignment_; }
  bool empty() const { return size_ == 0; }
  std::span<std::byte> span() { return {data_, size_}; }
  std::span<const std::byte> span() const { return {data_, size_}; }

 private:
  std::byte* data_ = nullptr;
  size_t size_ = 0;
  size_t alignment_ = 0;
};

// Rounds `value` up to a multiple of `alignment` (a power of two).
constexpr uint64_t AlignUp(uint64_t value, uint64_t alignment) {
  return (value + alignment - 1) & ~(alignment - 1);
}
constexpr bool IsAligned(uint64_t value, uint64_t alignment) {
  return (value & (alignment - 1)) == 0;
}
inline bool IsAligned(const void* ptr, uint64_t alignment) {
  return IsAligned(reinterpret_cast<uintptr_t>(ptr), alignment);
}

}  // namespace zoe
