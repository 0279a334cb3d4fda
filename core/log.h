// Logging through spdlog. One logger named "zoe"; its level comes from ZOE_LOG_LEVEL
// (trace|debug|info|warn|error|critical|off) at first use, and from configuration afterwards.
#pragma once

#include <spdlog/spdlog.h>

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace zoe::log {

// The process-wide zoe logger (stderr), created on first use.
spdlog::logger& Get();

// Sets the level by name; an unknown name is an error listing the allowed names.
Status SetLevel(std::string_view level);

// Collects the messages the zoe logger emits while it lives (those its level lets through), in
// addition to the usual output. Thread-safe: other threads may log meanwhile. Used by tests that
// assert a warning was given, and given once.
class ScopedCapture {
 public:
  ScopedCapture();
  ~ScopedCapture();
  ScopedCapture(const ScopedCapture&) = delete;
  ScopedCapture& operator=(const ScopedCapture&) = delete;

  // Every captured message, formatted as "<level>: <text>" (e.g. "warning: ...").
  std::vector<std::string> messages() const;
  // How many captured messages contain `text`.
  size_t Count(std::string_view text) const;

 private:
  class Sink;
  std::shared_ptr<Sink> sink_;
};

}  // namespace zoe::log

#define ZOE_LOG_TRACE(...) ::zoe::log::Get().trace(__VA_ARGS__)
#define ZOE_LOG_DEBUG(...) ::zoe::log::Get().debug(__VA_ARGS__)
#define ZOE_LOG_INFO(...) ::zoe::log::Get().info(__VA_ARGS__)
#define ZOE_LOG_WARN(...) ::zoe::log::Get().warn(__VA_ARGS__)
#define ZOE_LOG_ERROR(...) ::zoe::log::Get().error(__VA_ARGS__)
