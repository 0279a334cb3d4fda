#include "offload/checkpoint/checkpoint_store.h"

#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#define XXH_STATIC_LINKING_ONLY  // XXH3_state_t by value
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <climits>
#include <filesystem>
#include <limits>
#include <optional>
#include <unordered_set>

#include "core/config.h"
#include "core/log.h"

namespace zoe::offload {
namespace {

constexpr std::string_view kLatest = "LATEST";
constexpr std::string_view kLatestTmp = "LATEST.tmp";
constexpr std::string_view kManifest = "manifest.json";
constexpr std::string_view kTmpSuffix = ".tmp";
// A bound on one file's entry in the manifest: its name, size, checksum and metadata, indented.
constexpr uint64_t kManifestEntryBytes = 4096;

using FaultHook = std::function<int(CheckpointSyscall, const std::string&)>;

// The hook's verdict for one call: 0 to run it, a positive errno to fail it, kShortWrite.
int Injected(const FaultHook& hook, CheckpointSyscall call, const std::string& path) {
  return hook ? hook(call, path) : 0;
}

std::string Join(std::string_view dir, std::string_view name) {
  return fmt::format("{}/{}", dir, name);
}

// "v000007" -> 7; nullopt for anything else (including "v000007.tmp").
std::optional<uint64_t> ParseVersionName(std::string_view name) {
  if (name.size() < 2 || name[0] != 'v') return std::nullopt;
  uint64_t number = 0;
  const char* end = name.data() + name.size();
  auto [ptr, ec] = std::from_chars(name.data() + 1, end, number);
  if (ec != std::errc() || ptr != end) return std::nullopt;
  return number;
}

std::string VersionName(uint64_t number) { return fmt::format("v{:06}", number); }

bool IsValidUtf8(std::string_view text) {
  try {
    (void)nlohmann::json(std::string(text)).dump();
    return true;
  } catch (const nlohmann::json::exception&) {
    return false;
  }
}

}  // namespace

// Plain file names only (see checkpoint_store.h), so a refused name is refused here and not as an
// I/O error halfway through a save. Printed JSON-quoted: a NUL or a control character shows.
Status CheckCheckpointFileName(std::string_view name) {
  const bool reserved = name == kManifest || name == kLatest || name == kLatestTmp;
  const bool control = std::any_of(name.begin(), name.end(), [](char c) {
    return static_cast<unsigned char>(c) < 0x20 || c == 0x7f;
  });
  if (name.empty() || name == "." || name == ".." || reserved || name.size() > NAME_MAX ||
      control || name.find('/') != std::string_view::npos || !IsValidUtf8(name)) {
    return Status::InvalidArgument(fmt::format(
        "checkpoint file name {} ({} bytes) is not allowed: it must be a plain, non-empty file "
        "name of at most {} bytes of UTF-8 without '/' or control characters, other than '.', "
        "'..', '{}', '{}' and '{}'",
        QuoteForMessage(name), name.size(), NAME_MAX, kManifest, kLatest, kLatestTmp));
  }
  return Status::Ok();
}

std::string QuoteForMessage(std::string_view text) {
  return nlohmann::json(std::string(text))
      .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

namespace {

// The manifest is JSON: what goes into it must print as JSON, so its strings must be UTF-8.
// Checked when it is handed over, before anything is written, instead of failing the commit.
Status CheckPrintable(const nlohmann::json& value, std::string_view what) {
  try {
    (void)value.dump();
  } catch (const nlohmann::json::exception& e) {
    return Status::InvalidArgument(
        fmt::format("checkpoint {} cannot be stored in {}: {}; allowed: JSON whose strings are "
                    "valid UTF-8",
                    what, kManifest, e.what()));
  }
  return Status::Ok();
}

// --- POSIX helpers: each retries EINTR, resubmits short transfers and names its path. ---

Result<int> OpenFile(const std::string& path, int flags, const FaultHook& hook) {
  for (;;) {
    int injected = Injected(hook, CheckpointSyscall::kOpen, path);
    int fd = injected > 0 ? -1 : ::open(path.c_str(), flags | O_CLOEXEC, 0644);
    int err = injected > 0 ? injected : errno;
    if (fd >= 0) return fd;
    if (err != EINTR) return Status::FromErrno(err, "open " + path);
  }
}

// Writes until every byte is down at `*offset` onward: a short write advances and goes on, EINTR
// repeats the call. `*offset` moves past what was written, also when a later write fails.
Status WriteAll(int fd, std::span<const std::byte> bytes, const std::string& path, uint64_t* offset,
                const FaultHook& hook) {
  while (!bytes.empty()) {
    int injected = Injected(hook, CheckpointSyscall::kWrite, path);
    size_t length = bytes.size();
    if (injected == CheckpointWriterOptions::kShortWrite) length = std::max<size_t>(1, length / 2);
    ssize_t n = injected > 0 ? -1 : ::write(fd, bytes.data(), length);
    int err = injected > 0 ? injected : errno;
    if (n < 0 && err == EINTR) continue;
    if (n < 0) return Status::FromErrno(err, fmt::format("write {} at offset {}", path, *offset));
    if (n == 0) {
      return Status::IoError(fmt::format("write {} at offset {}: no progress", path, *offset));
    }
    bytes = bytes.subspan(static_cast<size_t>(n));
    *offset += static_cast<uint64_t>(n);
  }
  return Status::Ok();
}

Status Fsync(int fd, const std::string& path, const FaultHook& hook) {
  for (;;) {
    int injected = Injected(hook, CheckpointSyscall::kFsync, path);
    int rc = injected > 0 ? -1 : ::fsync(fd);
    int err = injected > 0 ? injected : errno;
    if (rc == 0) return Status::Ok();
    if (err != EINTR) return Status::FromErrno(err, "fsync " + path);
  }
}

void CloseQuietly(int& fd) {
  if (fd >= 0) ::close(fd);  // close is not retried on EINTR on Linux: the fd is gone either way
  fd = -1;
}

Status FsyncDirectory(const std::string& dir, const FaultHook& hook) {
  ZOE_ASSIGN_OR_RETURN(int fd, OpenFile(dir, O_RDONLY | O_DIRECTORY, hook));
  Status synced = Fsync(fd, dir, hook);
  CloseQuietly(fd);
  return synced;
}

Status MakeDirectory(const std::string& path, bool exist_ok, const FaultHook& hook) {
  for (;;) {
    int injected = Injected(hook, CheckpointSyscall::kMkdir, path);
    int rc = injected > 0 ? -1 : ::mkdir(path.c_str(), 0755);
    int err = injected > 0 ? injected : errno;
    if (rc == 0 || (exist_ok && err == EEXIST)) return Status::Ok();
    if (err != EINTR) return Status::FromErrno(err, "mkdir " + path);
  }
}

Status Rename(const std::string& from, const std::string& to, const FaultHook& hook) {
  for (;;) {
    int injected = Injected(hook, CheckpointSyscall::kRename, from);
    int rc = injected > 0 ? -1 : ::rename(from.c_str(), to.c_str());
    int err = injected > 0 ? injected : errno;
    if (rc == 0) return Status::Ok();
    if (err != EINTR) return Status::FromErrno(err, fmt::format("rename {} to {}", from, to));
  }
}

Status RemoveTree(const std::string& path, const FaultHook& hook) {
  int injected = Injected(hook, CheckpointSyscall::kRemove, path);
  while (injected == EINTR) injected = Injected(hook, CheckpointSyscall::kRemove, path);
  if (injected > 0) return Status::FromErrno(injected, "remove " + path);
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
  if (ec) return Status::FromErrno(ec.value(), "remove " + path);
  return Status::Ok();
}

// Writes a small file completely and durably: create/truncate, write, fsync, close.
Status WriteSmallFile(const std::string& path, std::string_view text, const FaultHook& hook) {
  ZOE_ASSIGN_OR_RETURN(int fd, OpenFile(path, O_WRONLY | O_CREAT | O_TRUNC, hook));
  uint64_t end = 0;
  Status status =
      WriteAll(fd, std::as_bytes(std::span(text.data(), text.size())), path, &end, hook);
  if (status.ok()) status = Fsync(fd, path, hook);
  CloseQuietly(fd);
  return status;
}

Result<std::string> ReadSmallFile(const std::string& path) {
  ZOE_ASSIGN_OR_RETURN(int fd, OpenFile(path, O_RDONLY, nullptr));
  std::string text;
  char buffer[4096];
  for (;;) {
    ssize_t n = ::read(fd, buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      Status error = Status::FromErrno(errno, "read " + path);
      CloseQuietly(fd);
      return error;
    }
    if (n == 0) break;
    text.append(buffer, static_cast<size_t>(n));
  }
  CloseQuietly(fd);
  return text;
}

Result<std::vector<std::string>> ListDirectory(const std::string& dir) {
  DIR* handle = ::opendir(dir.c_str());
  if (handle == nullptr) return Status::FromErrno(errno, "list " + dir);
  std::vector<std::string> names;
  while (const dirent* entry = ::readdir(handle)) {
    std::string_view name = entry->d_name;
    if (name != "." && name != "..") names.emplace_back(name);
  }
  ::closedir(handle);
  return names;
}

// The version LATEST names, or nullopt when there is no LATEST. Corruption when it is garbled.
Result<std::optional<std::string>> ReadLatest(const std::string& dir) {
  const std::string path = Join(dir, kLatest);
  auto text = ReadSmallFile(path);
  if (!text.ok() && text.status().sys_errno() == ENOENT) return std::optional<std::string>();
  if (!text.ok()) return text.status();
  std::string name = *text;
  while (!name.empty() && (name.back() == '\n' || name.back() == '\r')) name.pop_back();
  if (!ParseVersionName(name)) {
    return Status::Corruption(
        fmt::format("{} does not name a checkpoint version (expected 'v' and digits)", path));
  }
  return std::optional<std::string>(std::move(name));
}

// Sums of sizes saturate at the largest uint64_t: a save that large fits nowhere, and the figure
// in its error stays monotone instead of wrapping to a small number.
constexpr uint64_t kMaxBytes = std::numeric_limits<uint64_t>::max();

uint64_t SaturatingAdd(uint64_t a, uint64_t b) { return b > kMaxBytes - a ? kMaxBytes : a + b; }

uint64_t RoundUpToBlocks(uint64_t bytes, uint64_t block) {
  if (bytes > kMaxBytes - (block - 1)) return kMaxBytes;
  return (bytes + block - 1) / block * block;
}

// What statvfs says about the filesystem holding `dir`: the bytes an unprivileged writer may still
// use (f_bavail) and the block size.
struct FreeSpace {
  uint64_t available = 0;
  uint64_t block_size = 0;
};

Result<FreeSpace> QueryFreeSpace(const std::string& dir, const FaultHook& hook) {
  for (;;) {
    struct statvfs vfs {};
    int injected = Injected(hook, CheckpointSyscall::kStatvfs, dir);
    int rc = injected > 0 ? -1 : ::statvfs(dir.c_str(), &vfs);
    int err = injected > 0 ? injected : errno;
    if (rc == 0) return FreeSpace{uint64_t{vfs.f_bavail} * vfs.f_frsize, uint64_t{vfs.f_frsize}};
    if (err != EINTR) return Status::FromErrno(err, "statvfs " + dir);
  }
}

std::string HexChecksum(uint64_t value) { return fmt::format("{:016x}", value); }

std::optional<uint64_t> ParseHexChecksum(std::string_view text) {
  uint64_t value = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), value, 16);
  if (text.size() != 16 || ec != std::errc() || ptr != text.data() + text.size()) {
    return std::nullopt;
  }
  return value;
}

struct ManifestFile {
  std::string name;
  uint64_t size = 0;
  uint64_t xxh3 = 0;
  nlohmann::json metadata;
};

nlohmann::json ManifestJson(const nlohmann::json& metadata,
                            const std::vector<ManifestFile>& files) {
  nlohmann::json list = nlohmann::json::array();
  for (const ManifestFile& file : files) {
    list.push_back({{"name", file.name},
                    {"size", file.size},
                    {"xxh3", HexChecksum(file.xxh3)},
                    {"metadata", file.metadata}});
  }
  return {{"format_version", kCheckpointFormatVersion}, {"metadata", metadata}, {"files", list}};
}

Result<ManifestFile> ParseManifestFile(const nlohmann::json& entry, const std::string& path) {
  auto bad = [&](std::string_view what) {
    return Status::Corruption(fmt::format("{}: file entry {}: {}", path, entry.dump(), what));
  };
  if (!entry.is_object() || !entry.contains("name") || !entry["name"].is_string()) {
    return bad("no string 'name'");
  }
  if (!entry.contains("size") || !entry["size"].is_number_unsigned()) {
    return bad("no unsigned 'size'");
  }
  if (!entry.contains("xxh3") || !entry["xxh3"].is_string()) return bad("no string 'xxh3'");
  ManifestFile file;
  file.name = entry["name"].get<std::string>();
  file.size = entry["size"].get<uint64_t>();
  auto checksum = ParseHexChecksum(entry["xxh3"].get<std::string>());
  if (!checksum) return bad("'xxh3' is not 16 hex digits");
  file.xxh3 = *checksum;
  if (entry.contains("metadata")) file.metadata = entry["metadata"];
  if (!CheckCheckpointFileName(file.name).ok()) return bad("the name is not a plain file name");
  return file;
}

struct Manifest {
  nlohmann::json metadata;
  std::vector<ManifestFile> files;
};

Result<Manifest> ParseManifest(const std::string& text, const std::string& path) {
  Result<nlohmann::json> parsed = config::ParseJson(text);  // refuses absurd nesting too
  if (!parsed.ok()) {
    return Status::Corruption(
        fmt::format("{}: not a JSON object: {}", path, parsed.status().message()));
  }
  nlohmann::json& json = *parsed;
  if (!json.is_object()) return Status::Corruption(fmt::format("{}: not a JSON object", path));
  if (!json.contains("format_version") || !json["format_version"].is_number_integer()) {
    return Status::Corruption(fmt::format("{}: no integer 'format_version'", path));
  }
  const int64_t version = json["format_version"].get<int64_t>();
  if (version != kCheckpointFormatVersion) {
    return Status::NotSupported(
        fmt::format("{}: checkpoint format version {}; this build reads version {}", path, version,
                    kCheckpointFormatVersion));
  }
  if (!json.contains("files") || !json["files"].is_array()) {
    return Status::Corruption(fmt::format("{}: no 'files' array", path));
  }
  Manifest manifest;
  manifest.metadata = json.contains("metadata") ? json["metadata"] : nlohmann::json();
  std::unordered_set<std::string> seen;
  for (const nlohmann::json& entry : json["files"]) {
    ZOE_ASSIGN_OR_RETURN(ManifestFile file, ParseManifestFile(entry, path));
    if (!seen.insert(file.name).second) {
      return Status::Corruption(fmt::format("{}: file '{}' is listed twice", path, file.name));
    }
    manifest.files.push_back(std::move(file));
  }
  return manifest;
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// Writer

struct CheckpointWriter::Impl {
  enum class Stage { kOpen, kRenamed, kPublished };

  std::string dir;
  std::string version_name;  // "v000008"
  std::string version_path;  // dir/v000008.tmp until the rename
  nlohmann::json metadata;
  FaultHook hook;
  Stage stage = Stage::kOpen;
  Status failed;  // the first error of a call that leaves the save unusable
  // Figures for NoSpace errors: what the save needs (0 when its files' sizes were not given), what
  // `dir` had available when it began, and what the completed Appends wrote.
  uint64_t bytes_needed = 0;
  uint64_t bytes_available = 0;
  uint64_t bytes_written = 0;
  std::vector<ManifestFile> files;
  std::unordered_set<std::string> written_names;

  // The file being written.
  int fd = -1;
  ManifestFile current;
  XXH3_state_t hash;

  std::string FinalPath() const { return Join(dir, version_name); }
  Status Usable() const;
  Status CleanRoot() const;
  Status CheckRoom(std::span<const uint64_t> file_sizes);
  Status ExplainNoSpace(Status status) const;
  Status Publish();
  void RemoveOldVersions() const;
};

Status CheckpointWriter::Impl::Usable() const {
  if (stage != Stage::kOpen) {
    return Status::FailedPrecondition(
        fmt::format("checkpoint {}: the save was already committed", version_path));
  }
  if (!failed.ok()) {
    return Status::FailedPrecondition(fmt::format(
        "checkpoint {}: an earlier error ended this save: {}", version_path, failed.ToString()));
  }
  return Status::Ok();
}

// Removes what a crashed or abandoned save left: ".tmp" versions, LATEST.tmp and, when LATEST
// names a version that exists, every other final version.
Status CheckpointWriter::Impl::CleanRoot() const {
  ZOE_ASSIGN_OR_RETURN(std::vector<std::string> names, ListDirectory(dir));
  auto latest = ReadLatest(dir);
  std::optional<std::string> live;
  if (latest.ok() && *latest && ::access(Join(dir, **latest).c_str(), F_OK) == 0) live = **latest;
  for (const std::string& name : names) {
    const bool tmp_version = name.ends_with(kTmpSuffix) &&
                             ParseVersionName(name.substr(0, name.size() - kTmpSuffix.size()));
    const bool orphan = live && ParseVersionName(name) && name != *live;
    if (tmp_version || orphan || name == kLatestTmp) {
      ZOE_RETURN_IF_ERROR(RemoveTree(Join(dir, name), hook));
    }
  }
  return Status::Ok();
}

// Measures the room in `dir` (after CleanRoot freed what it could) and, when the files' sizes are
// known, fails NoSpace unless the whole save fits beside the live version.
Status CheckpointWriter::Impl::CheckRoom(std::span<const uint64_t> file_sizes) {
  ZOE_ASSIGN_OR_RETURN(FreeSpace space, QueryFreeSpace(dir, hook));
  bytes_available = space.available;
  if (file_sizes.empty()) return Status::Ok();
  bytes_needed = CheckpointSpaceNeeded(file_sizes, metadata, space.block_size);
  if (bytes_needed <= space.available) return Status::Ok();
  uint64_t data = 0;
  for (uint64_t size : file_sizes) data = SaturatingAdd(data, size);
  return Status::NoSpace(
      fmt::format("checkpoint {}: the save needs {} bytes ({} bytes of data in {} file{}, the "
                  "manifest and {}) but only {} bytes are available there; the checkpoint it "
                  "holds is unchanged",
                  dir, bytes_needed, data, file_sizes.size(), file_sizes.size() == 1 ? "" : "s",
                  kLatest, space.available),
      ENOSPC);
}

// A NoSpace error of a create, write or sync, with the save's figures; other errors unchanged.
Status CheckpointWriter::Impl::ExplainNoSpace(Status status) const {
  if (status.code() != StatusCode::kNoSpace) return status;
  const std::string needed = bytes_needed > 0 ? fmt::format("the save needs {} bytes", bytes_needed)
                                              : std::string("the save's size was not given");
  const std::string_view kept =
      stage == Stage::kPublished ? "" : "; the checkpoint it holds is unchanged";
  return Status::NoSpace(
      fmt::format("out of space in {} after {} bytes of the save were written "
                  "({}, {} bytes were available there when it began{}): {}",
                  dir, bytes_written, needed, bytes_available, kept, status.message()),
      status.sys_errno());
}

uint64_t CheckpointSpaceNeeded(std::span<const uint64_t> file_sizes, const nlohmann::json& metadata,
                               uint64_t block_size) {
  const uint64_t block = std::max<uint64_t>(block_size, 1);
  uint64_t needed = 0;
  for (uint64_t size : file_sizes) needed = SaturatingAdd(needed, RoundUpToBlocks(size, block));
  // The manifest is written with dump(2), whose indentation at most quadruples what dump() writes
  // of the metadata on one line; each file adds one entry.
  const uint64_t manifest =
      4 * metadata.dump().size() + kManifestEntryBytes * (file_sizes.size() + 1);
  needed = SaturatingAdd(needed, RoundUpToBlocks(manifest, block));
  return SaturatingAdd(needed, 2 * block);  // LATEST and the version directory
}

Result<std::unique_ptr<CheckpointWriter>> CheckpointWriter::Begin(const std::string& dir,
                                                                  nlohmann::json metadata,
                                                                  CheckpointWriterOptions options) {
  ZOE_RETURN_IF_ERROR(CheckPrintable(metadata, "metadata"));
  auto impl = std::make_unique<Impl>();
  impl->dir = dir;
  impl->metadata = std::move(metadata);
  impl->hook = std::move(options.fault_for_testing);
  ZOE_RETURN_IF_ERROR(MakeDirectory(dir, /*exist_ok=*/true, impl->hook).WithContext("checkpoint"));
  ZOE_RETURN_IF_ERROR(impl->CleanRoot().WithContext("checkpoint " + dir));
  ZOE_RETURN_IF_ERROR(impl->CheckRoom(options.expected_file_sizes));

  // The new version's number is above every version present, live or not.
  ZOE_ASSIGN_OR_RETURN(std::vector<std::string> names, ListDirectory(dir));
  uint64_t next = 1;
  for (const std::string& name : names) {
    if (auto number = ParseVersionName(name)) next = std::max(next, *number + 1);
  }
  auto latest = ReadLatest(dir);
  if (latest.ok() && *latest) next = std::max(next, *ParseVersionName(**latest) + 1);

  impl->version_name = VersionName(next);
  impl->version_path = Join(dir, impl->version_name + std::string(kTmpSuffix));
  ZOE_RETURN_IF_ERROR(
      MakeDirectory(impl->version_path, /*exist_ok=*/false, impl->hook).WithContext("checkpoint"));
  return std::unique_ptr<CheckpointWriter>(new CheckpointWriter(std::move(impl)));
}

CheckpointWriter::CheckpointWriter(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

CheckpointWriter::~CheckpointWriter() {
  if (!impl_) return;
  CloseQuietly(impl_->fd);
  // A version renamed but never named by LATEST is as abandoned as a ".tmp" one.
  std::string leftover;
  if (impl_->stage == Impl::Stage::kOpen) leftover = impl_->version_path;
  if (impl_->stage == Impl::Stage::kRenamed) {
    leftover = impl_->FinalPath();
    ::unlink(Join(impl_->dir, kLatestTmp).c_str());  // absent unless LATEST failed to change
  }
  if (leftover.empty()) return;
  Status removed = RemoveTree(leftover, nullptr);
  if (!removed.ok()) ZOE_LOG_WARN("checkpoint: abandoned save: {}", removed.ToString());
}

Status CheckpointWriter::BeginFile(std::string_view name, nlohmann::json file_metadata) {
  ZOE_RETURN_IF_ERROR(impl_->Usable());
  if (impl_->fd >= 0) {
    return Status::FailedPrecondition(
        fmt::format("checkpoint {}: BeginFile('{}') while '{}' is still open (call EndFile)",
                    impl_->version_path, name, impl_->current.name));
  }
  ZOE_RETURN_IF_ERROR(CheckCheckpointFileName(name));
  ZOE_RETURN_IF_ERROR(CheckPrintable(std::string(name), "file name"));
  ZOE_RETURN_IF_ERROR(CheckPrintable(file_metadata, fmt::format("metadata of file '{}'", name)));
  if (impl_->written_names.contains(std::string(name))) {
    return Status::InvalidArgument(
        fmt::format("checkpoint {}: file '{}' was already written", impl_->version_path, name));
  }
  const std::string path = Join(impl_->version_path, name);
  auto fd = OpenFile(path, O_WRONLY | O_CREAT | O_EXCL, impl_->hook);
  if (!fd.ok()) return impl_->failed = impl_->ExplainNoSpace(fd.status());
  impl_->fd = *fd;
  impl_->current = ManifestFile{std::string(name), 0, 0, std::move(file_metadata)};
  impl_->written_names.insert(impl_->current.name);
  XXH3_64bits_reset(&impl_->hash);
  return Status::Ok();
}

Status CheckpointWriter::Append(std::span<const std::byte> bytes) {
  ZOE_RETURN_IF_ERROR(impl_->Usable());
  if (impl_->fd < 0) {
    return Status::FailedPrecondition(
        fmt::format("checkpoint {}: Append without BeginFile", impl_->version_path));
  }
  const std::string path = Join(impl_->version_path, impl_->current.name);
  uint64_t end = impl_->current.size;
  Status written = WriteAll(impl_->fd, bytes, path, &end, impl_->hook);
  impl_->bytes_written += end - impl_->current.size;  // what reached the file, also on failure
  if (!written.ok()) return impl_->failed = impl_->ExplainNoSpace(std::move(written));
  XXH3_64bits_update(&impl_->hash, bytes.data(), bytes.size());
  impl_->current.size = end;
  return Status::Ok();
}

Status CheckpointWriter::EndFile() {
  ZOE_RETURN_IF_ERROR(impl_->Usable());
  if (impl_->fd < 0) {
    return Status::FailedPrecondition(
        fmt::format("checkpoint {}: EndFile without BeginFile", impl_->version_path));
  }
  const std::string path = Join(impl_->version_path, impl_->current.name);
  Status synced = Fsync(impl_->fd, path, impl_->hook);
  CloseQuietly(impl_->fd);
  if (!synced.ok()) return impl_->failed = impl_->ExplainNoSpace(std::move(synced));
  impl_->current.xxh3 = XXH3_64bits_digest(&impl_->hash);
  impl_->files.push_back(std::move(impl_->current));
  return Status::Ok();
}

// The publication sequence of the header, step by step; `stage` records how far it got so the
// destructor knows what an interrupted commit left behind.
Status CheckpointWriter::Impl::Publish() {
  const std::string manifest_path = Join(version_path, kManifest);
  ZOE_RETURN_IF_ERROR(WriteSmallFile(manifest_path, ManifestJson(metadata, files).dump(2), hook));
  ZOE_RETURN_IF_ERROR(FsyncDirectory(version_path, hook));
  ZOE_RETURN_IF_ERROR(Rename(version_path, FinalPath(), hook));
  stage = Stage::kRenamed;
  ZOE_RETURN_IF_ERROR(FsyncDirectory(dir, hook));
  const std::string latest_tmp = Join(dir, kLatestTmp);
  ZOE_RETURN_IF_ERROR(WriteSmallFile(latest_tmp, version_name + "\n", hook));
  ZOE_RETURN_IF_ERROR(Rename(latest_tmp, Join(dir, kLatest), hook));
  stage = Stage::kPublished;
  version_path = FinalPath();
  return FsyncDirectory(dir, hook);
}

// Older versions go only after LATEST names the new one; a failure here leaves extra space in
// use, never a broken checkpoint, and the next save retries.
void CheckpointWriter::Impl::RemoveOldVersions() const {
  auto names = ListDirectory(dir);
  if (!names.ok()) {
    ZOE_LOG_WARN("checkpoint: older versions kept: {}", names.status().ToString());
    return;
  }
  for (const std::string& name : *names) {
    if (!ParseVersionName(name) || name == version_name) continue;
    Status removed = RemoveTree(Join(dir, name), hook);
    if (!removed.ok()) ZOE_LOG_WARN("checkpoint: older version kept: {}", removed.ToString());
  }
}

Status CheckpointWriter::Commit() {
  ZOE_RETURN_IF_ERROR(impl_->Usable());
  if (impl_->fd >= 0) {
    return Status::FailedPrecondition(fmt::format("checkpoint {}: Commit while '{}' is open",
                                                  impl_->version_path, impl_->current.name));
  }
  Status published = impl_->Publish();
  if (!published.ok()) {
    published = impl_->ExplainNoSpace(std::move(published));
    impl_->failed = published;
    // A failed fsync of `dir` after LATEST was replaced still leaves a complete version that LATEST
    // names; report it, keep it.
    return published.WithContext("checkpoint " + impl_->dir);
  }
  impl_->RemoveOldVersions();
  return Status::Ok();
}

const std::string& CheckpointWriter::version_path() const { return impl_->version_path; }

// ------------------------------------------------------------------------------------------------
// Reader

struct CheckpointReader::Impl {
  std::string version_path;
  Manifest manifest;
  FaultHook hook;

  // The file being read.
  int fd = -1;
  const ManifestFile* current = nullptr;
  uint64_t position = 0;
  XXH3_state_t hash;

  const ManifestFile* Find(std::string_view name) const;
  Status NotListed(std::string_view name) const;
  Status Finish(Status status) {
    CloseQuietly(fd);
    current = nullptr;
    return status;
  }
};

const ManifestFile* CheckpointReader::Impl::Find(std::string_view name) const {
  for (const ManifestFile& file : manifest.files) {
    if (file.name == name) return &file;
  }
  return nullptr;
}

Status CheckpointReader::Impl::NotListed(std::string_view name) const {
  std::string listed;
  for (const ManifestFile& file : manifest.files) {
    listed += listed.empty() ? "" : ", ";
    listed += file.name;
  }
  return Status::NotFound(fmt::format("checkpoint {} has no file '{}' (it has: {})", version_path,
                                      name, listed.empty() ? "none" : listed));
}

Result<std::unique_ptr<CheckpointReader>> CheckpointReader::Open(const std::string& dir,
                                                                 CheckpointReaderOptions options) {
  struct stat info;
  if (::stat(dir.c_str(), &info) != 0) {
    return Status::FromErrno(errno, "checkpoint " + dir);
  }
  ZOE_ASSIGN_OR_RETURN(std::optional<std::string> latest, ReadLatest(dir));
  if (!latest) {
    return Status::NotFound(fmt::format("no checkpoint in {}: it has no {}", dir, kLatest));
  }
  auto impl = std::make_unique<Impl>();
  impl->hook = std::move(options.fault_for_testing);
  impl->version_path = Join(dir, *latest);
  const std::string manifest_path = Join(impl->version_path, kManifest);
  auto text = ReadSmallFile(manifest_path);
  if (!text.ok() && text.status().sys_errno() == ENOENT) {
    return Status::Corruption(fmt::format("checkpoint {}: {} names {}, which has no {} ({})", dir,
                                          kLatest, *latest, kManifest, text.status().ToString()));
  }
  if (!text.ok()) return text.status();
  ZOE_ASSIGN_OR_RETURN(impl->manifest, ParseManifest(*text, manifest_path));
  return std::unique_ptr<CheckpointReader>(new CheckpointReader(std::move(impl)));
}

CheckpointReader::CheckpointReader(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CheckpointReader::~CheckpointReader() {
  if (impl_) CloseQuietly(impl_->fd);
}

const nlohmann::json& CheckpointReader::metadata() const { return impl_->manifest.metadata; }

std::vector<std::string> CheckpointReader::file_names() const {
  std::vector<std::string> names;
  for (const ManifestFile& file : impl_->manifest.files) names.push_back(file.name);
  return names;
}

Result<nlohmann::json> CheckpointReader::file_metadata(std::string_view name) const {
  const ManifestFile* file = impl_->Find(name);
  if (file == nullptr) return impl_->NotListed(name);
  return file->metadata;
}

Result<uint64_t> CheckpointReader::file_size(std::string_view name) const {
  const ManifestFile* file = impl_->Find(name);
  if (file == nullptr) return impl_->NotListed(name);
  return file->size;
}

Status CheckpointReader::BeginFile(std::string_view name) {
  if (impl_->current != nullptr) {
    return Status::FailedPrecondition(
        fmt::format("checkpoint {}: BeginFile('{}') while '{}' is still open (call EndFile)",
                    impl_->version_path, name, impl_->current->name));
  }
  const ManifestFile* file = impl_->Find(name);
  if (file == nullptr) return impl_->NotListed(name);
  const std::string path = Join(impl_->version_path, file->name);
  Result<int> fd = OpenFile(path, O_RDONLY, impl_->hook);
  if (!fd.ok() && fd.status().sys_errno() == ENOENT) {
    return Status::Corruption(
        fmt::format("{} is listed in the manifest but missing: {}", path, fd.status().ToString()));
  }
  if (!fd.ok()) return fd.status();
  impl_->fd = *fd;
  struct stat info;
  if (::fstat(impl_->fd, &info) != 0) {
    return impl_->Finish(Status::FromErrno(errno, "stat " + path));
  }
  if (static_cast<uint64_t>(info.st_size) != file->size) {
    return impl_->Finish(Status::Corruption(
        fmt::format("{} holds {} bytes; the manifest says {}", path, info.st_size, file->size)));
  }
  impl_->current = file;
  impl_->position = 0;
  XXH3_64bits_reset(&impl_->hash);
  return Status::Ok();
}

Status CheckpointReader::Read(std::span<std::byte> out) {
  const ManifestFile* file = impl_->current;
  if (file == nullptr) {
    return Status::FailedPrecondition(
        fmt::format("checkpoint {}: Read without BeginFile", impl_->version_path));
  }
  const std::string path = Join(impl_->version_path, file->name);
  if (out.size() > file->size - impl_->position) {
    return Status::InvalidArgument(
        fmt::format("{}: read of {} bytes at offset {} goes past its end ({} bytes)", path,
                    out.size(), impl_->position, file->size));
  }
  // Reads until `out` is full: short reads go on, EINTR repeats, end of file is corruption.
  std::span<std::byte> rest = out;
  while (!rest.empty()) {
    const int injected = Injected(impl_->hook, CheckpointSyscall::kRead, path);
    const size_t asked = injected == CheckpointReaderOptions::kShortRead && rest.size() > 1
                             ? rest.size() / 2
                             : rest.size();
    ssize_t n = injected > 0 ? -1 : ::read(impl_->fd, rest.data(), asked);
    const int err = injected > 0 ? injected : errno;
    if (n < 0 && err == EINTR) continue;
    const uint64_t offset = impl_->position + (out.size() - rest.size());
    if (n < 0) {
      return impl_->Finish(
          Status::FromErrno(err, fmt::format("read {} at offset {}", path, offset)));
    }
    if (n > 0 && injected == CheckpointReaderOptions::kCorruptRead) rest[0] ^= std::byte{0x20};
    if (n == 0) {
      return impl_->Finish(Status::Corruption(fmt::format(
          "{} ends at offset {}; the manifest says {} bytes", path, offset, file->size)));
    }
    rest = rest.subspan(static_cast<size_t>(n));
  }
  XXH3_64bits_update(&impl_->hash, out.data(), out.size());
  impl_->position += out.size();
  return Status::Ok();
}

Status CheckpointReader::EndFile() {
  const ManifestFile* file = impl_->current;
  if (file == nullptr) {
    return Status::FailedPrecondition(
        fmt::format("checkpoint {}: EndFile without BeginFile", impl_->version_path));
  }
  const std::string path = Join(impl_->version_path, file->name);
  if (impl_->position != file->size) {
    return impl_->Finish(Status::Corruption(
        fmt::format("{}: EndFile after {} of its {} bytes, so its checksum cannot be verified",
                    path, impl_->position, file->size)));
  }
  const uint64_t actual = XXH3_64bits_digest(&impl_->hash);
  if (actual != file->xxh3) {
    return impl_->Finish(
        Status::Corruption(fmt::format("{}: checksum mismatch: xxh3 expected {}, read {}", path,
                                       HexChecksum(file->xxh3), HexChecksum(actual))));
  }
  return impl_->Finish(Status::Ok());
}

const std::string& CheckpointReader::version_path() const { return impl_->version_path; }

}  // namespace zoe::offload
