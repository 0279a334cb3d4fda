// Description: Engine and its configuration mapping -- tier manager options, host budget split,
// optimizer group documents and placement, swap sizing; groups stepping like the in-memory
// reference with per-step hyper-parameters; statistics and the configuration in effect;
// checkpoints (round trip, identity mismatch, a damaged file changing nothing); injected I/O
// faults; the async-error slot; concurrent callers.
#include "offload/engine.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "core/log.h"
#include "io/backend.h"
#include "io/fault_injection.h"
#include "offload/optimizer/optimizer_group_layout.h"
#include "optim/group.h"
#include "tests/offload/temp_dir.h"

namespace zoe::offload {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using testing::TempDir;
using Json = nlohmann::json;

constexpr size_t kCount = 3000;
constexpr uint64_t kSubGroup = 1024;

std::string DirOf(const TempDir& dir) {
  return std::filesystem::path(dir.File("x")).parent_path().string();
}

config::EngineConfig ParseConfig(const Json& document) {
  Result<config::EngineConfig> parsed = config::ParseEngineConfigDocument(document);
  EXPECT_TRUE(parsed.ok()) << parsed.status().ToString();
  return parsed.ok() ? *parsed : config::EngineConfig{};
}

// Small tiers: 64 KiB chunks, the optimizer on NVMe in sub-groups of 1024 parameters.
Json SmallConfig(const TempDir& dir, std::string_view optimizer_device = "nvme") {
  return {{"zero_optimization",
           {{"sub_group_size", kSubGroup},
            {"offload_optimizer", {{"device", optimizer_device}, {"nvme_path", DirOf(dir)}}}}},
          {"aio", {{"backend", "psync"}, {"queue_depth", 8}}},
          {"zoe",
           {{"chunk_size", "64K"},
            {"host_budget", "32M"},
            {"tensor_host_budget", "256K"},
            {"tensor_swap_bytes", "2M"},
            {"device", "host"}}}};
}

std::unique_ptr<Engine> MakeEngine(const Json& document, EngineHooks hooks = {}) {
  Result<std::unique_ptr<Engine>> engine = Engine::Create(ParseConfig(document), std::move(hooks));
  EXPECT_TRUE(engine.ok()) << engine.status().ToString();
  return engine.ok() ? std::move(engine).value() : nullptr;
}

std::vector<float> Ramp(size_t count, float start, float step) {
  std::vector<float> out(count);
  for (size_t i = 0; i < count; ++i) out[i] = start + step * static_cast<float>(i);
  return out;
}

std::vector<float> Gradients(size_t count, int seed) {
  std::vector<float> out(count);
  for (size_t i = 0; i < count; ++i)
    out[i] = std::sin(static_cast<float>(i * 7 + seed * 13)) * 0.05f;
  return out;
}

GroupId CreateGroup(Engine& engine, const std::string& json, std::vector<float>& params) {
  const ParamView view{params.data(), optim::DType::kFloat32, params.size()};
  Result<GroupId> id = engine.CreateGroup(json, std::span(&view, 1));
  EXPECT_TRUE(id.ok()) << id.status().ToString();
  return id.ok() ? *id : GroupId();
}

std::vector<float> ReadSlot(const Engine& engine, GroupId group, StateSlot slot, size_t count) {
  std::vector<float> out(count);
  Status read = engine.ReadState(group, slot, 0, out);
  EXPECT_TRUE(read.ok()) << read.ToString();
  return out;
}

// Per-step hyper-parameters with this lr and beta1, the others at their defaults.
optim::HyperParams StepValues(double lr, double beta1) {
  optim::HyperParams hyper;
  hyper.lr = lr;
  hyper.beta1 = beta1;
  return hyper;
}

Result<StepReport> StepWith(Engine& engine, GroupId group, const std::vector<float>& grads,
                            std::optional<optim::HyperParams> hyper = std::nullopt) {
  const GradView view{grads.data(), optim::DType::kFloat32, grads.size()};
  EngineStepArgs args;
  args.hyper = hyper;
  args.grads = std::span(&view, 1);
  return engine.Step(group, args);
}

// ---- configuration mapping --------------------------------------------------------------------

TEST(EngineSetup, TierManagerOptionsFollowTheConfiguration) {
  const config::EngineConfig config = ParseConfig(
      {{"aio", {{"backend", "libaio"}, {"queue_depth", 16}, {"block_size", "64K"}}},
       {"zoe",
        {{"chunk_size", "256K"},
         {"tensor_swap_bytes", "8M"},
         {"device_budget", "1M"},
         {"checksum", true},
         {"eviction", "lru"},
         {"trace", {{"lookahead_bytes", "1M"}, {"max_inflight", 3}, {"mismatch_limit", 5}}}}}});
  HostBudgets budgets{uint64_t{8} << 20, uint64_t{2} << 20, uint64_t{6} << 20};
  Result<TierManagerOptions> options = MakeTierManagerOptions(config, {"/a", "/b"}, budgets);
  ASSERT_TRUE(options.ok()) << options.status().ToString();
  EXPECT_EQ(options->layout.chunk_bytes, 256u << 10);
  EXPECT_EQ(options->host_budget_bytes, 2u << 20);
  EXPECT_EQ(options->device_budget_bytes, 1u << 20);
  EXPECT_TRUE(static_cast<bool>(options->device_factory));
  EXPECT_EQ(options->nvme_paths, (std::vector<std::string>{"/a", "/b"}));
  EXPECT_EQ(options->nvme_capacity_bytes, 8u << 20);
  EXPECT_EQ(options->nvme_growth_bytes, 0u);  // a size the user set is kept
  EXPECT_EQ(options->nvme_capacity_key, "zoe.tensor_swap_bytes");
  EXPECT_EQ(options->io_backend, io::BackendKind::kLibaio);
  EXPECT_EQ(options->queue_depth, 16u);
  EXPECT_EQ(options->checksum_block, 64u << 10);  // aio.block_size divides the chunk
  EXPECT_EQ(options->lookahead_bytes, 1u << 20);
  EXPECT_EQ(options->prefetch_in_flight, 3u);
  EXPECT_EQ(options->trace_cursor.rerecord_min_mismatches, 5u);
  EXPECT_EQ(options->eviction, EvictionKind::kLru);
}

TEST(EngineSetup, ChecksumBlockFallsBackToTheDirectIoUnit) {
  const config::EngineConfig on_by_default = ParseConfig(Json::object());
  EXPECT_EQ(TensorChecksumBlock(on_by_default), on_by_default.aio.block_size);
  const config::EngineConfig off = ParseConfig({{"zoe", {{"checksum", false}}}});
  EXPECT_EQ(TensorChecksumBlock(off), 0u);
  const config::EngineConfig odd = ParseConfig(
      {{"aio", {{"block_size", "12K"}}}, {"zoe", {{"chunk_size", "64K"}, {"checksum", true}}}});
  EXPECT_EQ(TensorChecksumBlock(odd), 4096u);
}

TEST(EngineSetup, StandInDeviceGetsTheTensorsHostBudgetWhenAutomatic) {
  const config::EngineConfig config = ParseConfig({{"zoe", {{"device", "host"}}}});
  HostBudgets budgets{uint64_t{4} << 20, uint64_t{1} << 20, uint64_t{3} << 20};
  Result<TierManagerOptions> options = MakeTierManagerOptions(config, {"/a"}, budgets);
  ASSERT_TRUE(options.ok());
  Result<std::unique_ptr<DeviceBackend>> device = options->device_factory();
  ASSERT_TRUE(device.ok()) << device.status().ToString();
  EXPECT_FALSE((*device)->is_real_gpu());
  EXPECT_EQ((*device)->capacity_bytes(), 1u << 20);
}

TEST(EngineSetup, HostBudgetIsSplitBetweenTensorsAndOptimizer) {
  constexpr uint64_t kGiB = uint64_t{1} << 30;
  config::ZoeConfig zoe;
  HostBudgets automatic = ResolveHostBudgets(zoe, 16 * kGiB);
  EXPECT_EQ(automatic.total, 8 * kGiB);
  EXPECT_EQ(automatic.tensors, 4 * kGiB);
  EXPECT_EQ(automatic.optimizer, 4 * kGiB);
  zoe.host_budget = 10 * kGiB;
  zoe.tensor_host_budget = 1 * kGiB;
  HostBudgets given = ResolveHostBudgets(zoe, 16 * kGiB);
  EXPECT_EQ(given.total, 10 * kGiB);
  EXPECT_EQ(given.tensors, 1 * kGiB);
  EXPECT_EQ(given.optimizer, 9 * kGiB);
  zoe.host_budget = 0;
  zoe.tensor_host_budget = 12 * kGiB;  // more than the automatic total
  HostBudgets grown = ResolveHostBudgets(zoe, 16 * kGiB);
  EXPECT_EQ(grown.tensors, 12 * kGiB);
  EXPECT_EQ(grown.optimizer, 12 * kGiB);
}

TEST(EngineSetup, AnAutomaticTensorSwapSpaceStartsAtOneGibibyteAndGrows) {
  const config::EngineConfig config = ParseConfig(Json::object());
  EXPECT_EQ(config.zoe.tensor_swap_bytes, 0u);
  HostBudgets budgets{uint64_t{8} << 20, uint64_t{2} << 20, uint64_t{6} << 20};
  Result<TierManagerOptions> options = MakeTierManagerOptions(config, {"/a"}, budgets);
  ASSERT_TRUE(options.ok()) << options.status().ToString();
  EXPECT_EQ(options->nvme_capacity_bytes, config::kAutoTensorSwapBytes);
  EXPECT_EQ(options->nvme_growth_bytes, config::kAutoTensorSwapBytes);
}

TEST(EngineSetup, GroupDefaultsComeFromTheConfiguration) {
  const config::EngineConfig config = ParseConfig(
      {{"optimizer",
        {{"type", "Adam"},
         {"params",
          {{"adam_w_mode", false},
           {"lr", 0.02},
           {"betas", {0.8, 0.9}},
           {"eps", 1e-6},
           {"weight_decay", 0.1}}}}},
       {"gradient_clipping", 2.0},
       {"zero_optimization",
        {{"sub_group_size", 100},
         {"offload_optimizer",
          {{"device", "nvme"}, {"nvme_path", "/n"}, {"ratio", 0.5}, {"buffer_count", 1}}}}},
       {"zoe", {{"moment_dtype", "bf16"}}}});
  Result<GroupSpec> spec = ParseGroupSpec(R"({"name": "g"})", config, 1000);
  ASSERT_TRUE(spec.ok()) << spec.status().ToString();
  const OptimizerGroupOptions& options = spec->options;
  EXPECT_EQ(options.name, "g");
  EXPECT_EQ(options.kind, optim::Kind::kAdam);
  EXPECT_EQ(options.state_dtype, optim::DType::kBFloat16);
  EXPECT_EQ(options.count, 1000u);
  EXPECT_EQ(options.max_grad_norm, 2.0);
  EXPECT_EQ(options.placement, Tier::kNvme);
  EXPECT_EQ(options.nvme_ratio, 0.5);
  EXPECT_EQ(options.chunk_elements, 100u);
  EXPECT_EQ(options.buffer_count, 2u);  // at least two: one updated while the next is read
  EXPECT_EQ(spec->hyper.kind, optim::Kind::kAdam);
  EXPECT_EQ(spec->hyper.lr, 0.02);
  EXPECT_EQ(spec->hyper.beta1, 0.8);
  EXPECT_EQ(spec->hyper.beta2, 0.9);
  EXPECT_EQ(spec->hyper.eps, 1e-6);
  EXPECT_EQ(spec->hyper.weight_decay, 0.1);
}

// Every name of the configuration's "moment_dtype" and "arithmetic" lists reaches the kernels:
// in the engine document, in a group document, and as the optim layer's own name.
TEST(EngineSetup, MomentDTypeAndArithmeticNamesReachTheKernels) {
  const optim::DType dtypes[] = {optim::DType::kFloat32, optim::DType::kBFloat16,
                                 optim::DType::kInt8};
  static_assert(std::size(dtypes) == kMomentDTypeNames.size());
  for (size_t i = 0; i < kMomentDTypeNames.size(); ++i) {
    const std::string name(kMomentDTypeNames[i]);
    SCOPED_TRACE(name);
    EXPECT_EQ(DTypeName(dtypes[i]), name);
    const config::EngineConfig config = ParseConfig({{"zoe", {{"moment_dtype", name}}}});
    Result<GroupSpec> engine_wide = ParseGroupSpec(R"({"name": "g"})", config, 1000);
    ASSERT_TRUE(engine_wide.ok()) << engine_wide.status().ToString();
    EXPECT_EQ(engine_wide->options.state_dtype, dtypes[i]);
    Result<GroupSpec> group = ParseGroupSpec(Json{{"name", "g"}, {"moment_dtype", name}}.dump(),
                                             config::EngineConfig{}, 1000);
    ASSERT_TRUE(group.ok()) << group.status().ToString();
    EXPECT_EQ(group->options.state_dtype, dtypes[i]);
  }
  const optim::Arithmetic arithmetics[] = {optim::Arithmetic::kExact, optim::Arithmetic::kFast};
  static_assert(std::size(arithmetics) == kArithmeticNames.size());
  for (size_t i = 0; i < kArithmeticNames.size(); ++i) {
    const std::string name(kArithmeticNames[i]);
    EXPECT_EQ(optim::ArithmeticName(arithmetics[i]), name);
    const config::EngineConfig config = ParseConfig({{"zoe", {{"arithmetic", name}}}});
    Result<GroupSpec> spec = ParseGroupSpec(R"({"name": "g"})", config, 1000);
    ASSERT_TRUE(spec.ok()) << spec.status().ToString();
    EXPECT_EQ(spec->options.run.arithmetic, arithmetics[i]) << name;
  }
  const optim::StoreMode stores[] = {optim::StoreMode::kCached, optim::StoreMode::kAuto,
                                     optim::StoreMode::kStreaming};
  static_assert(std::size(stores) == kStoreModeNames.size());
  for (size_t i = 0; i < kStoreModeNames.size(); ++i) {
    const std::string name(kStoreModeNames[i]);
    const config::EngineConfig config = ParseConfig({{"zoe", {{"stores", name}}}});
    Result<GroupSpec> spec = ParseGroupSpec(R"({"name": "g"})", config, 1000);
    ASSERT_TRUE(spec.ok()) << spec.status().ToString();
    EXPECT_EQ(spec->options.run.stores, stores[i]) << name;
  }
}

// A configuration built in code may hold any DType; only the moment dtypes reach the kernels.
TEST(EngineSetup, ConfigBuiltInCodeWithANonMomentDTypeIsRefused) {
  config::EngineConfig config;
  config.zoe.moment_dtype = DType::kFloat16;
  Result<GroupSpec> spec = ParseGroupSpec(R"({"name": "g"})", config, 1000);
  ASSERT_FALSE(spec.ok());
  EXPECT_EQ(spec.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(
      std::string(spec.status().message()),
      HasSubstr("zoe.moment_dtype = fp16 is not a moment dtype; allowed: fp32, bf16, int8"));
}

TEST(EngineSetup, GroupDocumentOverridesTheDefaults) {
  const config::EngineConfig config = ParseConfig({{"zoe", {{"chunk_size", "64K"}}}});
  Result<GroupSpec> spec = ParseGroupSpec(
      R"({"name": "emb", "type": "ADAGRAD", "lr": 0.5, "eps": 1e-5, "weight_decay": 0.01,
          "max_grad_norm": 1.0, "moment_dtype": "bf16", "lr_decay": 0.25})",
      config, 100000);
  ASSERT_TRUE(spec.ok()) << spec.status().ToString();
  EXPECT_EQ(spec->options.kind, optim::Kind::kAdagrad);
  EXPECT_EQ(spec->options.state_dtype, optim::DType::kBFloat16);
  EXPECT_EQ(spec->options.max_grad_norm, 1.0);
  EXPECT_EQ(spec->options.placement, Tier::kHost);  // offload_optimizer.device defaults to cpu
  EXPECT_EQ(spec->options.chunk_elements, 16384u);  // chunk_size / 4
  EXPECT_EQ(spec->hyper.lr, 0.5);
  EXPECT_EQ(spec->hyper.lr_decay, 0.25);
  Result<GroupSpec> lion =
      ParseGroupSpec(R"({"name": "l", "type": "lion", "betas": [0.9, 0.99]})", config, 10);
  ASSERT_TRUE(lion.ok()) << lion.status().ToString();
  EXPECT_EQ(lion->options.kind, optim::Kind::kLion);
  EXPECT_EQ(lion->hyper.beta2, 0.99);
  EXPECT_EQ(lion->options.chunk_elements, 10u);  // never more than the group
}

TEST(EngineSetup, RatioZeroOrCpuKeepsTheStateInHost) {
  for (const Json& offload : {Json{{"device", "nvme"}, {"nvme_path", "/n"}, {"ratio", 0.0}},
                              Json{{"device", "cpu"}}, Json{{"device", "none"}}}) {
    const config::EngineConfig config =
        ParseConfig({{"zero_optimization", {{"offload_optimizer", offload}}}});
    Result<GroupSpec> spec = ParseGroupSpec(R"({"name": "g"})", config, 10);
    ASSERT_TRUE(spec.ok()) << spec.status().ToString();
    EXPECT_EQ(spec->options.placement, Tier::kHost) << offload.dump();
  }
}

TEST(EngineSetup, GroupDocumentErrorsNameTheKey) {
  const config::EngineConfig config;
  struct Case {
    std::string json;
    size_t count;
    std::string message;
  };
  const std::vector<Case> cases = {
      {R"({"name": "g", "lrr": 0.1})", 10, "unknown key 'lrr'; did you mean 'lr'?"},
      {R"({"name": "g", "betas": [0.9]})", 10, "betas: expected two numbers"},
      {R"({"name": "g", "betas": [0.9, 1.5]})", 10, "beta2"},
      {R"({"name": "g", "type": "adagard"})", 10, "did you mean 'adagrad'?"},
      {R"({"name": "g", "lr_decay": 0.1})", 10, "lr_decay applies to adagrad only"},
      {R"({"name": "g", "moment_dtype": "fp16"})", 10, "allowed: fp32, bf16, int8"},
      {R"({"name": "g", "eps": 0})", 10, "eps"},
      {R"({"name": "g", "lr": -1})", 10, "lr = -1 is out of range"},
      {R"({"name": "a/b"})", 10, "cannot name a checkpoint file"},
      // Names no checkpoint could be saved under, refused by the rule every save applies.
      {Json{{"name", std::string(250, 'n')}}.dump(), 10, "(250 bytes) cannot name a checkpoint"},
      {Json{{"name", std::string(300, 'n')}}.dump(), 10, "allowed: 1 to 249 bytes"},
      {R"({"name": "nul\u0000x"})", 10, R"("nul\u0000x" (5 bytes) cannot name a checkpoint)"},
      {R"({"name": "tab\there"})", 10, "cannot name a checkpoint file"},
      {R"({"lr": 0.1})", 10, "name is missing"},
      {R"(["g"])", 10, "expected a JSON object"},
      {R"({"name": )", 10, ""},
      {R"({"name": "g"})", 0, "at least one parameter"},
  };
  for (const Case& c : cases) {
    Result<GroupSpec> spec = ParseGroupSpec(c.json, config, c.count);
    ASSERT_FALSE(spec.ok()) << c.json;
    EXPECT_EQ(spec.status().code(), StatusCode::kInvalidArgument) << c.json;
    EXPECT_THAT(std::string(spec.status().message()), HasSubstr(c.message)) << c.json;
  }
  const std::string longest = Json{{"name", std::string(kMaxGroupNameBytes, 'n')}}.dump();
  EXPECT_TRUE(ParseGroupSpec(longest, config, 10).ok()) << "249 bytes and '.state' fit NAME_MAX";
}

TEST(EngineSetup, GroupSwapHoldsBothSlotsOfEveryNvmeChunk) {
  OptimizerGroupOptions options;
  options.count = 2500;
  options.chunk_elements = 1000;
  options.placement = Tier::kHost;
  EXPECT_EQ(GroupSwapBytes(options, 4096), 0u);
  options.placement = Tier::kNvme;
  const StateLayout layout(options.kind, options.state_dtype, options.count, options.chunk_elements,
                           4096);
  ASSERT_EQ(layout.chunk_count(), 3u);
  const uint64_t all = 2 * (layout.chunk(0).bytes + layout.chunk(1).bytes + layout.chunk(2).bytes);
  EXPECT_EQ(GroupSwapBytes(options, 4096), all);
  options.nvme_ratio = 0.5;  // round(1.5) chunks at most, by any rounding: 2
  EXPECT_EQ(GroupSwapBytes(options, 4096), 2 * (layout.chunk(0).bytes + layout.chunk(1).bytes));
}

// ---- engine -----------------------------------------------------------------------------------

TEST(Engine, CreateFromJsonReportsConfigurationErrors) {
  Result<std::unique_ptr<Engine>> engine = Engine::CreateFromJson(R"({"zoe": {"chunk_sise": 1}})");
  ASSERT_FALSE(engine.ok());
  EXPECT_EQ(engine.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(engine.status().message()), HasSubstr("did you mean 'chunk_size'?"));
}

TEST(Engine, LogLevelIsAppliedAndIgnoredKeysAreLogged) {
  TempDir dir;
  const spdlog::level::level_enum before = log::Get().level();
  Json document = SmallConfig(dir);
  document["steps_per_print"] = 10;
  document["train_batch_size"] = 8;
  document["zoe"]["log_level"] = "info";
  {
    log::ScopedCapture capture;
    std::unique_ptr<Engine> engine = MakeEngine(document);
    ASSERT_NE(engine, nullptr);
    EXPECT_EQ(log::Get().level(), spdlog::level::info);
    EXPECT_EQ(capture.Count("ignored DeepSpeed keys: steps_per_print"), 1u);
    // A key the framework reads is not called ignored, and is named only at debug level.
    EXPECT_EQ(capture.Count("train_batch_size"), 0u);
  }
  log::Get().set_level(before);
}

TEST(Engine, LogLevelSilencesEvenTheFirstLinesOfCreation) {
  TempDir dir;
  const spdlog::level::level_enum before = log::Get().level();
  log::Get().set_level(spdlog::level::info);
  Json document;  // automatic host budget and chunk size: both are logged at info
  document["zoe"] = {
      {"log_level", "error"}, {"nvme_paths", {DirOf(dir)}}, {"tensor_swap_bytes", "1M"}};
  {
    log::ScopedCapture capture;
    Result<std::unique_ptr<Engine>> engine = Engine::CreateFromJson(document.dump());
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    EXPECT_EQ(capture.messages(), std::vector<std::string>{});
  }
  log::Get().set_level(before);
}

TEST(Engine, ParamOffloadBelowStage3IsAWarningAndTakesNoEffect) {
  TempDir dir;
  Json document = SmallConfig(dir);
  document["zero_optimization"]["stage"] = 2;
  document["zero_optimization"]["offload_param"] = {{"device", "cpu"}};
  log::ScopedCapture capture;
  std::unique_ptr<Engine> engine = MakeEngine(document);
  ASSERT_NE(engine, nullptr);
  EXPECT_EQ(capture.Count("warning: engine: zero_optimization.offload_param.device = 'cpu' has "
                          "no effect at zero_optimization.stage 2"),
            1u);
}

TEST(Engine, AMissingSwapDirectoryIsCreatedWithAWarningNamingIt) {
  TempDir dir;
  Json document = SmallConfig(dir);
  const std::string missing = DirOf(dir) + "/not/yet";
  document["zoe"]["nvme_paths"] = {missing};
  log::ScopedCapture capture;
  std::unique_ptr<Engine> engine = MakeEngine(document);
  ASSERT_NE(engine, nullptr);
  EXPECT_TRUE(std::filesystem::is_directory(missing));
  EXPECT_EQ(capture.Count("warning: engine: swap directory " + missing + " did not exist"), 1u);
}

TEST(Engine, SwapThatCannotFitIsNoSpaceAtCreation) {
  TempDir dir;
  Json document = SmallConfig(dir);
  document["zoe"]["tensor_swap_bytes"] = "1024T";
  document["zoe"]["nvme_paths"] = {DirOf(dir)};
  Result<std::unique_ptr<Engine>> engine = Engine::Create(ParseConfig(document));
  ASSERT_FALSE(engine.ok());
  EXPECT_EQ(engine.status().code(), StatusCode::kNoSpace) << engine.status().ToString();
  EXPECT_THAT(std::string(engine.status().message()), HasSubstr("engine: tensors"));
  EXPECT_THAT(std::string(engine.status().message()),
              HasSubstr("zoe.tensor_swap_bytes = 1125899906842624 bytes: swap space of"))
      << "names the setting to lower, as a registration that does not fit does";
}

TEST(Engine, WithoutNvmePathsTensorsSwapToAPrivateDirectoryRemovedWithTheEngine) {
  std::string scratch;
  {
    Result<std::unique_ptr<Engine>> engine =
        Engine::CreateFromJson(R"({"zoe": {"chunk_size": "64K", "tensor_swap_bytes": "1M"}})");
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    const Json config = (*engine)->ConfigJson();
    ASSERT_EQ(config["zoe"]["nvme_paths"].size(), 1u);
    scratch = config["zoe"]["nvme_paths"][0].get<std::string>();
    EXPECT_THAT(scratch, HasSubstr("zoe-engine-"));
    EXPECT_TRUE(std::filesystem::is_directory(scratch));
  }
  EXPECT_FALSE(std::filesystem::exists(scratch));
}

// Sets an environment variable for one scope, restoring the previous value after.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::string& value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    ::setenv(name, value.c_str(), 1);
  }
  ~ScopedEnv() {
    if (old_) ::setenv(name_, old_->c_str(), 1);
    if (!old_) ::unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

// A private swap directory `parent`/`name` holding a 4 KiB swap file of a process that ended;
// returns the file's path.
std::string PrivateDirectoryOfAnEndedProcess(const std::string& parent, const std::string& name) {
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ::waitpid(child, nullptr, 0);
  std::filesystem::create_directory(parent + "/" + name);
  const std::string file = parent + "/" + name + "/zoe-swap-" + std::to_string(child) + "-0.0.swap";
  std::ofstream(file) << std::string(4096, 'x');
  return file;
}

TEST(Engine, APrivateDirectoryMadeRemovesThoseOfKilledProcessesButNotHeldOnes) {
  TempDir dir;
  const std::string parent = DirOf(dir);
  const ScopedEnv tmpdir("TMPDIR", parent);
  const std::string stale = PrivateDirectoryOfAnEndedProcess(parent, "zoe-engine-Dead01");
  const std::string held = PrivateDirectoryOfAnEndedProcess(parent, "zoe-engine-Held01");
  const int fd = ::open(held.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX), 0);  // as an engine in another pid namespace holds its file
  Result<std::unique_ptr<Engine>> engine =
      Engine::CreateFromJson(R"({"zoe": {"chunk_size": "64K", "tensor_swap_bytes": "1M"}})");
  ::close(fd);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  EXPECT_FALSE(std::filesystem::exists(parent + "/zoe-engine-Dead01"));
  EXPECT_TRUE(std::filesystem::exists(held));
}

TEST(Engine, ConfigJsonShowsResolvedValuesAndParsesBack) {
  TempDir dir;
  std::unique_ptr<Engine> engine = MakeEngine(SmallConfig(dir));
  ASSERT_NE(engine, nullptr);
  const Json printed = engine->ConfigJson();
  EXPECT_EQ(printed["zoe"]["host_budget"], 32u << 20);
  EXPECT_EQ(printed["zoe"]["tensor_host_budget"], 256u << 10);
  EXPECT_EQ(printed["zoe"]["device_budget"], 256u << 10);  // the stand-in's automatic budget
  EXPECT_EQ(printed["zero_optimization"]["sub_group_size"], kSubGroup);
  EXPECT_EQ(printed["zoe"]["nvme_paths"], Json::array({DirOf(dir)}));
  Result<config::EngineConfig> again = config::ParseEngineConfigDocument(printed);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(config::ToJson(*again), printed);
}

TEST(Engine, TensorsMoveThroughTheTiers) {
  TempDir dir;
  std::unique_ptr<Engine> engine = MakeEngine(SmallConfig(dir));
  ASSERT_NE(engine, nullptr);
  std::vector<TensorId> ids;
  for (int i = 0; i < 6; ++i) {  // six chunks through a HOST budget of four
    TensorDesc desc{"t" + std::to_string(i), 64 << 10, DType::kUInt8, Tier::kNvme, ""};
    Result<TensorId> id = engine->RegisterTensor(desc);
    ASSERT_TRUE(id.ok()) << id.status().ToString();
    ids.push_back(*id);
    Result<void*> ptr = engine->Acquire(*id, Tier::kHost, Access::kWrite);
    ASSERT_TRUE(ptr.ok()) << ptr.status().ToString();
    std::memset(*ptr, 'a' + i, 64 << 10);
    ASSERT_TRUE(engine->Release(*id).ok());
  }
  for (int i = 0; i < 6; ++i) {
    Result<void*> ptr = engine->Acquire(ids[i], Tier::kDevice, Access::kRead);
    ASSERT_TRUE(ptr.ok()) << ptr.status().ToString();
    EXPECT_EQ(static_cast<const char*>(*ptr)[1000], 'a' + i);
    ASSERT_TRUE(engine->Release(ids[i]).ok());
  }
  EXPECT_EQ(*engine->FindTensor("t4"), ids[4]);
  EXPECT_EQ(engine->Acquire(ids[0], Tier::kHost, static_cast<Access>(5)).status().code(),
            StatusCode::kInvalidArgument);
  const Json stats = engine->StatsJson();
  EXPECT_GT(stats["links"]["host_to_nvme"]["bytes"].get<uint64_t>(), 0u);
  EXPECT_EQ(stats["io_backend"]["tensors"], "psync");
  EXPECT_TRUE(stats["io_backend"]["optimizer"].is_null());
  EXPECT_EQ(stats["host_budget"]["tensors"], 256u << 10);
  EXPECT_TRUE(stats["device"]["present"].get<bool>());
  EXPECT_EQ(stats["device"]["backend"], "host stand-in");
  EXPECT_FALSE(stats["device"]["gpu"].get<bool>());
}

TEST(Engine, PrefetchHintsReturnArgumentErrors) {
  TempDir dir;
  std::unique_ptr<Engine> engine = MakeEngine(SmallConfig(dir));
  ASSERT_NE(engine, nullptr);
  EXPECT_EQ(engine->Prefetch(TensorId(9), Tier::kHost).code(), StatusCode::kNotFound);
  Result<TensorId> id = engine->RegisterTensor({"w", 4096, DType::kUInt8, Tier::kNvme, ""});
  ASSERT_TRUE(id.ok());
  EXPECT_EQ(engine->Prefetch(*id, static_cast<Tier>(9)).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(engine->Prefetch(*id, Tier::kHost).ok());
  EXPECT_TRUE(engine->TakeAsyncError().ok());
}

TEST(Engine, AsyncErrorSlotKeepsTheFirstFailureUntilRead) {
  TempDir dir;
  std::unique_ptr<Engine> engine = MakeEngine(SmallConfig(dir));
  ASSERT_NE(engine, nullptr);
  EXPECT_TRUE(engine->TakeAsyncError().ok());
  engine->RecordAsyncError(Status::IoError("first"));
  engine->RecordAsyncError(Status::NoSpace("second"));
  const Status taken = engine->TakeAsyncError();
  EXPECT_EQ(taken.code(), StatusCode::kIoError);
  EXPECT_EQ(taken.message(), "first");
  EXPECT_TRUE(engine->TakeAsyncError().ok());
}

// The engine's groups step exactly like the in-memory reference given the same hyper-parameters,
// including a schedule that changes lr and a step that keeps the group's (hyper = nullopt).
TEST(Engine, GroupStepsMatchTheReferenceWithPerStepHyperParameters) {
  TempDir dir;
  std::unique_ptr<Engine> engine = MakeEngine(SmallConfig(dir));
  ASSERT_NE(engine, nullptr);
  std::vector<float> params = Ramp(kCount, -1.0f, 0.001f);
  const GroupId id =
      CreateGroup(*engine, R"({"name": "g", "lr": 0.01, "weight_decay": 0.1})", params);
  ASSERT_TRUE(id.valid());

  optim::GroupOptions reference_options;
  reference_options.count = kCount;
  Result<std::unique_ptr<optim::Group>> reference = optim::Group::Create(reference_options);
  ASSERT_TRUE(reference.ok());
  std::vector<float> master = params;
  optim::HyperParams hyper;
  hyper.lr = 0.01;
  hyper.weight_decay = 0.1;
  for (int step = 0; step < 4; ++step) {
    const std::vector<float> grads = Gradients(kCount, step);
    std::optional<optim::HyperParams> given;
    if (step != 2) {  // step 2 keeps the previous step's hyper-parameters
      hyper.lr = 0.01 / (step + 1);
      given = hyper;
    }
    Result<StepReport> report = StepWith(*engine, id, grads, given);
    ASSERT_TRUE(report.ok()) << report.status().ToString();
    EXPECT_EQ(report->steps_taken, step + 1);
    EXPECT_GT(report->bytes_read + report->bytes_reused, 0u);  // the state is on NVMe
    ASSERT_TRUE((*reference)->Step(hyper, master.data(), grads.data()).ok());
  }
  EXPECT_EQ(ReadSlot(*engine, id, StateSlot::kMaster, kCount), master);
  const auto* m = static_cast<const float*>((*reference)->exp_avg());
  EXPECT_EQ(ReadSlot(*engine, id, StateSlot::kExpAvg, kCount), std::vector<float>(m, m + kCount));

  const Json stats = engine->StatsJson();
  ASSERT_EQ(stats["groups"].size(), 1u);
  const Json& group = stats["groups"][0];
  EXPECT_EQ(group["name"], "g");
  EXPECT_EQ(group["placement"], "nvme");
  EXPECT_EQ(group["chunks"], 3u);
  EXPECT_EQ(group["steps_taken"], 4);
  EXPECT_EQ(group["steps_called"], 4u);
  EXPECT_GT(group["bytes_written"].get<uint64_t>(), 0u);
  EXPECT_EQ(group["bytes_read"].get<uint64_t>() + group["bytes_reused"].get<uint64_t>(),
            group["bytes_written"].get<uint64_t>());  // every chunk read or reused, then written
  EXPECT_DOUBLE_EQ(group["hyper"]["lr"].get<double>(), 0.01 / 4);
  EXPECT_EQ(stats["io_backend"]["optimizer"], "psync");
}

TEST(Engine, RejectedHyperParametersLeaveTheGroupsOwn) {
  TempDir dir;
  std::unique_ptr<Engine> engine = MakeEngine(SmallConfig(dir));
  ASSERT_NE(engine, nullptr);
  std::vector<float> params = Ramp(kCount, 0.0f, 0.001f);
  const GroupId id = CreateGroup(*engine, R"({"name": "g", "lr": 0.03})", params);
  const std::vector<float> grads = Gradients(kCount, 1);
  Result<StepReport> bad = StepWith(*engine, id, grads, StepValues(0.1, 1.5));
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("optimizer group 'g' step"));
  EXPECT_EQ(engine->StatsJson()["groups"][0]["hyper"]["lr"], 0.03);
  EXPECT_EQ(ReadSlot(*engine, id, StateSlot::kMaster, kCount), params);
  EngineStepArgs args;
  args.loss_scale = std::nan("");
  EXPECT_EQ(engine->Step(id, args).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(engine->Step(GroupId(7), args).status().code(), StatusCode::kNotFound);
}

TEST(Engine, GroupsHaveDenseIdsAndUniqueNames) {
  TempDir dir;
  std::unique_ptr<Engine> engine = MakeEngine(SmallConfig(dir, "cpu"));
  ASSERT_NE(engine, nullptr);
  std::vector<float> a = Ramp(100, 0, 1);
  std::vector<float> b = Ramp(200, 0, 1);
  EXPECT_EQ(CreateGroup(*engine, R"({"name": "a"})", a), GroupId(0));
  EXPECT_EQ(CreateGroup(*engine, R"({"name": "b", "type": "lion"})", b), GroupId(1));
  EXPECT_EQ(engine->group_count(), 2u);
  EXPECT_EQ(*engine->FindGroup("b"), GroupId(1));
  EXPECT_EQ(engine->FindGroup("c").status().code(), StatusCode::kNotFound);
  const ParamView view{a.data(), optim::DType::kFloat32, a.size()};
  Result<GroupId> again = engine->CreateGroup(R"({"name": "a"})", std::span(&view, 1));
  EXPECT_EQ(again.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(again.status().message()), HasSubstr("already exists"));
  EXPECT_EQ(engine->StatsJson()["groups"][1]["placement"], "host");
  EXPECT_TRUE(engine->StatsJson()["io_backend"]["optimizer"].is_null());  // no NVMe group
  EXPECT_TRUE(engine->SetGroupSteps(GroupId(1), 12).ok());
  EXPECT_EQ(*engine->GroupSteps(GroupId(1)), 12);
  EXPECT_EQ(engine->SetGroupSteps(GroupId(1), -2).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(engine->GroupSteps(GroupId(5)).status().code(), StatusCode::kNotFound);
}

TEST(Engine, StateAccessChecksSlotsAndRanges) {
  TempDir dir;
  std::unique_ptr<Engine> engine = MakeEngine(SmallConfig(dir));
  ASSERT_NE(engine, nullptr);
  std::vector<float> params = Ramp(kCount, 0, 1);
  const GroupId id = CreateGroup(*engine, R"({"name": "g"})", params);
  std::vector<float> values(8, 0.5f);
  EXPECT_TRUE(engine->WriteState(id, StateSlot::kExpAvgSq, kCount - 8, values).ok());
  std::vector<float> back(8);
  EXPECT_TRUE(engine->ReadState(id, StateSlot::kExpAvgSq, kCount - 8, back).ok());
  EXPECT_EQ(back, values);
  EXPECT_EQ(engine->ReadState(id, StateSlot::kMaster, kCount - 7, back).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(engine->WriteState(id, static_cast<StateSlot>(3), 0, values).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(engine->ReadState(GroupId(4), StateSlot::kMaster, 0, back).code(),
            StatusCode::kNotFound);
  const GradView grad{values.data(), optim::DType::kFloat32, values.size()};
  EXPECT_EQ(engine->AccumulateGrad(id, kCount - 4, grad).code(), StatusCode::kInvalidArgument);
  const GradView null_grad{nullptr, optim::DType::kFloat32, 4};
  EXPECT_EQ(engine->AccumulateGrad(id, 0, null_grad).code(), StatusCode::kInvalidArgument);
}

// ---- checkpoints ------------------------------------------------------------------------------

class EngineCheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    engine_ = MakeEngine(SmallConfig(dir_));
    ASSERT_NE(engine_, nullptr);
    a_ = CreateGroup(*engine_, R"({"name": "a", "lr": 0.02})", params_a_);
    b_ = CreateGroup(*engine_, R"({"name": "b", "moment_dtype": "bf16"})", params_b_);
    ASSERT_TRUE(StepWith(*engine_, a_, Gradients(kCount, 1)).ok());
    ASSERT_TRUE(StepWith(*engine_, b_, Gradients(500, 2)).ok());
    ckpt_ = dir_.File("ckpt");
    ASSERT_TRUE(engine_->SaveCheckpoint(ckpt_).ok());
    saved_a_ = ReadSlot(*engine_, a_, StateSlot::kMaster, kCount);
    saved_b_ = ReadSlot(*engine_, b_, StateSlot::kExpAvg, 500);
  }

  // Steps both groups so that their state differs from the checkpoint.
  void StepAway() {
    ASSERT_TRUE(StepWith(*engine_, a_, Gradients(kCount, 3), StepValues(0.5, 0.9)).ok());
    ASSERT_TRUE(StepWith(*engine_, b_, Gradients(500, 4)).ok());
    ASSERT_NE(ReadSlot(*engine_, a_, StateSlot::kMaster, kCount), saved_a_);
  }

  std::string VersionFile(const std::string& name) {
    std::ifstream latest(ckpt_ + "/LATEST");
    std::string version;
    std::getline(latest, version);
    return ckpt_ + "/" + version + "/" + name;
  }

  TempDir dir_;
  std::unique_ptr<Engine> engine_;
  std::vector<float> params_a_ = Ramp(kCount, 0.0f, 0.01f);
  std::vector<float> params_b_ = Ramp(500, 1.0f, -0.01f);
  GroupId a_, b_;
  std::string ckpt_;
  std::vector<float> saved_a_, saved_b_;
};

TEST_F(EngineCheckpointTest, LoadRestoresStateStepsAndHyperParameters) {
  StepAway();
  ASSERT_TRUE(engine_->LoadCheckpoint(ckpt_).ok());
  EXPECT_EQ(ReadSlot(*engine_, a_, StateSlot::kMaster, kCount), saved_a_);
  EXPECT_EQ(ReadSlot(*engine_, b_, StateSlot::kExpAvg, 500), saved_b_);
  EXPECT_EQ(*engine_->GroupSteps(a_), 1);
  EXPECT_EQ(*engine_->GroupSteps(b_), 1);
  EXPECT_EQ(engine_->StatsJson()["groups"][0]["hyper"]["lr"], 0.02);
  const Json manifest = Json::parse(std::ifstream(VersionFile("manifest.json")));
  EXPECT_THAT(manifest.dump(), HasSubstr(std::string(EngineVersion())));
}

TEST_F(EngineCheckpointTest, CheckpointOfOtherGroupsIsRefusedAndChangesNothing) {
  TempDir other_dir;
  std::unique_ptr<Engine> other = MakeEngine(SmallConfig(other_dir));
  ASSERT_NE(other, nullptr);
  std::vector<float> params = Ramp(kCount, 0.0f, 0.01f);
  const GroupId only = CreateGroup(*other, R"({"name": "a", "lr": 0.02})", params);
  const Status loaded = other->LoadCheckpoint(ckpt_);
  EXPECT_EQ(loaded.code(), StatusCode::kFailedPrecondition) << loaded.ToString();
  EXPECT_THAT(std::string(loaded.message()), HasSubstr("\"b\""));
  EXPECT_EQ(ReadSlot(*other, only, StateSlot::kMaster, kCount), params);
}

// Groups that differ from the checkpoint's only in their moment dtype are told which to use;
// groups that differ otherwise are not.
TEST_F(EngineCheckpointTest, OtherMomentDtypesAreRefusedNamingTheCheckpoints) {
  TempDir other_dir;
  std::unique_ptr<Engine> other = MakeEngine(SmallConfig(other_dir));
  ASSERT_NE(other, nullptr);
  std::vector<float> params = params_a_, params_b = params_b_;
  const GroupId a = CreateGroup(*other, R"({"name": "a", "moment_dtype": "int8"})", params);
  CreateGroup(*other, R"({"name": "b", "moment_dtype": "bf16"})", params_b);
  const Status loaded = other->LoadCheckpoint(ckpt_);
  EXPECT_EQ(loaded.code(), StatusCode::kFailedPrecondition) << loaded.ToString();
  EXPECT_THAT(std::string(loaded.message()),
              HasSubstr("only the moment dtype differs: create group \"a\" with moment_dtype "
                        "\"fp32\" (zoe.torch"));
  EXPECT_EQ(ReadSlot(*other, a, StateSlot::kMaster, kCount), params_a_);

  TempDir third_dir;
  std::unique_ptr<Engine> third = MakeEngine(SmallConfig(third_dir));
  ASSERT_NE(third, nullptr);
  std::vector<float> renamed = params_a_, renamed_b = params_b_;
  CreateGroup(*third, R"({"name": "c", "moment_dtype": "int8"})", renamed);
  CreateGroup(*third, R"({"name": "b", "moment_dtype": "bf16"})", renamed_b);
  const Status refused = third->LoadCheckpoint(ckpt_);
  EXPECT_EQ(refused.code(), StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(refused.message()), Not(HasSubstr("only the moment dtype")));
}

TEST_F(EngineCheckpointTest, DamagedFileOfTheSecondGroupChangesNeitherGroup) {
  StepAway();
  const std::vector<float> now_a = ReadSlot(*engine_, a_, StateSlot::kMaster, kCount);
  const std::vector<float> now_b = ReadSlot(*engine_, b_, StateSlot::kExpAvg, 500);
  {
    std::fstream file(VersionFile("b.state"), std::ios::in | std::ios::out | std::ios::binary);
    ASSERT_TRUE(file.is_open());
    file.seekg(100);
    char byte = 0;
    file.read(&byte, 1);
    byte = static_cast<char>(byte ^ 0x5a);
    file.seekp(100);
    file.write(&byte, 1);
  }
  const Status loaded = engine_->LoadCheckpoint(ckpt_);
  EXPECT_EQ(loaded.code(), StatusCode::kCorruption) << loaded.ToString();
  EXPECT_EQ(ReadSlot(*engine_, a_, StateSlot::kMaster, kCount), now_a);
  EXPECT_EQ(ReadSlot(*engine_, b_, StateSlot::kExpAvg, 500), now_b);
  EXPECT_EQ(*engine_->GroupSteps(a_), 2);
}

TEST_F(EngineCheckpointTest, SecondGroupThatCannotLoadLeavesTheFirstUnchanged) {
  StepAway();
  const std::vector<float> now_a = ReadSlot(*engine_, a_, StateSlot::kMaster, kCount);
  const std::vector<float> grads = Gradients(100, 5);
  const GradView partial{grads.data(), optim::DType::kFloat32, grads.size()};
  ASSERT_TRUE(engine_->AccumulateGrad(b_, 0, partial).ok());
  const Status loaded = engine_->LoadCheckpoint(ckpt_);
  EXPECT_EQ(loaded.code(), StatusCode::kFailedPrecondition) << loaded.ToString();
  EXPECT_THAT(std::string(loaded.message()), HasSubstr("optimizer group 'b'"));
  EXPECT_EQ(ReadSlot(*engine_, a_, StateSlot::kMaster, kCount), now_a);
  EXPECT_EQ(*engine_->GroupSteps(a_), 2);
  EXPECT_EQ(engine_->StatsJson()["groups"][0]["hyper"]["lr"], 0.5);
}

// Gradients handed over and then discarded (an iteration abandoned after a failure) change
// nothing: the state and step count stay, a checkpoint loads (nothing is accumulated any more), the
// same range can be handed over again, and the step then takes only what was handed after.
TEST_F(EngineCheckpointTest, DiscardedGradientsLeaveTheStateAndFreeTheirRange) {
  StepAway();
  const std::vector<float> master = ReadSlot(*engine_, b_, StateSlot::kMaster, 500);
  const std::vector<float> stale = Gradients(500, 7);
  const GradView stale_view{stale.data(), optim::DType::kFloat32, 100};
  ASSERT_TRUE(engine_->AccumulateGrad(b_, 0, stale_view).ok());
  ASSERT_TRUE(engine_->DiscardGradients(b_).ok());
  EXPECT_EQ(ReadSlot(*engine_, b_, StateSlot::kMaster, 500), master);
  EXPECT_EQ(*engine_->GroupSteps(b_), 2);
  ASSERT_TRUE(engine_->LoadCheckpoint(ckpt_).ok());
  EXPECT_EQ(ReadSlot(*engine_, b_, StateSlot::kExpAvg, 500), saved_b_);
  // Handed over again (no overlap with the discarded range), stepped: the bits of a step given
  // the same gradients directly, on the state the checkpoint holds.
  const std::vector<float> grads = Gradients(500, 4);
  const GradView whole{grads.data(), optim::DType::kFloat32, grads.size()};
  ASSERT_TRUE(engine_->AccumulateGrad(b_, 0, stale_view).ok());
  ASSERT_TRUE(engine_->DiscardGradients(b_).ok());
  ASSERT_TRUE(engine_->AccumulateGrad(b_, 0, whole).ok());
  EngineStepArgs accumulated;
  ASSERT_TRUE(engine_->Step(b_, accumulated).ok());
  const std::vector<float> stepped = ReadSlot(*engine_, b_, StateSlot::kMaster, 500);
  ASSERT_TRUE(engine_->LoadCheckpoint(ckpt_).ok());
  ASSERT_TRUE(StepWith(*engine_, b_, grads).ok());
  EXPECT_EQ(ReadSlot(*engine_, b_, StateSlot::kMaster, 500), stepped);
  EXPECT_EQ(engine_->DiscardGradients(GroupId{99}).code(), StatusCode::kNotFound);
}

// Values in the manifest outside their range are Corruption, found before any group changes.
TEST_F(EngineCheckpointTest, OutOfRangeManifestValuesAreCorruptionAndChangeNothing) {
  StepAway();
  const std::vector<float> now_a = ReadSlot(*engine_, a_, StateSlot::kMaster, kCount);
  const std::string path = VersionFile("manifest.json");
  const Json original = Json::parse(std::ifstream(path));
  ASSERT_TRUE(original["metadata"]["group_settings"].is_array()) << original.dump();
  const std::vector<std::pair<std::string, Json>> edits = {
      {"/metadata/group_settings/1/steps_taken", -1},
      {"/metadata/group_settings/1/hyper/lr", -0.5},
      {"/metadata/group_settings/1/hyper/beta1", 1.5},
  };
  for (const auto& [pointer, value] : edits) {
    Json edited = original;
    edited[Json::json_pointer(pointer)] = value;
    std::ofstream(path, std::ios::trunc) << edited.dump(2);
    const Status loaded = engine_->LoadCheckpoint(ckpt_);
    EXPECT_EQ(loaded.code(), StatusCode::kCorruption) << pointer << ": " << loaded.ToString();
    EXPECT_THAT(std::string(loaded.message()), HasSubstr("group_settings[1]")) << pointer;
    EXPECT_EQ(ReadSlot(*engine_, a_, StateSlot::kMaster, kCount), now_a) << pointer;
    EXPECT_EQ(*engine_->GroupSteps(a_), 2) << pointer;
  }
  std::ofstream(path, std::ios::trunc) << original.dump(2);
  ASSERT_TRUE(engine_->LoadCheckpoint(ckpt_).ok());
  EXPECT_EQ(ReadSlot(*engine_, a_, StateSlot::kMaster, kCount), saved_a_);
}

// View counts whose sum wraps around to the group's count are refused.
TEST(Engine, ViewCountsThatWrapAroundAreRejected) {
  TempDir dir;
  std::unique_ptr<Engine> engine = MakeEngine(SmallConfig(dir));
  ASSERT_NE(engine, nullptr);
  std::vector<float> params = Ramp(kCount, 0.0f, 0.01f);
  const std::vector<ParamView> wrapping = {{params.data(), optim::DType::kFloat32, SIZE_MAX},
                                           {params.data(), optim::DType::kFloat32, 11}};
  Result<GroupId> created = engine->CreateGroup(R"({"name": "w"})", wrapping);
  EXPECT_EQ(created.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(created.status().message()), HasSubstr("params[1]"));

  const GroupId id = CreateGroup(*engine, R"({"name": "g"})", params);
  const std::vector<float> grads = Gradients(kCount, 1);
  const std::vector<GradView> grad_views = {{grads.data(), optim::DType::kFloat32, SIZE_MAX},
                                            {grads.data(), optim::DType::kFloat32, kCount + 1}};
  EngineStepArgs args;
  args.grads = grad_views;
  Result<StepReport> stepped = engine->Step(id, args);
  EXPECT_EQ(stepped.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(stepped.status().message()),
              HasSubstr("grads[1] of 3001 elements overflows"));
  EXPECT_EQ(ReadSlot(*engine, id, StateSlot::kMaster, kCount), params);
}

TEST_F(EngineCheckpointTest, MissingCheckpointIsNotFound) {
  EXPECT_EQ(engine_->LoadCheckpoint(dir_.File("none")).code(), StatusCode::kNotFound);
}

// ---- injected faults --------------------------------------------------------------------------

// Makes psync engines whose faults a test arms later.
struct FaultyIo {
  io::FaultInjectingEngine* engine = nullptr;

  std::function<Result<std::unique_ptr<io::Engine>>()> Factory() {
    return [this]() -> Result<std::unique_ptr<io::Engine>> {
      ZOE_ASSIGN_OR_RETURN(std::unique_ptr<io::Engine> raw, io::CreatePsyncEngine(8));
      auto faulty = std::make_unique<io::FaultInjectingEngine>(std::move(raw), 11);
      engine = faulty.get();
      return std::unique_ptr<io::Engine>(std::move(faulty));
    };
  }

  void Fail(io::FaultOps ops) {
    io::FaultRule rule;
    rule.kind = io::FaultKind::kEio;
    rule.ops = ops;
    rule.nth = 1;
    rule.max_faults = 1;
    engine->AddRule(rule);
  }
};

TEST(EngineFaults, FailedOptimizerWriteLeavesTheStateAndTheNextStepSucceeds) {
  TempDir dir;
  FaultyIo faults;
  EngineHooks hooks;
  hooks.optimizer_io_factory = faults.Factory();
  std::unique_ptr<Engine> engine = MakeEngine(SmallConfig(dir), hooks);
  ASSERT_NE(engine, nullptr);
  std::vector<float> params = Ramp(kCount, 0.0f, 0.01f);
  const GroupId id = CreateGroup(*engine, R"({"name": "g"})", params);
  ASSERT_NE(faults.engine, nullptr);
  faults.Fail(io::FaultOps::kWrites);
  Result<StepReport> failed = StepWith(*engine, id, Gradients(kCount, 1));
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), StatusCode::kIoError) << failed.status().ToString();
  EXPECT_THAT(std::string(failed.status().message()), HasSubstr("optimizer group 'g' step"));
  EXPECT_EQ(ReadSlot(*engine, id, StateSlot::kMaster, kCount), params);
  EXPECT_EQ(*engine->GroupSteps(id), 0);
  EXPECT_EQ(engine->StatsJson()["groups"][0]["steps_called"], 0u);
  ASSERT_TRUE(StepWith(*engine, id, Gradients(kCount, 1)).ok());
  EXPECT_EQ(*engine->GroupSteps(id), 1);
}

TEST(EngineFaults, FailedTensorReadIsReturnedByTheAcquire) {
  TempDir dir;
  FaultyIo faults;
  EngineHooks hooks;
  hooks.tensor_io_factory = faults.Factory();
  std::unique_ptr<Engine> engine = MakeEngine(SmallConfig(dir), hooks);
  ASSERT_NE(engine, nullptr);
  Result<TensorId> id = engine->RegisterTensor({"w", 64 << 10, DType::kUInt8, Tier::kNvme, ""});
  ASSERT_TRUE(id.ok());
  ASSERT_TRUE(engine->Acquire(*id, Tier::kHost, Access::kWrite).ok());
  ASSERT_TRUE(engine->Release(*id).ok());
  ASSERT_TRUE(engine->Evict(*id).ok());
  faults.Fail(io::FaultOps::kReads);
  Result<void*> ptr = engine->Acquire(*id, Tier::kHost, Access::kRead);
  ASSERT_FALSE(ptr.ok());
  EXPECT_EQ(ptr.status().code(), StatusCode::kIoError);
  EXPECT_TRUE(engine->Acquire(*id, Tier::kHost, Access::kRead).ok());
  EXPECT_TRUE(engine->Release(*id).ok());
}

// ---- concurrency ------------------------------------------------------------------------------

TEST(EngineThreads, GroupsTensorsAndStatisticsFromSeveralThreads) {
  TempDir dir;
  std::unique_ptr<Engine> engine = MakeEngine(SmallConfig(dir));
  ASSERT_NE(engine, nullptr);
  std::vector<float> a = Ramp(kCount, 0.0f, 0.01f);
  std::vector<float> b = Ramp(kCount, 1.0f, 0.01f);
  const GroupId ga = CreateGroup(*engine, R"({"name": "a"})", a);
  const GroupId gb = CreateGroup(*engine, R"({"name": "b"})", b);
  Result<TensorId> t = engine->RegisterTensor({"t", 4096, DType::kUInt8, Tier::kNvme, ""});
  ASSERT_TRUE(t.ok());
  std::atomic<int> errors{0};
  auto stepper = [&](GroupId group, int seed) {
    for (int i = 0; i < 5; ++i) {
      if (!StepWith(*engine, group, Gradients(kCount, seed + i)).ok()) ++errors;
    }
  };
  std::thread first(stepper, ga, 0);
  std::thread second(stepper, gb, 10);
  std::thread third(stepper, ga, 20);  // the same group as `first`: serialised by its mutex
  for (int i = 0; i < 20; ++i) {
    Result<void*> ptr = engine->Acquire(*t, Tier::kHost, Access::kReadWrite);
    if (!ptr.ok() || !engine->Release(*t).ok()) ++errors;
    if (engine->StatsJson()["groups"].size() != 2) ++errors;
  }
  first.join();
  second.join();
  third.join();
  EXPECT_EQ(errors.load(), 0);
  EXPECT_EQ(*engine->GroupSteps(ga), 10);
  EXPECT_EQ(*engine->GroupSteps(gb), 5);
}

// ---- single slot and NVMe writes ----------------------------------------------------------------

// The bytes of every NVMe chunk's state of a group of `count` fp32-moment AdamW parameters.
uint64_t StateBytes(size_t count) {
  const StateLayout layout(optim::Kind::kAdamW, optim::DType::kFloat32, count, kSubGroup, 4096);
  uint64_t bytes = 0;
  for (size_t c = 0; c < layout.chunk_count(); ++c) bytes += layout.chunk(c).bytes;
  return bytes;
}

// The statistics name each group's moment dtype and where its master lives: the configuration's
// zoe.moment_dtype unless the group's spec names its own.
TEST(Engine, GroupStatisticsNameTheMomentDtypeAndTheMaster) {
  TempDir dir;
  Json config = SmallConfig(dir);
  config["zoe"]["moment_dtype"] = "int8";
  std::unique_ptr<Engine> engine = MakeEngine(config);
  ASSERT_NE(engine, nullptr);
  std::vector<float> params = Ramp(kCount, 0.0f, 0.01f);
  CreateGroup(*engine, R"({"name": "configured"})", params);
  CreateGroup(*engine, R"({"name": "own", "moment_dtype": "bf16"})", params);
  const Json groups = engine->StatsJson()["groups"];
  EXPECT_EQ(groups[0]["moment_dtype"], "int8");
  EXPECT_EQ(groups[1]["moment_dtype"], "bf16");
  EXPECT_EQ(groups[0]["master"], "zoe");
}

TEST(Engine, SingleSlotFromTheConfigurationOrTheGroupHalvesTheNvmeBytes) {
  TempDir dir;
  Json config = SmallConfig(dir);
  config["zoe"]["slots"] = 1;
  std::unique_ptr<Engine> engine = MakeEngine(config);
  ASSERT_NE(engine, nullptr);
  std::vector<float> params = Ramp(kCount, 0.0f, 0.01f);
  CreateGroup(*engine, R"({"name": "one"})", params);
  CreateGroup(*engine, R"({"name": "two", "slots": 2})", params);
  const Json groups = engine->StatsJson()["groups"];
  EXPECT_EQ(groups[0]["slots"], 1);
  EXPECT_EQ(groups[1]["slots"], 2);
  EXPECT_EQ(groups[0]["nvme_bytes"].get<uint64_t>(), StateBytes(kCount));
  EXPECT_EQ(groups[1]["nvme_bytes"].get<uint64_t>(), 2 * StateBytes(kCount));
  EXPECT_DOUBLE_EQ(groups[0]["nvme_bytes_per_parameter"].get<double>(),
                   static_cast<double>(StateBytes(kCount)) / kCount);
  EXPECT_TRUE(groups[0]["broken"].is_null());
  EXPECT_EQ(engine->ConfigJson()["zoe"]["slots"], 1);
  Json bad = SmallConfig(dir);
  bad["zoe"]["slots"] = 3;
  Result<config::EngineConfig> refused = config::ParseEngineConfigDocument(bad);
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(refused.status().ToString(), HasSubstr("zoe.slots"));
}

// Creating a group writes its initial state once; each step writes every NVMe chunk once.
TEST(Engine, StatsCountTheBytesWrittenToEachNvmePathInTotalAndInTheLastStep) {
  TempDir dir;
  std::unique_ptr<Engine> engine = MakeEngine(SmallConfig(dir));
  ASSERT_NE(engine, nullptr);
  std::vector<float> params = Ramp(kCount, 0.0f, 0.01f);
  const GroupId id = CreateGroup(*engine, R"({"name": "g"})", params);
  const uint64_t state = StateBytes(kCount);
  Json stats = engine->StatsJson();
  ASSERT_EQ(stats["groups"][0]["nvme_writes"].size(), 1u);
  EXPECT_EQ(stats["groups"][0]["nvme_writes"][0]["bytes_written"].get<uint64_t>(), state);
  EXPECT_EQ(stats["groups"][0]["nvme_writes"][0]["bytes_written_last_step"].get<uint64_t>(), 0u);
  for (int step = 1; step <= 2; ++step) {
    Result<StepReport> report = StepWith(*engine, id, Gradients(kCount, step));
    ASSERT_TRUE(report.ok()) << report.status().ToString();
    EXPECT_EQ(report->bytes_written, state);
  }
  stats = engine->StatsJson();
  const Json& file = stats["groups"][0]["nvme_writes"][0];
  EXPECT_EQ(file["bytes_written"].get<uint64_t>(), 3 * state);
  EXPECT_EQ(file["bytes_written_last_step"].get<uint64_t>(), state);
  ASSERT_EQ(stats["nvme_writes"].size(), 1u);
  EXPECT_EQ(stats["nvme_writes"][0]["path"], DirOf(dir));
  EXPECT_EQ(stats["nvme_writes"][0]["bytes_written"].get<uint64_t>(), 3 * state);
  EXPECT_EQ(stats["nvme_writes"][0]["bytes_written_last_step"].get<uint64_t>(), state);
}

// A checkpoint read that fails leaves every group as it was (EngineHooks cover loads too).
TEST(Engine, FailedCheckpointReadLeavesTheGroupsUsable) {
  TempDir dir;
  EngineHooks hooks;
  bool fail_reads = false;
  hooks.checkpoint_fault_for_testing = [&](CheckpointSyscall call, const std::string&) {
    return fail_reads && call == CheckpointSyscall::kRead ? EIO : 0;
  };
  std::unique_ptr<Engine> engine = MakeEngine(SmallConfig(dir), hooks);
  ASSERT_NE(engine, nullptr);
  std::vector<float> params = Ramp(kCount, 0.0f, 0.01f);
  const GroupId id = CreateGroup(*engine, R"({"name": "g"})", params);
  ASSERT_TRUE(StepWith(*engine, id, Gradients(kCount, 1)).ok());
  ASSERT_TRUE(engine->SaveCheckpoint(dir.File("ckpt")).ok());
  ASSERT_TRUE(StepWith(*engine, id, Gradients(kCount, 2)).ok());
  const std::vector<float> now = ReadSlot(*engine, id, StateSlot::kMaster, kCount);
  fail_reads = true;
  const Status loaded = engine->LoadCheckpoint(dir.File("ckpt"));
  EXPECT_EQ(loaded.code(), StatusCode::kIoError) << loaded.ToString();
  EXPECT_THAT(loaded.ToString(), HasSubstr("g.state at offset 0"));
  fail_reads = false;
  EXPECT_EQ(ReadSlot(*engine, id, StateSlot::kMaster, kCount), now);
  EXPECT_EQ(*engine->GroupSteps(id), 2);
  EXPECT_TRUE(StepWith(*engine, id, Gradients(kCount, 3)).ok());
  ASSERT_TRUE(engine->LoadCheckpoint(dir.File("ckpt")).ok());
  EXPECT_EQ(*engine->GroupSteps(id), 1);
}

// A group of kSizingCount parameters on NVMe under a host budget whose optimizer share is 32 MiB:
// the default sub-group (chunk_size / 4 = 1 Mi parameters, 12 MiB of fp32 state) needs four 12 MiB
// pipeline buffers.
constexpr size_t kSizingCount = size_t{4} << 20;

Json SizingConfig(const TempDir& dir, std::optional<uint64_t> sub_group_size) {
  Json document = SmallConfig(dir);
  document["zero_optimization"].erase("sub_group_size");
  if (sub_group_size) document["zero_optimization"]["sub_group_size"] = *sub_group_size;
  document["zoe"]["chunk_size"] = "4M";
  document["zoe"]["host_budget"] = "64M";
  document["zoe"]["tensor_host_budget"] = "32M";
  return document;
}

TEST(EngineSizing, AnAutomaticSubGroupShrinksToFitTheHostBudget) {
  TempDir dir;
  std::unique_ptr<Engine> engine = MakeEngine(SizingConfig(dir, std::nullopt));
  ASSERT_NE(engine, nullptr);
  std::vector<float> params = Ramp(kSizingCount, 0.5f, 1e-7f);
  const GroupId id = CreateGroup(*engine, R"({"name": "big", "lr": 0.01})", params);
  const Json group = engine->StatsJson()["groups"][0];
  EXPECT_EQ(group["sub_group_size"], kMinAutoChunkElements);  // 4 buffers of 3 MiB <= 16 MiB
  EXPECT_EQ(group["chunks"], kSizingCount / kMinAutoChunkElements);
  const std::vector<float> grads = Gradients(kSizingCount, 1);
  Result<StepReport> step = StepWith(*engine, id, grads);
  ASSERT_TRUE(step.ok()) << step.status().ToString();
  EXPECT_GT(step->bytes_written, 0u);
}

// The automatic buffer count: one buffer per NVMe chunk where a quarter of the optimizer pool
// holds them (so every chunk's state is read while its gradients arrive), four where it does
// not, and a count the user gives is kept.
TEST(EngineSizing, AnAutomaticBufferCountGivesEveryNvmeChunkABufferWithinAQuarterOfThePool) {
  const auto buffers_of = [](const std::string& host_budget, std::optional<uint64_t> given) {
    TempDir dir;
    Json document = SizingConfig(dir, size_t{1} << 18);  // 16 chunks of 3 MiB of state
    document["zoe"]["host_budget"] = host_budget;
    if (given) document["zero_optimization"]["offload_optimizer"]["buffer_count"] = *given;
    std::unique_ptr<Engine> engine = MakeEngine(document);
    EXPECT_NE(engine, nullptr);
    if (engine == nullptr) return Json();
    std::vector<float> params = Ramp(kSizingCount, 0.5f, 1e-7f);
    const GroupId id = CreateGroup(*engine, R"({"name": "g", "lr": 0.01})", params);
    const std::vector<float> grads = Gradients(kSizingCount, 1);
    Result<StepReport> step = StepWith(*engine, id, grads);
    EXPECT_TRUE(step.ok()) << step.status().ToString();
    return engine->StatsJson()["groups"][0];
  };
  const Json roomy = buffers_of("512M", std::nullopt);  // 480 MiB pool: 16 x 3 MiB fit 1/4
  EXPECT_EQ(roomy["nvme_chunks"], 16u);
  EXPECT_EQ(roomy["pipeline_buffers"], 16u);
  const Json tight = buffers_of("64M", std::nullopt);  // 32 MiB pool: its quarter holds 2
  EXPECT_EQ(tight["pipeline_buffers"], kMinAutoBufferCount);
  EXPECT_EQ(buffers_of("512M", 3)["pipeline_buffers"], 3u);  // given: kept
  EXPECT_EQ(buffers_of("64M", 6)["pipeline_buffers"], 6u);
}

TEST(EngineSizing, AnAutomaticChunkSizeIsAThirtySecondOfTheTensorsBudgetWithinLimits) {
  EXPECT_EQ(AutoChunkSize(uint64_t{256} << 20), uint64_t{8} << 20);
  EXPECT_EQ(AutoChunkSize(uint64_t{250} << 20), uint64_t{4} << 20);  // a power of two below
  EXPECT_EQ(AutoChunkSize(uint64_t{1} << 20), kMinAutoChunkSize);
  EXPECT_EQ(AutoChunkSize(uint64_t{64} << 30), kMaxAutoChunkSize);
  for (const auto& [budget, chunk] :
       {std::pair<std::string, uint64_t>{"32M", 1u << 20}, {"512M", 16u << 20}}) {
    TempDir dir;
    Json document = SmallConfig(dir);
    document["zoe"].erase("chunk_size");
    document["zero_optimization"].erase("sub_group_size");
    document["zoe"]["host_budget"] = "1G";
    document["zoe"]["tensor_host_budget"] = budget;
    std::unique_ptr<Engine> engine = MakeEngine(document);
    ASSERT_NE(engine, nullptr);
    EXPECT_EQ(engine->ConfigJson()["zoe"]["chunk_size"], chunk) << budget;
    // The automatic sub-group follows the chunk.
    EXPECT_EQ(engine->ConfigJson()["zero_optimization"]["sub_group_size"], chunk / 4) << budget;
  }
  TempDir dir;
  Json given = SmallConfig(dir);
  given["zoe"]["chunk_size"] = "64K";
  given["zoe"]["tensor_host_budget"] = "512M";
  given["zoe"]["host_budget"] = "1G";
  std::unique_ptr<Engine> engine = MakeEngine(given);
  ASSERT_NE(engine, nullptr);
  EXPECT_EQ(engine->ConfigJson()["zoe"]["chunk_size"], 64u << 10);  // a size given is kept
}

TEST(EngineSizing, ASubGroupTheUserSetIsKeptAndARefusalNamesTheKeysAndValuesThatFit) {
  TempDir dir;
  std::unique_ptr<Engine> engine = MakeEngine(SizingConfig(dir, size_t{1} << 20));
  ASSERT_NE(engine, nullptr);
  std::vector<float> params = Ramp(kSizingCount, 0.5f, 1e-7f);
  const ParamView view{params.data(), optim::DType::kFloat32, params.size()};
  Result<GroupId> refused = engine->CreateGroup(R"({"name": "big"})", std::span(&view, 1));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kOutOfMemory);
  const std::string message(refused.status().message());
  EXPECT_THAT(message, HasSubstr("raise zoe.host_budget from 67108864 to at least"));
  EXPECT_THAT(message, HasSubstr("set zero_optimization.sub_group_size to 524288 (now 1048576)"));

  // Each value the message gives works.
  TempDir smaller_dir;
  std::unique_ptr<Engine> smaller = MakeEngine(SizingConfig(smaller_dir, size_t{1} << 19));
  ASSERT_NE(smaller, nullptr);
  CreateGroup(*smaller, R"({"name": "big"})", params);
  EXPECT_EQ(smaller->StatsJson()["groups"][0]["sub_group_size"], size_t{1} << 19);
  const size_t at = message.find("to at least ") + std::string("to at least ").size();
  const uint64_t budget = std::stoull(message.substr(at));
  TempDir larger_dir;
  Json larger = SizingConfig(larger_dir, size_t{1} << 20);
  larger["zoe"]["host_budget"] = budget;
  std::unique_ptr<Engine> roomier = MakeEngine(larger);
  ASSERT_NE(roomier, nullptr);
  CreateGroup(*roomier, R"({"name": "big"})", params);
  EXPECT_EQ(roomier->StatsJson()["groups"][0]["sub_group_size"], size_t{1} << 20);
}

// A host group under a tiny host budget whose tensor share is automatic (half): the host budget
// the refusal suggests is one whose split gives the optimizer enough, and it does.
TEST(EngineSizing, TheHostBudgetAHostGroupsRefusalSuggestsFitsTheAutomaticSplit) {
  TempDir dir;
  auto config = [&](uint64_t host_budget) {
    Json document;
    document["zoe"] = {{"device", "host"},
                       {"host_budget", host_budget},
                       {"tensor_swap_bytes", "1M"},
                       {"nvme_paths", {DirOf(dir)}}};
    document["zero_optimization"]["offload_optimizer"] = {{"device", "cpu"}};
    return document;
  };
  std::vector<float> params(1000, 0.5f);
  const ParamView view{params.data(), optim::DType::kFloat32, params.size()};
  std::unique_ptr<Engine> tiny = MakeEngine(config(1024));
  ASSERT_NE(tiny, nullptr);
  Result<GroupId> refused = tiny->CreateGroup(R"({"name": "g"})", std::span(&view, 1));
  ASSERT_FALSE(refused.ok());
  ASSERT_EQ(refused.status().code(), StatusCode::kOutOfMemory);
  const std::string message(refused.status().message());
  EXPECT_THAT(message, Not(HasSubstr("pipeline buffers"))) << "a HOST group has none";
  EXPECT_THAT(message, HasSubstr("tensor_host_budget being half of host_budget"));
  const size_t at = message.find("to at least ");
  ASSERT_NE(at, std::string::npos) << message;
  const uint64_t budget = std::stoull(message.substr(at + std::string("to at least ").size()));
  std::unique_ptr<Engine> advised = MakeEngine(config(budget));
  ASSERT_NE(advised, nullptr);
  Result<GroupId> created = advised->CreateGroup(R"({"name": "g"})", std::span(&view, 1));
  EXPECT_TRUE(created.ok()) << "host_budget " << budget << ": " << created.status().ToString();
}

}  // namespace
}  // namespace zoe::offload
