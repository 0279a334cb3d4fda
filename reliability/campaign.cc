#include "reliability/campaign.h"

#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <utility>

#include "core/engine_config.h"
#include "io/backend.h"
#include "offload/engine.h"
#include "optim/group.h"

namespace zoe::reliability {
namespace {

using offload::Access;
using offload::Tier;
using Json = nlohmann::json;

constexpr size_t kParams = 3000;  // three chunks of 1024: two on NVMe, one in HOST
constexpr uint64_t kSubGroup = 1024;
constexpr int kSteps = 6;
constexpr int kSaveAfterStep = 2;
constexpr int kLoadAfterStep = 4;
constexpr int kIterations = 4;
constexpr int kRetries = 3;

bool Recoverable(io::FaultKind kind) {
  return kind == io::FaultKind::kShortTransfer || kind == io::FaultKind::kEintr ||
         kind == io::FaultKind::kEagain;
}

// Sits on top of a target's chain of fault engines. While armed, requests go through the chain;
// once disarmed they go straight to the raw engine at its bottom (completions are still reaped
// through the chain, which hands back those it did not see unchanged).
class ArmedSwitch : public io::EngineWrapper {
 public:
  ArmedSwitch(std::unique_ptr<io::Engine> chain, io::Engine* raw)
      : EngineWrapper(std::move(chain)), raw_(raw) {}

  void Disarm() { armed_ = false; }
  uint64_t requests() const { return requests_; }

  Result<size_t> Submit(std::span<const io::RawRequest> requests) override {
    if (!armed_) return raw_->Submit(requests);
    Result<size_t> taken = target().Submit(requests);
    if (taken.ok()) requests_ += *taken;
    return taken;
  }

 private:
  io::Engine* raw_;
  std::atomic<bool> armed_{true};
  std::atomic<uint64_t> requests_{0};
};

// psync, or the backend ZOE_CAMPAIGN_BACKEND names ("io_uring", "libaio", "psync").
Result<std::unique_ptr<io::Engine>> RawEngine() {
  io::EngineOptions options;
  options.queue_depth = 8;
  options.backend = io::BackendKind::kPsync;
  if (const char* name = std::getenv("ZOE_CAMPAIGN_BACKEND"); name != nullptr && *name != '\0') {
    ZOE_ASSIGN_OR_RETURN(options.backend, io::ParseBackend(name));
  }
  return io::CreateEngine(options);
}

// The fault engines of one target, built when the Engine asks for its raw I/O engine.
struct TargetIo {
  std::vector<std::pair<io::FaultKind, io::FaultInjectingEngine*>> faults;
  ArmedSwitch* top = nullptr;

  std::function<Result<std::unique_ptr<io::Engine>>()> Factory(std::vector<io::FaultRule> rules,
                                                               uint64_t seed) {
    return [this, rules = std::move(rules), seed]() -> Result<std::unique_ptr<io::Engine>> {
      ZOE_ASSIGN_OR_RETURN(std::unique_ptr<io::Engine> chain, RawEngine());
      io::Engine* raw = chain.get();
      for (size_t i = 0; i < rules.size(); ++i) {
        auto faulty = std::make_unique<io::FaultInjectingEngine>(std::move(chain), seed + i);
        faulty->AddRule(rules[i]);
        faults.emplace_back(rules[i].kind, faulty.get());
        chain = std::move(faulty);
      }
      auto armed = std::make_unique<ArmedSwitch>(std::move(chain), raw);
      top = armed.get();
      return std::unique_ptr<io::Engine>(std::move(armed));
    };
  }

  void Disarm() {
    if (top != nullptr) top->Disarm();
  }
  void Count(Outcome* out) const {
    for (const auto& [kind, engine] : faults) {
      (Recoverable(kind) ? out->injected_recoverable : out->injected_errors) += engine->injected();
    }
    if (top != nullptr) out->requests += top->requests();
  }
};

// Checkpoint saves' system calls, failed by the same rules (see Target::kCheckpoint).
class CheckpointFaults {
 public:
  CheckpointFaults(std::vector<io::FaultRule> rules, uint64_t seed) : random_(seed) {
    for (const io::FaultRule& rule : rules) rules_.push_back({rule});
  }

  void Disarm() { armed_ = false; }
  void Count(Outcome* out) const {
    out->injected_errors += errors_;
    out->injected_recoverable += recoverable_;
  }

  // The errno (or CheckpointWriterOptions::kShortWrite) `call` fails with; 0: it runs.
  int Fault(offload::CheckpointSyscall call) {
    if (!armed_) return 0;
    for (State& state : rules_) {
      const int fault = FaultOf(state.rule.kind, call);
      if (fault == 0 || !Fires(state, call)) continue;
      const bool recoverable = fault == EINTR ||
                               fault == offload::CheckpointWriterOptions::kShortWrite ||
                               call == offload::CheckpointSyscall::kRemove;
      ++(recoverable ? recoverable_ : errors_);
      return fault;
    }
    return 0;
  }

 private:
  struct State {
    io::FaultRule rule;
    uint64_t seen = 0;
    uint64_t fired = 0;
  };

  static int FaultOf(io::FaultKind kind, offload::CheckpointSyscall call) {
    const bool write = call == offload::CheckpointSyscall::kWrite;
    switch (kind) {
      case io::FaultKind::kEio:
        return EIO;
      case io::FaultKind::kEnospc:
        return ENOSPC;
      case io::FaultKind::kEintr:
        return EINTR;
      case io::FaultKind::kShortTransfer:
        return write ? offload::CheckpointWriterOptions::kShortWrite : 0;
      default:
        return 0;
    }
  }

  bool Fires(State& state, offload::CheckpointSyscall call) {
    const bool write = call == offload::CheckpointSyscall::kWrite;
    if (state.rule.ops == io::FaultOps::kReads) return false;
    if (state.rule.ops == io::FaultOps::kWrites && !write) return false;
    ++state.seen;
    if (state.fired >= state.rule.max_faults) return false;
    const bool fires = (state.rule.nth != 0 && state.seen == state.rule.nth) ||
                       (state.rule.one_in != 0 && random_() % state.rule.one_in == 0);
    if (fires) ++state.fired;
    return fires;
  }

  std::vector<State> rules_;
  std::mt19937_64 random_;
  bool armed_ = true;
  uint64_t errors_ = 0;
  uint64_t recoverable_ = 0;
};

struct TensorSpec {
  const char* name;
  uint64_t bytes;
};

// 64 KiB chunks and a HOST budget of three: the runs below need more, so acquires evict.
constexpr TensorSpec kTensors[] = {{"t0", 40 << 10}, {"t1", 64 << 10}, {"t2", 100 << 10},
                                   {"t3", 8 << 10},  {"t4", 8 << 10},  {"t5", 24 << 10}};

struct Touch {
  size_t tensor;
  Tier tier;
  Access access;
};

// One iteration: what a forward and backward pass would ask for, recorded once and replayed.
constexpr Touch kIteration[] = {
    {0, Tier::kHost, Access::kReadWrite}, {1, Tier::kHost, Access::kRead},
    {2, Tier::kHost, Access::kWrite},     {3, Tier::kDevice, Access::kRead},
    {4, Tier::kHost, Access::kReadWrite}, {5, Tier::kDevice, Access::kReadWrite},
    {1, Tier::kHost, Access::kReadWrite}, {2, Tier::kHost, Access::kRead},
    {0, Tier::kHost, Access::kRead},      {3, Tier::kHost, Access::kReadWrite}};

Json ConfigFor(const std::string& dir) {
  return {{"zero_optimization",
           {{"sub_group_size", kSubGroup},
            {"offload_optimizer",
             {{"device", "nvme"}, {"nvme_path", dir}, {"ratio", 0.5}, {"buffer_count", 2}}}}},
          {"aio", {{"backend", "psync"}, {"queue_depth", 8}}},
          {"zoe",
           {{"chunk_size", "64K"},
            {"host_budget", "16M"},
            {"tensor_host_budget", "192K"},
            {"tensor_swap_bytes", "1M"},
            {"device", "host"},
            {"device_budget", "128K"},
            {"checksum", true},
            {"log_level", "error"}}}};
}

struct StepRecord {
  std::vector<float> grads;
  optim::HyperParams hyper;
};

class Workload {
 public:
  Workload(const FaultPlan& plan, std::string dir, Outcome* out)
      : plan_(plan), dir_(std::move(dir)), out_(out), random_(plan.seed) {}

  void Run() {
    if (!CreateEngine()) return;
    RegisterTensors();
    CreateGroup();
    for (int i = 0; i < std::max(kIterations, kSteps); ++i) {
      if (i < kIterations) TensorIteration(i);
      if (i < kSteps) OptimizerStep(i);
    }
    Check(engine_->TakeAsyncError(), "async error");
    tensor_io_.Count(out_);
    optimizer_io_.Count(out_);
    checkpoint_faults_->Count(out_);
    tensor_io_.Disarm();
    optimizer_io_.Disarm();
    checkpoint_faults_->Disarm();
    out_->final_pass_ok = FinalPass();
    out_->completed = true;
  }

 private:
  void Problem(const std::string& text) {
    if (out_->first_problem[0] != '\0') return;
    std::snprintf(out_->first_problem, sizeof(out_->first_problem), "%s", text.c_str());
  }

  // Counts a failed call by its code; true when `status` is OK.
  bool Check(const Status& status, std::string_view what) {
    if (status.ok()) return true;
    if (final_retry_)
      Problem(fmt::format("{} after the faults stopped: {}", what, status.ToString()));
    const StatusCode code = status.code();
    if (code == StatusCode::kIoError || code == StatusCode::kNoSpace ||
        code == StatusCode::kCorruption) {
      if (out_->errors_reported++ == 0) {
        std::snprintf(out_->first_error, sizeof(out_->first_error), "%s: %s",
                      std::string(what).c_str(), status.ToString().c_str());
      }
    } else {
      ++out_->other_errors;
      Problem(fmt::format("{}: unexpected {}", what, status.ToString()));
    }
    return false;
  }

  void Corrupted(const std::string& what) {
    ++out_->silent_corruptions;
    Problem(fmt::format("silent corruption: {}", what));
  }

  bool CreateEngine() {
    Result<config::EngineConfig> config = config::ParseEngineConfigDocument(ConfigFor(dir_));
    if (!Check(config.status(), "configuration")) return false;
    std::vector<io::FaultRule> rules[3];
    for (const TargetedRule& r : plan_.rules)
      rules[static_cast<size_t>(r.target)].push_back(r.rule);
    const auto& [tensor_rules, optimizer_rules, checkpoint_rules] = rules;
    checkpoint_faults_.emplace(checkpoint_rules, plan_.seed * 31);
    offload::EngineHooks hooks;
    hooks.tensor_io_factory = tensor_io_.Factory(tensor_rules, plan_.seed * 7919);
    hooks.optimizer_io_factory = optimizer_io_.Factory(optimizer_rules, plan_.seed);
    hooks.checkpoint_fault_for_testing = [this](offload::CheckpointSyscall call,
                                                const std::string&) {
      return checkpoint_faults_->Fault(call);
    };
    hooks.refuse_direct_for_testing = plan_.refuse_direct;
    if (plan_.refuse_direct) ++out_->injected_recoverable;
    Result<std::unique_ptr<offload::Engine>> engine =
        offload::Engine::Create(std::move(config).value(), std::move(hooks));
    if (!Check(engine.status(), "engine")) return false;
    engine_ = std::move(engine).value();
    return true;
  }

  // ---- tensors

  std::vector<std::byte> Pattern(uint64_t bytes) {
    std::vector<std::byte> out(bytes);
    for (uint64_t i = 0; i < bytes; i += 8) {
      const uint64_t word = random_();
      std::memcpy(out.data() + i, &word, std::min<uint64_t>(8, bytes - i));
    }
    return out;
  }

  void RegisterTensors() {
    for (const TensorSpec& spec : kTensors) {
      Result<offload::TensorId> id =
          engine_->RegisterTensor({spec.name, spec.bytes, offload::DType::kUInt8, Tier::kNvme, ""});
      if (!Check(id.status(), spec.name)) continue;
      tensors_.push_back(*id);
      shadow_.emplace_back(spec.bytes, std::byte{0});  // never written: reads as zeros
    }
  }

  void TouchTensor(const Touch& touch) {
    if (touch.tensor >= tensors_.size()) return;
    const offload::TensorId id = tensors_[touch.tensor];
    std::vector<std::byte>& shadow = shadow_[touch.tensor];
    Result<void*> acquired = engine_->Acquire(id, touch.tier, touch.access);
    const std::string what =
        fmt::format("acquire {} on {} for {}", kTensors[touch.tensor].name,
                    offload::TierName(touch.tier), offload::AccessName(touch.access));
    if (!Check(acquired.status(), what)) return;
    auto* bytes = static_cast<std::byte*>(*acquired);
    if (offload::Reads(touch.access) && std::memcmp(bytes, shadow.data(), shadow.size()) != 0)
      Corrupted(what + " read bytes other than those last released");
    if (offload::Writes(touch.access)) {
      shadow = Pattern(shadow.size());
      std::memcpy(bytes, shadow.data(), shadow.size());
    }
    Check(engine_->Release(id), "release " + std::string(kTensors[touch.tensor].name));
  }

  void TensorIteration(int iteration) {
    Check(engine_->TraceBegin("iteration"), "trace begin");
    for (size_t i = 0; i < std::size(kIteration); ++i) {
      TouchTensor(kIteration[i]);
      // An explicit hint ahead of the trace's own look-ahead every other iteration.
      const Touch& next = kIteration[(i + 2) % std::size(kIteration)];
      if (iteration % 2 == 1 && next.tensor < tensors_.size())
        Check(engine_->Prefetch(tensors_[next.tensor], Tier::kHost), "prefetch");
    }
    Check(engine_->TraceEnd(), "trace end");
  }

  // ---- optimizer

  std::vector<float> Gradients() {
    std::vector<float> out(kParams);
    std::uniform_real_distribution<float> spread(-0.05f, 0.05f);
    for (float& g : out) g = spread(random_);
    return out;
  }

  optim::HyperParams Hyper(int step) const {
    optim::HyperParams hyper;
    hyper.lr = 0.01 / (step + 1);
    hyper.weight_decay = 0.01;
    return hyper;
  }

  void CreateGroup() {
    initial_.resize(kParams);
    for (size_t i = 0; i < kParams; ++i) initial_[i] = 0.001f * static_cast<float>(i) - 1.0f;
    const offload::ParamView view{initial_.data(), optim::DType::kFloat32, kParams};
    for (int attempt = 0; attempt < kRetries && !group_; ++attempt) {
      Result<offload::GroupId> id = engine_->CreateGroup(
          R"({"name": "g", "lr": 0.01, "weight_decay": 0.01})", std::span(&view, 1));
      if (Check(id.status(), "create group")) group_ = *id;
    }
  }

  // The reference: a fresh in-memory group stepped with every successful step, in order.
  struct Reference {
    std::vector<float> master, exp_avg, exp_avg_sq;
  };
  std::optional<Reference> Replay(size_t steps) {
    optim::GroupOptions options;
    options.count = kParams;
    Result<std::unique_ptr<optim::Group>> group = optim::Group::Create(options);
    if (!group.ok()) return std::nullopt;
    Reference ref{initial_, {}, {}};
    for (size_t s = 0; s < steps; ++s) {
      if (!(*group)->Step(history_[s].hyper, ref.master.data(), history_[s].grads.data()).ok())
        return std::nullopt;
    }
    const auto* m = static_cast<const float*>((*group)->exp_avg());
    const auto* v = static_cast<const float*>((*group)->exp_avg_sq());
    ref.exp_avg.assign(m, m + kParams);
    ref.exp_avg_sq.assign(v, v + kParams);
    return ref;
  }

  offload::EngineStepArgs StepArgs(const optim::HyperParams& h) const {
    offload::EngineStepArgs args;
    args.hyper = h;
    return args;
  }

  // One step with the gradients given to it, the updated parameters written to `params_`.
  bool StepGiven(const StepRecord& record) {
    const offload::GradView grad{record.grads.data(), optim::DType::kFloat32, kParams};
    params_.assign(kParams, 0.0f);
    const offload::ParamView param{params_.data(), optim::DType::kFloat32, kParams};
    offload::EngineStepArgs args = StepArgs(record.hyper);
    args.grads = std::span(&grad, 1);
    args.params = std::span(&param, 1);
    Result<offload::StepReport> report = engine_->Step(*group_, args);
    if (!Check(report.status(), "step")) return false;
    std::optional<Reference> ref = ReplayWith(record);
    if (ref && params_ != ref->master) Corrupted("parameters written by a successful step");
    return true;
  }

  // One step through AccumulateGrad in three ranges; a failed step keeps the gradients and is
  // retried. The views borrow record.grads until a step consumes them.
  bool StepAccumulated(StepRecord& record) {
    constexpr size_t kRange = 1000;
    for (size_t offset = 0; offset < kParams; offset += kRange) {
      const offload::GradView grad{record.grads.data() + offset, optim::DType::kFloat32, kRange};
      if (!Check(engine_->AccumulateGrad(*group_, offset, grad), "accumulate_grad")) return false;
    }
    for (int attempt = 0; attempt < kRetries; ++attempt) {
      Result<offload::StepReport> report = engine_->Step(*group_, StepArgs(record.hyper));
      if (Check(report.status(), "accumulated step")) return true;
    }
    // The gradients stay accumulated, borrowed from record.grads: moved, the buffer stays put.
    stuck_ = std::move(record);
    return false;
  }

  std::optional<Reference> ReplayWith(const StepRecord& record) {
    history_.push_back(record);
    std::optional<Reference> ref = Replay(history_.size());
    history_.pop_back();
    return ref;
  }

  void OptimizerStep(int step) {
    if (!group_ || stuck_) return;
    StepRecord record{Gradients(), Hyper(step)};
    const bool stepped = step % 2 == 0 ? StepGiven(record) : StepAccumulated(record);
    if (stepped) history_.push_back(std::move(record));  // the buffer stays put
    if (step == kSaveAfterStep) SaveCheckpoint();
    if (step == kLoadAfterStep) LoadCheckpoint();
  }

  // A save that fails after it replaced LATEST (the directory's last fsync) reports the error
  // and keeps the complete version it published: a later load may find either one.
  void SaveCheckpoint() {
    if (Check(engine_->SaveCheckpoint(dir_ + "/checkpoint"), "checkpoint save")) {
      saved_steps_ = history_.size();
      unacknowledged_steps_.reset();
    } else {
      unacknowledged_steps_ = history_.size();
    }
  }

  void LoadCheckpoint() {
    if (!saved_steps_ && !unacknowledged_steps_) return;
    const Status loaded = engine_->LoadCheckpoint(dir_ + "/checkpoint");
    if (!saved_steps_ && loaded.code() == StatusCode::kNotFound) return;  // nothing published
    if (!Check(loaded, "checkpoint load")) return;
    Result<int64_t> steps = engine_->GroupSteps(*group_);
    if (!Check(steps.status(), "group steps")) return;
    const bool unacknowledged =
        unacknowledged_steps_ && static_cast<size_t>(*steps) == *unacknowledged_steps_;
    history_.resize(unacknowledged ? *unacknowledged_steps_ : saved_steps_.value_or(0));
    VerifyOptimizer("after checkpoint load");
  }

  // Compares the group's state with the reference; false when it could not be read.
  bool VerifyOptimizer(const std::string& when) {
    std::optional<Reference> ref = Replay(history_.size());
    if (!ref) {
      Problem("the reference group could not be stepped");
      return false;
    }
    const std::pair<offload::StateSlot, const std::vector<float>*> slots[] = {
        {offload::StateSlot::kMaster, &ref->master},
        {offload::StateSlot::kExpAvg, &ref->exp_avg},
        {offload::StateSlot::kExpAvgSq, &ref->exp_avg_sq}};
    std::vector<float> state(kParams);
    for (const auto& [slot, expected] : slots) {
      if (!Check(engine_->ReadState(*group_, slot, 0, state), "read state " + when)) return false;
      if (state != *expected)
        Corrupted(fmt::format("optimizer state {} {}", static_cast<int>(slot), when));
    }
    Result<int64_t> steps = engine_->GroupSteps(*group_);
    if (!Check(steps.status(), "group steps")) return false;
    if (*steps != static_cast<int64_t>(history_.size()))
      Corrupted(fmt::format("{} steps counted {}, {} succeeded", *steps, when, history_.size()));
    return true;
  }

  // ---- after the faults

  bool VerifyTensors() {
    bool ok = true;
    for (size_t i = 0; i < tensors_.size(); ++i) {
      Result<void*> acquired = engine_->Acquire(tensors_[i], Tier::kHost, Access::kRead);
      if (!Check(acquired.status(), "final acquire")) {
        ok = false;
        continue;
      }
      if (std::memcmp(*acquired, shadow_[i].data(), shadow_[i].size()) != 0)
        Corrupted(fmt::format("tensor {} after the faults stopped", kTensors[i].name));
      ok = Check(engine_->Release(tensors_[i]), "final release") && ok;
    }
    return ok;
  }

  // Flushes, reads every tensor, finishes a step left with accumulated gradients, steps once
  // more and reads the optimizer state back; true when every call succeeded.
  bool FinalAttempt() {
    const uint64_t errors_before = out_->errors_reported + out_->other_errors;
    Check(engine_->Flush(), "final flush");
    VerifyTensors();
    if (!group_) CreateGroup();
    if (group_ && stuck_) {
      Result<offload::StepReport> report = engine_->Step(*group_, StepArgs(stuck_->hyper));
      if (Check(report.status(), "final accumulated step")) {
        history_.push_back(std::move(*stuck_));
        stuck_.reset();
      }
    }
    if (group_ && !stuck_) {
      StepRecord record{Gradients(), Hyper(kSteps)};
      if (StepGiven(record)) history_.push_back(std::move(record));
      VerifyOptimizer("after the faults stopped");
    }
    return group_ && !stuck_ && out_->errors_reported + out_->other_errors == errors_before;
  }

  // Errors kept from before the faults stopped (a failed prefetch reported by the next acquire
  // of its run) may fail the first attempt; the second must succeed.
  bool FinalPass() {
    if (FinalAttempt()) return true;
    final_retry_ = true;
    return FinalAttempt();
  }

  const FaultPlan& plan_;
  const std::string dir_;
  Outcome* out_;
  std::mt19937_64 random_;
  TargetIo tensor_io_;
  TargetIo optimizer_io_;
  std::optional<CheckpointFaults> checkpoint_faults_;
  std::unique_ptr<offload::Engine> engine_;  // after the TargetIo it borrows

  std::vector<offload::TensorId> tensors_;
  std::vector<std::vector<std::byte>> shadow_;

  std::optional<offload::GroupId> group_;
  std::vector<float> initial_;
  std::vector<float> params_;
  std::vector<StepRecord> history_;             // the steps that succeeded, in order
  std::optional<size_t> saved_steps_;           // steps in the last save that succeeded
  std::optional<size_t> unacknowledged_steps_;  // in a failed save since then
  std::optional<StepRecord> stuck_;             // an accumulated step that failed every retry
  bool final_retry_ = false;                    // the final pass's second attempt is running
};

bool WriteAll(int fd, const void* data, size_t bytes) {
  const auto* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd, p, bytes);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return true;
}

// Reads `bytes` from `fd` before `deadline`; false on end of file, error or time out (`*late`).
bool ReadAllBefore(int fd, void* data, size_t bytes, std::chrono::steady_clock::time_point deadline,
                   bool* late) {
  auto* p = static_cast<char*>(data);
  while (bytes > 0) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      *late = true;
      return false;
    }
    pollfd pfd{fd, POLLIN, 0};
    const int ready = ::poll(&pfd, 1, static_cast<int>(left.count()));
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0) return false;
    if (ready == 0) continue;  // the loop checks the deadline
    const ssize_t n = ::read(fd, p, bytes);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return true;
}

std::string DescribeWait(int wait_status) {
  if (WIFSIGNALED(wait_status))
    return fmt::format("killed by signal {} ({})", WTERMSIG(wait_status),
                       ::strsignal(WTERMSIG(wait_status)));
  if (WIFEXITED(wait_status)) return fmt::format("exit status {}", WEXITSTATUS(wait_status));
  return fmt::format("wait status {:#x}", wait_status);
}

}  // namespace

Outcome RunWorkload(const FaultPlan& plan, const std::string& dir) {
  Outcome out;
  Workload(plan, dir, &out).Run();
  return out;
}

ForkedResult RunForked(const std::function<Outcome()>& body, std::chrono::milliseconds deadline) {
  ForkedResult result;
  int fds[2];
  if (::pipe(fds) != 0) {
    result.exit = ExitKind::kCrashed;
    result.detail = fmt::format("pipe: {}", std::strerror(errno));
    return result;
  }
  const pid_t child = ::fork();
  if (child == 0) {
    ::close(fds[0]);
    const Outcome outcome = body();
    _exit(WriteAll(fds[1], &outcome, sizeof(outcome)) ? 0 : 3);
  }
  ::close(fds[1]);
  if (child < 0) {
    ::close(fds[0]);
    result.exit = ExitKind::kCrashed;
    result.detail = fmt::format("fork: {}", std::strerror(errno));
    return result;
  }
  bool late = false;
  const bool received = ReadAllBefore(fds[0], &result.outcome, sizeof(result.outcome),
                                      std::chrono::steady_clock::now() + deadline, &late);
  ::close(fds[0]);
  if (late) ::kill(child, SIGKILL);
  int wait_status = 0;
  while (::waitpid(child, &wait_status, 0) < 0 && errno == EINTR) {
  }
  const bool clean_exit = WIFEXITED(wait_status) && WEXITSTATUS(wait_status) == 0;
  if (late) {
    result.exit = ExitKind::kHung;
    result.detail = fmt::format("still running after {} ms", deadline.count());
  } else if (!received || !clean_exit) {
    result.exit = ExitKind::kCrashed;
    result.detail = DescribeWait(wait_status);
  }
  return result;
}

// GCC defines __SANITIZE_*; Clang answers __has_feature.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define ZOE_CAMPAIGN_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define ZOE_CAMPAIGN_SANITIZED 1
#endif
#endif

bool SmallCampaign() {
#ifdef ZOE_CAMPAIGN_SANITIZED
  return true;
#else
  return std::getenv("ZOE_CAMPAIGN_SMALL") != nullptr;
#endif
}

}  // namespace zoe::reliability
