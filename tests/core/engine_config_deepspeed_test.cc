// Description: DeepSpeed documents the engine accepts as DeepSpeed does and refuses where zoe
// would train differently: Python's non-finite numbers.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "core/engine_config.h"
#include "tests/core/engine_config_parse.h"

namespace zoe::config {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using Json = nlohmann::json;

// ---------------------------------------------------------------------------------------------
// Non-finite numbers

// accelerate writes "steps_per_print": float("inf"), which json.dumps prints as Infinity.
TEST(EngineConfigDeepSpeed, PythonsNonFiniteNumbersAreAcceptedWhereZoeIgnoresTheKey) {
  const EngineConfig config = ParseOk(R"({"steps_per_print": Infinity,
      "flops_profiler": {"profile_step": -Infinity, "threshold": NaN},
      "optimizer": {"params": {"lr": 2e-4}}, "wandb": {"project": "NaN Infinity"}})");
  EXPECT_THAT(config.ignored_keys, ElementsAre("flops_profiler", "steps_per_print", "wandb"));
  EXPECT_DOUBLE_EQ(config.optimizer.lr, 2e-4);
  Result<Json> document = ParseConfigJson(R"({"a": [NaN, -Infinity, Infinity], "s": "NaN"})");
  ASSERT_TRUE(document.ok()) << document.status().ToString();
  EXPECT_TRUE(std::isnan((*document)["a"][0].get<double>()));
  EXPECT_EQ((*document)["a"][1].get<double>(), -HUGE_VAL);
  EXPECT_EQ((*document)["a"][2].get<double>(), HUGE_VAL);
  EXPECT_EQ((*document)["s"], "NaN");  // inside a string it stays text
  EXPECT_EQ(DescribeJson((*document)["a"]), "[NaN,-Infinity,Infinity]");
}

TEST(EngineConfigDeepSpeed, NonFiniteNumbersWhereZoeNeedsANumberAreRefusedNamingTheKey) {
  EXPECT_THAT(ParseError(R"({"optimizer": {"params": {"lr": Infinity}}})"),
              HasSubstr("optimizer.params.lr = Infinity is out of range; allowed: 0..1e+300"));
  EXPECT_THAT(ParseError(R"({"gradient_clipping": NaN})"),
              HasSubstr("gradient_clipping = NaN is out of range"));
  EXPECT_THAT(ParseError(R"({"zero_optimization": {"stage": Infinity}})"),
              HasSubstr("zero_optimization.stage: expected an integer in 0..3, got Infinity"));
  EXPECT_THAT(ParseError(R"({"optimizer": {"params": {"betas": [0.9, NaN]}}})"),
              HasSubstr("optimizer.params.betas = [0.9,NaN] is out of range"));
  EXPECT_THAT(ParseError(R"({"zoe": {"host_budget": Infinity}})"),
              HasSubstr("zoe.host_budget: size Infinity is not finite"));
}

TEST(EngineConfigDeepSpeed, NonFiniteTokensKeepSyntaxErrorPositionsAndPlainJsonStaysStrict) {
  // The error is at the '}' after the last colon: byte 36 of the text as written.
  const std::string bad = R"({"steps_per_print": -Infinity, "x": })";
  EXPECT_THAT(ParseError(bad), HasSubstr("byte offset 36 (line 1, column 37)"));
  EXPECT_THAT(ParseError(R"({"steps_per_print": Infinit})"), HasSubstr("JSON syntax error"));
  EXPECT_THAT(ParseError(R"({"steps_per_print": NaNa})"), HasSubstr("JSON syntax error"));
  EXPECT_FALSE(ParseJson(R"({"steps_per_print": Infinity})").ok());  // checkpoint manifests
  // A document that writes the marker's escape itself is parsed as plain JSON.
  const Result<Json> escaped = ParseConfigJson(R"({"s": "\u0000NaN", "n": 1})");
  ASSERT_TRUE(escaped.ok());
  EXPECT_EQ((*escaped)["s"], std::string("\0NaN", 4));
  EXPECT_FALSE(ParseConfigJson(R"({"s": "\u0000", "n": NaN})").ok());
}

}  // namespace
}  // namespace zoe::config
