// SwapSpace: scratch space for offloaded state, one preallocated file per directory (striped when
// there are several, e.g. two NVMe mount points), handed out as aligned extents.
//
//  - Create() checks free space (statvfs) and reserves the whole capacity with fallocate, so
//    "no space" shows at start-up with the bytes needed and the bytes free, never mid-training.
//  - Allocate() returns an extent aligned to SwapOptions::alignment (first fit); Free() returns
//    it for reuse, merging it with free neighbours.
//  - Grow() adds space at the end, checked and reserved the same way before any of it is handed
//    out, for callers that size the space from what they register.
//  - Close() (and the destructor) removes the files. Those of a process that died first are
//    removed by the next swap space made in their directory (io/stale_swap.h).
// Allocate and Free are thread-safe. I/O on extents goes through an IoQueue with files().
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/result.h"
#include "io/file.h"

namespace zoe::io {

struct Extent {
  uint64_t offset = 0;  // logical offset in the swap space's file set
  uint64_t length = 0;
};

struct SwapOptions {
  FileSetOptions files;          // O_DIRECT, stripe unit, checksum block
  uint64_t alignment = 1 << 20;  // extent offsets and lengths are multiples of this (power of two)
  std::string name_prefix = "zoe-swap";
};

class SwapSpace {
 public:
  static Result<std::unique_ptr<SwapSpace>> Create(const std::vector<std::string>& directories,
                                                   uint64_t capacity, const SwapOptions& options);
  ~SwapSpace();
  SwapSpace(const SwapSpace&) = delete;
  SwapSpace& operator=(const SwapSpace&) = delete;

  // An extent of at least `bytes` (rounded up to the alignment). NoSpace names the bytes asked,
  // the bytes free and the largest free extent.
  Result<Extent> Allocate(uint64_t bytes);
  // InvalidArgument for an extent that is not currently allocated exactly as given.
  Status Free(const Extent& extent);
  // Adds at least `bytes` (rounded up to the alignment) after the current end: checks the free
  // space of each directory, then extends every file with fallocate, and only then makes the
  // space allocatable. A failure (NoSpace with the bytes needed and free, or the fallocate error
  // naming the file) adds nothing; extents allocated before are untouched either way. Returns
  // the new capacity.
  Result<uint64_t> Grow(uint64_t bytes);
  // Removes the files; the space cannot be used afterwards. Idempotent.
  Status Close();

  FileSet& files() { return *files_; }
  uint64_t capacity() const;
  uint64_t free_bytes() const;

 private:
  SwapSpace(std::unique_ptr<FileSet> files, std::vector<std::string> directories, uint64_t capacity,
            uint64_t alignment);
  // Extends every file to hold `capacity` logical bytes, checking first that the directories
  // have room for what that adds to `old_capacity`.
  Status ReserveFiles(uint64_t old_capacity, uint64_t capacity);

  std::unique_ptr<FileSet> files_;
  const std::vector<std::string> directories_;
  const uint64_t alignment_;
  std::mutex grow_mutex_;  // one Grow at a time; never held with mutex_ while waiting
  mutable std::mutex mutex_;
  uint64_t capacity_;
  std::map<uint64_t, uint64_t> free_;       // offset -> length, non-adjacent
  std::map<uint64_t, uint64_t> allocated_;  // offset -> length
  uint64_t free_total_;
  bool closed_ = false;
};

}  // namespace zoe::io
