#include "io/stale_swap.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <memory>

#include "core/log.h"

namespace zoe::io {
namespace {

constexpr std::string_view kPrefix = "zoe-";
constexpr std::string_view kSuffix = ".swap";

bool AllDigits(std::string_view text) {
  if (text.empty()) return false;
  for (char c : text) {
    if (c < '0' || c > '9') return false;
  }
  return true;
}

bool ProcessExists(int pid) { return ::kill(pid, 0) == 0 || errno != ESRCH; }

// Takes the swap lock on the open file `fd`; false when another open file holds it. The lock is
// dropped when `fd` is closed.
bool TakeSwapLock(int fd) { return ::flock(fd, LOCK_EX | LOCK_NB) == 0; }

struct Descriptor {
  explicit Descriptor(int value) : fd(value) {}
  ~Descriptor() {
    if (fd >= 0) ::close(fd);
  }
  int fd;
};

// Removes the swap file `name` of the directory open as `dir_fd` when it was left behind (see
// stale_swap.h), holding its lock meanwhile; its size when removed.
std::optional<uint64_t> RemoveIfLeftBehind(int dir_fd, const char* name) {
  const std::optional<int> owner = SwapFileOwner(name);
  if (!owner || ProcessExists(*owner)) return std::nullopt;
  Descriptor file(::openat(dir_fd, name, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK));
  if (file.fd < 0) return std::nullopt;
  struct stat st {};
  if (::fstat(file.fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != ::geteuid())
    return std::nullopt;
  if (!TakeSwapLock(file.fd) || ::unlinkat(dir_fd, name, 0) != 0) return std::nullopt;
  return static_cast<uint64_t>(st.st_size);
}

using Directory = std::unique_ptr<DIR, int (*)(DIR*)>;

// The swap files left behind in the directory `dir` (see stale_swap.h), removed.
StaleSweep SweepOpenDirectory(DIR* dir) {
  StaleSweep sweep;
  const int dir_fd = ::dirfd(dir);
  while (const dirent* entry = ::readdir(dir)) {
    const std::optional<uint64_t> bytes = RemoveIfLeftBehind(dir_fd, entry->d_name);
    if (!bytes) continue;
    ++sweep.files;
    sweep.bytes += *bytes;
  }
  return sweep;
}

// Opens `name` in `parent_fd` as a directory of this user; null for a link, another user's
// directory or anything else.
Directory OpenOwnDirectory(int parent_fd, const char* name) {
  const int fd = ::openat(parent_fd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return Directory(nullptr, ::closedir);
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != ::geteuid()) {
    ::close(fd);
    return Directory(nullptr, ::closedir);
  }
  Directory dir(::fdopendir(fd), ::closedir);
  if (!dir) ::close(fd);
  return dir;
}

// Sweeps the private directory `name` of `parent_fd` and removes it when the sweep emptied it.
// rmdir refuses a directory with anything left in it, so a file made meanwhile keeps it.
void SweepPrivateDirectory(int parent_fd, const char* name, StaleDirectorySweep& sweep) {
  StaleSweep files;
  {
    Directory dir = OpenOwnDirectory(parent_fd, name);
    if (!dir) return;
    files = SweepOpenDirectory(dir.get());
  }
  sweep.files.files += files.files;
  sweep.files.bytes += files.bytes;
  if (files.files > 0 && ::unlinkat(parent_fd, name, AT_REMOVEDIR) == 0) ++sweep.directories;
}

}  // namespace

bool IsPrivateDirectoryName(std::string_view name, std::string_view prefix) {
  if (!name.starts_with(prefix) || name.size() != prefix.size() + 6) return false;
  for (char c : name.substr(prefix.size())) {
    const bool alnum = (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
    if (!alnum) return false;
  }
  return true;
}

StaleDirectorySweep RemoveStalePrivateDirectories(const std::string& parent,
                                                  std::string_view prefix) {
  StaleDirectorySweep sweep;
  Directory dir(::opendir(parent.c_str()), ::closedir);
  if (!dir) return sweep;
  const int parent_fd = ::dirfd(dir.get());
  while (const dirent* entry = ::readdir(dir.get())) {
    if (IsPrivateDirectoryName(entry->d_name, prefix))
      SweepPrivateDirectory(parent_fd, entry->d_name, sweep);
  }
  if (sweep.files.files > 0) {
    ZOE_LOG_INFO(
        "io: removed {} swap file(s) ({} bytes) and {} directory(ies) {}* in {} left by "
        "processes that ended",
        sweep.files.files, sweep.files.bytes, sweep.directories, prefix, parent);
  }
  return sweep;
}

Status HoldSwapLock(const File& file) {
  if (TakeSwapLock(file.fd())) return Status::Ok();
  return Status::FromErrno(errno, "lock swap file " + file.path());
}

std::optional<int> SwapFileOwner(std::string_view name) {
  if (!name.starts_with(kPrefix) || !name.ends_with(kSuffix)) return std::nullopt;
  name.remove_suffix(kSuffix.size());
  // <prefix>-<pid>-<id>.<index>: the last dash starts "<id>.<index>", the one before the pid.
  const size_t last = name.rfind('-');
  if (last == std::string_view::npos || last < kPrefix.size()) return std::nullopt;
  const std::string_view id_index = name.substr(last + 1);
  const size_t dot = id_index.find('.');
  if (dot == std::string_view::npos || !AllDigits(id_index.substr(0, dot)) ||
      !AllDigits(id_index.substr(dot + 1))) {
    return std::nullopt;
  }
  const size_t before = name.rfind('-', last - 1);  // the prefix is "zoe-" and more
  if (before == std::string_view::npos || before <= kPrefix.size()) return std::nullopt;
  const std::string_view pid_text = name.substr(before + 1, last - before - 1);
  int pid = 0;
  if (!AllDigits(pid_text)) return std::nullopt;
  const auto [end, error] =
      std::from_chars(pid_text.data(), pid_text.data() + pid_text.size(), pid);
  if (error != std::errc() || end != pid_text.data() + pid_text.size() || pid <= 0)
    return std::nullopt;
  return pid;
}

StaleSweep RemoveStaleSwapFiles(const std::string& directory) {
  Directory dir(::opendir(directory.c_str()), ::closedir);
  if (!dir) return StaleSweep{};
  const StaleSweep sweep = SweepOpenDirectory(dir.get());
  if (sweep.files > 0) {
    ZOE_LOG_INFO("io: removed {} swap file(s) ({} bytes) in {} left by processes that ended",
                 sweep.files, sweep.bytes, directory);
  }
  return sweep;
}

}  // namespace zoe::io
