#include "core/engine_config_pydantic.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <charconv>
#include <cstdint>
#include <cstdlib>
#include <iterator>
#include <optional>
#include <string>
#include <string_view>

#include "core/config.h"

namespace zoe::config {
namespace {

using Json = nlohmann::json;

enum class Kind { kBool, kInt, kFloat };

struct TypedKey {
  std::string_view section;  // the dotted path of the object holding the key
  std::string_view key;
  Kind kind;
};

constexpr Kind kBool = Kind::kBool;
constexpr Kind kInt = Kind::kInt;
constexpr Kind kFloat = Kind::kFloat;
constexpr std::string_view kZero = "zero_optimization";
constexpr std::string_view kOffloadOptimizer = "zero_optimization.offload_optimizer";
constexpr std::string_view kOffloadParam = "zero_optimization.offload_param";

// The keys zoe accepts in DeepSpeed's pydantic sections, typed as DeepSpeed's models type them
// (DeepSpeedZeroConfig, DeepSpeedZeroOffloadOptimizerConfig, DeepSpeedZeroOffloadParamConfig,
// DeepSpeedFP16Config, DeepSpeedBF16Config, HybridEngineConfig, TPTrainingConfig); an
// Optional[bool] is a bool here (null is left alone).
constexpr auto kTypedKeys = std::to_array<TypedKey>({
    {kZero, "stage", kInt},
    {kZero, "contiguous_gradients", kBool},
    {kZero, "reduce_scatter", kBool},
    {kZero, "reduce_bucket_size", kInt},
    {kZero, "use_multi_rank_bucket_allreduce", kBool},
    {kZero, "allgather_partitions", kBool},
    {kZero, "allgather_bucket_size", kInt},
    {kZero, "overlap_comm", kBool},
    {kZero, "load_from_fp32_weights", kBool},
    {kZero, "elastic_checkpoint", kBool},
    {kZero, "sub_group_size", kInt},
    {kZero, "cpu_offload_param", kBool},
    {kZero, "cpu_offload_use_pin_memory", kBool},
    {kZero, "cpu_offload", kBool},
    {kZero, "stage3_prefetch_bucket_size", kInt},
    {kZero, "stage3_param_persistence_threshold", kInt},
    {kZero, "stage3_model_persistence_threshold", kInt},
    {kZero, "stage3_max_live_parameters", kInt},
    {kZero, "stage3_max_reuse_distance", kInt},
    {kZero, "stage3_gather_16bit_weights_on_model_save", kBool},
    {kZero, "stage3_gather_fp16_weights_on_model_save", kBool},
    {kZero, "stage3_module_granularity_threshold", kInt},
    {kZero, "stage3_use_all_reduce_for_fetch_params", kBool},
    {kZero, "ignore_unused_parameters", kBool},
    {kZero, "legacy_stage1", kBool},
    {kZero, "round_robin_gradients", kBool},
    {kZero, "zero_hpz_partition_size", kInt},
    {kZero, "zero_quantized_weights", kBool},
    {kZero, "zero_quantized_nontrainable_weights", kBool},
    {kZero, "zero_quantized_gradients", kBool},
    {kZero, "mics_shard_size", kInt},
    {kZero, "mics_hierarchical_params_gather", kBool},
    {kZero, "memory_efficient_linear", kBool},
    {kZero, "pipeline_loading_checkpoint", kBool},
    {kZero, "override_module_apply", kBool},
    {kZero, "log_trace_cache_warnings", kBool},
    {kOffloadOptimizer, "buffer_count", kInt},
    {kOffloadOptimizer, "pin_memory", kBool},
    {kOffloadOptimizer, "pipeline_read", kBool},
    {kOffloadOptimizer, "pipeline_write", kBool},
    {kOffloadOptimizer, "fast_init", kBool},
    {kOffloadOptimizer, "ratio", kFloat},
    {kOffloadParam, "buffer_count", kInt},
    {kOffloadParam, "buffer_size", kInt},
    {kOffloadParam, "max_in_cpu", kInt},
    {kOffloadParam, "pin_memory", kBool},
    {"fp16", "enabled", kBool},
    {"fp16", "auto_cast", kBool},
    {"fp16", "loss_scale", kFloat},
    {"fp16", "initial_scale_power", kInt},
    {"fp16", "loss_scale_window", kInt},
    {"fp16", "hysteresis", kInt},
    {"fp16", "consecutive_hysteresis", kBool},
    {"fp16", "min_loss_scale", kFloat},
    {"fp16", "fp16_master_weights_and_grads", kBool},
    {"bf16", "enabled", kBool},
    {"bf16", "immediate_grad_update", kBool},
    {"hybrid_engine", "enabled", kBool},
    {"hybrid_engine", "max_out_tokens", kInt},
    {"hybrid_engine", "inference_tp_size", kInt},
    {"hybrid_engine", "release_inference_cache", kBool},
    {"hybrid_engine", "pin_parameters", kBool},
    {"hybrid_engine", "tp_gather_partition_size", kInt},
    {"hybrid_engine", "enable_cuda_graph", kBool},
    {"tensor_parallel", "autotp_size", kInt},
    {"tensor_parallel", "keep_module_on_host", kBool},
    {"tensor_parallel", "replace_with_kernel_inject", kBool},
    {"tensor_parallel", "kernel_inject", kBool},
});

// pydantic's words for a bool, compared in lower case.
constexpr std::array<std::string_view, 6> kFalseWords = {"0", "off", "f", "false", "n", "no"};
constexpr std::array<std::string_view, 6> kTrueWords = {"1", "on", "t", "true", "y", "yes"};

// The spellings of a section: Megatron-DeepSpeed writes bf16 as bfloat16.
std::array<std::string_view, 2> SpellingsOf(std::string_view section) {
  if (section == "bf16") return {"bf16", "bfloat16"};
  return {section, {}};
}

// The object at a dotted path, or null when a section on the way is absent or not an object.
Json* ObjectAt(Json* document, std::string_view path) {
  Json* node = document;
  while (!path.empty()) {
    const size_t dot = path.find('.');
    if (!node->is_object()) return nullptr;
    const auto it = node->find(std::string(path.substr(0, dot)));
    if (it == node->end()) return nullptr;
    node = &*it;
    path = dot == std::string_view::npos ? std::string_view() : path.substr(dot + 1);
  }
  return node->is_object() ? node : nullptr;
}

std::string Lower(std::string_view text) {
  std::string out(text);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string_view Trim(std::string_view text) {
  constexpr std::string_view kSpace = " \t\n\r\f\v";
  const size_t begin = text.find_first_not_of(kSpace);
  if (begin == std::string_view::npos) return {};
  return text.substr(begin, text.find_last_not_of(kSpace) - begin + 1);
}

// Digits with single underscores between them ("1_000"), as Python writes numbers.
bool IsDigitRun(std::string_view text) {
  if (text.empty() || !std::isdigit(static_cast<unsigned char>(text.front())) ||
      !std::isdigit(static_cast<unsigned char>(text.back())) ||
      text.find("__") != std::string_view::npos) {
    return false;
  }
  return std::all_of(text.begin(), text.end(), [](char c) {
    return c == '_' || std::isdigit(static_cast<unsigned char>(c));
  });
}

std::string WithoutUnderscores(std::string_view text) {
  std::string out;
  std::copy_if(text.begin(), text.end(), std::back_inserter(out), [](char c) { return c != '_'; });
  return out;
}

std::optional<Json> AsBool(const Json& value) {
  if (value.is_boolean()) return value;
  if (value.is_number()) {
    const double number = value.get<double>();
    if (number == 0.0 || number == 1.0) return Json(number == 1.0);
    return std::nullopt;
  }
  if (!value.is_string()) return std::nullopt;
  const std::string word = Lower(value.get<std::string>());
  if (std::find(kFalseWords.begin(), kFalseWords.end(), word) != kFalseWords.end()) return false;
  if (std::find(kTrueWords.begin(), kTrueWords.end(), word) != kTrueWords.end()) return true;
  return std::nullopt;
}

// The integer of pydantic's lax int: [sign] digits [. zeros], around spaces. One beyond 64 bits
// becomes a double, which the section readers refuse as out of range.
std::optional<Json> ParseIntText(std::string_view text) {
  text = Trim(text);
  const bool negative = !text.empty() && text.front() == '-';
  if (!text.empty() && (text.front() == '-' || text.front() == '+')) text.remove_prefix(1);
  const size_t dot = text.find('.');
  if (dot != std::string_view::npos &&
      (dot + 1 == text.size() || text.find_first_not_of('0', dot + 1) != std::string_view::npos)) {
    return std::nullopt;
  }
  const std::string_view whole = text.substr(0, dot);
  if (!IsDigitRun(whole)) return std::nullopt;
  const std::string digits = WithoutUnderscores(whole);
  uint64_t magnitude = 0;
  const auto [end, error] =
      std::from_chars(digits.data(), digits.data() + digits.size(), magnitude);
  if (error != std::errc()) {
    const double huge = std::strtod(digits.c_str(), nullptr);
    return Json(negative ? -huge : huge);
  }
  if (!negative) return Json(magnitude);
  if (magnitude > uint64_t{1} << 63) return Json(-static_cast<double>(magnitude));
  return Json(static_cast<int64_t>(0 - magnitude));  // two's complement: -2^63 included
}

// Python's float() grammar, which pydantic's lax float follows: [sign] (digits [. [digits]] |
// . digits) [(e | E) [sign] digits], or inf, infinity, nan in any letter case.
bool IsFloatText(std::string_view text) {
  if (!text.empty() && (text.front() == '-' || text.front() == '+')) text.remove_prefix(1);
  const std::string word = Lower(text);
  if (word == "inf" || word == "infinity" || word == "nan") return true;
  const size_t exponent = text.find_first_of("eE");
  if (exponent != std::string_view::npos) {
    std::string_view power = text.substr(exponent + 1);
    if (!power.empty() && (power.front() == '-' || power.front() == '+')) power.remove_prefix(1);
    if (!IsDigitRun(power)) return false;
  }
  const std::string_view mantissa = text.substr(0, exponent);
  const size_t dot = mantissa.find('.');
  if (dot == std::string_view::npos) return IsDigitRun(mantissa);
  const std::string_view whole = mantissa.substr(0, dot);
  const std::string_view fraction = mantissa.substr(dot + 1);
  if (whole.empty() && fraction.empty()) return false;
  return (whole.empty() || IsDigitRun(whole)) && (fraction.empty() || IsDigitRun(fraction));
}

std::optional<Json> AsNumber(const Json& value, Kind kind) {
  if (value.is_number() || value.is_boolean()) return value;  // the section reader checks it
  if (!value.is_string()) return std::nullopt;
  const std::string_view text = value.get_ref<const std::string&>();
  if (kind == Kind::kInt) return ParseIntText(text);
  if (!IsFloatText(Trim(text))) return std::nullopt;
  return Json(std::strtod(WithoutUnderscores(Trim(text)).c_str(), nullptr));
}

std::string_view AllowedOf(Kind kind) {
  switch (kind) {
    case Kind::kBool:
      return "true or false (DeepSpeed's pydantic also takes 0 and 1, and \"true\", \"false\", "
             "\"yes\", \"no\", \"on\", \"off\", \"t\", \"f\", \"y\", \"n\", \"1\" or \"0\" in any "
             "letter case)";
    case Kind::kInt:
      return "an integer (DeepSpeed's pydantic also takes one quoted, such as \"2\" or \"2.0\", "
             "but not \"1e9\" or \"2.5\")";
    case Kind::kFloat:
      break;
  }
  return "a number (DeepSpeed's pydantic also takes one quoted, such as \"0.5\" or \"1e9\")";
}

Status Coerce(std::string_view section, const TypedKey& entry, Json* value) {
  if (value->is_null() || (value->is_string() && *value == "auto")) return Status::Ok();
  std::optional<Json> coerced =
      entry.kind == Kind::kBool ? AsBool(*value) : AsNumber(*value, entry.kind);
  if (!coerced.has_value()) {
    static const std::array<std::string, 1> kAuto = {"auto"};
    const bool near_auto =
        value->is_string() && !ClosestMatch(value->get<std::string>(), kAuto).empty();
    return Status::InvalidArgument(fmt::format(
        "{}.{} = {} is not allowed; allowed: {}{}", section, entry.key, DescribeJson(*value),
        AllowedOf(entry.kind), near_auto ? "; did you mean \"auto\"?" : ""));
  }
  *value = std::move(*coerced);
  return Status::Ok();
}

struct DeprecatedOffload {
  std::string_view key;      // the deprecated switch in zero_optimization
  std::string_view section;  // the section it stands for
};

constexpr std::array<DeprecatedOffload, 2> kDeprecatedOffloads = {{
    {"cpu_offload", "offload_optimizer"},
    {"cpu_offload_param", "offload_param"},
}};

// DeepSpeed's pydantic sections (the objects DropDefaultedValues looks into).
constexpr std::array<std::string_view, 8> kPydanticSections = {
    kZero,  kOffloadOptimizer, kOffloadParam,   "fp16",
    "bf16", "bfloat16",        "hybrid_engine", "tensor_parallel"};

// Whether "auto" at `key` of `section` is zoe's to read (the framework decides: StripAutoValues).
bool AutoIsZoes(std::string_view section, std::string_view key) {
  return key == "enabled" && (section == "fp16" || section == "bf16" || section == "bfloat16");
}

// The values of kTypedKeys converted as pydantic's lax mode converts them (ReadPydanticSections).
Status CoercePydanticValues(Json* document) {
  for (const TypedKey& entry : kTypedKeys) {
    for (std::string_view section : SpellingsOf(entry.section)) {
      if (section.empty()) continue;
      Json* object = ObjectAt(document, section);
      if (object == nullptr) continue;
      const auto it = object->find(std::string(entry.key));
      if (it != object->end()) ZOE_RETURN_IF_ERROR(Coerce(section, entry, &*it));
    }
  }
  return Status::Ok();
}

// kDeprecatedOffloads replaced by their sections, as DeepSpeedZeroConfig replaces them.
Status MapDeprecatedOffloadKeys(Json* document) {
  Json* zero = ObjectAt(document, kZero);
  if (zero == nullptr) return Status::Ok();
  if (const auto old = zero->find("cpu_offload_params"); old != zero->end()) {
    return Status::InvalidArgument(fmt::format(
        "zero_optimization.cpu_offload_params = {} is DeepSpeed's spelling before 0.7, which "
        "later releases refuse as an unknown key; for true write \"offload_param\": "
        "{{\"device\": \"cpu\"}}, for false remove it",
        DescribeJson(*old)));
  }
  for (const DeprecatedOffload& entry : kDeprecatedOffloads) {
    const auto it = zero->find(std::string(entry.key));
    if (it == zero->end()) continue;
    const Json value = *it;
    zero->erase(it);
    if (value == "auto") continue;  // DeepSpeed's models drop "auto" values
    if (zero->contains(entry.section)) {
      return Status::InvalidArgument(fmt::format(
          "zero_optimization.{0} and zero_optimization.{1} are both given; {0} is DeepSpeed's "
          "deprecated spelling of {1}, and DeepSpeed refuses the two together: keep {1}",
          entry.key, entry.section));
    }
    const bool on = value.is_boolean() && value.get<bool>();
    (*zero)[std::string(entry.section)] = Json{{"device", on ? "cpu" : "none"}};
  }
  return Status::Ok();
}

}  // namespace

void DropDefaultedValues(Json* document) {
  for (std::string_view section : kPydanticSections) {
    Json* object = ObjectAt(document, section);
    if (object == nullptr) continue;
    for (auto it = object->begin(); it != object->end();) {
      const bool offload =
          section == kZero && (it.key() == "offload_optimizer" || it.key() == "offload_param");
      if (offload && it->is_null()) {
        *it = Json{{"device", "none"}};  // DeepSpeed's None: no offload (zoe's default: cpu)
        ++it;
      } else if (it->is_null() || (*it == "auto" && !AutoIsZoes(section, it.key()))) {
        it = object->erase(it);
      } else {
        ++it;
      }
    }
  }
}

Status ReadPydanticSections(Json* document) {
  if (!document->is_object()) return Status::Ok();
  ZOE_RETURN_IF_ERROR(CoercePydanticValues(document));
  return MapDeprecatedOffloadKeys(document);
}

}  // namespace zoe::config
