// Description: logging: level names (including the documented short "warn") and message capture.
#include "core/log.h"

#include <gtest/gtest.h>

#include <thread>
#include <vector>

namespace zoe {
namespace {

TEST(Log, AcceptsEveryDocumentedLevelName) {
  for (const char* level :
       {"trace", "debug", "info", "warn", "warning", "error", "critical", "off"}) {
    EXPECT_TRUE(log::SetLevel(level).ok()) << level;
  }
  EXPECT_TRUE(log::SetLevel("warn").ok());
  EXPECT_EQ(log::Get().level(), spdlog::level::warn);
}

TEST(Log, UnknownLevelListsTheAllowedNames) {
  Status status = log::SetLevel("loud");
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(
      status.message(),
      "log level 'loud' is not a level; allowed: trace, debug, info, warn, error, critical, off");
}

TEST(Log, CaptureSeesMessagesTheLevelLetsThroughWhileItLives) {
  ASSERT_TRUE(log::SetLevel("warn").ok());
  ZOE_LOG_WARN("before capture");
  {
    log::ScopedCapture capture;
    ZOE_LOG_INFO("filtered out {}", 1);
    ZOE_LOG_WARN("disk {} is slow", "/nvme0");
    ZOE_LOG_ERROR("disk {} failed", "/nvme1");
    EXPECT_EQ(capture.messages(), (std::vector<std::string>{"warning: disk /nvme0 is slow",
                                                            "error: disk /nvme1 failed"}));
    EXPECT_EQ(capture.Count("disk"), 2u);
    EXPECT_EQ(capture.Count("before capture"), 0u);
  }
  log::ScopedCapture later;
  ZOE_LOG_WARN("after");
  EXPECT_EQ(later.Count("slow"), 0u);
  EXPECT_EQ(later.Count("after"), 1u);
}

TEST(Log, CaptureIsSafeWhileOtherThreadsLog) {
  ASSERT_TRUE(log::SetLevel("warn").ok());
  std::vector<std::thread> threads;
  log::ScopedCapture capture;
  for (int t = 0; t < 3; ++t) {
    threads.emplace_back([t] {
      for (int i = 0; i < 10; ++i) ZOE_LOG_WARN("thread {} message {}", t, i);
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(capture.Count("message"), 30u);
}

}  // namespace
}  // namespace zoe
