// Logging through spdlog. One logger named "zoe"; its level comes from ZOE_LOG_LEVEL
// (trace|debug|info|warn|error|critical|off) at first use, and from configuration afterwards.
#pragma once

#include <spdlog/spdlog.h>

#include <string_view>

#include "core/status.h"

namespace zoe::log {

// The process-wide zoe logger (stderr), created on first use.
spdlog::logger& Get();

// Sets the level by name; an unknown name is an error listing the allowed names.
Status SetLevel(std::string_view level);

}  // namespace zoe::log

#define ZOE_LOG_TRACE(...) ::zoe::log::Get().trace(__VA_ARGS__)
#define ZOE_LOG_DEBUG(...) ::zoe::log::Get().debug(__VA_ARGS__)
#define ZOE_LOG_INFO(...) ::zoe::log::Get().info(__VA_ARGS__)
#define ZOE_LOG_WARN(...) ::zoe::log::Get().warn(__VA_ARGS__)
#define ZOE_LOG_ERROR(...) ::zoe::log::Get().error(__VA_ARGS__)
