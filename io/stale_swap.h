// Swap files left behind. A swap file lives as long as its process holds it: SwapSpace removes its
// files when closed, but a process that dies first (SIGKILL, the OOM killer of a memory limit)
// leaves them on disk, and they fill it. So each open swap file holds an exclusive flock, which
// the kernel drops when the process ends, and a new swap space first removes the files of its
// directory that were left: named as SwapSpace names them (<prefix>-<pid>-<id>.<index>.swap, the
// prefix starting "zoe-"), regular files of this user, whose process no longer exists and on which
// nobody holds the lock. A file of a process that is alive, or locked, is never touched.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "core/result.h"
#include "io/file.h"

namespace zoe::io {

// Takes the exclusive lock that marks `file` as held by this process (until it is closed).
Status HoldSwapLock(const File& file);

// The process id in a swap file's name, or nullopt for a name SwapSpace would not have made.
std::optional<int> SwapFileOwner(std::string_view name);

struct StaleSweep {
  size_t files = 0;    // swap files removed
  uint64_t bytes = 0;  // their sizes
};

// Removes the swap files in `directory` left by processes that ended (see above). Best effort: a
// file that cannot be checked or removed is left as it is, and an unreadable directory sweeps
// nothing.
StaleSweep RemoveStaleSwapFiles(const std::string& directory);

}  // namespace zoe::io
