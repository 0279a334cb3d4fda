// Description: DeepSpeed documents the engine accepts as DeepSpeed does and refuses where zoe
// would train differently: keys ignored or left to the framework, feature switches refused when
// on, Python's non-finite numbers, sub_group_size beyond any group, offload_param below stage 3
// and torch_adam's defaults.
#include "core/engine_config_deepspeed.h"

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
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;
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

// zoe_config_normalize hands a document back to Python: what it writes reads back the same.
TEST(EngineConfigDeepSpeed, WrittenDocumentsReadBackWithTheirNonFiniteNumbers) {
  const std::string text =
      R"({"a":[NaN,-Infinity,{"b":Infinity,"c":"NaN"}],"d":{},"e":[],"f":"\u00e9\"","g":0.1})";
  Result<Json> document = ParseConfigJson(text);
  ASSERT_TRUE(document.ok()) << document.status().ToString();
  const std::string written = WriteConfigJson(*document);
  EXPECT_EQ(written, R"({"a":[NaN,-Infinity,{"b":Infinity,"c":"NaN"}],"d":{},"e":[],"f":"é\"",)"
                     R"("g":0.1})");
  Result<Json> again = ParseConfigJson(written);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(WriteConfigJson(*again), written);
  EXPECT_EQ((*again)["a"][2]["b"].get<double>(), HUGE_VAL);
  EXPECT_EQ(DescribeJson((*again)["a"]), "[NaN,-Infinity,an object]");
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

TEST(EngineConfigDeepSpeed, NonFiniteTokensAreValuesOnlyNeverKeys) {
  // Where a key belongs the token stays as written, and the parser refuses it there.
  EXPECT_THAT(ParseError(R"({"wandb": {NaN: 1}})"), HasSubstr("byte offset 11"));
  EXPECT_THAT(ParseError(R"({"wandb": {"a": 1, Infinity: 2}})"), HasSubstr("byte offset 19"));
  EXPECT_THAT(ParseError(R"({NaN: 1})"), HasSubstr("JSON syntax error at byte offset 1"));
  // Values: after a colon, and after '[' or ',' in an array.
  const Result<Json> values = ParseConfigJson(R"({"a": [1, NaN, [Infinity]], "b": -Infinity})");
  ASSERT_TRUE(values.ok()) << values.status().ToString();
  EXPECT_TRUE(std::isnan((*values)["a"][1].get<double>()));
  EXPECT_EQ((*values)["a"][2][0].get<double>(), HUGE_VAL);
  EXPECT_EQ((*values)["b"].get<double>(), -HUGE_VAL);
}

// ---------------------------------------------------------------------------------------------
// Keys the framework reads, keys ignored, typos

TEST(EngineConfigDeepSpeed, KeysTheFrameworkReadsAreNotListedAsIgnored) {
  const EngineConfig config = ParseOk(R"({"train_batch_size": 8, "scheduler": {"type": "x"},
      "gradient_accumulation_steps": 2, "train_micro_batch_size_per_gpu": 4,
      "dataloader_drop_last": true, "activation_checkpointing": {},
      "zero_optimization": {"reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8,
                            "stage3_max_live_parameters": 1e9,
                            "stage3_max_reuse_distance": 1e9}})");
  EXPECT_TRUE(config.ignored_keys.empty());
  EXPECT_EQ(DescribeIgnoredKeys(config), "");
  EXPECT_EQ(config.framework_keys.size(), 10u);
  EXPECT_THAT(config.framework_keys, Contains("zero_optimization.allgather_bucket_size"));
}

TEST(EngineConfigDeepSpeed, DeepSpeedKeysWithoutEffectOnZoeAreAcceptedAndListed) {
  const EngineConfig config = ParseOk(R"({
    "vocabulary_size": 50304, "graph_harvesting": false, "use_data_before_expert_parallelism": true,
    "seq_parallel_comm_data_type": "fp32", "comet": {"enabled": false},
    "compile": {"enabled": true},
    "eigenvalue": {"enabled": true}, "weight_quantization": {"quantized_initialization": {}},
    "nebula": {"enabled": false}, "hybrid_engine": {"enabled": false, "max_out_tokens": 512},
    "tensor_parallel": {"autotp_size": 1},
    "bf16": {"enabled": true, "immediate_grad_update": true, "loss_scale": 1.0},
    "aio": {"use_gds": false},
    "zero_optimization": {"zero_quantized_nontrainable_weights": false,
                          "stage3_module_granularity_threshold": 0,
                          "cpu_offload_use_pin_memory": false}})");
  EXPECT_TRUE(config.bf16.enabled);
  EXPECT_THAT(config.ignored_keys,
              ElementsAre("aio.use_gds", "bf16.immediate_grad_update", "bf16.loss_scale", "comet",
                          "compile", "eigenvalue", "graph_harvesting", "hybrid_engine", "nebula",
                          "seq_parallel_comm_data_type", "tensor_parallel",
                          "use_data_before_expert_parallelism", "vocabulary_size",
                          "weight_quantization", "zero_optimization.cpu_offload_use_pin_memory",
                          "zero_optimization.stage3_module_granularity_threshold",
                          "zero_optimization.zero_quantized_nontrainable_weights"));
  // Megatron-DeepSpeed spells the section bfloat16.
  EXPECT_THAT(ParseOk(R"({"bfloat16": {"enabled": true, "loss_scale": 1.0}})").ignored_keys,
              ElementsAre("bfloat16.loss_scale"));
}

TEST(EngineConfigDeepSpeed, KeysDeepSpeedDoesNotHaveAreStillTyposWithTheirClosestKey) {
  EXPECT_THAT(ParseError(R"({"seq_parallel_communication_data_type": "fp32"})"),
              HasSubstr("unknown key 'seq_parallel_communication_data_type'; did you mean "));
  EXPECT_THAT(ParseError(R"({"vocabulary_sise": 8})"),
              HasSubstr("unknown key 'vocabulary_sise'; did you mean 'vocabulary_size'?"));
  EXPECT_THAT(ParseError(R"({"hybrid_engin": {}})"), HasSubstr("did you mean 'hybrid_engine'?"));
  EXPECT_THAT(ParseError(R"({"cuda_visible_devices": "0"})"),
              HasSubstr("unknown key 'cuda_visible_devices'"));
}

// ---------------------------------------------------------------------------------------------
// Switches of features zoe does not implement

TEST(EngineConfigDeepSpeed, FeatureSwitchesAreAcceptedWhileOff) {
  const EngineConfig config = ParseOk(R"({
    "amp": {"enabled": false, "opt_level": "O2"}, "elasticity": {"enabled": false},
    "curriculum_learning": {"enabled": false}, "data_efficiency": {"enabled": false},
    "progressive_layer_drop": {"enabled": false, "theta": 0.5},
    "quantize_training": {"enabled": false}, "hybrid_engine": {"enabled": false},
    "compression_training": {"weight_quantization": {"shared_parameters": {"enabled": false}},
                             "layer_reduction": {"enabled": false}},
    "fp16": {"enabled": false, "auto_cast": true, "fp16_master_weights_and_grads": true},
    "tensor_parallel": {"autotp_size": 0},
    "zero_optimization": {"zero_quantized_weights": false, "zero_quantized_gradients": false}})");
  EXPECT_THAT(config.ignored_keys, Contains("progressive_layer_drop"));
  EXPECT_THAT(config.ignored_keys, Contains("fp16.auto_cast"));
  EXPECT_THAT(config.ignored_keys, Not(Contains("fp16.enabled")));
}

TEST(EngineConfigDeepSpeed, FeatureSwitchesOnAreRefusedNamingWhatDeepSpeedDoesAndTheWayOut) {
  struct Case {
    const char* document;
    const char* message;
  };
  const std::vector<Case> cases = {
      {R"({"amp": {"enabled": true}})",
       "amp.enabled = true: with it DeepSpeed trains with NVIDIA Apex's automatic mixed "
       "precision"},
      {R"({"amp": {"enabled": true}})",
       "; use the fp16 or bf16 section instead, and remove "
       "'amp' or set amp.enabled to false"},
      {R"({"elasticity": {"enabled": true}})",
       "elasticity.enabled = true: with it DeepSpeed "
       "chooses train_batch_size"},
      {R"({"curriculum_learning": {"enabled": true}})",
       "which zoe does not do; remove 'curriculum_learning' or set curriculum_learning.enabled "
       "to false"},
      {R"({"data_efficiency": {"enabled": true}})", "data_efficiency.enabled = true"},
      {R"({"progressive_layer_drop": {"enabled": true}})", "progressive_layer_drop.enabled"},
      {R"({"quantize_training": {"enabled": true}})", "quantizes the weights during training"},
      {R"({"hybrid_engine": {"enabled": true}})", "generate with engine.module"},
      {R"({"nebula": {"enabled": true}})", "through the Nebula service"},
      {R"({"compression_training": {"sparse_pruning": {"shared_parameters":
           {"enabled": true}}}})",
       "compression_training.sparse_pruning.shared_parameters.enabled = true: with it DeepSpeed "
       "quantizes or prunes"},
      {R"({"compression_training": {"layer_reduction": {"enabled": true}}})",
       "set compression_training.layer_reduction.enabled to false"},
      {R"({"fp16": {"enabled": true, "auto_cast": true}})",
       "fp16.auto_cast = true: with it DeepSpeed casts the floating-point inputs of forward to "
       "fp16"},
      {R"({"fp16": {"enabled": true, "fp16_master_weights_and_grads": true}})",
       "zoe keeps fp32 master weights"},
      {R"({"zero_optimization": {"zero_quantized_weights": true}})",
       "zero_optimization.zero_quantized_weights = true: with it DeepSpeed all-gathers the "
       "weights quantized to int8"},
      {R"({"zero_optimization": {"zero_quantized_nontrainable_weights": true}})",
       "set zero_optimization.zero_quantized_nontrainable_weights to false"},
      {R"({"zero_optimization": {"zero_quantized_gradients": true}})", "int4"},
      {R"({"tensor_parallel": {"autotp_size": 2}})",
       "tensor_parallel.autotp_size = 2: with it DeepSpeed splits the model's layers"},
      // DeepSpeed reads the switches as Python's truth values.
      {R"({"amp": {"enabled": 1}})", "amp.enabled = 1:"},
      {R"({"amp": {"enabled": "false"}})", "amp.enabled = \"false\":"},
  };
  for (const Case& c : cases) EXPECT_THAT(ParseError(c.document), HasSubstr(c.message));
}

TEST(EngineConfigDeepSpeed, AnUnknownKeyIsReportedBeforeASwitch) {
  EXPECT_THAT(ParseError(R"({"amp": {"enabled": true}, "ampp": 1})"),
              HasSubstr("unknown key 'ampp'"));
}

// ---------------------------------------------------------------------------------------------
// sub_group_size, offload_param below stage 3, torch_adam

TEST(EngineConfigDeepSpeed, SubGroupSizeLargerThanAnyGroupIsAccepted) {
  const EngineConfig config = ParseOk(R"({"zero_optimization": {"sub_group_size": 1e14}})");
  EXPECT_EQ(config.zero.sub_group_size, 100'000'000'000'000u);
  EXPECT_EQ(ToJson(config)["zero_optimization"]["sub_group_size"], 100'000'000'000'000u);
  EXPECT_EQ(ParseOk(R"({"zero_optimization": {"sub_group_size": 18446744073709551615}})")
                .zero.sub_group_size,
            18'446'744'073'709'551'615u);
}

TEST(EngineConfigDeepSpeed, ParamOffloadBelowStage3IsAWarningAndHasNoEffect) {
  // DeepSpeed-Chat's stage 2 --offload configuration.
  const EngineConfig config = ParseOk(R"({"zero_optimization": {"stage": 2,
      "offload_param": {"device": "nvme", "pin_memory": true},
      "offload_optimizer": {"device": "cpu"}}})");
  EXPECT_EQ(config.zero.offload_param, OffloadParamConfig{});
  EXPECT_TRUE(config.zoe.nvme_paths.empty());  // no directory needed, none taken
  ASSERT_EQ(config.warnings.size(), 1u);
  EXPECT_THAT(config.warnings[0],
              HasSubstr("zero_optimization.offload_param.device = 'nvme' has no effect at "
                        "zero_optimization.stage 2"));
  const Json printed = ToJson(config);
  EXPECT_EQ(printed["zero_optimization"]["offload_param"]["device"], "none");
  Result<EngineConfig> again = ParseEngineConfigDocument(printed);
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(again->warnings.empty());
  // At stage 3 it is honoured, and "none" is never a warning.
  EXPECT_TRUE(ParseOk(R"({"zero_optimization": {"stage": 1, "offload_param":
      {"device": "none"}}})")
                  .warnings.empty());
  EXPECT_EQ(ParseOk(R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}})")
                .zero.offload_param.device,
            OffloadDevice::kCpu);
}

TEST(EngineConfigDeepSpeed, TorchAdamTakesTorchsDefaultsForTheParamsLeftOut) {
  auto optimizer_of = [](std::string_view section) {
    return ParseOk(fmt::format(R"({{"optimizer": {}}})", section)).optimizer;
  };
  // torch.optim.AdamW's weight_decay is 0.01; DeepSpeed's own Adam's is 0.
  EXPECT_EQ(optimizer_of(R"({"type": "AdamW", "params": {"torch_adam": true}})").weight_decay,
            0.01);
  EXPECT_EQ(optimizer_of(R"({"type": "Adam", "params": {"torch_adam": true}})").weight_decay, 0.01);
  EXPECT_EQ(optimizer_of(R"({"type": "Adam", "params": {"torch_adam": true,
      "adam_w_mode": false}})")
                .weight_decay,
            0.0);
  EXPECT_EQ(optimizer_of(R"({"type": "AdamW", "params": {"torch_adam": true,
      "weight_decay": 0.0}})")
                .weight_decay,
            0.0);
  EXPECT_EQ(optimizer_of(R"({"type": "AdamW", "params": {"torch_adam": false}})").weight_decay,
            0.0);
  // "auto" leaves the value to the group; without one it is torch's default too.
  const EngineConfig automatic = ParseOk(R"({"optimizer": {"type": "AdamW",
      "params": {"torch_adam": true, "weight_decay": "auto"}}})");
  EXPECT_EQ(automatic.optimizer.weight_decay, 0.01);
  EXPECT_THAT(ParseError(R"({"optimizer": {"type": "Lion", "params": {"torch_adam": true}}})"),
              HasSubstr("optimizer.params.torch_adam applies to adam and adamw only; "
                        "optimizer.type is 'Lion'"));
  EXPECT_THAT(ParseError(R"({"optimizer": {"params": {"torch_adam": "yes"}}})"),
              HasSubstr("optimizer.params.torch_adam: expected true or false"));
}

}  // namespace
}  // namespace zoe::config
