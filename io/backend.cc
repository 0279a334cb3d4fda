#include "io/backend.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>

#include "core/log.h"
#include "core/vocabulary.h"
#include "io/file.h"

namespace zoe::io {
namespace {

constexpr std::array<BackendKind, 3> kChain = {BackendKind::kIoUring, BackendKind::kLibaio,
                                               BackendKind::kPsync};
constexpr uint32_t kMaxQueueDepth = 4096;
constexpr uint32_t kProbeQueueDepth = 8;

Result<std::unique_ptr<Engine>> CreateOne(BackendKind kind, const EngineOptions& options) {
  const auto& refused = options.refuse_for_testing;
  if (std::find(refused.begin(), refused.end(), kind) != refused.end()) {
    return Status::FromErrno(
        EPERM, fmt::format("{} setup (refused by fault injection)", BackendName(kind)));
  }
  switch (kind) {
    case BackendKind::kIoUring:
      return CreateUringEngine(options.queue_depth);
    case BackendKind::kLibaio:
      return CreateLibaioEngine(options.queue_depth);
    case BackendKind::kPsync:
      return CreatePsyncEngine(options.queue_depth);
    case BackendKind::kAuto:
      break;
  }
  return Status::Internal("CreateOne called with kAuto");
}

// The filesystem a statfs magic number stands for (a kernel constant rather than an enum of zoe,
// so not one of core/vocabulary.h's tables); others in hex.
std::string FilesystemName(int64_t magic) {
  switch (magic) {
    case EXT4_SUPER_MAGIC:
      return "ext2/ext3/ext4";
    case TMPFS_MAGIC:
      return "tmpfs";
    case XFS_SUPER_MAGIC:
      return "xfs";
    case BTRFS_SUPER_MAGIC:
      return "btrfs";
    case OVERLAYFS_SUPER_MAGIC:
      return "overlayfs";
    default:
      return fmt::format("{:#x}", magic);
  }
}

}  // namespace

// Indexed by BackendKind's value (core/vocabulary.h's mechanism).
constexpr std::array<std::string_view, 4> kBackendNames = {"auto", "io_uring", "libaio", "psync"};
static_assert(kBackendNames.size() == static_cast<size_t>(BackendKind::kPsync) + 1);

std::string_view BackendName(BackendKind kind) { return NameIn(kBackendNames, kind); }

Result<BackendKind> ParseBackend(std::string_view name) {
  return ParseIn<BackendKind>(kBackendNames, "I/O backend", name);
}

Result<std::unique_ptr<Engine>> CreateEngine(const EngineOptions& options) {
  if (options.queue_depth == 0 || options.queue_depth > kMaxQueueDepth) {
    return Status::InvalidArgument(
        fmt::format("queue depth {} is out of range 1..{}", options.queue_depth, kMaxQueueDepth));
  }
  if (options.backend != BackendKind::kAuto) {
    ZOE_ASSIGN_OR_RETURN(auto engine, CreateOne(options.backend, options));
    ZOE_LOG_INFO("io: backend {} (queue depth {}; {})", engine->name(), options.queue_depth,
                 engine->features());
    return engine;
  }
  std::string passed_over;
  for (BackendKind kind : kChain) {
    Result<std::unique_ptr<Engine>> engine = CreateOne(kind, options);
    if (engine.ok()) {
      ZOE_LOG_INFO("io: backend {} (queue depth {}; {}){}", (*engine)->name(), options.queue_depth,
                   (*engine)->features(),
                   passed_over.empty() ? "" : "; passed over: " + passed_over);
      return engine;
    }
    ZOE_LOG_WARN("io: {} unavailable ({}); falling back", BackendName(kind),
                 engine.status().ToString());
    passed_over += fmt::format("{}{} ({})", passed_over.empty() ? "" : ", ", BackendName(kind),
                               engine.status().message());
  }
  return Status::NotSupported("no I/O backend can run here: " + passed_over);
}

std::vector<BackendInfo> DescribeBackends() {
  std::vector<BackendInfo> out;
  for (BackendKind kind : kChain) {
    BackendInfo info;
    info.kind = kind;
    EngineOptions options;
    options.queue_depth = kProbeQueueDepth;
    Result<std::unique_ptr<Engine>> engine = CreateOne(kind, options);
    info.available = engine.ok();
    if (!engine.ok()) {
      info.reason = engine.status().ToString();
    } else {
      const std::string features = (*engine)->features();
      for (size_t begin = 0; begin < features.size();) {
        size_t end = features.find(", ", begin);
        if (end == std::string::npos) end = features.size();
        info.features.push_back(features.substr(begin, end - begin));
        begin = end + 2;
      }
    }
    out.push_back(std::move(info));
  }
  return out;
}

Result<PathInfo> ProbePath(const std::string& path) {
  PathInfo info;
  info.path = path;
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return Status::FromErrno(errno, "probe " + path);
  struct statfs fs {};
  struct statvfs vfs {};
  if (::statfs(path.c_str(), &fs) != 0) return Status::FromErrno(errno, "statfs " + path);
  if (::statvfs(path.c_str(), &vfs) != 0) return Status::FromErrno(errno, "statvfs " + path);
  info.filesystem = FilesystemName(static_cast<int64_t>(fs.f_type));
  info.free_bytes = uint64_t{vfs.f_bavail} * vfs.f_frsize;
  const bool is_dir = S_ISDIR(st.st_mode);
  const std::string probe_path = is_dir ? fmt::format("{}/.zoe-probe-{}", path, ::getpid()) : path;
  OpenOptions options;
  options.create = is_dir;
  Result<std::unique_ptr<File>> file = File::Open(probe_path, options);
  if (is_dir) ::unlink(probe_path.c_str());
  if (!file.ok()) return std::move(file).status();
  info.accepts_direct = (*file)->direct();
  if (!info.accepts_direct) info.direct_reason = "open with O_DIRECT failed with EINVAL";
  info.dio_mem_align = (*file)->mem_align();
  info.dio_offset_align = (*file)->offset_align();
  return info;
}

std::string FormatBackends(const std::vector<BackendInfo>& backends) {
  std::string out;
  for (const BackendInfo& b : backends) {
    out += fmt::format("  {:<9} {}", BackendName(b.kind),
                       b.available ? "available" : "unavailable: " + b.reason);
    if (!b.features.empty()) out += fmt::format(" [{}]", fmt::join(b.features, ", "));
    out += "\n";
  }
  return out;
}

std::string FormatPathInfo(const PathInfo& info) {
  if (!info.accepts_direct) {
    return fmt::format("  {}: {}, {} bytes free, O_DIRECT refused ({}); buffered I/O\n", info.path,
                       info.filesystem, info.free_bytes, info.direct_reason);
  }
  return fmt::format(
      "  {}: {}, {} bytes free, O_DIRECT accepted, alignment: memory {} B, offset {} B\n",
      info.path, info.filesystem, info.free_bytes, info.dio_mem_align, info.dio_offset_align);
}

}  // namespace zoe::io
