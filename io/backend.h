// Choosing a raw engine at run time: the fallback chain io_uring -> libaio -> psync thread pool,
// and the facts `zoe info` prints about them (which backends work here and why one does not,
// io_uring features found with the probe API, whether a path accepts O_DIRECT).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/result.h"
#include "io/engine.h"

namespace zoe::io {

enum class BackendKind { kAuto, kIoUring, kLibaio, kPsync };

std::string_view BackendName(BackendKind kind);  // "auto", "io_uring", "libaio", "psync"
// Parses a name as written in config and on the command line; an unknown name is an error
// listing the allowed ones.
Result<BackendKind> ParseBackend(std::string_view name);

struct EngineOptions {
  BackendKind backend = BackendKind::kAuto;
  uint32_t queue_depth = 32;  // 1..4096
  // Backends treated as unavailable, as if their setup had failed with EPERM (the way a kernel
  // with kernel.io_uring_disabled=2 refuses io_uring). Used to exercise the fallback chain.
  std::vector<BackendKind> refuse_for_testing;
};

// kAuto tries io_uring, libaio, psync in that order and logs which one runs and why the ones
// before it were passed over; a named backend is used or its failure returned.
Result<std::unique_ptr<Engine>> CreateEngine(const EngineOptions& options);

// The individual backends; each fails with the reason it cannot run here.
Result<std::unique_ptr<Engine>> CreateUringEngine(uint32_t queue_depth);
Result<std::unique_ptr<Engine>> CreateLibaioEngine(uint32_t queue_depth);
Result<std::unique_ptr<Engine>> CreatePsyncEngine(uint32_t queue_depth);

struct BackendInfo {
  BackendKind kind = BackendKind::kPsync;
  bool available = false;
  std::string reason;                 // why it is unavailable; empty when available
  std::vector<std::string> features;  // io_uring: probed opcodes and ring features
};

// Tries to set up each backend (a small queue, torn down again) and reports what it found.
std::vector<BackendInfo> DescribeBackends();

struct PathInfo {
  std::string path;
  std::string filesystem;       // "ext2/ext3/ext4", "tmpfs", "xfs", ... or the magic in hex
  uint64_t free_bytes = 0;      // available to an unprivileged user (statvfs f_bavail)
  bool accepts_direct = false;  // a file under it can be opened with O_DIRECT
  std::string direct_reason;    // why not, when it cannot
  uint32_t dio_mem_align = 0;   // statx DIOALIGN, or 4096 when the kernel does not report it
  uint32_t dio_offset_align = 0;
};

// Probes a directory (with a temporary file, removed again) or an existing file.
Result<PathInfo> ProbePath(const std::string& path);

// Human-readable lines for `zoe info`.
std::string FormatBackends(const std::vector<BackendInfo>& backends);
std::string FormatPathInfo(const PathInfo& info);

}  // namespace zoe::io
