// Memory for buffers that disks and devices transfer into and out of.
//
// Buffers of at least kHugePageBytes are mapped directly, aligned to kHugePageBytes and advised
// MADV_HUGEPAGE, so the kernel can back them with transparent huge pages. The pages behind a
// buffer are then physically contiguous in 2 MiB runs, and an O_DIRECT request into them is a
// handful of DMA segments instead of one per 4 KiB page. That matters on disks with a small
// per-request segment limit (virtio-blk allows 254 segments, so a 1 MiB request of 4 KiB pages is
// split in two and never merged with its neighbours), and with io_uring's registered buffers,
// whose segments are built page by page unless the pages are huge. Smaller buffers come from the
// C allocator. Where transparent huge pages are disabled the advice is ignored and the buffer
// is ordinary memory, still correctly aligned.
#pragma once

#include <cstddef>

namespace zoe {

inline constexpr size_t kHugePageBytes = size_t{2} << 20;

// Returns `bytes` of uninitialised memory aligned to `alignment` (a power of two, at least
// sizeof(void*)) and, when bytes >= kHugePageBytes, to kHugePageBytes; nullptr when the system
// refuses. Release it with FreeIoMemory and the same `bytes`.
void* AllocateIoMemory(size_t bytes, size_t alignment);

// Releases memory from AllocateIoMemory(bytes, ...); nullptr is ignored.
void FreeIoMemory(void* data, size_t bytes);

}  // namespace zoe
