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

}  // namespace

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
  StaleSweep sweep;
  std::unique_ptr<DIR, int (*)(DIR*)> dir(::opendir(directory.c_str()), ::closedir);
  if (!dir) return sweep;
  const int dir_fd = ::dirfd(dir.get());
  while (const dirent* entry = ::readdir(dir.get())) {
    const std::optional<uint64_t> bytes = RemoveIfLeftBehind(dir_fd, entry->d_name);
    if (!bytes) continue;
    ++sweep.files;
    sweep.bytes += *bytes;
  }
  if (sweep.files > 0) {
    ZOE_LOG_INFO("io: removed {} swap file(s) ({} bytes) in {} left by processes that ended",
                 sweep.files, sweep.bytes, directory);
  }
  return sweep;
}

}  // namespace zoe::io
