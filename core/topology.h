// The machine's CPU and memory layout, from hwloc: cores, hardware threads (PUs), NUMA nodes and
// their CPUs, which NUMA node a file's block device hangs off, and binding threads to cores or
// nodes so I/O and optimizer workers stay near their memory and devices.
//
// Contract: nothing here aborts. hwloc failures, unknown paths and out-of-range indices are
// Status errors; a device whose NUMA node the kernel does not know (virtio, tmpfs, a one-node
// machine) is node -1, not an error.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/executor.h"
#include "core/result.h"

namespace zoe {

struct NumaNode {
  int os_index = -1;      // the kernel's node number
  std::vector<int> cpus;  // OS indices of the node's PUs, ascending
  uint64_t memory_bytes = 0;
};

// A loaded hwloc topology. Copies share it; safe to use from several threads at once.
class Topology {
 public:
  // The topology of this machine (restricted to the CPUs this process may use).
  static Result<Topology> Load();
  // A made-up topology in hwloc's synthetic syntax ("node:2 core:4 pu:2"), for tests. It is not
  // this machine, so binding threads with it fails with NotSupported.
  static Result<Topology> LoadSynthetic(std::string_view description);

  unsigned cores() const;
  unsigned pus() const;
  const std::vector<NumaNode>& numa_nodes() const;
  // Bytes of the last-level cache the CPUs this process may use can hold: the sizes of the
  // instances of the deepest cache level, added up (one per L3 slice, socket or complex). 0 when
  // the topology names no cache. Virtual machines report their guest's instances here (sysfs),
  // which is what a pass over memory can use; the CPUID total that sysconf may give is often the
  // whole host's.
  uint64_t last_level_cache_bytes() const;
  // OS indices of the PUs of core `core` (0 <= core < cores(), in hwloc's logical order).
  Result<std::vector<int>> CoreCpus(unsigned core) const;

  // Restrict the calling thread to core `core`'s PUs, or to NUMA node `os_index`'s PUs.
  Status BindThreadToCore(unsigned core) const;
  Status BindThreadToNumaNode(int os_index) const;

  // An Executor::ThreadInit that binds worker i to core i % cores(). A failed binding is logged
  // once per returned function and the worker runs unbound.
  Executor::ThreadInit PinWorkersToCores() const;

  struct Impl;  // the hwloc handle and a summary of it; defined in topology.cc

 private:
  explicit Topology(std::shared_ptr<const Impl> impl);
  Status BindThreadToCpus(const std::vector<int>& cpus, const std::string& what) const;

  std::shared_ptr<const Impl> impl_;
};

// This machine's topology, loaded on first use and shared afterwards (a failure is kept too).
Result<Topology> SystemTopology();

// The NUMA node of the block device holding `path`: stat(path) gives st_dev, whose
// <sysfs_root>/dev/block/MAJ:MIN link leads into the device tree, walked upwards to the first
// numa_node file. -1 when unknown (no block device behind the file system, or the kernel says -1).
// NotFound when `path` does not exist. `sysfs_root` is replaceable for tests.
Result<int> NumaNodeOfPath(const std::string& path, const std::string& sysfs_root = "/sys");

}  // namespace zoe
