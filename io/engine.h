// io::Engine: the raw asynchronous block-I/O interface every backend (io_uring, libaio, psync
// thread pool) implements, and EngineWrapper, which forwards every call to another engine so that
// decorators (fault injection, tracing) override only what they change.
//
// Contract of a raw engine:
//  - Submit() hands requests to the kernel (or the worker pool) and returns how many of them, a
//    prefix of the span, were accepted; the caller resubmits the rest later. At most
//    queue_depth() requests may be in flight at once. Accepted means handed over for good: each
//    will complete without further calls to Submit. A request not accepted (beyond the returned
//    prefix, or every request of a call that returned an error) is not in flight and never will
//    be: the caller may reuse its tag and free its buffer at once.
//  - Every accepted request produces exactly one RawCompletion carrying its tag and the raw
//    result: bytes transferred (possibly fewer than asked) or -errno. Raw engines never retry,
//    never resubmit short transfers and never validate alignment; io::IoQueue does that.
//  - Submit() and Reap() may run at the same time on two different threads (one submitter and one
//    reaper at a time); RegisterBuffers/RegisterFile/UnregisterFile are called with no request in
//    flight that uses the buffer or file being changed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include "core/result.h"

namespace zoe::io {

enum class Op : uint8_t { kRead, kWrite };

std::string_view OpName(Op op);  // "read" or "write"

struct RawRequest {
  Op op = Op::kRead;
  int fd = -1;
  uint64_t offset = 0;
  std::byte* buffer = nullptr;
  uint32_t length = 0;
  uint64_t tag = 0;  // returned unchanged in the completion
};

struct RawCompletion {
  uint64_t tag = 0;
  int64_t result = 0;  // bytes transferred, or -errno
};

// A region of memory the engine may pre-register with the kernel (io_uring fixed buffers).
struct BufferRegion {
  std::byte* data = nullptr;
  size_t size = 0;
};

class Engine {
 public:
  virtual ~Engine() = default;

  // "io_uring", "libaio" or "psync" (decorators report the engine they wrap).
  virtual std::string_view name() const = 0;
  virtual uint32_t queue_depth() const = 0;

  // Accepts a prefix of `requests`; returns its length (0 when the queue is full or the kernel is
  // short of resources for now), or an error when none could be accepted for another reason. An
  // error means that nothing from this call is in flight.
  virtual Result<size_t> Submit(std::span<const RawRequest> requests) = 0;

  // Waits until at least `min_completions` completions are available (0: do not wait), then
  // moves up to out.size() of them into `out` and returns how many. Waiting for more
  // completions than there are requests in flight blocks forever; callers track what is in flight.
  virtual Result<size_t> Reap(std::span<RawCompletion> out, size_t min_completions) = 0;

  // Optional acceleration hooks; engines without the feature accept and ignore them.
  virtual Status RegisterBuffers(std::span<const BufferRegion> regions) {
    (void)regions;
    return Status::Ok();
  }
  virtual void RegisterFile(int fd) { (void)fd; }
  virtual void UnregisterFile(int fd) { (void)fd; }

  // Features in use, for logs and `zoe info` ("registered buffers, registered files").
  virtual std::string features() const { return {}; }
};

// Forwards every call to `target`. Decorators derive from it and override what they change.
class EngineWrapper : public Engine {
 public:
  explicit EngineWrapper(std::unique_ptr<Engine> target) : target_(std::move(target)) {}

  std::string_view name() const override { return target_->name(); }
  uint32_t queue_depth() const override { return target_->queue_depth(); }
  Result<size_t> Submit(std::span<const RawRequest> requests) override {
    return target_->Submit(requests);
  }
  Result<size_t> Reap(std::span<RawCompletion> out, size_t min_completions) override {
    return target_->Reap(out, min_completions);
  }
  Status RegisterBuffers(std::span<const BufferRegion> regions) override {
    return target_->RegisterBuffers(regions);
  }
  void RegisterFile(int fd) override { target_->RegisterFile(fd); }
  void UnregisterFile(int fd) override { target_->UnregisterFile(fd); }
  std::string features() const override { return target_->features(); }

  Engine& target() { return *target_; }

 private:
  std::unique_ptr<Engine> target_;
};

}  // namespace zoe::io
