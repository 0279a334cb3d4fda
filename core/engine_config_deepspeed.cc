#include "core/engine_config_deepspeed.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <string_view>

namespace zoe::config {
namespace {

using Json = nlohmann::json;

enum class Use { kIgnored, kFramework };

struct AcceptedKey {
  DeepSpeedSection section;
  std::string_view key;
  Use use = Use::kIgnored;
};

using S = DeepSpeedSection;
constexpr Use kFramework = Use::kFramework;

// DeepSpeed's keys (deepspeed/runtime/config.py, zero/config.py, constants.py) that the engine
// reads no value from. The ones named with kFramework are read by zoe.torch.initialize; the
// switches of CheckDeepSpeedSwitches are here too, as they are ignored while off.
constexpr auto kAcceptedKeys = std::to_array<AcceptedKey>({
    {S::kTopLevel, "train_batch_size", kFramework},
    {S::kTopLevel, "train_micro_batch_size_per_gpu", kFramework},
    {S::kTopLevel, "gradient_accumulation_steps", kFramework},
    {S::kTopLevel, "scheduler", kFramework},
    {S::kTopLevel, "dataloader_drop_last", kFramework},
    {S::kTopLevel, "activation_checkpointing", kFramework},
    // the precision of the gradients' accumulation and reduction, checked against zoe's
    {S::kTopLevel, "data_types", kFramework},
    {S::kTopLevel, "communication_data_type", kFramework},
    // logging, monitoring and profiling
    {S::kTopLevel, "steps_per_print"},
    {S::kTopLevel, "wall_clock_breakdown"},
    {S::kTopLevel, "memory_breakdown"},
    {S::kTopLevel, "dump_state"},
    {S::kTopLevel, "flops_profiler"},
    {S::kTopLevel, "tensorboard"},
    {S::kTopLevel, "wandb"},
    {S::kTopLevel, "csv_monitor"},
    {S::kTopLevel, "comet"},
    {S::kTopLevel, "comms_logger"},
    {S::kTopLevel, "timers"},
    {S::kTopLevel, "autotuning"},
    {S::kTopLevel, "eigenvalue"},  // read only by MoQ (quantize_training), refused when on
    // communication, the same sums in another order or precision
    {S::kTopLevel, "prescale_gradients"},
    {S::kTopLevel, "gradient_predivide_factor"},
    {S::kTopLevel, "seq_parallel_comm_data_type"},
    {S::kTopLevel, "sparse_gradients"},
    {S::kTopLevel, "disable_allgather"},
    {S::kTopLevel, "graph_harvesting"},
    {S::kTopLevel, "use_data_before_expert_parallelism"},
    // DeepSpeed's own optimizer checks, checkpoints, kernels and model-side helpers
    {S::kTopLevel, "zero_allow_untested_optimizer"},
    {S::kTopLevel, "zero_force_ds_cpu_optimizer"},
    {S::kTopLevel, "checkpoint"},
    {S::kTopLevel, "sparse_attention"},
    {S::kTopLevel, "pipeline"},
    {S::kTopLevel, "vocabulary_size"},
    {S::kTopLevel, "weight_quantization"},  // deepspeed.zero.Init's and inference's
    {S::kTopLevel, "compile"},              // DeepSpeed 0.13 to 0.14.3: torch.compile, same math
    // switches of features zoe does not implement (CheckDeepSpeedSwitches)
    {S::kTopLevel, "amp"},
    {S::kTopLevel, "elasticity"},
    {S::kTopLevel, "curriculum_learning"},
    {S::kTopLevel, "data_efficiency"},
    {S::kTopLevel, "compression_training"},
    {S::kTopLevel, "progressive_layer_drop"},
    {S::kTopLevel, "quantize_training"},
    {S::kTopLevel, "hybrid_engine"},
    {S::kTopLevel, "nebula"},
    {S::kTopLevel, "tensor_parallel"},

    {S::kZero, "reduce_bucket_size", kFramework},
    {S::kZero, "allgather_bucket_size", kFramework},
    {S::kZero, "stage3_max_live_parameters", kFramework},
    {S::kZero, "stage3_max_reuse_distance", kFramework},
    {S::kZero, "allgather_partitions"},
    {S::kZero, "overlap_comm"},
    {S::kZero, "reduce_scatter"},
    {S::kZero, "contiguous_gradients"},
    {S::kZero, "use_multi_rank_bucket_allreduce"},
    {S::kZero, "grad_hooks"},
    {S::kZero, "round_robin_gradients"},
    {S::kZero, "cpu_offload_use_pin_memory"},
    {S::kZero, "elastic_checkpoint"},
    {S::kZero, "ignore_unused_parameters"},
    {S::kZero, "legacy_stage1"},
    {S::kZero, "stage3_prefetch_bucket_size"},
    {S::kZero, "stage3_param_persistence_threshold"},
    {S::kZero, "stage3_model_persistence_threshold"},
    {S::kZero, "stage3_gather_16bit_weights_on_model_save"},
    {S::kZero, "stage3_module_granularity_threshold"},
    {S::kZero, "stage3_use_all_reduce_for_fetch_params"},
    {S::kZero, "zero_hpz_partition_size"},
    {S::kZero, "zero_quantized_weights"},
    {S::kZero, "zero_quantized_nontrainable_weights"},
    {S::kZero, "zero_quantized_gradients"},
    {S::kZero, "zeropp_loco_param"},
    {S::kZero, "mics_shard_size"},
    {S::kZero, "mics_hierarchical_params_gather"},
    {S::kZero, "memory_efficient_linear"},
    {S::kZero, "pipeline_loading_checkpoint"},
    {S::kZero, "override_module_apply"},
    {S::kZero, "log_trace_cache_warnings"},

    // zoe always overlaps reads, compute and writes of the optimizer step
    {S::kOffloadOptimizer, "pipeline_read"},
    {S::kOffloadOptimizer, "pipeline_write"},
    {S::kOffloadOptimizer, "pipeline"},
    {S::kOptimizer, "legacy_fusion"},
    {S::kFp16, "auto_cast"},
    {S::kFp16, "fp16_master_weights_and_grads"},
    // DeepSpeed scales no bf16 loss, and when its bf16 optimizer adds the gradients into fp32
    // changes no sum
    {S::kBf16, "immediate_grad_update"},
    {S::kBf16, "loss_scale"},
});

// A DeepSpeed switch for a feature that changes what is trained and that zoe does not implement.
struct Switch {
  std::string_view path;       // the switch's dotted path
  std::string_view deepspeed;  // what DeepSpeed does when it is on
  std::string_view fix = {};   // how to get a document zoe accepts; empty: remove or switch off
  std::string_view only_with = {};  // a switch that must be on too, as DeepSpeed reads it
  bool above_one = false;           // on when a number above 1, not when true for Python
};

constexpr std::string_view kCompression =
    "quantizes or prunes, on the section's schedule, the layers that "
    "deepspeed.compression.init_compression converted";

constexpr auto kSwitches = std::to_array<Switch>({
    {"amp.enabled",
     "trains with NVIDIA Apex's automatic mixed precision (apex.amp.initialize with the "
     "section's opt_level)",
     "use the fp16 or bf16 section instead, and remove 'amp' or set amp.enabled to false"},
    {"elasticity.enabled",
     "chooses train_batch_size, train_micro_batch_size_per_gpu and gradient_accumulation_steps "
     "for the world size from the elastic configuration",
     "give the batch sizes, and remove 'elasticity' or set elasticity.enabled to false"},
    {"curriculum_learning.enabled",
     "passes the model's forward a curriculum_seqlen that grows on the curriculum's schedule "
     "(legacy curriculum learning)"},
    {"data_efficiency.enabled",
     "samples the training data by its curriculum and drops tokens in the layers it routes "
     "(random-LTD)"},
    {"progressive_layer_drop.enabled",
     "passes the model's forward the progressive layer drop's theta, with which the model drops "
     "layers at random"},
    {"quantize_training.enabled",
     "quantizes the weights during training (MoQ, in DeepSpeed up to 0.6; later releases moved "
     "it to compression_training)"},
    {"hybrid_engine.enabled",
     "wraps the model in its hybrid engine, which generates with inference kernels (DeepSpeed-"
     "Chat's RLHF actor)",
     "generate with engine.module, and remove 'hybrid_engine' or set hybrid_engine.enabled to "
     "false"},
    {"nebula.enabled", "saves and loads checkpoints through the Nebula service",
     "zoe saves where save_checkpoint says: remove 'nebula' or set nebula.enabled to false"},
    {"compression_training.weight_quantization.shared_parameters.enabled", kCompression},
    {"compression_training.activation_quantization.shared_parameters.enabled", kCompression},
    {"compression_training.sparse_pruning.shared_parameters.enabled", kCompression},
    {"compression_training.row_pruning.shared_parameters.enabled", kCompression},
    {"compression_training.head_pruning.shared_parameters.enabled", kCompression},
    {"compression_training.channel_pruning.shared_parameters.enabled", kCompression},
    {"compression_training.layer_reduction.enabled", kCompression},
    {"fp16.auto_cast", "casts the floating-point inputs of forward to fp16",
     "cast the inputs to torch.half before calling the engine, and set fp16.auto_cast to false",
     "fp16.enabled"},
    {"fp16.fp16_master_weights_and_grads",
     "keeps the master weights and the gradients in fp16 (ZeRO stage 2)",
     "zoe keeps fp32 master weights: set fp16.fp16_master_weights_and_grads to false",
     "fp16.enabled"},
    {"zero_optimization.zero_quantized_weights",
     "all-gathers the weights quantized to int8 (ZeRO++ qwZ), so that forward and backward see "
     "quantized weights",
     "set zero_optimization.zero_quantized_weights to false"},
    {"zero_optimization.zero_quantized_nontrainable_weights",
     "keeps the frozen weights quantized to int8 (ZeRO++)",
     "set zero_optimization.zero_quantized_nontrainable_weights to false"},
    {"zero_optimization.zero_quantized_gradients",
     "reduces the gradients quantized to int4 (ZeRO++ qgZ)",
     "set zero_optimization.zero_quantized_gradients to false"},
    {"tensor_parallel.autotp_size",
     "splits the model's layers over that many ranks (automatic tensor parallelism)",
     "zoe is data parallel only: remove 'tensor_parallel' or set tensor_parallel.autotp_size to "
     "0",
     {},
     /*above_one=*/true},
});

// The value at a dotted path, or null when a section on the way is absent or not an object.
const Json* Lookup(const Json& document, std::string_view path) {
  const Json* node = &document;
  while (!path.empty()) {
    const size_t dot = path.find('.');
    const std::string part(path.substr(0, dot));
    if (!node->is_object() || !node->contains(part)) return nullptr;
    node = &(*node)[part];
    path = dot == std::string_view::npos ? std::string_view() : path.substr(dot + 1);
  }
  return node;
}

// Whether Python takes the value for true, as DeepSpeed's `if config.get("enabled")` does.
bool TrueForPython(const Json& value) {
  if (value.is_boolean()) return value.get<bool>();
  if (value.is_number()) return value.get<double>() != 0.0;  // NaN too
  if (value.is_null()) return false;
  return !value.empty();  // a string, an array or an object
}

// How the switch that a switch applies only with (Switch::only_with) stands: on (also when
// there is none), off, or "auto" (decided by the framework).
enum class Condition { kOff, kOn, kAuto };

Condition ConditionOf(const Json& document, const Switch& entry,
                      std::span<const std::string> auto_keys) {
  if (entry.only_with.empty()) return Condition::kOn;
  if (std::find(auto_keys.begin(), auto_keys.end(), entry.only_with) != auto_keys.end()) {
    return Condition::kAuto;
  }
  const Json* other = Lookup(document, entry.only_with);
  return other != nullptr && TrueForPython(*other) ? Condition::kOn : Condition::kOff;
}

bool IsOn(const Json& document, const Switch& entry, Condition condition) {
  const Json* value = Lookup(document, entry.path);
  if (value == nullptr || condition == Condition::kOff) return false;
  if (entry.above_one) return value->is_number() && value->get<double>() > 1.0;
  return TrueForPython(*value);
}

// What the message adds when the switch applies because the one it applies with is "auto".
std::string WithAuto(const Switch& entry, Condition condition) {
  if (condition != Condition::kAuto) return {};
  return fmt::format(" with {} = \"auto\" (DeepSpeed reads the switch whatever \"auto\" becomes)",
                     entry.only_with);
}

std::string FixOf(const Switch& entry) {
  if (!entry.fix.empty()) return std::string(entry.fix);
  const std::string_view section = entry.path.substr(0, entry.path.find('.'));
  return fmt::format("remove '{}' or set {} to false", section, entry.path);
}

}  // namespace

void AcceptDeepSpeedKeys(ObjectReader& reader, DeepSpeedSection section, const AcceptedKeys& keys) {
  for (const AcceptedKey& entry : kAcceptedKeys) {
    if (entry.section != section) continue;
    reader.Ignore(entry.key, entry.use == Use::kFramework ? keys.framework : keys.ignored);
  }
}

Status CheckDeepSpeedSwitches(const Json& document, std::span<const std::string> auto_keys) {
  for (const Switch& entry : kSwitches) {
    const Condition condition = ConditionOf(document, entry, auto_keys);
    if (!IsOn(document, entry, condition)) continue;
    return Status::InvalidArgument(
        fmt::format("{} = {}{}: with it DeepSpeed {}, which zoe does not do; {}", entry.path,
                    DescribeJson(*Lookup(document, entry.path)), WithAuto(entry, condition),
                    entry.deepspeed, FixOf(entry)));
  }
  return Status::Ok();
}

}  // namespace zoe::config
