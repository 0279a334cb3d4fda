// CheckpointWriter / CheckpointReader: crash-safe checkpoint directories written and read as
// streams, so state far larger than RAM is never materialised.
//
// On disk, a checkpoint root `dir` holds versions and a pointer to the live one:
//   dir/LATEST            one line: the name of the live version ("v000007")
//   dir/v000007/          the files of that version and its manifest.json
//   dir/v000008.tmp/      a save in progress (or left by a crash; removed by the next save)
// A save writes every file into a fresh ".tmp" version, fsyncs each file, writes manifest.json
// (format version, caller metadata, and for each file its size, xxh3-64 checksum and metadata),
// fsyncs it and the version directory, renames the version to its final name, fsyncs `dir`, then
// replaces LATEST through a temporary file + fsync + rename + fsync of `dir`, and only then removes
// older versions. A process killed at any point therefore leaves LATEST naming a complete version.
//
// Reading verifies the manifest's format version and each file's size and checksum; a file is
// verified when its last byte has been read (Reader::EndFile), so callers that apply data as they
// read must stage it and commit only after EndFile succeeds.
//
// Errors name the path: NotFound (no checkpoint), Corruption (bad manifest, size or checksum),
// NotSupported (another format version), PermissionDenied / NoSpace / IoError from the system.
// Not thread-safe: one thread drives a writer or a reader.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/result.h"

namespace zoe::offload {

inline constexpr int kCheckpointFormatVersion = 1;

// The system calls a save or a load makes, named for the fault hooks below.
enum class CheckpointSyscall { kMkdir, kOpen, kWrite, kFsync, kRename, kRemove, kStatvfs, kRead };

// Ok when `name` can be a file of a checkpoint: a plain, non-empty file name of at most NAME_MAX
// bytes of valid UTF-8 without '/', NUL or other control characters, other than '.', '..' and
// the store's own names ("manifest.json", "LATEST", "LATEST.tmp"). InvalidArgument naming the
// rule otherwise. BeginFile applies it, and so does whatever names a file before any save.
Status CheckCheckpointFileName(std::string_view name);

// `text` JSON-quoted and escaped (invalid UTF-8 replaced), for a message: a NUL or a control
// character in a name shows instead of cutting the message short.
std::string QuoteForMessage(std::string_view text);

struct CheckpointWriterOptions {
  // The sizes of the files the save will write, in any order (empty: not known). Begin then checks,
  // after removing what earlier saves left, that `dir` has room for them, the manifest and LATEST
  // (CheckpointSpaceNeeded) beside the live version, and fails NoSpace naming `dir`, the bytes
  // needed and the bytes available before it creates anything. A write that runs out of space
  // anyway (something else took the room) fails NoSpace with the same figures.
  std::vector<uint64_t> expected_file_sizes;
  // For tests: called before each system call a save makes, with the path it acts on. A positive
  // return is an errno the call fails with instead of running (EINTR is retried like a real one);
  // kShortWrite makes a write transfer only half of its bytes, as a real short write does.
  static constexpr int kShortWrite = -1;
  std::function<int(CheckpointSyscall call, const std::string& path)> fault_for_testing;
};

// The bytes a save of files of `file_sizes` with `metadata` takes on a filesystem of
// `block_size`-byte blocks: each file, the manifest (bounded from the metadata's size and the
// number of files), LATEST and the version directory, each rounded up to whole blocks.
uint64_t CheckpointSpaceNeeded(std::span<const uint64_t> file_sizes, const nlohmann::json& metadata,
                               uint64_t block_size);

struct CheckpointReaderOptions {
  // For tests: called before each open and read of a checkpoint file's data (BeginFile, Read),
  // with its path. A positive return is an errno the call fails with (EINTR is retried like a
  // real one); kShortRead makes the read return half of what it asked for, as a real short read
  // may; kCorruptRead flips a byte of what it read, as bit rot on the disk would.
  static constexpr int kShortRead = -1;
  static constexpr int kCorruptRead = -2;
  std::function<int(CheckpointSyscall call, const std::string& path)> fault_for_testing;
};

class CheckpointWriter {
 public:
  // Creates `dir` if needed (its parent must exist), removes stale ".tmp" versions and starts a new
  // version. `metadata` is stored in the manifest as given; InvalidArgument, before anything is
  // written, when it holds a string that is not valid UTF-8 (JSON cannot print it). Final versions
  // that LATEST does not name (left by a crash between the rename and the LATEST update) are
  // removed too, so a failed save never holds the space of a second checkpoint.
  static Result<std::unique_ptr<CheckpointWriter>> Begin(const std::string& dir,
                                                         nlohmann::json metadata,
                                                         CheckpointWriterOptions options = {});
  // Abandons an uncommitted save: removes its ".tmp" version; LATEST is untouched.
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  // One file at a time: BeginFile, any number of Append, EndFile. `name` is a plain file name
  // (no '/', not "manifest.json" or "LATEST", unique in the checkpoint); it and `file_metadata`
  // are valid UTF-8. A refused name or metadata is InvalidArgument and leaves the save usable.
  Status BeginFile(std::string_view name, nlohmann::json file_metadata = {});
  Status Append(std::span<const std::byte> bytes);
  Status EndFile();  // fsyncs the file and records its size and checksum
  // Publishes the version as described above. The writer cannot be used afterwards.
  Status Commit();

  const std::string& version_path() const;  // the ".tmp" directory being written

 private:
  struct Impl;
  explicit CheckpointWriter(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

class CheckpointReader {
 public:
  // Opens the version LATEST names and parses and checks its manifest. NotFound when `dir` or its
  // LATEST does not exist; Corruption when LATEST is garbled or names a version without a manifest,
  // or the manifest is not JSON (or is nested deeper than config::kMaxJsonDepth).
  // A save that commits removes the version a reader has open: finish reading before saving again.
  static Result<std::unique_ptr<CheckpointReader>> Open(const std::string& dir,
                                                        CheckpointReaderOptions options = {});
  ~CheckpointReader();
  CheckpointReader(const CheckpointReader&) = delete;
  CheckpointReader& operator=(const CheckpointReader&) = delete;

  const nlohmann::json& metadata() const;
  std::vector<std::string> file_names() const;
  // NotFound naming the file and listing the checkpoint's files.
  Result<nlohmann::json> file_metadata(std::string_view name) const;
  Result<uint64_t> file_size(std::string_view name) const;

  // One file at a time: BeginFile, Read until the file's size, EndFile (verifies the checksum;
  // Corruption when it or the size is wrong, e.g. EndFile before every byte was read).
  Status BeginFile(std::string_view name);
  // Fills `out` exactly; InvalidArgument when `out` reaches past the size the manifest gives,
  // Corruption when the file on disk is shorter or longer than that size.
  Status Read(std::span<std::byte> out);
  Status EndFile();

  const std::string& version_path() const;

 private:
  struct Impl;
  explicit CheckpointReader(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace zoe::offload
