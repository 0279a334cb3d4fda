// Description: a process SIGKILLed at random points while it saves checkpoints in a loop (raw
// files, and an OptimizerGroup that steps and saves) always leaves a checkpoint that opens,
// verifies, and holds exactly the state of the generation it names; a group resumed from a
// checkpoint continues bit for bit like one that never stopped.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/pinned_memory.h"
#include "io/backend.h"
#include "io/queue.h"
#include "io/swap_space.h"
#include "offload/checkpoint/checkpoint_store.h"
#include "offload/optimizer/optimizer_group.h"
#include "tests/offload/temp_dir.h"

namespace zoe::offload {
namespace {

using testing::TempDir;

constexpr size_t kFilesPerGeneration = 3;

// File `i` of generation `g`: a few hundred KB to ~1.5 MB of 64-bit words derived from (g, i), with
// sizes that change with g so a file of one generation never passes for another's.
std::vector<uint64_t> GenerationData(uint64_t g, size_t i) {
  const size_t words = (size_t{1} << (17 - i)) + 8 * (g % 13) + i;
  std::vector<uint64_t> data(words);
  uint64_t state = g * 0x9E3779B97F4A7C15ull + i * 0xD1B54A32D192ED03ull;
  for (uint64_t& word : data) {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    word = z ^ (z >> 27);
  }
  return data;
}

std::string FileName(size_t i) { return "part" + std::to_string(i) + ".bin"; }

Status SaveGeneration(const std::string& dir, uint64_t g) {
  ZOE_ASSIGN_OR_RETURN(auto writer, CheckpointWriter::Begin(dir, {{"generation", g}}));
  for (size_t i = 0; i < kFilesPerGeneration; ++i) {
    const std::vector<uint64_t> data = GenerationData(g, i);
    auto bytes = std::as_bytes(std::span(data));
    ZOE_RETURN_IF_ERROR(writer->BeginFile(FileName(i), {{"index", i}}));
    // Appends of 256 KiB: a kill lands between appends as well as inside one.
    for (size_t at = 0; at < bytes.size(); at += size_t{1} << 18) {
      ZOE_RETURN_IF_ERROR(
          writer->Append(bytes.subspan(at, std::min(bytes.size() - at, size_t{1} << 18))));
    }
    ZOE_RETURN_IF_ERROR(writer->EndFile());
  }
  return writer->Commit();
}

// Opens `dir`, verifies every file and compares it with the data of the generation the metadata
// names, which it returns (0 on any failure, after recording it).
uint64_t VerifiedGeneration(const std::string& dir) {
  auto reader = CheckpointReader::Open(dir);
  EXPECT_TRUE(reader.ok()) << reader.status().ToString();
  if (!reader.ok()) return 0;
  const uint64_t g = (*reader)->metadata().at("generation").get<uint64_t>();
  EXPECT_EQ((*reader)->file_names().size(), kFilesPerGeneration);
  for (size_t i = 0; i < kFilesPerGeneration; ++i) {
    const std::vector<uint64_t> expected = GenerationData(g, i);
    std::vector<uint64_t> read(expected.size());
    Status status = (*reader)->BeginFile(FileName(i));
    if (status.ok()) status = (*reader)->Read(std::as_writable_bytes(std::span(read)));
    if (status.ok()) status = (*reader)->EndFile();
    EXPECT_TRUE(status.ok()) << "generation " << g << ": " << status.ToString();
    EXPECT_TRUE(read == expected) << "generation " << g << ", file " << i;
    if (!status.ok() || read != expected) return 0;
  }
  return g;
}

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// In a child: saves generations first, first + 1, ... until killed. Exits 2 if a save fails.
[[noreturn]] void SaveForever(const std::string& dir, uint64_t first) {
  ::alarm(30);  // never outlives a parent that died before killing it
  for (uint64_t g = first;; ++g) {
    Status status = SaveGeneration(dir, g);
    if (!status.ok()) {
      std::fprintf(stderr, "child: %s\n", status.ToString().c_str());
      ::_exit(2);
    }
  }
}

TEST(CheckpointKillTest, AKilledSaveAlwaysLeavesAVerifiedCheckpoint) {
  TempDir temp;
  const std::string dir = temp.File("ckpt");
  const auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE(SaveGeneration(dir, 1).ok());
  const double save_seconds = SecondsSince(start);

  // Kill points spread over about three saves of the child, seeded so a failure repeats.
  std::mt19937_64 random(20261122);
  std::uniform_real_distribution<double> delay(0.0, 3.0 * save_seconds + 0.002);
  uint64_t generation = 1;
  int advanced = 0;
  for (int round = 0; round < 20; ++round) {
    const double wait = delay(random);
    SCOPED_TRACE("round " + std::to_string(round) + ", kill after " + std::to_string(wait) + " s");
    const pid_t child = ::fork();
    ASSERT_GE(child, 0) << std::strerror(errno);
    if (child == 0) SaveForever(dir, generation + 1);
    std::this_thread::sleep_for(std::chrono::duration<double>(wait));
    ASSERT_EQ(::kill(child, SIGKILL), 0);
    int wstatus = 0;
    ASSERT_EQ(::waitpid(child, &wstatus, 0), child);
    ASSERT_TRUE(WIFSIGNALED(wstatus)) << "the child stopped by itself, status " << wstatus;

    const uint64_t loaded = VerifiedGeneration(dir);
    ASSERT_GE(loaded, generation);  // 0 (a failure) is below every generation
    advanced += loaded > generation;
    generation = loaded;
  }
  RecordProperty("rounds_that_committed_a_new_generation", advanced);
  // Kills spread over several saves: some rounds must have let a save commit, or every round
  // tested only an interrupted first save.
  EXPECT_GT(advanced, 0);

  // The next save clears whatever the kills left and keeps one version.
  ASSERT_TRUE(SaveGeneration(dir, generation + 1).ok());
  EXPECT_EQ(VerifiedGeneration(dir), generation + 1);
  size_t entries = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator(dir)) ++entries;
  EXPECT_EQ(entries, 2u);  // LATEST and the version it names
}

// ---- an OptimizerGroup that steps and saves -----------------------------------------------

constexpr size_t kGroupCount = 50000;  // 7 chunks of 8192: 4 on NVMe, 3 in HOST

// The resources and the group of one process; the state on NVMe lives under `swap_dir`.
class GroupRig {
 public:
  explicit GroupRig(const std::string& swap_dir) {
    io::EngineOptions engine_options;
    engine_options.backend = io::BackendKind::kPsync;
    engine_options.queue_depth = 8;
    auto engine = io::CreateEngine(engine_options);
    if (!engine.ok()) {
      status_ = engine.status();
      return;
    }
    auto queue = io::IoQueue::Create(std::move(*engine));
    if (!queue.ok()) {
      status_ = queue.status();
      return;
    }
    queue_ = std::move(*queue);
    io::SwapOptions swap_options;
    swap_options.alignment = 4096;
    auto swap = io::SwapSpace::Create({swap_dir}, uint64_t{4} << 20, swap_options);
    if (!swap.ok()) {
      status_ = swap.status();
      return;
    }
    swap_ = std::move(*swap);
    auto pinned = PinnedMemoryPool::Create({.name = "kill-test", .budget_bytes = 4 << 20});
    if (!pinned.ok()) {
      status_ = pinned.status();
      return;
    }
    pinned_.emplace(std::move(*pinned));

    OptimizerGroupOptions options;
    options.name = "layer";
    options.count = kGroupCount;
    options.max_grad_norm = 1.0;
    options.placement = Tier::kNvme;
    options.nvme_ratio = 0.6;
    options.chunk_elements = 8192;
    options.buffer_count = 3;
    std::vector<float> initial(kGroupCount);
    for (size_t i = 0; i < kGroupCount; ++i) initial[i] = 0.01f * static_cast<float>(i % 101);
    const ParamView view{initial.data(), optim::DType::kFloat32, kGroupCount};
    auto group = OptimizerGroup::Create(options, {queue_.get(), swap_.get(), &*pinned_},
                                        std::span(&view, 1));
    if (!group.ok()) {
      status_ = group.status();
      return;
    }
    group_ = std::move(*group);
  }

  const Status& status() const { return status_; }
  OptimizerGroup& group() { return *group_; }

  // Step `g` (1-based): gradients and lr derived from g.
  Status Step(uint64_t g) {
    std::vector<float> grads(kGroupCount);
    for (size_t i = 0; i < kGroupCount; ++i) {
      uint64_t z = (g * 0x9E3779B97F4A7C15ull) ^ (i * 0xBF58476D1CE4E5B9ull);
      z ^= z >> 29;
      grads[i] = 0.02f * (static_cast<float>(z % 2001) / 1000.0f - 1.0f);
    }
    const GradView view{grads.data(), optim::DType::kFloat32, kGroupCount};
    StepArgs args;
    args.hyper.lr = 1e-3 * (1.0 + 0.25 * static_cast<double>(g % 4));
    args.hyper.weight_decay = 0.01;
    args.grads = std::span(&view, 1);
    ZOE_ASSIGN_OR_RETURN(StepReport report, group_->Step(args));
    if (report.skipped) return Status::Internal("a finite step was skipped");
    return Status::Ok();
  }

  Status Save(const std::string& dir) {
    ZOE_ASSIGN_OR_RETURN(auto writer,
                         CheckpointWriter::Begin(dir, {{"generation", group_->steps_taken()}}));
    ZOE_RETURN_IF_ERROR(group_->Save(*writer));
    return writer->Commit();
  }

  // Loads the checkpoint in `dir`; returns the generation its metadata names.
  Result<uint64_t> Load(const std::string& dir) {
    ZOE_ASSIGN_OR_RETURN(auto reader, CheckpointReader::Open(dir));
    ZOE_RETURN_IF_ERROR(group_->Load(*reader));
    return reader->metadata().at("generation").get<uint64_t>();
  }

  // master, exp_avg and exp_avg_sq, one after the other, as fp32.
  std::vector<float> State() const {
    std::vector<float> state(3 * kGroupCount);
    const StateSlot slots[] = {StateSlot::kMaster, StateSlot::kExpAvg, StateSlot::kExpAvgSq};
    for (size_t s = 0; s < 3; ++s) {
      Status read =
          group_->ReadState(slots[s], 0, std::span(state).subspan(s * kGroupCount, kGroupCount));
      EXPECT_TRUE(read.ok()) << read.ToString();
    }
    return state;
  }

 private:
  Status status_;
  std::unique_ptr<io::IoQueue> queue_;
  std::unique_ptr<io::SwapSpace> swap_;
  std::optional<PinnedMemoryPool> pinned_;
  std::unique_ptr<OptimizerGroup> group_;
};

// In a child: resumes from the checkpoint in `dir` and steps and saves until killed.
[[noreturn]] void StepAndSaveForever(const std::string& swap_dir, const std::string& dir) {
  ::alarm(30);
  GroupRig rig(swap_dir);
  Status status = rig.status();
  if (status.ok()) status = rig.Load(dir).status();
  for (uint64_t g = rig.group().steps_taken() + 1; status.ok(); ++g) {
    status = rig.Step(g);
    if (status.ok()) status = rig.Save(dir);
  }
  std::fprintf(stderr, "child: %s\n", status.ToString().c_str());
  ::_exit(2);
}

// The state of a group that took steps 1..g without stopping.
std::vector<float> ReferenceState(const std::string& swap_dir, uint64_t g) {
  GroupRig reference(swap_dir);
  EXPECT_TRUE(reference.status().ok()) << reference.status().ToString();
  if (!reference.status().ok()) return {};
  for (uint64_t step = 1; step <= g; ++step) EXPECT_TRUE(reference.Step(step).ok());
  return reference.State();
}

// No group lives in the parent while a child is forked: a child of a process with running threads
// (the I/O queue's reaper) may not start its own under ThreadSanitizer.
TEST(CheckpointKillTest, AKilledGroupSaveAlwaysLeavesTheStateOfAStep) {
  TempDir temp;
  const std::string dir = temp.File("ckpt");
  const std::string swap_dir = temp.File("swap");
  ASSERT_EQ(::mkdir(swap_dir.c_str(), 0755), 0);
  // What a child does before its first save (set up, step), and one save: the kill points spread
  // over the child's start and about three of its saves.
  double cycle_seconds = 0;
  {
    const auto start = std::chrono::steady_clock::now();
    GroupRig first(swap_dir);
    ASSERT_TRUE(first.status().ok()) << first.status().ToString();
    ASSERT_TRUE(first.Step(1).ok());
    ASSERT_TRUE(first.Save(dir).ok());
    cycle_seconds = SecondsSince(start);
  }

  std::mt19937_64 random(7);
  std::uniform_real_distribution<double> delay(0.0, 4.0 * cycle_seconds + 0.005);
  uint64_t generation = 1;
  int advanced = 0;
  for (int round = 0; round < 10; ++round) {
    const double wait = delay(random);
    SCOPED_TRACE("round " + std::to_string(round) + ", kill after " + std::to_string(wait) + " s");
    const pid_t child = ::fork();
    ASSERT_GE(child, 0) << std::strerror(errno);
    if (child == 0) StepAndSaveForever(swap_dir, dir);
    std::this_thread::sleep_for(std::chrono::duration<double>(wait));
    ASSERT_EQ(::kill(child, SIGKILL), 0);
    int wstatus = 0;
    ASSERT_EQ(::waitpid(child, &wstatus, 0), child);
    ASSERT_TRUE(WIFSIGNALED(wstatus)) << "the child stopped by itself, status " << wstatus;

    GroupRig loaded(swap_dir);
    ASSERT_TRUE(loaded.status().ok()) << loaded.status().ToString();
    Result<uint64_t> g = loaded.Load(dir);
    ASSERT_TRUE(g.ok()) << g.status().ToString();
    ASSERT_GE(*g, generation);
    EXPECT_EQ(loaded.group().steps_taken(), static_cast<int64_t>(*g));
    ASSERT_TRUE(loaded.State() == ReferenceState(swap_dir, *g)) << "generation " << *g;
    advanced += *g > generation;
    generation = *g;
  }
  RecordProperty("rounds_that_committed_a_new_generation", advanced);
  // Kills spread over several saves: some rounds must have let a save commit, or every round
  // tested only an interrupted first save.
  EXPECT_GT(advanced, 0);
}

TEST(CheckpointKillTest, AResumedGroupContinuesBitForBitLikeOneThatNeverStopped) {
  TempDir temp;
  const std::string dir = temp.File("ckpt");
  const std::string swap_dir = temp.File("swap");
  ASSERT_EQ(::mkdir(swap_dir.c_str(), 0755), 0);
  constexpr uint64_t kSaveAt = 6, kLast = 12;

  GroupRig uninterrupted(swap_dir);
  ASSERT_TRUE(uninterrupted.status().ok()) << uninterrupted.status().ToString();
  for (uint64_t g = 1; g <= kLast; ++g) {
    ASSERT_TRUE(uninterrupted.Step(g).ok());
    if (g == kSaveAt) {
      ASSERT_TRUE(uninterrupted.Save(dir).ok());
    }
  }

  GroupRig resumed(swap_dir);
  ASSERT_TRUE(resumed.status().ok()) << resumed.status().ToString();
  const std::vector<float> initial = resumed.State();
  Result<uint64_t> g = resumed.Load(dir);
  ASSERT_TRUE(g.ok()) << g.status().ToString();
  ASSERT_EQ(*g, kSaveAt);
  EXPECT_EQ(resumed.group().steps_taken(), static_cast<int64_t>(kSaveAt));
  EXPECT_FALSE(resumed.State() == initial);
  for (uint64_t step = kSaveAt + 1; step <= kLast; ++step) ASSERT_TRUE(resumed.Step(step).ok());
  EXPECT_EQ(resumed.group().steps_taken(), uninterrupted.group().steps_taken());
  EXPECT_TRUE(resumed.State() == uninterrupted.State());
}

}  // namespace
}  // namespace zoe::offload
