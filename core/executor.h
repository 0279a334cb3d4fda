// Executor: the CPU worker pool every part of zoe shares, built on Boost.Asio (an io_context run
// by N threads). Work is posted as closures; ParallelFor splits a range across all threads
// including the caller and returns when every tile is done.
#pragma once

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <cstddef>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace zoe {

class Executor {
 public:
  // Called once on each worker thread before it runs any work (e.g. to bind it to a core).
  using ThreadInit = std::function<void(unsigned worker_index)>;

  // threads == 0 means one per available core (std::thread::hardware_concurrency).
  explicit Executor(unsigned threads = 0, ThreadInit init = {});
  ~Executor();  // finishes queued work, then joins
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  unsigned threads() const { return static_cast<unsigned>(workers_.size()); }

  // Runs `fn` on a worker thread. `fn` must not throw.
  template <class F>
  void Post(F&& fn) {
    boost::asio::post(context_, std::forward<F>(fn));
  }

  // Calls fn(begin, end) for consecutive tiles of at most `grain` elements covering [0, n), on
  // the workers and on the calling thread, and returns when all tiles are done. Tiles are
  // handed out in order from a shared counter, so each thread walks memory forward.
  // `fn` must not throw. Safe to call from several threads at once; not from inside `fn`.
  void ParallelFor(size_t n, size_t grain, const std::function<void(size_t, size_t)>& fn);

 private:
  boost::asio::io_context context_;
  boost::asio::executor_work_guard<boost::asio::io_context::executor_type> guard_;
  std::vector<std::thread> workers_;
};

// The process-wide executor with one thread per core, created on first use.
Executor& DefaultExecutor();

}  // namespace zoe
