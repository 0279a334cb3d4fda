// Description: the engine's configuration document: defaults, a DeepSpeed ZeRO-Infinity config,
// zoe's own section, sizes in every form, every error (unknown keys, ranges, cross-field checks),
// ignored DeepSpeed keys and the ToJson round trip.
#include "core/engine_config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tests/core/engine_config_parse.h"

namespace zoe::config {
namespace {

using ::testing::Contains;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;
using Json = nlohmann::json;

// A ZeRO-Infinity config as DeepSpeed's documentation writes one: optimizer state and parameters
// on NVMe, an aio block, fp16 with dynamic loss scaling, and the usual batch/scheduler keys.
constexpr std::string_view kZeroInfinityConfig = R"({
  "train_batch_size": 64,
  "train_micro_batch_size_per_gpu": 4,
  "gradient_accumulation_steps": 16,
  "steps_per_print": 100,
  "wall_clock_breakdown": false,
  "gradient_clipping": 1.0,
  "optimizer": {
    "type": "AdamW",
    "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
  },
  "scheduler": {
    "type": "WarmupLR",
    "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-4, "warmup_num_steps": 1000}
  },
  "fp16": {
    "enabled": true,
    "loss_scale": 0,
    "initial_scale_power": 12,
    "loss_scale_window": 500,
    "hysteresis": 2,
    "min_loss_scale": 1
  },
  "zero_optimization": {
    "stage": 3,
    "contiguous_gradients": true,
    "overlap_comm": true,
    "reduce_bucket_size": 5e8,
    "stage3_prefetch_bucket_size": 5e8,
    "stage3_param_persistence_threshold": 1e6,
    "stage3_max_live_parameters": 1e9,
    "stage3_max_reuse_distance": 1e9,
    "stage3_gather_16bit_weights_on_model_save": true,
    "sub_group_size": 1e9,
    "offload_optimizer": {
      "device": "nvme",
      "nvme_path": "/local_nvme",
      "pin_memory": true,
      "buffer_count": 4,
      "fast_init": false
    },
    "offload_param": {
      "device": "nvme",
      "nvme_path": "/local_nvme",
      "pin_memory": true,
      "buffer_count": 5,
      "buffer_size": 1e8,
      "max_in_cpu": 1e9
    }
  },
  "aio": {
    "block_size": 1048576,
    "queue_depth": 8,
    "thread_count": 1,
    "single_submit": false,
    "overlap_events": true
  }
})";

EngineConfig ParseDocumentOk(const Json& document) { return ParseOk(document.dump()); }

// The error message of a document that must be rejected as an invalid argument.
std::string ParseError(const Json& document) {
  const std::string text = document.dump();
  return config::ParseError(text);  // engine_config_parse.h's, which this name hides
}

// Parses the printed configuration again; what comes back must be what was printed.
void ExpectRoundTrip(const EngineConfig& config) {
  const Json printed = ToJson(config);
  Result<EngineConfig> again = ParseEngineConfig(printed.dump(2));
  ASSERT_TRUE(again.ok()) << printed.dump(2) << "\n" << again.status().ToString();
  EXPECT_TRUE(again->ignored_keys.empty());
  EngineConfig expected = config;
  expected.ignored_keys.clear();
  expected.framework_keys.clear();
  expected.warnings.clear();
  EXPECT_TRUE(*again == expected) << "printed:  " << printed.dump()
                                  << "\nreprinted: " << ToJson(*again).dump();
  EXPECT_EQ(ToJson(*again), printed);
}

// ---------------------------------------------------------------------------------------------
// Defaults and accepted documents

TEST(EngineConfig, EmptyDocumentGivesDefaultsOffloadingTheOptimizerToCpu) {
  const EngineConfig config = ParseOk("{}");
  EXPECT_TRUE(config == EngineConfig{});
  EXPECT_EQ(config.zero.offload_optimizer.device, OffloadDevice::kCpu);
  EXPECT_EQ(config.zero.offload_param.device, OffloadDevice::kNone);
  EXPECT_EQ(config.zero.stage, 3u);
  EXPECT_EQ(config.zoe.device, ComputeDevice::kAuto);
  EXPECT_EQ(config.optimizer.kind, OptimizerKind::kAdamW);
  EXPECT_EQ(config.zoe.eviction, EvictionKind::kOpt);
  EXPECT_EQ(config.zoe.moment_dtype, DType::kFloat32);
  EXPECT_TRUE(config.zoe.checksum);  // silent corruption is impossible by default
  EXPECT_TRUE(config.aio.checksum);
  EXPECT_TRUE(config.zoe.nvme_paths.empty());
  EXPECT_EQ(config.zero.sub_group_size, 0u);  // derived from zoe.chunk_size
  EXPECT_EQ(config.zoe.tensor_host_budget, 0u);
  EXPECT_EQ(config.zoe.tensor_swap_bytes, 0u);  // automatic
  EXPECT_TRUE(config.ignored_keys.empty());
  EXPECT_EQ(DescribeIgnoredKeys(config), "");
}

// Found by fuzz_config: betas nested 30000 arrays deep were copied and printed recursively by
// the optimizer section's reader until the stack ran out.
TEST(EngineConfig, AbsurdlyNestedValuesAreRefusedWithAMessage) {
  const size_t levels = 1'000'000;
  const std::string betas = std::string(levels, '[') + std::string(levels, ']');
  auto parsed = ParseEngineConfig(R"({"optimizer": {"params": {"betas": )" + betas + "}}}");
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(parsed.status().message()), HasSubstr("nested deeper than"));
}

TEST(EngineConfig, TensorHostBudgetAloneIsAcceptedWithAnAutomaticHostBudget) {
  const EngineConfig config = ParseOk(R"({"zoe": {"tensor_host_budget": "64M"}})");
  EXPECT_EQ(config.zoe.tensor_host_budget, uint64_t{64} << 20);
  EXPECT_EQ(config.zoe.host_budget, 0u);
  ExpectRoundTrip(config);
}

TEST(EngineConfig, DeepSpeedZeroInfinityConfigParsesWithItsValues) {
  const EngineConfig config = ParseOk(kZeroInfinityConfig);
  EXPECT_EQ(config.zero.stage, 3u);
  EXPECT_EQ(config.zero.sub_group_size, 1'000'000'000u);
  const OffloadOptimizerConfig& opt = config.zero.offload_optimizer;
  EXPECT_EQ(opt.device, OffloadDevice::kNvme);
  EXPECT_EQ(opt.nvme_path, "/local_nvme");
  EXPECT_TRUE(opt.pin_memory);
  EXPECT_EQ(opt.buffer_count, 4u);  // as given
  EXPECT_FALSE(opt.fast_init);
  EXPECT_EQ(opt.ratio, 1.0);
  const OffloadParamConfig& param = config.zero.offload_param;
  EXPECT_EQ(param.device, OffloadDevice::kNvme);
  EXPECT_EQ(param.nvme_path, "/local_nvme");
  EXPECT_TRUE(param.pin_memory);
  EXPECT_EQ(param.buffer_count, 5u);
  EXPECT_EQ(param.buffer_size, 100'000'000u);
  EXPECT_EQ(param.max_in_cpu, 1'000'000'000u);
  EXPECT_THAT(config.zoe.nvme_paths, ElementsAre("/local_nvme"));

  EXPECT_EQ(config.optimizer.kind, OptimizerKind::kAdamW);
  EXPECT_DOUBLE_EQ(config.optimizer.lr, 3e-4);
  EXPECT_DOUBLE_EQ(config.optimizer.beta1, 0.9);
  EXPECT_DOUBLE_EQ(config.optimizer.beta2, 0.95);
  EXPECT_DOUBLE_EQ(config.optimizer.eps, 1e-8);
  EXPECT_DOUBLE_EQ(config.optimizer.weight_decay, 0.1);
  EXPECT_DOUBLE_EQ(config.gradient_clipping, 1.0);

  EXPECT_TRUE(config.fp16.enabled);
  EXPECT_EQ(config.fp16.loss_scale, 0.0);
  EXPECT_EQ(config.fp16.initial_scale_power, 12u);
  EXPECT_EQ(config.fp16.loss_scale_window, 500u);
  EXPECT_EQ(config.fp16.hysteresis, 2u);
  EXPECT_EQ(config.fp16.min_loss_scale, 1.0);
  EXPECT_FALSE(config.bf16.enabled);

  EXPECT_EQ(config.aio.block_size, 1u << 20);
  EXPECT_EQ(config.aio.queue_depth, 8u);
  EXPECT_EQ(config.aio.intra_op_parallelism, 1u);
  EXPECT_TRUE(config.aio.overlap_events);

  EXPECT_THAT(
      config.ignored_keys,
      ElementsAre("steps_per_print", "wall_clock_breakdown",
                  "zero_optimization.contiguous_gradients", "zero_optimization.overlap_comm",
                  "zero_optimization.stage3_gather_16bit_weights_on_model_save",
                  "zero_optimization.stage3_param_persistence_threshold",
                  "zero_optimization.stage3_prefetch_bucket_size"));
  EXPECT_THAT(DescribeIgnoredKeys(config),
              HasSubstr("ignored DeepSpeed keys: steps_per_print, wall_clock_breakdown, "));
  // The keys zoe.torch.initialize reads are not called ignored.
  EXPECT_THAT(config.framework_keys,
              ElementsAre("gradient_accumulation_steps", "scheduler", "train_batch_size",
                          "train_micro_batch_size_per_gpu", "zero_optimization.reduce_bucket_size",
                          "zero_optimization.stage3_max_live_parameters",
                          "zero_optimization.stage3_max_reuse_distance"));
  EXPECT_THAT(DescribeFrameworkKeys(config),
              HasSubstr("(zoe.torch.initialize reads them; the engine does not): "
                        "gradient_accumulation_steps, scheduler, train_batch_size, "));
}

// The shape Hugging Face examples hand to DeepSpeed: "auto" in keys zoe ignores, sizes as floats.
TEST(EngineConfig, HuggingFaceStyleNvmeParamOffloadConfigIsAccepted) {
  const EngineConfig config = ParseOk(R"({
    "fp16": {"enabled": false}, "bf16": {"enabled": true},
    "zero_optimization": {
      "stage": 3,
      "offload_param": {"device": "nvme", "nvme_path": "/nvme", "pin_memory": true,
                        "buffer_count": 5, "buffer_size": 1e9, "max_in_cpu": 1e9},
      "overlap_comm": true, "reduce_bucket_size": "auto", "contiguous_gradients": true,
      "sub_group_size": 1e8, "stage3_prefetch_bucket_size": "auto",
      "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": "auto",
      "stage3_max_reuse_distance": "auto"},
    "aio": {"block_size": 262144, "queue_depth": 32, "thread_count": 1,
            "single_submit": false, "overlap_events": true},
    "steps_per_print": 2000, "train_batch_size": 8, "train_micro_batch_size_per_gpu": 1,
    "wall_clock_breakdown": false})");
  EXPECT_TRUE(config.bf16.enabled);
  EXPECT_EQ(config.zero.offload_param.device, OffloadDevice::kNvme);
  EXPECT_EQ(config.zero.offload_param.buffer_size, 1'000'000'000u);
  EXPECT_EQ(config.zero.offload_param.max_in_cpu, 1'000'000'000u);
  EXPECT_THAT(config.zoe.nvme_paths, ElementsAre("/nvme"));
  EXPECT_EQ(config.aio.block_size, 262144u);
  EXPECT_EQ(config.aio.queue_depth, 32u);
  EXPECT_THAT(config.ignored_keys, Contains("zero_optimization.overlap_comm"));
  // "auto" in a pydantic section is the key's default, as DeepSpeed's models drop it.
  EXPECT_THAT(config.ignored_keys, Not(Contains("zero_optimization.stage3_prefetch_bucket_size")));
}

TEST(EngineConfig, ZoeSectionParsesEveryOption) {
  const EngineConfig config = ParseOk(R"({
    "zero_optimization": {"offload_optimizer": {"device": "nvme"}},
    "zoe": {
      "device": "host",
      "device_budget": "8GiB",
      "host_budget": "1.5G",
      "tensor_host_budget": "512M",
      "tensor_swap_bytes": "2G",
      "nvme_paths": ["/nvme0/zoe", "/nvme1/zoe"],
      "stripe_unit": "256K",
      "chunk_size": 6.7108864e7,
      "checksum": true,
      "log_level": "debug",
      "trace": {"lookahead_bytes": "512MB", "max_inflight": 16, "mismatch_limit": 4},
      "eviction": "lru",
      "moment_dtype": "bf16",
      "speculative": true
    }
  })");
  const ZoeConfig& zoe = config.zoe;
  EXPECT_EQ(zoe.device, ComputeDevice::kHost);
  EXPECT_EQ(zoe.device_budget, uint64_t{8} << 30);
  EXPECT_EQ(zoe.host_budget, uint64_t{3} << 29);
  EXPECT_EQ(zoe.tensor_host_budget, uint64_t{512} << 20);
  EXPECT_EQ(zoe.tensor_swap_bytes, uint64_t{2} << 30);
  EXPECT_THAT(zoe.nvme_paths, ElementsAre("/nvme0/zoe", "/nvme1/zoe"));
  EXPECT_EQ(zoe.stripe_unit, 256u << 10);
  EXPECT_EQ(zoe.chunk_size, 64u << 20);
  EXPECT_TRUE(zoe.checksum);
  EXPECT_TRUE(config.aio.checksum);
  EXPECT_EQ(zoe.log_level, "debug");
  EXPECT_EQ(zoe.trace.lookahead_bytes, 512'000'000u);
  EXPECT_EQ(zoe.trace.max_inflight, 16u);
  EXPECT_EQ(zoe.trace.mismatch_limit, 4u);
  EXPECT_EQ(zoe.eviction, EvictionKind::kLru);
  EXPECT_EQ(zoe.moment_dtype, DType::kBFloat16);
  EXPECT_TRUE(zoe.speculative);
  EXPECT_FALSE(ParseOk("{}").zoe.speculative);
  EXPECT_TRUE(config.ignored_keys.empty());
}

TEST(EngineConfig, SizesAreAcceptedInEveryForm) {
  struct SizeCase {
    Json value;
    uint64_t bytes;
  };
  const std::vector<SizeCase> cases = {
      {1048576, 1048576},
      {1e6, 1000000},
      {"1048576", 1048576},
      {"1M", 1u << 20},
      {"1m", 1u << 20},
      {"4KiB", 4096},
      {"4K", 4096},
      {"1.5GiB", 3ull << 29},
      {"1MB", 1000000},
      {"2 GB", 2000000000u},
      {"1T", 1ull << 40},
      {"512B", 512},
      {0, 0},
  };
  for (const SizeCase& c : cases) {
    const EngineConfig config = ParseDocumentOk({{"zoe", {{"host_budget", c.value}}}});
    EXPECT_EQ(config.zoe.host_budget, c.bytes) << c.value.dump();
  }
  EXPECT_THAT(ParseError({{"zoe", {{"device_budget", "12 parsecs"}}}}),
              HasSubstr("zoe.device_budget: size '12 parsecs' has an unknown unit 'parsecs'"));
  EXPECT_THAT(ParseError({{"zoe", {{"host_budget", -1}}}}),
              HasSubstr("zoe.host_budget: size -1 is negative"));
  EXPECT_THAT(ParseError({{"zoe", {{"trace", {{"lookahead_bytes", "0.5B"}}}}}}),
              HasSubstr("zoe.trace.lookahead_bytes: size '0.5B' is not a whole number of bytes"));
}

TEST(EngineConfig, DeepSpeedAdamMeansAdamWUnlessAdamWModeIsFalse) {
  auto type_of = [](const Json& optimizer) {
    return ParseDocumentOk({{"optimizer", optimizer}}).optimizer.kind;
  };
  EXPECT_EQ(type_of({{"type", "Adam"}}), OptimizerKind::kAdamW);
  EXPECT_EQ(type_of({{"type", "adam"}, {"params", {{"adam_w_mode", true}}}}),
            OptimizerKind::kAdamW);
  EXPECT_EQ(type_of({{"type", "Adam"}, {"params", {{"adam_w_mode", false}}}}),
            OptimizerKind::kAdam);
  EXPECT_EQ(type_of({{"type", "AdamW"}, {"params", {{"adam_w_mode", false}}}}),
            OptimizerKind::kAdamW);
  EXPECT_EQ(type_of({{"type", "ADAGRAD"}}), OptimizerKind::kAdagrad);
  EXPECT_EQ(type_of({{"type", "Lion"}}), OptimizerKind::kLion);
}

TEST(EngineConfig, OptimizerParamsAreReadPerType) {
  const EngineConfig adagrad = ParseOk(R"({"optimizer": {"type": "Adagrad", "params":
      {"lr": 0.01, "eps": 1e-10, "weight_decay": 0.001, "lr_decay": 0.5}}})");
  EXPECT_EQ(adagrad.optimizer.kind, OptimizerKind::kAdagrad);
  EXPECT_DOUBLE_EQ(adagrad.optimizer.lr, 0.01);
  EXPECT_DOUBLE_EQ(adagrad.optimizer.eps, 1e-10);
  EXPECT_DOUBLE_EQ(adagrad.optimizer.weight_decay, 0.001);
  EXPECT_DOUBLE_EQ(adagrad.optimizer.lr_decay, 0.5);

  const EngineConfig adam = ParseOk(R"({"optimizer": {"type": "Adam", "legacy_fusion": false,
      "params": {"lr": 1e-4, "torch_adam": false, "bias_correction": true, "amsgrad": false}}})");
  EXPECT_DOUBLE_EQ(adam.optimizer.lr, 1e-4);
  EXPECT_EQ(adam.optimizer.weight_decay, 0.0);
  EXPECT_THAT(adam.ignored_keys, ElementsAre("optimizer.legacy_fusion"));
}

TEST(EngineConfig, IgnoredDeepSpeedSectionsAreNotValidated) {
  const EngineConfig config = ParseOk(R"({
    "scheduler": {"type": "AnyScheduler", "params": {"whatever": [1, "two"]}},
    "amp": {"enabled": false, "opt_level": "O1"},
    "activation_checkpointing": {"partition_activations": true, "cpu_checkpointing": true},
    "fp16": {"enabled": true, "auto_cast": false, "fp16_master_weights_and_grads": false},
    "zero_optimization": {"stage": 3, "stage3_gather_fp16_weights_on_model_save": true,
                          "offload_optimizer": {"device": "cpu", "pipeline_read": true}}
  })");
  EXPECT_THAT(config.ignored_keys,
              ElementsAre("amp", "fp16.auto_cast", "fp16.fp16_master_weights_and_grads",
                          "zero_optimization.offload_optimizer.pipeline_read",
                          "zero_optimization.stage3_gather_fp16_weights_on_model_save"));
  EXPECT_THAT(config.framework_keys, ElementsAre("activation_checkpointing", "scheduler"));
}

TEST(EngineConfig, OtherSpellingsAreAcceptedButNotTwoOfTheSameOption) {
  EXPECT_TRUE(ParseOk(R"({"bfloat16": {"enabled": true}})").bf16.enabled);
  EXPECT_TRUE(ParseOk(R"({"bf16": {"enabled": true}})").bf16.enabled);
  EXPECT_THAT(ParseError(Json::parse(R"({"bf16": {}, "bfloat16": {}})")),
              HasSubstr("both 'bf16' and 'bfloat16' are given"));
  EXPECT_THAT(ParseError(Json::parse(R"({"zero_optimization": {
                  "stage3_gather_16bit_weights_on_model_save": true,
                  "stage3_gather_fp16_weights_on_model_save": true}})")),
              HasSubstr("both 'zero_optimization.stage3_gather_16bit_weights_on_model_save' and "
                        "'zero_optimization.stage3_gather_fp16_weights_on_model_save' are given"));
  EXPECT_THAT(ParseError(Json::parse(R"({"aio": {"thread_count": 2, "num_threads": 2}})")),
              HasSubstr("both 'aio.thread_count' and 'aio.num_threads' are given"));
}

// ---------------------------------------------------------------------------------------------
// NVMe directories and checksums across sections

TEST(EngineConfig, NvmeDirectoriesComeFromZoeOrFromTheDeepSpeedSections) {
  const EngineConfig both = ParseOk(R"({"zero_optimization": {
      "offload_optimizer": {"device": "nvme", "nvme_path": "/a"},
      "offload_param": {"device": "nvme", "nvme_path": "/b"}}})");
  EXPECT_THAT(both.zoe.nvme_paths, ElementsAre("/a", "/b"));

  const EngineConfig zoe_wins = ParseOk(R"({"zoe": {"nvme_paths": ["/x", "/y"]},
      "zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": "/a"}}})");
  EXPECT_THAT(zoe_wins.zoe.nvme_paths, ElementsAre("/x", "/y"));
  EXPECT_EQ(zoe_wins.zero.offload_optimizer.nvme_path, "/a");

  const EngineConfig single = ParseOk(R"({"zoe": {"nvme_paths": "/only"},
      "zero_optimization": {"offload_param": {"device": "nvme"}}})");
  EXPECT_THAT(single.zoe.nvme_paths, ElementsAre("/only"));

  const EngineConfig cpu = ParseOk(R"({"zero_optimization":
      {"offload_optimizer": {"device": "cpu", "nvme_path": "/unused"}}})");
  EXPECT_TRUE(cpu.zoe.nvme_paths.empty());
}

TEST(EngineConfig, NvmeWithoutAnyDirectoryIsAnError) {
  EXPECT_THAT(ParseError(Json::parse(
                  R"({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}})")),
              HasSubstr("zero_optimization.offload_optimizer.device = 'nvme' needs a directory; "
                        "set zero_optimization.offload_optimizer.nvme_path or zoe.nvme_paths"));
  EXPECT_THAT(ParseError(Json::parse(R"({"zero_optimization": {"offload_param":
                  {"device": "nvme", "nvme_path": ""}}})")),
              HasSubstr("zero_optimization.offload_param.device = 'nvme' needs a directory"));
}

TEST(EngineConfig, NvmePathsMustBeDistinctAndNonEmpty) {
  EXPECT_THAT(ParseError({{"zoe", {{"nvme_paths", {"/a", "/b", "/a"}}}}}),
              HasSubstr("zoe.nvme_paths[2] = '/a' is the directory of zoe.nvme_paths[0] = '/a' "
                        "again; allowed: distinct directories"));
  // The same directory written otherwise is one directory too
  for (const char* again : {"/x/", "/x/.", "/y/../x", "//x"}) {
    EXPECT_THAT(ParseError({{"zoe", {{"nvme_paths", {"/x", again}}}}}),
                HasSubstr("zoe.nvme_paths[1] = '" + std::string(again) +
                          "' is the directory of zoe.nvme_paths[0] = '/x' again"))
        << again;
  }
  const Json distinct = {{"zoe", {{"nvme_paths", {"/", "/x", "/x/y"}}}}};
  EXPECT_TRUE(ParseEngineConfig(distinct.dump()).ok());
  EXPECT_THAT(ParseError({{"zoe", {{"nvme_paths", {"/a", ""}}}}}),
              HasSubstr("zoe.nvme_paths[1] is empty"));
  EXPECT_THAT(ParseError({{"zoe", {{"nvme_paths", {"/a", 3}}}}}),
              HasSubstr("zoe.nvme_paths: expected a string or an array of strings"));
}

TEST(EngineConfig, ChecksumMayBeGivenInAioOrZoeButNotDifferently) {
  const EngineConfig from_aio = ParseOk(R"({"aio": {"checksum": false}})");
  EXPECT_FALSE(from_aio.zoe.checksum);
  EXPECT_FALSE(from_aio.aio.checksum);
  const EngineConfig from_zoe = ParseOk(R"({"zoe": {"checksum": false}})");
  EXPECT_FALSE(from_zoe.zoe.checksum);
  EXPECT_FALSE(from_zoe.aio.checksum);
  const EngineConfig agree = ParseOk(R"({"aio": {"checksum": true}, "zoe": {"checksum": true}})");
  EXPECT_TRUE(agree.zoe.checksum);
  EXPECT_THAT(ParseError(Json::parse(R"({"aio": {"checksum": true}, "zoe": {"checksum": false}})")),
              HasSubstr("aio.checksum = true and zoe.checksum = false disagree"));
}

// ---------------------------------------------------------------------------------------------
// Errors

struct ErrorCase {
  const char* document;
  const char* message;  // a fragment the error must contain
};

void ExpectErrors(const std::vector<ErrorCase>& cases) {
  for (const ErrorCase& c : cases) {
    EXPECT_THAT(ParseError(Json::parse(c.document)), HasSubstr(c.message)) << c.document;
  }
}

TEST(EngineConfig, UnknownKeysNameTheirDottedPathAndClosestKey) {
  ExpectErrors({
      {R"({"zero_optimisation": {}})",
       "unknown key 'zero_optimisation'; did you mean 'zero_optimization'?"},
      {R"({"zero_optimization": {"offload_optimizer": {"nvme_pth": "/a"}}})",
       "unknown key 'zero_optimization.offload_optimizer.nvme_pth'; did you mean 'nvme_path'?"},
      {R"({"zero_optimization": {"offload_param": {"max_in_gpu": 1}}})",
       "unknown key 'zero_optimization.offload_param.max_in_gpu'; did you mean 'max_in_cpu'?"},
      {R"({"zero_optimization": {"stage3_prefetch_bucket": 1}})",
       "did you mean 'stage3_prefetch_bucket_size'?"},
      {R"({"optimizer": {"type": "AdamW", "params": {"beta": [0.9, 0.99]}}})",
       "unknown key 'optimizer.params.beta'; did you mean 'betas'?"},
      {R"({"fp16": {"loss_scale_windw": 100}})",
       "unknown key 'fp16.loss_scale_windw'; did you mean 'loss_scale_window'?"},
      {R"({"bf16": {"enable": true}})", "unknown key 'bf16.enable'; did you mean 'enabled'?"},
      {R"({"aio": {"queue_dept": 8}})",
       "unknown key 'aio.queue_dept'; did you mean 'queue_depth'?"},
      {R"({"zoe": {"evicton": "lru"}})", "unknown key 'zoe.evicton'; did you mean 'eviction'?"},
      {R"({"zoe": {"trace": {"lookahead": 1}}})",
       "unknown key 'zoe.trace.lookahead'; did you mean 'lookahead_bytes'?"},
      {R"({"train_batch_sise": 8})", "did you mean 'train_batch_size'?"},
  });
}

TEST(EngineConfig, OutOfRangeValuesNameKeyValueAndRange) {
  ExpectErrors({
      {R"({"zero_optimization": {"offload_optimizer": {"ratio": 1.5}}})",
       "zero_optimization.offload_optimizer.ratio = 1.5 is out of range; allowed: 0..1"},
      {R"({"zero_optimization": {"offload_optimizer": {"ratio": -0.25}}})",
       "zero_optimization.offload_optimizer.ratio = -0.25 is out of range; allowed: 0..1"},
      {R"({"zero_optimization": {"stage": 4}})",
       "zero_optimization.stage = 4 is out of range; allowed: 0..3"},
      {R"({"zero_optimization": {"offload_optimizer": {"buffer_count": 1025}}})",
       "zero_optimization.offload_optimizer.buffer_count = 1025 is out of range; allowed: "
       "0..1024"},
      {R"({"zero_optimization": {"offload_param": {"buffer_size": 0}}})",
       "zero_optimization.offload_param.buffer_size = 0 is out of range"},
      {R"({"optimizer": {"params": {"lr": -0.1}}})",
       "optimizer.params.lr = -0.1 is out of range; allowed: 0..1e+300"},
      {R"({"optimizer": {"params": {"eps": 0}}})",
       "optimizer.params.eps = 0 is out of range; allowed: greater than 0"},
      {R"({"optimizer": {"params": {"weight_decay": -1}}})",
       "optimizer.params.weight_decay = -1 is out of range"},
      {R"({"optimizer": {"params": {"betas": [0.9, 1.0]}}})",
       "optimizer.params.betas = [0.9,1.0] is out of range; allowed: each beta in [0, 1)"},
      {R"({"optimizer": {"params": {"betas": [-0.1, 0.9]}}})",
       "optimizer.params.betas = [-0.1,0.9] is out of range"},
      {R"({"optimizer": {"params": {"betas": [0.9]}}})",
       "optimizer.params.betas: expected two numbers [beta1, beta2], got [0.9]"},
      {R"({"optimizer": {"params": {"betas": "0.9,0.99"}}})",
       "optimizer.params.betas: expected two numbers"},
      {R"({"gradient_clipping": -1})", "gradient_clipping = -1 is out of range; allowed: 0.."},
      {R"({"fp16": {"initial_scale_power": 64}})",
       "fp16.initial_scale_power = 64 is out of range; allowed: 0..63"},
      {R"({"fp16": {"loss_scale_window": 0}})", "fp16.loss_scale_window = 0 is out of range"},
      {R"({"fp16": {"hysteresis": 0}})", "fp16.hysteresis = 0 is out of range"},
      {R"({"fp16": {"min_loss_scale": 0}})",
       "fp16.min_loss_scale = 0 is out of range; allowed: greater than 0"},
      {R"({"fp16": {"loss_scale": -2}})", "fp16.loss_scale = -2 is out of range"},
      {R"({"zoe": {"stripe_unit": 1024}})",
       "zoe.stripe_unit = 1024 is out of range; allowed: 4096 (4 KiB)..1073741824 (1 GiB)"},
      {R"({"zoe": {"stripe_unit": 6144}})",
       "zoe.stripe_unit = 6144 is not a multiple of 4096; allowed: multiples of 4096"},
      {R"({"zoe": {"chunk_size": "1MB"}})", "zoe.chunk_size = 1000000 is not a multiple of 4096"},
      {R"({"zoe": {"chunk_size": "17GiB"}})",
       "zoe.chunk_size = \"17GiB\" is out of range; allowed: 0..17179869184 (16 GiB)"},
      {R"({"zoe": {"chunk_size": 2048}})", "zoe.chunk_size = 2048 is not a multiple of 4096"},
      {R"({"zoe": {"device_budget": "2PiB"}})", "zoe.device_budget: size '2PiB' has an unknown"},
      {R"({"zoe": {"host_budget": "2048T"}})",
       "zoe.host_budget = \"2048T\" is out of range; allowed: 0..1125899906842624"},
      {R"({"zoe": {"trace": {"max_inflight": 0}}})",
       "zoe.trace.max_inflight = 0 is out of range; allowed: 1..1024"},
      {R"({"zoe": {"trace": {"mismatch_limit": 0}}})",
       "zoe.trace.mismatch_limit = 0 is out of range"},
      {R"({"zoe": {"trace": {"lookahead_bytes": "2TiB"}}})",
       "zoe.trace.lookahead_bytes = \"2TiB\" is out of range"},
      {R"({"aio": {"block_size": 1000}})", "aio.block_size = 1000 is out of range"},
      {R"({"zero_optimization": {"sub_group_size": 2e19}})",
       "zero_optimization.sub_group_size = 2e+19 is out of range; allowed: "
       "0..18446744073709551615"},
      {R"({"zoe": {"tensor_swap_bytes": 1024}})", "zoe.tensor_swap_bytes = 1024 is out of range"},
      {R"({"zoe": {"host_budget": "1G", "tensor_host_budget": "1G"}})",
       "zoe.tensor_host_budget = 1073741824 is not less than zoe.host_budget = 1073741824"},
  });
}

TEST(EngineConfig, EnumValuesOutsideTheirSetAreErrors) {
  ExpectErrors({
      {R"({"zero_optimization": {"offload_optimizer": {"device": "disk"}}})",
       "zero_optimization.offload_optimizer.device = 'disk' is not allowed; allowed: none, cpu, "
       "nvme"},
      {R"({"zero_optimization": {"offload_param": {"device": "nvm"}}})",
       "did you mean 'nvme'? allowed: none, cpu, nvme"},
      {R"({"zoe": {"device": "gpu"}})", "zoe.device = 'gpu' is not allowed;"},
      {R"({"zoe": {"device": "cdua"}})", "did you mean 'cuda'? allowed: auto, cuda, host"},
      {R"({"zoe": {"eviction": "belady"}})", "zoe.eviction = 'belady' is not allowed; "},
      {R"({"zoe": {"moment_dtype": "fp16"}})", "allowed: fp32, bf16, int8"},
      {R"({"zoe": {"log_level": "verbose"}})",
       "allowed: trace, debug, info, warn, error, critical, off"},
  });
}

TEST(EngineConfig, WrongTypesAreErrors) {
  ExpectErrors({
      {R"([])", "'<root>' must be a JSON object"},
      {R"({"zoe": 3})", "'zoe' must be a JSON object, got 3"},
      {R"({"zero_optimization": {"offload_param": "nvme"}})",
       "'zero_optimization.offload_param' must be a JSON object"},
      {R"({"optimizer": {"type": 1}})", "optimizer.type: expected a string, got 1"},
      {R"({"fp16": {"enabled": "ja"}})", "fp16.enabled = \"ja\" is not allowed; allowed: true"},
      {R"({"zoe": {"checksum": 1}})", "zoe.checksum: expected true or false"},
      {R"({"zoe": {"speculative": "on"}})", "zoe.speculative: expected true or false"},
      {R"({"zero_optimization": {"stage": "three"}})",
       "zero_optimization.stage = \"three\" is not allowed; allowed: an integer"},
      {R"({"zero_optimization": {"stage": true}})", "zero_optimization.stage: expected an integer"},
  });
}

TEST(EngineConfig, UnsupportedOptimizersAreNamedWithWhatIsSupported) {
  ExpectErrors({
      {R"({"optimizer": {"type": "OneBitAdam"}})",
       "optimizer.type = 'OneBitAdam' is not supported by zoe; supported: adamw, adam, adagrad, "
       "lion (any letter case)"},
      {R"({"optimizer": {"type": "Lamb"}})", "optimizer.type = 'Lamb' is not supported by zoe"},
      {R"({"optimizer": {"type": "SGD"}})", "optimizer.type = 'SGD' is not supported by zoe"},
      {R"({"optimizer": {"type": "AdamWW"}})",
       "optimizer.type = 'AdamWW' is not an optimizer; did you mean 'adamw'? supported: "},
      {R"({"optimizer": {"type": "RMSprop"}})",
       "optimizer.type = 'RMSprop' is not an optimizer; supported: adamw, adam, adagrad, lion"},
      {R"({"optimizer": {"type": "AdamW", "params": {"lr_decay": 0.1}}})",
       "optimizer.params.lr_decay applies to adagrad only; optimizer.type is 'AdamW'"},
      {R"({"optimizer": {"params": {"amsgrad": true}}})",
       "optimizer.params.amsgrad = true is not supported; allowed: false"},
      {R"({"optimizer": {"params": {"bias_correction": false}}})",
       "optimizer.params.bias_correction = false is not supported"},
  });
}

TEST(EngineConfig, CrossSectionConflictsAreErrors) {
  ExpectErrors({
      {R"({"fp16": {"enabled": true}, "bf16": {"enabled": true}})",
       "fp16.enabled and bf16.enabled are both true; allowed: at most one of them"},
  });
  // Disabled sections and a param offload of "none" do not conflict.
  ParseOk(R"({"fp16": {"enabled": false}, "bf16": {"enabled": true}})");
  ParseOk(R"({"zero_optimization": {"stage": 1, "offload_param": {"device": "none"}}})");
}

TEST(EngineConfig, SyntaxErrorsNameTheirPosition) {
  Result<EngineConfig> parsed = ParseEngineConfig("{\"zoe\": {\"device\": }}");
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(parsed.status().message()), HasSubstr("byte offset 19"));
  EXPECT_FALSE(ParseEngineConfig("").ok());
}

// ---------------------------------------------------------------------------------------------
// ToJson

TEST(EngineConfigToJson, PrintsEveryEffectiveOption) {
  const Json printed = ToJson(ParseOk(kZeroInfinityConfig));
  EXPECT_EQ(printed["zero_optimization"]["offload_optimizer"]["device"], "nvme");
  EXPECT_EQ(printed["zero_optimization"]["offload_param"]["max_in_cpu"], 1'000'000'000u);
  EXPECT_EQ(printed["optimizer"]["type"], "adamw");
  EXPECT_EQ(printed["optimizer"]["params"]["betas"], Json({0.9, 0.95}));
  EXPECT_EQ(printed["aio"]["intra_op_parallelism"], 1u);
  EXPECT_EQ(printed["zoe"]["nvme_paths"], Json({"/local_nvme"}));
  EXPECT_EQ(printed["zoe"]["chunk_size"], 0u);         // automatic: the engine resolves it
  EXPECT_FALSE(printed["zoe"].contains("log_level"));  // unset: the environment decides
  EXPECT_FALSE(printed.contains("scheduler"));
}

TEST(EngineConfigToJson, RoundTripsThroughParse) {
  ExpectRoundTrip(ParseOk("{}"));
  ExpectRoundTrip(ParseOk(kZeroInfinityConfig));
  ExpectRoundTrip(ParseOk(R"({"optimizer": {"type": "Adam", "params": {"adam_w_mode": false,
      "lr": 0.1234567890123, "weight_decay": 1e-5}}, "bf16": {"enabled": true}})"));
  ExpectRoundTrip(ParseOk(R"({"optimizer": {"type": "adagrad", "params": {"lr_decay": 0.25}},
                  "gradient_clipping": 0.5, "aio": {"checksum": true, "backend": "psync"}})"));
  ExpectRoundTrip(ParseOk(R"({"optimizer": {"type": "lion", "params": {"betas": [0.95, 0.98]}},
      "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none", "ratio": 0.3}},
      "zoe": {"device": "cuda", "device_budget": "40GiB", "host_budget": "96G",
              "stripe_unit": "64K", "chunk_size": "16M", "log_level": "warn",
              "trace": {"lookahead_bytes": 0, "max_inflight": 1, "mismatch_limit": 100},
              "eviction": "lru", "moment_dtype": "bf16", "speculative": true}})"));
}

TEST(EngineConfigToJson, ParsesFromAnInMemoryDocument) {
  Json document = ToJson(EngineConfig{});
  document["zoe"]["device"] = "host";
  Result<EngineConfig> parsed = ParseEngineConfigDocument(document);
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ(parsed->zoe.device, ComputeDevice::kHost);
}

// ---------------------------------------------------------------------------------------------
// The ObjectReader helpers the document reader relies on

TEST(ObjectReaderHelpers, IgnoreRecordsPresentKeysAsSpelled) {
  const Json object = Json::parse(R"({"old": 1, "plain": {"x": 2}})");
  std::vector<std::string> ignored;
  ObjectReader reader(object, "section");
  reader.Alias("old", "new")
      .Ignore("new", &ignored)
      .Ignore("plain", &ignored)
      .Ignore("absent", &ignored);
  EXPECT_TRUE(reader.Finish().ok());
  EXPECT_THAT(ignored, ElementsAre("section.old", "section.plain"));
}

TEST(ObjectReaderHelpers, ValueCopiesPresentValuesAndLeavesAbsentOnesAlone) {
  const Json object = Json::parse(R"({"pair": [1, 2]})");
  std::optional<Json> pair, absent;
  ObjectReader reader(object, "");
  reader.Value("pair", &pair).Value("absent", &absent);
  EXPECT_TRUE(reader.Finish().ok());
  ASSERT_TRUE(pair.has_value());
  EXPECT_EQ(*pair, Json({1, 2}));
  EXPECT_FALSE(absent.has_value());
}

TEST(EngineConfigNames, EveryEnumValueHasItsDocumentName) {
  EXPECT_EQ(OffloadDeviceName(OffloadDevice::kNone), "none");
  EXPECT_EQ(OffloadDeviceName(OffloadDevice::kCpu), "cpu");
  EXPECT_EQ(OffloadDeviceName(OffloadDevice::kNvme), "nvme");
  EXPECT_EQ(ComputeDeviceName(ComputeDevice::kAuto), "auto");
  EXPECT_EQ(ComputeDeviceName(ComputeDevice::kCuda), "cuda");
  EXPECT_EQ(ComputeDeviceName(ComputeDevice::kHost), "host");
}

}  // namespace
}  // namespace zoe::config
