#include "core/topology.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <hwloc.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>

#include <atomic>
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <utility>

#include "core/log.h"

namespace zoe {

struct Topology::Impl {
  hwloc_topology_t topology = nullptr;
  bool is_this_system = true;
  unsigned cores = 0;
  unsigned pus = 0;
  std::vector<NumaNode> nodes;
  std::vector<std::vector<int>> core_cpus;
  uint64_t last_level_cache_bytes = 0;

  ~Impl() {
    if (topology != nullptr) hwloc_topology_destroy(topology);
  }
};

namespace {

std::vector<int> CpusOf(hwloc_const_cpuset_t set) {
  std::vector<int> cpus;
  for (int cpu = hwloc_bitmap_first(set); cpu != -1; cpu = hwloc_bitmap_next(set, cpu)) {
    cpus.push_back(cpu);
  }
  return cpus;
}

// The summed size of the instances of the deepest cache level the topology has, 0 for none.
uint64_t LastLevelCacheBytes(hwloc_topology_t t) {
  const hwloc_obj_type_t deepest_first[] = {HWLOC_OBJ_L5CACHE, HWLOC_OBJ_L4CACHE, HWLOC_OBJ_L3CACHE,
                                            HWLOC_OBJ_L2CACHE, HWLOC_OBJ_L1CACHE};
  for (hwloc_obj_type_t type : deepest_first) {
    uint64_t bytes = 0;
    const int count = hwloc_get_nbobjs_by_type(t, type);
    for (int i = 0; i < count; ++i) {
      const hwloc_obj_t cache = hwloc_get_obj_by_type(t, type, i);
      if (cache->attr != nullptr && cache->attr->cache.type != HWLOC_OBJ_CACHE_INSTRUCTION) {
        bytes += cache->attr->cache.size;
      }
    }
    if (bytes > 0) return bytes;
  }
  return 0;
}

// Copies what zoe asks about out of hwloc once, so later queries are plain reads.
void Summarise(Topology::Impl& impl) {
  hwloc_topology_t t = impl.topology;
  impl.pus = static_cast<unsigned>(std::max(0, hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_PU)));
  const int cores = hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_CORE);
  for (int i = 0; i < cores; ++i) {
    impl.core_cpus.push_back(CpusOf(hwloc_get_obj_by_type(t, HWLOC_OBJ_CORE, i)->cpuset));
  }
  if (impl.core_cpus.empty()) {  // some virtual machines report PUs without cores
    for (unsigned i = 0; i < impl.pus; ++i) {
      impl.core_cpus.push_back(CpusOf(hwloc_get_obj_by_type(t, HWLOC_OBJ_PU, i)->cpuset));
    }
  }
  impl.cores = static_cast<unsigned>(impl.core_cpus.size());
  impl.last_level_cache_bytes = LastLevelCacheBytes(t);
  const int nodes = hwloc_get_nbobjs_by_type(t, HWLOC_OBJ_NUMANODE);
  for (int i = 0; i < nodes; ++i) {
    hwloc_obj_t node = hwloc_get_obj_by_type(t, HWLOC_OBJ_NUMANODE, i);
    impl.nodes.push_back({static_cast<int>(node->os_index), CpusOf(node->cpuset),
                          node->attr != nullptr ? node->attr->numanode.local_memory : 0});
  }
}

// Initialises, configures (via `configure`) and loads an hwloc topology.
template <class Configure>
Result<std::shared_ptr<Topology::Impl>> LoadWith(std::string_view what, Configure configure) {
  auto impl = std::make_shared<Topology::Impl>();
  if (hwloc_topology_init(&impl->topology) != 0) {
    impl->topology = nullptr;
    return Status::FromErrno(errno, fmt::format("hwloc: initialise {} topology", what));
  }
  ZOE_RETURN_IF_ERROR(configure(impl->topology));
  if (hwloc_topology_load(impl->topology) != 0) {
    return Status::FromErrno(errno, fmt::format("hwloc: load {} topology", what));
  }
  impl->is_this_system = hwloc_topology_is_thissystem(impl->topology) != 0;
  Summarise(*impl);
  if (impl->pus == 0) {
    return Status::NotSupported(
        fmt::format("hwloc: the {} topology has no processing units", what));
  }
  return impl;
}

// Reads the integer in a sysfs attribute file; false when it is missing or not a number.
bool ReadInt(const std::filesystem::path& file, int* out) {
  std::ifstream in(file);
  return static_cast<bool>(in >> *out);
}

// Walks from `dir` up towards `stop` (exclusive) and returns the first numa_node attribute's
// value; -1 when none is found or the kernel itself reports -1.
int FirstNumaNodeAbove(std::filesystem::path dir, const std::filesystem::path& stop) {
  for (; dir.has_relative_path() && dir != stop; dir = dir.parent_path()) {
    int node = -1;
    if (ReadInt(dir / "numa_node", &node)) return node < 0 ? -1 : node;
  }
  return -1;
}

}  // namespace

Topology::Topology(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}

Result<Topology> Topology::Load() {
  ZOE_ASSIGN_OR_RETURN(auto impl,
                       LoadWith("this machine's", [](hwloc_topology_t) { return Status::Ok(); }));
  return Topology(std::move(impl));
}

Result<Topology> Topology::LoadSynthetic(std::string_view description) {
  const std::string text(description);
  ZOE_ASSIGN_OR_RETURN(auto impl, LoadWith("synthetic", [&](hwloc_topology_t t) {
                         if (hwloc_topology_set_synthetic(t, text.c_str()) == 0)
                           return Status::Ok();
                         return Status::InvalidArgument(fmt::format(
                             "hwloc: '{}' is not a synthetic topology description (for example "
                             "\"node:2 core:4 pu:2\")",
                             text));
                       }));
  return Topology(std::move(impl));
}

unsigned Topology::cores() const { return impl_->cores; }
unsigned Topology::pus() const { return impl_->pus; }
const std::vector<NumaNode>& Topology::numa_nodes() const { return impl_->nodes; }
uint64_t Topology::last_level_cache_bytes() const { return impl_->last_level_cache_bytes; }

Result<std::vector<int>> Topology::CoreCpus(unsigned core) const {
  if (core >= impl_->cores) {
    return Status::InvalidArgument(
        fmt::format("core {} is out of range; this machine has {} cores (0..{})", core,
                    impl_->cores, impl_->cores - 1));
  }
  return impl_->core_cpus[core];
}

Status Topology::BindThreadToCpus(const std::vector<int>& cpus, const std::string& what) const {
  if (!impl_->is_this_system) {
    return Status::NotSupported(
        fmt::format("bind thread to {}: the topology is not this machine's", what));
  }
  hwloc_bitmap_t set = hwloc_bitmap_alloc();
  if (set == nullptr) return Status::OutOfMemory("hwloc: allocate a cpuset");
  for (int cpu : cpus) hwloc_bitmap_set(set, static_cast<unsigned>(cpu));
  const int rc = hwloc_set_cpubind(impl_->topology, set, HWLOC_CPUBIND_THREAD);
  const int err = errno;
  hwloc_bitmap_free(set);
  if (rc != 0) {
    return Status::FromErrno(
        err, fmt::format("hwloc: bind thread to {} (cpus {})", what, fmt::join(cpus, ",")));
  }
  return Status::Ok();
}

Status Topology::BindThreadToCore(unsigned core) const {
  ZOE_ASSIGN_OR_RETURN(std::vector<int> cpus, CoreCpus(core));
  return BindThreadToCpus(cpus, fmt::format("core {}", core));
}

Status Topology::BindThreadToNumaNode(int os_index) const {
  std::vector<int> known;
  for (const NumaNode& node : impl_->nodes) {
    if (node.os_index == os_index) {
      return BindThreadToCpus(node.cpus, fmt::format("NUMA node {}", os_index));
    }
    known.push_back(node.os_index);
  }
  return Status::InvalidArgument(fmt::format("NUMA node {} does not exist; this machine has {}",
                                             os_index, fmt::join(known, ", ")));
}

Executor::ThreadInit Topology::PinWorkersToCores() const {
  auto warned = std::make_shared<std::atomic<bool>>(false);
  return [topology = *this, warned](unsigned worker) {
    Status status = topology.BindThreadToCore(worker % topology.cores());
    if (!status.ok() && !warned->exchange(true)) {
      ZOE_LOG_WARN("worker {} runs unbound: {}", worker, status.ToString());
    }
  };
}

Result<Topology> SystemTopology() {
  static const Result<Topology> topology = Topology::Load();
  return topology;
}

Result<int> NumaNodeOfPath(const std::string& path, const std::string& sysfs_root) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) {
    return Status::FromErrno(errno, fmt::format("NUMA node of '{}': stat", path));
  }
  namespace fs = std::filesystem;
  const fs::path sysfs(sysfs_root);
  const fs::path link =
      sysfs / "dev" / "block" / fmt::format("{}:{}", major(st.st_dev), minor(st.st_dev));
  std::error_code ec;
  const fs::path device = fs::canonical(link, ec);
  if (ec) return -1;  // no block device behind this file system (tmpfs, overlay, NFS, ...)
  const fs::path devices_root = fs::canonical(sysfs / "devices", ec);
  return FirstNumaNodeAbove(device, ec ? fs::path() : devices_root);
}

}  // namespace zoe
