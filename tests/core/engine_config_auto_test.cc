// Description: "auto" configuration values — Hugging Face's ds_config_zero3.json as its
// documentation writes it parses, "auto" keeps zoe's defaults and is recorded, printed and read
// back, and anything else where "auto" may stand (a typo such as "atuo") is a clear error.
#include "core/engine_config_auto.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <iterator>
#include <string>

#include "core/engine_config.h"
#include "tests/core/engine_config_parse.h"

namespace zoe::config {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using Json = nlohmann::json;

// Hugging Face Transformers' DeepSpeed integration, "ZeRO-3 Example" (ds_config_zero3.json), as
// its documentation writes it; the Python tests read the same file.
std::string HuggingFaceZero3Config() {
  std::ifstream in(std::string(ZOE_TEST_DATA_DIR) + "/hf_ds_config_zero3.json");
  EXPECT_TRUE(in.good()) << "cannot read " << ZOE_TEST_DATA_DIR << "/hf_ds_config_zero3.json";
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

TEST(EngineConfigAuto, TheHuggingFaceZero3ExampleParsesWithZoesDefaultsForAutoValues) {
  const EngineConfig config = ParseOk(HuggingFaceZero3Config());
  const EngineConfig defaults;
  EXPECT_THAT(
      config.auto_keys,
      ElementsAre("bf16.enabled", "fp16.enabled", "gradient_clipping", "optimizer.params.betas",
                  "optimizer.params.eps", "optimizer.params.lr", "optimizer.params.weight_decay"));
  EXPECT_EQ(config.optimizer, defaults.optimizer);
  EXPECT_EQ(config.gradient_clipping, 0.0);
  EXPECT_FALSE(config.fp16.enabled);
  EXPECT_FALSE(config.bf16.enabled);
  // The keys around the "auto" values are read as usual.
  EXPECT_EQ(config.fp16.loss_scale_window, 1000u);
  EXPECT_EQ(config.zero.sub_group_size, 1'000'000'000u);
  EXPECT_EQ(config.zero.offload_param.device, OffloadDevice::kCpu);
  EXPECT_TRUE(config.zero.offload_optimizer.pin_memory);
  // "auto" in a pydantic section is the key's default, as DeepSpeed's models drop it.
  EXPECT_THAT(config.framework_keys,
              ::testing::Not(::testing::Contains("zero_optimization.reduce_bucket_size")));
  EXPECT_THAT(config.framework_keys, ::testing::Contains("train_batch_size"));
}

TEST(EngineConfigAuto, EffectiveConfigurationShowsTheChosenValuesAndWhichCameFromAuto) {
  const EngineConfig config = ParseOk(R"({"optimizer": {"params": {"lr": "auto", "eps": 1e-6}},
                                          "gradient_clipping": "auto"})");
  const Json printed = ToJson(config);
  EXPECT_EQ(printed["optimizer"]["params"]["lr"], 1e-3);
  EXPECT_EQ(printed["optimizer"]["params"]["eps"], 1e-6);
  EXPECT_EQ(printed["gradient_clipping"], 0.0);
  EXPECT_EQ(printed["auto"], Json({"gradient_clipping", "optimizer.params.lr"}));
  EXPECT_EQ(DescribeAutoValues(config),
            "\"auto\" values (decided by the framework; zoe's defaults until an optimizer group "
            "gives them): gradient_clipping = 0.0, optimizer.params.lr = 0.001");
  // The printed document reads back to the same configuration.
  Result<EngineConfig> again = ParseEngineConfigDocument(printed);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_TRUE(*again == config);
  EXPECT_EQ(ToJson(*again), printed);
  // Without "auto" values nothing is printed about them.
  EXPECT_FALSE(ToJson(ParseOk("{}")).contains("auto"));
  EXPECT_EQ(DescribeAutoValues(ParseOk("{}")), "");
}

TEST(EngineConfigAuto, AnythingButAutoWhereAutoMayStandIsAClearError) {
  EXPECT_EQ(ParseError(R"({"optimizer": {"params": {"lr": "atuo"}}})"),
            "optimizer.params.lr: expected a number, or \"auto\" (decided by the framework), got "
            "\"atuo\"; did you mean \"auto\"?");
  EXPECT_THAT(ParseError(R"({"fp16": {"enabled": "Auto!"}})"),
              HasSubstr("fp16.enabled = \"Auto!\" is not allowed; allowed: true or false"));
  EXPECT_THAT(ParseError(R"({"bf16": {"enabled": "atuo"}})"), HasSubstr("did you mean \"auto\"?"));
  EXPECT_THAT(ParseError(R"({"optimizer": {"params": {"betas": "atuo"}}})"),
              HasSubstr("optimizer.params.betas: expected two numbers [beta1, beta2], or "
                        "\"auto\" (decided by the framework), got \"atuo\"; did you mean"));
  EXPECT_THAT(ParseError(R"({"gradient_clipping": "none"})"),
              HasSubstr("gradient_clipping: expected a number, or \"auto\""));
  // "auto" where zoe decides no such value stays an error of that key.
  EXPECT_THAT(ParseError(R"({"zoe": {"chunk_size": "auto"}})"), HasSubstr("zoe.chunk_size"));
  EXPECT_THAT(ParseError(R"({"optimizer": {"type": "auto"}})"), HasSubstr("optimizer.type"));
  // The printed "auto" list names only keys that may be "auto".
  EXPECT_THAT(ParseError(R"({"auto": ["zoe.chunk_size"]})"),
              HasSubstr("auto[0] = \"zoe.chunk_size\" is not a key that may be \"auto\"; "
                        "allowed: optimizer.params.lr"));
  EXPECT_THAT(ParseError(R"({"auto": "optimizer.params.lr"})"), HasSubstr("is not a list"));
}

TEST(EngineConfigAuto, EveryAutoKeyPathHasAValue) {
  const EngineConfig defaults;
  for (std::string_view path : AutoKeyPaths()) {
    EXPECT_FALSE(AutoKeyValue(defaults, path).is_null()) << path;
  }
  EXPECT_TRUE(AutoKeyValue(defaults, "zoe.chunk_size").is_null());
}

}  // namespace
}  // namespace zoe::config
