#include "core/log.h"

#include <spdlog/sinks/base_sink.h>
#include <spdlog/sinks/dist_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>

#include <algorithm>
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
  if (name == "warn") {  // spdlog spells it "warning"; the short form is the documented one
    *out = spdlog::level::warn;
    return true;
  }
  return false;
}

// The logger writes through a distributing sink so captures can be attached and detached while
// other threads log (dist_sink_mt guards its sink list with a mutex).
std::shared_ptr<spdlog::sinks::dist_sink_mt>& Distributor() {
  static auto distributor = [] {
    auto dist = std::make_shared<spdlog::sinks::dist_sink_mt>();
    dist->add_sink(std::make_shared<spdlog::sinks::stderr_color_sink_mt>());
    return dist;
  }();
  return distributor;
}

std::shared_ptr<spdlog::logger> MakeLogger() {
  auto logger = std::make_shared<spdlog::logger>("zoe", Distributor());
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

// Stores each message as "<level>: <text>"; base_sink<std::mutex> serialises sink_it_ and the
// reads below share that mutex.
class ScopedCapture::Sink : public spdlog::sinks::base_sink<std::mutex> {
 public:
  std::vector<std::string> messages() {
    std::lock_guard lock(mutex_);
    return messages_;
  }

 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    std::string line(spdlog::level::to_string_view(msg.level).data(),
                     spdlog::level::to_string_view(msg.level).size());
    line += ": ";
    line.append(msg.payload.data(), msg.payload.size());
    messages_.push_back(std::move(line));
  }
  void flush_() override {}

 private:
  std::vector<std::string> messages_;
};

ScopedCapture::ScopedCapture() : sink_(std::make_shared<Sink>()) {
  Get();  // the distributor's first user creates the logger
  Distributor()->add_sink(sink_);
}

ScopedCapture::~ScopedCapture() { Distributor()->remove_sink(sink_); }

std::vector<std::string> ScopedCapture::messages() const { return sink_->messages(); }

size_t ScopedCapture::Count(std::string_view text) const {
  const std::vector<std::string> all = messages();
  return static_cast<size_t>(std::count_if(all.begin(), all.end(), [&](const std::string& m) {
    return m.find(text) != std::string::npos;
  }));
}

}  // namespace zoe::log
