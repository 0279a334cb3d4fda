#include "offload/engine.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <map>
#include <type_traits>
#include <utility>

#include "core/engine_config_auto.h"
#include "core/log.h"
#include "core/memory_limits.h"
#include "io/backend.h"
#include "io/stale_swap.h"
#include "io/swap_space.h"
#include "offload/checkpoint/checkpoint_store.h"

namespace zoe::offload {
namespace {

using Json = nlohmann::json;

constexpr uint64_t kDirectIoUnit = 4096;

// The name of the private swap directory of an engine given none, before mkdtemp's six characters.
constexpr const char* kPrivateDirectoryPrefix = "zoe-engine-";

// Where a private swap directory goes when the configuration names none.
std::string ScratchBase() {
  const char* tmpdir = std::getenv("TMPDIR");
  return tmpdir != nullptr && *tmpdir != '\0' ? tmpdir : "/var/tmp";
}

Json HyperToJson(const optim::HyperParams& hyper) {
  return {{"lr", hyper.lr},
          {"beta1", hyper.beta1},
          {"beta2", hyper.beta2},
          {"eps", hyper.eps},
          {"weight_decay", hyper.weight_decay},
          {"lr_decay", hyper.lr_decay}};
}

Result<optim::HyperParams> HyperFromJson(const Json& json, optim::Kind kind) {
  optim::HyperParams hyper;
  hyper.kind = kind;
  try {
    hyper.lr = json.at("lr").get<double>();
    hyper.beta1 = json.at("beta1").get<double>();
    hyper.beta2 = json.at("beta2").get<double>();
    hyper.eps = json.at("eps").get<double>();
    hyper.weight_decay = json.at("weight_decay").get<double>();
    hyper.lr_decay = json.at("lr_decay").get<double>();
  } catch (const Json::exception& e) {
    return Status::Corruption(fmt::format("hyper-parameters {}: {}", json.dump(), e.what()));
  }
  return hyper;
}

// Checks that `views` (grads or params) cover the group's `count` elements exactly. A view
// without data is allowed where `absent_allowed`: a gradient view says its elements have no
// gradient (OptimizerGroup checks that they are whole segments), an initial parameter view that
// their master weights start at zero; parameter views of a step need their buffer.
template <class View>
Status CheckViews(std::span<const View> views, size_t count, std::string_view what,
                  bool absent_allowed) {
  uint64_t total = 0;
  for (size_t i = 0; i < views.size(); ++i) {
    if (views[i].data == nullptr && views[i].count > 0 && !absent_allowed)
      return Status::InvalidArgument(fmt::format("{}[{}] has no data (NULL)", what, i));
    if (views[i].count > std::numeric_limits<uint64_t>::max() - total)
      return Status::InvalidArgument(
          fmt::format("{}[{}] of {} elements overflows the {} elements of the views before it",
                      what, i, views[i].count, total));
    total += views[i].count;
  }
  if (total == count) return Status::Ok();
  return Status::InvalidArgument(
      fmt::format("{} cover {} elements in {} views; the group has {} parameters", what, total,
                  views.size(), count));
}

Status CheckRange(uint64_t offset, uint64_t count, size_t group_count) {
  if (offset <= group_count && count <= group_count - offset) return Status::Ok();
  return Status::InvalidArgument(fmt::format("elements {} are outside the group's {} parameters",
                                             DescribeElementRange(offset, count), group_count));
}

Status CheckSlot(StateSlot slot) {
  if (static_cast<uint8_t>(slot) <= static_cast<uint8_t>(StateSlot::kExpAvgSq)) return Status::Ok();
  return Status::InvalidArgument(
      fmt::format("state slot {} is not one of master (0), exp_avg (1), exp_avg_sq (2)",
                  static_cast<int>(slot)));
}

}  // namespace

std::string_view EngineVersion() { return "0.2.0"; }

struct Engine::Group {
  mutable std::mutex mutex;             // serialises every call on this group
  std::unique_ptr<io::SwapSpace> swap;  // outlives `optimizer`, which holds extents in it
  std::unique_ptr<OptimizerGroup> optimizer;
  std::string name;
  optim::HyperParams hyper;
  // Step figures for StatsJson.
  Json auto_values;  // GroupSpec::auto_values
  uint64_t steps_called = 0;
  uint64_t steps_skipped = 0;
  uint64_t bytes_read = 0;
  uint64_t bytes_reused = 0;
  uint64_t bytes_written = 0;
  double seconds = 0.0;
  double io_wait_seconds = 0.0;
  double compute_seconds = 0.0;
  double last_grad_norm = 0.0;
  // Bytes written to each of the swap's files in the last Step call, failed ones included.
  std::vector<uint64_t> written_last_step;
};

namespace {

// Bytes written so far to each file of `swap` (none when the group has no swap space).
std::vector<uint64_t> BytesWritten(io::SwapSpace* swap) {
  std::vector<uint64_t> written;
  if (swap == nullptr) return written;
  for (size_t i = 0; i < swap->files().file_count(); ++i) {
    written.push_back(swap->files().file(i).bytes_written());
  }
  return written;
}

// `path` without "." and ".." parts, doubled or trailing separators, so that one directory has
// one spelling.
std::string NormalPath(const std::string& path) {
  std::filesystem::path normal = std::filesystem::path(path).lexically_normal();
  if (!normal.has_filename() && normal.has_parent_path() && normal != normal.root_path()) {
    normal = normal.parent_path();
  }
  return normal.string();
}

// The directory a swap file lives in.
std::string DirectoryOf(const std::string& path) {
  return NormalPath(std::filesystem::path(path).lexically_normal().parent_path().string());
}

}  // namespace

// ---- creation ---------------------------------------------------------------------------------

Result<std::unique_ptr<Engine>> Engine::CreateFromJson(std::string_view json_text,
                                                       EngineHooks hooks) {
  ZOE_ASSIGN_OR_RETURN(config::EngineConfig config,
                       config::ParseEngineConfig(json_text.empty() ? "{}" : json_text));
  return Create(std::move(config), std::move(hooks));
}

Result<std::unique_ptr<Engine>> Engine::Create(config::EngineConfig config, EngineHooks hooks) {
  // The level first: every line below obeys it.
  if (!config.zoe.log_level.empty()) ZOE_RETURN_IF_ERROR(log::SetLevel(config.zoe.log_level));
  const MemoryLimits memory = ReadMemoryLimits();
  const HostBudgets budgets = ResolveHostBudgets(config.zoe, memory.usable_bytes());
  if (config.zoe.host_budget == 0)
    ZOE_LOG_INFO("engine: zoe.host_budget {} bytes, half of what this process may use ({})",
                 budgets.total, memory.Describe());
  if (config.zoe.chunk_size == 0) {
    config.zoe.chunk_size = AutoChunkSize(budgets.tensors);
    ZOE_LOG_INFO("engine: zoe.chunk_size {} bytes, from the tensors' host budget of {} bytes",
                 config.zoe.chunk_size, budgets.tensors);
  }
  std::vector<std::string> nvme_paths = config.zoe.nvme_paths;
  const std::string ignored = config::DescribeIgnoredKeys(config);
  if (!ignored.empty()) ZOE_LOG_INFO("engine: {}", ignored);
  const std::string framework = config::DescribeFrameworkKeys(config);
  if (!framework.empty()) ZOE_LOG_DEBUG("engine: {}", framework);
  for (const std::string& warning : config.warnings) ZOE_LOG_WARN("engine: {}", warning);
  const std::string automatic = config::DescribeAutoValues(config);
  if (!automatic.empty()) ZOE_LOG_INFO("engine: {}", automatic);
  std::unique_ptr<Engine> engine(new Engine(std::move(config), std::move(hooks), budgets));
  ZOE_RETURN_IF_ERROR(engine->Build(std::move(nvme_paths)));
  return engine;
}

Engine::Engine(config::EngineConfig config, EngineHooks hooks, HostBudgets budgets)
    : config_(std::move(config)), hooks_(std::move(hooks)), budgets_(budgets) {}

Status Engine::Build(std::vector<std::string> nvme_paths) {
  if (nvme_paths.empty()) {
    io::RemoveStalePrivateDirectories(ScratchBase(), kPrivateDirectoryPrefix);
    ZOE_ASSIGN_OR_RETURN(scratch_,
                         ScratchDir::Create(ScratchBase() + "/" + kPrivateDirectoryPrefix));
    nvme_paths.push_back(scratch_->path());
    ZOE_LOG_INFO("engine: no zoe.nvme_paths; tensors swap to {}", scratch_->path());
  }
  ZOE_RETURN_IF_ERROR(EnsureSwapDirectories(nvme_paths));
  nvme_paths_ = nvme_paths;
  ZOE_ASSIGN_OR_RETURN(TierManagerOptions options,
                       MakeTierManagerOptions(config_, std::move(nvme_paths), budgets_));
  options.engine_factory = hooks_.tensor_io_factory;
  options.refuse_direct_for_testing = hooks_.refuse_direct_for_testing;
  Result<std::unique_ptr<TierManager>> manager = TierManager::Create(std::move(options));
  if (!manager.ok()) return std::move(manager).status().WithContext("engine: tensors");
  tier_manager_ = std::move(manager).value();
  PinnedPoolOptions pool;
  pool.name = "optimizer state";
  pool.budget_bytes = budgets_.optimizer;
  ZOE_ASSIGN_OR_RETURN(PinnedMemoryPool created, PinnedMemoryPool::Create(std::move(pool)));
  optimizer_pool_.emplace(std::move(created));
  return Status::Ok();
}

Engine::~Engine() {
  {
    std::lock_guard lock(groups_mutex_);
    groups_.clear();  // before the queue, pool and executor they borrow
  }
  optimizer_io_.reset();
  tier_manager_.reset();
}

// ---- engine -----------------------------------------------------------------------------------

void Engine::RecordAsyncError(Status status) {
  std::lock_guard lock(async_mutex_);
  if (async_error_.ok()) async_error_ = std::move(status);
}

Status Engine::TakeAsyncError() {
  std::lock_guard lock(async_mutex_);
  return std::exchange(async_error_, Status::Ok());
}

Status Engine::Flush() { return tier_manager_->Flush(); }

Status Engine::CheckHostMemory(const void* data, uint64_t count, uint64_t element_bytes,
                               std::string_view what) const {
  // A count too large for the address space overlaps everything above `data` (saturated).
  const uint64_t bytes =
      element_bytes != 0 && count > std::numeric_limits<uint64_t>::max() / element_bytes
          ? std::numeric_limits<uint64_t>::max()
          : count * element_bytes;
  if (data == nullptr || !tier_manager_->HoldsDeviceMemory(data, bytes)) return Status::Ok();
  return Status::InvalidArgument(fmt::format(
      "{} ({} elements of {} bytes at {}) is in the device tier's memory (device '{}'), not host "
      "memory: copy the values to host memory first (a tensor acquired on the device tier, say, "
      "is read on the host after a copy, or acquired on ZOE_TIER_HOST)",
      what, count, element_bytes, data, tier_manager_->device_name()));
}

// What speculation did in the group's steps (OptimizerGroup::speculation_stats).
static Json SpeculationJson(const OptimizerGroup& optimizer) {
  const SpeculationStats& s = optimizer.speculation_stats();
  return {{"enabled", optimizer.options().speculative}, {"steps", s.steps},
          {"chunks_speculative", s.chunks_speculative}, {"chunks_committed", s.chunks_committed},
          {"chunks_recomputed", s.chunks_recomputed},   {"chunks_discarded", s.chunks_discarded}};
}

Json Engine::GroupStatsJson(const Group& group) const {
  std::lock_guard lock(group.mutex);
  const OptimizerGroup& optimizer = *group.optimizer;
  Json writes = Json::array();
  const std::vector<uint64_t> written = BytesWritten(group.swap.get());
  for (size_t i = 0; i < written.size(); ++i) {
    const uint64_t last = i < group.written_last_step.size() ? group.written_last_step[i] : 0;
    writes.push_back({{"file", group.swap->files().file(i).path()},
                      {"bytes_written", written[i]},
                      {"bytes_written_last_step", last}});
  }
  const Json broken =
      optimizer.broken().ok() ? Json() : Json(std::string(optimizer.broken().ToString()));
  return {{"name", group.name},
          {"type", optim::KindName(optimizer.options().kind)},
          {"moment_dtype", DTypeName(optimizer.options().state_dtype)},
          {"master", optimizer.options().master_in_params ? "params" : "zoe"},
          {"parameters", optimizer.count()},
          {"placement", TierName(optimizer.options().placement)},
          {"chunks", optimizer.chunk_count()},
          {"sub_group_size", optimizer.options().chunk_elements},
          {"nvme_chunks", optimizer.nvme_chunk_count()},
          {"pipeline_buffers", optimizer.options().buffer_count},
          {"pinned_bytes", optimizer.pinned_bytes()},
          {"nvme_bytes", optimizer.nvme_bytes()},
          {"nvme_bytes_per_parameter",
           static_cast<double>(optimizer.nvme_bytes()) / static_cast<double>(optimizer.count())},
          {"slots", optimizer.options().slots},
          {"broken", broken},
          {"nvme_writes", std::move(writes)},
          {"steps_taken", optimizer.steps_taken()},
          {"segments", optimizer.segment_count()},
          {"steps_called", group.steps_called},
          {"steps_skipped", group.steps_skipped},
          {"bytes_read", group.bytes_read},
          {"bytes_reused", group.bytes_reused},
          {"bytes_written", group.bytes_written},
          {"seconds", group.seconds},
          {"io_wait_seconds", group.io_wait_seconds},
          {"compute_seconds", group.compute_seconds},
          {"last_grad_norm", group.last_grad_norm},
          {"speculation", SpeculationJson(optimizer)},
          {"hyper", HyperToJson(group.hyper)},
          {"auto", group.auto_values}};
}

Json Engine::StatsJson() const {
  Json out = tier_manager_->StatsJson();
  std::vector<const Group*> snapshot;
  std::string optimizer_backend;
  {
    std::lock_guard lock(groups_mutex_);
    for (const auto& group : groups_) snapshot.push_back(group.get());
    optimizer_backend = optimizer_backend_;
  }
  // Each group's figures under its own mutex, after the vector's is released: a long step of one
  // group delays these statistics, never another group's calls.
  Json groups = Json::array();
  for (const Group* group : snapshot) groups.push_back(GroupStatsJson(*group));
  out["io_backend"] = {{"tensors", tier_manager_->io_backend()},
                       {"optimizer", optimizer_backend.empty() ? Json() : Json(optimizer_backend)}};
  out["host_budget"] = {{"total", budgets_.total},
                        {"tensors", budgets_.tensors},
                        {"optimizer", budgets_.optimizer},
                        {"tensors_reserved", tier_manager_->host_reserved_bytes()},
                        {"optimizer_used", optimizer_pool_->used_bytes()}};
  out["device"] = {{"present", tier_manager_->has_device()},
                   {"backend", tier_manager_->device_name()},
                   {"gpu", tier_manager_->device_is_gpu()},
                   {"budget_bytes", tier_manager_->device_budget_bytes()},
                   {"reserved_bytes", tier_manager_->device_reserved_bytes()}};
  out["nvme_writes"] = NvmeWritesJson(groups);
  out["groups"] = std::move(groups);
  return out;
}

// Bytes written to each NVMe path by the tensors and every group, in total and in each group's
// last step: {"path", "bytes_written", "bytes_written_last_step"} per path.
Json Engine::NvmeWritesJson(const Json& groups) const {
  std::map<std::string, std::pair<uint64_t, uint64_t>> by_path;  // total, last step
  for (const std::string& path : nvme_paths_) by_path[NormalPath(path)];
  const io::FileSet& tensors = tier_manager_->swap_files();
  for (size_t i = 0; i < tensors.file_count(); ++i) {
    by_path[DirectoryOf(tensors.file(i).path())].first += tensors.file(i).bytes_written();
  }
  for (const Json& group : groups) {
    for (const Json& file : group["nvme_writes"]) {
      auto& [total, last] = by_path[DirectoryOf(file["file"].get<std::string>())];
      total += file["bytes_written"].get<uint64_t>();
      last += file["bytes_written_last_step"].get<uint64_t>();
    }
  }
  Json out = Json::array();
  for (const auto& [path, written] : by_path) {
    out.push_back({{"path", path},
                   {"bytes_written", written.first},
                   {"bytes_written_last_step", written.second}});
  }
  return out;
}

Json Engine::ConfigJson() const {
  config::EngineConfig effective = config_;
  effective.zoe.host_budget = budgets_.total;
  effective.zoe.tensor_host_budget = budgets_.tensors;
  effective.zoe.nvme_paths = nvme_paths_;
  if (effective.zero.sub_group_size == 0)
    effective.zero.sub_group_size = effective.zoe.chunk_size / 4;
  if (effective.zoe.device_budget == 0)
    effective.zoe.device_budget = tier_manager_->device_budget_bytes();
  return config::ToJson(effective);
}

// ---- tensors and traces -----------------------------------------------------------------------

Result<TensorId> Engine::RegisterTensor(TensorDesc desc) {
  return tier_manager_->RegisterTensor(std::move(desc));
}

Result<TensorId> Engine::FindTensor(std::string_view name) const {
  return tier_manager_->Find(name);
}

Result<void*> Engine::Acquire(TensorId tensor, Tier tier, Access access) {
  if (!IsValidAccess(access)) {
    return Status::InvalidArgument(fmt::format(
        "access {} is not one of read (0), write (1), read_write (2)", static_cast<int>(access)));
  }
  return tier_manager_->Acquire(tensor, tier, access);
}

Status Engine::Release(TensorId tensor) { return tier_manager_->Release(tensor); }

Status Engine::Prefetch(TensorId tensor, Tier tier) {
  Status started = tier_manager_->Prefetch(tensor, tier);
  const StatusCode code = started.code();
  if (started.ok() || code == StatusCode::kInvalidArgument || code == StatusCode::kNotFound)
    return started;
  RecordAsyncError(std::move(started));
  return Status::Ok();
}

Status Engine::Evict(TensorId tensor) { return tier_manager_->Evict(tensor); }

Status Engine::TraceBegin(std::string_view name) { return tier_manager_->TraceBegin(name); }
Status Engine::TraceEnd() { return tier_manager_->TraceEnd(); }

Status Engine::TraceSave(std::string_view name, const std::string& path) const {
  return tier_manager_->TraceSave(name, path);
}

Result<std::string> Engine::TraceLoad(const std::string& path) {
  return tier_manager_->TraceLoad(path);
}

// ---- optimizer groups -------------------------------------------------------------------------

Result<Engine::Group*> Engine::FindGroupSlot(GroupId id) const {
  std::lock_guard lock(groups_mutex_);
  if (!id.valid() || id.value >= groups_.size()) {
    return Status::NotFound(
        fmt::format("optimizer group {} does not exist ({} groups)", id.value, groups_.size()));
  }
  return groups_[id.value].get();
}

Result<GroupId> Engine::FindGroup(std::string_view name) const {
  std::lock_guard lock(groups_mutex_);
  for (size_t i = 0; i < groups_.size(); ++i) {
    if (groups_[i]->name == name) return GroupId(static_cast<uint32_t>(i));
  }
  return Status::NotFound(fmt::format("optimizer group '{}' does not exist", name));
}

size_t Engine::group_count() const {
  std::lock_guard lock(groups_mutex_);
  return groups_.size();
}

Status Engine::EnsureOptimizerIo() {
  if (optimizer_io_) return Status::Ok();
  std::unique_ptr<io::Engine> raw;
  if (hooks_.optimizer_io_factory) {
    ZOE_ASSIGN_OR_RETURN(raw, hooks_.optimizer_io_factory());
  } else {
    io::EngineOptions options;
    ZOE_ASSIGN_OR_RETURN(options.backend, io::ParseBackend(config_.aio.backend));
    options.queue_depth = static_cast<uint32_t>(config_.aio.queue_depth);
    ZOE_ASSIGN_OR_RETURN(raw, io::CreateEngine(options));
  }
  ZOE_ASSIGN_OR_RETURN(optimizer_io_, io::IoQueue::Create(std::move(raw)));
  std::lock_guard lock(groups_mutex_);
  optimizer_backend_ = std::string(optimizer_io_->backend());
  return Status::Ok();
}

Executor& Engine::EnsureExecutor() {
  if (!executor_) executor_ = std::make_unique<Executor>();
  return *executor_;
}

Result<std::unique_ptr<io::SwapSpace>> Engine::CreateGroupSwap(
    const OptimizerGroupOptions& options) {
  io::SwapOptions swap;
  swap.files.open.direct = config_.aio.use_direct;
  swap.files.open.refuse_direct_for_testing = hooks_.refuse_direct_for_testing;
  swap.files.stripe_unit = config_.zoe.stripe_unit;
  swap.files.checksum_block = config_.zoe.checksum ? kDirectIoUnit : 0;
  swap.alignment = kDirectIoUnit;
  swap.name_prefix = "zoe-optimizer";
  const uint64_t bytes = GroupSwapBytes(options, kDirectIoUnit);
  return io::SwapSpace::Create(nvme_paths_, bytes, swap);
}

// An OutOfMemory from creating a group, with the configuration keys that would make it fit and
// the values that would: the host budget that holds the group, and for NVMe groups a smaller
// sub-group size.
Status Engine::WithSizingAdvice(Status status, const OptimizerGroupOptions& options,
                                uint64_t pinned_free) const {
  if (status.code() != StatusCode::kOutOfMemory) return status;
  // What the group needs on top of what other groups hold, and the host budget whose split
  // (ResolveHostBudgets) gives the optimizer that much.
  const uint64_t needed =
      GroupPinnedNeed(options, optimizer_pool_->alignment(), kDirectIoUnit).total();
  const uint64_t held = budgets_.optimizer - std::min(budgets_.optimizer, pinned_free);
  const uint64_t host_budget = HostBudgetForOptimizer(config_.zoe, held + needed);
  std::string advice = fmt::format(
      "; to fit, raise zoe.host_budget from {} to at least {} bytes (the optimizer groups get "
      "host_budget - tensor_host_budget, {})",
      budgets_.total, host_budget,
      config_.zoe.tensor_host_budget != 0 ? "tensor_host_budget as configured"
                                          : "tensor_host_budget being half of host_budget");
  const size_t fitting =
      options.placement == Tier::kNvme
          ? LargestChunkWithin(options, pinned_free, optimizer_pool_->alignment(), 1)
          : 0;
  if (fitting != 0) {
    advice += fmt::format(", or set zero_optimization.sub_group_size to {} (now {})", fitting,
                          options.chunk_elements);
  } else if (options.placement != Tier::kNvme) {
    advice += ", or put the state on NVMe (zero_optimization.offload_optimizer.device \"nvme\")";
  }
  return Status(status.code(), std::string(status.message()) + advice, status.sys_errno());
}

Result<GroupId> Engine::CreateGroup(std::string_view optim_json,
                                    std::span<const ParamView> params) {
  uint64_t count = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].count > std::numeric_limits<uint64_t>::max() - count)
      return Status::InvalidArgument(
          fmt::format("optimizer group: params[{}] of {} elements overflows the {} elements of "
                      "the views before it",
                      i, params[i].count, count));
    count += params[i].count;
  }
  Result<GroupSpec> parsed = ParseGroupSpec(optim_json, config_, count);
  if (!parsed.ok()) return std::move(parsed).status().WithContext("optimizer group");
  GroupSpec spec = std::move(parsed).value();
  const std::string context = fmt::format("optimizer group '{}'", spec.options.name);
  ZOE_RETURN_IF_ERROR(
      CheckViews(params, count, "params", /*absent_allowed=*/true).WithContext(context));

  std::lock_guard create(create_mutex_);
  if (FindGroup(spec.options.name).ok())
    return Status::InvalidArgument(fmt::format("{} already exists; names are unique", context));
  auto group = std::make_unique<Group>();
  group->name = spec.options.name;
  group->hyper = spec.hyper;
  group->auto_values = spec.auto_values;
  if (!spec.auto_values.empty())
    ZOE_LOG_INFO("{}: \"auto\" configuration values: {}", context, spec.auto_values.dump());
  spec.options.run.executor = &EnsureExecutor();
  OptimizerResources resources;
  resources.pinned = &*optimizer_pool_;
  const uint64_t pinned_free =
      optimizer_pool_->budget_bytes() -
      std::min(optimizer_pool_->budget_bytes(), optimizer_pool_->used_bytes());
  FitAutoSubGroup(config_, pinned_free, optimizer_pool_->alignment(), &spec.options);
  FitAutoBufferCount(config_, pinned_free, optimizer_pool_->alignment(), &spec.options);
  if (spec.options.placement == Tier::kNvme) {
    ZOE_RETURN_IF_ERROR(EnsureOptimizerIo().WithContext(context));
    Result<std::unique_ptr<io::SwapSpace>> swap = CreateGroupSwap(spec.options);
    if (!swap.ok()) return std::move(swap).status().WithContext(context);
    group->swap = std::move(swap).value();
    resources.io = optimizer_io_.get();
    resources.swap = group->swap.get();
  }
  Result<std::unique_ptr<OptimizerGroup>> created =
      OptimizerGroup::Create(spec.options, resources, params);
  if (!created.ok()) {
    return WithSizingAdvice(std::move(created).status(), spec.options, pinned_free)
        .WithContext(context);
  }
  group->optimizer = std::move(created).value();
  std::lock_guard lock(groups_mutex_);
  groups_.push_back(std::move(group));
  return GroupId(static_cast<uint32_t>(groups_.size() - 1));
}

// The group's step arguments from the engine's: its hyper-parameters with those given, checked,
// and the views checked against the group's `count` elements.
static Result<StepArgs> GroupStepArgs(const std::string& context, const optim::HyperParams& current,
                                      size_t count, const EngineStepArgs& args) {
  optim::HyperParams hyper = current;
  if (args.hyper) {
    hyper = current.WithStepValues(*args.hyper);
    ZOE_RETURN_IF_ERROR(optim::ValidateHyperParams(hyper).WithContext(context));
  }
  if (!(args.loss_scale > 0.0) || !std::isfinite(args.loss_scale)) {
    return Status::InvalidArgument(fmt::format(
        "{}: loss_scale = {} must be a finite number > 0 (1 for none)", context, args.loss_scale));
  }
  if (!args.grads.empty())
    ZOE_RETURN_IF_ERROR(
        CheckViews(args.grads, count, "grads", /*absent_allowed=*/true).WithContext(context));
  if (!args.params.empty())
    ZOE_RETURN_IF_ERROR(
        CheckViews(args.params, count, "params", /*absent_allowed=*/true).WithContext(context));
  StepArgs step;
  step.hyper = hyper;
  step.grads = args.grads;
  step.params = args.params;
  step.loss_scale = args.loss_scale;
  step.agree_scan = args.agree_scan;
  return step;
}

Result<StepReport> Engine::Step(GroupId id, const EngineStepArgs& args) {
  ZOE_ASSIGN_OR_RETURN(Group * group, FindGroupSlot(id));
  std::lock_guard lock(group->mutex);
  const std::string context = fmt::format("optimizer group '{}' step", group->name);
  ZOE_ASSIGN_OR_RETURN(const StepArgs step,
                       GroupStepArgs(context, group->hyper, group->optimizer->count(), args));
  const optim::HyperParams& hyper = step.hyper;
  const std::vector<uint64_t> written_before = BytesWritten(group->swap.get());
  Result<StepReport> report = group->optimizer->Step(step);
  group->written_last_step = BytesWritten(group->swap.get());
  for (size_t i = 0; i < written_before.size(); ++i) {
    group->written_last_step[i] -= written_before[i];
  }
  if (!report.ok()) return std::move(report).status().WithContext(context);
  group->hyper = hyper;
  ++group->steps_called;
  if (report->skipped) ++group->steps_skipped;
  group->bytes_read += report->bytes_read;
  group->bytes_reused += report->bytes_reused;
  group->bytes_written += report->bytes_written;
  group->seconds += report->seconds;
  group->io_wait_seconds += report->io_wait_seconds;
  group->compute_seconds += report->compute_seconds;
  group->last_grad_norm = report->grad_norm;
  return report;
}

Status Engine::AccumulateGrad(GroupId id, uint64_t offset, const GradView& grad) {
  ZOE_ASSIGN_OR_RETURN(Group * group, FindGroupSlot(id));
  std::lock_guard lock(group->mutex);
  const std::string context = fmt::format("optimizer group '{}' accumulate_grad", group->name);
  ZOE_RETURN_IF_ERROR(
      CheckRange(offset, grad.count, group->optimizer->count()).WithContext(context));
  return group->optimizer->AccumulateGrad(static_cast<size_t>(offset), grad).WithContext(context);
}

Status Engine::DiscardGradients(GroupId id) {
  ZOE_ASSIGN_OR_RETURN(Group * group, FindGroupSlot(id));
  std::lock_guard lock(group->mutex);
  group->optimizer->DiscardGradients();
  return Status::Ok();
}

Result<double> Engine::AccumulatedGradSumSquares(GroupId id) {
  ZOE_ASSIGN_OR_RETURN(Group * group, FindGroupSlot(id));
  std::lock_guard lock(group->mutex);
  ZOE_ASSIGN_OR_RETURN(const optim::GradScan scan, group->optimizer->AccumulatedScan());
  return scan.sum_squares;
}

Status Engine::Speculate(GroupId id, const EngineStepArgs& args) {
  ZOE_ASSIGN_OR_RETURN(Group * group, FindGroupSlot(id));
  std::lock_guard lock(group->mutex);
  const std::string context = fmt::format("optimizer group '{}' speculate", group->name);
  ZOE_ASSIGN_OR_RETURN(const StepArgs step,
                       GroupStepArgs(context, group->hyper, group->optimizer->count(), args));
  return group->optimizer->Speculate(step).WithContext(context);
}

Result<SpeculationStats> Engine::GroupSpeculationStats(GroupId id) const {
  ZOE_ASSIGN_OR_RETURN(Group * group, FindGroupSlot(id));
  std::lock_guard lock(group->mutex);
  return group->optimizer->speculation_stats();
}

Status Engine::ReadState(GroupId id, StateSlot slot, uint64_t offset, std::span<float> out) const {
  ZOE_ASSIGN_OR_RETURN(Group * group, FindGroupSlot(id));
  std::lock_guard lock(group->mutex);
  const std::string context = fmt::format("optimizer group '{}' read state", group->name);
  ZOE_RETURN_IF_ERROR(CheckSlot(slot).WithContext(context));
  ZOE_RETURN_IF_ERROR(
      CheckRange(offset, out.size(), group->optimizer->count()).WithContext(context));
  return group->optimizer->ReadState(slot, static_cast<size_t>(offset), out).WithContext(context);
}

Status Engine::WriteState(GroupId id, StateSlot slot, uint64_t offset,
                          std::span<const float> values) {
  ZOE_ASSIGN_OR_RETURN(Group * group, FindGroupSlot(id));
  std::lock_guard lock(group->mutex);
  const std::string context = fmt::format("optimizer group '{}' write state", group->name);
  ZOE_RETURN_IF_ERROR(CheckSlot(slot).WithContext(context));
  ZOE_RETURN_IF_ERROR(
      CheckRange(offset, values.size(), group->optimizer->count()).WithContext(context));
  return group->optimizer->WriteState(slot, static_cast<size_t>(offset), values)
      .WithContext(context);
}

Result<int64_t> Engine::GroupSteps(GroupId id) const {
  ZOE_ASSIGN_OR_RETURN(Group * group, FindGroupSlot(id));
  std::lock_guard lock(group->mutex);
  return group->optimizer->steps_taken();
}

Status Engine::SetGroupSteps(GroupId id, int64_t steps) {
  ZOE_ASSIGN_OR_RETURN(Group * group, FindGroupSlot(id));
  Status valid = CheckStepCount("steps", steps);
  if (!valid.ok())
    return std::move(valid).WithContext(fmt::format("optimizer group '{}'", group->name));
  std::lock_guard lock(group->mutex);
  group->optimizer->set_steps_taken(steps);
  return Status::Ok();
}

Status Engine::CopyGroupSegmentSteps(GroupId id, std::span<int64_t> out) const {
  ZOE_ASSIGN_OR_RETURN(Group * group, FindGroupSlot(id));
  std::lock_guard lock(group->mutex);
  const std::span<const int64_t> steps = group->optimizer->segment_steps();
  if (steps.size() != out.size()) {
    return Status::InvalidArgument(fmt::format("optimizer group '{}' has {} segments; n = {}",
                                               group->name, steps.size(), out.size()));
  }
  std::copy(steps.begin(), steps.end(), out.begin());
  return Status::Ok();
}

Status Engine::SetGroupSegmentSteps(GroupId id, std::span<const int64_t> steps) {
  ZOE_ASSIGN_OR_RETURN(Group * group, FindGroupSlot(id));
  std::lock_guard lock(group->mutex);
  return group->optimizer->SetSegmentSteps(steps);
}

// ---- checkpoints ------------------------------------------------------------------------------

std::vector<std::unique_lock<std::mutex>> Engine::LockAllGroups() const {
  std::vector<Group*> groups;
  {
    std::lock_guard lock(groups_mutex_);
    for (const auto& group : groups_) groups.push_back(group.get());
  }
  std::vector<std::unique_lock<std::mutex>> locks;
  for (Group* group : groups) locks.emplace_back(group->mutex);
  return locks;
}

Status Engine::SaveCheckpoint(const std::string& dir) {
  std::lock_guard create(create_mutex_);
  const auto locks = LockAllGroups();
  Json identities = Json::array();
  Json settings = Json::array();
  for (const auto& group : groups_) {
    identities.push_back(group->optimizer->Identity());
    settings.push_back({{"name", group->name},
                        {"steps_taken", group->optimizer->steps_taken()},
                        {"hyper", HyperToJson(group->hyper)}});
  }
  Json metadata = {{"engine_version", EngineVersion()},
                   {"groups", std::move(identities)},
                   {"group_settings", std::move(settings)}};
  // Every group's file size is known, so a checkpoint that does not fit fails before it writes.
  CheckpointWriterOptions options;
  options.fault_for_testing = hooks_.checkpoint_fault_for_testing;
  for (const auto& group : groups_)
    options.expected_file_sizes.push_back(group->optimizer->checkpoint_bytes());
  ZOE_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointWriter> writer,
                       CheckpointWriter::Begin(dir, std::move(metadata), std::move(options)));
  for (const auto& group : groups_) {
    ZOE_RETURN_IF_ERROR(group->optimizer->Save(*writer).WithContext(
        fmt::format("checkpoint save: optimizer group '{}'", group->name)));
  }
  return writer->Commit();
}

namespace {

// When saved and current group identities differ only in their moment dtypes: a sentence
// naming, for each group that differs, the dtype to create it with (a checkpoint keeps the
// moments it was saved with).
std::string MomentDTypeHint(const Json& saved, const Json& current) {
  if (!saved.is_array() || saved.size() != current.size()) return "";
  std::vector<std::string> fixes;
  for (size_t i = 0; i < saved.size(); ++i) {
    if (!saved[i].is_object() || !saved[i].contains("state_dtype")) return "";
    Json left = saved[i], right = current[i];
    if (left["state_dtype"] == right["state_dtype"]) continue;
    left.erase("state_dtype");
    right.erase("state_dtype");
    if (left != right) return "";
    fixes.push_back(fmt::format("group {} with moment_dtype {}", saved[i]["name"].dump(),
                                saved[i]["state_dtype"].dump()));
  }
  if (fixes.empty()) return "";
  return fmt::format(
      "; only the moment dtype differs: create {} (zoe.torch: moment_dtype=...), "
      "the moments the checkpoint holds",
      fmt::join(fixes, " and "));
}

}  // namespace

Status Engine::CheckCheckpointGroups(const Json& metadata) const {
  Json current = Json::array();
  for (const auto& group : groups_) current.push_back(group->optimizer->Identity());
  const auto found = metadata.find("groups");
  if (found != metadata.end() && *found == current) return Status::Ok();
  const Json saved = found != metadata.end() ? *found : Json();
  return Status::FailedPrecondition(fmt::format(
      "the checkpoint holds the groups {} but this engine has {}; it loads only into the same "
      "groups (name, type, parameters, moment dtype, sub-group size){}",
      found != metadata.end() ? saved.dump() : std::string("(none)"), current.dump(),
      MomentDTypeHint(saved, current)));
}

namespace {

struct SavedSettings {
  int64_t steps_taken = 0;
  optim::HyperParams hyper;
};

}  // namespace

Status Engine::LoadCheckpoint(const std::string& dir) {
  std::lock_guard create(create_mutex_);
  const auto locks = LockAllGroups();
  CheckpointReaderOptions options;
  options.fault_for_testing = hooks_.checkpoint_fault_for_testing;
  ZOE_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader,
                       CheckpointReader::Open(dir, std::move(options)));
  const Json& metadata = reader->metadata();
  ZOE_RETURN_IF_ERROR(CheckCheckpointGroups(metadata).WithContext("checkpoint load " + dir));
  // Everything that could fail before a group changes is checked first.
  std::vector<SavedSettings> saved(groups_.size());
  const Json settings = metadata.value("group_settings", Json::array());
  if (!settings.is_array() || settings.size() != groups_.size())
    return Status::Corruption(fmt::format(
        "checkpoint {}: group_settings {} do not match its groups", dir, settings.dump()));
  for (size_t i = 0; i < groups_.size(); ++i) {
    const Json& entry = settings[i];
    const bool well_formed = entry.is_object() && entry.contains("hyper") &&
                             entry.contains("steps_taken") &&
                             entry["steps_taken"].is_number_integer();
    if (!well_formed)
      return Status::Corruption(
          fmt::format("checkpoint {}: group_settings[{}] = {}", dir, i, entry.dump()));
    saved[i].steps_taken = entry["steps_taken"].get<int64_t>();
    if (!CheckStepCount("steps_taken", saved[i].steps_taken).ok())
      return Status::Corruption(fmt::format(
          "checkpoint {}: group_settings[{}] steps_taken {} is out of range; allowed: [0, {}]", dir,
          i, saved[i].steps_taken, kMaxStepCount));
    ZOE_ASSIGN_OR_RETURN(saved[i].hyper,
                         HyperFromJson(entry["hyper"], groups_[i]->optimizer->options().kind));
    const Status valid = optim::ValidateHyperParams(saved[i].hyper);
    if (!valid.ok())
      return Status::Corruption(
          fmt::format("checkpoint {}: group_settings[{}] hyper: {}", dir, i, valid.message()));
  }
  // Every group prepares (all that can fail) before any commits, so the load is all or nothing.
  for (size_t i = 0; i < groups_.size(); ++i) {
    Group& group = *groups_[i];
    Status prepared = group.optimizer->PrepareLoad(*reader).WithContext(
        fmt::format("checkpoint load {}: optimizer group '{}'", dir, group.name));
    if (!prepared.ok()) {
      for (size_t j = 0; j < i; ++j) groups_[j]->optimizer->DiscardLoad();
      return prepared;
    }
  }
  for (size_t i = 0; i < groups_.size(); ++i) {
    groups_[i]->optimizer->CommitLoad();  // with the step counts of the group's own file
    groups_[i]->hyper = saved[i].hyper;
  }
  return Status::Ok();
}

}  // namespace zoe::offload
