// HostStandInDevice: the device tier on a machine without a GPU. "Device memory" is host memory
// with its own capacity budget, and each queue owns a worker thread that performs its copies in
// submission order, so copies complete asynchronously exactly as they would on a CUDA stream and
// code above the device tier runs unchanged (and testably) without a GPU.
//
// Adversarial mode (for tests): each copy completes only `adversarial_delay` after it starts, and
// its destination reads as poison (every byte kPoisonByte: NaN in fp32, bf16 and fp16) from the
// copy's submission -- or, behind earlier copies of its queue, from its start -- until it
// completes. Code that reads a destination before waiting for the copy's event (or the queue) then
// sees NaN instead of passing by luck because the worker happened to be fast.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/device.h"

namespace zoe {

struct HostStandInOptions {
  uint64_t capacity_bytes = 0;  // must be > 0
  // Runs on the queue's worker just before each copy. A non-OK Status fails that copy (nothing is
  // copied) and becomes its event's Status; blocking here holds the queue. For fault injection.
  std::function<Status(CopyKind kind, uint64_t bytes)> before_copy;
  // > 0: adversarial mode (see above) with this delay per copy; 0: off.
  std::chrono::microseconds adversarial_delay{0};
};

// What an adversarial destination holds until its copy completes.
inline constexpr std::byte kPoisonByte{0xff};

// The adversarial delay that ZOE_DEVICE_ADVERSARIAL_US asks for (a whole number of microseconds,
// >= 0), which CreateDeviceBackend gives the stand-in; 0 when unset. InvalidArgument naming the
// value otherwise.
Result<std::chrono::microseconds> AdversarialDelayFromEnv();

class HostStandInDevice final : public DeviceBackend {
 public:
  static Result<std::unique_ptr<HostStandInDevice>> Create(HostStandInOptions options);
  ~HostStandInDevice() override;

  std::string name() const override { return "host stand-in"; }
  bool is_real_gpu() const override { return false; }
  Result<std::unique_ptr<DeviceQueue>> CreateQueue() override;
  Status Synchronize() override;

 private:
  class Queue;
  explicit HostStandInDevice(HostStandInOptions options);

  Result<void*> AllocateMemory(uint64_t bytes) override;
  void FreeMemory(void* data, uint64_t bytes) override;
  void Unregister(Queue* queue);

  HostStandInOptions options_;
  std::mutex queues_mutex_;
  std::vector<Queue*> queues_;  // live queues, for Synchronize
};

}  // namespace zoe
