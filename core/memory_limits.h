// How much memory this process may use: what zoe's automatic host budget is taken from.
//
// Contract:
//  - ReadMemoryLimits never fails: every source that cannot be read is left out (an absent
//    /proc/meminfo gives the physical memory from sysconf; an absent cgroup file, no limit).
//  - The cgroup limits are those of the process's own memory cgroup and its ancestors (v2:
//    memory.max and memory.current along the unified hierarchy's path; v1: the memory
//    controller's memory.limit_in_bytes and memory.usage_in_bytes); "max" and v1's near-2^63
//    "unlimited" are no limit. The tightest room left under any of them counts.
//  - `root` prefixes every path read ("/" on a real machine; tests give a folder laid out as
//    /proc and /sys/fs/cgroup).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace zoe {

struct MemoryLimits {
  uint64_t physical_bytes = 0;   // sysconf(_SC_PHYS_PAGES) * page size
  uint64_t available_bytes = 0;  // /proc/meminfo MemAvailable, else physical_bytes
  // The tightest cgroup: its limit, its usage now, and its folder (for messages).
  std::optional<uint64_t> cgroup_limit_bytes;
  uint64_t cgroup_usage_bytes = 0;
  std::string cgroup_path;

  // The memory this process may still take: the machine's available memory, or less the room
  // left under the cgroup limit.
  uint64_t usable_bytes() const;
  // One line for logs and errors: "available 21.1 GiB of 23.4 GiB; cgroup /x limit 1 GiB, 300
  // MiB used".
  std::string Describe() const;
};

MemoryLimits ReadMemoryLimits(const std::string& root = "/");

}  // namespace zoe
