// Swap files left behind. A swap file lives as long as its process holds it: SwapSpace removes its
// files when closed, but a process that dies first (SIGKILL, the OOM killer of a memory limit)
// leaves them on disk, and they fill it. So each open swap file holds an exclusive flock, which
// the kernel drops when the process ends, and a new swap space first removes the files of its
// directory that were left: named as SwapSpace names them (<prefix>-<pid>-<id>.<index>.swap, the
// prefix starting "zoe-"), regular files of this user, whose process no longer exists and on which
// nobody holds the lock. A file of a process that is alive, or locked, is never touched.
//
// An engine given no swap directory makes a private one (<parent>/<prefix>XXXXXX, by mkdtemp) and
// removes it when closed; a killed process leaves it with its swap files. So the next engine
// making one in the same parent sweeps the private directories left there: named <prefix> and six
// characters of mkdtemp's, directories of this user (not links); in each, the swap files left
// behind are removed by the rule above, and then the directory when nothing else is left in it. A
// directory holding anything else (a live or locked swap file, a file zoe did not make) keeps it;
// an empty one is kept too, since it may be another engine's, made a moment ago (it holds no
// space).
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

struct StaleDirectorySweep {
  size_t directories = 0;  // private directories removed
  StaleSweep files;        // the swap files removed from them, whether or not they went
};

// Sweeps the private directories named `prefix` + six characters in `parent` (see above); e.g.
// prefix "zoe-engine-". Best effort, as RemoveStaleSwapFiles.
StaleDirectorySweep RemoveStalePrivateDirectories(const std::string& parent,
                                                  std::string_view prefix);

// Whether `name` is `prefix` followed by the six characters mkdtemp puts for "XXXXXX".
bool IsPrivateDirectoryName(std::string_view name, std::string_view prefix);

}  // namespace zoe::io
