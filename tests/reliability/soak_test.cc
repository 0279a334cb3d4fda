// Description: the soak test -- several threads acquire, release, prefetch and evict their own
// tensors (one of them under a recorded and replayed trace) while another steps an optimizer
// group and saves and loads checkpoints, all on one engine with tight budgets, checksums on and
// recoverable faults (short transfers, EINTR, EAGAIN) injected; every read is compared with a
// shadow, every step with an in-memory reference; a watchdog fails the run with a dump of what
// each thread is doing when one stops progressing. ZOE_SOAK_SECONDS sets the duration (default
// 3), ZOE_SOAK_STALL_SECONDS the watchdog's patience (default 30).
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "core/engine_config.h"
#include "io/backend.h"
#include "io/fault_injection.h"
#include "offload/engine.h"
#include "optim/group.h"
#include "tests/offload/temp_dir.h"
#include "tests/reliability/watchdog.h"

namespace zoe::reliability {
namespace {

using offload::Access;
using offload::Tier;
using Clock = std::chrono::steady_clock;
using Json = nlohmann::json;

constexpr uint64_t kChunk = 64 << 10;
constexpr int kTensorWorkers = 3;
constexpr int kTensorsPerWorker = 3;
constexpr size_t kParams = 3000;
constexpr int kSaveEvery = 8;
constexpr int kLoadEvery = 13;
constexpr int kVerifyStateEvery = 10;

double EnvSeconds(const char* name, double fallback) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return fallback;
  const double value = std::strtod(text, nullptr);
  return value > 0 ? value : fallback;
}

// Every tensor a whole number of chunks, so each has its run to itself and threads never share
// one. The HOST budget holds five chunks for nine tensors of one or two: acquires evict and wait.
Json SoakConfig(const std::string& dir) {
  return {{"zero_optimization",
           {{"sub_group_size", 1024},
            {"offload_optimizer",
             {{"device", "nvme"}, {"nvme_path", dir}, {"ratio", 0.5}, {"buffer_count", 2}}}}},
          {"aio", {{"backend", "psync"}, {"queue_depth", 8}}},
          {"zoe",
           {{"chunk_size", kChunk},
            {"host_budget", "16M"},
            {"tensor_host_budget", 5 * kChunk},
            {"tensor_swap_bytes", "4M"},
            {"device", "host"},
            {"device_budget", 3 * kChunk},
            {"checksum", true},
            {"log_level", "error"}}}};
}

// Recoverable faults only: any error the workers see is a failure.
std::function<Result<std::unique_ptr<io::Engine>>()> RecoverableFaults(uint64_t seed) {
  return [seed]() -> Result<std::unique_ptr<io::Engine>> {
    ZOE_ASSIGN_OR_RETURN(std::unique_ptr<io::Engine> raw, io::CreatePsyncEngine(8));
    auto faulty = std::make_unique<io::FaultInjectingEngine>(std::move(raw), seed);
    faulty->AddRule({io::FaultKind::kShortTransfer, io::FaultOps::kAll, 0, 16});
    faulty->AddRule({io::FaultKind::kEintr, io::FaultOps::kAll, 0, 40});
    faulty->AddRule({io::FaultKind::kEagain, io::FaultOps::kAll, 0, 40});
    return std::unique_ptr<io::Engine>(std::move(faulty));
  };
}

class Soak {
 public:
  explicit Soak(offload::Engine& engine, Clock::time_point end) : engine_(engine), end_(end) {}

  void Fail(const std::string& what) {
    ++failures_;
    std::lock_guard lock(mutex_);
    if (messages_.size() < 20) messages_.push_back(what);
  }
  bool Ok(const Status& status, const std::string& what) {
    if (!status.ok()) Fail(fmt::format("{}: {}", what, status.ToString()));
    return status.ok();
  }
  uint64_t failures() const { return failures_; }
  std::vector<std::string> messages() const {
    std::lock_guard lock(mutex_);
    return messages_;
  }

  // ---- tensor workers

  struct Owned {
    offload::TensorId id;
    std::string name;
    uint64_t bytes = 0;
    std::vector<std::byte> shadow;
  };

  std::vector<Owned> RegisterOwn(int worker) {
    std::vector<Owned> owned;
    for (int i = 0; i < kTensorsPerWorker; ++i) {
      Owned t;
      t.name = fmt::format("w{}.{}", worker, i);
      t.bytes = (i == 2 ? 2 : 1) * kChunk;
      Result<offload::TensorId> id =
          engine_.RegisterTensor({t.name, t.bytes, offload::DType::kUInt8, Tier::kNvme, ""});
      if (!Ok(id.status(), "register " + t.name)) continue;
      t.id = *id;
      t.shadow.assign(t.bytes, std::byte{0});
      owned.push_back(std::move(t));
    }
    return owned;
  }

  void Touch(Owned& t, Tier tier, Access access, std::mt19937_64& random, WorkerState& state) {
    state.Doing(tier == Tier::kDevice ? "acquire on DEVICE" : "acquire on HOST");
    Result<void*> acquired = engine_.Acquire(t.id, tier, access);
    if (!Ok(acquired.status(), "acquire " + t.name)) return;
    auto* bytes = static_cast<std::byte*>(*acquired);
    if (offload::Reads(access) && std::memcmp(bytes, t.shadow.data(), t.bytes) != 0)
      Fail(fmt::format("{} read back other bytes than released last", t.name));
    if (offload::Writes(access)) {
      const uint64_t word = random();
      for (uint64_t i = 0; i < t.bytes; i += 8) std::memcpy(&t.shadow[i], &word, 8);
      std::memcpy(&t.shadow[random() % t.bytes], &word, 1);  // not only a repeated word
      std::memcpy(bytes, t.shadow.data(), t.bytes);
    }
    state.Doing("release");
    Ok(engine_.Release(t.id), "release " + t.name);
  }

  // One random operation on one of the worker's tensors.
  void TensorOperation(std::vector<Owned>& owned, std::mt19937_64& random, WorkerState& state) {
    Owned& t = owned[random() % owned.size()];
    const auto access = static_cast<Access>(random() % 3);
    switch (random() % 8) {
      case 0:
        state.Doing("prefetch");
        Ok(engine_.Prefetch(t.id, t.bytes == kChunk ? Tier::kDevice : Tier::kHost),
           "prefetch " + t.name);
        break;
      case 1: {
        state.Doing("evict");
        Ok(engine_.Evict(t.id), "evict " + t.name);
        break;
      }
      case 2:
      case 3:
        if (t.bytes == kChunk) {
          Touch(t, Tier::kDevice, access, random, state);
          break;
        }
        [[fallthrough]];
      default:
        Touch(t, Tier::kHost, access, random, state);
    }
  }

  // Worker 0 brackets every 12 operations in a trace iteration, so its acquires are recorded
  // once and then replayed with prefetch while the others run free.
  void TensorWorker(int worker, WorkerState& state) {
    std::mt19937_64 random(static_cast<uint64_t>(worker) + 1);
    std::vector<Owned> owned = RegisterOwn(worker);
    const bool traced = worker == 0;
    for (uint64_t op = 0; !owned.empty() && Clock::now() < end_; ++op) {
      if (traced && op % 12 == 0) {
        state.Doing("trace begin");
        if (op != 0) Ok(engine_.TraceEnd(), "trace end");
        Ok(engine_.TraceBegin("soak"), "trace begin");
      }
      TensorOperation(owned, random, state);
      state.Progressed();
    }
    if (traced && !owned.empty()) Ok(engine_.TraceEnd(), "trace end");
    state.Doing("final read");
    for (Owned& t : owned) Touch(t, Tier::kHost, Access::kRead, random, state);
    state.Finished();
  }

  // ---- the optimizer worker

  struct StepRecord {
    std::vector<float> grads;
    double lr = 0.0;
  };

  struct Reference {
    std::unique_ptr<optim::Group> group;
    std::vector<float> master;
  };

  optim::HyperParams Hyper(double lr) const {
    optim::HyperParams hyper;
    hyper.lr = lr;
    hyper.weight_decay = 0.01;
    return hyper;
  }

  bool Rebuild(Reference& ref, const std::vector<float>& initial,
               const std::vector<StepRecord>& history) {
    optim::GroupOptions options;
    options.count = kParams;
    Result<std::unique_ptr<optim::Group>> group = optim::Group::Create(options);
    if (!Ok(group.status(), "reference group")) return false;
    ref.group = std::move(group).value();
    ref.master = initial;
    for (const StepRecord& r : history) {
      if (!Ok(ref.group->Step(Hyper(r.lr), ref.master.data(), r.grads.data()).status(),
              "reference step"))
        return false;
    }
    return true;
  }

  void CompareState(offload::GroupId id, const Reference& ref, WorkerState& state) {
    state.Doing("read optimizer state");
    std::vector<float> values(kParams);
    if (!Ok(engine_.ReadState(id, offload::StateSlot::kMaster, 0, values), "read master")) return;
    if (values != ref.master) Fail("optimizer master differs from the reference");
    if (!Ok(engine_.ReadState(id, offload::StateSlot::kExpAvg, 0, values), "read exp_avg")) return;
    const auto* m = static_cast<const float*>(ref.group->exp_avg());
    if (values != std::vector<float>(m, m + kParams))
      Fail("optimizer exp_avg differs from the reference");
  }

  bool Step(offload::GroupId id, const StepRecord& record, bool accumulate, WorkerState& state) {
    optim::HyperParams hyper;
    hyper.lr = record.lr;
    hyper.weight_decay = 0.01;
    offload::EngineStepArgs args;
    args.hyper = hyper;
    const offload::GradView grad{record.grads.data(), optim::DType::kFloat32, kParams};
    if (accumulate) {
      state.Doing("accumulate_grad");
      for (size_t offset = 0; offset < kParams; offset += 1500) {
        const offload::GradView part{record.grads.data() + offset, optim::DType::kFloat32, 1500};
        if (!Ok(engine_.AccumulateGrad(id, offset, part), "accumulate_grad")) return false;
      }
    } else {
      args.grads = std::span(&grad, 1);
    }
    state.Doing(accumulate ? "accumulated step" : "step");
    return Ok(engine_.Step(id, args).status(), "step");
  }

  void OptimizerWorker(WorkerState& state) {
    std::vector<float> initial(kParams);
    for (size_t i = 0; i < kParams; ++i) initial[i] = 0.5f - 0.0003f * static_cast<float>(i);
    const offload::ParamView view{initial.data(), optim::DType::kFloat32, kParams};
    state.Doing("create group");
    Result<offload::GroupId> id = engine_.CreateGroup(R"({"name": "soak"})", std::span(&view, 1));
    Reference ref;
    if (!Ok(id.status(), "create group") || !Rebuild(ref, initial, {})) return state.Finished();
    const std::string checkpoint = scratch_ + "/checkpoint";
    std::mt19937_64 random(99);
    std::uniform_real_distribution<float> spread(-0.1f, 0.1f);
    std::vector<StepRecord> history;
    size_t saved = 0;
    for (int step = 1; Clock::now() < end_; ++step) {
      StepRecord record{std::vector<float>(kParams), 0.01 / (1 + step % 5)};
      for (float& g : record.grads) g = spread(random);
      if (!Step(*id, record, step % 2 == 0, state)) break;
      if (!Ok(ref.group->Step(Hyper(record.lr), ref.master.data(), record.grads.data()).status(),
              "reference step"))
        break;
      history.push_back(std::move(record));
      if (step % kVerifyStateEvery == 0) CompareState(*id, ref, state);
      if (step % kSaveEvery == 0) {
        state.Doing("checkpoint save");
        if (Ok(engine_.SaveCheckpoint(checkpoint), "checkpoint save")) saved = history.size();
      }
      if (step % kLoadEvery == 0 && saved > 0) {
        state.Doing("checkpoint load");
        if (!Ok(engine_.LoadCheckpoint(checkpoint), "checkpoint load")) break;
        history.resize(saved);
        if (!Rebuild(ref, initial, history)) break;
        CompareState(*id, ref, state);
      }
      state.Progressed();
    }
    CompareState(*id, ref, state);
    steps_ = history.size();
    state.Finished();
  }

  void set_scratch(std::string dir) { scratch_ = std::move(dir); }
  size_t steps() const { return steps_; }

 private:
  offload::Engine& engine_;
  const Clock::time_point end_;
  std::string scratch_;
  std::atomic<uint64_t> failures_{0};
  mutable std::mutex mutex_;
  std::vector<std::string> messages_;
  size_t steps_ = 0;
};

TEST(Soak, ThreadsOnOneEngineKeepEveryByteAndStep) {
  const double seconds = EnvSeconds("ZOE_SOAK_SECONDS", 3.0);
  const double stall = EnvSeconds("ZOE_SOAK_STALL_SECONDS", 30.0);
  offload::testing::TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  Result<config::EngineConfig> config = config::ParseEngineConfigDocument(SoakConfig(dir.path()));
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  offload::EngineHooks hooks;
  hooks.tensor_io_factory = RecoverableFaults(1);
  hooks.optimizer_io_factory = RecoverableFaults(2);
  Result<std::unique_ptr<offload::Engine>> engine =
      offload::Engine::Create(std::move(config).value(), std::move(hooks));
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();

  const auto end = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                      std::chrono::duration<double>(seconds));
  Soak soak(**engine, end);
  soak.set_scratch(dir.path());
  // A stall is a hang: the workers cannot be joined, so the dump is printed and the process ends.
  Watchdog watchdog(std::chrono::milliseconds(static_cast<int64_t>(stall * 1000)),
                    [](const std::string& dump) {
                      std::fprintf(stderr, "soak: watchdog: %s", dump.c_str());
                      std::fflush(stderr);
                      std::abort();
                    });
  std::vector<WorkerState*> states;
  for (int w = 0; w < kTensorWorkers; ++w)
    states.push_back(&watchdog.AddWorker(fmt::format("tensors {}", w)));
  WorkerState& optimizer_state = watchdog.AddWorker("optimizer");
  watchdog.Start();
  std::vector<std::thread> threads;
  for (int w = 0; w < kTensorWorkers; ++w)
    threads.emplace_back([&soak, w, state = states[w]] { soak.TensorWorker(w, *state); });
  threads.emplace_back([&] { soak.OptimizerWorker(optimizer_state); });
  for (std::thread& t : threads) t.join();
  watchdog.Stop();

  uint64_t operations = 0;
  for (const WorkerState* state : states) operations += state->progress.load();
  fmt::print("soak: {:.1f} s, {} tensor operations, {} optimizer steps, {} failures\n", seconds,
             operations, soak.steps(), soak.failures());
  for (const std::string& message : soak.messages()) ADD_FAILURE() << message;
  EXPECT_EQ(soak.failures(), 0u);
  EXPECT_GT(operations, 3u * kTensorWorkers);
  EXPECT_GT(soak.steps(), 0u);
  EXPECT_TRUE((*engine)->Flush().ok());
}

// The watchdog itself: a worker stuck in one operation is named in the dump with what it is
// doing, and a finished worker is not taken for a stuck one.
TEST(Soak, WatchdogDumpsTheStuckWorker) {
  std::mutex mutex;
  std::string dump;
  Watchdog watchdog(std::chrono::milliseconds(150), [&](const std::string& text) {
    std::lock_guard lock(mutex);
    dump = text;
  });
  WorkerState& busy = watchdog.AddWorker("busy");
  WorkerState& stuck = watchdog.AddWorker("stuck");
  WorkerState& done = watchdog.AddWorker("done");
  done.Finished();
  watchdog.Start();
  stuck.Doing("acquire on HOST");
  const auto until = Clock::now() + std::chrono::milliseconds(600);
  while (Clock::now() < until && !watchdog.fired()) {
    busy.Progressed();
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  watchdog.Stop();
  ASSERT_TRUE(watchdog.fired());
  std::lock_guard lock(mutex);
  EXPECT_NE(dump.find("stuck"), std::string::npos) << dump;
  EXPECT_NE(dump.find("acquire on HOST"), std::string::npos) << dump;
  EXPECT_NE(dump.find("finished"), std::string::npos) << dump;
}

}  // namespace
}  // namespace zoe::reliability
