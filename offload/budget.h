// Budget: the bytes one tier may hold, handed out by reservation. It is never exceeded.
//
// Back-pressure: Reserve waits until enough bytes are released (by evictions finishing), in FIFO
// order, so a large request is not starved by a stream of small ones; TryReserve never waits and
// never jumps the queue, which makes it the right call for prefetches (they yield to demand).
// A request larger than the whole budget fails at once with OutOfMemory: waiting could never
// succeed. A wait can be bounded by a timeout (Busy) or a cancellation predicate (Aborted); a
// caller that changes what the predicate observes calls WakeWaiters() so waiters look again.
// Thread-safe.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <list>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>

#include "core/status.h"

namespace zoe::offload {

struct ReserveOptions {
  // Gives up with Busy when the bytes have not become free in this long; none: wait forever.
  std::optional<std::chrono::nanoseconds> timeout;
  // Gives up with Aborted once this returns true; checked on entry and on every wake-up.
  std::function<bool()> cancelled;
};

class Budget {
 public:
  // `name` prefixes messages ("device budget").
  Budget(std::string name, uint64_t capacity_bytes);
  Budget(const Budget&) = delete;
  Budget& operator=(const Budget&) = delete;

  // Waits until `bytes` fit and every earlier waiter has been served, then reserves them.
  Status Reserve(uint64_t bytes, const ReserveOptions& options = {});
  // Reserves `bytes` only if they fit now and nobody is waiting. OutOfMemory for a request above
  // the capacity, Busy when it does not fit now.
  Status TryReserve(uint64_t bytes);
  // Returns bytes; Internal (and no change) when more is released than is reserved.
  Status Release(uint64_t bytes);
  // Makes every waiter re-check its cancellation predicate.
  void WakeWaiters();

  uint64_t capacity() const { return capacity_; }
  uint64_t reserved() const;
  uint64_t available() const;
  uint64_t peak_reserved() const;
  size_t waiting() const;  // Reserve calls currently blocked

 private:
  using Queue = std::list<uint64_t>;  // the byte counts of waiting reservations, oldest first

  Status CheckFitsAtAll(uint64_t bytes) const;
  void Grant(uint64_t bytes);  // requires mutex_
  Status WaitFailure(StatusCode code, std::string_view why,
                     uint64_t bytes) const;  // requires mutex_

  const std::string name_;
  const uint64_t capacity_;
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  uint64_t reserved_ = 0;
  uint64_t peak_ = 0;
  Queue queue_;
};

}  // namespace zoe::offload
