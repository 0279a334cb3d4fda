// Description: hwloc topology: counts and NUMA cpusets, thread binding and its refusal, worker
// pinning, and the NUMA node of a path.
#include "core/topology.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <pthread.h>
#include <sched.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>
#include <vector>

#include "core/log.h"

namespace zoe {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

Topology LoadOrFail() {
  auto topology = Topology::Load();
  EXPECT_TRUE(topology.ok()) << topology.status().ToString();
  return std::move(topology).value();
}

std::vector<int> ThreadAffinity() {
  cpu_set_t set;
  CPU_ZERO(&set);
  pthread_getaffinity_np(pthread_self(), sizeof(set), &set);
  std::vector<int> cpus;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (CPU_ISSET(cpu, &set)) cpus.push_back(cpu);
  }
  return cpus;
}

// Restores the calling thread's CPU affinity when it goes out of scope.
class AffinityGuard {
 public:
  AffinityGuard() { pthread_getaffinity_np(pthread_self(), sizeof(saved_), &saved_); }
  ~AffinityGuard() { pthread_setaffinity_np(pthread_self(), sizeof(saved_), &saved_); }

 private:
  cpu_set_t saved_;
};

TEST(Topology, CountsAndNumaNodesCoverTheUsableCpus) {
  Topology topology = LoadOrFail();
  EXPECT_GE(topology.cores(), 1u);
  EXPECT_GE(topology.pus(), topology.cores());
  ASSERT_GE(topology.numa_nodes().size(), 1u);
  std::set<int> from_nodes, from_cores;
  for (const NumaNode& node : topology.numa_nodes()) {
    EXPECT_GE(node.os_index, 0);
    EXPECT_TRUE(std::is_sorted(node.cpus.begin(), node.cpus.end()));
    from_nodes.insert(node.cpus.begin(), node.cpus.end());
  }
  for (unsigned core = 0; core < topology.cores(); ++core) {
    auto cpus = topology.CoreCpus(core);
    ASSERT_TRUE(cpus.ok());
    EXPECT_FALSE(cpus->empty());
    from_cores.insert(cpus->begin(), cpus->end());
  }
  EXPECT_EQ(from_cores.size(), topology.pus());
  EXPECT_EQ(from_nodes, from_cores);
  const std::vector<int> allowed = ThreadAffinity();
  for (int cpu : from_cores) {
    EXPECT_TRUE(std::find(allowed.begin(), allowed.end(), cpu) != allowed.end()) << cpu;
  }
}

TEST(Topology, SystemTopologyIsLoadedOnceAndShared) {
  auto first = SystemTopology();
  auto second = SystemTopology();
  ASSERT_TRUE(first.ok() && second.ok());
  EXPECT_EQ(&first->numa_nodes(), &second->numa_nodes());
  EXPECT_EQ(first->pus(), LoadOrFail().pus());
}

TEST(Topology, SyntheticTopologyDescribesNodesAndCores) {
  auto topology = Topology::LoadSynthetic("node:2 core:3 pu:2");
  ASSERT_TRUE(topology.ok()) << topology.status().ToString();
  EXPECT_EQ(topology->cores(), 6u);
  EXPECT_EQ(topology->pus(), 12u);
  ASSERT_EQ(topology->numa_nodes().size(), 2u);
  EXPECT_EQ(topology->numa_nodes()[0].cpus, (std::vector<int>{0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(topology->numa_nodes()[1].cpus, (std::vector<int>{6, 7, 8, 9, 10, 11}));
  EXPECT_EQ(*topology->CoreCpus(4), (std::vector<int>{8, 9}));
}

// The last-level cache is the deepest cache level's instances added up: two L3 slices of 16 MiB
// under L2s of 1 MiB give 32 MiB; a topology without caches gives 0.
TEST(Topology, LastLevelCacheAddsUpTheDeepestLevelsInstances) {
  auto sliced =
      Topology::LoadSynthetic("pack:1 l3:2(size=16777216) l2:2(size=1048576) core:1 pu:1");
  ASSERT_TRUE(sliced.ok()) << sliced.status().ToString();
  EXPECT_EQ(sliced->last_level_cache_bytes(), uint64_t{32} << 20);
  auto l2_only = Topology::LoadSynthetic("pack:2 l2:3(size=2097152) core:1 pu:1");
  ASSERT_TRUE(l2_only.ok()) << l2_only.status().ToString();
  EXPECT_EQ(l2_only->last_level_cache_bytes(), uint64_t{12} << 20);
  auto none = Topology::LoadSynthetic("node:2 core:3 pu:2");
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->last_level_cache_bytes(), 0u);
}

TEST(Topology, BadSyntheticDescriptionIsAnError) {
  auto topology = Topology::LoadSynthetic("node:two");
  ASSERT_FALSE(topology.ok());
  EXPECT_EQ(topology.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(topology.status().message()), HasSubstr("'node:two'"));
}

TEST(Topology, BindingToACoreRestrictsTheThread) {
  Topology topology = LoadOrFail();
  AffinityGuard restore;
  const unsigned last = topology.cores() - 1;
  ASSERT_TRUE(topology.BindThreadToCore(last).ok());
  EXPECT_EQ(ThreadAffinity(), *topology.CoreCpus(last));
  sched_yield();
  const std::vector<int> cpus = *topology.CoreCpus(last);
  EXPECT_TRUE(std::find(cpus.begin(), cpus.end(), sched_getcpu()) != cpus.end());
}

TEST(Topology, BindingToANumaNodeUsesItsCpus) {
  Topology topology = LoadOrFail();
  AffinityGuard restore;
  const NumaNode& node = topology.numa_nodes().front();
  ASSERT_TRUE(topology.BindThreadToNumaNode(node.os_index).ok());
  EXPECT_EQ(ThreadAffinity(), node.cpus);
}

TEST(Topology, OutOfRangeTargetsAreErrorsNamingTheRange) {
  Topology topology = LoadOrFail();
  Status status = topology.BindThreadToCore(topology.cores());
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message(), "core " + std::to_string(topology.cores()) +
                                  " is out of range; this machine has " +
                                  std::to_string(topology.cores()) + " cores (0.." +
                                  std::to_string(topology.cores() - 1) + ")");
  status = topology.BindThreadToNumaNode(4096);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(status.message()), HasSubstr("NUMA node 4096 does not exist"));
}

TEST(Topology, BindingWithATopologyOfAnotherMachineIsRefused) {
  auto synthetic = Topology::LoadSynthetic("node:2 core:2 pu:1");
  ASSERT_TRUE(synthetic.ok());
  AffinityGuard restore;
  const std::vector<int> before = ThreadAffinity();
  Status status = synthetic->BindThreadToCore(1);
  EXPECT_EQ(status.code(), StatusCode::kNotSupported);
  EXPECT_EQ(status.message(), "bind thread to core 1: the topology is not this machine's");
  EXPECT_EQ(synthetic->BindThreadToNumaNode(1).code(), StatusCode::kNotSupported);
  EXPECT_EQ(ThreadAffinity(), before);
}

TEST(Topology, PinWorkersToCoresBindsWorkerIToCoreIModCores) {
  Topology topology = LoadOrFail();
  const unsigned workers = topology.cores() + 1;  // one wraps around
  std::mutex mutex;
  std::vector<std::vector<int>> seen(workers);
  {
    Executor::ThreadInit pin = topology.PinWorkersToCores();
    Executor executor(workers, [&](unsigned worker) {
      pin(worker);
      std::lock_guard lock(mutex);
      seen[worker] = ThreadAffinity();
    });
  }
  for (unsigned i = 0; i < workers; ++i) {
    EXPECT_EQ(seen[i], *topology.CoreCpus(i % topology.cores())) << "worker " << i;
  }
}

TEST(Topology, PinWorkersWarnsOnceWhenBindingIsRefused) {
  ASSERT_TRUE(log::SetLevel("warn").ok());
  auto synthetic = Topology::LoadSynthetic("core:4 pu:1");
  ASSERT_TRUE(synthetic.ok());
  log::ScopedCapture capture;
  { Executor executor(3, synthetic->PinWorkersToCores()); }
  EXPECT_EQ(capture.Count("runs unbound"), 1u);
}

// ---------------------------------------------------------------------------------------------
// NumaNodeOfPath

TEST(NumaNodeOfPath, MissingPathIsNotFound) {
  auto node = NumaNodeOfPath("/nonexistent/zoe/path");
  ASSERT_FALSE(node.ok());
  EXPECT_EQ(node.status().code(), StatusCode::kNotFound);
  EXPECT_THAT(std::string(node.status().message()), HasSubstr("'/nonexistent/zoe/path'"));
}

TEST(NumaNodeOfPath, RealPathsGiveANodeOrMinusOne) {
  for (const char* path : {"/", "/proc/self", "/dev/shm"}) {
    auto node = NumaNodeOfPath(path);
    ASSERT_TRUE(node.ok()) << path << ": " << node.status().ToString();
    EXPECT_GE(*node, -1) << path;
  }
  EXPECT_EQ(*NumaNodeOfPath("/proc/self"), -1) << "procfs has no block device";
}

// Builds a fake sysfs in which the block device of `file` sits below a PCI function with
// numa_node `pci_node` (the walk must pass devices without the attribute to find it).
class FakeSysfs : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::path(::testing::TempDir()) / ("zoe_sysfs_" + std::to_string(getpid()));
    fs::remove_all(root_);
    file_ = root_ / "file";
    fs::create_directories(root_);
    std::ofstream(file_) << "x";
  }
  void TearDown() override { fs::remove_all(root_); }

  void MakeDevice(const std::string& pci_node) {
    struct stat st;
    ASSERT_EQ(stat(file_.c_str(), &st), 0);
    const fs::path pci = root_ / "devices/pci0000:00/0000:00:1d.0";
    const fs::path disk = pci / "nvme/nvme0/nvme0n1";
    fs::create_directories(disk);
    fs::create_directories(root_ / "dev/block");
    if (!pci_node.empty()) std::ofstream(pci / "numa_node") << pci_node << "\n";
    fs::create_symlink(
        "../../devices/pci0000:00/0000:00:1d.0/nvme/nvme0/nvme0n1",
        root_ / "dev/block" /
            (std::to_string(major(st.st_dev)) + ":" + std::to_string(minor(st.st_dev))));
  }

  fs::path root_;
  fs::path file_;
};

TEST_F(FakeSysfs, WalksUpToTheFirstNumaNodeAttribute) {
  MakeDevice("1");
  auto node = NumaNodeOfPath(file_, root_);
  ASSERT_TRUE(node.ok()) << node.status().ToString();
  EXPECT_EQ(*node, 1);
}

TEST_F(FakeSysfs, KernelMinusOneMeansUnknown) {
  MakeDevice("-1");
  EXPECT_EQ(*NumaNodeOfPath(file_, root_), -1);
}

TEST_F(FakeSysfs, NoAttributeAnywhereMeansUnknown) {
  MakeDevice("");
  EXPECT_EQ(*NumaNodeOfPath(file_, root_), -1);
}

TEST_F(FakeSysfs, NoBlockDeviceLinkMeansUnknown) { EXPECT_EQ(*NumaNodeOfPath(file_, root_), -1); }

}  // namespace
}  // namespace zoe
