// ParseOk and ParseError: how the engine configuration's tests parse a document that must be
// accepted, or refused as an invalid argument.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <string_view>

#include "core/engine_config.h"

namespace zoe::config {

// The configuration of a document that must parse; a test failure naming it otherwise.
inline EngineConfig ParseOk(std::string_view text) {
  Result<EngineConfig> parsed = ParseEngineConfig(text);
  EXPECT_TRUE(parsed.ok()) << text << "\n" << parsed.status().ToString();
  return parsed.ok() ? *parsed : EngineConfig{};
}

// The error message of a document that must be refused as an invalid argument.
inline std::string ParseError(std::string_view text) {
  Result<EngineConfig> parsed = ParseEngineConfig(text);
  if (parsed.ok()) {
    ADD_FAILURE() << "accepted: " << text;
    return {};
  }
  EXPECT_EQ(parsed.status().code(), StatusCode::kInvalidArgument) << parsed.status().ToString();
  return std::string(parsed.status().message());
}

}  // namespace zoe::config
