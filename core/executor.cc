#include "core/executor.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>

namespace zoe {

Executor::Executor(unsigned threads, ThreadInit init) : guard_(context_.get_executor()) {
  if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
  workers_.reserve(threads);
  for (unsigned i = 0; i < threads; ++i) {
    workers_.emplace_back([this, i, init] {
      if (init) init(i);
      context_.run();
    });
  }
}

Executor::~Executor() {
  guard_.reset();
  for (auto& worker : workers_) worker.join();
}

namespace {

// Shared state of one ParallelFor call: a tile counter and a count of helpers still running.
struct ParallelForState {
  std::atomic<size_t> next_tile{0};
  size_t tiles = 0;
  size_t n = 0;
  size_t grain = 0;
  const std::function<void(size_t, size_t)>* fn = nullptr;
  std::mutex mutex;
  std::condition_variable done;
  size_t helpers_running = 0;

  void RunTiles() {
    for (size_t t = next_tile.fetch_add(1); t < tiles; t = next_tile.fetch_add(1)) {
      const size_t begin = t * grain;
      (*fn)(begin, begin + std::min(grain, n - begin));
    }
  }
};

}  // namespace

void Executor::ParallelFor(size_t n, size_t grain, const std::function<void(size_t, size_t)>& fn) {
  if (n == 0) return;
  grain = std::clamp<size_t>(grain, 1, n);  // a grain above n is one tile; no sum can wrap
  auto state = std::make_shared<ParallelForState>();
  state->tiles = (n + grain - 1) / grain;
  state->n = n;
  state->grain = grain;
  state->fn = &fn;
  // The caller takes tiles too, so only tiles - 1 helpers can ever find work.
  const size_t helpers = std::min<size_t>(workers_.size(), state->tiles - 1);
  state->helpers_running = helpers;
  for (size_t i = 0; i < helpers; ++i) {
    Post([state] {
      state->RunTiles();
      std::lock_guard lock(state->mutex);
      if (--state->helpers_running == 0) state->done.notify_all();
    });
  }
  state->RunTiles();
  std::unique_lock lock(state->mutex);
  state->done.wait(lock, [&] { return state->helpers_running == 0; });
}

Executor& DefaultExecutor() {
  static Executor executor;
  return executor;
}

}  // namespace zoe
