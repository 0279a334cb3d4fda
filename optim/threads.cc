#include "optim/threads.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "core/log.h"

namespace zoe::optim {

std::vector<int> AllowedCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
      if (CPU_ISSET(cpu, &set)) cpus.push_back(cpu);
    }
  }
  if (cpus.empty()) cpus.push_back(0);
  return cpus;
}

Status PinCurrentThread(int cpu) {
  if (cpu < 0 || cpu >= CPU_SETSIZE) {
    return Status::InvalidArgument("cpu " + std::to_string(cpu) +
                                   " is out of range; allowed: [0, " + std::to_string(CPU_SETSIZE) +
                                   ")");
  }
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  const int rc = pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
  if (rc != 0) return Status::FromErrno(rc, "pin thread to cpu " + std::to_string(cpu));
  return Status::Ok();
}

Result<std::unique_ptr<KernelThreads>> KernelThreads::Create(unsigned participants, bool pin) {
  const std::vector<int> cpus = AllowedCpus();
  if (participants == 0) participants = static_cast<unsigned>(cpus.size());
  auto threads = std::unique_ptr<KernelThreads>(new KernelThreads());
  threads->participants_ = participants;
  threads->pin_ = pin;
  if (participants == 1) return threads;
  Executor::ThreadInit init;
  if (pin) {
    init = [cpus](unsigned worker) {
      const int cpu = cpus[(worker + 1) % cpus.size()];
      Status status = PinCurrentThread(cpu);
      if (!status.ok()) ZOE_LOG_WARN("optimizer worker {}: {}", worker, status.ToString());
    };
  }
  threads->executor_ = std::make_unique<Executor>(participants - 1, std::move(init));
  return threads;
}

Status KernelThreads::PinCaller() const {
  if (!pin_) return Status::Ok();
  return PinCurrentThread(AllowedCpus().front());
}

Result<AlignedBuffer> AllocateFirstTouch(size_t bytes, size_t tile_bytes, Executor* executor) {
  if (tile_bytes == 0) return Status::InvalidArgument("first-touch tile of 0 bytes; allowed: >= 1");
  ZOE_ASSIGN_OR_RETURN(AlignedBuffer buffer, AlignedBuffer::Allocate(bytes, 64));
  std::byte* data = buffer.data();
  const auto zero = [data](size_t begin, size_t end) { std::memset(data + begin, 0, end - begin); };
  if (executor != nullptr) {
    executor->ParallelFor(buffer.size(), tile_bytes, zero);
  } else {
    zero(0, buffer.size());
  }
  return buffer;
}

}  // namespace zoe::optim
