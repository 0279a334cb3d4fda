// Description: device backends: one conformance suite (allocation budget, async copies, ordering,
// range checks) run on every backend present, plus the stand-in's fault hook and the factory.
#include "core/device.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <numeric>
#include <vector>

#include "core/host_device.h"
#include "core/log.h"

namespace zoe {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kCapacity = 1 << 20;
constexpr std::chrono::microseconds kAdversarialDelay{2000};

std::vector<std::byte> Pattern(size_t bytes, unsigned seed) {
  std::vector<std::byte> data(bytes);
  for (size_t i = 0; i < bytes; ++i) data[i] = static_cast<std::byte>((i * 131 + seed) & 0xff);
  return data;
}

// ---------------------------------------------------------------------------------------------
// Conformance: every backend that exists here

// "host-adversarial" is the stand-in in adversarial mode: every copy late, its destination poison
// until then, so a test that forgot a wait fails there.
Result<std::unique_ptr<DeviceBackend>> CreateForTest(std::string_view kind) {
  if (kind != "host-adversarial") return CreateDeviceBackend(kind, kCapacity);
  ZOE_ASSIGN_OR_RETURN(auto device,
                       HostStandInDevice::Create(
                           {.capacity_bytes = kCapacity, .adversarial_delay = kAdversarialDelay}));
  return std::unique_ptr<DeviceBackend>(std::move(device));
}

class DeviceConformance : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    auto backend = CreateForTest(GetParam());
    if (!backend.ok() && backend.status().code() == StatusCode::kNotSupported) {
      GTEST_SKIP() << GetParam() << " backend absent: " << backend.status().ToString();
    }
    ASSERT_TRUE(backend.ok()) << backend.status().ToString();
    device_ = std::move(backend).value();
    auto queue = device_->CreateQueue();
    ASSERT_TRUE(queue.ok()) << queue.status().ToString();
    queue_ = std::move(queue).value();
  }
  void TearDown() override {
    queue_.reset();
    device_.reset();
  }

  DeviceAllocation Allocate(uint64_t bytes) {
    auto allocation = device_->Allocate(bytes);
    EXPECT_TRUE(allocation.ok()) << allocation.status().ToString();
    return allocation.ok() ? std::move(allocation).value() : DeviceAllocation();
  }

  std::unique_ptr<DeviceBackend> device_;
  std::unique_ptr<DeviceQueue> queue_;
};

TEST_P(DeviceConformance, ReportsItselfAndItsBudget) {
  EXPECT_FALSE(device_->name().empty());
  EXPECT_EQ(device_->is_real_gpu(), std::string(GetParam()) == "cuda");
  EXPECT_EQ(device_->capacity_bytes(), kCapacity);
  EXPECT_EQ(device_->used_bytes(), 0u);
}

TEST_P(DeviceConformance, AllocationsCountAgainstCapacityUntilDestroyed) {
  DeviceAllocation a = Allocate(kCapacity / 2);
  EXPECT_EQ(a.size(), kCapacity / 2);
  EXPECT_EQ(a.backend(), device_.get());
  {
    DeviceAllocation b = Allocate(kCapacity / 4);
    EXPECT_EQ(device_->used_bytes(), 3 * kCapacity / 4);
    DeviceAllocation moved = std::move(b);
    EXPECT_TRUE(b.empty());
    EXPECT_EQ(device_->used_bytes(), 3 * kCapacity / 4);
  }
  EXPECT_EQ(device_->used_bytes(), kCapacity / 2);
  DeviceAllocation empty = Allocate(0);
  EXPECT_TRUE(empty.empty());
  EXPECT_EQ(device_->used_bytes(), kCapacity / 2);
}

// What a caller hands over as host memory is checked against this (Engine::CheckHostMemory).
TEST_P(DeviceConformance, HoldsTellsItsLiveAllocationsFromOtherMemory) {
  std::vector<std::byte> host(64);
  const std::byte* start = nullptr;
  {
    DeviceAllocation a = Allocate(4096);
    start = static_cast<const std::byte*>(a.data());
    EXPECT_TRUE(device_->Holds(start, 1));
    EXPECT_TRUE(device_->Holds(start + 4095, 1));
    EXPECT_TRUE(device_->Holds(start + 100, 8192));  // runs past its end
    EXPECT_TRUE(device_->Holds(start - 8, 16));      // begins before it
    EXPECT_FALSE(device_->Holds(start - 8, 8));      // ends where it begins
    EXPECT_FALSE(device_->Holds(start + 4096, 64));
    EXPECT_FALSE(device_->Holds(host.data(), host.size()));
    EXPECT_FALSE(device_->Holds(nullptr, 0));
  }
  EXPECT_FALSE(device_->Holds(start, 1));  // freed
}

TEST_P(DeviceConformance, AllocationBeyondCapacityIsOutOfMemoryNamingTheNumbers) {
  DeviceAllocation held = Allocate(kCapacity - 4096);
  auto refused = device_->Allocate(8192);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kOutOfMemory);
  EXPECT_EQ(refused.status().message(),
            "device '" + device_->name() +
                "': cannot allocate 8192 bytes: 1044480 of 1048576 bytes in use, 4096 available");
  EXPECT_EQ(device_->used_bytes(), kCapacity - 4096);
  EXPECT_TRUE(device_->Allocate(4096).ok());
}

TEST_P(DeviceConformance, RoundTripThroughDeviceMemory) {
  const std::vector<std::byte> source = Pattern(64 * 1024, 3);
  std::vector<std::byte> back(source.size());
  DeviceAllocation a = Allocate(source.size());
  DeviceAllocation b = Allocate(source.size());
  auto up = queue_->CopyToDevice(source, {&a, 0});
  ASSERT_TRUE(up.ok()) << up.status().ToString();
  auto across = queue_->CopyOnDevice({&a, 0}, {&b, 0}, source.size());
  ASSERT_TRUE(across.ok()) << across.status().ToString();
  auto down = queue_->CopyToHost({&b, 0}, back);
  ASSERT_TRUE(down.ok()) << down.status().ToString();
  EXPECT_TRUE(down->Wait().ok());
  EXPECT_TRUE(up->Ready());
  EXPECT_TRUE(across->Ready());
  EXPECT_TRUE(down->Ready());
  EXPECT_EQ(back, source);
}

TEST_P(DeviceConformance, CopiesAtOffsetsTouchOnlyTheirRange) {
  DeviceAllocation a = Allocate(3 * 4096);
  const std::vector<std::byte> zeros(3 * 4096, std::byte{0});
  const std::vector<std::byte> middle = Pattern(4096, 9);
  ASSERT_TRUE(queue_->CopyToDevice(zeros, {&a, 0}).ok());
  ASSERT_TRUE(queue_->CopyToDevice(middle, {&a, 4096}).ok());
  std::vector<std::byte> back(3 * 4096);
  auto down = queue_->CopyToHost({&a, 0}, back);
  ASSERT_TRUE(down.ok());
  ASSERT_TRUE(down->Wait().ok());
  EXPECT_TRUE(std::equal(back.begin(), back.begin() + 4096, zeros.begin()));
  EXPECT_TRUE(std::equal(back.begin() + 4096, back.begin() + 8192, middle.begin()));
  EXPECT_TRUE(std::equal(back.begin() + 8192, back.end(), zeros.begin()));
}

TEST_P(DeviceConformance, CopiesOnOneQueueCompleteInSubmissionOrder) {
  // Many writes to the same place: in-order execution leaves the last one's bytes.
  DeviceAllocation a = Allocate(4096);
  std::vector<std::vector<std::byte>> versions;
  for (unsigned v = 0; v < 32; ++v) versions.push_back(Pattern(4096, v));
  std::vector<DeviceEvent> events;
  for (const auto& version : versions) {
    auto event = queue_->CopyToDevice(version, {&a, 0});
    ASSERT_TRUE(event.ok());
    events.push_back(*event);
  }
  std::vector<std::byte> back(4096);
  auto down = queue_->CopyToHost({&a, 0}, back);
  ASSERT_TRUE(down.ok());
  ASSERT_TRUE(down->Wait().ok());
  for (const DeviceEvent& event : events) EXPECT_TRUE(event.Ready());
  EXPECT_EQ(back, versions.back());
}

TEST_P(DeviceConformance, SynchronizeWaitsForEveryQueue) {
  auto second = device_->CreateQueue();
  ASSERT_TRUE(second.ok());
  DeviceAllocation a = Allocate(256 * 1024);
  DeviceAllocation b = Allocate(256 * 1024);
  const std::vector<std::byte> source = Pattern(256 * 1024, 5);
  std::vector<std::byte> back_a(source.size()), back_b(source.size());
  std::vector<DeviceEvent> events;
  events.push_back(*queue_->CopyToDevice(source, {&a, 0}));
  events.push_back(*(*second)->CopyToDevice(source, {&b, 0}));
  events.push_back(*queue_->CopyToHost({&a, 0}, back_a));
  events.push_back(*(*second)->CopyToHost({&b, 0}, back_b));
  ASSERT_TRUE(device_->Synchronize().ok());
  for (const DeviceEvent& event : events) EXPECT_TRUE(event.Ready());
  EXPECT_EQ(back_a, source);
  EXPECT_EQ(back_b, source);
  EXPECT_TRUE(queue_->Synchronize().ok());
}

TEST_P(DeviceConformance, EmptyCopiesCompleteImmediately) {
  DeviceAllocation a = Allocate(4096);
  auto event = queue_->CopyToDevice({}, {&a, 4096});
  ASSERT_TRUE(event.ok());
  EXPECT_TRUE(event->Ready());
  EXPECT_TRUE(event->Wait().ok());
}

TEST_P(DeviceConformance, CopiesOutsideTheirAllocationAreRejectedBeforeSubmission) {
  DeviceAllocation a = Allocate(4096);
  DeviceAllocation b = Allocate(4096);
  std::vector<std::byte> host(4097);
  auto too_long = queue_->CopyToDevice(host, {&a, 0});
  ASSERT_FALSE(too_long.ok());
  EXPECT_EQ(too_long.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(too_long.status().message(),
            "host-to-device destination range of 4097 bytes at offset 0 exceeds its device "
            "allocation of 4096 bytes");
  auto past_end = queue_->CopyToHost({&a, 4000}, std::span(host).first(100));
  EXPECT_EQ(past_end.status().message(),
            "device-to-host source range of 100 bytes at offset 4000 exceeds its device "
            "allocation of 4096 bytes");
  auto huge_offset = queue_->CopyToHost({&a, UINT64_MAX}, std::span(host).first(2));
  EXPECT_EQ(huge_offset.status().code(), StatusCode::kInvalidArgument);
  auto d2d = queue_->CopyOnDevice({&a, 0}, {&b, 1}, 4096);
  EXPECT_EQ(d2d.status().message(),
            "device-to-device destination range of 4096 bytes at offset 1 exceeds its device "
            "allocation of 4096 bytes");
  auto overlap = queue_->CopyOnDevice({&a, 0}, {&a, 1024}, 2048);
  EXPECT_EQ(overlap.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(overlap.status().message()), HasSubstr("overlaps itself"));
  EXPECT_TRUE(queue_->CopyOnDevice({&a, 0}, {&a, 2048}, 2048).ok()) << "disjoint halves are fine";
  auto null_target = queue_->CopyToDevice(host, {nullptr, 0});
  EXPECT_EQ(null_target.status().message(),
            "host-to-device destination is not an allocation of device '" + device_->name() + "'");
  EXPECT_TRUE(queue_->Synchronize().ok());
}

TEST_P(DeviceConformance, AllocationsOfAnotherBackendAreRejected) {
  auto other = HostStandInDevice::Create({.capacity_bytes = 4096});
  ASSERT_TRUE(other.ok());
  auto foreign = (*other)->Allocate(4096);
  ASSERT_TRUE(foreign.ok());
  std::vector<std::byte> host(4096);
  auto copy = queue_->CopyToDevice(host, {&*foreign, 0});
  EXPECT_EQ(copy.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(copy.status().message()), HasSubstr("is not an allocation of device"));
}

INSTANTIATE_TEST_SUITE_P(Backends, DeviceConformance,
                         ::testing::Values("host", "host-adversarial", "cuda"),
                         [](const auto& param_info) {
                           std::string name = param_info.param;
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

// ---------------------------------------------------------------------------------------------
// The host stand-in specifically

// Holds every copy of a stand-in device until Open() is called; counts copies in arrival order.
class Gate {
 public:
  Status Pass(CopyKind, uint64_t bytes) {
    std::unique_lock lock(mutex_);
    order_.push_back(bytes);
    opened_cv_.wait(lock, [&] { return open_; });
    return Status::Ok();
  }
  void Open() {
    {
      std::lock_guard lock(mutex_);
      open_ = true;
    }
    opened_cv_.notify_all();
  }
  std::vector<uint64_t> order() {
    std::lock_guard lock(mutex_);
    return order_;
  }

 private:
  std::mutex mutex_;
  std::condition_variable opened_cv_;
  bool open_ = false;
  std::vector<uint64_t> order_;
};

TEST(HostStandIn, CopiesCompleteAsynchronouslyAfterSubmissionReturns) {
  Gate gate;
  auto device = HostStandInDevice::Create(
      {.capacity_bytes = kCapacity,
       .before_copy = [&](CopyKind kind, uint64_t bytes) { return gate.Pass(kind, bytes); }});
  ASSERT_TRUE(device.ok());
  auto queue = (*device)->CreateQueue();
  ASSERT_TRUE(queue.ok());
  auto a = (*device)->Allocate(8192);
  ASSERT_TRUE(a.ok());
  const std::vector<std::byte> source = Pattern(8192, 1);
  std::vector<DeviceEvent> events;
  for (uint64_t bytes = 1024; bytes <= 8192; bytes += 1024) {
    auto event = (*queue)->CopyToDevice(std::span(source).first(bytes), {&*a, 0});
    ASSERT_TRUE(event.ok());
    events.push_back(*event);
  }
  // The gate is closed: submission returned, yet no copy can have finished.
  for (const DeviceEvent& event : events) EXPECT_FALSE(event.Ready());
  gate.Open();
  for (const DeviceEvent& event : events) EXPECT_TRUE(event.Wait().ok());
  std::vector<uint64_t> expected(8);
  std::iota(expected.begin(), expected.end(), 1);
  for (auto& e : expected) e *= 1024;
  EXPECT_EQ(gate.order(), expected);
  EXPECT_EQ(std::memcmp(a->data(), source.data(), source.size()), 0);
}

TEST(HostStandIn, InjectedCopyFailureReachesTheEventAndSynchronize) {
  std::atomic<int> copies{0};
  auto device = HostStandInDevice::Create(
      {.capacity_bytes = kCapacity, .before_copy = [&](CopyKind kind, uint64_t) {
         if (copies++ == 1 && kind == CopyKind::kDeviceToHost) return Status::IoError("link reset");
         return Status::Ok();
       }});
  ASSERT_TRUE(device.ok());
  auto queue = (*device)->CreateQueue();
  auto a = (*device)->Allocate(4096);
  ASSERT_TRUE(queue.ok() && a.ok());
  const std::vector<std::byte> source = Pattern(4096, 2);
  std::vector<std::byte> back(4096, std::byte{0x5a});
  auto up = (*queue)->CopyToDevice(source, {&*a, 0});
  auto down = (*queue)->CopyToHost({&*a, 0}, back);
  auto again = (*queue)->CopyToHost({&*a, 0}, std::span(back).first(16));
  ASSERT_TRUE(up.ok() && down.ok() && again.ok());
  Status failed = down->Wait();
  EXPECT_EQ(failed.code(), StatusCode::kIoError);
  EXPECT_EQ(failed.message(), "device-to-host copy of 4096 bytes: link reset");
  EXPECT_TRUE(up->Wait().ok());
  EXPECT_TRUE(again->Wait().ok()) << "a failure does not poison later copies";
  EXPECT_TRUE(std::equal(back.begin(), back.begin() + 16, source.begin()));
  EXPECT_EQ(back[16], std::byte{0x5a}) << "the failed copy wrote nothing";
  EXPECT_EQ((*queue)->Synchronize().code(), StatusCode::kIoError);
  EXPECT_TRUE((*queue)->Synchronize().ok()) << "Synchronize reports a failure once";
}

TEST(HostStandIn, DestroyingAQueueFinishesItsCopies) {
  auto device = HostStandInDevice::Create({.capacity_bytes = kCapacity});
  ASSERT_TRUE(device.ok());
  auto a = (*device)->Allocate(kCapacity);
  ASSERT_TRUE(a.ok());
  const std::vector<std::byte> source = Pattern(kCapacity, 8);
  DeviceEvent event;
  {
    auto queue = (*device)->CreateQueue();
    ASSERT_TRUE(queue.ok());
    event = *(*queue)->CopyToDevice(source, {&*a, 0});
  }
  EXPECT_TRUE(event.Ready());
  EXPECT_EQ(std::memcmp(a->data(), source.data(), source.size()), 0);
}

TEST(HostStandIn, ConcurrentSubmittersOnSharedQueues) {
  auto device = HostStandInDevice::Create({.capacity_bytes = kCapacity});
  ASSERT_TRUE(device.ok());
  auto queue = (*device)->CreateQueue();
  ASSERT_TRUE(queue.ok());
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      auto a = (*device)->Allocate(16 * 1024);
      ASSERT_TRUE(a.ok());
      const std::vector<std::byte> source = Pattern(16 * 1024, t);
      std::vector<std::byte> back(source.size());
      for (int i = 0; i < 20; ++i) {
        ASSERT_TRUE((*queue)->CopyToDevice(source, {&*a, 0}).ok());
        auto down = (*queue)->CopyToHost({&*a, 0}, back);
        ASSERT_TRUE(down.ok());
        ASSERT_TRUE(down->Wait().ok());
        ASSERT_EQ(back, source);
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ((*device)->used_bytes(), 0u);
}

bool AllPoison(std::span<const std::byte> bytes) {
  return std::all_of(bytes.begin(), bytes.end(), [](std::byte b) { return b == kPoisonByte; });
}

// A deliberately missing wait: the adversarial stand-in shows poison (NaN floats) where a fast
// worker would have let the read pass by luck; the same reads after the wait see the data. The
// wait-less reads race with the copy on purpose, so ThreadSanitizer would rightly report them.
TEST(HostStandIn, AdversarialModeShowsPoisonToAReadWithoutWait) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "the test reads a copy's destination without waiting, on purpose";
#endif
  auto device = HostStandInDevice::Create(
      {.capacity_bytes = kCapacity, .adversarial_delay = std::chrono::milliseconds(250)});
  ASSERT_TRUE(device.ok());
  auto queue = (*device)->CreateQueue();
  auto a = (*device)->Allocate(4096);
  ASSERT_TRUE(queue.ok() && a.ok());
  std::vector<float> source(1024, 1.5f);
  std::vector<float> back(1024, 0.0f);
  auto up = (*queue)->CopyToDevice(std::as_bytes(std::span(source)), {&*a, 0});
  ASSERT_TRUE(up.ok());
  ASSERT_TRUE(up->Wait().ok());
  auto down = (*queue)->CopyToHost({&*a, 0}, std::as_writable_bytes(std::span(back)));
  ASSERT_TRUE(down.ok());
  EXPECT_FALSE(down->Ready());
  EXPECT_TRUE(std::isnan(back[0])) << "read before the wait: the forgotten wait is caught";
  EXPECT_TRUE(AllPoison(std::as_bytes(std::span(back))));
  ASSERT_TRUE(down->Wait().ok());
  EXPECT_EQ(back, source);
}

TEST(HostStandIn, AdversarialModePoisonsACopyQueuedBehindAnotherOnlyWhenItStarts) {
  auto device = HostStandInDevice::Create(
      {.capacity_bytes = kCapacity, .adversarial_delay = std::chrono::milliseconds(5)});
  ASSERT_TRUE(device.ok());
  auto queue = (*device)->CreateQueue();
  auto a = (*device)->Allocate(4096);
  ASSERT_TRUE(queue.ok() && a.ok());
  const std::vector<std::byte> first = Pattern(4096, 1);
  const std::vector<std::byte> second = Pattern(4096, 2);  // borrowed until the copy completes
  std::vector<std::byte> back(4096);
  // The second copy overwrites what the first reads: in-order execution must still hold.
  ASSERT_TRUE((*queue)->CopyToDevice(first, {&*a, 0}).ok());
  auto down = (*queue)->CopyToHost({&*a, 0}, back);
  auto overwrite = (*queue)->CopyToDevice(second, {&*a, 0});
  ASSERT_TRUE(down.ok() && overwrite.ok());
  ASSERT_TRUE((*queue)->Synchronize().ok());
  EXPECT_EQ(back, first);
}

TEST(AdversarialDelayFromEnv, ReadsMicrosecondsAndRejectsOtherText) {
  ASSERT_EQ(setenv("ZOE_DEVICE_ADVERSARIAL_US", "250", 1), 0);
  auto delay = AdversarialDelayFromEnv();
  ASSERT_TRUE(delay.ok());
  EXPECT_EQ(delay->count(), 250);
  ASSERT_EQ(setenv("ZOE_DEVICE_ADVERSARIAL_US", "soon", 1), 0);
  auto bad = AdversarialDelayFromEnv();
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("ZOE_DEVICE_ADVERSARIAL_US='soon'"));
  EXPECT_EQ(CreateDeviceBackend("host", kCapacity).status().code(), StatusCode::kInvalidArgument);
  ASSERT_EQ(unsetenv("ZOE_DEVICE_ADVERSARIAL_US"), 0);
  EXPECT_EQ(AdversarialDelayFromEnv()->count(), 0);
}

TEST(HostStandIn, ZeroCapacityIsRejected) {
  auto device = HostStandInDevice::Create({});
  ASSERT_FALSE(device.ok());
  EXPECT_EQ(device.status().code(), StatusCode::kInvalidArgument);
}

// ---------------------------------------------------------------------------------------------
// Factory

TEST(CreateDeviceBackend, UnknownKindListsTheAllowedOnes) {
  auto backend = CreateDeviceBackend("tpu", kCapacity);
  ASSERT_FALSE(backend.ok());
  EXPECT_EQ(backend.status().message(),
            "device backend 'tpu' is unknown; allowed: auto, cuda, host");
}

TEST(CreateDeviceBackend, AutoPicksCudaWhenPresentElseTheStandInAndLogsWhy) {
  ASSERT_TRUE(log::SetLevel("info").ok());
  log::ScopedCapture capture;
  auto backend = CreateDeviceBackend("auto", kCapacity);
  ASSERT_TRUE(log::SetLevel("warn").ok());
  ASSERT_TRUE(backend.ok()) << backend.status().ToString();
  auto cuda = CreateDeviceBackend("cuda", kCapacity);
  EXPECT_EQ((*backend)->is_real_gpu(), cuda.ok());
  if (cuda.ok()) {
    EXPECT_EQ(capture.Count("(auto: a CUDA device is present)"), 1u);
  } else {
    EXPECT_EQ(cuda.status().code(), StatusCode::kNotSupported);
    EXPECT_EQ((*backend)->name(), "host stand-in");
    EXPECT_EQ(capture.Count("device backend: host stand-in (auto: " +
                            std::string(cuda.status().message()) + ")"),
              1u);
  }
}

}  // namespace
}  // namespace zoe
