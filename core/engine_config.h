// EngineConfig: the one JSON document that configures an engine (zoe_engine_create, the Python
// binding). Its shape is DeepSpeed's, so a DeepSpeed ZeRO-Infinity config is accepted as it is:
//  - DeepSpeed keys zoe acts on (zero_optimization.stage and its offload_optimizer/offload_param
//    sections, optimizer, gradient_clipping, fp16, bf16, aio) are parsed into typed fields;
//  - DeepSpeed keys the engine reads no value from are accepted from the lists of
//    core/engine_config_deepspeed.h, left unvalidated, and their dotted paths recorded so the
//    engine can log them once: in EngineConfig::ignored_keys those zoe has no use for (monitors,
//    communication knobs, ...), in EngineConfig::framework_keys those the framework integration
//    reads (batch sizes, the schedule, gradient buckets); a DeepSpeed switch for a feature that
//    changes training and that zoe does not implement (amp, elasticity, ...) is accepted while
//    off and refused when on;
//  - the document may hold the non-finite numbers Python's json module writes (NaN, Infinity),
//    which only keys zoe ignores accept;
//  - "auto", which Hugging Face's DeepSpeed integration writes for values the framework decides,
//    is accepted where it writes it (core/engine_config_auto.h): the value stays zoe's default
//    and the key's path is recorded in EngineConfig::auto_keys;
//  - zoe's own options live under a top-level "zoe" object;
//  - any other key, anywhere, is an error naming its dotted path and the closest valid key.
// docs/configuration.md lists every key with its type, default and range.
#pragma once

#include <array>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "core/config.h"
#include "core/hyper_params.h"
#include "core/result.h"
#include "core/vocabulary.h"

namespace zoe::config {

// Where a DeepSpeed offload section puts its tensors.
enum class OffloadDevice { kNone, kCpu, kNvme };
// The device backend (core/device.h): CUDA when a GPU is found, else the host stand-in.
enum class ComputeDevice { kAuto, kCuda, kHost };

// The names used in the document: "none"/"cpu"/"nvme", "auto"/"cuda"/"host". The optimizer type,
// "arithmetic", "stores", "eviction" and "moment_dtype" take the names of core/vocabulary.h.
std::string_view OffloadDeviceName(OffloadDevice device);
std::string_view ComputeDeviceName(ComputeDevice device);

// zero_optimization.offload_optimizer (DeepSpeed's keys and defaults, except the device: zoe
// offloads the optimizer to pinned DRAM unless told otherwise).
struct OffloadOptimizerConfig {
  OffloadDevice device = OffloadDevice::kCpu;
  std::string nvme_path;  // empty: none given (zoe.nvme_paths may supply the directories)
  bool pin_memory = false;
  uint64_t buffer_count = 0;  // 0: automatic (offload/engine_setup.h FitAutoBufferCount); 1..1024
  bool fast_init = false;
  double ratio =
      1.0;  // fraction of the optimizer state offloaded, 0..1 (DeepSpeed's partial offload)

  bool operator==(const OffloadOptimizerConfig&) const = default;
};

// zero_optimization.offload_param (DeepSpeed's keys and defaults; counts are in elements). Below
// stage 3 the section has no effect: the parser leaves these defaults and records a warning.
struct OffloadParamConfig {
  OffloadDevice device = OffloadDevice::kNone;
  std::string nvme_path;
  bool pin_memory = false;
  uint64_t buffer_count = 5;            // 1..1024
  uint64_t buffer_size = 100'000'000;   // elements per buffer, 1..2^40
  uint64_t max_in_cpu = 1'000'000'000;  // elements kept in DRAM when offloading to NVMe, 0..2^50

  bool operator==(const OffloadParamConfig&) const = default;
};

struct ZeroConfig {
  uint64_t stage = 3;  // 0..3; offload_param takes effect at 3 only
  // Parameters per optimizer sub-group: the unit the offloaded optimizer step reads, updates and
  // writes (OptimizerGroupOptions::chunk_elements). 0: derived from zoe.chunk_size (chunk_size / 4,
  // a sub-group whose fp32 master weights fill one chunk). Any larger size than a group's makes
  // the group one sub-group.
  uint64_t sub_group_size = 0;
  OffloadOptimizerConfig offload_optimizer;
  OffloadParamConfig offload_param;

  bool operator==(const ZeroConfig&) const = default;
};

// "fp16": dynamic loss scaling unless loss_scale > 0 (then a static scale).
struct Fp16Config {
  bool enabled = false;
  double loss_scale = 0.0;            // 0: dynamic; > 0: static scale
  uint64_t initial_scale_power = 16;  // dynamic scaling starts at 2^power, 0..63
  uint64_t loss_scale_window = 1000;  // overflow-free steps before the scale doubles, >= 1
  uint64_t hysteresis = 2;            // overflows tolerated before the scale halves, >= 1
  bool consecutive_hysteresis = false;
  double min_loss_scale = 1.0;  // > 0

  bool operator==(const Fp16Config&) const = default;
};

struct Bf16Config {
  bool enabled = false;

  bool operator==(const Bf16Config&) const = default;
};

// zoe.trace: prefetching driven by the recorded trace.
struct TraceConfig {
  uint64_t lookahead_bytes = uint64_t{256} << 20;  // bytes of upcoming chunks prefetched; 0: off
  uint64_t max_inflight = 8;                       // prefetches in flight at once, 1..1024
  uint64_t mismatch_limit = 16;  // mismatches in one iteration that trigger a re-record, >= 1

  bool operator==(const TraceConfig&) const = default;
};

// The top-level "zoe" object.
struct ZoeConfig {
  ComputeDevice device = ComputeDevice::kAuto;
  uint64_t device_budget = 0;  // bytes of device memory zoe may use; 0: automatic
  uint64_t host_budget = 0;    // bytes of pinned DRAM zoe may hold; 0: automatic
  // The part of host_budget that holds registered tensors (the tier manager's HOST tier); the
  // rest holds the optimizer groups' state and pipeline buffers. 0: half of host_budget. Less than
  // host_budget when both are given.
  uint64_t tensor_host_budget = 0;
  // Bytes of NVMe swap space for registered tensors, reserved when the engine is created and
  // fixed; 0: automatic, kAutoTensorSwapBytes at first, grown as registrations need.
  uint64_t tensor_swap_bytes = 0;
  // Directories a swap space is striped over. After parsing: the given list, else the nvme_path
  // of each offload section whose device is nvme (distinct, optimizer's first); may be empty only
  // when nothing is offloaded to NVMe.
  std::vector<std::string> nvme_paths;
  uint64_t stripe_unit = uint64_t{1} << 20;  // bytes per directory before the next, 4 KiB multiple
  // Bytes of one chunk, the unit tiers move; 0: automatic (offload::AutoChunkSize, from the
  // tensors' HOST budget), resolved when the engine is created.
  uint64_t chunk_size = 0;
  bool checksum = true;                        // xxh3 per block on NVMe, verified on read
  Arithmetic arithmetic = Arithmetic::kExact;  // of the CPU optimizer kernels (optim/chunk.h)
  StoreMode stores = StoreMode::kCached;       // how those kernels write (optim/chunk.h)
  // NVMe extents per optimizer chunk: 2 makes every step atomic; 1 updates the state in place,
  // halving the NVMe space, and a step that fails mid-way leaves the group refusing work until a
  // checkpoint is loaded (OptimizerGroupOptions::slots).
  uint64_t slots = 2;
  std::string log_level;  // empty: ZOE_LOG_LEVEL, else info
  TraceConfig trace;
  EvictionKind eviction = EvictionKind::kOpt;
  // Element type of the optimizer's moments in every tier: one of kMomentDTypes.
  DType moment_dtype = DType::kFloat32;
  // Whether zoe.torch's optimizers built from this configuration speculate in their device param
  // groups. The engine does not act on it: a C API group speculates when its own "speculative"
  // says so (zoe_optim_group_create).
  bool speculative = false;

  bool operator==(const ZoeConfig&) const = default;
};

// The first size, and the least growth, of an automatic zoe.tensor_swap_bytes.
inline constexpr uint64_t kAutoTensorSwapBytes = uint64_t{1} << 30;

struct EngineConfig {
  ZeroConfig zero;  // "zero_optimization"
  // "optimizer": {"type" (-> kind), "params"}. DeepSpeed's "Adam" is AdamW unless
  // params.adam_w_mode is false; "AdamW" is AdamW whatever adam_w_mode says. Ranges are those of
  // optim::ValidateHyperParams.
  HyperParams optimizer;
  double gradient_clipping = 0.0;  // global gradient norm bound; 0: no clipping
  Fp16Config fp16;
  Bf16Config bf16;
  AioConfig aio;  // aio.checksum always equals zoe.checksum after parsing
  ZoeConfig zoe;
  // Dotted paths of the DeepSpeed keys present in the document and ignored, sorted. Not part of
  // the effective configuration: ToJson does not print them.
  std::vector<std::string> ignored_keys;
  // Dotted paths of the DeepSpeed keys present that the framework integration reads and the
  // engine does not (train_batch_size, scheduler, ...), sorted; not printed by ToJson either.
  std::vector<std::string> framework_keys;
  // Settings accepted that take no effect (offload_param below stage 3), one sentence each, for
  // the engine to log as warnings; not printed by ToJson.
  std::vector<std::string> warnings;
  // Dotted paths of the keys given as "auto" (decided by the framework), sorted. Their fields
  // above keep zoe's defaults; ToJson prints these paths under the top-level "auto" list.
  std::vector<std::string> auto_keys;

  bool operator==(const EngineConfig&) const = default;
};

// Parses and validates a whole document. "{}" gives the defaults above. Errors are
// InvalidArgument and name the dotted key path, the value and what is allowed.
Result<EngineConfig> ParseEngineConfig(std::string_view json_text);
// The same for a document already parsed (built in code, or read by another JSON reader).
Result<EngineConfig> ParseEngineConfigDocument(const nlohmann::json& document);

// The effective configuration as a document ParseEngineConfig accepts and maps back to the same
// EngineConfig (less ignored_keys, framework_keys and warnings). Sizes are printed in bytes.
nlohmann::json ToJson(const EngineConfig& config);

// "ignored DeepSpeed keys: a, b.c" for the engine's log, or empty when none were ignored.
std::string DescribeIgnoredKeys(const EngineConfig& config);

// "DeepSpeed keys for the framework (...): scheduler, train_batch_size" for the engine's log, or
// empty when there are none.
std::string DescribeFrameworkKeys(const EngineConfig& config);

}  // namespace zoe::config
