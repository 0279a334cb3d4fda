// Description: zoe.arithmetic -- the optimizer kernels' exact (default) or fast arithmetic -- and
// zoe.stores -- their ordinary (default) or non-temporal stores -- are parsed, printed and refused
// with the allowed values.
#include <gtest/gtest.h>

#include <string>

#include "core/engine_config.h"

namespace zoe::config {
namespace {

TEST(EngineConfigArithmetic, ExactByDefaultFastWhenAskedAndPrinted) {
  Result<EngineConfig> plain = ParseEngineConfig("{}");
  ASSERT_TRUE(plain.ok()) << plain.status().ToString();
  EXPECT_EQ(plain->zoe.arithmetic, Arithmetic::kExact);
  EXPECT_EQ(ToJson(*plain)["zoe"]["arithmetic"], "exact");

  Result<EngineConfig> fast = ParseEngineConfig(R"({"zoe": {"arithmetic": "fast"}})");
  ASSERT_TRUE(fast.ok()) << fast.status().ToString();
  EXPECT_EQ(fast->zoe.arithmetic, Arithmetic::kFast);
  EXPECT_EQ(ToJson(*fast)["zoe"]["arithmetic"], "fast");
  // The printed configuration parses back to the same one.
  Result<EngineConfig> again = ParseEngineConfig(ToJson(*fast).dump());
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(again->zoe, fast->zoe);
}

TEST(EngineConfigArithmetic, UnknownValuesNameTheAllowedOnes) {
  Result<EngineConfig> bad = ParseEngineConfig(R"({"zoe": {"arithmetic": "approximate"}})");
  ASSERT_FALSE(bad.ok());
  const std::string message(bad.status().message());
  EXPECT_NE(message.find("zoe.arithmetic = 'approximate' is not allowed"), std::string::npos)
      << message;
  EXPECT_NE(message.find("allowed: exact, fast"), std::string::npos) << message;
}

TEST(EngineConfigStores, CachedByDefaultOthersWhenAskedAndPrinted) {
  Result<EngineConfig> plain = ParseEngineConfig("{}");
  ASSERT_TRUE(plain.ok()) << plain.status().ToString();
  EXPECT_EQ(plain->zoe.stores, StoreMode::kCached);
  EXPECT_EQ(ToJson(*plain)["zoe"]["stores"], "cached");
  for (StoreMode mode : {StoreMode::kAuto, StoreMode::kStreaming}) {
    const std::string name(StoreModeName(mode));
    Result<EngineConfig> asked = ParseEngineConfig(R"({"zoe": {"stores": ")" + name + R"("}})");
    ASSERT_TRUE(asked.ok()) << asked.status().ToString();
    EXPECT_EQ(asked->zoe.stores, mode);
    Result<EngineConfig> again = ParseEngineConfig(ToJson(*asked).dump());
    ASSERT_TRUE(again.ok()) << again.status().ToString();
    EXPECT_EQ(again->zoe, asked->zoe);
  }
}

TEST(EngineConfigStores, UnknownValuesNameTheAllowedOnes) {
  Result<EngineConfig> bad = ParseEngineConfig(R"({"zoe": {"stores": "nontemporal"}})");
  ASSERT_FALSE(bad.ok());
  const std::string message(bad.status().message());
  EXPECT_NE(message.find("zoe.stores = 'nontemporal' is not allowed"), std::string::npos)
      << message;
  EXPECT_NE(message.find("allowed: cached, auto, streaming"), std::string::npos) << message;
}

}  // namespace
}  // namespace zoe::config
