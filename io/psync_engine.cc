// The psync backend: a pool of threads doing pread/pwrite, for machines where neither io_uring
// nor libaio can be set up. One thread per queue slot (capped), so queue depth still means
// requests in flight.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <string>

#include "core/executor.h"
#include "io/backend.h"

namespace zoe::io {
namespace {

constexpr uint32_t kMaxThreads = 64;

class PsyncEngine final : public Engine {
 public:
  explicit PsyncEngine(uint32_t depth) : depth_(depth), pool_(std::min(depth, kMaxThreads)) {}
  ~PsyncEngine() override = default;  // the pool joins after finishing queued requests

  std::string_view name() const override { return "psync"; }
  uint32_t queue_depth() const override { return depth_; }
  std::string features() const override {
    return std::to_string(pool_.threads()) + " pread/pwrite threads";
  }

  Result<size_t> Submit(std::span<const RawRequest> requests) override {
    for (const RawRequest& request : requests) {
      pool_.Post([this, request] { Complete(request.tag, Transfer(request)); });
    }
    return requests.size();
  }

  Result<size_t> Reap(std::span<RawCompletion> out, size_t min_completions) override {
    std::unique_lock lock(mutex_);
    ready_.wait(lock, [&] { return done_.size() >= min_completions; });
    const size_t n = std::min(out.size(), done_.size());
    for (size_t i = 0; i < n; ++i) {
      out[i] = done_.front();
      done_.pop_front();
    }
    return n;
  }

 private:
  // One pread/pwrite; the raw result (short counts and EINTR included) goes to the caller.
  static int64_t Transfer(const RawRequest& r) {
    const off_t offset = static_cast<off_t>(r.offset);
    const ssize_t n = r.op == Op::kRead ? pread(r.fd, r.buffer, r.length, offset)
                                        : pwrite(r.fd, r.buffer, r.length, offset);
    return n < 0 ? -errno : n;
  }

  void Complete(uint64_t tag, int64_t result) {
    {
      std::lock_guard lock(mutex_);
      done_.push_back(RawCompletion{tag, result});
    }
    ready_.notify_one();
  }

  uint32_t depth_;
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<RawCompletion> done_;
  Executor pool_;  // declared last: destroyed (joined) first, while the members above still live
};

}  // namespace

Result<std::unique_ptr<Engine>> CreatePsyncEngine(uint32_t queue_depth) {
  return std::unique_ptr<Engine>(std::make_unique<PsyncEngine>(queue_depth));
}

}  // namespace zoe::io
