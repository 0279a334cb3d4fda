#include "core/io_memory.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <limits>

#include "core/aligned_buffer.h"

namespace zoe {
namespace {

// The kernel's base page size: 4 KiB on x86-64, 4, 16 or 64 KiB on arm64. Every length handed
// to munmap is a multiple of it.
size_t SystemPageBytes() {
  static const size_t page_bytes = [] {
    const long reported = sysconf(_SC_PAGESIZE);
    return reported > 0 ? static_cast<size_t>(reported) : size_t{4096};
  }();
  return page_bytes;
}

bool UsesMapping(size_t bytes) { return bytes >= kHugePageBytes; }

// Maps bytes + one huge page and unmaps the unaligned head and the unused tail, leaving a
// mapping of AlignUp(bytes, page) that starts on a huge-page boundary. Returns nullptr when the
// sizes overflow or the kernel refuses the mapping. A failed trim of the head or tail only
// leaves that part of the reservation mapped until the process exits; the buffer is still valid.
void* MapHugeAligned(size_t bytes, size_t alignment) {
  const size_t page = SystemPageBytes();
  const size_t align = std::max({alignment, kHugePageBytes, page});
  if (bytes > std::numeric_limits<size_t>::max() - align - page) return nullptr;
  const size_t length = AlignUp(bytes, page);
  const size_t reserved = length + align;
  void* raw = mmap(nullptr, reserved, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  const uintptr_t start = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = AlignUp(start, align);
  if (aligned > start) (void)munmap(raw, aligned - start);
  const uintptr_t end = aligned + length;
  const uintptr_t reserved_end = start + reserved;
  if (reserved_end > end) (void)munmap(reinterpret_cast<void*>(end), reserved_end - end);
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
    (void)munmap(data, AlignUp(bytes, SystemPageBytes()));
  } else {
    std::free(data);
  }
}

}  // namespace zoe
