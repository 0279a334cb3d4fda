// HostStandInDevice: the device tier on a machine without a GPU. "Device memory" is host memory
// with its own capacity budget, and each queue owns a worker thread that performs its copies in
// submission order, so copies complete asynchronously exactly as they would on a CUDA stream and
// code above the device tier runs unchanged (and testably) without a GPU.
#pragma once

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
};

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
