// How an EngineConfig becomes the parts of an Engine: the tier manager's options, the split of the
// host budget, and the options of each optimizer group (from the engine's configuration and the
// group's own JSON document).
//
// Host budget. zoe.host_budget bounds all pinned DRAM the engine holds (0: half of the machine's
// physical memory). Registered tensors (the tier manager's HOST tier) get zoe.tensor_host_budget
// of it (0: half); the optimizer groups' state and pipeline buffers share the rest.
//
// Optimizer placement (zero_optimization.offload_optimizer):
//   device "nvme" with ratio > 0  -> Tier::kNvme, nvme_ratio = ratio (the other chunks in HOST);
//   device "cpu", "none", or ratio 0 -> Tier::kHost (groups always step on the CPU, so "none"
//   keeps the state in DRAM too).
// buffer_count -> OptimizerGroupOptions::buffer_count (at least 2: one chunk is updated while the
// next is read; 0: automatic, FitAutoBufferCount); sub_group_size -> chunk_elements (0:
// zoe.chunk_size / 4), never more than the group's parameters.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/engine_config.h"
#include "core/result.h"
#include "offload/optimizer/optimizer_group.h"
#include "offload/paging/tier_manager.h"
#include "optim/chunk.h"

namespace zoe::offload {

struct HostBudgets {
  uint64_t total = 0;
  uint64_t tensors = 0;    // the tier manager's HOST budget
  uint64_t optimizer = 0;  // the optimizer groups' pinned pool
};

// Resolves the automatic values (0) of zoe.host_budget and zoe.tensor_host_budget: half of
// `usable_bytes`, the memory the process may take (MemoryLimits::usable_bytes: the machine's
// available memory, or less the room under a memory cgroup's limit). Both shares are > 0.
HostBudgets ResolveHostBudgets(const config::ZoeConfig& zoe, uint64_t usable_bytes);

// The smallest zoe.host_budget that ResolveHostBudgets splits into an optimizer share of at least
// `optimizer_bytes`, zoe.tensor_host_budget staying as configured (automatic: half the total).
uint64_t HostBudgetForOptimizer(const config::ZoeConfig& zoe, uint64_t optimizer_bytes);

// The automatic zoe.chunk_size (chunk_size 0): the largest power of two that is at most
// 1/kAutoChunksInHostBudget of the tensors' HOST budget, within [1 MiB, 64 MiB]. The HOST tier
// then holds that many chunks (a layer's parameters, its gradient, prefetches ahead) rather than
// a few, and the automatic sub-group (chunk_size / 4 parameters) scales with it.
inline constexpr uint64_t kAutoChunksInHostBudget = 32;
inline constexpr uint64_t kMinAutoChunkSize = uint64_t{1} << 20;
inline constexpr uint64_t kMaxAutoChunkSize = uint64_t{64} << 20;
uint64_t AutoChunkSize(uint64_t tensor_budget);
// zoe.chunk_size as an engine resolves it; for a configuration no engine resolved (chunk_size 0),
// the largest automatic size.
inline uint64_t ChunkSizeOf(const config::ZoeConfig& zoe) {
  return zoe.chunk_size != 0 ? zoe.chunk_size : kMaxAutoChunkSize;
}

// Creates each of `paths` that does not exist yet, with its parents (as DeepSpeed creates its
// nvme_path). A path that exists but is not a directory, or that cannot be created, is an error
// naming it and the configuration keys that give swap directories.
Status EnsureSwapDirectories(const std::vector<std::string>& paths);

// An upper bound of the pinned bytes a group with `options` takes from the optimizer pool (whose
// pages are `page` bytes): its pipeline buffers, one chunk each, and its HOST chunks (twice for a
// speculative group).
uint64_t GroupPinnedBytes(const OptimizerGroupOptions& options, uint64_t page);

// The largest of options.chunk_elements / 2^k (k >= 0), at least `floor`, with which the group
// takes at most `limit` pinned bytes (GroupPinnedBytes); 0 when none does.
size_t LargestChunkWithin(OptimizerGroupOptions options, uint64_t limit, uint64_t page,
                          size_t floor);

// With an automatic sub-group size (zero_optimization.sub_group_size 0) on NVMe, halves
// options->chunk_elements until the group's pinned bytes fit in half of `pinned_free`, down to
// kMinAutoChunkElements, so that a small host budget gives smaller chunks rather than a refusal.
// A sub-group size the user set is kept. Returns whether the size changed.
inline constexpr size_t kMinAutoChunkElements = size_t{1} << 18;
bool FitAutoSubGroup(const config::EngineConfig& config, uint64_t pinned_free, uint64_t page,
                     OptimizerGroupOptions* options);

// With an automatic buffer count (zero_optimization.offload_optimizer.buffer_count 0, the
// default) on NVMe: kMinAutoBufferCount pipeline buffers, raised towards one per NVMe chunk (at
// most kMaxAutoBufferCount) while the group's pinned bytes stay within 1/kAutoBufferShare of
// `pinned_free`. A chunk's state is read as soon as its gradients are complete and holds its
// buffer until the step, so with a buffer per chunk the whole state is read while backward
// runs. A buffer count the user set is kept (at least 2). Returns whether the count changed.
inline constexpr size_t kMinAutoBufferCount = 4;  // DeepSpeed's default
inline constexpr size_t kMaxAutoBufferCount = 64;
inline constexpr uint64_t kAutoBufferShare = 4;
bool FitAutoBufferCount(const config::EngineConfig& config, uint64_t pinned_free, uint64_t page,
                        OptimizerGroupOptions* options);

// The checksum block of swap files when zoe.checksum is on: aio.block_size where it divides the
// chunk size, else 4096; 0 when checksums are off.
uint64_t TensorChecksumBlock(const config::EngineConfig& config);

// The tier manager's options. `nvme_paths`: the swap directories (the configured ones, or a
// private temporary directory when none is configured).
Result<TierManagerOptions> MakeTierManagerOptions(const config::EngineConfig& config,
                                                  std::vector<std::string> nvme_paths,
                                                  const HostBudgets& budgets);

// An optimizer group as its JSON document and the engine's configuration describe it.
struct GroupSpec {
  OptimizerGroupOptions options;
  optim::HyperParams hyper;  // the group's initial hyper-parameters (kind = options.kind)
  // For each key the configuration gave as "auto" that a group decides (optimizer.params.*,
  // gradient_clipping): {"value": what the group uses, "from": "optimizer group" when its
  // document gave it (zoe.torch: the optimizer's constructor), else "zoe default"}.
  nlohmann::json auto_values = nlohmann::json::object();
};

// Parses the group document {"name", "type", "lr", "betas", "eps", "weight_decay",
// "max_grad_norm", "moment_dtype", "lr_decay", "segments"} (all but "name" optional; defaults from
// the configuration's optimizer section, gradient_clipping and zoe.moment_dtype) for a group of
// `count` parameters. "type" is "adamw", "adam" (torch's Adam: L2 weight decay), "adagrad" or
// "lion" in any letter case. Unknown keys are InvalidArgument naming the closest valid key.
Result<GroupSpec> ParseGroupSpec(std::string_view json_text, const config::EngineConfig& config,
                                 size_t count);

// Swap bytes that hold the NVMe chunks of a group with `options` (every slot of every chunk that
// may be placed on NVMe), with extents rounded to `io_block`. 0 for a HOST group.
uint64_t GroupSwapBytes(const OptimizerGroupOptions& options, uint64_t io_block);

}  // namespace zoe::offload
