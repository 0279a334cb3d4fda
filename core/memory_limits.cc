#include "core/memory_limits.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <fstream>
#include <sstream>
#include <string_view>
#include <vector>

namespace zoe {
namespace {

// Limits at or above this are cgroup v1's "unlimited" (2^63 rounded down to a page).
constexpr uint64_t kUnlimited = uint64_t{1} << 62;
constexpr uint64_t kFallbackPhysicalBytes = uint64_t{8} << 30;

std::optional<std::string> ReadText(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::optional<uint64_t> ParseBytes(std::string_view text) {
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.remove_suffix(1);
  uint64_t value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return value;
}

uint64_t PhysicalBytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page_size = ::sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page_size <= 0) return kFallbackPhysicalBytes;
  return static_cast<uint64_t>(pages) * static_cast<uint64_t>(page_size);
}

// MemAvailable of /proc/meminfo in bytes.
std::optional<uint64_t> MemAvailable(const std::string& root) {
  const std::optional<std::string> text = ReadText(root + "/proc/meminfo");
  if (!text) return std::nullopt;
  std::istringstream lines(*text);
  std::string key;
  uint64_t kib = 0;
  std::string unit;
  while (lines >> key >> kib) {
    std::getline(lines, unit);
    if (key == "MemAvailable:") return kib * 1024;
  }
  return std::nullopt;
}

// The memory cgroup folders of this process, its own first, then each ancestor.
std::vector<std::string> CgroupFolders(const std::string& root) {
  const std::optional<std::string> text = ReadText(root + "/proc/self/cgroup");
  if (!text) return {};
  std::istringstream lines(*text);
  std::string line;
  std::string base;
  std::string path;
  while (std::getline(lines, line)) {
    const size_t first = line.find(':');
    const size_t second = line.find(':', first + 1);
    if (first == std::string::npos || second == std::string::npos) continue;
    const std::string controllers = "," + line.substr(first + 1, second - first - 1) + ",";
    if (controllers.find(",memory,") != std::string::npos) {  // v1: preferred when mounted
      base = root + "/sys/fs/cgroup/memory";
      path = line.substr(second + 1);
      break;
    }
    if (line.compare(0, first, "0") == 0 && controllers == ",,") {
      base = root + "/sys/fs/cgroup";
      path = line.substr(second + 1);
    }
  }
  std::vector<std::string> folders;
  if (base.empty()) return folders;
  for (;;) {
    folders.push_back(base + (path == "/" ? "" : path));
    if (path.empty() || path == "/") break;
    path = path.substr(0, std::max<size_t>(path.rfind('/'), 1));
  }
  return folders;
}

// The limit and usage of one cgroup folder, v2 files first, then v1's.
void ReadCgroup(const std::string& folder, const std::string& prefix, MemoryLimits* out) {
  std::optional<std::string> limit = ReadText(folder + "/memory.max");
  std::optional<std::string> usage = ReadText(folder + "/memory.current");
  if (!limit) {
    limit = ReadText(folder + "/memory.limit_in_bytes");
    usage = ReadText(folder + "/memory.usage_in_bytes");
  }
  if (!limit || !usage) return;
  const std::optional<uint64_t> limit_bytes = ParseBytes(*limit);  // "max": none
  const uint64_t usage_bytes = ParseBytes(*usage).value_or(0);
  if (!limit_bytes || *limit_bytes >= kUnlimited) return;
  const uint64_t room = *limit_bytes - std::min(*limit_bytes, usage_bytes);
  const uint64_t current_room =
      out->cgroup_limit_bytes
          ? *out->cgroup_limit_bytes - std::min(*out->cgroup_limit_bytes, out->cgroup_usage_bytes)
          : UINT64_MAX;
  if (room >= current_room) return;
  out->cgroup_limit_bytes = *limit_bytes;
  out->cgroup_usage_bytes = usage_bytes;
  out->cgroup_path = folder.substr(prefix.size());
}

std::string Gib(uint64_t bytes) { return fmt::format("{:.2f} GiB", bytes / double(1 << 30)); }

}  // namespace

uint64_t MemoryLimits::usable_bytes() const {
  if (!cgroup_limit_bytes) return available_bytes;
  const uint64_t room = *cgroup_limit_bytes - std::min(*cgroup_limit_bytes, cgroup_usage_bytes);
  return std::min(available_bytes, room);
}

std::string MemoryLimits::Describe() const {
  std::string out = fmt::format("available {} of {}", Gib(available_bytes), Gib(physical_bytes));
  if (cgroup_limit_bytes) {
    out += fmt::format("; memory cgroup {} limit {}, {} used", cgroup_path,
                       Gib(*cgroup_limit_bytes), Gib(cgroup_usage_bytes));
  }
  return out;
}

MemoryLimits ReadMemoryLimits(const std::string& root) {
  const std::string prefix = root == "/" ? "" : root;
  MemoryLimits limits;
  limits.physical_bytes = PhysicalBytes();
  limits.available_bytes = MemAvailable(prefix).value_or(limits.physical_bytes);
  for (const std::string& folder : CgroupFolders(prefix)) ReadCgroup(folder, prefix, &limits);
  return limits;
}

}  // namespace zoe
