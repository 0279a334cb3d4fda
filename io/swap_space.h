// SwapSpace: scratch space for offloaded state, one preallocated file per directory (striped when
// there are several, e.g. two NVMe mount points), handed out as aligned extents.
//
//  - Create() checks free space (statvfs) and reserves the whole capacity with fallocate, so
//    "no space" shows at start-up with the bytes needed and the bytes free, never mid-training.
//  - Allocate() returns an extent aligned to SwapOptions::alignment (first fit); Free() returns
//    it for reuse, merging it with free neighbours.
//  - Close() (and the destructor) removes the files.
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
  // Removes the files; the space cannot be used afterwards. Idempotent.
  Status Close();

  FileSet& files() { return *files_; }
  uint64_t capacity() const { return capacity_; }
  uint64_t free_bytes() const;

 private:
  SwapSpace(std::unique_ptr<FileSet> files, uint64_t capacity, uint64_t alignment);

  std::unique_ptr<FileSet> files_;
  const uint64_t capacity_;
  const uint64_t alignment_;
  mutable std::mutex mutex_;
  std::map<uint64_t, uint64_t> free_;       // offset -> length, non-adjacent
  std::map<uint64_t, uint64_t> allocated_;  // offset -> length
  uint64_t free_total_;
  bool closed_ = false;
};

}  // namespace zoe::io
