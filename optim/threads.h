// Threads and memory for the optimizer: executors whose workers are pinned to cores, and buffers
// first touched by the threads that will stream them (so a NUMA kernel places each page on the
// node of a thread that works on it).
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "core/aligned_buffer.h"
#include "core/executor.h"
#include "core/result.h"

namespace zoe::optim {

// The CPUs this process may run on (its affinity mask), ascending.
std::vector<int> AllowedCpus();

// Binds the calling thread to `cpu`; an error names the CPU and the kernel's reason.
Status PinCurrentThread(int cpu);

// The threads that run a kernel: an Executor with participants - 1 workers plus the calling
// thread, which Executor::ParallelFor also puts to work. With pin set, worker i is bound to
// AllowedCpus()[(i + 1) % cpus] and PinCaller() binds the caller to AllowedCpus()[0].
class KernelThreads {
 public:
  // participants == 0 means one per allowed CPU.
  static Result<std::unique_ptr<KernelThreads>> Create(unsigned participants, bool pin);

  unsigned participants() const { return participants_; }
  // Null when participants == 1 (the caller alone): what RunOptions::executor expects.
  Executor* executor() { return executor_.get(); }
  // Binds the calling thread to the first allowed CPU (no-op when pinning is off).
  Status PinCaller() const;

 private:
  unsigned participants_ = 1;
  bool pin_ = false;
  std::unique_ptr<Executor> executor_;
};

// Allocates `bytes` (64-byte aligned) and zero-fills it in tiles of `tile_bytes` on `executor`'s
// threads (the caller's alone when null): the same threads, in the same tile order, that the
// update kernels stream it with.
Result<AlignedBuffer> AllocateFirstTouch(size_t bytes, size_t tile_bytes, Executor* executor);

}  // namespace zoe::optim
