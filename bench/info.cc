// `zoe info`: what this machine offers zoe — I/O backends (and why one is unavailable), io_uring
// features, O_DIRECT support of the given paths, CPU topology and NUMA placement, the optimizer's
// instruction-set path, whether a CUDA device is present, and the NVMe bytes the optimizer state
// takes per parameter for each optimizer, moment dtype and number of slots.
#include <fmt/format.h>

#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench/command.h"
#include "core/device.h"
#include "core/topology.h"
#include "io/backend.h"
#include "offload/optimizer/optimizer_group_layout.h"
#include "optim/dispatch.h"

namespace zoe::cli {
namespace {

struct InfoOptions {
  std::vector<std::string> paths;
  std::string output_format = "human";
};

nlohmann::json BackendsJson(const std::vector<io::BackendInfo>& backends) {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& b : backends) {
    out.push_back({{"name", io::BackendName(b.kind)},
                   {"available", b.available},
                   {"reason", b.reason},
                   {"features", b.features}});
  }
  return out;
}

// One probed --path: what io/ found, and the NUMA node of its block device (-1 when unknown).
struct ProbedPath {
  std::string path;
  Result<io::PathInfo> info;
  int numa_node;
};

// Everything `zoe info` reports that needs probing, gathered once for both output formats.
struct Probes {
  std::vector<io::BackendInfo> backends;
  std::vector<ProbedPath> paths;
};

Probes ProbeMachine(const InfoOptions& options) {
  Probes probes{io::DescribeBackends(), {}};
  for (const auto& path : options.paths) {
    auto node = NumaNodeOfPath(path);
    probes.paths.push_back({path, io::ProbePath(path), node.ok() ? *node : -1});
  }
  return probes;
}

nlohmann::json PathJson(const ProbedPath& probed) {
  if (!probed.info.ok()) return {{"path", probed.path}, {"error", probed.info.status().ToString()}};
  const io::PathInfo& info = *probed.info;
  return {{"path", info.path},
          {"filesystem", info.filesystem},
          {"free_bytes", info.free_bytes},
          {"accepts_direct", info.accepts_direct},
          {"direct_reason", info.direct_reason},
          {"dio_mem_align", info.dio_mem_align},
          {"dio_offset_align", info.dio_offset_align},
          {"numa_node", probed.numa_node}};
}

nlohmann::json TopologyJson() {
  auto topology = SystemTopology();
  if (!topology.ok()) return {{"error", topology.status().ToString()}};
  nlohmann::json nodes = nlohmann::json::array();
  for (const auto& node : topology->numa_nodes()) {
    nodes.push_back(
        {{"os_index", node.os_index}, {"cpus", node.cpus}, {"memory_bytes", node.memory_bytes}});
  }
  return {{"cores", topology->cores()}, {"pus", topology->pus()}, {"numa_nodes", nodes}};
}

nlohmann::json CpuJson() {
  const optim::CpuFeatures cpu = optim::DetectCpuFeatures();
  return {{"avx2_fma_f16c", cpu.avx2_fma_f16c},
          {"avx512", cpu.avx512},
          {"avx512_bf16", cpu.avx512_bf16},
          {"optimizer_isa", optim::IsaName(optim::BestIsa(cpu))}};
}

nlohmann::json DeviceJson() {
#ifdef ZOE_HAVE_CUDA
  const bool built_with_cuda = true;
#else
  const bool built_with_cuda = false;
#endif
  nlohmann::json out = {{"built_with_cuda", built_with_cuda}};
  auto gpu = CreateDeviceBackend("cuda", 0);
  if (gpu.ok()) {
    out["gpu"] = (*gpu)->name();
    out["gpu_capacity_bytes"] = (*gpu)->capacity_bytes();
  } else {
    out["gpu"] = nullptr;
    out["device_tier"] = "host stand-in";
    out["why_no_gpu"] = std::string(gpu.status().message());
  }
  return out;
}

// NVMe bytes per parameter of each optimizer's state with a 64 MiB chunk (16 Mi parameters; the
// automatic zoe.chunk_size with 2 GiB or more of tensors' host budget), checksum blocks of 4 KiB
// and a large group (2^30 parameters), so padding at the ends of regions adds almost nothing:
// {"optimizer", "moment_dtype", "slots", "bytes"}.
nlohmann::json NvmeBytesPerParameterJson() {
  constexpr size_t kCount = size_t{1} << 30;
  constexpr size_t kChunkElements = size_t{16} << 20;
  nlohmann::json out = nlohmann::json::array();
  for (optim::Kind kind : optim::kAllKinds) {
    for (optim::DType moments : optim::kStateDTypes) {
      const offload::StateLayout layout(kind, moments, kCount, kChunkElements, 4096);
      uint64_t bytes = 0;
      for (size_t c = 0; c < layout.chunk_count(); ++c) bytes += layout.chunk(c).bytes;
      for (uint32_t slots : {2u, 1u}) {
        out.push_back({{"optimizer", optim::KindName(kind)},
                       {"moment_dtype", DTypeName(moments)},
                       {"slots", slots},
                       {"bytes", static_cast<double>(slots * bytes) / kCount}});
      }
    }
  }
  return out;
}

nlohmann::json CollectInfo(const Probes& probes) {
  nlohmann::json paths = nlohmann::json::array();
  for (const auto& path : probes.paths) paths.push_back(PathJson(path));
  return {{"schema_version", 1},
          {"version", ZOE_VERSION_STRING},
          {"io_backends", BackendsJson(probes.backends)},
          {"paths", paths},
          {"topology", TopologyJson()},
          {"cpu", CpuJson()},
          {"device", DeviceJson()},
          {"nvme_bytes_per_parameter", NvmeBytesPerParameterJson()}};
}

const char* YesNo(const nlohmann::json& flag) { return flag.get<bool>() ? "yes" : "no"; }

// The I/O part of the human output, in the same words `zoe bench io` uses.
void PrintIo(const Probes& probes) {
  std::cout << "I/O backends (tried in this order by \"auto\")\n"
            << io::FormatBackends(probes.backends) << "\n";
  for (const auto& probed : probes.paths) {
    std::cout << "Path " << probed.path << "\n"
              << (probed.info.ok() ? io::FormatPathInfo(*probed.info)
                                   : "  " + probed.info.status().ToString() + "\n")
              << "  NUMA node of its block device: "
              << (probed.numa_node >= 0 ? std::to_string(probed.numa_node) : "unknown") << "\n\n";
  }
}

void PrintTopology(const nlohmann::json& topology) {
  std::cout << "Topology\n";
  if (topology.contains("error")) {
    std::cout << "  " << topology["error"].get<std::string>() << "\n\n";
    return;
  }
  std::cout << "  " << topology["cores"] << " cores, " << topology["pus"] << " hardware threads\n";
  for (const auto& node : topology["numa_nodes"]) {
    std::cout << "  NUMA node " << node["os_index"] << ": cpus " << node["cpus"].dump() << ", "
              << node["memory_bytes"].get<uint64_t>() << " bytes\n";
  }
  std::cout << "\n";
}

void PrintCpuAndDevice(const nlohmann::json& cpu, const nlohmann::json& device) {
  std::cout << "CPU\n  AVX2+FMA+F16C: " << YesNo(cpu["avx2_fma_f16c"])
            << ", AVX-512: " << YesNo(cpu["avx512"])
            << ", AVX-512 BF16+VBMI: " << YesNo(cpu["avx512_bf16"])
            << "\n  optimizer kernels: " << cpu["optimizer_isa"].get<std::string>()
            << " (ZOE_ISA=avx2|scalar|... forces another)\n\n";
  std::cout << "Device\n  built with CUDA: " << YesNo(device["built_with_cuda"]) << "\n";
  if (device["gpu"].is_null()) {
    std::cout << "  GPU: none (" << device["why_no_gpu"].get<std::string>()
              << "); the device tier runs on the host stand-in\n";
  } else {
    std::cout << "  GPU: " << device["gpu"].get<std::string>() << ", "
              << device["gpu_capacity_bytes"].get<uint64_t>() << " bytes free\n";
  }
}

void PrintNvmeBytesPerParameter(const nlohmann::json& rows) {
  std::cout << "\nOptimizer state on NVMe, bytes per parameter (zoe.slots 2 | 1)\n";
  for (size_t i = 0; i + 1 < rows.size(); i += 2) {
    std::cout << fmt::format("  {:<8} {} moments: {:>5.2f} | {:>5.2f}\n",
                             rows[i]["optimizer"].get<std::string>(),
                             rows[i]["moment_dtype"].get<std::string>(),
                             rows[i]["bytes"].get<double>(), rows[i + 1]["bytes"].get<double>());
  }
}

void PrintHuman(const Probes& probes, const nlohmann::json& info) {
  std::cout << "zoe " << info["version"].get<std::string>() << "\n\n";
  PrintIo(probes);
  PrintTopology(info["topology"]);
  PrintCpuAndDevice(info["cpu"], info["device"]);
  PrintNvmeBytesPerParameter(info["nvme_bytes_per_parameter"]);
}

void AttachInfo(CLI::App& root) {
  auto options = std::make_shared<InfoOptions>();
  CLI::App* cmd = root.add_subcommand("info", "print what this machine offers zoe");
  cmd->add_option("--path", options->paths, "probe a directory or file (repeatable)");
  cmd->add_option("--output-format", options->output_format, "human or json")
      ->check(CLI::IsMember({"human", "json"}));
  cmd->callback([options] {
    const Probes probes = ProbeMachine(*options);
    const nlohmann::json info = CollectInfo(probes);
    if (options->output_format == "json") {
      std::cout << info.dump(2) << "\n";
    } else {
      PrintHuman(probes, info);
    }
  });
}

const CommandRegistrar kRegisterInfo{{Parent::kRoot, AttachInfo}};

}  // namespace
}  // namespace zoe::cli
