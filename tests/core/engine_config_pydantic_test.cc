// Description: the sections DeepSpeed reads with pydantic read as pydantic reads them (quoted
// booleans and numbers converted, other strings refused naming the key, "auto" and the other
// sections left alone), switches that apply with fp16 on when fp16.enabled is "auto", the
// deprecated offload switches, load_from_fp32_weights and the precision keys of the framework.
#include "core/engine_config_pydantic.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "core/engine_config.h"
#include "tests/core/engine_config_parse.h"

namespace zoe::config {
namespace {

using ::testing::Contains;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;
using Json = nlohmann::json;

// ---------------------------------------------------------------------------------------------
// Quoted values

TEST(EngineConfigPydantic, QuotedBooleansAndNumbersOfPydanticSectionsAreConverted) {
  const EngineConfig config = ParseOk(R"({
    "zero_optimization": {"stage": "2", "sub_group_size": " 1_000 ",
                          "zero_quantized_weights": "false", "zero_quantized_gradients": "No",
                          "overlap_comm": 1, "stage3_max_live_parameters": "1000000000",
                          "offload_optimizer": {"device": "cpu", "pin_memory": "TRUE",
                                                "buffer_count": "8.0", "ratio": "1e0"}},
    "fp16": {"enabled": "true", "loss_scale": "0.5", "loss_scale_window": "+500",
             "consecutive_hysteresis": "on", "min_loss_scale": "1e-2", "auto_cast": "f"},
    "hybrid_engine": {"enabled": "off", "max_out_tokens": "512"},
    "tensor_parallel": {"autotp_size": "1"}})");
  EXPECT_EQ(config.zero.stage, 2u);
  EXPECT_EQ(config.zero.sub_group_size, 1000u);
  EXPECT_TRUE(config.zero.offload_optimizer.pin_memory);
  EXPECT_EQ(config.zero.offload_optimizer.buffer_count, 8u);
  EXPECT_EQ(config.zero.offload_optimizer.ratio, 1.0);
  EXPECT_TRUE(config.fp16.enabled);
  EXPECT_EQ(config.fp16.loss_scale, 0.5);
  EXPECT_EQ(config.fp16.loss_scale_window, 500u);
  EXPECT_TRUE(config.fp16.consecutive_hysteresis);
  EXPECT_DOUBLE_EQ(config.fp16.min_loss_scale, 0.01);
  // Megatron-DeepSpeed's spelling of bf16, and 0 and 1 where a bool is wanted.
  EXPECT_TRUE(ParseOk(R"({"bfloat16": {"enabled": "Yes"}})").bf16.enabled);
  EXPECT_FALSE(ParseOk(R"({"fp16": {"enabled": 0}})").fp16.enabled);
}

TEST(EngineConfigPydantic, ValuesPydanticRefusesAreRefusedNamingTheKeyAndTheValue) {
  struct Case {
    const char* document;
    const char* message;
  };
  const std::vector<Case> cases = {
      {R"({"zero_optimization": {"zero_quantized_weights": "maybe"}})",
       "zero_optimization.zero_quantized_weights = \"maybe\" is not allowed; allowed: true or "
       "false (DeepSpeed's pydantic also takes 0 and 1, and \"true\", \"false\", \"yes\""},
      {R"({"zero_optimization": {"overlap_comm": 2}})",
       "zero_optimization.overlap_comm = 2 is not allowed; allowed: true or false"},
      {R"({"zero_optimization": {"contiguous_gradients": " true"}})",
       "zero_optimization.contiguous_gradients = \" true\" is not allowed"},
      {R"({"zero_optimization": {"sub_group_size": "1e9"}})",
       "zero_optimization.sub_group_size = \"1e9\" is not allowed; allowed: an integer "
       "(DeepSpeed's pydantic also takes one quoted, such as \"2\" or \"2.0\", but not \"1e9\" "
       "or \"2.5\")"},
      {R"({"zero_optimization": {"stage": "2.5"}})", "zero_optimization.stage = \"2.5\""},
      {R"({"zero_optimization": {"stage": "2."}})", "zero_optimization.stage = \"2.\""},
      {R"({"zero_optimization": {"offload_param": {"buffer_count": "1__0"}}})",
       "zero_optimization.offload_param.buffer_count = \"1__0\" is not allowed"},
      {R"({"zero_optimization": {"offload_optimizer": {"ratio": "half"}}})",
       "zero_optimization.offload_optimizer.ratio = \"half\" is not allowed; allowed: a number "
       "(DeepSpeed's pydantic also takes one quoted, such as \"0.5\" or \"1e9\")"},
      {R"({"fp16": {"loss_scale": "0x10"}})", "fp16.loss_scale = \"0x10\" is not allowed"},
      {R"({"fp16": {"enabled": [true]}})", "fp16.enabled = [true] is not allowed"},
      {R"({"bfloat16": {"enabled": "enabled"}})", "bfloat16.enabled = \"enabled\""},
      {R"({"hybrid_engine": {"max_out_tokens": {}}})",
       "hybrid_engine.max_out_tokens = an object is not allowed"},
  };
  for (const Case& c : cases) EXPECT_THAT(ParseError(c.document), HasSubstr(c.message));
}

TEST(EngineConfigPydantic, ConvertedSwitchesAreCheckedAsTheirValues) {
  EXPECT_THAT(ParseError(R"({"tensor_parallel": {"autotp_size": "2"}})"),
              HasSubstr("tensor_parallel.autotp_size = 2: with it DeepSpeed splits"));
  EXPECT_THAT(ParseError(R"({"zero_optimization": {"zero_quantized_weights": "yes"}})"),
              HasSubstr("zero_optimization.zero_quantized_weights = true: with it DeepSpeed"));
  EXPECT_THAT(ParseError(R"({"hybrid_engine": {"enabled": "1"}})"),
              HasSubstr("hybrid_engine.enabled = true:"));
  // get_scalar_param sections convert nothing: a quoted "false" is true for Python there.
  EXPECT_THAT(ParseError(R"({"amp": {"enabled": "false"}})"), HasSubstr("amp.enabled = \"false\""));
  EXPECT_THAT(ParseError(R"({"gradient_clipping": "1.0"})"),
              HasSubstr("gradient_clipping: expected a number"));
  EXPECT_THAT(ParseError(R"({"optimizer": {"params": {"lr": "1e-3"}}})"),
              HasSubstr("optimizer.params.lr: expected a number"));
}

TEST(EngineConfigPydantic, AutoAndNullInPydanticSectionsAreTheirDefaults) {
  const EngineConfig config = ParseOk(R"({"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
      "zero_optimization": {"stage3_prefetch_bucket_size": "auto", "reduce_bucket_size": "auto",
                            "stage3_param_persistence_threshold": "auto", "overlap_comm": null,
                            "sub_group_size": "auto"}})");
  EXPECT_THAT(config.auto_keys, Contains("fp16.enabled"));  // the framework's to decide
  EXPECT_THAT(config.ignored_keys, Not(Contains("zero_optimization.stage3_prefetch_bucket_size")));
  EXPECT_EQ(config.zero.sub_group_size, ParseOk("{}").zero.sub_group_size);
  EXPECT_THAT(ParseError(R"({"fp16": {"enabled": "atuo"}})"), HasSubstr("fp16.enabled = \"atuo\""));
  // accelerate's generated section: an Optional path as null, and "auto" inside an offload section
  const EngineConfig accelerate = ParseOk(R"({"zero_optimization": {"stage": 2,
      "offload_optimizer": {"device": "none", "nvme_path": null, "pin_memory": "auto"},
      "offload_param": {"device": "none", "nvme_path": null}}})");
  EXPECT_EQ(accelerate.zero.offload_optimizer.device, OffloadDevice::kNone);
  // A section given as null is DeepSpeed's None: no offload (zoe's default is the CPU).
  EXPECT_EQ(ParseOk(R"({"zero_optimization": {"offload_optimizer": null}})")
                .zero.offload_optimizer.device,
            OffloadDevice::kNone);
}

TEST(EngineConfigPydantic, CoercionLeavesDocumentsWithoutPydanticSectionsAlone) {
  Json document = Json::parse(R"({"amp": {"enabled": "false"}, "zero_optimization": 1,
      "fp16": "yes", "steps_per_print": "10"})");
  const Json before = document;
  ASSERT_TRUE(ReadPydanticSections(&document).ok());
  EXPECT_EQ(document, before);
  Json numbers = Json::parse(R"({"zero_optimization": {"stage": "-0", "reduce_bucket_size":
      "99999999999999999999999", "sub_group_size": "18446744073709551615"},
      "fp16": {"loss_scale": " -inf ", "min_loss_scale": "1_0.5"}})");
  ASSERT_TRUE(ReadPydanticSections(&numbers).ok());
  EXPECT_EQ(numbers["zero_optimization"]["stage"], 0);
  EXPECT_EQ(numbers["zero_optimization"]["reduce_bucket_size"], 1e23);
  EXPECT_EQ(numbers["zero_optimization"]["sub_group_size"], 18446744073709551615u);
  EXPECT_EQ(numbers["fp16"]["loss_scale"], -HUGE_VAL);
  EXPECT_EQ(numbers["fp16"]["min_loss_scale"], 10.5);
}

// ---------------------------------------------------------------------------------------------
// Switches that apply with fp16 on, under fp16.enabled "auto"

TEST(EngineConfigPydantic, Fp16SwitchesAreRefusedWhenFp16EnabledIsAuto) {
  EXPECT_THAT(ParseError(R"({"fp16": {"enabled": "auto", "auto_cast": true}})"),
              HasSubstr("fp16.auto_cast = true with fp16.enabled = \"auto\" (DeepSpeed reads the "
                        "switch whatever \"auto\" becomes): with it DeepSpeed casts the "
                        "floating-point inputs of forward to fp16, which zoe does not do; cast "
                        "the inputs to torch.half before calling the engine, and set "
                        "fp16.auto_cast to false"));
  EXPECT_THAT(ParseError(R"({"fp16": {"enabled": "auto", "fp16_master_weights_and_grads": 1}})"),
              HasSubstr("fp16.fp16_master_weights_and_grads = true with fp16.enabled = \"auto\""));
  // The "auto" list ToJson prints says the same.
  EXPECT_THAT(ParseError(R"({"auto": ["fp16.enabled"], "fp16": {"auto_cast": "true"}})"),
              HasSubstr("fp16.auto_cast = true with fp16.enabled = \"auto\""));
  EXPECT_THAT(ParseOk(R"({"fp16": {"enabled": "auto", "auto_cast": false}})").auto_keys,
              Contains("fp16.enabled"));
  ParseOk(R"({"fp16": {"enabled": false, "auto_cast": true}})");
}

// ---------------------------------------------------------------------------------------------
// Deprecated offload switches, load_from_fp32_weights, the framework's precision keys

TEST(EngineConfigPydantic, DeprecatedOffloadSwitchesStandForTheirSections) {
  const EngineConfig on = ParseOk(R"({"zero_optimization": {"stage": 3, "cpu_offload": true,
      "cpu_offload_param": "true", "cpu_offload_use_pin_memory": true}})");
  EXPECT_EQ(on.zero.offload_optimizer.device, OffloadDevice::kCpu);
  EXPECT_EQ(on.zero.offload_param.device, OffloadDevice::kCpu);
  EXPECT_THAT(on.ignored_keys, Contains("zero_optimization.cpu_offload_use_pin_memory"));
  EXPECT_THAT(on.ignored_keys, Not(Contains("zero_optimization.cpu_offload")));
  // false is DeepSpeed's offload_optimizer None: nothing offloaded (zoe's own default is cpu).
  const EngineConfig off = ParseOk(R"({"zero_optimization": {"stage": 2, "cpu_offload": false,
      "cpu_offload_param": null}})");
  EXPECT_EQ(off.zero.offload_optimizer.device, OffloadDevice::kNone);
  EXPECT_EQ(off.zero.offload_param.device, OffloadDevice::kNone);
  EXPECT_EQ(
      ParseOk(R"({"zero_optimization": {"cpu_offload": "auto"}})").zero.offload_optimizer.device,
      OffloadDevice::kCpu);
  EXPECT_THAT(ParseError(R"({"zero_optimization": {"cpu_offload": false,
      "offload_optimizer": {"device": "cpu"}}})"),
              HasSubstr("zero_optimization.cpu_offload and zero_optimization.offload_optimizer "
                        "are both given; cpu_offload is DeepSpeed's deprecated spelling of "
                        "offload_optimizer, and DeepSpeed refuses the two together: keep "
                        "offload_optimizer"));
  EXPECT_THAT(ParseError(R"({"zero_optimization": {"cpu_offload_params": true}})"),
              HasSubstr("zero_optimization.cpu_offload_params = true is DeepSpeed's spelling "
                        "before 0.7, which later releases refuse as an unknown key; for true "
                        "write \"offload_param\": {\"device\": \"cpu\"}, for false remove it"));
  EXPECT_THAT(ParseError(R"({"zero_optimization": {"cpu_offload": "sure"}})"),
              HasSubstr("zero_optimization.cpu_offload = \"sure\" is not allowed"));
}

TEST(EngineConfigPydantic, LoadFromFp32WeightsFalseIsRefusedWhereItWouldChangeTheWeights) {
  EXPECT_THAT(ParseError(R"({"zero_optimization": {"stage": 2, "load_from_fp32_weights": false},
      "bf16": {"enabled": true}})"),
              HasSubstr("zero_optimization.load_from_fp32_weights = false: with it DeepSpeed's "
                        "ZeRO stage 2 load takes the fp32 master weights from the model's bf16 "
                        "weights, rounded, instead of the checkpoint's fp32 copies; zoe's "
                        "checkpoints always restore the fp32 master weights they hold: set "
                        "zero_optimization.load_from_fp32_weights to true or remove it"));
  EXPECT_THAT(ParseError(R"({"zero_optimization": {"stage": 1, "load_from_fp32_weights": "false"},
      "fp16": {"enabled": true}})"),
              HasSubstr("ZeRO stage 1 load takes the fp32 master weights from the model's fp16"));
  EXPECT_THAT(ParseError(R"({"zero_optimization": {"stage": 0, "load_from_fp32_weights": false},
      "bf16": {"enabled": true}})"),
              HasSubstr("DeepSpeed's bf16 optimizer's load at ZeRO stage 0 takes the fp32 master "
                        "weights from the model's bf16 weights"));
  // True is what zoe does; an fp32 model loads the same weights either way, and DeepSpeed's
  // fp16 stage 0 and its stage 3 loads do not read the key.
  const EngineConfig kept = ParseOk(R"({"zero_optimization": {"stage": 2,
      "load_from_fp32_weights": true}, "fp16": {"enabled": true}})");
  EXPECT_THAT(kept.ignored_keys, Not(Contains("zero_optimization.load_from_fp32_weights")));
  ParseOk(R"({"zero_optimization": {"stage": 2, "load_from_fp32_weights": false}})");
  ParseOk(R"({"zero_optimization": {"stage": 3, "load_from_fp32_weights": false},
      "bf16": {"enabled": true}})");
  ParseOk(R"({"zero_optimization": {"stage": 0, "load_from_fp32_weights": false},
      "fp16": {"enabled": true}})");
  EXPECT_THAT(ParseError(R"({"zero_optimization": {"load_from_fp32_weights": "maybe"}})"),
              HasSubstr("zero_optimization.load_from_fp32_weights = \"maybe\" is not allowed"));
}

TEST(EngineConfigPydantic, PrecisionKeysAreTheFrameworksNotIgnored) {
  const EngineConfig config = ParseOk(R"({"communication_data_type": "fp32",
      "data_types": {"grad_accum_dtype": "fp32"}})");
  EXPECT_THAT(config.ignored_keys, IsEmpty());
  EXPECT_THAT(config.framework_keys, Contains("communication_data_type"));
  EXPECT_THAT(config.framework_keys, Contains("data_types"));
}

}  // namespace
}  // namespace zoe::config
