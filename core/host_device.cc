#include "core/host_device.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <thread>
#include <utility>

#include "core/aligned_buffer.h"
#include "core/log.h"

namespace zoe {
namespace {

constexpr size_t kDeviceAlignment = 256;  // what cudaMalloc guarantees

// Completion state of one copy, set once by the queue's worker.
class HostEvent final : public DeviceEvent::Impl {
 public:
  bool Poll() override { return done_.load(std::memory_order_acquire); }

  Status Wait() override {
    std::unique_lock lock(mutex_);
    finished_.wait(lock, [&] { return done_.load(std::memory_order_relaxed); });
    return status_;
  }

  void Complete(Status status) {
    {
      std::lock_guard lock(mutex_);
      status_ = std::move(status);
      done_.store(true, std::memory_order_release);
    }
    finished_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable finished_;
  std::atomic<bool> done_{false};
  Status status_;
};

}  // namespace

// One worker thread draining a FIFO of copies: submission order is completion order.
class HostStandInDevice::Queue final : public DeviceQueue {
 public:
  explicit Queue(HostStandInDevice& device) : DeviceQueue(device), device_(device) {
    worker_ = std::thread([this] { Run(); });
  }

  ~Queue() override {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    changed_.notify_all();
    worker_.join();  // the worker drains the FIFO before it exits
    device_.Unregister(this);
  }

  Status Synchronize() override {
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [&] { return completed_ == submitted_; });
    return std::exchange(first_error_, Status::Ok());
  }

 protected:
  Result<DeviceEvent> Submit(const CopyRequest& request) override {
    auto event = std::make_shared<HostEvent>();
    {
      std::lock_guard lock(mutex_);
      // Poisoned now only when no earlier copy of this queue, which may still read the
      // destination, is pending or running; otherwise when the copy starts.
      if (adversarial() && completed_ == submitted_) Poison(request);
      pending_.push_back({request, event});
      ++submitted_;
    }
    changed_.notify_all();
    return DeviceEvent(event);
  }

 private:
  struct Task {
    CopyRequest request;
    std::shared_ptr<HostEvent> event;
  };

  void Run() {
    std::unique_lock lock(mutex_);
    while (true) {
      changed_.wait(lock, [&] { return stopping_ || !pending_.empty(); });
      if (pending_.empty()) return;  // stopping, and nothing left
      Task task = std::move(pending_.front());
      pending_.pop_front();
      lock.unlock();
      Status status = Execute(task.request);
      lock.lock();
      if (!status.ok() && first_error_.ok()) first_error_ = status;
      ++completed_;
      task.event->Complete(std::move(status));
      changed_.notify_all();
    }
  }

  bool adversarial() const { return device_.options_.adversarial_delay.count() > 0; }

  static void Poison(const CopyRequest& request) {
    std::memset(request.dst, static_cast<int>(kPoisonByte), request.bytes);
  }

  Status Execute(const CopyRequest& request) const {
    if (adversarial()) {
      Poison(request);
      std::this_thread::sleep_for(device_.options_.adversarial_delay);
    }
    if (device_.options_.before_copy) {
      Status injected = device_.options_.before_copy(request.kind, request.bytes);
      if (!injected.ok()) {
        return injected.WithContext(
            fmt::format("{} copy of {} bytes", CopyKindName(request.kind), request.bytes));
      }
    }
    std::memcpy(request.dst, request.src, request.bytes);
    return Status::Ok();
  }

  HostStandInDevice& device_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::deque<Task> pending_;
  uint64_t submitted_ = 0;
  uint64_t completed_ = 0;
  Status first_error_;
  bool stopping_ = false;
  std::thread worker_;  // last: started after every member above exists
};

HostStandInDevice::HostStandInDevice(HostStandInOptions options)
    : DeviceBackend(options.capacity_bytes), options_(std::move(options)) {}

HostStandInDevice::~HostStandInDevice() {
  std::lock_guard lock(queues_mutex_);
  if (!queues_.empty() || used_bytes() != 0) {
    ZOE_LOG_ERROR("device 'host stand-in' destroyed with {} live queues and {} bytes allocated",
                  queues_.size(), used_bytes());
  }
}

Result<std::unique_ptr<HostStandInDevice>> HostStandInDevice::Create(HostStandInOptions options) {
  if (options.capacity_bytes == 0) {
    return Status::InvalidArgument(
        "the host stand-in device needs a capacity in bytes greater than 0");
  }
  return std::unique_ptr<HostStandInDevice>(new HostStandInDevice(std::move(options)));
}

Result<std::unique_ptr<DeviceQueue>> HostStandInDevice::CreateQueue() {
  auto queue = std::make_unique<Queue>(*this);
  std::lock_guard lock(queues_mutex_);
  queues_.push_back(queue.get());
  return std::unique_ptr<DeviceQueue>(std::move(queue));
}

Status HostStandInDevice::Synchronize() {
  std::lock_guard lock(queues_mutex_);
  Status first;
  for (Queue* queue : queues_) {
    Status status = queue->Synchronize();
    if (first.ok()) first = std::move(status);
  }
  return first;
}

void HostStandInDevice::Unregister(Queue* queue) {
  std::lock_guard lock(queues_mutex_);
  queues_.erase(std::remove(queues_.begin(), queues_.end(), queue), queues_.end());
}

Result<void*> HostStandInDevice::AllocateMemory(uint64_t bytes) {
  void* memory = std::aligned_alloc(kDeviceAlignment, AlignUp(bytes, kDeviceAlignment));
  if (memory == nullptr) {
    return Status::OutOfMemory(fmt::format("host memory for {} bytes was refused", bytes));
  }
  return memory;
}

void HostStandInDevice::FreeMemory(void* data, uint64_t) { std::free(data); }

Result<std::chrono::microseconds> AdversarialDelayFromEnv() {
  const char* value = std::getenv("ZOE_DEVICE_ADVERSARIAL_US");
  if (value == nullptr || *value == '\0') return std::chrono::microseconds(0);
  char* end = nullptr;
  errno = 0;
  const long long micros = std::strtoll(value, &end, 10);
  if (*end != '\0' || errno != 0 || micros < 0) {
    return Status::InvalidArgument(fmt::format(
        "ZOE_DEVICE_ADVERSARIAL_US='{}' is not a delay; allowed: a whole number of microseconds "
        ">= 0 (0: the stand-in's adversarial mode off)",
        value));
  }
  return std::chrono::microseconds(micros);
}

}  // namespace zoe
