// A small OptimizerGroup with its I/O queue, swap space and pinned pool, gradients and parameters
// cut at odd boundaries, and the in-memory optim::Group it must match bit for bit.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "core/executor.h"
#include "io/backend.h"
#include "io/fault_injection.h"
#include "offload/checkpoint/checkpoint_store.h"
#include "offload/optimizer/optimizer_group.h"
#include "optim/group.h"
#include "tests/offload/temp_dir.h"

namespace zoe::offload::testing {

inline OptimizerGroupOptions DefaultGroupOptions() {
  OptimizerGroupOptions options;
  options.name = "g";
  options.chunk_elements = 16384;
  options.buffer_count = 3;
  options.max_grad_norm = 150.0;  // engages on the steps with full-size gradients
  options.run.tile_elements = 4096;
  return options;
}

struct HarnessOptions {
  io::BackendKind backend = io::BackendKind::kPsync;
  bool inject_faults = false;  // psync wrapped in a FaultInjectingEngine
  uint64_t checksum_block = 0;
  uint64_t swap_alignment = 0;  // 0: max(4096, checksum_block)
  uint64_t swap_capacity = 16 << 20;
  uint64_t pinned_budget = 16 << 20;
  unsigned threads = 0;   // > 0: kernels and scans on an Executor with that many workers
  size_t count = 100003;  // 7 chunks of 16384, the last one short
  optim::DType param_dtype = optim::DType::kFloat32;
  optim::DType grad_dtype = optim::DType::kFloat32;
  OptimizerGroupOptions group = DefaultGroupOptions();
};

// Bit patterns of every state array a kind keeps, master first.
using StateBits = std::vector<std::vector<uint32_t>>;

inline std::vector<uint32_t> Bits(const std::vector<float>& values) {
  std::vector<uint32_t> bits(values.size());
  std::memcpy(bits.data(), values.data(), values.size() * sizeof(float));
  return bits;
}

// Converts fp32 values to `dtype` bytes with the kernels' rounding.
inline std::vector<std::byte> Encode(const std::vector<float>& values, optim::DType dtype) {
  std::vector<std::byte> bytes(values.size() * DTypeSize(dtype));
  if (dtype == optim::DType::kFloat32) {
    std::memcpy(bytes.data(), values.data(), bytes.size());
  } else {
    EXPECT_TRUE(optim::CastFromF32(values.data(), dtype, bytes.data(), values.size()).ok());
  }
  return bytes;
}

inline std::vector<float> Decode(const void* data, optim::DType dtype, size_t count) {
  std::vector<float> values(count);
  if (dtype == optim::DType::kFloat32) {
    std::memcpy(values.data(), data, count * sizeof(float));
  } else {
    EXPECT_TRUE(optim::CastToF32(data, dtype, values.data(), count).ok());
  }
  return values;
}

// Odd cut points, different for gradients and parameters and unrelated to chunks and tiles.
inline std::vector<size_t> Cuts(size_t count, std::initializer_list<size_t> lengths) {
  std::vector<size_t> cuts;
  size_t used = 0;
  for (size_t length : lengths) {
    if (used + length >= count) break;
    cuts.push_back(length);
    used += length;
  }
  cuts.push_back(count - used);
  return cuts;
}

// A checkpoint of one group in `dir` (a CheckpointWriter of its own), and its load.
inline Status SaveTo(const std::string& dir, const OptimizerGroup& group) {
  ZOE_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointWriter> writer,
                       CheckpointWriter::Begin(dir, {{"model", "test"}}));
  ZOE_RETURN_IF_ERROR(group.Save(*writer));
  return writer->Commit();
}

inline Status LoadFrom(const std::string& dir, OptimizerGroup& group) {
  ZOE_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader, CheckpointReader::Open(dir));
  return group.Load(*reader);
}

class Reference;

class GroupHarness {
 public:
  explicit GroupHarness(const HarnessOptions& options, bool create = true) : options_(options) {
    options_.group.count = options.count;
    if (options.threads > 0) {
      executor_ = std::make_unique<Executor>(options.threads);
      options_.group.run.executor = executor_.get();
    }
    grad_cuts_ = Cuts(options.count, {7, 16380, 3, 40001, 4096, 1});
    param_cuts_ = Cuts(options.count, {12345, 1, 50000, 9});
    std::mt19937 random(11);
    std::normal_distribution<float> normal(0.0f, 0.1f);
    std::vector<float> initial(options.count);
    for (float& v : initial) v = normal(random);
    initial_ = Encode(initial, options.param_dtype);
    params_ = initial_;
    ok_ = MakeResources();
    if (ok_ && create) {
      Result<std::unique_ptr<OptimizerGroup>> group = CreateGroup(options_.group);
      EXPECT_TRUE(group.ok()) << group.status().ToString();
      ok_ = group.ok();
      if (ok_) group_ = std::move(group).value();
    }
  }

  bool ok() const { return ok_; }
  size_t count() const { return options_.count; }
  OptimizerGroup& group() { return *group_; }
  io::FaultInjectingEngine* faults() { return faults_; }
  // Makes the nth operation of `ops` from now on fail once with `kind` (inject_faults only).
  void FailOnce(io::FaultKind kind, io::FaultOps ops, uint64_t nth) {
    io::FaultRule rule;
    rule.kind = kind;
    rule.ops = ops;
    rule.nth = nth;
    rule.max_faults = 1;
    faults_->AddRule(rule);
  }
  io::SwapSpace& swap() { return *swap_; }
  io::QueueStats queue_stats() const { return queue_->stats(); }
  PinnedMemoryPool& pinned() { return *pinned_; }
  const HarnessOptions& options() const { return options_; }
  const OptimizerGroupOptions& group_options() const { return options_.group; }
  const std::vector<std::byte>& initial_params() const { return initial_; }
  const std::byte* grads() const { return grads_.data(); }
  std::vector<std::byte> params_bytes() const { return params_; }

  Result<std::unique_ptr<OptimizerGroup>> CreateGroup(const OptimizerGroupOptions& options) {
    const std::vector<ParamView> views = initial_param_views();
    return CreateGroupFrom(options, views);
  }
  Result<std::unique_ptr<OptimizerGroup>> CreateGroupFrom(const OptimizerGroupOptions& options,
                                                          std::span<const ParamView> views) {
    const OptimizerResources resources{queue_.get(), swap_.get(), &*pinned_};
    return OptimizerGroup::Create(options, resources, views);
  }
  // The harness's group from now on (a harness made with create = false).
  void Adopt(std::unique_ptr<OptimizerGroup> group) { group_ = std::move(group); }

  // Gradients of step `step`: uniform in (-1, 1), halved on two steps out of three.
  void NewGradients(int step) {
    std::mt19937 random(1000 + step);
    std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
    const float scale = step % 3 == 0 ? 1.0f : 0.5f;
    std::vector<float> values(options_.count);
    for (float& v : values) v = uniform(random) * scale;
    grads_ = Encode(values, options_.grad_dtype);
  }
  void PoisonGradient(size_t index, float value) {
    const std::vector<std::byte> one = Encode({value}, options_.grad_dtype);
    std::memcpy(grads_.data() + index * one.size(), one.data(), one.size());
  }

  optim::HyperParams Hyper(int step) const {
    optim::HyperParams hyper;
    hyper.kind = options_.group.kind;
    hyper.lr = 1e-3 * (1.0 + 0.5 * std::sin(0.3 * step));
    hyper.weight_decay = 0.01;
    if (hyper.kind == optim::Kind::kAdagrad) hyper.lr_decay = 0.01;
    return hyper;
  }

  std::vector<GradView> grad_views() const {
    std::vector<GradView> views;
    size_t offset = 0;
    for (size_t length : grad_cuts_) {
      views.push_back(
          {grads_.data() + offset * DTypeSize(options_.grad_dtype), options_.grad_dtype, length});
      offset += length;
    }
    return views;
  }
  std::vector<ParamView> param_views() { return ParamViews(params_); }
  std::vector<ParamView> initial_param_views() { return ParamViews(initial_); }

  Result<StepReport> Step(const optim::HyperParams& hyper) {
    const std::vector<GradView> grads = grad_views();
    return StepWith(hyper, grads);
  }
  // Hands every gradient view to AccumulateGrad, in order; false at the first refusal.
  bool AccumulateAll() {
    size_t offset = 0;
    for (const GradView& view : grad_views()) {
      Status accumulated = group_->AccumulateGrad(offset, view);
      EXPECT_TRUE(accumulated.ok()) << accumulated.ToString();
      if (!accumulated.ok()) return false;
      offset += view.count;
    }
    return true;
  }
  Result<StepReport> StepAccumulated(const optim::HyperParams& hyper) {
    return StepWith(hyper, {});
  }

  StateBits Snapshot() const {
    StateBits state;
    for (StateSlot slot : UsedSlots(options_.group.kind)) {
      std::vector<float> values(options_.count);
      Status read = group_->ReadState(slot, 0, values);
      EXPECT_TRUE(read.ok()) << read.ToString();
      state.push_back(Bits(values));
    }
    return state;
  }

  static std::vector<StateSlot> UsedSlots(optim::Kind kind) {
    std::vector<StateSlot> slots = {StateSlot::kMaster};
    if (optim::UsesExpAvg(kind)) slots.push_back(StateSlot::kExpAvg);
    if (optim::UsesExpAvgSq(kind)) slots.push_back(StateSlot::kExpAvgSq);
    return slots;
  }

  inline void ExpectMatches(const Reference& reference) const;

 private:
  bool MakeResources() {
    Result<std::unique_ptr<io::Engine>> engine = MakeEngine();
    EXPECT_TRUE(engine.ok()) << engine.status().ToString();
    if (!engine.ok()) return false;
    Result<std::unique_ptr<io::IoQueue>> queue = io::IoQueue::Create(std::move(engine).value());
    EXPECT_TRUE(queue.ok()) << queue.status().ToString();
    if (!queue.ok()) return false;
    queue_ = std::move(queue).value();
    io::SwapOptions swap_options;
    swap_options.files.checksum_block = options_.checksum_block;
    swap_options.alignment = options_.swap_alignment != 0
                                 ? options_.swap_alignment
                                 : std::max<uint64_t>(4096, options_.checksum_block);
    Result<std::unique_ptr<io::SwapSpace>> swap =
        io::SwapSpace::Create({dir_.File("")}, options_.swap_capacity, swap_options);
    EXPECT_TRUE(swap.ok()) << swap.status().ToString();
    if (!swap.ok()) return false;
    swap_ = std::move(swap).value();
    PinnedPoolOptions pool_options;
    pool_options.name = "optimizer";
    pool_options.budget_bytes = options_.pinned_budget;
    Result<PinnedMemoryPool> pool = PinnedMemoryPool::Create(pool_options);
    EXPECT_TRUE(pool.ok()) << pool.status().ToString();
    if (!pool.ok()) return false;
    pinned_.emplace(std::move(pool).value());
    return true;
  }

  Result<std::unique_ptr<io::Engine>> MakeEngine() {
    if (!options_.inject_faults) {
      io::EngineOptions engine;
      engine.backend = options_.backend;
      engine.queue_depth = 8;
      return io::CreateEngine(engine);
    }
    ZOE_ASSIGN_OR_RETURN(std::unique_ptr<io::Engine> engine, io::CreatePsyncEngine(8));
    auto faulty = std::make_unique<io::FaultInjectingEngine>(std::move(engine), 7);
    faults_ = faulty.get();
    return std::unique_ptr<io::Engine>(std::move(faulty));
  }

  std::vector<ParamView> ParamViews(std::vector<std::byte>& bytes) {
    std::vector<ParamView> views;
    size_t offset = 0;
    for (size_t length : param_cuts_) {
      views.push_back(
          {bytes.data() + offset * DTypeSize(options_.param_dtype), options_.param_dtype, length});
      offset += length;
    }
    return views;
  }

  Result<StepReport> StepWith(const optim::HyperParams& hyper, std::span<const GradView> grads) {
    const std::vector<ParamView> params = param_views();
    StepArgs args;
    args.hyper = hyper;
    args.grads = grads;
    args.params = params;
    return group_->Step(args);
  }

  HarnessOptions options_;
  TempDir dir_;
  std::vector<size_t> grad_cuts_;
  std::vector<size_t> param_cuts_;
  std::vector<std::byte> initial_;
  std::vector<std::byte> params_;
  std::vector<std::byte> grads_;
  bool ok_ = false;
  std::unique_ptr<Executor> executor_;
  std::optional<PinnedMemoryPool> pinned_;
  io::FaultInjectingEngine* faults_ = nullptr;
  std::unique_ptr<io::IoQueue> queue_;
  std::unique_ptr<io::SwapSpace> swap_;
  std::unique_ptr<OptimizerGroup> group_;  // last: destroyed before what it borrows
};

// optim::Group over whole in-memory buffers, fed the harness's gradients as one buffer.
class Reference {
 public:
  explicit Reference(const GroupHarness& harness) : options_(harness.options()) {
    optim::GroupOptions group;
    group.kind = options_.group.kind;
    group.layout.grad = options_.grad_dtype;
    group.layout.state = options_.group.state_dtype;
    if (options_.param_dtype != optim::DType::kFloat32)
      group.layout.param_copy = options_.param_dtype;
    group.count = options_.count;
    group.max_grad_norm = options_.group.max_grad_norm;
    group.run = harness.group_options().run;
    Result<std::unique_ptr<optim::Group>> created = optim::Group::Create(group);
    EXPECT_TRUE(created.ok()) << created.status().ToString();
    if (created.ok()) group_ = std::move(created).value();
    master_ = Decode(harness.initial_params().data(), options_.param_dtype, options_.count);
    if (options_.param_dtype != optim::DType::kFloat32) param_copy_ = harness.initial_params();
  }

  // One step with the harness's current gradients; false when it failed or was skipped.
  bool Step(const optim::HyperParams& hyper, const GroupHarness& harness) {
    if (group_ == nullptr) return false;
    Result<optim::StepScaling> scaling = group_->Step(
        hyper, master_.data(), harness.grads(), param_copy_.empty() ? nullptr : param_copy_.data());
    EXPECT_TRUE(scaling.ok()) << scaling.status().ToString();
    if (!scaling.ok() || scaling->skip) return false;
    last_grad_norm_ = scaling->grad_norm;
    if (scaling->scaling.clip_factor < 1.0) ++clipped_steps_;
    return true;
  }

  double last_grad_norm() const { return last_grad_norm_; }
  int clipped_steps() const { return clipped_steps_; }

  StateBits State() const {
    StateBits state = {Bits(master_)};
    const optim::DType dtype = options_.group.state_dtype;
    if (group_->exp_avg() != nullptr) {
      state.push_back(Bits(Decode(group_->exp_avg(), dtype, options_.count)));
    }
    if (group_->exp_avg_sq() != nullptr) {
      state.push_back(Bits(Decode(group_->exp_avg_sq(), dtype, options_.count)));
    }
    return state;
  }
  // What the caller's parameter buffers must hold.
  std::vector<std::byte> Params() const {
    if (!param_copy_.empty()) return param_copy_;
    std::vector<std::byte> bytes(master_.size() * sizeof(float));
    std::memcpy(bytes.data(), master_.data(), bytes.size());
    return bytes;
  }

 private:
  HarnessOptions options_;
  std::unique_ptr<optim::Group> group_;
  std::vector<float> master_;
  std::vector<std::byte> param_copy_;
  double last_grad_norm_ = 0.0;
  int clipped_steps_ = 0;
};

inline void GroupHarness::ExpectMatches(const Reference& reference) const {
  const StateBits expected = reference.State();
  const StateBits actual = Snapshot();
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t s = 0; s < expected.size(); ++s) {
    size_t mismatches = 0;
    size_t first = expected[s].size();
    for (size_t i = 0; i < expected[s].size(); ++i) {
      if (actual[s][i] != expected[s][i]) {
        if (mismatches++ == 0) first = i;
      }
    }
    EXPECT_EQ(mismatches, 0u) << "state array " << s << ": first mismatch at element " << first;
  }
  EXPECT_TRUE(params_ == reference.Params()) << "parameters differ";
}

}  // namespace zoe::offload::testing
