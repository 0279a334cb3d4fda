// Description: TierManager prefetch into DEVICE — trace replay of device acquires copies the next
// runs to the device ahead of time (prefetch hits), budgets hold at every step, data stays intact
// under tight budgets, failed device prefetches fail only the acquire of their own run, the
// DEVICE prefetch hint, the LRU eviction mode of a replayed trace, and each device-copy wait
// left out in turn failing the reads.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/host_device.h"
#include "offload/paging/tier_manager.h"
#include "tests/offload/temp_dir.h"

namespace zoe::offload {
namespace {

using testing::TempDir;

constexpr uint64_t kChunk = 64 << 10;
// The device tests run on the stand-in as it is and in its adversarial mode (copies late,
// destinations poison until their event), where a missing wait in the tier manager fails them.
constexpr std::chrono::microseconds kAdversarialDelay{200};
std::string AdversarialName(const ::testing::TestParamInfo<bool>& info) {
  return info.param ? "adversarial" : "plain";
}

std::vector<std::byte> Pattern(uint64_t bytes, uint64_t seed) {
  std::vector<std::byte> out(bytes);
  std::mt19937_64 random(seed);
  for (std::byte& b : out) b = static_cast<std::byte>(random());
  return out;
}

size_t Index(Link link) { return static_cast<size_t>(link); }

// `layers` tensors holding known patterns (one chunk each, layer 1 layer1_chunks_), written down
// to NVMe and evicted, under a manager with a device stand-in that fails the next fail_copies_
// copies to the device of fail_copy_bytes_ bytes.
class DevicePrefetchTest : public ::testing::TestWithParam<bool> {
 protected:
  std::unique_ptr<TierManager> Make(uint64_t host_chunks, uint64_t device_chunks, int layers,
                                    EvictionKind eviction = EvictionKind::kOpt,
                                    uint32_t prefetch_in_flight = 2) {
    TierManagerOptions options;
    options.host_budget_bytes = host_chunks * kChunk;
    options.device_budget_bytes = device_chunks * kChunk;
    options.layout.chunk_bytes = kChunk;
    options.nvme_paths = {dir_.File("")};
    options.nvme_capacity_bytes = 64 * kChunk;
    options.io_backend = io::BackendKind::kPsync;
    options.queue_depth = 8;
    options.busy_timeout = std::chrono::seconds(30);
    options.lookahead_bytes = 2 * kChunk;
    options.prefetch_in_flight = prefetch_in_flight;
    options.eviction = eviction;
    options.skipped_device_waits_for_testing = skipped_waits_;
    options.device_factory = [this, device_chunks]() -> Result<std::unique_ptr<DeviceBackend>> {
      HostStandInOptions device;
      device.capacity_bytes = device_chunks * kChunk;
      if (GetParam()) device.adversarial_delay = adversarial_delay_;
      device.before_copy = [this](CopyKind kind, uint64_t bytes) {
        if (kind == CopyKind::kHostToDevice && bytes == fail_copy_bytes_.load() &&
            fail_copies_.fetch_sub(1) > 0) {
          return Status::IoError("injected device copy failure");
        }
        return Status::Ok();
      };
      ZOE_ASSIGN_OR_RETURN(std::unique_ptr<HostStandInDevice> backend,
                           HostStandInDevice::Create(std::move(device)));
      return std::unique_ptr<DeviceBackend>(std::move(backend));
    };
    Result<std::unique_ptr<TierManager>> made = TierManager::Create(std::move(options));
    EXPECT_TRUE(made.ok()) << made.status().ToString();
    if (!made.ok()) return nullptr;
    std::unique_ptr<TierManager> manager = std::move(made).value();
    ids_.clear();
    for (int i = 0; i < layers; ++i) {
      TensorDesc desc{"layer" + std::to_string(i), LayerBytes(i), DType::kUInt8, Tier::kHost, ""};
      Result<TensorId> id = manager->RegisterTensor(desc);
      EXPECT_TRUE(id.ok()) << id.status().ToString();
      ids_.push_back(*id);
      Result<void*> data = manager->Acquire(*id, Tier::kHost, Access::kWrite);
      EXPECT_TRUE(data.ok()) << data.status().ToString();
      if (data.ok()) std::memcpy(*data, Pattern(LayerBytes(i), i + 1).data(), LayerBytes(i));
      EXPECT_TRUE(manager->Release(*id).ok());
      EXPECT_TRUE(manager->Evict(*id).ok());
    }
    return manager;
  }

  // Acquires layer i on DEVICE, checks its bytes and the budgets, and releases it.
  void UseOnDevice(TierManager& manager, int i) {
    Result<void*> data = manager.Acquire(ids_[i], Tier::kDevice, Access::kRead);
    ASSERT_TRUE(data.ok()) << data.status().ToString();
    EXPECT_EQ(std::memcmp(*data, Pattern(LayerBytes(i), i + 1).data(), LayerBytes(i)), 0)
        << "layer " << i;
    CheckBudgets(manager);
    ASSERT_TRUE(manager.Release(ids_[i]).ok());
  }

  uint64_t LayerBytes(int i) const { return i == 1 ? layer1_chunks_ * kChunk : kChunk; }

  // One iteration: every layer forward, then (unless forward_only) backward, on DEVICE.
  void Iterate(TierManager& manager, bool forward_only = false) {
    ASSERT_TRUE(manager.TraceBegin("step").ok());
    for (int i = 0; i < static_cast<int>(ids_.size()); ++i) UseOnDevice(manager, i);
    if (!forward_only)
      for (int i = static_cast<int>(ids_.size()) - 1; i >= 0; --i) UseOnDevice(manager, i);
    ASSERT_TRUE(manager.TraceEnd().ok());
  }

  static void CheckBudgets(const TierManager& manager) {
    ASSERT_LE(manager.host_reserved_bytes(), manager.host_budget_bytes());
    ASSERT_LE(manager.device_reserved_bytes(), manager.device_budget_bytes());
    const StatsSnapshot stats = manager.stats().Snapshot();
    ASSERT_LE(stats.tiers[static_cast<size_t>(Tier::kHost)].peak_occupancy_bytes,
              manager.host_budget_bytes());
    ASSERT_LE(stats.tiers[static_cast<size_t>(Tier::kDevice)].peak_occupancy_bytes,
              manager.device_budget_bytes());
  }

  struct Counts {
    uint64_t hits, misses, issued, copies;
  };
  static Counts Snapshot(const TierManager& manager) {
    const StatsSnapshot s = manager.stats().Snapshot();
    return {s.prefetch_hits, s.prefetch_misses, s.prefetches_issued,
            s.links[Index(Link::kHostToDevice)].transfers};
  }
  static Counts Delta(const Counts& after, const Counts& before) {
    return {after.hits - before.hits, after.misses - before.misses, after.issued - before.issued,
            after.copies - before.copies};
  }

  TempDir dir_;
  uint8_t skipped_waits_ = 0;  // DeviceWait bits left out
  std::chrono::microseconds adversarial_delay_ = kAdversarialDelay;
  std::atomic<int> fail_copies_{0};
  std::atomic<uint64_t> fail_copy_bytes_{0};
  uint64_t layer1_chunks_ = 1;
  std::vector<TensorId> ids_;
};

// HOST holds every layer after the first iteration, so what replay gains is the device copies:
// each one is started an acquire ahead and every device acquire of a replayed iteration finds its
// copy done or in flight.
TEST_P(DevicePrefetchTest, ReplayOfDeviceAcquiresGivesDevicePrefetchHits) {
  auto manager = Make(/*host_chunks=*/6, /*device_chunks=*/2, /*layers=*/4);
  ASSERT_NE(manager, nullptr);
  Counts before = Snapshot(*manager);
  Iterate(*manager);  // records
  const Counts recorded = Delta(Snapshot(*manager), before);
  EXPECT_EQ(recorded.issued, 0u);
  EXPECT_GE(recorded.misses, 4u);
  Iterate(*manager);  // the first replay ends by prefetching the next iteration's first layer
  before = Snapshot(*manager);
  Iterate(*manager);
  const Counts replay = Delta(Snapshot(*manager), before);
  EXPECT_EQ(replay.misses, 0u);
  EXPECT_EQ(replay.hits, 8u);
  EXPECT_GE(replay.issued, 1u);
  EXPECT_EQ(replay.copies, replay.issued) << "every device copy was a prefetch";
  EXPECT_EQ(manager->stats().Snapshot().links[Index(Link::kNvmeToHost)].transfers, 4u)
      << "HOST kept every layer after the first read";
}

// HOST cannot hold every layer: runs come from NVMe each iteration, HOST and DEVICE prefetches
// interleave, and the contents and both budgets hold at every acquire.
TEST_P(DevicePrefetchTest, TightBudgetsKeepDataAndBudgets) {
  auto manager = Make(/*host_chunks=*/4, /*device_chunks=*/2, /*layers=*/8);
  ASSERT_NE(manager, nullptr);
  for (int iteration = 0; iteration < 4; ++iteration) Iterate(*manager);
  const StatsSnapshot stats = manager->stats().Snapshot();
  EXPECT_GT(stats.prefetches_issued, 0u);
  EXPECT_GT(stats.links[Index(Link::kNvmeToHost)].transfers, 8u);
}

// Forward-only iterations over layers of 1, 2, 1 and 1 chunks with room on the device for three
// chunks: in steady state, acquiring layer 0 starts the copy of layer 1 (the only two-chunk copy,
// which is the one made to fail).
class FailedDevicePrefetchTest : public DevicePrefetchTest {
 protected:
  std::unique_ptr<TierManager> MakeSteady() {
    layer1_chunks_ = 2;
    auto manager = Make(/*host_chunks=*/8, /*device_chunks=*/3, /*layers=*/4);
    if (manager == nullptr) return nullptr;
    Iterate(*manager, /*forward_only=*/true);  // records
    Iterate(*manager, /*forward_only=*/true);
    fail_copy_bytes_ = 2 * kChunk;
    fail_copies_ = 1;
    EXPECT_TRUE(manager->TraceBegin("step").ok());
    return manager;
  }
};

// The failed prefetch of layer 1 leaves it absent on the device: acquires of other layers
// meanwhile succeed (one of them collects the failed copy), the next acquire of layer 1 reports
// the failure naming the tensor, and the one after copies it again.
TEST_P(FailedDevicePrefetchTest, OtherAcquiresSucceedAndTheFailureReachesItsRun) {
  auto manager = MakeSteady();
  ASSERT_NE(manager, nullptr);
  UseOnDevice(*manager, 0);  // starts layer 1's copy, which fails
  UseOnDevice(*manager, 2);  // skips layer 1
  UseOnDevice(*manager, 3);
  EXPECT_EQ(fail_copies_.load(), 0) << "the injected failure was used";
  Result<void*> failed = manager->Acquire(ids_[1], Tier::kDevice, Access::kRead);
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), StatusCode::kIoError);
  EXPECT_NE(failed.status().message().find("'layer1'"), std::string_view::npos)
      << failed.status().ToString();
  UseOnDevice(*manager, 1);  // a demand copy this time
  ASSERT_TRUE(manager->TraceEnd().ok());
}

// The acquire of the run whose prefetch failed reports it, naming the tensor; the next acquire of
// it copies it again, and other layers are unaffected.
TEST_P(FailedDevicePrefetchTest, SurfacesFromTheAcquireOfItsRunOnly) {
  auto manager = MakeSteady();
  ASSERT_NE(manager, nullptr);
  UseOnDevice(*manager, 0);
  Result<void*> failed = manager->Acquire(ids_[1], Tier::kDevice, Access::kRead);
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), StatusCode::kIoError);
  EXPECT_NE(failed.status().message().find("'layer1'"), std::string_view::npos)
      << failed.status().ToString();
  UseOnDevice(*manager, 1);
  UseOnDevice(*manager, 2);
  UseOnDevice(*manager, 3);
  ASSERT_TRUE(manager->TraceEnd().ok());
}

TEST_P(DevicePrefetchTest, DeviceHintCopiesAResidentOrLoadingRun) {
  auto manager = Make(/*host_chunks=*/4, /*device_chunks=*/2, /*layers=*/3);
  ASSERT_NE(manager, nullptr);
  // Layer 0 resident on HOST: the copy starts at once.
  Result<void*> on_host = manager->Acquire(ids_[0], Tier::kHost, Access::kRead);
  ASSERT_TRUE(on_host.ok());
  ASSERT_TRUE(manager->Release(ids_[0]).ok());
  ASSERT_TRUE(manager->Prefetch(ids_[0], Tier::kDevice).ok());
  EXPECT_EQ(manager->device_reserved_bytes(), kChunk);
  // Layer 1 on NVMe only: read first, copied once the read is applied.
  ASSERT_TRUE(manager->Prefetch(ids_[1], Tier::kDevice).ok());
  const Counts before = Snapshot(*manager);
  UseOnDevice(*manager, 0);
  UseOnDevice(*manager, 1);
  const Counts used = Delta(Snapshot(*manager), before);
  EXPECT_EQ(used.hits, 2u);
  EXPECT_EQ(used.misses, 0u);
  EXPECT_EQ(manager->stats().Snapshot().links[Index(Link::kHostToDevice)].transfers, 2u);
}

TEST_P(DevicePrefetchTest, DeviceHintWithoutRoomEvictsNothing) {
  auto manager = Make(/*host_chunks=*/4, /*device_chunks=*/2, /*layers=*/3);
  ASSERT_NE(manager, nullptr);
  Result<void*> a = manager->Acquire(ids_[0], Tier::kDevice, Access::kRead);
  Result<void*> b = manager->Acquire(ids_[1], Tier::kDevice, Access::kRead);
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE(manager->Prefetch(ids_[2], Tier::kDevice).ok());  // read into HOST only
  UseOnDevice(*manager, 0);                                     // still resident
  ASSERT_TRUE(manager->Release(ids_[0]).ok());
  ASSERT_TRUE(manager->Release(ids_[1]).ok());
  EXPECT_EQ(manager->stats().Snapshot().links[Index(Link::kHostToDevice)].transfers, 2u);
  EXPECT_EQ(manager->stats().Snapshot().tiers[static_cast<size_t>(Tier::kDevice)].evictions_clean,
            0u);
  EXPECT_EQ(manager->Prefetch(TensorId(99), Tier::kDevice).code(), StatusCode::kNotFound);
}

TEST(DevicePrefetchHint, WithoutADeviceTierDoesNothing) {
  TempDir dir;
  TierManagerOptions options;
  options.host_budget_bytes = 2 * kChunk;
  options.layout.chunk_bytes = kChunk;
  options.nvme_paths = {dir.File("")};
  options.nvme_capacity_bytes = 4 * kChunk;
  options.io_backend = io::BackendKind::kPsync;
  Result<std::unique_ptr<TierManager>> manager = TierManager::Create(options);
  ASSERT_TRUE(manager.ok()) << manager.status().ToString();
  Result<TensorId> id = (*manager)->RegisterTensor({"w", kChunk, DType::kUInt8, Tier::kHost, ""});
  ASSERT_TRUE(id.ok());
  EXPECT_TRUE((*manager)->Prefetch(*id, Tier::kDevice).ok());
  EXPECT_EQ((*manager)->host_reserved_bytes(), 0u);
  EXPECT_EQ((*manager)->stats().Snapshot().prefetches_issued, 0u);
}

// The eviction mode of a replayed trace, with demand loads only (no prefetch): a cycle of four
// layers over HOST room for two reads three layers per iteration with OPT, all four with LRU.
TEST_P(DevicePrefetchTest, LruModeEvictsByRecencyWhileReplaying) {
  for (EvictionKind mode : {EvictionKind::kOpt, EvictionKind::kLru}) {
    auto manager = Make(/*host_chunks=*/2, /*device_chunks=*/2, /*layers=*/4, mode,
                        /*prefetch_in_flight=*/0);
    ASSERT_NE(manager, nullptr);
    std::vector<uint64_t> reads;
    for (int iteration = 0; iteration < 3; ++iteration) {
      const uint64_t before = manager->stats().Snapshot().links[Index(Link::kNvmeToHost)].bytes;
      ASSERT_TRUE(manager->TraceBegin("cycle").ok());
      for (int i = 0; i < 4; ++i) {
        Result<void*> data = manager->Acquire(ids_[i], Tier::kHost, Access::kRead);
        ASSERT_TRUE(data.ok()) << data.status().ToString();
        EXPECT_EQ(std::memcmp(*data, Pattern(kChunk, i + 1).data(), kChunk), 0);
        ASSERT_TRUE(manager->Release(ids_[i]).ok());
      }
      ASSERT_TRUE(manager->TraceEnd().ok());
      reads.push_back((manager->stats().Snapshot().links[Index(Link::kNvmeToHost)].bytes - before) /
                      kChunk);
    }
    const uint64_t expected = mode == EvictionKind::kOpt ? 3 : 4;
    EXPECT_EQ(reads, (std::vector<uint64_t>{4, expected, expected}))
        << (mode == EvictionKind::kOpt ? "opt" : "lru");
  }
}

// Each device-copy wait of the tier manager left out in turn (a test-only switch), with the
// adversarial stand-in: an acquire then finds poison on the device, so the device tests fail
// without that wait. The copies take 20 ms, far longer than the code between a copy's start and
// the read, so the result does not depend on timing. With every wait in place the same
// iterations read the right bytes.
class DeviceWaitMutationTest : public DevicePrefetchTest {
 protected:
  // Record, then replay twice; the device acquires whose bytes were wrong.
  int WrongAcquires(uint8_t skipped) {
    skipped_waits_ = skipped;
    adversarial_delay_ = std::chrono::milliseconds(20);
    // Room on the device for two prefetches beside the acquired layer: the second is found
    // finished (or, without the wait, taken as finished) while the first is acquired.
    auto manager = Make(/*host_chunks=*/10, /*device_chunks=*/4, /*layers=*/8, EvictionKind::kOpt,
                        /*prefetch_in_flight=*/2);
    EXPECT_NE(manager, nullptr);
    if (manager == nullptr) return -1;
    int wrong = 0;
    for (int iteration = 0; iteration < 3; ++iteration) {
      EXPECT_TRUE(manager->TraceBegin("step").ok());
      for (int k = 0; k < 16; ++k) {
        const int i = k < 8 ? k : 15 - k;
        Result<void*> data = manager->Acquire(ids_[i], Tier::kDevice, Access::kRead);
        EXPECT_TRUE(data.ok()) << data.status().ToString();
        if (!data.ok()) return -1;
        wrong += std::memcmp(*data, Pattern(LayerBytes(i), i + 1).data(), LayerBytes(i)) != 0;
        EXPECT_TRUE(manager->Release(ids_[i]).ok());
      }
      EXPECT_TRUE(manager->TraceEnd().ok());
    }
    return wrong;
  }
};

TEST_P(DeviceWaitMutationTest, EachWaitLeftOutMakesADeviceAcquireReadPoison) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "the mutated runs read copies' destinations without waiting, on purpose";
#endif
  EXPECT_EQ(WrongAcquires(0), 0);
  for (const DeviceWait wait : {DeviceWait::kDemandCopy, DeviceWait::kPrefetchCopy}) {
    SCOPED_TRACE("without wait " + std::to_string(static_cast<int>(wait)));
    EXPECT_GT(WrongAcquires(static_cast<uint8_t>(wait)), 0);
  }
}

INSTANTIATE_TEST_SUITE_P(StandIn, DevicePrefetchTest, ::testing::Bool(), AdversarialName);
INSTANTIATE_TEST_SUITE_P(StandIn, DeviceWaitMutationTest, ::testing::Values(true), AdversarialName);
INSTANTIATE_TEST_SUITE_P(StandIn, FailedDevicePrefetchTest, ::testing::Bool(), AdversarialName);

}  // namespace
}  // namespace zoe::offload
