// Description: TierManager — registration limits, acquire/release/flush/evict between HOST and
// NVMe, data integrity under tight budgets on every I/O backend, back-pressure and Busy, prefetch,
// injected I/O faults, and concurrent acquirers.
#include "offload/paging/tier_manager.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <random>
#include <thread>
#include <tuple>
#include <vector>

#include "core/host_device.h"
#include "io/fault_injection.h"
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

TierManagerOptions SmallOptions(const TempDir& dir, uint64_t host_chunks) {
  TierManagerOptions options;
  options.host_budget_bytes = host_chunks * kChunk;
  options.layout.chunk_bytes = kChunk;
  options.nvme_paths = {dir.File("")};
  options.nvme_capacity_bytes = 64 * kChunk;
  options.io_backend = io::BackendKind::kPsync;
  options.queue_depth = 8;
  options.busy_timeout = std::chrono::seconds(30);
  return options;
}

std::unique_ptr<TierManager> MakeManager(TierManagerOptions options) {
  Result<std::unique_ptr<TierManager>> manager = TierManager::Create(std::move(options));
  EXPECT_TRUE(manager.ok()) << manager.status().ToString();
  return manager.ok() ? std::move(manager).value() : nullptr;
}

TensorId Register(TierManager& manager, const std::string& name, uint64_t bytes,
                  const std::string& group = "") {
  TensorDesc desc;
  desc.name = name;
  desc.bytes = bytes;
  desc.dtype = DType::kUInt8;
  desc.group = group;
  Result<TensorId> id = manager.RegisterTensor(desc);
  EXPECT_TRUE(id.ok()) << id.status().ToString();
  return id.ok() ? *id : TensorId();
}

std::byte* AcquireOk(TierManager& manager, TensorId id, Access access) {
  Result<void*> ptr = manager.Acquire(id, Tier::kHost, access);
  EXPECT_TRUE(ptr.ok()) << ptr.status().ToString();
  return ptr.ok() ? static_cast<std::byte*>(*ptr) : nullptr;
}

std::vector<std::byte> Pattern(uint64_t bytes, uint64_t seed) {
  std::vector<std::byte> out(bytes);
  std::mt19937_64 random(seed);
  for (std::byte& b : out) b = static_cast<std::byte>(random());
  return out;
}

bool IsZero(const std::byte* data, uint64_t bytes) {
  return std::all_of(data, data + bytes, [](std::byte b) { return b == std::byte{0}; });
}

// Writes `contents` into the tensor and releases it.
void Store(TierManager& manager, TensorId id, const std::vector<std::byte>& contents) {
  std::byte* data = AcquireOk(manager, id, Access::kWrite);
  ASSERT_NE(data, nullptr);
  std::memcpy(data, contents.data(), contents.size());
  ASSERT_TRUE(manager.Release(id).ok());
}

void ExpectContents(TierManager& manager, TensorId id, const std::vector<std::byte>& contents) {
  std::byte* data = AcquireOk(manager, id, Access::kRead);
  ASSERT_NE(data, nullptr);
  EXPECT_EQ(std::memcmp(data, contents.data(), contents.size()), 0);
  ASSERT_TRUE(manager.Release(id).ok());
}

TEST(TierManagerTest, RejectsOptionsWithoutSwapOrBudget) {
  TempDir dir;
  TierManagerOptions options = SmallOptions(dir, 4);
  options.nvme_paths.clear();
  EXPECT_EQ(TierManager::Create(options).status().code(), StatusCode::kInvalidArgument);
  options = SmallOptions(dir, 4);
  options.host_budget_bytes = 0;
  EXPECT_EQ(TierManager::Create(options).status().code(), StatusCode::kInvalidArgument);
  options = SmallOptions(dir, 4);
  options.checksum_block = 1000;
  EXPECT_EQ(TierManager::Create(options).status().code(), StatusCode::kInvalidArgument);
}

TEST(TierManagerTest, AGrowableSwapSpaceGrowsForRegistrationsAndKeepsWhatWasWritten) {
  TempDir dir;
  TierManagerOptions options = SmallOptions(dir, 4);
  options.nvme_capacity_bytes = 2 * kChunk;
  options.nvme_growth_bytes = 2 * kChunk;
  auto manager = MakeManager(options);
  ASSERT_NE(manager, nullptr);
  const TensorId first = Register(*manager, "first", 2 * kChunk);
  const std::vector<std::byte> contents = Pattern(2 * kChunk, 1);
  Store(*manager, first, contents);
  ASSERT_TRUE(manager->Evict(first).ok());
  // Five more chunks than the space held: three growths, one of them by more than the step.
  const TensorId second = Register(*manager, "second", kChunk);
  const TensorId third = Register(*manager, "third", 4 * kChunk);
  ASSERT_NE(second, TensorId());
  ASSERT_NE(third, TensorId());
  const std::vector<std::byte> more = Pattern(4 * kChunk, 2);
  Store(*manager, third, more);
  ASSERT_TRUE(manager->Evict(third).ok());
  ExpectContents(*manager, first, contents);
  ExpectContents(*manager, third, more);
}

TEST(TierManagerTest, AFixedSwapSpaceRefusesARegistrationNamingTheSettingAndASizeThatFits) {
  TempDir dir;
  TierManagerOptions options = SmallOptions(dir, 4);
  options.nvme_capacity_bytes = 2 * kChunk;
  options.nvme_capacity_key = "zoe.tensor_swap_bytes";
  auto manager = MakeManager(options);
  ASSERT_NE(manager, nullptr);
  Register(*manager, "first", kChunk);
  TensorDesc desc{"big", 3 * kChunk, DType::kUInt8, Tier::kHost, ""};
  Result<TensorId> refused = manager->RegisterTensor(desc);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kNoSpace);
  const std::string message(refused.status().message());
  EXPECT_NE(message.find("set zoe.tensor_swap_bytes to at least 262144"), std::string::npos)
      << message;
  // That size works.
  TempDir other;
  options = SmallOptions(other, 4);
  options.nvme_capacity_bytes = 4 * kChunk;
  auto roomier = MakeManager(options);
  ASSERT_NE(roomier, nullptr);
  Register(*roomier, "first", kChunk);
  EXPECT_TRUE(roomier->RegisterTensor(desc).ok());
}

TEST(TierManagerTest, TensorLargerThanHostBudgetFailsAtRegistration) {
  TempDir dir;
  auto manager = MakeManager(SmallOptions(dir, 2));
  ASSERT_NE(manager, nullptr);
  TensorDesc desc{"huge", 3 * kChunk, DType::kUInt8, Tier::kHost, ""};
  Result<TensorId> id = manager->RegisterTensor(desc);
  ASSERT_EQ(id.status().code(), StatusCode::kOutOfMemory);
  EXPECT_NE(id.status().message().find("'huge'"), std::string_view::npos);
  EXPECT_FALSE(manager->Find("huge").ok()) << "a rejected registration changes nothing";
}

TEST(TierManagerTest, SwapTooSmallFailsAtRegistrationWithNoSpace) {
  TempDir dir;
  TierManagerOptions options = SmallOptions(dir, 8);
  options.nvme_capacity_bytes = 2 * kChunk;
  auto manager = MakeManager(options);
  ASSERT_NE(manager, nullptr);
  Register(*manager, "a", 2 * kChunk);
  Result<TensorId> id = manager->RegisterTensor({"b", kChunk, DType::kUInt8, Tier::kHost, ""});
  ASSERT_EQ(id.status().code(), StatusCode::kNoSpace);
  EXPECT_NE(id.status().message().find("'b'"), std::string_view::npos);
}

// The swap files follow the stripe unit and O_DIRECT choice: a 64 KiB run striped in 16 KiB units
// over two directories leaves half its bytes in the second one.
TEST(TierManagerTest, SwapFilesUseTheStripeUnitAndDirectChoice) {
  TempDir first, second;
  TierManagerOptions options = SmallOptions(first, 2);
  options.nvme_paths = {first.File(""), second.File("")};
  options.stripe_unit = 16 << 10;
  options.use_direct = false;
  auto manager = MakeManager(options);
  ASSERT_NE(manager, nullptr);
  TensorId a = Register(*manager, "a", kChunk);
  const std::vector<std::byte> contents = Pattern(kChunk, 41);
  std::memcpy(AcquireOk(*manager, a, Access::kWrite), contents.data(), kChunk);
  ASSERT_TRUE(manager->Release(a).ok());
  ASSERT_TRUE(manager->Evict(a).ok());
  const auto second_half_of = [&contents](size_t stripe) {
    return std::string(reinterpret_cast<const char*>(contents.data()) + stripe * (16 << 10),
                       16 << 10);
  };
  std::string in_second;
  for (const auto& entry : std::filesystem::directory_iterator(second.File("")))
    in_second += testing::ReadBytes(entry.path().string());
  EXPECT_NE(in_second.find(second_half_of(1)), std::string::npos);
  EXPECT_NE(in_second.find(second_half_of(3)), std::string::npos);
  ExpectContents(*manager, a, contents);

  options.stripe_unit = 1000;  // not a multiple of the O_DIRECT alignment
  options.use_direct = true;
  Result<std::unique_ptr<TierManager>> refused = TierManager::Create(options);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("stripe"), std::string_view::npos)
      << refused.status().ToString();
}

TEST(TierManagerTest, WrongTierAccessAndReleaseAreErrors) {
  TempDir dir;
  auto manager = MakeManager(SmallOptions(dir, 2));
  ASSERT_NE(manager, nullptr);
  TensorId a = Register(*manager, "a", 1024);
  EXPECT_EQ(manager->Acquire(a, Tier::kNvme, Access::kRead).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(manager->Acquire(a, Tier::kDevice, Access::kRead).status().code(),
            StatusCode::kNotSupported);
  EXPECT_EQ(manager->Acquire(TensorId(7), Tier::kHost, Access::kRead).status().code(),
            StatusCode::kNotFound);
  EXPECT_EQ(manager->Acquire(a, Tier::kHost, static_cast<Access>(9)).status().code(),
            StatusCode::kInvalidArgument);
  Status release = manager->Release(a);
  EXPECT_EQ(release.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(release.message().find("'a'"), std::string_view::npos);
}

TEST(TierManagerTest, NewTensorsReadAsZerosAndSurviveEviction) {
  TempDir dir;
  auto manager = MakeManager(SmallOptions(dir, 2));
  ASSERT_NE(manager, nullptr);
  TensorId a = Register(*manager, "a", 4096, "g1");
  TensorId b = Register(*manager, "b", 8192, "g1");  // shares a's chunk
  std::byte* data = AcquireOk(*manager, b, Access::kRead);
  ASSERT_NE(data, nullptr);
  EXPECT_TRUE(IsZero(data, 8192));
  ASSERT_TRUE(manager->Release(b).ok());

  const std::vector<std::byte> contents = Pattern(4096, 1);
  Store(*manager, a, contents);
  ASSERT_TRUE(manager->Evict(a).ok());
  EXPECT_EQ(manager->host_reserved_bytes(), 0u);
  ExpectContents(*manager, a, contents);
  data = AcquireOk(*manager, b, Access::kRead);
  EXPECT_TRUE(IsZero(data, 8192)) << "the neighbour in the same chunk is untouched";
  ASSERT_TRUE(manager->Release(b).ok());
}

TEST(TierManagerTest, MultiChunkTensorIsOnePointer) {
  TempDir dir;
  auto manager = MakeManager(SmallOptions(dir, 4));
  ASSERT_NE(manager, nullptr);
  TensorId big = Register(*manager, "big", 3 * kChunk - 512);
  const std::vector<std::byte> contents = Pattern(3 * kChunk - 512, 2);
  Store(*manager, big, contents);
  ASSERT_TRUE(manager->Evict(big).ok());
  ExpectContents(*manager, big, contents);
}

TEST(TierManagerTest, FlushWritesDirtyOnceAndCleanEvictionIsFree) {
  TempDir dir;
  auto manager = MakeManager(SmallOptions(dir, 2));
  ASSERT_NE(manager, nullptr);
  TensorId a = Register(*manager, "a", kChunk);
  Store(*manager, a, Pattern(kChunk, 3));
  ASSERT_TRUE(manager->Flush().ok());
  const auto link = static_cast<size_t>(Link::kHostToNvme);
  EXPECT_EQ(manager->stats().Snapshot().links[link].bytes, kChunk);
  ASSERT_TRUE(manager->Flush().ok());
  EXPECT_EQ(manager->stats().Snapshot().links[link].bytes, kChunk) << "clean: nothing to write";
  ASSERT_TRUE(manager->Evict(a).ok());
  StatsSnapshot stats = manager->stats().Snapshot();
  EXPECT_EQ(stats.links[link].bytes, kChunk);
  EXPECT_EQ(stats.tiers[static_cast<size_t>(Tier::kHost)].evictions_clean, 1u);
  EXPECT_EQ(stats.tiers[static_cast<size_t>(Tier::kHost)].evictions_dirty, 0u);
  ExpectContents(*manager, a, Pattern(kChunk, 3));
}

// A write acquire held across a Flush: what is written after the Flush must still reach NVMe
// when the run is evicted after the Release.
TEST(TierManagerTest, WritesAfterFlushUnderAHeldWriteAcquireSurviveEviction) {
  TempDir dir;
  auto manager = MakeManager(SmallOptions(dir, 2));
  ASSERT_NE(manager, nullptr);
  TensorId a = Register(*manager, "a", kChunk);
  std::byte* data = AcquireOk(*manager, a, Access::kWrite);
  ASSERT_NE(data, nullptr);
  const std::vector<std::byte> first = Pattern(kChunk, 31);
  std::memcpy(data, first.data(), kChunk);
  ASSERT_TRUE(manager->Flush().ok());
  const std::vector<std::byte> second = Pattern(kChunk, 32);
  std::memcpy(data, second.data(), kChunk);
  ASSERT_TRUE(manager->Release(a).ok());
  ASSERT_TRUE(manager->Evict(a).ok());
  EXPECT_EQ(manager->host_reserved_bytes(), 0u);
  ExpectContents(*manager, a, second);
}

TEST(TierManagerTest, PureWriteOfASoleTensorSkipsTheRead) {
  TempDir dir;
  auto manager = MakeManager(SmallOptions(dir, 2));
  ASSERT_NE(manager, nullptr);
  TensorId a = Register(*manager, "a", kChunk);
  Store(*manager, a, Pattern(kChunk, 13));
  ASSERT_TRUE(manager->Evict(a).ok());
  Store(*manager, a, Pattern(kChunk, 14));
  const auto read_link = static_cast<size_t>(Link::kNvmeToHost);
  EXPECT_EQ(manager->stats().Snapshot().links[read_link].bytes, 0u);
  ASSERT_TRUE(manager->Evict(a).ok());
  ExpectContents(*manager, a, Pattern(kChunk, 14));
  EXPECT_EQ(manager->stats().Snapshot().links[read_link].bytes, kChunk);
}

TEST(TierManagerTest, EvictOfPinnedTensorIsBusy) {
  TempDir dir;
  auto manager = MakeManager(SmallOptions(dir, 2));
  ASSERT_NE(manager, nullptr);
  TensorId a = Register(*manager, "a", 100);
  ASSERT_NE(AcquireOk(*manager, a, Access::kRead), nullptr);
  EXPECT_EQ(manager->Evict(a).code(), StatusCode::kBusy);
  ASSERT_TRUE(manager->Release(a).ok());
  EXPECT_TRUE(manager->Evict(a).ok());
}

TEST(TierManagerTest, EveryChunkPinnedIsBusyNotAHang) {
  TempDir dir;
  TierManagerOptions options = SmallOptions(dir, 2);
  options.busy_timeout = std::chrono::milliseconds(20);
  auto manager = MakeManager(options);
  ASSERT_NE(manager, nullptr);
  TensorId a = Register(*manager, "a", kChunk);
  TensorId b = Register(*manager, "b", kChunk);
  TensorId c = Register(*manager, "c", kChunk);
  ASSERT_NE(AcquireOk(*manager, a, Access::kRead), nullptr);
  ASSERT_NE(AcquireOk(*manager, b, Access::kRead), nullptr);
  Result<void*> third = manager->Acquire(c, Tier::kHost, Access::kRead);
  ASSERT_EQ(third.status().code(), StatusCode::kBusy);
  EXPECT_NE(third.status().message().find("'c'"), std::string_view::npos);
  EXPECT_LE(manager->host_reserved_bytes(), manager->host_budget_bytes());
  ASSERT_TRUE(manager->Release(a).ok());
  EXPECT_NE(AcquireOk(*manager, c, Access::kRead), nullptr);
}

TEST(TierManagerTest, BlockedAcquireProceedsWhenAnotherReleases) {
  TempDir dir;
  auto manager = MakeManager(SmallOptions(dir, 2));
  ASSERT_NE(manager, nullptr);
  TensorId a = Register(*manager, "a", kChunk);
  TensorId b = Register(*manager, "b", kChunk);
  TensorId c = Register(*manager, "c", kChunk);
  ASSERT_NE(AcquireOk(*manager, a, Access::kWrite), nullptr);
  ASSERT_NE(AcquireOk(*manager, b, Access::kRead), nullptr);
  std::future<Result<void*>> blocked = manager->AcquireAsync(c, Tier::kHost, Access::kRead);
  while (manager->waiting_acquires() == 0) std::this_thread::yield();
  ASSERT_TRUE(manager->Release(a).ok());
  Result<void*> acquired = blocked.get();
  ASSERT_TRUE(acquired.ok()) << acquired.status().ToString();
  EXPECT_TRUE(IsZero(static_cast<std::byte*>(*acquired), kChunk));
  EXPECT_EQ(manager->stats().Snapshot().tiers[static_cast<size_t>(Tier::kHost)].evictions_dirty,
            1u);
}

TEST(TierManagerTest, PrefetchedTensorIsAHit) {
  TempDir dir;
  auto manager = MakeManager(SmallOptions(dir, 2));
  ASSERT_NE(manager, nullptr);
  TensorId a = Register(*manager, "a", kChunk);
  Store(*manager, a, Pattern(kChunk, 4));
  ASSERT_TRUE(manager->Evict(a).ok());
  const StatsSnapshot before = manager->stats().Snapshot();
  ASSERT_TRUE(manager->Prefetch(a, Tier::kHost).ok());
  ExpectContents(*manager, a, Pattern(kChunk, 4));
  const StatsSnapshot after = manager->stats().Snapshot();
  EXPECT_EQ(after.prefetches_issued, before.prefetches_issued + 1);
  EXPECT_EQ(after.prefetch_hits, before.prefetch_hits + 1);
  EXPECT_EQ(after.prefetch_misses, before.prefetch_misses);
  EXPECT_EQ(after.links[static_cast<size_t>(Link::kNvmeToHost)].bytes, kChunk);
}

TEST(TierManagerTest, PrefetchWithoutRoomIsDroppedAndEvictsNothing) {
  TempDir dir;
  auto manager = MakeManager(SmallOptions(dir, 1));
  ASSERT_NE(manager, nullptr);
  TensorId a = Register(*manager, "a", kChunk);
  TensorId b = Register(*manager, "b", kChunk);
  Store(*manager, a, Pattern(kChunk, 5));
  ASSERT_TRUE(manager->Prefetch(b, Tier::kHost).ok());
  EXPECT_EQ(manager->stats().Snapshot().prefetches_issued, 0u);
  EXPECT_EQ(manager->stats().Snapshot().links[static_cast<size_t>(Link::kHostToNvme)].bytes, 0u);
}

TEST(TierManagerTest, StatsJsonHasOccupancy) {
  TempDir dir;
  auto manager = MakeManager(SmallOptions(dir, 2));
  ASSERT_NE(manager, nullptr);
  TensorId a = Register(*manager, "a", 10);
  ASSERT_NE(AcquireOk(*manager, a, Access::kRead), nullptr);
  nlohmann::json json = manager->StatsJson();
  EXPECT_EQ(json["tiers"]["host"]["occupancy_bytes"].get<uint64_t>(), kChunk);
  EXPECT_EQ(json["tiers"]["nvme"]["occupancy_bytes"].get<uint64_t>(), kChunk);
  ASSERT_TRUE(manager->Release(a).ok());
}

// ---- data integrity on every backend, with and without checksums ----------------------------

class TierManagerIntegrityTest
    : public ::testing::TestWithParam<std::tuple<io::BackendKind, bool>> {};

// Random acquires of 24 tensors of 1 byte to 2.5 chunks in 3 groups, with a HOST budget of 4
// chunks; every read is compared with a shadow copy and the budget is checked after every step.
TEST_P(TierManagerIntegrityTest, RandomAccessMatchesShadowCopy) {
  const auto [backend, checksums] = GetParam();
  io::EngineOptions probe;
  probe.backend = backend;
  if (!io::CreateEngine(probe).ok()) GTEST_SKIP() << io::BackendName(backend) << " unavailable";
  TempDir dir;
  TierManagerOptions options = SmallOptions(dir, 4);
  options.io_backend = backend;
  options.checksum_block = checksums ? 4096 : 0;
  auto manager = MakeManager(options);
  ASSERT_NE(manager, nullptr);
  std::mt19937_64 random(42);
  std::vector<TensorId> ids;
  std::vector<std::vector<std::byte>> shadow;
  for (int i = 0; i < 24; ++i) {
    const uint64_t bytes = 1 + random() % (5 * kChunk / 2);
    ids.push_back(Register(*manager, "t" + std::to_string(i), bytes, "g" + std::to_string(i % 3)));
    shadow.emplace_back(bytes, std::byte{0});
  }
  for (int step = 0; step < 300; ++step) {
    const size_t i = random() % ids.size();
    const auto access = static_cast<Access>(random() % 3);
    std::byte* data = AcquireOk(*manager, ids[i], access);
    ASSERT_NE(data, nullptr) << "step " << step;
    if (Reads(access)) {
      ASSERT_EQ(std::memcmp(data, shadow[i].data(), shadow[i].size()), 0) << "step " << step;
    }
    if (Writes(access)) {
      shadow[i] = Pattern(shadow[i].size(), random());
      std::memcpy(data, shadow[i].data(), shadow[i].size());
    }
    ASSERT_TRUE(manager->Release(ids[i]).ok());
    ASSERT_LE(manager->host_reserved_bytes(), manager->host_budget_bytes());
    if (step % 97 == 0) {
      ASSERT_TRUE(manager->Flush().ok());
    }
  }
  for (size_t i = 0; i < ids.size(); ++i) ExpectContents(*manager, ids[i], shadow[i]);
  EXPECT_GT(manager->stats().Snapshot().tiers[static_cast<size_t>(Tier::kHost)].evictions_dirty,
            0u);
}

INSTANTIATE_TEST_SUITE_P(Backends, TierManagerIntegrityTest,
                         ::testing::Combine(::testing::Values(io::BackendKind::kIoUring,
                                                              io::BackendKind::kLibaio,
                                                              io::BackendKind::kPsync),
                                            ::testing::Bool()),
                         [](const auto& param_info) {
                           return std::string(io::BackendName(std::get<0>(param_info.param))) +
                                  (std::get<1>(param_info.param) ? "_checksums" : "_plain");
                         });

// ---- injected faults ------------------------------------------------------------------------

class TierManagerFaultTest : public ::testing::Test {
 protected:
  void SetUp() override {
    TierManagerOptions options = SmallOptions(dir_, 1);
    options.checksum_block = 4096;
    options.engine_factory = [this]() -> Result<std::unique_ptr<io::Engine>> {
      ZOE_ASSIGN_OR_RETURN(std::unique_ptr<io::Engine> engine, io::CreatePsyncEngine(8));
      auto faulty = std::make_unique<io::FaultInjectingEngine>(std::move(engine), 7);
      faults_ = faulty.get();
      return std::unique_ptr<io::Engine>(std::move(faulty));
    };
    manager_ = MakeManager(options);
    ASSERT_NE(manager_, nullptr);
    a_ = Register(*manager_, "alpha", kChunk);
    b_ = Register(*manager_, "beta", kChunk);
  }

  void Inject(io::FaultKind kind, io::FaultOps ops) {
    io::FaultRule rule;
    rule.kind = kind;
    rule.ops = ops;
    rule.nth = 1;
    rule.max_faults = 1;
    faults_->AddRule(rule);
  }

  TempDir dir_;
  io::FaultInjectingEngine* faults_ = nullptr;
  std::unique_ptr<TierManager> manager_;
  TensorId a_, b_;
};

TEST_F(TierManagerFaultTest, ReadErrorNamesTensorAndLaterAcquireRetries) {
  Store(*manager_, a_, Pattern(kChunk, 8));
  ASSERT_TRUE(manager_->Evict(a_).ok());
  Inject(io::FaultKind::kEio, io::FaultOps::kReads);
  Result<void*> failed = manager_->Acquire(a_, Tier::kHost, Access::kRead);
  ASSERT_EQ(failed.status().code(), StatusCode::kIoError);
  EXPECT_NE(failed.status().message().find("'alpha'"), std::string_view::npos);
  EXPECT_EQ(manager_->host_reserved_bytes(), 0u);
  ExpectContents(*manager_, a_, Pattern(kChunk, 8));
}

TEST_F(TierManagerFaultTest, FailedPrefetchSurfacesFromTheAcquireThatNeedsIt) {
  Store(*manager_, a_, Pattern(kChunk, 12));
  ASSERT_TRUE(manager_->Evict(a_).ok());
  Inject(io::FaultKind::kEio, io::FaultOps::kReads);
  ASSERT_TRUE(manager_->Prefetch(a_, Tier::kHost).ok());
  Result<void*> failed = manager_->Acquire(a_, Tier::kHost, Access::kRead);
  ASSERT_EQ(failed.status().code(), StatusCode::kIoError);
  EXPECT_NE(failed.status().message().find("'alpha'"), std::string_view::npos);
  ExpectContents(*manager_, a_, Pattern(kChunk, 12));
}

// With the only HOST chunk taken by beta's prefetch, acquiring alpha waits for that read; its
// error belongs to beta, so alpha's acquire succeeds, beta's own acquire reports it and the next
// one retries the read.
TEST_F(TierManagerFaultTest, FailedPrefetchOfAnotherRunDoesNotFailTheAcquire) {
  Store(*manager_, b_, Pattern(kChunk, 15));
  ASSERT_TRUE(manager_->Evict(b_).ok());
  Inject(io::FaultKind::kEio, io::FaultOps::kReads);
  ASSERT_TRUE(manager_->Prefetch(b_, Tier::kHost).ok());
  std::byte* alpha = AcquireOk(*manager_, a_, Access::kRead);
  ASSERT_NE(alpha, nullptr);
  EXPECT_TRUE(IsZero(alpha, kChunk));
  ASSERT_TRUE(manager_->Release(a_).ok());
  Result<void*> failed = manager_->Acquire(b_, Tier::kHost, Access::kRead);
  ASSERT_EQ(failed.status().code(), StatusCode::kIoError);
  EXPECT_NE(failed.status().message().find("'beta'"), std::string_view::npos);
  ExpectContents(*manager_, b_, Pattern(kChunk, 15));
}

TEST_F(TierManagerFaultTest, WriteBackNoSpaceKeepsTheDirtyData) {
  Store(*manager_, a_, Pattern(kChunk, 9));
  Inject(io::FaultKind::kEnospc, io::FaultOps::kWrites);
  Result<void*> failed = manager_->Acquire(b_, Tier::kHost, Access::kRead);
  ASSERT_EQ(failed.status().code(), StatusCode::kNoSpace);
  EXPECT_NE(failed.status().message().find("'beta'"), std::string_view::npos);
  EXPECT_NE(failed.status().message().find("'alpha'"), std::string_view::npos);
  ExpectContents(*manager_, a_, Pattern(kChunk, 9));          // still resident
  std::byte* beta = AcquireOk(*manager_, b_, Access::kRead);  // the write-back now succeeds
  ASSERT_NE(beta, nullptr);
  EXPECT_TRUE(IsZero(beta, kChunk));
  ASSERT_TRUE(manager_->Release(b_).ok());
  ExpectContents(*manager_, a_, Pattern(kChunk, 9));  // read back from NVMe
}

TEST_F(TierManagerFaultTest, FlushErrorIsReportedAndRetried) {
  Store(*manager_, a_, Pattern(kChunk, 10));
  Inject(io::FaultKind::kEio, io::FaultOps::kWrites);
  EXPECT_EQ(manager_->Flush().code(), StatusCode::kIoError);
  ASSERT_TRUE(manager_->Flush().ok());
  ASSERT_TRUE(manager_->Evict(a_).ok());
  ExpectContents(*manager_, a_, Pattern(kChunk, 10));
}

TEST_F(TierManagerFaultTest, CorruptedReadIsAChecksumError) {
  Store(*manager_, a_, Pattern(kChunk, 11));
  ASSERT_TRUE(manager_->Evict(a_).ok());
  Inject(io::FaultKind::kCorruption, io::FaultOps::kReads);
  Result<void*> failed = manager_->Acquire(a_, Tier::kHost, Access::kRead);
  ASSERT_EQ(failed.status().code(), StatusCode::kCorruption);
  EXPECT_NE(failed.status().message().find("'alpha'"), std::string_view::npos);
  ExpectContents(*manager_, a_, Pattern(kChunk, 11));
}

// ---- the device tier (host stand-in) --------------------------------------------------------

class TierManagerDeviceTest : public ::testing::TestWithParam<bool> {
 protected:
  // A HOST budget of 5 chunks and a DEVICE budget of 2; device copies fail while fail_copies_.
  std::unique_ptr<TierManager> Make(uint64_t host_chunks = 5, uint64_t device_chunks = 2,
                                    uint32_t prefetch_in_flight = 8) {
    TierManagerOptions options = SmallOptions(dir_, host_chunks);
    options.prefetch_in_flight = prefetch_in_flight;
    options.device_budget_bytes = device_chunks * kChunk;
    options.busy_timeout = std::chrono::milliseconds(200);
    options.engine_factory = engine_factory_;
    options.device_factory = [this, device_chunks]() -> Result<std::unique_ptr<DeviceBackend>> {
      HostStandInOptions device;
      device.capacity_bytes = device_chunks * kChunk;
      if (GetParam()) device.adversarial_delay = kAdversarialDelay;
      device.before_copy = [this](CopyKind, uint64_t) {
        return fail_copies_.load() ? Status::IoError("injected device copy failure") : Status::Ok();
      };
      ZOE_ASSIGN_OR_RETURN(std::unique_ptr<HostStandInDevice> backend,
                           HostStandInDevice::Create(std::move(device)));
      return std::unique_ptr<DeviceBackend>(std::move(backend));
    };
    return MakeManager(options);
  }

  // The stand-in's device memory is host memory, so tests may look at it directly.
  static std::byte* OnDevice(TierManager& manager, TensorId id, Access access) {
    Result<void*> ptr = manager.Acquire(id, Tier::kDevice, access);
    EXPECT_TRUE(ptr.ok()) << ptr.status().ToString();
    return ptr.ok() ? static_cast<std::byte*>(*ptr) : nullptr;
  }

  void CheckBudgets(TierManager& manager) {
    ASSERT_LE(manager.host_reserved_bytes(), manager.host_budget_bytes());
    ASSERT_LE(manager.device_reserved_bytes(), manager.device_budget_bytes());
  }

  TempDir dir_;
  std::atomic<bool> fail_copies_{false};
  std::function<Result<std::unique_ptr<io::Engine>>()> engine_factory_;  // empty: the default
};

// Holds completions back while closed: the first Reap after Close collects a completion from the
// engine, reports it as held and returns it only once the gate opens, so a test can act while a
// finished transfer is not yet applied.
class GatedEngine : public io::EngineWrapper {
 public:
  using EngineWrapper::EngineWrapper;

  void Close() {
    std::lock_guard lock(mutex_);
    closed_ = true;
  }
  void Open() {
    std::lock_guard lock(mutex_);
    closed_ = false;
    changed_.notify_all();
  }
  void WaitUntilHolding() {
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [this] { return holding_; });
  }

  Result<size_t> Reap(std::span<io::RawCompletion> out, size_t min_completions) override {
    std::unique_lock lock(mutex_);
    if (!closed_) {
      lock.unlock();
      return EngineWrapper::Reap(out, min_completions);
    }
    lock.unlock();
    Result<size_t> reaped = EngineWrapper::Reap(out, std::max<size_t>(min_completions, 1));
    lock.lock();
    holding_ = true;
    changed_.notify_all();
    changed_.wait(lock, [this] { return !closed_; });
    holding_ = false;
    return reaped;
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  bool closed_ = false;
  bool holding_ = false;
};

TEST_P(TierManagerDeviceTest, DirtyDeviceDataReachesHostAndNvme) {
  auto manager = Make();
  ASSERT_NE(manager, nullptr);
  ASSERT_TRUE(manager->has_device());
  TensorId a = Register(*manager, "a", kChunk);
  TensorId b = Register(*manager, "b", kChunk);
  TensorId c = Register(*manager, "c", kChunk);
  std::byte* data = OnDevice(*manager, a, Access::kWrite);
  ASSERT_NE(data, nullptr);
  EXPECT_TRUE(IsZero(data, kChunk));
  const std::vector<std::byte> contents = Pattern(kChunk, 21);
  std::memcpy(data, contents.data(), kChunk);
  ASSERT_TRUE(manager->Release(a).ok());
  for (TensorId id : {b, c}) {  // the device holds two runs: `a` is evicted, copied back
    ASSERT_NE(OnDevice(*manager, id, Access::kRead), nullptr);
    ASSERT_TRUE(manager->Release(id).ok());
  }
  StatsSnapshot stats = manager->stats().Snapshot();
  EXPECT_EQ(stats.links[static_cast<size_t>(Link::kDeviceToHost)].bytes, kChunk);
  EXPECT_EQ(stats.tiers[static_cast<size_t>(Tier::kDevice)].evictions_dirty, 1u);
  ExpectContents(*manager, a, contents);
  ASSERT_TRUE(manager->Evict(a).ok());
  ExpectContents(*manager, a, contents);  // from NVMe
}

TEST_P(TierManagerDeviceTest, FlushWritesDeviceDataDownToNvme) {
  auto manager = Make();
  ASSERT_NE(manager, nullptr);
  TensorId a = Register(*manager, "a", 5000);
  std::byte* data = OnDevice(*manager, a, Access::kReadWrite);
  ASSERT_NE(data, nullptr);
  const std::vector<std::byte> contents = Pattern(5000, 22);
  std::memcpy(data, contents.data(), contents.size());
  ASSERT_TRUE(manager->Release(a).ok());
  ASSERT_TRUE(manager->Flush().ok());
  ASSERT_TRUE(manager->Evict(a).ok());
  EXPECT_EQ(manager->host_reserved_bytes(), 0u);
  EXPECT_EQ(manager->device_reserved_bytes(), 0u);
  data = OnDevice(*manager, a, Access::kRead);
  ASSERT_NE(data, nullptr);
  EXPECT_EQ(std::memcmp(data, contents.data(), contents.size()), 0);
  ASSERT_TRUE(manager->Release(a).ok());
}

// The device variant: a device write acquire held across a Flush keeps its later writes.
TEST_P(TierManagerDeviceTest, DeviceWritesAfterFlushUnderAHeldAcquireSurviveEviction) {
  auto manager = Make();
  ASSERT_NE(manager, nullptr);
  TensorId a = Register(*manager, "a", kChunk);
  std::byte* data = OnDevice(*manager, a, Access::kWrite);
  ASSERT_NE(data, nullptr);
  const std::vector<std::byte> first = Pattern(kChunk, 33);
  std::memcpy(data, first.data(), kChunk);
  ASSERT_TRUE(manager->Flush().ok());
  const std::vector<std::byte> second = Pattern(kChunk, 34);
  std::memcpy(data, second.data(), kChunk);
  ASSERT_TRUE(manager->Release(a).ok());
  ASSERT_TRUE(manager->Evict(a).ok());
  EXPECT_EQ(manager->host_reserved_bytes(), 0u);
  EXPECT_EQ(manager->device_reserved_bytes(), 0u);
  ExpectContents(*manager, a, second);
}

// A device copy evicted back into the HOST copy while a Flush writes that HOST copy to NVMe: the
// run must stay dirty after the write, so the newer device bytes reach NVMe before it is dropped.
TEST_P(TierManagerDeviceTest, DeviceCopyBackDuringHostWriteBackKeepsTheRunDirty) {
  GatedEngine* gate = nullptr;
  engine_factory_ = [&gate]() -> Result<std::unique_ptr<io::Engine>> {
    ZOE_ASSIGN_OR_RETURN(std::unique_ptr<io::Engine> engine, io::CreatePsyncEngine(8));
    auto gated = std::make_unique<GatedEngine>(std::move(engine));
    gate = gated.get();
    return std::unique_ptr<io::Engine>(std::move(gated));
  };
  auto manager = Make();
  ASSERT_NE(manager, nullptr);
  ASSERT_NE(gate, nullptr);
  TensorId a = Register(*manager, "a", kChunk);
  std::byte* data = OnDevice(*manager, a, Access::kWrite);
  ASSERT_NE(data, nullptr);
  std::memcpy(data, Pattern(kChunk, 35).data(), kChunk);
  ASSERT_TRUE(manager->Release(a).ok());

  gate->Close();
  std::future<Status> flushed = std::async(std::launch::async, [&] { return manager->Flush(); });
  gate->WaitUntilHolding();  // NVMe holds the first bytes; the write is not applied yet
  data = OnDevice(*manager, a, Access::kWrite);
  ASSERT_NE(data, nullptr);
  const std::vector<std::byte> newer = Pattern(kChunk, 36);
  std::memcpy(data, newer.data(), kChunk);
  ASSERT_TRUE(manager->Release(a).ok());
  std::future<Status> evicted = std::async(std::launch::async, [&] { return manager->Evict(a); });
  const auto link = static_cast<size_t>(Link::kDeviceToHost);
  while (manager->stats().Snapshot().links[link].transfers < 2) std::this_thread::yield();
  gate->Open();
  EXPECT_TRUE(flushed.get().ok());
  EXPECT_TRUE(evicted.get().ok());
  EXPECT_EQ(manager->host_reserved_bytes(), 0u);
  ExpectContents(*manager, a, newer);
}

// The HOST budget is held by the HOST copies of two unpinned device runs: a HOST acquire of a
// third run evicts a device copy (copying its dirty bytes back) instead of failing with Busy.
TEST_P(TierManagerDeviceTest, HostBackPressureEvictsUnpinnedDeviceCopies) {
  auto manager = Make(2, 2);
  ASSERT_NE(manager, nullptr);
  TensorId a = Register(*manager, "a", kChunk);
  TensorId b = Register(*manager, "b", kChunk);
  TensorId c = Register(*manager, "c", kChunk);
  const std::vector<std::byte> contents = Pattern(kChunk, 37);
  std::byte* data = OnDevice(*manager, a, Access::kWrite);
  ASSERT_NE(data, nullptr);
  std::memcpy(data, contents.data(), kChunk);
  ASSERT_TRUE(manager->Release(a).ok());
  ASSERT_NE(OnDevice(*manager, b, Access::kRead), nullptr);
  ASSERT_TRUE(manager->Release(b).ok());
  std::byte* third = AcquireOk(*manager, c, Access::kRead);
  ASSERT_NE(third, nullptr);
  EXPECT_TRUE(IsZero(third, kChunk));
  ASSERT_TRUE(manager->Release(c).ok());
  CheckBudgets(*manager);
  EXPECT_EQ(manager->stats().Snapshot().tiers[static_cast<size_t>(Tier::kDevice)].evictions_dirty,
            1u);
  ExpectContents(*manager, a, contents);
}

TEST_P(TierManagerDeviceTest, HostAcquireOfRunPinnedDirtyOnDeviceFails) {
  auto manager = Make();
  ASSERT_NE(manager, nullptr);
  TensorId a = Register(*manager, "a", 100);
  ASSERT_NE(OnDevice(*manager, a, Access::kWrite), nullptr);
  Result<void*> host = manager->Acquire(a, Tier::kHost, Access::kRead);
  ASSERT_EQ(host.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(host.status().message().find("'a'"), std::string_view::npos);
  EXPECT_EQ(manager->Evict(a).code(), StatusCode::kBusy);
  ASSERT_TRUE(manager->Release(a).ok());
  EXPECT_NE(AcquireOk(*manager, a, Access::kRead), nullptr);
  ASSERT_TRUE(manager->Release(a).ok());
}

// Two tensors in one run: a device copy taken while `a` is written on the host would carry a
// stale `a`, and copying `b`'s device writes back would revert `a`.
TEST_P(TierManagerDeviceTest, DeviceAcquireOfRunHeldForHostWritingFails) {
  auto manager = Make();
  ASSERT_NE(manager, nullptr);
  TensorId a = Register(*manager, "a", 100);
  TensorId b = Register(*manager, "b", 100);
  std::byte* host_a = AcquireOk(*manager, a, Access::kWrite);
  ASSERT_NE(host_a, nullptr);
  Result<void*> device_b = manager->Acquire(b, Tier::kDevice, Access::kReadWrite);
  ASSERT_EQ(device_b.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(device_b.status().message().find("'b'"), std::string_view::npos);
  EXPECT_NE(device_b.status().message().find("for writing"), std::string_view::npos);
  EXPECT_EQ(manager->Prefetch(b, Tier::kDevice).code(), StatusCode::kOk);  // a hint: skipped
  const std::vector<std::byte> newer_a = Pattern(100, 31);
  std::memcpy(host_a, newer_a.data(), 100);
  ASSERT_TRUE(manager->Release(a).ok());

  std::byte* on_device_b = OnDevice(*manager, b, Access::kWrite);  // allowed once released
  ASSERT_NE(on_device_b, nullptr);
  const std::vector<std::byte> newer_b = Pattern(100, 32);
  std::memcpy(on_device_b, newer_b.data(), 100);
  ASSERT_TRUE(manager->Release(b).ok());
  ASSERT_TRUE(manager->Flush().ok());
  ASSERT_TRUE(manager->Evict(a).ok());
  ExpectContents(*manager, a, newer_a);  // from NVMe: both writes kept
  ExpectContents(*manager, b, newer_b);
  CheckBudgets(*manager);
}

TEST_P(TierManagerDeviceTest, EveryDeviceChunkPinnedIsBusy) {
  auto manager = Make();
  ASSERT_NE(manager, nullptr);
  TensorId a = Register(*manager, "a", kChunk);
  TensorId b = Register(*manager, "b", kChunk);
  TensorId c = Register(*manager, "c", kChunk);
  ASSERT_NE(OnDevice(*manager, a, Access::kRead), nullptr);
  ASSERT_NE(OnDevice(*manager, b, Access::kRead), nullptr);
  Result<void*> third = manager->Acquire(c, Tier::kDevice, Access::kRead);
  ASSERT_EQ(third.status().code(), StatusCode::kBusy);
  EXPECT_NE(third.status().message().find("'c'"), std::string_view::npos);
  CheckBudgets(*manager);
  ASSERT_TRUE(manager->Release(a).ok());
  EXPECT_NE(OnDevice(*manager, c, Access::kRead), nullptr);
}

TEST_P(TierManagerDeviceTest, FailedDeviceCopyNamesTensorAndKeepsData) {
  auto manager = Make();
  ASSERT_NE(manager, nullptr);
  TensorId a = Register(*manager, "a", kChunk);
  Store(*manager, a, Pattern(kChunk, 23));
  fail_copies_ = true;
  Result<void*> failed = manager->Acquire(a, Tier::kDevice, Access::kRead);
  ASSERT_FALSE(failed.ok());
  EXPECT_NE(failed.status().message().find("'a'"), std::string_view::npos);
  EXPECT_EQ(manager->device_reserved_bytes(), 0u);
  fail_copies_ = false;
  ExpectContents(*manager, a, Pattern(kChunk, 23));
}

// A device write acquire that fails after staging the run on HOST must not leave an unread HOST
// copy behind: a later HOST read sees what NVMe holds. `b` passes through the same memory first,
// so an unread copy would show b's bytes.
TEST_P(TierManagerDeviceTest, FailedDeviceWriteAcquireLeavesTheHostCopyRead) {
  auto manager = Make(5, 1);
  ASSERT_NE(manager, nullptr);
  TensorId a = Register(*manager, "a", 2 * kChunk);  // HOST home: larger than the device budget
  TensorId b = Register(*manager, "b", 2 * kChunk);
  const std::vector<std::byte> contents = Pattern(2 * kChunk, 24);
  Store(*manager, a, contents);
  ASSERT_TRUE(manager->Evict(a).ok());
  Store(*manager, b, Pattern(2 * kChunk, 25));
  ASSERT_TRUE(manager->Evict(b).ok());
  Result<void*> failed = manager->Acquire(a, Tier::kDevice, Access::kWrite);
  ASSERT_EQ(failed.status().code(), StatusCode::kOutOfMemory);
  EXPECT_NE(failed.status().message().find("'a'"), std::string_view::npos);
  EXPECT_EQ(manager->device_reserved_bytes(), 0u);
  ExpectContents(*manager, a, contents);
}

// The same after a failed copy to the device.
TEST_P(TierManagerDeviceTest, FailedDeviceWriteCopyLeavesTheHostCopyRead) {
  auto manager = Make();
  ASSERT_NE(manager, nullptr);
  TensorId a = Register(*manager, "a", kChunk);
  TensorId b = Register(*manager, "b", kChunk);
  const std::vector<std::byte> contents = Pattern(kChunk, 26);
  Store(*manager, a, contents);
  ASSERT_TRUE(manager->Evict(a).ok());
  Store(*manager, b, Pattern(kChunk, 27));
  ASSERT_TRUE(manager->Evict(b).ok());
  fail_copies_ = true;
  Result<void*> failed = manager->Acquire(a, Tier::kDevice, Access::kWrite);
  fail_copies_ = false;
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(manager->device_reserved_bytes(), 0u);
  ExpectContents(*manager, a, contents);
}

TEST_P(TierManagerDeviceTest, DeviceHomeLargerThanDeviceBudgetFailsAtRegistration) {
  auto manager = Make(8, 2);
  ASSERT_NE(manager, nullptr);
  Result<TensorId> id =
      manager->RegisterTensor({"w", 3 * kChunk, DType::kUInt8, Tier::kDevice, ""});
  ASSERT_EQ(id.status().code(), StatusCode::kOutOfMemory);
  EXPECT_NE(id.status().message().find("'w'"), std::string_view::npos);
}

// Random acquires on DEVICE and HOST over 10 tensors against shadow copies, budgets checked at
// every step.
TEST_P(TierManagerDeviceTest, RandomAccessOnBothTiersMatchesShadowCopy) {
  auto manager = Make(4, 2);
  ASSERT_NE(manager, nullptr);
  std::mt19937_64 random(7);
  std::vector<TensorId> ids;
  std::vector<std::vector<std::byte>> shadow;
  for (int i = 0; i < 10; ++i) {
    const uint64_t bytes = 1 + random() % kChunk;
    ids.push_back(Register(*manager, "t" + std::to_string(i), bytes, "g" + std::to_string(i % 4)));
    shadow.emplace_back(bytes, std::byte{0});
  }
  for (int step = 0; step < 300; ++step) {
    const size_t i = random() % ids.size();
    const auto access = static_cast<Access>(random() % 3);
    const Tier tier = random() % 2 ? Tier::kDevice : Tier::kHost;
    Result<void*> ptr = manager->Acquire(ids[i], tier, access);
    ASSERT_TRUE(ptr.ok()) << "step " << step << ": " << ptr.status().ToString();
    auto* data = static_cast<std::byte*>(*ptr);
    if (Reads(access)) {
      ASSERT_EQ(std::memcmp(data, shadow[i].data(), shadow[i].size()), 0) << "step " << step;
    }
    if (Writes(access)) {
      shadow[i] = Pattern(shadow[i].size(), random());
      std::memcpy(data, shadow[i].data(), shadow[i].size());
    }
    ASSERT_TRUE(manager->Release(ids[i]).ok());
    CheckBudgets(*manager);
    if (step % 89 == 0) {
      ASSERT_TRUE(manager->Flush().ok());
    }
  }
  for (size_t i = 0; i < ids.size(); ++i) ExpectContents(*manager, ids[i], shadow[i]);
}

// A cyclic pass over four runs with room for two on the device: LRU copies every run in every
// iteration; replaying the trace, eviction by next use (OPT) keeps the run needed soonest.
TEST_P(TierManagerDeviceTest, ReplayedTraceEvictsFromDeviceByNextUse) {
  auto manager = Make(5, 2, /*prefetch_in_flight=*/0);  // demand copies only
  ASSERT_NE(manager, nullptr);
  std::vector<TensorId> layers;
  for (int i = 0; i < 4; ++i) layers.push_back(Register(*manager, "l" + std::to_string(i), kChunk));
  const auto copies_in_one_iteration = [&] {
    const auto link = static_cast<size_t>(Link::kHostToDevice);
    const uint64_t before = manager->stats().Snapshot().links[link].transfers;
    EXPECT_TRUE(manager->TraceBegin("pass").ok());
    for (TensorId id : layers) {
      EXPECT_NE(OnDevice(*manager, id, Access::kRead), nullptr);
      EXPECT_TRUE(manager->Release(id).ok());
    }
    EXPECT_TRUE(manager->TraceEnd().ok());
    return manager->stats().Snapshot().links[link].transfers - before;
  };
  EXPECT_EQ(copies_in_one_iteration(), 4u);  // recording: LRU
  // Replay: Belady's choice on a cycle of four with room for two copies three runs per iteration.
  EXPECT_EQ(copies_in_one_iteration(), 3u);
  EXPECT_EQ(copies_in_one_iteration(), 3u);
  CheckBudgets(*manager);
}

// ---- trace record and replay ---------------------------------------------------------------

// Eight one-chunk "layers" holding known patterns, a HOST budget of three chunks and a look-ahead
// of two: without a trace a sequential pass misses every time (LRU); replay prefetches.
class TierManagerTraceTest : public ::testing::Test {
 protected:
  std::unique_ptr<TierManager> Make() {
    TierManagerOptions options = SmallOptions(dir_, 3);
    options.lookahead_bytes = 2 * kChunk;
    options.prefetch_in_flight = 2;
    options.trace_cursor.rerecord_min_mismatches = 4;
    auto manager = MakeManager(options);
    ids_.clear();
    for (int i = 0; i < 8; ++i) {
      ids_.push_back(Register(*manager, "layer" + std::to_string(i), kChunk));
      Store(*manager, ids_.back(), Pattern(kChunk, i + 1));
    }
    for (TensorId id : ids_) EXPECT_TRUE(manager->Evict(id).ok());
    return manager;
  }

  // One iteration reading the layers in `order`, checking their contents.
  void Iterate(TierManager& manager, const std::vector<int>& order) {
    ASSERT_TRUE(manager.TraceBegin("step").ok());
    for (int i : order) ExpectContents(manager, ids_[i], Pattern(kChunk, i + 1));
    ASSERT_TRUE(manager.TraceEnd().ok());
  }

  static StatsSnapshot Delta(const StatsSnapshot& after, const StatsSnapshot& before) {
    StatsSnapshot delta;
    delta.prefetches_issued = after.prefetches_issued - before.prefetches_issued;
    delta.prefetch_hits = after.prefetch_hits - before.prefetch_hits;
    delta.prefetch_misses = after.prefetch_misses - before.prefetch_misses;
    delta.trace_matched = after.trace_matched - before.trace_matched;
    delta.trace_resynced = after.trace_resynced - before.trace_resynced;
    delta.trace_unmatched = after.trace_unmatched - before.trace_unmatched;
    return delta;
  }

  const std::vector<int> kForward = {0, 1, 2, 3, 4, 5, 6, 7};
  TempDir dir_;
  std::vector<TensorId> ids_;
};

TEST_F(TierManagerTraceTest, RecordSaveLoadReplayGivesPrefetchHits) {
  const std::string path = dir_.File("step.trace");
  {
    auto recorder = Make();
    ASSERT_NE(recorder, nullptr);
    const StatsSnapshot before = recorder->stats().Snapshot();
    Iterate(*recorder, kForward);
    const StatsSnapshot lru = Delta(recorder->stats().Snapshot(), before);
    EXPECT_EQ(lru.prefetch_misses, 8u) << "a sequential pass over LRU misses every layer";
    EXPECT_EQ(lru.prefetches_issued, 0u);
    ASSERT_TRUE(recorder->TraceSave("step", path).ok());
  }
  auto manager = Make();
  ASSERT_NE(manager, nullptr);
  Result<std::string> name = manager->TraceLoad(path);
  ASSERT_TRUE(name.ok()) << name.status().ToString();
  EXPECT_EQ(*name, "step");
  const StatsSnapshot before = manager->stats().Snapshot();
  Iterate(*manager, kForward);
  EXPECT_FALSE(manager->trace_recording());
  const StatsSnapshot replay = Delta(manager->stats().Snapshot(), before);
  EXPECT_EQ(replay.trace_matched, 8u);
  EXPECT_LE(replay.prefetch_misses, 1u);
  EXPECT_GE(replay.prefetch_hits, 7u);
  EXPECT_GE(replay.prefetches_issued, 7u);
  EXPECT_LE(
      manager->stats().Snapshot().tiers[static_cast<size_t>(Tier::kHost)].peak_occupancy_bytes,
      manager->host_budget_bytes());
}

TEST_F(TierManagerTraceTest, DivergingIterationResynchronises) {
  auto manager = Make();
  ASSERT_NE(manager, nullptr);
  Iterate(*manager, kForward);  // records
  const StatsSnapshot before = manager->stats().Snapshot();
  Iterate(*manager, {0, 1, 2, 4, 5, 6, 7});  // layer 3 skipped this time
  const StatsSnapshot replay = Delta(manager->stats().Snapshot(), before);
  EXPECT_GE(replay.trace_resynced, 1u);
  EXPECT_GE(replay.trace_matched, 5u);
  EXPECT_LE(replay.prefetch_misses, 1u);
  ASSERT_TRUE(manager->TraceBegin("step").ok());
  EXPECT_FALSE(manager->trace_recording()) << "one skip does not re-record";
  ASSERT_TRUE(manager->TraceEnd().ok());
}

TEST_F(TierManagerTraceTest, RepeatedMismatchesReRecordTheNextIteration) {
  auto manager = Make();
  ASSERT_NE(manager, nullptr);
  Iterate(*manager, kForward);
  const std::vector<int> backward = {7, 6, 5, 4, 3, 2, 1, 0};
  Iterate(*manager, backward);  // mismatches the recorded order
  ASSERT_TRUE(manager->TraceBegin("step").ok());
  EXPECT_TRUE(manager->trace_recording());
  for (int i : backward) ExpectContents(*manager, ids_[i], Pattern(kChunk, i + 1));
  ASSERT_TRUE(manager->TraceEnd().ok());
  const StatsSnapshot before = manager->stats().Snapshot();
  Iterate(*manager, backward);
  EXPECT_EQ(Delta(manager->stats().Snapshot(), before).trace_matched, 8u);
}

// Acquires between TraceEnd and TraceBegin (an optimizer step, a checkpoint) are not the
// iteration's: they neither move the replay nor prefetch, and the next iteration replays from its
// start as if they had not happened.
TEST_F(TierManagerTraceTest, AcquiresBetweenIterationsLeaveTheReplayAlone) {
  auto manager = Make();
  ASSERT_NE(manager, nullptr);
  Iterate(*manager, kForward);  // records
  Iterate(*manager, kForward);  // replays
  const StatsSnapshot before = manager->stats().Snapshot();
  for (int i : {4, 5}) ExpectContents(*manager, ids_[i], Pattern(kChunk, i + 1));
  const StatsSnapshot between = Delta(manager->stats().Snapshot(), before);
  EXPECT_EQ(between.trace_matched + between.trace_resynced + between.trace_unmatched, 0u);
  EXPECT_EQ(between.prefetches_issued, 0u)
      << "matching layer 5 would have moved the replay there and prefetched layers 6 and 7";
  const StatsSnapshot start = manager->stats().Snapshot();
  Iterate(*manager, kForward);
  const StatsSnapshot next = Delta(manager->stats().Snapshot(), start);
  EXPECT_EQ(next.trace_matched, 8u);
  EXPECT_EQ(next.trace_resynced + next.trace_unmatched, 0u);
  EXPECT_LE(next.prefetch_misses, 1u);
}

TEST_F(TierManagerTraceTest, MisuseIsReported) {
  auto manager = Make();
  ASSERT_NE(manager, nullptr);
  EXPECT_EQ(manager->TraceEnd().code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(manager->TraceBegin("step").ok());
  EXPECT_EQ(manager->TraceBegin("step").code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(manager->TraceEnd().ok());
  EXPECT_EQ(manager->TraceSave("other", dir_.File("x")).code(), StatusCode::kNotFound);
  ASSERT_TRUE(manager->TraceSave("step", dir_.File("step.trace")).ok());
  Register(*manager, "late", 10);  // the registry no longer matches the saved trace
  EXPECT_FALSE(manager->TraceLoad(dir_.File("step.trace")).ok());
}

// ---- concurrency ----------------------------------------------------------------------------

// Four threads each write and check their own tensors (on HOST, or with the parameter set on
// DEVICE or HOST at random) and read shared ones that hold a known pattern, with budgets smaller
// than the working set, so evictions and copies race with acquires.
class TierManagerConcurrencyTest : public ::testing::TestWithParam<bool> {};

TEST_P(TierManagerConcurrencyTest, ThreadsAcquireDistinctAndSharedTensors) {
  const bool device = GetParam();
  TempDir dir;
  TierManagerOptions options = SmallOptions(dir, 6);
  if (device) {
    options.device_backend = "host";
    options.device_budget_bytes = 2 * kChunk;
  }
  auto manager = MakeManager(options);
  ASSERT_NE(manager, nullptr);
  constexpr int kThreads = 4;
  constexpr int kOwn = 3;
  std::vector<TensorId> shared;
  for (int i = 0; i < 3; ++i) {
    shared.push_back(Register(*manager, "shared" + std::to_string(i), kChunk / 2, "s"));
    Store(*manager, shared.back(), Pattern(kChunk / 2, 100 + i));
  }
  std::vector<TensorId> own;
  for (int t = 0; t < kThreads * kOwn; ++t)
    own.push_back(Register(*manager, "own" + std::to_string(t), kChunk - 4096));
  std::atomic<int> failures{0};
  auto worker = [&](int thread) {
    std::mt19937_64 random(thread);
    std::vector<std::vector<std::byte>> shadow(kOwn, std::vector<std::byte>(kChunk - 4096));
    for (int step = 0; step < 60; ++step) {
      const int which = static_cast<int>(random() % (kOwn + 1));
      if (which == kOwn) {
        const size_t s = random() % shared.size();
        Result<void*> data = manager->Acquire(shared[s], Tier::kHost, Access::kRead);
        if (!data.ok() || std::memcmp(*data, Pattern(kChunk / 2, 100 + s).data(), kChunk / 2) != 0)
          ++failures;
        if (data.ok() && !manager->Release(shared[s]).ok()) ++failures;
        continue;
      }
      const TensorId id = own[thread * kOwn + which];
      const Tier tier = device && random() % 2 ? Tier::kDevice : Tier::kHost;
      Result<void*> data = manager->Acquire(id, tier, Access::kReadWrite);
      if (!data.ok()) {
        ++failures;
        continue;
      }
      if (std::memcmp(*data, shadow[which].data(), shadow[which].size()) != 0) ++failures;
      shadow[which] = Pattern(shadow[which].size(), random());
      std::memcpy(*data, shadow[which].data(), shadow[which].size());
      if (!manager->Release(id).ok()) ++failures;
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(worker, t);
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_LE(
      manager->stats().Snapshot().tiers[static_cast<size_t>(Tier::kHost)].peak_occupancy_bytes,
      manager->host_budget_bytes());
  EXPECT_LE(
      manager->stats().Snapshot().tiers[static_cast<size_t>(Tier::kDevice)].peak_occupancy_bytes,
      manager->device_budget_bytes());
}

INSTANTIATE_TEST_SUITE_P(Tiers, TierManagerConcurrencyTest, ::testing::Bool(),
                         [](const auto& param_info) {
                           return std::string(param_info.param ? "device_and_host" : "host");
                         });

INSTANTIATE_TEST_SUITE_P(StandIn, TierManagerDeviceTest, ::testing::Bool(), AdversarialName);

}  // namespace
}  // namespace zoe::offload
