#include "offload/engine_setup.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <optional>
#include <utility>

#include "core/aligned_buffer.h"
#include "core/config.h"
#include "core/device.h"
#include "core/log.h"
#include "io/backend.h"
#include "offload/optimizer/optimizer_group_layout.h"

namespace zoe::offload {
namespace {

using Json = nlohmann::json;

constexpr uint64_t kDirectIoUnit = 4096;
constexpr double kHugeNumber = 1e300;

std::string Lower(std::string_view text) {
  std::string out(text);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

Result<optim::Kind> ParseGroupType(const std::string& text) {
  const std::string lower = Lower(text);
  Result<optim::Kind> kind = ParseOptimizerKind(lower);
  if (kind.ok()) return kind;
  const std::vector<std::string> candidates(kOptimizerKindNames.begin(), kOptimizerKindNames.end());
  const std::string closest = config::ClosestMatch(text, candidates);
  return Status::InvalidArgument(
      fmt::format("type = '{}' is not an optimizer;{} allowed: {} (any letter case)", text,
                  closest.empty() ? "" : fmt::format(" did you mean '{}'?", closest),
                  JoinNames(kOptimizerKindNames)));
}

Status ReadBetas(const Json& value, optim::HyperParams* hyper) {
  const bool pair_of_numbers =
      value.is_array() && value.size() == 2 && value[0].is_number() && value[1].is_number();
  if (!pair_of_numbers) {
    return Status::InvalidArgument(
        fmt::format("betas: expected two numbers [beta1, beta2], got {}", value.dump()));
  }
  hyper->beta1 = value[0].get<double>();
  hyper->beta2 = value[1].get<double>();
  return Status::Ok();
}

// The group document's keys, with the engine's configuration as defaults.
struct GroupDocument {
  std::string name;
  std::string type;
  std::optional<Json> betas;
  std::string moment_dtype;
  uint64_t slots = 0;      // 0: not given
  double lr_decay = -1.0;  // < 0: not given
  std::optional<Json> segments;
  bool speculative = false;
  std::string master;  // "params": the initial parameters are the master; "" or "zoe": a copy
};

Status ReadGroupDocument(const Json& document, GroupDocument* doc, GroupSpec* spec) {
  if (!document.is_object()) {
    return Status::InvalidArgument(
        fmt::format("expected a JSON object {{\"name\": ...}}, got {}", document.dump()));
  }
  optim::HyperParams& hyper = spec->hyper;
  config::ObjectReader reader(document, "");
  reader.String("name", &doc->name)
      .String("type", &doc->type)
      .Double("lr", &hyper.lr, 0.0, kHugeNumber)
      .Value("betas", &doc->betas)
      .Double("eps", &hyper.eps, 0.0, kHugeNumber)
      .Double("weight_decay", &hyper.weight_decay, 0.0, kHugeNumber)
      .Double("max_grad_norm", &spec->options.max_grad_norm, 0.0, kHugeNumber)
      .Enum("moment_dtype", &doc->moment_dtype, kMomentDTypeNames)
      .UInt("slots", &doc->slots, 1, 2)
      .Double("lr_decay", &doc->lr_decay, 0.0, kHugeNumber)
      .Value("segments", &doc->segments)
      .Bool("speculative", &doc->speculative)
      .String("master", &doc->master);
  return reader.Finish();
}

// "segments": the lengths of the group's segments, integers >= 0 (OptimizerGroupOptions).
Status ReadSegments(const Json& value, std::vector<size_t>* segments) {
  if (!value.is_array()) {
    return Status::InvalidArgument(fmt::format(
        "segments: expected a list of segment lengths (integers >= 0), got {}", value.dump()));
  }
  segments->reserve(value.size());
  for (size_t i = 0; i < value.size(); ++i) {
    if (!value[i].is_number_unsigned()) {
      return Status::InvalidArgument(fmt::format(
          "segments[{}] = {} is not a segment length; allowed: integers >= 0", i, value[i].dump()));
    }
    segments->push_back(value[i].get<size_t>());
  }
  return Status::Ok();
}

Status ApplyGroupDocument(const GroupDocument& doc, GroupSpec* spec) {
  if (doc.name.empty())
    return Status::InvalidArgument("name is missing or empty; every group needs a unique name");
  ZOE_RETURN_IF_ERROR(CheckGroupName(doc.name));
  spec->options.name = doc.name;
  spec->options.speculative = doc.speculative;
  if (doc.master != "" && doc.master != "zoe" && doc.master != "params") {
    return Status::InvalidArgument(fmt::format(
        "master = '{}' is not allowed; allowed: 'zoe' (a copy in the group's state, the default) "
        "or 'params' (the initial fp32 parameters are the master, borrowed for the group's life)",
        doc.master));
  }
  spec->options.master_in_params = doc.master == "params";
  if (!doc.type.empty()) {
    ZOE_ASSIGN_OR_RETURN(spec->options.kind, ParseGroupType(doc.type));
  }
  spec->hyper.kind = spec->options.kind;
  if (doc.betas) ZOE_RETURN_IF_ERROR(ReadBetas(*doc.betas, &spec->hyper));
  if (doc.segments) ZOE_RETURN_IF_ERROR(ReadSegments(*doc.segments, &spec->options.segments));
  if (!doc.moment_dtype.empty()) {
    // One of kMomentDTypeNames (the reader checked), each also a name ParseDType accepts.
    ZOE_ASSIGN_OR_RETURN(spec->options.state_dtype, ParseDType(doc.moment_dtype));
  }
  if (doc.slots != 0) spec->options.slots = static_cast<uint32_t>(doc.slots);
  if (doc.lr_decay >= 0.0) {
    if (spec->options.kind != optim::Kind::kAdagrad) {
      return Status::InvalidArgument(fmt::format("lr_decay applies to adagrad only; type is '{}'",
                                                 optim::KindName(spec->options.kind)));
    }
    spec->hyper.lr_decay = doc.lr_decay;
  }
  if (spec->options.kind != optim::Kind::kAdagrad) spec->hyper.lr_decay = 0.0;
  return optim::ValidateHyperParams(spec->hyper);
}

// Placement, pipeline and chunking from zero_optimization and zoe.
void ApplyPlacement(const config::EngineConfig& config, size_t count, GroupSpec* spec) {
  const config::OffloadOptimizerConfig& offload = config.zero.offload_optimizer;
  OptimizerGroupOptions& options = spec->options;
  const bool on_nvme = offload.device == config::OffloadDevice::kNvme && offload.ratio > 0.0;
  options.placement = on_nvme ? Tier::kNvme : Tier::kHost;
  options.nvme_ratio = on_nvme ? offload.ratio : 1.0;
  options.buffer_count = static_cast<uint32_t>(offload.buffer_count == 0
                                                   ? kMinAutoBufferCount
                                                   : std::max<uint64_t>(2, offload.buffer_count));
  const uint64_t sub_group =
      config.zero.sub_group_size != 0 ? config.zero.sub_group_size : ChunkSizeOf(config.zoe) / 4;
  options.chunk_elements = static_cast<size_t>(std::clamp<uint64_t>(sub_group, 1, count));
  options.count = count;
}

// zoe.device: "cuda" is CUDA or an error; "host" the stand-in; "auto" CUDA when a device is
// present, else the stand-in. The stand-in has no memory of its own to measure, so an automatic
// (0) device budget gives it `stand_in_bytes`.
std::function<Result<std::unique_ptr<DeviceBackend>>()> MakeDeviceFactory(
    config::ComputeDevice device, uint64_t budget, uint64_t stand_in_bytes) {
  return [device, budget, stand_in_bytes]() -> Result<std::unique_ptr<DeviceBackend>> {
    const uint64_t stand_in_budget = budget != 0 ? budget : stand_in_bytes;
    if (device == config::ComputeDevice::kHost) return CreateDeviceBackend("host", stand_in_budget);
    Result<std::unique_ptr<DeviceBackend>> cuda = CreateDeviceBackend("cuda", budget);
    const bool fall_back = device == config::ComputeDevice::kAuto && !cuda.ok() &&
                           cuda.status().code() == StatusCode::kNotSupported;
    if (!fall_back) return cuda;
    ZOE_LOG_INFO("engine: device tier on the host stand-in ({} bytes): {}", stand_in_budget,
                 cuda.status().message());
    return CreateDeviceBackend("host", stand_in_budget);
  };
}

// The group's key deciding each auto key path of the configuration that groups decide.
constexpr std::array<std::pair<std::string_view, std::string_view>, 5> kAutoGroupKeys = {{
    {"optimizer.params.lr", "lr"},
    {"optimizer.params.betas", "betas"},
    {"optimizer.params.eps", "eps"},
    {"optimizer.params.weight_decay", "weight_decay"},
    {"gradient_clipping", "max_grad_norm"},
}};

Json GroupValue(const GroupSpec& spec, std::string_view group_key) {
  if (group_key == "lr") return spec.hyper.lr;
  if (group_key == "betas") return Json{spec.hyper.beta1, spec.hyper.beta2};
  if (group_key == "eps") return spec.hyper.eps;
  if (group_key == "weight_decay") return spec.hyper.weight_decay;
  return spec.options.max_grad_norm;
}

// What the group chose for each of the configuration's "auto" keys, and where it came from.
Json AutoValues(const config::EngineConfig& config, const Json& document, const GroupSpec& spec) {
  Json out = Json::object();
  for (const auto& [path, group_key] : kAutoGroupKeys) {
    const auto& keys = config.auto_keys;
    if (std::find(keys.begin(), keys.end(), path) == keys.end()) continue;
    const bool given = document.contains(group_key) && !document[std::string(group_key)].is_null();
    out[std::string(path)] = {{"value", GroupValue(spec, group_key)},
                              {"from", given ? "optimizer group" : "zoe default"}};
  }
  return out;
}

}  // namespace

HostBudgets ResolveHostBudgets(const config::ZoeConfig& zoe, uint64_t usable_bytes) {
  HostBudgets budgets;
  budgets.total = zoe.host_budget != 0 ? zoe.host_budget : std::max<uint64_t>(usable_bytes / 2, 2);
  budgets.tensors = zoe.tensor_host_budget != 0 ? zoe.tensor_host_budget : budgets.total / 2;
  // With an automatic total, an explicit tensor share may exceed it: the total grows to give the
  // optimizer the same share as the tensors would have left it.
  if (budgets.tensors >= budgets.total) budgets.total = budgets.tensors * 2;
  budgets.optimizer = budgets.total - budgets.tensors;
  return budgets;
}

uint64_t HostBudgetForOptimizer(const config::ZoeConfig& zoe, uint64_t optimizer_bytes) {
  if (zoe.tensor_host_budget != 0) return zoe.tensor_host_budget + optimizer_bytes;
  // The tensors take total / 2, rounded down; the optimizer the rest, at least half.
  return std::max<uint64_t>(2 * optimizer_bytes, 3) - 1;
}

uint64_t AutoChunkSize(uint64_t tensor_budget) {
  const uint64_t share = tensor_budget / kAutoChunksInHostBudget;
  const uint64_t power = share == 0 ? 0 : std::bit_floor(share);
  return std::clamp(power, kMinAutoChunkSize, kMaxAutoChunkSize);
}

Status EnsureSwapDirectories(const std::vector<std::string>& paths) {
  for (const std::string& path : paths) {
    std::error_code error;
    const bool created = std::filesystem::create_directories(path, error);
    if (!error && std::filesystem::is_directory(path, error)) {
      // A warning: a path that did not exist may be a typo, and this shows where swap now goes.
      if (created) ZOE_LOG_WARN("engine: swap directory {} did not exist; created it", path);
      continue;
    }
    const std::string what = fmt::format(
        "swap directory '{}' (from zoe.nvme_paths or an nvme_path of "
        "zero_optimization.offload_optimizer / offload_param)",
        path);
    if (error) return Status::FromErrno(-error.value(), "create " + what);
    return Status::InvalidArgument(what + " exists and is not a directory; give a directory");
  }
  return Status::Ok();
}

uint64_t TensorChecksumBlock(const config::EngineConfig& config) {
  if (!config.zoe.checksum) return 0;
  const uint64_t block = config.aio.block_size;
  if (block != 0 && config.zoe.chunk_size % block == 0) return block;
  return kDirectIoUnit;
}

Result<TierManagerOptions> MakeTierManagerOptions(const config::EngineConfig& config,
                                                  std::vector<std::string> nvme_paths,
                                                  const HostBudgets& budgets) {
  const config::ZoeConfig& zoe = config.zoe;
  TierManagerOptions options;
  options.device_budget_bytes = zoe.device_budget;
  options.device_factory = MakeDeviceFactory(zoe.device, zoe.device_budget, budgets.tensors);
  options.host_budget_bytes = budgets.tensors;
  options.layout.chunk_bytes = zoe.chunk_size;
  options.nvme_paths = std::move(nvme_paths);
  const bool automatic_swap = zoe.tensor_swap_bytes == 0;
  options.nvme_capacity_bytes =
      automatic_swap ? config::kAutoTensorSwapBytes : zoe.tensor_swap_bytes;
  options.nvme_growth_bytes = automatic_swap ? config::kAutoTensorSwapBytes : 0;
  options.nvme_capacity_key = "zoe.tensor_swap_bytes";
  ZOE_ASSIGN_OR_RETURN(options.io_backend, io::ParseBackend(config.aio.backend));
  options.queue_depth = static_cast<uint32_t>(config.aio.queue_depth);
  options.checksum_block = TensorChecksumBlock(config);
  options.stripe_unit = zoe.stripe_unit;
  options.use_direct = config.aio.use_direct;
  options.lookahead_bytes = zoe.trace.lookahead_bytes;
  options.prefetch_in_flight = static_cast<uint32_t>(zoe.trace.max_inflight);
  options.trace_cursor.rerecord_min_mismatches = zoe.trace.mismatch_limit;
  options.eviction = zoe.eviction;
  return options;
}

Result<GroupSpec> ParseGroupSpec(std::string_view json_text, const config::EngineConfig& config,
                                 size_t count) {
  if (count == 0)
    return Status::InvalidArgument("a group needs at least one parameter; the views hold none");
  GroupSpec spec;
  spec.options.kind = config.optimizer.kind;
  // The parser admits only kMomentDTypes; a configuration built in code is checked here.
  ZOE_RETURN_IF_ERROR(CheckMomentDType(config.zoe.moment_dtype, "zoe.moment_dtype"));
  spec.options.state_dtype = config.zoe.moment_dtype;
  spec.options.max_grad_norm = config.gradient_clipping;
  spec.options.run.arithmetic = config.zoe.arithmetic;
  spec.options.run.stores = config.zoe.stores;
  spec.options.slots = static_cast<uint32_t>(config.zoe.slots);
  spec.hyper = config.optimizer;
  ZOE_ASSIGN_OR_RETURN(const Json document, config::ParseJson(json_text));
  GroupDocument doc;
  ZOE_RETURN_IF_ERROR(ReadGroupDocument(document, &doc, &spec));
  ZOE_RETURN_IF_ERROR(ApplyGroupDocument(doc, &spec));
  ApplyPlacement(config, count, &spec);
  spec.auto_values = AutoValues(config, document, spec);
  return spec;
}

namespace {

StateLayout LayoutOf(const OptimizerGroupOptions& options, uint64_t io_block) {
  std::vector<size_t> segment_ends;  // int8 moments: segment starts split quantization blocks
  size_t end = 0;
  for (size_t length : options.segments) segment_ends.push_back(end += length);
  return StateLayout(options.kind, options.state_dtype, options.count, options.chunk_elements,
                     io_block, segment_ends);
}

// At least as many chunks as the group puts on NVMe, however it rounds the ratio (rounding
// `up`), or at most as many (rounding down).
size_t NvmeChunksBound(const OptimizerGroupOptions& options, size_t chunks, bool up) {
  if (options.placement != Tier::kNvme) return 0;
  const double exact = options.nvme_ratio * static_cast<double>(chunks);
  const double rounded = up ? std::max(std::ceil(exact), 1.0) : std::floor(exact);
  return std::min(chunks, static_cast<size_t>(rounded));
}

}  // namespace

uint64_t GroupPinnedBytes(const OptimizerGroupOptions& options, uint64_t page) {
  if (options.count == 0 || options.chunk_elements == 0) return 0;
  const StateLayout layout = LayoutOf(options, kDirectIoUnit);
  const uint64_t chunk = AlignUp(layout.max_chunk_bytes(), page);
  const size_t nvme_chunks = NvmeChunksBound(options, layout.chunk_count(), /*up=*/false);
  const size_t host_chunks = layout.chunk_count() - nvme_chunks;
  const size_t buffers =
      std::min<size_t>(options.buffer_count, NvmeChunksBound(options, layout.chunk_count(), true));
  return buffers * chunk + host_chunks * chunk * (options.speculative ? 2 : 1);
}

size_t LargestChunkWithin(OptimizerGroupOptions options, uint64_t limit, uint64_t page,
                          size_t floor) {
  for (;;) {
    if (GroupPinnedBytes(options, page) <= limit) return options.chunk_elements;
    if (options.chunk_elements <= std::max<size_t>(floor, 1)) return 0;
    options.chunk_elements = std::max(std::max<size_t>(floor, 1), options.chunk_elements / 2);
  }
}

bool FitAutoSubGroup(const config::EngineConfig& config, uint64_t pinned_free, uint64_t page,
                     OptimizerGroupOptions* options) {
  if (config.zero.sub_group_size != 0 || options->placement != Tier::kNvme) return false;
  const size_t chosen = options->chunk_elements;
  const size_t floor = std::min(chosen, kMinAutoChunkElements);
  const size_t fitting = LargestChunkWithin(*options, pinned_free / 2, page, floor);
  options->chunk_elements = fitting != 0 ? fitting : floor;
  if (options->chunk_elements == chosen) return false;
  ZOE_LOG_INFO(
      "optimizer group '{}': sub-groups of {} elements (zero_optimization.sub_group_size is "
      "automatic) so that its {} pinned bytes fit the {} free in the optimizer pool",
      options->name, options->chunk_elements, GroupPinnedBytes(*options, page), pinned_free);
  return true;
}

bool FitAutoBufferCount(const config::EngineConfig& config, uint64_t pinned_free, uint64_t page,
                        OptimizerGroupOptions* options) {
  if (config.zero.offload_optimizer.buffer_count != 0 || options->placement != Tier::kNvme)
    return false;
  const size_t chosen = options->buffer_count;
  const size_t nvme_chunks =
      NvmeChunksBound(*options, LayoutOf(*options, kDirectIoUnit).chunk_count(), /*up=*/true);
  OptimizerGroupOptions more = *options;
  while (more.buffer_count < std::min<size_t>(nvme_chunks, kMaxAutoBufferCount)) {
    ++more.buffer_count;
    if (GroupPinnedBytes(more, page) > pinned_free / kAutoBufferShare) break;
    options->buffer_count = more.buffer_count;
  }
  if (options->buffer_count == chosen) return false;
  ZOE_LOG_INFO(
      "optimizer group '{}': {} pipeline buffers (zero_optimization.offload_optimizer."
      "buffer_count is automatic), so that its {} NVMe chunks are read while their gradients "
      "arrive; {} pinned bytes of the {} free in the optimizer pool",
      options->name, options->buffer_count, nvme_chunks, GroupPinnedBytes(*options, page),
      pinned_free);
  return true;
}

uint64_t GroupSwapBytes(const OptimizerGroupOptions& options, uint64_t io_block) {
  if (options.placement != Tier::kNvme || options.count == 0 || options.chunk_elements == 0)
    return 0;
  const StateLayout layout = LayoutOf(options, io_block);
  const size_t nvme_chunks = NvmeChunksBound(options, layout.chunk_count(), /*up=*/true);
  uint64_t bytes = 0;
  for (size_t i = 0; i < nvme_chunks; ++i) {
    const uint64_t extent = layout.chunk(i).bytes;
    bytes += options.slots * ((extent + kDirectIoUnit - 1) / kDirectIoUnit * kDirectIoUnit);
  }
  return bytes;
}

}  // namespace zoe::offload
