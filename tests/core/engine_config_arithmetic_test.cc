// Description: zoe.arithmetic -- the optimizer kernels' exact (default) or fast arithmetic -- and
// zoe.stores -- their ordinary (default) or non-temporal stores -- are parsed, printed and refused
// with the allowed values.
#include <gtest/gtest.h>

#include <string>

#include "core/engine_config.h"

namespace zoe::config {
namespace {

// {"zoe": {key: value}} parsed, checked to parse back from its printed form to the same one.
EngineConfig ParsedAndReprinted(const std::string& key, const std::string& value) {
  Result<EngineConfig> asked =
      ParseEngineConfig(R"({"zoe": {")" + key + R"(": ")" + value + R"("}})");
  EXPECT_TRUE(asked.ok()) << asked.status().ToString();
  if (!asked.ok()) return {};
  EXPECT_EQ(ToJson(*asked)["zoe"][key], value);
  Result<EngineConfig> again = ParseEngineConfig(ToJson(*asked).dump());
  EXPECT_TRUE(again.ok()) << again.status().ToString();
  if (again.ok()) {
    EXPECT_EQ(again->zoe, asked->zoe);
  }
  return *asked;
}

// {"zoe": {key: value}} refused with a message naming the key, the value and `allowed`.
void ExpectRefused(const std::string& key, const std::string& value, const std::string& allowed) {
  Result<EngineConfig> bad =
      ParseEngineConfig(R"({"zoe": {")" + key + R"(": ")" + value + R"("}})");
  ASSERT_FALSE(bad.ok());
  const std::string message(bad.status().message());
  EXPECT_NE(message.find("zoe." + key + " = '" + value + "' is not allowed"), std::string::npos)
      << message;
  EXPECT_NE(message.find("allowed: " + allowed), std::string::npos) << message;
}

TEST(EngineConfigArithmetic, ExactByDefaultFastWhenAskedAndPrinted) {
  Result<EngineConfig> plain = ParseEngineConfig("{}");
  ASSERT_TRUE(plain.ok()) << plain.status().ToString();
  EXPECT_EQ(plain->zoe.arithmetic, Arithmetic::kExact);
  EXPECT_EQ(ToJson(*plain)["zoe"]["arithmetic"], "exact");
  EXPECT_EQ(ParsedAndReprinted("arithmetic", "fast").zoe.arithmetic, Arithmetic::kFast);
}

TEST(EngineConfigArithmetic, UnknownValuesNameTheAllowedOnes) {
  ExpectRefused("arithmetic", "approximate", "exact, fast");
}

TEST(EngineConfigStores, CachedByDefaultOthersWhenAskedAndPrinted) {
  Result<EngineConfig> plain = ParseEngineConfig("{}");
  ASSERT_TRUE(plain.ok()) << plain.status().ToString();
  EXPECT_EQ(plain->zoe.stores, StoreMode::kCached);
  EXPECT_EQ(ToJson(*plain)["zoe"]["stores"], "cached");
  for (StoreMode mode : {StoreMode::kAuto, StoreMode::kStreaming}) {
    EXPECT_EQ(ParsedAndReprinted("stores", std::string(StoreModeName(mode))).zoe.stores, mode);
  }
}

TEST(EngineConfigStores, UnknownValuesNameTheAllowedOnes) {
  ExpectRefused("stores", "nontemporal", "cached, auto, streaming");
}

}  // namespace
}  // namespace zoe::config
