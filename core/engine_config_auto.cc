#include "core/engine_config_auto.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>

#include "core/engine_config.h"

namespace zoe::config {
namespace {

using Json = nlohmann::json;

constexpr std::string_view kAutoValue = "auto";

constexpr std::array<std::string_view, 7> kAutoKeyPaths = {
    "optimizer.params.lr",  "optimizer.params.betas",
    "optimizer.params.eps", "optimizer.params.weight_decay",
    "gradient_clipping",    "fp16.enabled",
    "bf16.enabled"};

// The object holding the last part of `path` and that part, or null when a section on the way
// is absent or not an object.
std::pair<Json*, std::string> Parent(Json* document, std::string_view path) {
  Json* node = document;
  size_t begin = 0;
  for (size_t dot = path.find('.'); dot != std::string_view::npos; dot = path.find('.', begin)) {
    const std::string section(path.substr(begin, dot - begin));
    if (!node->is_object() || !node->contains(section)) return {nullptr, {}};
    node = &(*node)[section];
    begin = dot + 1;
  }
  if (!node->is_object()) return {nullptr, {}};
  return {node, std::string(path.substr(begin))};
}

std::string_view AllowedFor(std::string_view path) {
  if (path.ends_with(".enabled")) return "true or false, or \"auto\" (decided by the framework)";
  if (path.ends_with(".betas")) {
    return "two numbers [beta1, beta2], or \"auto\" (decided by the framework)";
  }
  return "a number, or \"auto\" (decided by the framework)";
}

bool IsAutoKeyPath(std::string_view path) {
  return std::find(kAutoKeyPaths.begin(), kAutoKeyPaths.end(), path) != kAutoKeyPaths.end();
}

// The top-level "auto" list: paths ToJson printed as decided by the framework.
Status ReadAutoList(const Json& list, std::vector<std::string>* auto_keys) {
  if (!list.is_array()) {
    return Status::InvalidArgument(
        fmt::format("auto = {} is not a list; allowed: a list of key paths from {}", list.dump(),
                    fmt::join(kAutoKeyPaths, ", ")));
  }
  for (size_t i = 0; i < list.size(); ++i) {
    if (!list[i].is_string() || !IsAutoKeyPath(list[i].get<std::string>())) {
      return Status::InvalidArgument(
          fmt::format("auto[{}] = {} is not a key that may be \"auto\"; allowed: {}", i,
                      list[i].dump(), fmt::join(kAutoKeyPaths, ", ")));
    }
    auto_keys->push_back(list[i].get<std::string>());
  }
  return Status::Ok();
}

}  // namespace

std::span<const std::string_view> AutoKeyPaths() { return kAutoKeyPaths; }

Status StripAutoValues(Json* document, std::vector<std::string>* auto_keys) {
  if (!document->is_object()) return Status::Ok();  // the reader reports it
  for (std::string_view path : kAutoKeyPaths) {
    auto [parent, key] = Parent(document, path);
    if (parent == nullptr || !parent->contains(key) || !(*parent)[key].is_string()) continue;
    const std::string value = (*parent)[key].get<std::string>();
    if (value != kAutoValue) {
      const std::string closest = ClosestMatch(value, std::vector<std::string>{"auto"});
      return Status::InvalidArgument(
          fmt::format("{}: expected {}, got \"{}\"{}", path, AllowedFor(path), value,
                      closest.empty() ? "" : "; did you mean \"auto\"?"));
    }
    parent->erase(key);
    auto_keys->emplace_back(path);
  }
  if (document->contains("auto")) {
    ZOE_RETURN_IF_ERROR(ReadAutoList((*document)["auto"], auto_keys));
    document->erase("auto");
  }
  std::sort(auto_keys->begin(), auto_keys->end());
  auto_keys->erase(std::unique(auto_keys->begin(), auto_keys->end()), auto_keys->end());
  return Status::Ok();
}

Json AutoKeyValue(const EngineConfig& config, std::string_view path) {
  const HyperParams& optimizer = config.optimizer;
  if (path == "optimizer.params.lr") return optimizer.lr;
  if (path == "optimizer.params.betas") return Json{optimizer.beta1, optimizer.beta2};
  if (path == "optimizer.params.eps") return optimizer.eps;
  if (path == "optimizer.params.weight_decay") return optimizer.weight_decay;
  if (path == "gradient_clipping") return config.gradient_clipping;
  if (path == "fp16.enabled") return config.fp16.enabled;
  if (path == "bf16.enabled") return config.bf16.enabled;
  return nullptr;
}

std::string DescribeAutoValues(const EngineConfig& config) {
  if (config.auto_keys.empty()) return {};
  std::vector<std::string> values;
  for (const std::string& path : config.auto_keys) {
    values.push_back(fmt::format("{} = {}", path, AutoKeyValue(config, path).dump()));
  }
  return fmt::format(
      "\"auto\" values (decided by the framework; zoe's defaults until an optimizer group gives "
      "them): {}",
      fmt::join(values, ", "));
}

}  // namespace zoe::config
