#include "core/engine_config.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <filesystem>
#include <limits>
#include <optional>
#include <utility>

#include "core/engine_config_auto.h"
#include "core/engine_config_deepspeed.h"
#include "core/engine_config_pydantic.h"

namespace zoe::config {
namespace {

using Json = nlohmann::json;

// Bounds for numbers that have no natural maximum; JSON has no infinity, so a finite bound keeps
// every accepted value printable by ToJson.
constexpr double kHugeNumber = 1e300;
constexpr uint64_t kMaxBudget = uint64_t{1} << 50;      // 1 PiB
constexpr uint64_t kMaxChunkSize = uint64_t{16} << 30;  // 16 GiB
constexpr uint64_t kDirectIoUnit = 4096;

// Names in the document, indexed by the enum's value.
constexpr std::array<std::string_view, 3> kOffloadDevices = {"none", "cpu", "nvme"};
constexpr std::array<std::string_view, 3> kComputeDevices = {"auto", "cuda", "host"};
constexpr std::array<std::string_view, 7> kLogLevels = {"trace", "debug",    "info", "warn",
                                                        "error", "critical", "off"};

// Optimizers DeepSpeed (or torch.optim, which DeepSpeed falls back to) knows and zoe does not
// implement, lower-case: named as such in the error instead of being treated as typos.
constexpr std::array<std::string_view, 9> kUnsupportedOptimizers = {
    "lamb",    "onebitadam", "zerooneadam", "onebitlamb", "muadam",
    "muadamw", "musgd",      "sgd",         "adamax"};

std::string Lower(std::string_view text) {
  std::string out(text);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// Reads `key` as one of `names` into the enum whose values index `names`.
template <class Enum, size_t N>
void ReadEnum(ObjectReader& reader, std::string_view key, Enum* out,
              const std::array<std::string_view, N>& names) {
  std::string text(NameIn(names, *out));
  reader.Enum(key, &text, names);  // leaves `text` alone when absent or invalid
  *out = static_cast<Enum>(std::find(names.begin(), names.end(), text) - names.begin());
}

// Reads `key` as one of kMomentDTypeNames into `out`.
void ReadMomentDType(ObjectReader& reader, std::string_view key, DType* out) {
  std::string text(DTypeName(*out));
  reader.Enum(key, &text, kMomentDTypeNames);  // leaves `text` alone when absent or invalid
  *out = *ParseDType(text);                    // one of kMomentDTypeNames, which ParseDType accepts
}

std::string KeyPath(const ObjectReader& reader, std::string_view key) {
  return reader.path().empty() ? std::string(key) : fmt::format("{}.{}", reader.path(), key);
}

// ---------------------------------------------------------------------------------------------
// zero_optimization

Status ReadOffloadOptimizer(ObjectReader& reader, OffloadOptimizerConfig* out,
                            const AcceptedKeys& keys) {
  ReadEnum(reader, "device", &out->device, kOffloadDevices);
  reader.String("nvme_path", &out->nvme_path)
      .Bool("pin_memory", &out->pin_memory)
      .UInt("buffer_count", &out->buffer_count, 0, 1024)
      .Bool("fast_init", &out->fast_init)
      .Double("ratio", &out->ratio, 0.0, 1.0);
  AcceptDeepSpeedKeys(reader, DeepSpeedSection::kOffloadOptimizer, keys);
  return reader.Finish();
}

Status ReadOffloadParam(ObjectReader& reader, OffloadParamConfig* out) {
  ReadEnum(reader, "device", &out->device, kOffloadDevices);
  reader.String("nvme_path", &out->nvme_path)
      .Bool("pin_memory", &out->pin_memory)
      .UInt("buffer_count", &out->buffer_count, 1, 1024)
      .UInt("buffer_size", &out->buffer_size, 1, uint64_t{1} << 40)
      .UInt("max_in_cpu", &out->max_in_cpu, 0, uint64_t{1} << 50);
  return reader.Finish();
}

Status ReadZero(ObjectReader& reader, ZeroConfig* out, const AcceptedKeys& keys) {
  // Checked across sections (CheckLoadFromFp32Weights), which read it from the document.
  bool load_from_fp32_weights = true;
  // Any size: one larger than a group makes the group one sub-group, as in DeepSpeed (Hugging
  // Face's tests write 1e14).
  reader.UInt("stage", &out->stage, 0, 3)
      .Bool("load_from_fp32_weights", &load_from_fp32_weights)
      .UInt("sub_group_size", &out->sub_group_size, 0, std::numeric_limits<uint64_t>::max())
      .Object(
          "offload_optimizer",
          [&](ObjectReader& r) { return ReadOffloadOptimizer(r, &out->offload_optimizer, keys); })
      .Object("offload_param",
              [&](ObjectReader& r) { return ReadOffloadParam(r, &out->offload_param); })
      .Alias("stage3_gather_fp16_weights_on_model_save",
             "stage3_gather_16bit_weights_on_model_save");
  AcceptDeepSpeedKeys(reader, DeepSpeedSection::kZero, keys);
  return reader.Finish();
}

// ---------------------------------------------------------------------------------------------
// optimizer

// What optimizer.params holds besides the typed fields; checked once the type is known.
struct OptimizerParamsExtra {
  bool adam_w_mode = true;  // DeepSpeed's default: its "Adam" is AdamW
  bool lr_decay_given = false;
  bool weight_decay_given = false;
  bool torch_adam = false;  // DeepSpeed then builds torch.optim.Adam or AdamW
};

Status ReadBetas(const Json& value, const std::string& key_path, HyperParams* out) {
  const bool pair_of_numbers =
      value.is_array() && value.size() == 2 && value[0].is_number() && value[1].is_number();
  if (!pair_of_numbers) {
    return Status::InvalidArgument(fmt::format("{}: expected two numbers [beta1, beta2], got {}",
                                               key_path, DescribeJson(value)));
  }
  const double beta1 = value[0].get<double>();
  const double beta2 = value[1].get<double>();
  if (!(beta1 >= 0.0 && beta1 < 1.0) || !(beta2 >= 0.0 && beta2 < 1.0)) {
    return Status::InvalidArgument(fmt::format(
        "{} = {} is out of range; allowed: each beta in [0, 1)", key_path, DescribeJson(value)));
  }
  out->beta1 = beta1;
  out->beta2 = beta2;
  return Status::Ok();
}

Status ReadOptimizerParams(ObjectReader& reader, HyperParams* out, OptimizerParamsExtra* extra) {
  std::optional<Json> betas;
  bool bias_correction = true;
  bool amsgrad = false;
  double lr_decay = -1.0;  // stays negative (outside the allowed range) when absent
  double weight_decay = -1.0;
  reader.Double("lr", &out->lr, 0.0, kHugeNumber)
      .Value("betas", &betas)
      .Double("eps", &out->eps, 0.0, kHugeNumber)
      .Double("weight_decay", &weight_decay, 0.0, kHugeNumber)
      .Double("lr_decay", &lr_decay, 0.0, kHugeNumber)
      .Bool("adam_w_mode", &extra->adam_w_mode)
      .Bool("bias_correction", &bias_correction)
      .Bool("amsgrad", &amsgrad)
      .Bool("torch_adam", &extra->torch_adam);
  ZOE_RETURN_IF_ERROR(reader.Finish());
  extra->weight_decay_given = weight_decay >= 0.0;
  if (extra->weight_decay_given) out->weight_decay = weight_decay;
  if (betas.has_value()) ZOE_RETURN_IF_ERROR(ReadBetas(*betas, KeyPath(reader, "betas"), out));
  if (out->eps == 0.0) {
    return Status::InvalidArgument(
        fmt::format("{} = 0 is out of range; allowed: greater than 0", KeyPath(reader, "eps")));
  }
  if (!bias_correction) {
    return Status::InvalidArgument(fmt::format(
        "{} = false is not supported; zoe always applies bias correction; allowed: true",
        KeyPath(reader, "bias_correction")));
  }
  if (amsgrad) {
    return Status::InvalidArgument(
        fmt::format("{} = true is not supported; allowed: false", KeyPath(reader, "amsgrad")));
  }
  extra->lr_decay_given = lr_decay >= 0.0;
  if (extra->lr_decay_given) out->lr_decay = lr_decay;
  return Status::Ok();
}

// The type named in the document, case-insensitively, as DeepSpeed matches it.
Result<OptimizerKind> ResolveOptimizerType(const std::string& text, const std::string& key_path,
                                           bool adam_w_mode) {
  const std::string lower = Lower(text);
  if (lower == "adam") return adam_w_mode ? OptimizerKind::kAdamW : OptimizerKind::kAdam;
  Result<OptimizerKind> kind = ParseOptimizerKind(lower);
  if (kind.ok()) return kind;
  const std::string supported = fmt::format("{} (any letter case)", JoinNames(kOptimizerKindNames));
  const bool known_elsewhere =
      std::find(kUnsupportedOptimizers.begin(), kUnsupportedOptimizers.end(), lower) !=
      kUnsupportedOptimizers.end();
  if (known_elsewhere) {
    return Status::InvalidArgument(
        fmt::format("{} = '{}' is not supported by zoe; supported: {}", key_path, text, supported));
  }
  const std::vector<std::string> candidates(kOptimizerKindNames.begin(), kOptimizerKindNames.end());
  const std::string closest = ClosestMatch(text, candidates);
  return Status::InvalidArgument(
      fmt::format("{} = '{}' is not an optimizer;{} supported: {}", key_path, text,
                  closest.empty() ? "" : fmt::format(" did you mean '{}'?", closest), supported));
}

// torch_adam: DeepSpeed builds torch.optim.Adam or AdamW with torch's defaults for the params
// left out, where those differ from DeepSpeed's own Adam (AdamW's weight_decay, 0.01).
Status ApplyTorchAdam(const ObjectReader& reader, const OptimizerParamsExtra& extra,
                      const std::string& type, HyperParams* out) {
  if (!extra.torch_adam) return Status::Ok();
  if (out->kind != OptimizerKind::kAdamW && out->kind != OptimizerKind::kAdam) {
    return Status::InvalidArgument(
        fmt::format("{}.params.torch_adam applies to adam and adamw only; {}.type is '{}'",
                    reader.path(), reader.path(), type));
  }
  if (out->kind == OptimizerKind::kAdamW && !extra.weight_decay_given) out->weight_decay = 0.01;
  return Status::Ok();
}

Status ReadOptimizer(ObjectReader& reader, HyperParams* out, const AcceptedKeys& keys) {
  std::string type(OptimizerKindName(out->kind));
  OptimizerParamsExtra extra;
  reader.String("type", &type).Object("params", [&](ObjectReader& r) {
    return ReadOptimizerParams(r, out, &extra);
  });
  AcceptDeepSpeedKeys(reader, DeepSpeedSection::kOptimizer, keys);
  ZOE_RETURN_IF_ERROR(reader.Finish());
  ZOE_ASSIGN_OR_RETURN(out->kind,
                       ResolveOptimizerType(type, KeyPath(reader, "type"), extra.adam_w_mode));
  if (extra.lr_decay_given && out->kind != OptimizerKind::kAdagrad) {
    return Status::InvalidArgument(
        fmt::format("{}.params.lr_decay applies to adagrad only; {}.type is '{}'", reader.path(),
                    reader.path(), type));
  }
  return ApplyTorchAdam(reader, extra, type, out);
}

// ---------------------------------------------------------------------------------------------
// fp16, bf16

Status ReadFp16(ObjectReader& reader, Fp16Config* out, const AcceptedKeys& keys) {
  reader.Bool("enabled", &out->enabled)
      .Double("loss_scale", &out->loss_scale, 0.0, kHugeNumber)
      .UInt("initial_scale_power", &out->initial_scale_power, 0, 63)
      .UInt("loss_scale_window", &out->loss_scale_window, 1, uint64_t{1} << 32)
      .UInt("hysteresis", &out->hysteresis, 1, uint64_t{1} << 32)
      .Bool("consecutive_hysteresis", &out->consecutive_hysteresis)
      .Double("min_loss_scale", &out->min_loss_scale, 0.0, kHugeNumber);
  AcceptDeepSpeedKeys(reader, DeepSpeedSection::kFp16, keys);
  ZOE_RETURN_IF_ERROR(reader.Finish());
  if (out->min_loss_scale == 0.0) {
    return Status::InvalidArgument(fmt::format("{} = 0 is out of range; allowed: greater than 0",
                                               KeyPath(reader, "min_loss_scale")));
  }
  return Status::Ok();
}

Status ReadBf16(ObjectReader& reader, Bf16Config* out, const AcceptedKeys& keys) {
  reader.Bool("enabled", &out->enabled);
  AcceptDeepSpeedKeys(reader, DeepSpeedSection::kBf16, keys);
  return reader.Finish();
}

// ---------------------------------------------------------------------------------------------
// zoe

Status ReadTrace(ObjectReader& reader, TraceConfig* out) {
  reader.Size("lookahead_bytes", &out->lookahead_bytes, 0, uint64_t{1} << 40)
      .UInt("max_inflight", &out->max_inflight, 1, 1024)
      .UInt("mismatch_limit", &out->mismatch_limit, 1, uint64_t{1} << 32);
  return reader.Finish();
}

Status CheckDirectIoMultiple(const ObjectReader& reader, std::string_view key, uint64_t bytes) {
  if (bytes % kDirectIoUnit == 0) return Status::Ok();
  return Status::InvalidArgument(
      fmt::format("{} = {} is not a multiple of {}; allowed: multiples "
                  "of {} (the O_DIRECT unit)",
                  KeyPath(reader, key), bytes, kDirectIoUnit, kDirectIoUnit));
}

// A directory path as written, made comparable: "/x", "/x/", "/x/." and "/y/../x" are one.
std::string LexicalDirectory(const std::string& path) {
  std::filesystem::path normal = std::filesystem::path(path).lexically_normal();
  if (!normal.has_filename() && normal != normal.root_path()) normal = normal.parent_path();
  return normal.string();
}

Status CheckNvmePaths(const ObjectReader& reader, const std::vector<std::string>& paths) {
  const std::string key_path = KeyPath(reader, "nvme_paths");
  for (size_t i = 0; i < paths.size(); ++i) {
    if (paths[i].empty()) {
      return Status::InvalidArgument(
          fmt::format("{}[{}] is empty; allowed: directory paths", key_path, i));
    }
    for (size_t j = 0; j < i; ++j) {
      if (LexicalDirectory(paths[j]) != LexicalDirectory(paths[i])) continue;
      return Status::InvalidArgument(
          fmt::format("{}[{}] = '{}' is the directory of {}[{}] = '{}' again; allowed: distinct "
                      "directories",
                      key_path, i, paths[i], key_path, j, paths[j]));
    }
  }
  return Status::Ok();
}

// The tensors' share must leave the optimizer groups some of an explicit host budget.
Status CheckTensorHostBudget(const ObjectReader& reader, const ZoeConfig& zoe) {
  if (zoe.host_budget == 0 || zoe.tensor_host_budget < zoe.host_budget) return Status::Ok();
  return Status::InvalidArgument(fmt::format(
      "{} = {} is not less than {} = {}; allowed: less than host_budget (the rest holds "
      "the optimizer state), or 0 for half of it",
      KeyPath(reader, "tensor_host_budget"), zoe.tensor_host_budget, KeyPath(reader, "host_budget"),
      zoe.host_budget));
}

// A fixed tensor swap space holds at least one direct-I/O unit; 0 is automatic.
Status CheckTensorSwapBytes(const ObjectReader& reader, const ZoeConfig& zoe) {
  if (zoe.tensor_swap_bytes == 0 || zoe.tensor_swap_bytes >= kDirectIoUnit) return Status::Ok();
  return Status::InvalidArgument(fmt::format(
      "{} = {} is out of range; allowed: 0 (automatic: grown as tensors register) or "
      "{}..{}",
      KeyPath(reader, "tensor_swap_bytes"), zoe.tensor_swap_bytes, kDirectIoUnit, kMaxBudget));
}

Status ReadZoe(ObjectReader& reader, ZoeConfig* out) {
  ReadEnum(reader, "device", &out->device, kComputeDevices);
  reader.Size("device_budget", &out->device_budget, 0, kMaxBudget)
      .Size("host_budget", &out->host_budget, 0, kMaxBudget)
      .Size("tensor_host_budget", &out->tensor_host_budget, 0, kMaxBudget)
      .Size("tensor_swap_bytes", &out->tensor_swap_bytes, 0, kMaxBudget)
      .StringList("nvme_paths", &out->nvme_paths)
      .Size("stripe_unit", &out->stripe_unit, kDirectIoUnit, uint64_t{1} << 30)
      .Size("chunk_size", &out->chunk_size, 0, kMaxChunkSize)
      .Bool("checksum", &out->checksum)
      .Bool("speculative", &out->speculative)
      .UInt("slots", &out->slots, 1, 2)
      .Enum("log_level", &out->log_level, kLogLevels)
      .Object("trace", [&](ObjectReader& r) { return ReadTrace(r, &out->trace); });
  ReadEnum(reader, "arithmetic", &out->arithmetic, kArithmeticNames);
  ReadEnum(reader, "stores", &out->stores, kStoreModeNames);
  ReadEnum(reader, "eviction", &out->eviction, kEvictionKindNames);
  ReadMomentDType(reader, "moment_dtype", &out->moment_dtype);
  ZOE_RETURN_IF_ERROR(reader.Finish());
  ZOE_RETURN_IF_ERROR(CheckDirectIoMultiple(reader, "stripe_unit", out->stripe_unit));
  ZOE_RETURN_IF_ERROR(CheckDirectIoMultiple(reader, "chunk_size", out->chunk_size));
  ZOE_RETURN_IF_ERROR(CheckTensorHostBudget(reader, *out));
  ZOE_RETURN_IF_ERROR(CheckTensorSwapBytes(reader, *out));
  return CheckNvmePaths(reader, out->nvme_paths);
}

// ---------------------------------------------------------------------------------------------
// Checks across sections

bool HasKey(const Json& document, std::string_view section, std::string_view key) {
  const auto it = document.find(section);
  return it != document.end() && it->is_object() && it->contains(key);
}

Status CheckPrecision(const EngineConfig& config) {
  if (!(config.fp16.enabled && config.bf16.enabled)) return Status::Ok();
  return Status::InvalidArgument(
      "fp16.enabled and bf16.enabled are both true; allowed: at most one of them");
}

// DeepSpeed reads offload_param on its stage 3 paths only; below stage 3 the section is accepted
// with a warning and takes no effect (its nvme_path gives no swap directory either).
void IgnoreParamOffloadBelowStage3(EngineConfig* config) {
  ZeroConfig& zero = config->zero;
  if (zero.offload_param.device == OffloadDevice::kNone || zero.stage == 3) return;
  config->warnings.push_back(fmt::format(
      "zero_optimization.offload_param.device = '{}' has no effect at zero_optimization.stage "
      "{}: parameters are offloaded only at stage 3, where they are partitioned (DeepSpeed "
      "ignores the section below stage 3 too); the parameters stay where the model put them",
      OffloadDeviceName(zero.offload_param.device), zero.stage));
  zero.offload_param = OffloadParamConfig{};
}

// zoe.nvme_paths when given, else the nvme_path of every section offloading to NVMe. A section on
// NVMe with no directory from either is an error naming both ways to give one.
Status ResolveNvmePaths(EngineConfig* config) {
  struct Section {
    std::string_view name;
    OffloadDevice device;
    const std::string& nvme_path;
  };
  const ZeroConfig& zero = config->zero;
  const std::array<Section, 2> sections = {{
      {"offload_optimizer", zero.offload_optimizer.device, zero.offload_optimizer.nvme_path},
      {"offload_param", zero.offload_param.device, zero.offload_param.nvme_path},
  }};
  const bool given = !config->zoe.nvme_paths.empty();
  std::vector<std::string>& paths = config->zoe.nvme_paths;
  for (const Section& section : sections) {
    if (section.device != OffloadDevice::kNvme || given) continue;
    if (section.nvme_path.empty()) {
      return Status::InvalidArgument(
          fmt::format("zero_optimization.{0}.device = 'nvme' needs a directory; set "
                      "zero_optimization.{0}.nvme_path or zoe.nvme_paths",
                      section.name));
    }
    if (std::find(paths.begin(), paths.end(), section.nvme_path) == paths.end()) {
      paths.push_back(section.nvme_path);
    }
  }
  return Status::Ok();
}

// aio.checksum and zoe.checksum are one option: either spelling sets it; both must agree.
Status ResolveChecksum(const Json& document, EngineConfig* config) {
  const bool in_aio = HasKey(document, "aio", "checksum");
  const bool in_zoe = HasKey(document, "zoe", "checksum");
  if (in_aio && in_zoe && config->aio.checksum != config->zoe.checksum) {
    return Status::InvalidArgument(fmt::format(
        "aio.checksum = {} and zoe.checksum = {} disagree; they are the same option, keep one",
        config->aio.checksum, config->zoe.checksum));
  }
  if (in_aio) config->zoe.checksum = config->aio.checksum;
  config->aio.checksum = config->zoe.checksum;
  return Status::Ok();
}

// With load_from_fp32_weights false, DeepSpeed's stage 1 and 2 loads, and its bf16 optimizer's
// at stage 0 (BF16_Optimizer), take the fp32 master weights from the model's 16-bit weights
// (stage_1_and_2.py and bf16_optimizer.py, _restore_from_bit16_weights); zoe's checkpoints always
// restore the fp32 master weights they hold. With an fp32 model both give the same weights;
// DeepSpeed's fp16 stage 0 and its stage 3 loads do not read the key (stage 3 restores the
// checkpoint's fp32 weights).
Status CheckLoadFromFp32Weights(const Json& document, const EngineConfig& config) {
  const bool stage_1_or_2 = config.zero.stage == 1 || config.zero.stage == 2;
  const bool reads_it = (stage_1_or_2 && (config.fp16.enabled || config.bf16.enabled)) ||
                        (config.zero.stage == 0 && config.bf16.enabled);
  const auto zero = document.find("zero_optimization");
  if (!reads_it || zero == document.end()) return Status::Ok();
  const auto given = zero->find("load_from_fp32_weights");  // a bool: ReadZero read it
  if (given == zero->end() || *given != false) return Status::Ok();
  const std::string loader = config.zero.stage == 0
                                 ? std::string("bf16 optimizer's load at ZeRO stage 0")
                                 : fmt::format("ZeRO stage {} load", config.zero.stage);
  return Status::InvalidArgument(fmt::format(
      "zero_optimization.load_from_fp32_weights = false: with it DeepSpeed's {} takes the fp32 "
      "master weights from the model's {} weights, rounded, instead of the checkpoint's fp32 "
      "copies; zoe's checkpoints always restore the fp32 master weights they hold: set "
      "zero_optimization.load_from_fp32_weights to true or remove it",
      loader, config.fp16.enabled ? "fp16" : "bf16"));
}

Status CheckAcrossSections(const Json& document, EngineConfig* config) {
  ZOE_RETURN_IF_ERROR(CheckPrecision(*config));
  ZOE_RETURN_IF_ERROR(CheckLoadFromFp32Weights(document, *config));
  IgnoreParamOffloadBelowStage3(config);
  ZOE_RETURN_IF_ERROR(ResolveNvmePaths(config));
  return ResolveChecksum(document, config);
}

// ---------------------------------------------------------------------------------------------
// ToJson

Json OptimizerToJson(const HyperParams& optimizer) {
  Json params = {{"lr", optimizer.lr},
                 {"betas", {optimizer.beta1, optimizer.beta2}},
                 {"eps", optimizer.eps},
                 {"weight_decay", optimizer.weight_decay}};
  // DeepSpeed's "adam" means AdamW unless adam_w_mode says otherwise.
  if (optimizer.kind == OptimizerKind::kAdam) params["adam_w_mode"] = false;
  if (optimizer.kind == OptimizerKind::kAdagrad) params["lr_decay"] = optimizer.lr_decay;
  return {{"type", OptimizerKindName(optimizer.kind)}, {"params", std::move(params)}};
}

Json ZeroToJson(const ZeroConfig& zero) {
  const OffloadOptimizerConfig& opt = zero.offload_optimizer;
  const OffloadParamConfig& param = zero.offload_param;
  return {{"stage", zero.stage},
          {"sub_group_size", zero.sub_group_size},
          {"offload_optimizer",
           {{"device", OffloadDeviceName(opt.device)},
            {"nvme_path", opt.nvme_path},
            {"pin_memory", opt.pin_memory},
            {"buffer_count", opt.buffer_count},
            {"fast_init", opt.fast_init},
            {"ratio", opt.ratio}}},
          {"offload_param",
           {{"device", OffloadDeviceName(param.device)},
            {"nvme_path", param.nvme_path},
            {"pin_memory", param.pin_memory},
            {"buffer_count", param.buffer_count},
            {"buffer_size", param.buffer_size},
            {"max_in_cpu", param.max_in_cpu}}}};
}

Json Fp16ToJson(const Fp16Config& fp16) {
  return {{"enabled", fp16.enabled},
          {"loss_scale", fp16.loss_scale},
          {"initial_scale_power", fp16.initial_scale_power},
          {"loss_scale_window", fp16.loss_scale_window},
          {"hysteresis", fp16.hysteresis},
          {"consecutive_hysteresis", fp16.consecutive_hysteresis},
          {"min_loss_scale", fp16.min_loss_scale}};
}

Json AioToJson(const AioConfig& aio) {
  return {{"block_size", aio.block_size},
          {"queue_depth", aio.queue_depth},
          {"intra_op_parallelism", aio.intra_op_parallelism},
          {"single_submit", aio.single_submit},
          {"overlap_events", aio.overlap_events},
          {"backend", aio.backend},
          {"use_direct", aio.use_direct},
          {"checksum", aio.checksum}};
}

Json ZoeToJson(const ZoeConfig& zoe) {
  Json out = {{"device", ComputeDeviceName(zoe.device)},
              {"device_budget", zoe.device_budget},
              {"host_budget", zoe.host_budget},
              {"tensor_host_budget", zoe.tensor_host_budget},
              {"tensor_swap_bytes", zoe.tensor_swap_bytes},
              {"nvme_paths", zoe.nvme_paths},
              {"stripe_unit", zoe.stripe_unit},
              {"chunk_size", zoe.chunk_size},
              {"checksum", zoe.checksum},
              {"arithmetic", ArithmeticName(zoe.arithmetic)},
              {"stores", StoreModeName(zoe.stores)},
              {"slots", zoe.slots},
              {"trace",
               {{"lookahead_bytes", zoe.trace.lookahead_bytes},
                {"max_inflight", zoe.trace.max_inflight},
                {"mismatch_limit", zoe.trace.mismatch_limit}}},
              {"eviction", EvictionKindName(zoe.eviction)},
              {"moment_dtype", DTypeName(zoe.moment_dtype)},
              {"speculative", zoe.speculative}};
  if (!zoe.log_level.empty()) out["log_level"] = zoe.log_level;
  return out;
}

}  // namespace

std::string_view OffloadDeviceName(OffloadDevice device) { return NameIn(kOffloadDevices, device); }
std::string_view ComputeDeviceName(ComputeDevice device) { return NameIn(kComputeDevices, device); }

Result<EngineConfig> ParseEngineConfig(std::string_view json_text) {
  ZOE_ASSIGN_OR_RETURN(const Json document, ParseConfigJson(json_text));
  return ParseEngineConfigDocument(document);
}

Result<EngineConfig> ParseEngineConfigDocument(const Json& given) {
  EngineConfig config;
  Json document = given;
  if (document.is_object()) {  // the reader refuses anything else
    ZOE_RETURN_IF_ERROR(ReadPydanticSections(&document));
    DropDefaultedValues(&document);
  }
  ZOE_RETURN_IF_ERROR(StripAutoValues(&document, &config.auto_keys));
  const AcceptedKeys keys{&config.ignored_keys, &config.framework_keys};
  std::optional<Json> aio;
  ObjectReader reader(document, "");
  reader
      .Object("zero_optimization", [&](ObjectReader& r) { return ReadZero(r, &config.zero, keys); })
      .Object("optimizer",
              [&](ObjectReader& r) { return ReadOptimizer(r, &config.optimizer, keys); })
      .Double("gradient_clipping", &config.gradient_clipping, 0.0, kHugeNumber)
      .Object("fp16", [&](ObjectReader& r) { return ReadFp16(r, &config.fp16, keys); })
      .Alias("bfloat16", "bf16")
      .Object("bf16", [&](ObjectReader& r) { return ReadBf16(r, &config.bf16, keys); })
      .Value("aio", &aio)
      .Object("zoe", [&](ObjectReader& r) { return ReadZoe(r, &config.zoe); });
  AcceptDeepSpeedKeys(reader, DeepSpeedSection::kTopLevel, keys);
  ZOE_RETURN_IF_ERROR(reader.Finish());
  ZOE_RETURN_IF_ERROR(CheckDeepSpeedSwitches(document, config.auto_keys));
  ZOE_ASSIGN_OR_RETURN(config.aio, ParseAioConfig(aio.value_or(Json()), &config.ignored_keys));
  ZOE_RETURN_IF_ERROR(CheckAcrossSections(document, &config));
  std::sort(config.ignored_keys.begin(), config.ignored_keys.end());
  std::sort(config.framework_keys.begin(), config.framework_keys.end());
  return config;
}

Json ToJson(const EngineConfig& config) {
  Json out = {{"zero_optimization", ZeroToJson(config.zero)},
              {"optimizer", OptimizerToJson(config.optimizer)},
              {"gradient_clipping", config.gradient_clipping},
              {"fp16", Fp16ToJson(config.fp16)},
              {"bf16", {{"enabled", config.bf16.enabled}}},
              {"aio", AioToJson(config.aio)},
              {"zoe", ZoeToJson(config.zoe)}};
  if (!config.auto_keys.empty()) out["auto"] = config.auto_keys;
  return out;
}

std::string DescribeIgnoredKeys(const EngineConfig& config) {
  if (config.ignored_keys.empty()) return {};
  return fmt::format("ignored DeepSpeed keys: {}", fmt::join(config.ignored_keys, ", "));
}

std::string DescribeFrameworkKeys(const EngineConfig& config) {
  if (config.framework_keys.empty()) return {};
  return fmt::format(
      "DeepSpeed keys for the framework (zoe.torch.initialize reads them; the engine does "
      "not): {}",
      fmt::join(config.framework_keys, ", "));
}

}  // namespace zoe::config
