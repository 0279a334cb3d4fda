// Description: ShardedGroup across ranks in threads with an in-memory communicator whose waits are
// bounded: the shard ranges, the parameters' all-gather in rounds, and the failures that every rank
// must see -- an I/O error on one rank during the update, bad gradients on one rank before it, a
// creation that fails on one rank -- each ending every rank's step with a clear error within the
// communicator's bound, never a hang.
#include "offload/distributed/sharded_group.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "io/backend.h"
#include "io/fault_injection.h"
#include "tests/offload/temp_dir.h"

namespace zoe::offload {
namespace {

using ::testing::HasSubstr;
using testing::TempDir;
using Json = nlohmann::json;
using Clock = std::chrono::steady_clock;

constexpr size_t kCount = 3001;
constexpr auto kCollectiveTimeout = std::chrono::seconds(10);

// Ranks in threads: a collective publishes each rank's buffer, waits at a rendezvous, reads its
// peers' buffers and waits again. A rendezvous that not every rank reaches within
// kCollectiveTimeout fails (Aborted), so a test can never hang.
class Communicator {
 public:
  explicit Communicator(int world) : world_(world), published_(static_cast<size_t>(world)) {}
  int world() const { return world_; }

  Status Rendezvous() {
    std::unique_lock lock(mutex_);
    const uint64_t generation = generation_;
    if (++arrived_ == world_) {
      arrived_ = 0;
      ++generation_;
      changed_.notify_all();
      return Status::Ok();
    }
    if (changed_.wait_for(lock, kCollectiveTimeout, [&] { return generation_ != generation; })) {
      return Status::Ok();
    }
    return Status::Aborted("in-memory collective: a peer did not arrive within the timeout");
  }
  void Publish(int rank, const void* buffer) { published_[static_cast<size_t>(rank)] = buffer; }
  const void* Published(int rank) const { return published_[static_cast<size_t>(rank)]; }

 private:
  const int world_;
  std::mutex mutex_;
  std::condition_variable changed_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  std::vector<const void*> published_;
};

class InMemoryCollectives final : public Collectives {
 public:
  // `offers_broadcast`: whether the sharded group may move parameters with Broadcast.
  InMemoryCollectives(Communicator& comm, int rank, bool offers_broadcast)
      : comm_(comm), rank_(rank), offers_broadcast_(offers_broadcast) {}
  int rank() const override { return rank_; }
  int world_size() const override { return comm_.world(); }
  // Collective calls made so far; FailCall(n): call n (1-based) returns Aborted without
  // exchanging, as a transport whose communicator broke fails on every rank.
  uint64_t calls() const { return calls_; }
  void FailCall(uint64_t n) { fail_call_ = n; }

  Status AllReduceSum(std::span<double> values) override {
    ZOE_RETURN_IF_ERROR(Count("all_reduce"));
    std::vector<double> sum(values.size(), 0.0);
    ZOE_RETURN_IF_ERROR(Exchange(values.data(), [&] {
      for (int r = 0; r < comm_.world(); ++r) {
        const auto* peer = static_cast<const double*>(comm_.Published(r));
        for (size_t i = 0; i < sum.size(); ++i) sum[i] += peer[i];
      }
    }));
    std::copy(sum.begin(), sum.end(), values.begin());
    return Status::Ok();
  }
  Status ReduceScatterSum(std::span<const float> send, std::span<float> recv,
                          std::span<const uint64_t> counts) override {
    ZOE_RETURN_IF_ERROR(Count("reduce_scatter"));
    const size_t offset = OffsetOf(counts, rank_);
    return Exchange(send.data(), [&] {
      for (size_t i = 0; i < recv.size(); ++i) {
        float sum = 0.0f;
        for (int r = 0; r < comm_.world(); ++r) {
          sum += static_cast<const float*>(comm_.Published(r))[offset + i];
        }
        recv[i] = sum;
      }
    });
  }
  Status AllGather(std::span<const float> send, std::span<float> recv,
                   std::span<const uint64_t> counts) override {
    ZOE_RETURN_IF_ERROR(Count("all_gather"));
    return Exchange(send.data(), [&] {
      for (int r = 0; r < comm_.world(); ++r) {
        const auto* peer = static_cast<const float*>(comm_.Published(r));
        std::copy_n(peer, counts[static_cast<size_t>(r)], recv.data() + OffsetOf(counts, r));
      }
    });
  }
  Status Barrier() override {
    ZOE_RETURN_IF_ERROR(Count("barrier"));
    return comm_.Rendezvous();
  }
  bool OffersBroadcast() const override { return offers_broadcast_; }
  Status Broadcast(std::span<const BroadcastSegment> segments) override {
    ZOE_RETURN_IF_ERROR(Count("broadcast"));
    for (const BroadcastSegment& segment : segments) {
      ZOE_RETURN_IF_ERROR(Exchange(segment.data, [&] {
        if (segment.root == rank_) return;
        std::memcpy(segment.data, comm_.Published(segment.root), segment.bytes);
      }));
    }
    return Status::Ok();
  }

 private:
  Status Count(const char* what) {
    if (++calls_ != fail_call_) return Status::Ok();
    return Status::Aborted(std::string("in-memory collective: injected failure of ") + what);
  }
  static size_t OffsetOf(std::span<const uint64_t> counts, int rank) {
    size_t offset = 0;
    for (int r = 0; r < rank; ++r) offset += counts[static_cast<size_t>(r)];
    return offset;
  }
  // Publish, wait, read the peers (`read`), wait until every rank has read.
  Status Exchange(const void* buffer, const std::function<void()>& read) {
    comm_.Publish(rank_, buffer);
    ZOE_RETURN_IF_ERROR(comm_.Rendezvous());
    read();
    return comm_.Rendezvous();
  }

  Communicator& comm_;
  const int rank_;
  const bool offers_broadcast_;
  uint64_t calls_ = 0;
  uint64_t fail_call_ = 0;
};

// Engines with the optimizer on NVMe (psync, so a FaultInjectingEngine can wrap it) in sub-groups
// of 256 parameters: each shard spans several chunks.
Json RankConfig(const std::string& dir) {
  return {{"zero_optimization",
           {{"sub_group_size", 256},
            // Two pipeline buffers for a shard's four sub-groups: every step reads its state back.
            {"offload_optimizer", {{"device", "nvme"}, {"nvme_path", dir}, {"buffer_count", 2}}}}},
          {"aio", {{"backend", "psync"}, {"queue_depth", 8}}},
          {"zoe",
           {{"host_budget", "32M"},
            {"tensor_host_budget", "256K"},
            {"tensor_swap_bytes", "1M"},
            {"device", "host"}}}};
}

// Psync engines whose faults a test arms later (the engine the last factory call made).
struct FaultyIo {
  io::FaultInjectingEngine* engine = nullptr;
  std::function<Result<std::unique_ptr<io::Engine>>()> Factory() {
    return [this]() -> Result<std::unique_ptr<io::Engine>> {
      ZOE_ASSIGN_OR_RETURN(std::unique_ptr<io::Engine> raw, io::CreatePsyncEngine(8));
      auto faulty = std::make_unique<io::FaultInjectingEngine>(std::move(raw), 7);
      engine = faulty.get();
      return std::unique_ptr<io::Engine>(std::move(faulty));
    };
  }
};

struct Rank {
  std::string dir;
  FaultyIo faults;
  std::unique_ptr<Engine> engine;
  std::unique_ptr<InMemoryCollectives> collectives;
  std::unique_ptr<ShardedGroup> group;
  std::vector<float> params;
  Status created;
  Status stepped;
};

// How the ranks' collectives move the updated parameters: all-gathered through the group's
// buffer, or broadcast straight into the peers' parameters.
enum class Transport { kAllGather, kBroadcast };

// `world` ranks, each with its own engine and directory; every rank's group is created in its
// own thread (creation is a collective). `optim_json(rank)` is each rank's group document.
class Ranks {
 public:
  Ranks(
      const TempDir& dir, int world,
      const std::function<std::string(int)>& optim_json = [](int) { return R"({"name": "w"})"; },
      const ShardedGroupOptions& options = {}, size_t view_split = kCount,
      Transport transport = Transport::kAllGather)
      : comm_(world), ranks_(static_cast<size_t>(world)), view_split_(view_split) {
    for (int r = 0; r < world; ++r) {
      Rank& rank = ranks_[static_cast<size_t>(r)];
      rank.dir = dir.File("rank" + std::to_string(r));
      std::filesystem::create_directories(rank.dir);
      EngineHooks hooks;
      hooks.optimizer_io_factory = rank.faults.Factory();
      Result<config::EngineConfig> config = config::ParseEngineConfigDocument(RankConfig(rank.dir));
      EXPECT_TRUE(config.ok()) << config.status().ToString();
      Result<std::unique_ptr<Engine>> engine = Engine::Create(*config, std::move(hooks));
      EXPECT_TRUE(engine.ok()) << engine.status().ToString();
      rank.engine = std::move(engine).value();
      rank.collectives =
          std::make_unique<InMemoryCollectives>(comm_, r, transport == Transport::kBroadcast);
      rank.params.resize(kCount);
      for (size_t i = 0; i < kCount; ++i) rank.params[i] = 0.001f * static_cast<float>(i % 101);
    }
    OnEveryRank([&](Rank& rank, int r) {
      const std::vector<ParamView> views = ParamViews(rank);
      Result<std::unique_ptr<ShardedGroup>> group =
          ShardedGroup::Create(*rank.engine, optim_json(r), views, *rank.collectives, options);
      rank.created = group.status();
      if (group.ok()) rank.group = std::move(group).value();
    });
  }

  // Runs `body` on every rank in its own thread and returns the seconds until all finished.
  double OnEveryRank(const std::function<void(Rank&, int)>& body) {
    const Clock::time_point start = Clock::now();
    std::vector<std::thread> threads;
    for (size_t r = 0; r < ranks_.size(); ++r) {
      threads.emplace_back([&, r] { body(ranks_[r], static_cast<int>(r)); });
    }
    for (std::thread& thread : threads) thread.join();
    return std::chrono::duration<double>(Clock::now() - start).count();
  }

  // One sharded step on every rank with gradients `grads(rank)` (kCount elements).
  double Step(const std::function<std::vector<float>(int)>& grads) {
    return OnEveryRank([&](Rank& rank, int r) {
      const std::vector<float> g = grads(r);
      const GradView grad{g.data(), optim::DType::kFloat32, g.size()};
      const std::vector<ParamView> params = ParamViews(rank);
      ShardedStepArgs args;
      args.grads = std::span<const GradView>(&grad, 1);
      args.params = params;
      Result<StepReport> report = rank.group->Step(args);
      rank.stepped = report.status();
    });
  }

  Rank& operator[](int r) { return ranks_[static_cast<size_t>(r)]; }

 private:
  // The rank's parameters as one view, or two split at view_split_.
  std::vector<ParamView> ParamViews(Rank& rank) const {
    std::vector<ParamView> views{{rank.params.data(), optim::DType::kFloat32, view_split_}};
    if (view_split_ < kCount) {
      views.push_back(
          {rank.params.data() + view_split_, optim::DType::kFloat32, kCount - view_split_});
    }
    return views;
  }

  Communicator comm_;
  std::vector<Rank> ranks_;
  size_t view_split_;
};

std::vector<float> Ones(int) { return std::vector<float>(kCount, 0.01f); }

std::vector<float> Master(Rank& rank) {
  std::vector<float> out(rank.group->shard().size());
  EXPECT_TRUE(rank.engine->ReadState(rank.group->group(), StateSlot::kMaster, 0, out).ok());
  return out;
}

TEST(ShardOf, ContiguousUnevenShardsCoverTheGroup) {
  for (const size_t count : {size_t{1}, size_t{7}, size_t{1000}, size_t{3001}}) {
    for (int world = 1; world <= 5; ++world) {
      size_t next = 0;
      for (int r = 0; r < world; ++r) {
        const ShardRange shard = ShardOf(count, r, world);
        EXPECT_EQ(shard.begin, next);
        EXPECT_EQ(shard.begin, static_cast<size_t>(r) * count / static_cast<size_t>(world));
        EXPECT_LE(shard.size(), count / static_cast<size_t>(world) + 1);
        EXPECT_GE(shard.size(), count / static_cast<size_t>(world));
        next = shard.end;
      }
      EXPECT_EQ(next, count);
    }
  }
  // No overflow for counts near the top of size_t.
  const size_t huge = SIZE_MAX - 3;
  EXPECT_EQ(ShardOf(huge, 3, 3).begin, huge);
  EXPECT_EQ(ShardOf(huge, 1, 2).begin, huge / 2);
}

// The gradients' reduce-scatter and the parameters' all-gather in rounds of 64 elements per rank
// (16 rounds for shards of 1000 and 1001 elements, the last one with nothing from two ranks), the
// parameters into two views split mid-shard: every rank's parameters are the shards' master
// weights in rank order, bit for bit the parameters of the same steps (gradients differing by
// rank) in one round.
TEST(ShardedGroupRounds, RoundsGiveTheParametersOfOneRound) {
  TempDir dir;
  auto name = [](int) { return std::string(R"({"name": "w"})"); };
  Ranks rounds(dir, 3, name, ShardedGroupOptions{.round_elements = 64}, /*view_split=*/1500);
  TempDir other;
  Ranks whole(other, 3, name);
  for (int r = 0; r < 3; ++r) ASSERT_TRUE(rounds[r].created.ok()) << rounds[r].created.ToString();
  auto grads = [](int rank) {
    std::vector<float> g(kCount);
    for (size_t i = 0; i < kCount; ++i) g[i] = 0.001f * static_cast<float>((i * 7 + rank) % 13);
    return g;
  };
  for (int step = 0; step < 3; ++step) {
    rounds.Step(grads);
    whole.Step(grads);
    for (int r = 0; r < 3; ++r) {
      ASSERT_TRUE(rounds[r].stepped.ok()) << rounds[r].stepped.ToString();
      ASSERT_TRUE(whole[r].stepped.ok()) << whole[r].stepped.ToString();
    }
  }
  std::vector<float> masters;
  for (int r = 0; r < 3; ++r) {
    const std::vector<float> master = Master(rounds[r]);
    masters.insert(masters.end(), master.begin(), master.end());
  }
  ASSERT_EQ(masters.size(), kCount);
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(rounds[r].params, masters) << "rank " << r;
    EXPECT_EQ(rounds[r].params, whole[r].params) << "rank " << r;
  }
  EXPECT_NE(masters, std::vector<float>(whole[0].params.size(), 0.0f));
}

// Collectives that offer Broadcast: each rank writes its shard into its own part of the views
// and every part is broadcast straight into the peers' views (split mid-shard here). The
// parameters are bit for bit those the all-gather gives, the group's buffer never takes them,
// and the step makes one collective call fewer per round it saves.
TEST(ShardedGroupTransports, BroadcastGivesTheParametersOfTheAllGather) {
  auto name = [](int) { return std::string(R"({"name": "w"})"); };
  const ShardedGroupOptions rounds{.round_elements = 256};
  TempDir one;
  Ranks gathered(one, 3, name, rounds, /*view_split=*/1500, Transport::kAllGather);
  TempDir other;
  Ranks broadcast(other, 3, name, rounds, /*view_split=*/1500, Transport::kBroadcast);
  auto grads = [](int rank) {
    std::vector<float> g(kCount);
    for (size_t i = 0; i < kCount; ++i) g[i] = 0.001f * static_cast<float>((i * 5 + rank) % 11);
    return g;
  };
  for (int step = 0; step < 3; ++step) {
    const uint64_t gathered_calls = gathered[0].collectives->calls();
    const uint64_t broadcast_calls = broadcast[0].collectives->calls();
    gathered.Step(grads);
    broadcast.Step(grads);
    for (int r = 0; r < 3; ++r) {
      ASSERT_TRUE(gathered[r].stepped.ok()) << gathered[r].stepped.ToString();
      ASSERT_TRUE(broadcast[r].stepped.ok()) << broadcast[r].stepped.ToString();
    }
    // Shards of 1000 and 1001 elements: 4 all-gather rounds against one broadcast.
    EXPECT_EQ((gathered[0].collectives->calls() - gathered_calls) -
                  (broadcast[0].collectives->calls() - broadcast_calls),
              3u);
  }
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(broadcast[r].params, gathered[r].params) << "rank " << r;
    EXPECT_EQ(broadcast[r].params, broadcast[0].params) << "rank " << r;
  }
}

TEST(ShardedGroupRounds, ZeroElementsPerRoundIsRefused) {
  TempDir dir;
  Ranks ranks(
      dir, 2, [](int) { return std::string(R"({"name": "w"})"); },
      ShardedGroupOptions{.round_elements = 0});
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(ranks[r].created.code(), StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(ranks[r].created.message()), HasSubstr("round_elements is 0"));
  }
}

int64_t Steps(Rank& rank) {
  Result<int64_t> steps = rank.engine->GroupSteps(rank.group->group());
  EXPECT_TRUE(steps.ok()) << steps.status().ToString();
  return steps.ok() ? *steps : -1;
}

std::vector<std::vector<float>> Masters(Ranks& ranks, int world) {
  std::vector<std::vector<float>> out;
  for (int r = 0; r < world; ++r) out.push_back(Master(ranks[r]));
  return out;
}

// The master shards of `world` ranks after `steps` clean steps of Ones: what a run that never
// failed holds.
std::vector<std::vector<float>> MastersAfterCleanSteps(int world, int steps) {
  TempDir dir;
  Ranks ranks(dir, world);
  for (int step = 0; step < steps; ++step) {
    ranks.Step(Ones);
    for (int r = 0; r < world; ++r) EXPECT_TRUE(ranks[r].stepped.ok());
  }
  return Masters(ranks, world);
}

struct ShardFault {
  const char* name;
  io::FaultKind kind;
  io::FaultOps ops;
  StatusCode code;
};
void PrintTo(const ShardFault& f, std::ostream* os) { *os << f.name; }

class ShardedGroupIoFaults : public ::testing::TestWithParam<ShardFault> {};

// One rank's optimizer I/O fails during a step (a read, a write, no space, a corrupted read):
// that rank reports the fault and keeps its previous state, the others report Aborted naming it,
// all within a third of the collectives' timeout. A rank that had already updated its shard (the
// fault came after the scan's agreement) says so and names the way back: every rank loads the
// checkpoint saved before the step, steps again, and then holds what a run that never failed
// holds.
TEST_P(ShardedGroupIoFaults, OneRankFailingFailsEveryRankAndACheckpointResumesExactly) {
  constexpr int kWorld = 3;
  TempDir dir;
  Ranks ranks(dir, kWorld);
  for (int r = 0; r < kWorld; ++r)
    ASSERT_TRUE(ranks[r].created.ok()) << ranks[r].created.ToString();
  ranks.Step(Ones);
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_TRUE(ranks[r].stepped.ok()) << ranks[r].stepped.ToString();
    ASSERT_TRUE(ranks[r].engine->SaveCheckpoint(dir.File("ckpt" + std::to_string(r))).ok());
  }
  const std::vector<float> failing_before = Master(ranks[1]);
  io::FaultRule rule;
  rule.kind = GetParam().kind;
  rule.ops = GetParam().ops;
  rule.nth = 1;
  rule.max_faults = 1;
  ranks[1].faults.engine->AddRule(rule);

  const double seconds = ranks.Step(Ones);
  EXPECT_LT(seconds, std::chrono::duration<double>(kCollectiveTimeout).count() / 3);
  EXPECT_EQ(ranks[1].faults.engine->injected(), 1u);
  EXPECT_EQ(ranks[1].stepped.code(), GetParam().code) << ranks[1].stepped.ToString();
  EXPECT_THAT(std::string(ranks[1].stepped.message()), HasSubstr("optimizer group 'w' step"));
  EXPECT_EQ(Master(ranks[1]), failing_before);
  for (const int r : {0, 2}) {
    EXPECT_EQ(ranks[r].stepped.code(), StatusCode::kAborted) << ranks[r].stepped.ToString();
    EXPECT_THAT(std::string(ranks[r].stepped.message()), HasSubstr("rank(s) 1 failed"));
    if (Steps(ranks[r]) == 2) {
      EXPECT_THAT(std::string(ranks[r].stepped.message()), HasSubstr("resume from a checkpoint"));
    }
  }

  for (int r = 0; r < kWorld; ++r) {
    ASSERT_TRUE(ranks[r].engine->LoadCheckpoint(dir.File("ckpt" + std::to_string(r))).ok());
  }
  ranks.Step(Ones);
  for (int r = 0; r < kWorld; ++r)
    ASSERT_TRUE(ranks[r].stepped.ok()) << ranks[r].stepped.ToString();
  EXPECT_EQ(Masters(ranks, kWorld), MastersAfterCleanSteps(kWorld, 2));
}

// A collective failing on every rank (the transport's error) at each of a step's collectives in
// turn, within the bound. Before the update (the gradients' reduction and the scan's agreement)
// no rank's state changed and the retried step leaves every rank where a run that never failed
// is. After it (the outcome's agreement, the parameters' gather) every rank's error says its
// shard was updated and to resume from a checkpoint, and every rank took the step.
// One step on every rank, rank r passing the parameter views `views(rank, r)`.
void StepWithViews(Ranks& ranks, const std::function<std::vector<ParamView>(Rank&, int)>& views) {
  ranks.OnEveryRank([&](Rank& rank, int r) {
    const std::vector<float> g = Ones(r);
    const GradView grad{g.data(), optim::DType::kFloat32, g.size()};
    const std::vector<ParamView> params = views(rank, r);
    ShardedStepArgs args;
    args.grads = std::span<const GradView>(&grad, 1);
    args.params = params;
    rank.stepped = rank.group->Step(args).status();
  });
}

// Broadcast moves each rank's part of each view into the same place of the peers' views, so the
// ranks' views must be laid out alike: a rank splitting the same elements into other views
// stops every rank before the update, naming it, and so does a view without memory. Nothing
// changed: the next step with proper views takes every rank where one clean step does.
TEST(ShardedGroupTransports, BroadcastRefusesViewsLaidOutUnlikeRankZerosBeforeTheUpdate) {
  TempDir dir;
  Ranks ranks(
      dir, 2, [](int) { return std::string(R"({"name": "w"})"); }, {}, kCount,
      Transport::kBroadcast);
  const std::vector<std::vector<float>> before = Masters(ranks, 2);
  auto whole = [](Rank& rank, int) {
    return std::vector<ParamView>{{rank.params.data(), optim::DType::kFloat32, kCount}};
  };
  StepWithViews(ranks, [&](Rank& rank, int r) {
    if (r == 0) return whole(rank, r);
    return std::vector<ParamView>{
        {rank.params.data(), optim::DType::kFloat32, 1000},
        {rank.params.data() + 1000, optim::DType::kFloat32, kCount - 1000}};
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(ranks[r].stepped.code(), StatusCode::kInvalidArgument) << ranks[r].stepped.ToString();
    EXPECT_THAT(ranks[r].stepped.ToString(),
                HasSubstr("rank(s) 1 passed parameter views laid out unlike rank 0's"));
  }
  StepWithViews(ranks, [&](Rank& rank, int r) {
    if (r == 0) return whole(rank, r);
    return std::vector<ParamView>{{nullptr, optim::DType::kFloat32, kCount}};
  });
  EXPECT_EQ(ranks[1].stepped.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(ranks[1].stepped.ToString(), HasSubstr("has no data"));
  EXPECT_EQ(ranks[0].stepped.code(), StatusCode::kAborted);
  EXPECT_THAT(ranks[0].stepped.ToString(), HasSubstr("rank(s) 1 failed before the update"));
  EXPECT_EQ(Masters(ranks, 2), before);
  StepWithViews(ranks, whole);
  for (int r = 0; r < 2; ++r) ASSERT_TRUE(ranks[r].stepped.ok()) << ranks[r].stepped.ToString();
  EXPECT_EQ(Masters(ranks, 2), MastersAfterCleanSteps(2, 1));
}

// Views of the rank's shard only (a caller that gathers on its device): each rank's views take
// its own updated values, bit for bit its part of what the whole-group views gather, and the
// step makes no gather call. A rank passing its shard while rank 0 passes the whole group stops
// every rank before the update, naming it.
TEST(ShardedGroupShardOnly, ShardViewsTakeTheRanksUpdatedValuesAndGatherNothing) {
  auto name = [](int) { return std::string(R"({"name": "w"})"); };
  const ShardedGroupOptions rounds{.round_elements = 256};
  TempDir one;
  Ranks gathered(one, 3, name, rounds);
  TempDir other;
  Ranks shards(other, 3, name, rounds);
  std::vector<std::vector<float>> own(3);
  auto shard_views = [&own](Rank& rank, int r) {
    const ShardRange shard = rank.group->shard();
    own[static_cast<size_t>(r)].assign(rank.params.begin() + static_cast<ptrdiff_t>(shard.begin),
                                       rank.params.begin() + static_cast<ptrdiff_t>(shard.end));
    const size_t split = shard.size() / 2;  // two views, split mid-shard
    float* data = own[static_cast<size_t>(r)].data();
    return std::vector<ParamView>{{data, optim::DType::kFloat32, split},
                                  {data + split, optim::DType::kFloat32, shard.size() - split}};
  };
  for (int step = 0; step < 2; ++step) {
    const uint64_t gathered_calls = gathered[0].collectives->calls();
    const uint64_t shard_calls = shards[0].collectives->calls();
    gathered.Step(Ones);
    StepWithViews(shards, shard_views);
    for (int r = 0; r < 3; ++r) {
      ASSERT_TRUE(gathered[r].stepped.ok()) << gathered[r].stepped.ToString();
      ASSERT_TRUE(shards[r].stepped.ok()) << shards[r].stepped.ToString();
    }
    // The gathered step's reduce-scatter and all-gather each take 4 rounds; the other has no
    // all-gather, and its gradients come as one whole-group view like the first's.
    EXPECT_EQ((gathered[0].collectives->calls() - gathered_calls) -
                  (shards[0].collectives->calls() - shard_calls),
              4u);
  }
  for (int r = 0; r < 3; ++r) {
    const ShardRange shard = gathered[r].group->shard();
    const std::vector<float> part(gathered[0].params.begin() + static_cast<ptrdiff_t>(shard.begin),
                                  gathered[0].params.begin() + static_cast<ptrdiff_t>(shard.end));
    EXPECT_EQ(own[static_cast<size_t>(r)], part) << "rank " << r;
    EXPECT_EQ(own[static_cast<size_t>(r)], Master(shards[r])) << "rank " << r;
  }
  const std::vector<std::vector<float>> before = Masters(shards, 3);
  StepWithViews(shards, [&](Rank& rank, int r) {
    if (r != 1) return std::vector<ParamView>{{rank.params.data(), optim::DType::kFloat32, kCount}};
    return shard_views(rank, r);
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(shards[r].stepped.code(), StatusCode::kInvalidArgument)
        << shards[r].stepped.ToString();
    EXPECT_THAT(shards[r].stepped.ToString(),
                HasSubstr("rank(s) 1 passed parameter views laid out unlike rank 0's"));
  }
  EXPECT_EQ(Masters(shards, 3), before);
}

class ShardedGroupCollectiveFailures : public ::testing::TestWithParam<Transport> {};

TEST_P(ShardedGroupCollectiveFailures,
       ACollectiveFailingAtAnyPointOfTheStepIsReportedAsWhatItLeft) {
  constexpr int kWorld = 2;
  auto name = [](int) { return std::string(R"({"name": "w"})"); };
  uint64_t per_step = 0;
  {
    TempDir dir;
    Ranks ranks(dir, kWorld, name, {}, kCount, GetParam());
    const uint64_t at_start = ranks[0].collectives->calls();
    ranks.Step(Ones);
    per_step = ranks[0].collectives->calls() - at_start;
  }
  ASSERT_GT(per_step, 0u);
  const std::vector<std::vector<float>> clean = MastersAfterCleanSteps(kWorld, 2);
  int before_update = 0;
  int after_update = 0;
  for (uint64_t k = 1; k <= per_step; ++k) {
    SCOPED_TRACE("collective " + std::to_string(k) + " of " + std::to_string(per_step));
    TempDir dir;
    Ranks ranks(dir, kWorld, name, {}, kCount, GetParam());
    ranks.Step(Ones);
    const std::vector<std::vector<float>> before = Masters(ranks, kWorld);
    for (int r = 0; r < kWorld; ++r) {
      ranks[r].collectives->FailCall(ranks[r].collectives->calls() + k);
    }
    const double seconds = ranks.Step(Ones);
    EXPECT_LT(seconds, std::chrono::duration<double>(kCollectiveTimeout).count() / 3);
    for (int r = 0; r < kWorld; ++r) {
      EXPECT_EQ(ranks[r].stepped.code(), StatusCode::kAborted) << ranks[r].stepped.ToString();
      EXPECT_THAT(ranks[r].stepped.ToString(), HasSubstr("injected failure"));
    }
    if (Steps(ranks[0]) == 1) {
      ++before_update;
      EXPECT_EQ(Steps(ranks[1]), 1);
      EXPECT_EQ(Masters(ranks, kWorld), before);
      ranks.Step(Ones);
      for (int r = 0; r < kWorld; ++r) ASSERT_TRUE(ranks[r].stepped.ok());
      EXPECT_EQ(Masters(ranks, kWorld), clean);
    } else {
      ++after_update;
      for (int r = 0; r < kWorld; ++r) {
        EXPECT_EQ(Steps(ranks[r]), 2);
        EXPECT_THAT(ranks[r].stepped.ToString(), HasSubstr("resume from a checkpoint"));
      }
      EXPECT_EQ(Masters(ranks, kWorld), clean);
    }
  }
  EXPECT_GT(before_update, 0);
  EXPECT_GT(after_update, 0);
}

INSTANTIATE_TEST_SUITE_P(Transports, ShardedGroupCollectiveFailures,
                         ::testing::Values(Transport::kAllGather, Transport::kBroadcast),
                         [](const auto& param_info) {
                           return std::string(param_info.param == Transport::kBroadcast
                                                  ? "broadcast"
                                                  : "all_gather");
                         });

INSTANTIATE_TEST_SUITE_P(Faults, ShardedGroupIoFaults,
                         ::testing::Values(ShardFault{"eio_write", io::FaultKind::kEio,
                                                      io::FaultOps::kWrites, StatusCode::kIoError},
                                           ShardFault{"eio_read", io::FaultKind::kEio,
                                                      io::FaultOps::kReads, StatusCode::kIoError},
                                           ShardFault{"enospc_write", io::FaultKind::kEnospc,
                                                      io::FaultOps::kWrites, StatusCode::kNoSpace},
                                           ShardFault{"corrupted_read", io::FaultKind::kCorruption,
                                                      io::FaultOps::kReads,
                                                      StatusCode::kCorruption}),
                         [](const auto& param_info) { return std::string(param_info.param.name); });

TEST(ShardedGroupFailures, BadGradientsOnOneRankStopEveryRankBeforeTheUpdate) {
  TempDir dir;
  Ranks ranks(dir, 2);
  for (int r = 0; r < 2; ++r) ASSERT_TRUE(ranks[r].created.ok()) << ranks[r].created.ToString();
  const std::vector<float> before0 = Master(ranks[0]);
  const std::vector<float> before1 = Master(ranks[1]);
  const double seconds = ranks.Step([](int r) {
    return std::vector<float>(r == 1 ? kCount - 1 : kCount, 0.01f);  // rank 1 is one short
  });
  EXPECT_LT(seconds, std::chrono::duration<double>(kCollectiveTimeout).count() / 3);
  EXPECT_EQ(ranks[1].stepped.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(ranks[1].stepped.message()),
              HasSubstr("cover 3000 elements; allowed: exactly the group's 3001"));
  EXPECT_EQ(ranks[0].stepped.code(), StatusCode::kAborted);
  EXPECT_THAT(std::string(ranks[0].stepped.message()),
              HasSubstr("rank(s) 1 gave gradients that cannot be used; no rank changed its state"));
  EXPECT_EQ(Master(ranks[0]), before0);
  EXPECT_EQ(Master(ranks[1]), before1);
}

// A gradient that passes the agreed checks but cannot be widened (int8 is no gradient type) on
// rank 1, with the reduce-scatter in rounds: rank 1 still makes every round's collective, then
// fails the scan's agreement, so every rank stops before its update within the bound.
TEST(ShardedGroupFailures, AGradientThatCannotBeWidenedStopsEveryRankBeforeTheUpdate) {
  TempDir dir;
  Ranks ranks(
      dir, 3, [](int) { return std::string(R"({"name": "w"})"); },
      ShardedGroupOptions{.round_elements = 100});
  std::vector<std::vector<float>> before;
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(ranks[r].created.ok()) << ranks[r].created.ToString();
    before.push_back(Master(ranks[r]));
  }
  const double seconds = ranks.OnEveryRank([](Rank& rank, int r) {
    const std::vector<float> g(kCount, 0.01f);
    const GradView grad{g.data(), r == 1 ? optim::DType::kInt8 : optim::DType::kFloat32, kCount};
    ShardedStepArgs args;
    args.grads = std::span<const GradView>(&grad, 1);
    rank.stepped = rank.group->Step(args).status();
  });
  EXPECT_LT(seconds, std::chrono::duration<double>(kCollectiveTimeout).count() / 3);
  EXPECT_EQ(ranks[1].stepped.code(), StatusCode::kInvalidArgument) << ranks[1].stepped.ToString();
  EXPECT_THAT(std::string(ranks[1].stepped.message()), HasSubstr("cast source dtype = int8"));
  for (const int r : {0, 2}) {
    EXPECT_EQ(ranks[r].stepped.code(), StatusCode::kAborted) << ranks[r].stepped.ToString();
    EXPECT_THAT(std::string(ranks[r].stepped.message()),
                HasSubstr("rank(s) 1 failed before the update; no rank changed its state"));
  }
  for (int r = 0; r < 3; ++r) EXPECT_EQ(Master(ranks[r]), before[r]) << "rank " << r;
}

TEST(ShardedGroupFailures, BadParameterViewsOnOneRankStopEveryRankBeforeTheUpdate) {
  TempDir dir;
  Ranks ranks(dir, 2);
  for (int r = 0; r < 2; ++r) ASSERT_TRUE(ranks[r].created.ok()) << ranks[r].created.ToString();
  const std::vector<float> before0 = Master(ranks[0]);
  ranks.OnEveryRank([](Rank& rank, int r) {
    const std::vector<float> g(kCount, 0.01f);
    const GradView grad{g.data(), optim::DType::kFloat32, g.size()};
    const ParamView param{rank.params.data(), optim::DType::kFloat32, r == 0 ? kCount - 5 : kCount};
    ShardedStepArgs args;
    args.grads = std::span<const GradView>(&grad, 1);
    args.params = std::span<const ParamView>(&param, 1);
    rank.stepped = rank.group->Step(args).status();
  });
  EXPECT_EQ(ranks[0].stepped.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ranks[1].stepped.code(), StatusCode::kAborted);
  EXPECT_THAT(std::string(ranks[1].stepped.message()),
              HasSubstr("rank(s) 0 failed before the update; no rank changed its state"));
  EXPECT_EQ(Master(ranks[0]), before0);
}

TEST(ShardedGroupFailures, CreationFailingOnOneRankFailsEveryRank) {
  TempDir dir;
  Ranks ranks(dir, 3, [](int r) {
    return r == 2 ? std::string(R"({"name": "w", "lr": -1})") : std::string(R"({"name": "w"})");
  });
  EXPECT_EQ(ranks[2].created.code(), StatusCode::kInvalidArgument) << ranks[2].created.ToString();
  for (const int r : {0, 1}) {
    EXPECT_EQ(ranks[r].created.code(), StatusCode::kAborted) << ranks[r].created.ToString();
    EXPECT_THAT(std::string(ranks[r].created.message()), HasSubstr("creation failed on rank(s) 2"));
  }
}

TEST(ShardedGroupFailures, MoreRanksThanElementsIsRefusedOnEveryRank) {
  TempDir dir;
  Ranks ranks(dir, 2);
  ASSERT_TRUE(ranks[0].created.ok());
  Communicator comm(3);
  std::vector<Status> created(3);
  std::vector<std::thread> threads;
  std::vector<std::unique_ptr<InMemoryCollectives>> collectives;
  for (int r = 0; r < 3; ++r)
    collectives.push_back(std::make_unique<InMemoryCollectives>(comm, r, false));
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] {
      float params[2] = {1.0f, 2.0f};
      const ParamView view{params, optim::DType::kFloat32, 2};
      created[static_cast<size_t>(r)] =
          ShardedGroup::Create(
              *ranks[r == 2 ? 1 : r].engine, R"({"name": "tiny)" + std::to_string(r) + "\"}",
              std::span<const ParamView>(&view, 1), *collectives[static_cast<size_t>(r)])
              .status();
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(created[0].code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(
      std::string(created[0].message()),
      HasSubstr("2 elements leave rank 0 of 3 none; allowed: at least one element per rank"));
  EXPECT_EQ(created[1].code(), StatusCode::kAborted);
}

}  // namespace
}  // namespace zoe::offload
