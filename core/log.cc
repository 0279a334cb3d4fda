#include "core/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>

#include <cstdlib>
#include <mutex>
#include <string>

namespace zoe::log {
namespace {

constexpr std::string_view kLevelNames = "trace, debug, info, warn, error, critical, off";

bool ParseLevel(std::string_view name, spdlog::level::level_enum* out) {
  for (int i = 0; i < spdlog::level::n_levels; ++i) {
    auto level = static_cast<spdlog::level::level_enum>(i);
    if (spdlog::level::to_string_view(level) == name) {
      *out = level;
      return true;
    }
  }
  if (name == "warning") {
    *out = spdlog::level::warn;
    return true;
  }
  return false;
}

std::shared_ptr<spdlog::logger> MakeLogger() {
  auto logger = spdlog::stderr_color_mt("zoe");
  logger->set_pattern("[%H:%M:%S.%e] [zoe] [%^%l%$] %v");
  logger->set_level(spdlog::level::info);
  if (const char* env = std::getenv("ZOE_LOG_LEVEL")) {
    spdlog::level::level_enum level;
    if (ParseLevel(env, &level)) {
      logger->set_level(level);
    } else {
      logger->warn("ZOE_LOG_LEVEL='{}' is not a level; allowed: {}", env, kLevelNames);
    }
  }
  return logger;
}

}  // namespace

spdlog::logger& Get() {
  static std::shared_ptr<spdlog::logger> logger = MakeLogger();
  return *logger;
}

Status SetLevel(std::string_view level) {
  spdlog::level::level_enum parsed;
  if (!ParseLevel(level, &parsed)) {
    return Status::InvalidArgument("log level '" + std::string(level) +
                                   "' is not a level; allowed: " + std::string(kLevelNames));
  }
  Get().set_level(parsed);
  return Status::Ok();
}

}  // namespace zoe::log
