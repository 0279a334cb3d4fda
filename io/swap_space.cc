#include "io/swap_space.h"

#include <fmt/format.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>

#include "core/aligned_buffer.h"
#include "core/log.h"
#include "io/stale_swap.h"

namespace zoe::io {
namespace {

std::atomic<uint64_t> next_swap_id{0};

struct DirectorySpace {
  dev_t device;
  uint64_t free;
  uint64_t needed = 0;
  std::string directories;
};

// Sums what each filesystem must hold (several directories may share one) and compares it with
// what statvfs says is free there.
Status CheckFreeSpace(const std::vector<std::string>& directories, uint64_t per_file,
                      uint64_t capacity) {
  std::vector<DirectorySpace> spaces;
  for (const std::string& dir : directories) {
    struct stat st {};
    struct statvfs vfs {};
    if (::stat(dir.c_str(), &st) != 0) return Status::FromErrno(errno, "swap directory " + dir);
    if (!S_ISDIR(st.st_mode))
      return Status::InvalidArgument("swap path " + dir + " is not a directory");
    if (::statvfs(dir.c_str(), &vfs) != 0) return Status::FromErrno(errno, "statvfs " + dir);
    auto it = std::find_if(spaces.begin(), spaces.end(),
                           [&](const auto& s) { return s.device == st.st_dev; });
    if (it == spaces.end()) {
      spaces.push_back(DirectorySpace{st.st_dev, uint64_t{vfs.f_bavail} * vfs.f_frsize});
      it = spaces.end() - 1;
    }
    it->needed += per_file;
    it->directories += (it->directories.empty() ? "" : ", ") + dir;
  }
  for (const DirectorySpace& space : spaces) {
    if (space.needed <= space.free) continue;
    return Status::NoSpace(
        fmt::format("swap space of {} bytes needs {} bytes in {} but only {} bytes are free there",
                    capacity, space.needed, space.directories, space.free));
  }
  return Status::Ok();
}

Status RemoveAll(FileSet& files) {
  Status first;
  for (size_t i = 0; i < files.file_count(); ++i) {
    Status removed = files.file(i).Remove();
    if (first.ok()) first = std::move(removed);
  }
  return first;
}

}  // namespace

SwapSpace::SwapSpace(std::unique_ptr<FileSet> files, std::vector<std::string> directories,
                     uint64_t capacity, uint64_t alignment)
    : files_(std::move(files)),
      directories_(std::move(directories)),
      alignment_(alignment),
      capacity_(capacity),
      free_total_(capacity) {
  free_[0] = capacity;
}

SwapSpace::~SwapSpace() {
  if (Status closed = Close(); !closed.ok())
    ZOE_LOG_WARN("io: closing swap space: {}", closed.ToString());
}

Result<std::unique_ptr<SwapSpace>> SwapSpace::Create(const std::vector<std::string>& directories,
                                                     uint64_t capacity,
                                                     const SwapOptions& options) {
  if (directories.empty())
    return Status::InvalidArgument("swap space needs at least one directory");
  if (options.alignment == 0 || (options.alignment & (options.alignment - 1)) != 0) {
    return Status::InvalidArgument(
        fmt::format("swap extent alignment {} is not a power of two", options.alignment));
  }
  capacity = AlignUp(capacity, options.alignment);
  if (capacity == 0) return Status::InvalidArgument("swap space capacity must be > 0 bytes");
  const uint64_t id = next_swap_id++;
  std::vector<std::unique_ptr<File>> files;
  std::vector<std::string> paths;
  OpenOptions open = options.files.open;
  open.create = open.exclusive = true;
  for (size_t i = 0; i < directories.size(); ++i) {
    RemoveStaleSwapFiles(directories[i]);
    const std::string path =
        fmt::format("{}/{}-{}-{}.{}.swap", directories[i], options.name_prefix, ::getpid(), id, i);
    Result<std::unique_ptr<File>> file = File::Open(path, open);
    if (!file.ok()) {
      for (auto& created : files) (void)created->Remove();
      return std::move(file).status();
    }
    // Without the lock (a filesystem without flock), only the process id tells it is in use.
    if (Status locked = HoldSwapLock(**file); !locked.ok())
      ZOE_LOG_DEBUG("io: {}", locked.ToString());
    files.push_back(std::move(file).value());
    paths.push_back(path);
  }
  Result<std::unique_ptr<FileSet>> set = FileSet::FromFiles(std::move(files), options.files);
  if (!set.ok()) {
    for (const std::string& path : paths) ::unlink(path.c_str());
    return std::move(set).status();
  }
  std::unique_ptr<SwapSpace> swap(
      new SwapSpace(std::move(set).value(), directories, capacity, options.alignment));
  if (Status reserved = swap->ReserveFiles(0, capacity); !reserved.ok()) {
    (void)swap->Close();
    return reserved;
  }
  ZOE_LOG_INFO("io: swap space of {} bytes on {} ({})", capacity, swap->files().Describe(),
               swap->files().direct() ? "O_DIRECT" : "buffered");
  return swap;
}

Status SwapSpace::ReserveFiles(uint64_t old_capacity, uint64_t capacity) {
  const uint64_t per_file = files_->PerFileBytes(capacity);
  const uint64_t added = per_file - std::min(per_file, files_->PerFileBytes(old_capacity));
  ZOE_RETURN_IF_ERROR(CheckFreeSpace(directories_, added, capacity));
  for (size_t i = 0; i < files_->file_count(); ++i) {
    const Status reserved = files_->file(i).Allocate(per_file);
    if (reserved.code() == StatusCode::kNoSpace) {
      return Status::NoSpace(
          fmt::format("swap space of {} bytes needs {} bytes for {}: {}", capacity, per_file,
                      files_->file(i).path(), reserved.message()),
          reserved.sys_errno());
    }
    ZOE_RETURN_IF_ERROR(reserved);
  }
  return Status::Ok();
}

Result<uint64_t> SwapSpace::Grow(uint64_t bytes) {
  if (bytes == 0) return Status::InvalidArgument("swap space growth must be > 0 bytes");
  std::lock_guard grow(grow_mutex_);
  uint64_t old_capacity = 0;
  {
    std::lock_guard lock(mutex_);
    if (closed_) return Status::FailedPrecondition("swap space is closed");
    old_capacity = capacity_;
  }
  const uint64_t added = AlignUp(bytes, alignment_);
  if (added > UINT64_MAX - old_capacity)
    return Status::InvalidArgument(fmt::format("swap space growth of {} bytes overflows", bytes));
  ZOE_RETURN_IF_ERROR(ReserveFiles(old_capacity, old_capacity + added));
  std::lock_guard lock(mutex_);
  if (closed_) return Status::FailedPrecondition("swap space is closed");
  capacity_ = old_capacity + added;
  free_total_ += added;
  auto last = free_.empty() ? free_.end() : std::prev(free_.end());
  if (last != free_.end() && last->first + last->second == old_capacity) {
    last->second += added;
  } else {
    free_[old_capacity] = added;
  }
  ZOE_LOG_INFO("io: swap space on {} grew to {} bytes", files_->Describe(), capacity_);
  return capacity_;
}

uint64_t SwapSpace::capacity() const {
  std::lock_guard lock(mutex_);
  return capacity_;
}

Result<Extent> SwapSpace::Allocate(uint64_t bytes) {
  if (bytes == 0) return Status::InvalidArgument("swap extent length must be > 0 bytes");
  const uint64_t length = AlignUp(bytes, alignment_);
  std::lock_guard lock(mutex_);
  if (closed_) return Status::FailedPrecondition("swap space is closed");
  uint64_t largest = 0;
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    largest = std::max(largest, it->second);
    if (it->second < length) continue;
    const Extent extent{it->first, length};
    if (it->second > length) free_[it->first + length] = it->second - length;
    free_.erase(it);
    allocated_[extent.offset] = length;
    free_total_ -= length;
    return extent;
  }
  return Status::NoSpace(fmt::format(
      "swap space on {}: cannot allocate {} bytes ({} aligned); {} of {} bytes free, largest free "
      "extent {} bytes",
      files_->Describe(), bytes, length, free_total_, capacity_, largest));
}

Status SwapSpace::Free(const Extent& extent) {
  std::lock_guard lock(mutex_);
  auto it = allocated_.find(extent.offset);
  if (it == allocated_.end() || it->second != AlignUp(extent.length, alignment_)) {
    return Status::InvalidArgument(fmt::format("swap extent [{}, {}) is not allocated",
                                               extent.offset, extent.offset + extent.length));
  }
  uint64_t offset = it->first;
  uint64_t length = it->second;
  allocated_.erase(it);
  free_total_ += length;
  if (ChecksumTable* sums = files_->checksums()) sums->Forget(offset, length);
  // Merge with the free neighbours on both sides.
  auto next = free_.lower_bound(offset);
  if (next != free_.end() && offset + length == next->first) {
    length += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      offset = prev->first;
      length += prev->second;
      free_.erase(prev);
    }
  }
  free_[offset] = length;
  return Status::Ok();
}

Status SwapSpace::Close() {
  std::lock_guard lock(mutex_);
  if (closed_) return Status::Ok();
  closed_ = true;
  return RemoveAll(*files_);
}

uint64_t SwapSpace::free_bytes() const {
  std::lock_guard lock(mutex_);
  return free_total_;
}

}  // namespace zoe::io
