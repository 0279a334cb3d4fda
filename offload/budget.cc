#include "offload/budget.h"

#include <fmt/format.h>

#include <algorithm>

namespace zoe::offload {

Budget::Budget(std::string name, uint64_t capacity_bytes)
    : name_(std::move(name)), capacity_(capacity_bytes) {}

Status Budget::CheckFitsAtAll(uint64_t bytes) const {
  if (bytes <= capacity_) return Status::Ok();
  return Status::OutOfMemory(fmt::format(
      "{}: a request of {} bytes exceeds the whole budget of {} bytes; raise the budget or use "
      "smaller chunks",
      name_, bytes, capacity_));
}

void Budget::Grant(uint64_t bytes) {
  reserved_ += bytes;
  peak_ = std::max(peak_, reserved_);
}

Status Budget::WaitFailure(StatusCode code, std::string_view why, uint64_t bytes) const {
  return Status(code, fmt::format("{}: {} while waiting for {} bytes ({} of {} bytes reserved, {} "
                                  "waiting)",
                                  name_, why, bytes, reserved_, capacity_, queue_.size()));
}

Status Budget::TryReserve(uint64_t bytes) {
  ZOE_RETURN_IF_ERROR(CheckFitsAtAll(bytes));
  std::lock_guard lock(mutex_);
  if (!queue_.empty() || bytes > capacity_ - reserved_) {
    return Status::Busy(
        fmt::format("{}: {} bytes do not fit now ({} of {} bytes reserved, {} waiting)", name_,
                    bytes, reserved_, capacity_, queue_.size()));
  }
  Grant(bytes);
  return Status::Ok();
}

// The waiter joins the queue and sleeps until it is at the head and its bytes fit. Leaving the
// queue (served, timed out or cancelled) wakes the others, because the new head may now fit.
Status Budget::Reserve(uint64_t bytes, const ReserveOptions& options) {
  ZOE_RETURN_IF_ERROR(CheckFitsAtAll(bytes));
  if (bytes == 0) return Status::Ok();  // nothing to wait for
  const auto deadline = options.timeout ? std::chrono::steady_clock::now() + *options.timeout
                                        : std::chrono::steady_clock::time_point::max();
  std::unique_lock lock(mutex_);
  const Queue::iterator self = queue_.insert(queue_.end(), bytes);
  Status outcome;
  for (;;) {
    if (options.cancelled && options.cancelled()) {
      outcome = WaitFailure(StatusCode::kAborted, "cancelled", bytes);
      break;
    }
    if (queue_.begin() == self && bytes <= capacity_ - reserved_) {
      Grant(bytes);
      break;
    }
    if (!options.timeout) {
      changed_.wait(lock);
    } else if (changed_.wait_until(lock, deadline) == std::cv_status::timeout) {
      if (queue_.begin() == self && bytes <= capacity_ - reserved_) continue;  // freed just now
      outcome = WaitFailure(StatusCode::kBusy, "timed out", bytes);
      break;
    }
  }
  queue_.erase(self);
  lock.unlock();
  changed_.notify_all();
  return outcome;
}

Status Budget::Release(uint64_t bytes) {
  {
    std::lock_guard lock(mutex_);
    if (bytes > reserved_) {
      return Status::Internal(fmt::format("{}: release of {} bytes exceeds the {} bytes reserved",
                                          name_, bytes, reserved_));
    }
    reserved_ -= bytes;
  }
  changed_.notify_all();
  return Status::Ok();
}

void Budget::WakeWaiters() {
  { std::lock_guard lock(mutex_); }  // orders the caller's change before the waiters' re-check
  changed_.notify_all();
}

uint64_t Budget::reserved() const {
  std::lock_guard lock(mutex_);
  return reserved_;
}

uint64_t Budget::available() const {
  std::lock_guard lock(mutex_);
  return capacity_ - reserved_;
}

uint64_t Budget::peak_reserved() const {
  std::lock_guard lock(mutex_);
  return peak_;
}

size_t Budget::waiting() const {
  std::lock_guard lock(mutex_);
  return queue_.size();
}

}  // namespace zoe::offload
