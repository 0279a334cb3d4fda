// Description: the tier backends (HOST over NVMe swap, DEVICE on the host stand-in) through one
// conformance suite — bytes round-trip through the tier below, Poll and Wait collect a transfer,
// freed memory is reused for the same size and given up when an allocation needs the room.
#include "offload/paging/tier_backend.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/host_device.h"
#include "core/pinned_memory.h"
#include "io/backend.h"
#include "io/queue.h"
#include "io/swap_space.h"
#include "tests/offload/temp_dir.h"

namespace zoe::offload {
namespace {

using testing::TempDir;

constexpr uint64_t kBytes = 64 << 10;
constexpr uint64_t kBudget = 4 * kBytes;

std::vector<std::byte> Pattern(uint64_t seed) {
  std::vector<std::byte> out(kBytes);
  std::mt19937_64 random(seed);
  for (std::byte& b : out) b = static_cast<std::byte>(random());
  return out;
}

PinnedMemoryPool MakePool(const std::string& name) {
  PinnedPoolOptions options;
  options.name = name;
  options.budget_bytes = kBudget;
  return std::move(PinnedMemoryPool::Create(std::move(options))).value();
}

class TierBackendTest : public ::testing::TestWithParam<Tier> {
 protected:
  void SetUp() override {
    ASSERT_TRUE(staging_.ok());
    if (GetParam() == Tier::kHost) return SetUpHost();
    HostStandInOptions options;
    options.capacity_bytes = kBudget;
    device_ = std::move(HostStandInDevice::Create(options)).value();
    device_queue_ = std::move(device_->CreateQueue()).value();
    backend_ = MakeDeviceTier(*device_, *device_queue_, 0);
  }

  void SetUpHost() {
    io::EngineOptions engine;
    engine.backend = io::BackendKind::kPsync;
    io_ = std::move(io::IoQueue::Create(std::move(io::CreateEngine(engine)).value())).value();
    io::SwapOptions swap;
    swap.alignment = 4096;
    swap_ = std::move(io::SwapSpace::Create({dir_.path()}, kBudget, swap)).value();
    extent_ = std::move(swap_->Allocate(kBytes)).value();
    backend_ = MakeHostTier(MakePool("host tier"), *io_, swap_->files());
  }

  LowerCopy Lower() { return LowerCopy{extent_.offset, staging_->span().first(kBytes)}; }

  // Puts `bytes` into the tier below (the swap extent below HOST, the staging buffer below
  // DEVICE), and reads them back.
  void WriteLower(const std::vector<std::byte>& bytes) {
    std::memcpy(staging_->data(), bytes.data(), kBytes);
    if (GetParam() != Tier::kHost) return;
    io::IoRequest write{io::Op::kWrite, &swap_->files(), extent_.offset, Lower().host};
    ASSERT_TRUE(io_->Wait(std::move(io_->Submit(write)).value()).ok());
  }
  std::vector<std::byte> ReadLower() {
    if (GetParam() == Tier::kHost) {
      io::IoRequest read{io::Op::kRead, &swap_->files(), extent_.offset, Lower().host};
      EXPECT_TRUE(io_->Wait(std::move(io_->Submit(read)).value()).ok());
    }
    return {staging_->data(), staging_->data() + kBytes};
  }

  TempDir dir_;
  PinnedMemoryPool staging_pool_ = MakePool("staging");
  Result<PinnedBuffer> staging_ = staging_pool_.Allocate(kBytes);
  std::unique_ptr<HostStandInDevice> device_;
  std::unique_ptr<DeviceQueue> device_queue_;
  std::unique_ptr<io::IoQueue> io_;
  std::unique_ptr<io::SwapSpace> swap_;
  io::Extent extent_;
  std::unique_ptr<TierBackend> backend_;
};

TEST_P(TierBackendTest, ReportsItsTier) { EXPECT_EQ(backend_->tier(), GetParam()); }

TEST_P(TierBackendTest, BytesRoundTripThroughTheTierBelow) {
  const std::vector<std::byte> pattern = Pattern(1);
  WriteLower(pattern);
  Result<TierMemory> memory = backend_->Allocate(kBytes);
  ASSERT_TRUE(memory.ok()) << memory.status().ToString();
  Result<Transfer> in = backend_->CopyIn(Lower(), *memory, kBytes);
  ASSERT_TRUE(in.ok()) << in.status().ToString();
  ASSERT_TRUE(backend_->Wait(*in).ok());
  WriteLower(std::vector<std::byte>(kBytes));
  Result<Transfer> out = backend_->CopyOut(*memory, Lower(), kBytes);
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  ASSERT_TRUE(backend_->Wait(*out).ok());
  EXPECT_EQ(ReadLower(), pattern);
}

TEST_P(TierBackendTest, PollReturnsTheStatusOnceTheTransferFinished) {
  WriteLower(Pattern(2));
  Result<TierMemory> memory = backend_->Allocate(kBytes);
  ASSERT_TRUE(memory.ok());
  Result<Transfer> in = backend_->CopyIn(Lower(), *memory, kBytes);
  ASSERT_TRUE(in.ok());
  std::optional<Status> outcome;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!outcome && std::chrono::steady_clock::now() < deadline) {
    outcome = backend_->Poll(*in);
    if (!outcome) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_TRUE(outcome.has_value());
  EXPECT_TRUE(outcome->ok()) << outcome->ToString();
}

TEST_P(TierBackendTest, FreedMemoryIsReusedForTheSameSize) {
  Result<TierMemory> first = backend_->Allocate(kBytes);
  ASSERT_TRUE(first.ok());
  std::byte* const data = first->data();
  ASSERT_NE(data, nullptr);
  backend_->Free(kBytes, std::move(first).value());
  Result<TierMemory> second = backend_->Allocate(kBytes);
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(second->data(), data);
  EXPECT_FALSE(second->empty());
}

TEST_P(TierBackendTest, SparesAreGivenUpWhenAnAllocationNeedsTheRoom) {
  Result<TierMemory> small = backend_->Allocate(kBytes);
  ASSERT_TRUE(small.ok());
  backend_->Free(kBytes, std::move(small).value());
  // The whole budget: fits only once the spare of another size is given up.
  Result<TierMemory> whole = backend_->Allocate(kBudget);
  ASSERT_TRUE(whole.ok()) << whole.status().ToString();
  Result<TierMemory> more = backend_->Allocate(kBytes);
  ASSERT_FALSE(more.ok());
  EXPECT_EQ(more.status().code(), StatusCode::kOutOfMemory);
}

TEST_P(TierBackendTest, HostMemoryIsAddressableAsASpanOnlyOnHost) {
  Result<TierMemory> memory = backend_->Allocate(kBytes);
  ASSERT_TRUE(memory.ok());
  EXPECT_EQ(memory->host_span(kBytes).size(), GetParam() == Tier::kHost ? kBytes : 0u);
  EXPECT_EQ(memory->device() != nullptr, GetParam() == Tier::kDevice);
}

std::string TierParamName(const ::testing::TestParamInfo<Tier>& info) {
  return std::string(TierName(info.param));
}

INSTANTIATE_TEST_SUITE_P(Tiers, TierBackendTest, ::testing::Values(Tier::kHost, Tier::kDevice),
                         TierParamName);

}  // namespace
}  // namespace zoe::offload
