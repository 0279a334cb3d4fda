#include "core/io_memory.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>

#include "core/aligned_buffer.h"

namespace zoe {
namespace {

constexpr size_t kPageBytes = 4096;

bool UsesMapping(size_t bytes) { return bytes >= kHugePageBytes; }

// Maps bytes + one huge page and unmaps the unaligned head and the unused tail, leaving a
// mapping of AlignUp(bytes, page) that starts on a huge-page boundary.
void* MapHugeAligned(size_t bytes, size_t alignment) {
  const size_t align = std::max(alignment, kHugePageBytes);
  const size_t length = AlignUp(bytes, kPageBytes);
  const size_t reserved = length + align;
  void* raw = mmap(nullptr, reserved, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  const uintptr_t start = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = AlignUp(start, align);
  if (aligned > start) munmap(raw, aligned - start);
  const uintptr_t end = aligned + length;
  const uintptr_t reserved_end = start + reserved;
  if (reserved_end > end) munmap(reinterpret_cast<void*>(end), reserved_end - end);
  void* data = reinterpret_cast<void*>(aligned);
  // Advice only: a kernel without transparent huge pages answers EINVAL, and 4 KiB pages work.
  (void)madvise(data, length, MADV_HUGEPAGE);
  return data;
}

}  // namespace

void* AllocateIoMemory(size_t bytes, size_t alignment) {
  if (UsesMapping(bytes)) return MapHugeAligned(bytes, alignment);
  return std::aligned_alloc(alignment, AlignUp(bytes, alignment));
}

void FreeIoMemory(void* data, size_t bytes) {
  if (data == nullptr) return;
  if (UsesMapping(bytes)) {
    munmap(data, AlignUp(bytes, kPageBytes));
  } else {
    std::free(data);
  }
}

}  // namespace zoe
