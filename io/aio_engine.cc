// The libaio backend: io_submit/io_getevents on one AIO context. Each in-flight request owns an
// iocb from a fixed pool of queue_depth entries (the kernel reads it at submission and returns
// its address in the completion event).
#include <libaio.h>

#include <atomic>
#include <cerrno>
#include <mutex>
#include <string>
#include <vector>

#include "io/backend.h"

namespace zoe::io {
namespace {

struct Slot {
  iocb control{};
  // Written at submission and read at completion on another thread; the kernel orders the two,
  // the atomic makes that order visible to the language (and to ThreadSanitizer).
  std::atomic<uint64_t> tag{0};
};

class LibaioEngine final : public Engine {
 public:
  static Result<std::unique_ptr<Engine>> Create(uint32_t depth);
  ~LibaioEngine() override { io_destroy(context_); }

  std::string_view name() const override { return "libaio"; }
  uint32_t queue_depth() const override { return depth_; }
  Result<size_t> Submit(std::span<const RawRequest> requests) override;
  Result<size_t> Reap(std::span<RawCompletion> out, size_t min_completions) override;
  std::string features() const override { return "io_submit batches"; }

 private:
  LibaioEngine(io_context_t context, uint32_t depth);
  iocb* Prepare(const RawRequest& request);
  void Release(Slot* slot);

  io_context_t context_;
  uint32_t depth_;
  std::vector<Slot> slots_;
  std::mutex free_mutex_;  // Submit takes slots and Reap returns them, on different threads
  std::vector<Slot*> free_;
  std::vector<iocb*> batch_;      // used by the submitting thread only
  std::vector<io_event> events_;  // used by the reaping thread only
};

LibaioEngine::LibaioEngine(io_context_t context, uint32_t depth)
    : context_(context), depth_(depth), slots_(depth), events_(depth) {
  for (Slot& slot : slots_) free_.push_back(&slot);
}

Result<std::unique_ptr<Engine>> LibaioEngine::Create(uint32_t depth) {
  io_context_t context = nullptr;
  const int ret = io_setup(static_cast<int>(depth), &context);
  if (ret < 0) return Status::FromErrno(ret, "io_setup with " + std::to_string(depth) + " events");
  return std::unique_ptr<Engine>(new LibaioEngine(context, depth));
}

iocb* LibaioEngine::Prepare(const RawRequest& request) {
  Slot* slot = nullptr;
  {
    std::lock_guard lock(free_mutex_);
    if (free_.empty()) return nullptr;
    slot = free_.back();
    free_.pop_back();
  }
  if (request.op == Op::kRead) {
    io_prep_pread(&slot->control, request.fd, request.buffer, request.length,
                  static_cast<long long>(request.offset));
  } else {
    io_prep_pwrite(&slot->control, request.fd, request.buffer, request.length,
                   static_cast<long long>(request.offset));
  }
  slot->control.data = slot;
  slot->tag.store(request.tag, std::memory_order_release);
  return &slot->control;
}

void LibaioEngine::Release(Slot* slot) {
  std::lock_guard lock(free_mutex_);
  free_.push_back(slot);
}

Result<size_t> LibaioEngine::Submit(std::span<const RawRequest> requests) {
  batch_.clear();
  for (const RawRequest& request : requests) {
    iocb* control = Prepare(request);
    if (control == nullptr) break;
    batch_.push_back(control);
  }
  size_t done = 0;
  while (done < batch_.size()) {
    const int ret =
        io_submit(context_, static_cast<long>(batch_.size() - done), batch_.data() + done);
    if (ret == -EINTR) continue;
    if (ret == -EAGAIN) break;  // the kernel is short of resources: the caller retries later
    if (ret < 0) {
      for (size_t i = done; i < batch_.size(); ++i) Release(static_cast<Slot*>(batch_[i]->data));
      if (done > 0) return done;
      return Status::FromErrno(ret, "io_submit of " + std::to_string(batch_.size()) + " requests");
    }
    done += static_cast<size_t>(ret);
  }
  for (size_t i = done; i < batch_.size(); ++i) Release(static_cast<Slot*>(batch_[i]->data));
  return done;
}

Result<size_t> LibaioEngine::Reap(std::span<RawCompletion> out, size_t min_completions) {
  const long max = static_cast<long>(std::min(out.size(), events_.size()));
  int ret;
  do {
    ret = io_getevents(context_, static_cast<long>(min_completions), max, events_.data(), nullptr);
  } while (ret == -EINTR);
  if (ret < 0) return Status::FromErrno(ret, "io_getevents");
  for (int i = 0; i < ret; ++i) {
    const io_event& event = events_[i];
    // event.data is the iocb's data field as copied by the kernel: our slot.
    Slot* slot = static_cast<Slot*>(event.data);
    // res holds bytes or -errno in the low word; res2 is unused for files.
    out[i] = RawCompletion{slot->tag.load(std::memory_order_acquire),
                           static_cast<int64_t>(static_cast<long>(event.res))};
    Release(slot);
  }
  return static_cast<size_t>(ret);
}

}  // namespace

Result<std::unique_ptr<Engine>> CreateLibaioEngine(uint32_t queue_depth) {
  return LibaioEngine::Create(queue_depth);
}

}  // namespace zoe::io
