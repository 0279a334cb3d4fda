// File: one open file for block I/O, O_DIRECT by default with a buffered fallback where the
// filesystem refuses it, and the alignment its direct I/O needs (statx DIOALIGN, else 4096).
// FileSet: one or more files striped with a fixed stripe unit (e.g. over two NVMe mount points),
// addressed by a logical offset; optionally with per-block checksums.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/result.h"
#include "io/checksum.h"

namespace zoe::io {

struct OpenOptions {
  bool direct = true;      // try O_DIRECT first; fall back to buffered I/O if refused
  bool create = true;      // O_CREAT (mode 0600)
  bool truncate = false;   // O_TRUNC
  bool exclusive = false;  // O_EXCL: fail if the path exists
  // Behave as a filesystem that refuses O_DIRECT (open fails with EINVAL), to exercise the
  // buffered fallback: tmpfs accepts O_DIRECT on current kernels.
  bool refuse_direct_for_testing = false;
};

constexpr uint32_t kDefaultDirectAlignment = 4096;

class File {
 public:
  static Result<std::unique_ptr<File>> Open(const std::string& path, const OpenOptions& options);
  ~File();
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  int fd() const { return fd_; }
  const std::string& path() const { return path_; }
  bool direct() const { return direct_; }
  // What a request must be aligned to: memory address, and file offset and length. Both are 1
  // for a buffered file.
  uint32_t mem_align() const { return mem_align_; }
  uint32_t offset_align() const { return offset_align_; }

  // Reserves [0, bytes) on disk with fallocate, so running out of space shows now.
  Status Allocate(uint64_t bytes);
  Result<uint64_t> Size() const;
  // Unlinks the path; the descriptor stays usable until destruction.
  Status Remove();

  // Bytes written to the file that the kernel acknowledged (IoQueue counts every completed write,
  // a short one by what it moved, a failed one not at all): the wear a drive sees from zoe. Any
  // thread.
  void CountWritten(uint64_t bytes) const {
    bytes_written_.fetch_add(bytes, std::memory_order_relaxed);
  }
  uint64_t bytes_written() const { return bytes_written_.load(std::memory_order_relaxed); }

 private:
  File(int fd, std::string path, bool direct);
  void LoadDirectAlignment();

  int fd_;
  std::string path_;
  bool direct_;
  uint32_t mem_align_ = 1;
  uint32_t offset_align_ = 1;
  mutable std::atomic<uint64_t> bytes_written_{0};
};

struct FileSetOptions {
  OpenOptions open;
  uint64_t stripe_unit = 1 << 20;  // bytes per stripe; a multiple of every file's offset alignment
  uint64_t checksum_block = 0;     // 0: no checksums; else xxh3 per block of this many bytes
};

class FileSet {
 public:
  // Opens one file per path; several paths are striped in the order given.
  static Result<std::unique_ptr<FileSet>> Open(const std::vector<std::string>& paths,
                                               const FileSetOptions& options);
  static Result<std::unique_ptr<FileSet>> FromFiles(std::vector<std::unique_ptr<File>> files,
                                                    const FileSetOptions& options);

  size_t file_count() const { return files_.size(); }
  File& file(size_t i) { return *files_[i]; }
  const File& file(size_t i) const { return *files_[i]; }
  uint64_t stripe_unit() const { return stripe_unit_; }
  bool direct() const;  // every file was opened with O_DIRECT
  ChecksumTable* checksums() const { return checksums_.get(); }

  // A contiguous piece of a logical range that lies in one file.
  struct Piece {
    const File* file;
    uint64_t file_offset;
    uint64_t logical_offset;
    uint64_t length;
  };
  // Appends the pieces of [offset, offset + length) to `out`: one per stripe unit crossed when
  // striped, or a single piece for a single file. Logical stripe s lives in file s % n at
  // file offset (s / n) * stripe_unit.
  void Map(uint64_t offset, uint64_t length, std::vector<Piece>* out) const;

  // Bytes each file needs to hold logical [0, logical_bytes).
  uint64_t PerFileBytes(uint64_t logical_bytes) const;

  // "path" or "path1+path2 (stripe 1048576 B)", for messages.
  std::string Describe() const;

 private:
  FileSet(std::vector<std::unique_ptr<File>> files, uint64_t stripe_unit, uint64_t checksum_block);

  std::vector<std::unique_ptr<File>> files_;
  uint64_t stripe_unit_;
  std::unique_ptr<ChecksumTable> checksums_;
};

}  // namespace zoe::io
