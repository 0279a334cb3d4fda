// Engine: one zoe engine -- the tiers, the tensors placed in them and the offloaded optimizer
// groups -- built from one configuration document. The C API (integrations/c/zoe.h) is a thin
// translation of this class: every zoe_engine_*, zoe_tensor_*, zoe_trace_*, zoe_optim_* and
// zoe_checkpoint_* function calls the method of the same verb.
//
// Parts (see offload/engine_setup.h for how the configuration maps onto them):
//  - a TierManager for registered tensors: HOST budget zoe.tensor_host_budget, a device tier
//    (CUDA, or the host stand-in whose budget defaults to the tensors' HOST budget), swap space of
//    zoe.tensor_swap_bytes striped over zoe.nvme_paths -- or, when no directory is configured, over
//    a private temporary directory under $TMPDIR (else /var/tmp) removed with the engine;
//  - optimizer groups (OptimizerGroup), each with its own SwapSpace created with the group and
//    sized to exactly what its NVMe chunks need (both slots), so "no space" shows when the group
//    is created; they share one IoQueue (created with the first NVMe group), one
//    PinnedMemoryPool bounded by the optimizer's share of zoe.host_budget, and one Executor for
//    the kernels (created with the first group, one thread per core);
//  - the async-error slot: the first failure of work that ran after the call that started it
//    returned (a prefetch hint whose transfer could not be started); TakeAsyncError returns it and
//    clears it. Failures of trace-driven prefetches are reported by the acquire that needs the
//    tensor (TierManager's contract), not here.
//
// Optimizer groups: ids are dense (0, 1, ...) in creation order and groups live as long as the
// engine. Names are unique (a checkpoint stores one file per name). A group's hyper-parameters
// start from its JSON document; a step given hyper-parameters makes them the group's (like
// torch's param_groups), a step given none uses the group's. Checkpoints hold every group: the
// manifest's metadata names the engine version, the groups' identities (OptimizerGroup::Identity),
// their step counts and hyper-parameters; loading a checkpoint of other groups is
// FailedPrecondition naming both lists and changes nothing.
//
// Thread safety: every method may be called from any thread. Tensor and trace calls go to the tier
// manager, which is thread-safe; calls on one optimizer group are serialised by that group's
// mutex (calls on different groups run in parallel); checkpoint save and load hold every group's
// mutex. Destruction must not race with any other call.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/engine_config.h"
#include "core/executor.h"
#include "core/pinned_memory.h"
#include "core/result.h"
#include "core/scratch_dir.h"
#include "io/engine.h"
#include "io/queue.h"
#include "offload/checkpoint/checkpoint_store.h"
#include "offload/engine_setup.h"
#include "offload/optimizer/optimizer_group.h"
#include "offload/paging/tier_manager.h"
#include "offload/types.h"

namespace zoe::offload {

struct GroupIdTag {};
using GroupId = StrongId<GroupIdTag>;

// The version written into checkpoint manifests ("MAJOR.MINOR.PATCH", zoe_version()'s value).
std::string_view EngineVersion();

// Seams for tests: replace the raw I/O engines (e.g. with an io::FaultInjectingEngine).
struct EngineHooks {
  std::function<Result<std::unique_ptr<io::Engine>>()> tensor_io_factory;
  std::function<Result<std::unique_ptr<io::Engine>>()> optimizer_io_factory;
  // Swap files (tensors and optimizer groups) open as on a filesystem that refuses O_DIRECT, so
  // the buffered fallback runs (io::OpenOptions::refuse_direct_for_testing).
  bool refuse_direct_for_testing = false;
  // Checkpoint saves and loads fail their system calls as this says (CheckpointWriterOptions,
  // CheckpointReaderOptions).
  std::function<int(CheckpointSyscall call, const std::string& path)> checkpoint_fault_for_testing;
};

struct EngineStepArgs {
  // Empty: the group's current hyper-parameters. Given: its per-step values (lr, betas, eps,
  // weight_decay) replace the group's (HyperParams::WithStepValues); its kind and lr_decay are
  // not read, they belong to the group.
  std::optional<optim::HyperParams> hyper;
  std::span<const GradView> grads;    // empty: those given to AccumulateGrad
  std::span<const ParamView> params;  // empty: no parameters written
  double loss_scale = 1.0;            // > 0
  // StepArgs::agree_scan, for sharded groups (offload/distributed/sharded_group.h).
  std::function<Result<optim::GradScan>(const optim::GradScan& local)> agree_scan;
};

class Engine {
 public:
  // Builds every part eagerly except the optimizer's I/O queue and executor (see above). Errors
  // name the part and the configuration key behind it. zoe.log_level, when given, sets the
  // process-wide zoe logger's level before the engine logs anything; DeepSpeed keys the
  // configuration ignored are logged once.
  static Result<std::unique_ptr<Engine>> Create(config::EngineConfig config,
                                                EngineHooks hooks = {});
  // ParseEngineConfig(json_text), then Create. An empty text means "{}".
  static Result<std::unique_ptr<Engine>> CreateFromJson(std::string_view json_text,
                                                        EngineHooks hooks = {});
  // Waits for transfers in flight, frees memory and removes swap files (dirty tensors are not
  // written: the swap files go with the engine).
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // ---- engine
  // The async-error slot: Record keeps `status` unless a failure is already kept (the first one
  // wins); Take returns the kept failure, or OK, and clears the slot.
  void RecordAsyncError(Status status);
  Status TakeAsyncError();
  Status Flush();
  // The tier manager's statistics (TierManager::StatsJson: links, tiers, prefetch, stall, trace),
  // plus "io_backend" {"tensors", "optimizer"}, "host_budget" {"total", "tensors", "optimizer",
  // "tensors_reserved", "optimizer_used"}, "device" {"present", "budget_bytes",
  // "reserved_bytes"} and "groups": one object per group with its step figures.
  nlohmann::json StatsJson() const;
  // The configuration in effect: ToJson of the configuration with the automatic values resolved
  // (host budgets, sub_group_size, the swap directories in use).
  nlohmann::json ConfigJson() const;
  const config::EngineConfig& config() const { return config_; }
  TierManager& tier_manager() { return *tier_manager_; }
  // InvalidArgument naming `what` when `count` elements of `element_bytes` at `data`, given as
  // host memory, overlap the device tier's memory (a pointer Acquire gave for Tier::kDevice, say);
  // OK otherwise (and for a null `data`). The C API checks every array it reads or writes on the
  // host with it.
  Status CheckHostMemory(const void* data, uint64_t count, uint64_t element_bytes,
                         std::string_view what) const;

  // ---- tensors and traces: see TierManager.
  Result<TensorId> RegisterTensor(TensorDesc desc);
  Result<TensorId> FindTensor(std::string_view name) const;
  Result<void*> Acquire(TensorId tensor, Tier tier, Access access);
  Status Release(TensorId tensor);
  // Argument errors are returned; a transfer that cannot be started goes to the async-error slot
  // (the call is a hint and returns OK).
  Status Prefetch(TensorId tensor, Tier tier);
  Status Evict(TensorId tensor);
  Status TraceBegin(std::string_view name);
  Status TraceEnd();
  Status TraceSave(std::string_view name, const std::string& path) const;
  Result<std::string> TraceLoad(const std::string& path);

  // ---- optimizer groups
  // Parses `optim_json` (ParseGroupSpec), creates the group's swap space and the group, with its
  // master weights from `params` (views covering the group, concatenated).
  Result<GroupId> CreateGroup(std::string_view optim_json, std::span<const ParamView> params);
  Result<GroupId> FindGroup(std::string_view name) const;
  size_t group_count() const;
  // One step (OptimizerGroup::Step). InvalidArgument for views that do not cover the group
  // exactly, a null view, or hyper-parameters out of range (the group's are then unchanged).
  Result<StepReport> Step(GroupId group, const EngineStepArgs& args);
  Status AccumulateGrad(GroupId group, uint64_t offset, const GradView& grad);
  Status DiscardGradients(GroupId group);  // OptimizerGroup::DiscardGradients
  // The sum of squares of the gradients accumulated for the group's next step
  // (OptimizerGroup::AccumulatedScan).
  Result<double> AccumulatedGradSumSquares(GroupId group);
  // Arms speculation for the group's next step (OptimizerGroup::Speculate) with these
  // hyper-parameters (empty: the group's current ones), parameter views and loss scale;
  // args.grads must be empty. The group must have been created with "speculative": true.
  Status Speculate(GroupId group, const EngineStepArgs& args);
  Result<SpeculationStats> GroupSpeculationStats(GroupId group) const;
  Status ReadState(GroupId group, StateSlot slot, uint64_t offset, std::span<float> out) const;
  Status WriteState(GroupId group, StateSlot slot, uint64_t offset, std::span<const float> values);
  Result<int64_t> GroupSteps(GroupId group) const;
  Status SetGroupSteps(GroupId group, int64_t steps);
  // Copies the step count of each segment of the group (OptimizerGroup::segment_steps) to `out`,
  // which must have one entry per segment (InvalidArgument naming the group and both counts
  // otherwise, `out` untouched); and setting them all (one per segment, CheckStepCount each).
  Status CopyGroupSegmentSteps(GroupId group, std::span<int64_t> out) const;
  Status SetGroupSegmentSteps(GroupId group, std::span<const int64_t> steps);

  // Every group, through CheckpointWriter / CheckpointReader
  // (offload/checkpoint/checkpoint_store.h). Load is all or nothing: it checks the identities and
  // the manifest's steps and hyper-parameters (Corruption when out of range), then prepares every
  // group (OptimizerGroup::PrepareLoad: reads and verifies its file, FailedPrecondition while it
  // has accumulated gradients) and commits them only when all were prepared, so a damaged
  // checkpoint, an I/O error or a group that cannot load changes no group. Save gives the writer
  // every group's file size, so a checkpoint that does not fit beside the live one is NoSpace,
  // naming the directory and the bytes needed and available, before anything is written.
  Status SaveCheckpoint(const std::string& dir);
  Status LoadCheckpoint(const std::string& dir);

 private:
  struct Group;

  Engine(config::EngineConfig config, EngineHooks hooks, HostBudgets budgets);
  Status Build(std::vector<std::string> nvme_paths);

  Result<Group*> FindGroupSlot(GroupId id) const;
  Status EnsureOptimizerIo();
  Executor& EnsureExecutor();
  Result<std::unique_ptr<io::SwapSpace>> CreateGroupSwap(const OptimizerGroupOptions& options);
  Status WithSizingAdvice(Status status, const OptimizerGroupOptions& options,
                          uint64_t pinned_free) const;
  nlohmann::json GroupStatsJson(const Group& group) const;
  nlohmann::json NvmeWritesJson(const nlohmann::json& groups) const;
  // Every group's mutex, in id order; held for checkpoints.
  std::vector<std::unique_lock<std::mutex>> LockAllGroups() const;
  Status CheckCheckpointGroups(const nlohmann::json& metadata) const;
  void RestoreGroupSettings(const nlohmann::json& metadata);

  const config::EngineConfig config_;
  const EngineHooks hooks_;
  const HostBudgets budgets_;
  std::vector<std::string> nvme_paths_;  // the directories in effect

  // Declared in the order they may be destroyed last: the scratch directory outlives the swap
  // files in it, the pool, queue and executor outlive the groups that borrow them.
  std::unique_ptr<ScratchDir> scratch_;
  std::unique_ptr<TierManager> tier_manager_;
  std::optional<PinnedMemoryPool> optimizer_pool_;
  std::unique_ptr<io::IoQueue> optimizer_io_;
  std::unique_ptr<Executor> executor_;

  std::mutex create_mutex_;          // serialises group creation and checkpoints
  mutable std::mutex groups_mutex_;  // guards the vector (not the groups) and the backend name
  std::vector<std::unique_ptr<Group>> groups_;
  std::string optimizer_backend_;  // empty until the optimizer's queue exists

  std::mutex async_mutex_;
  Status async_error_;
};

}  // namespace zoe::offload
