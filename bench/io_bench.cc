#include "bench/io_bench.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <deque>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <thread>

#include "core/aligned_buffer.h"
#include "core/config.h"
#include "io/queue.h"

namespace zoe::cli {
namespace {

uint64_t NowNs() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

}  // namespace

// One job: its files, its queue and its ring of iodepth buffers of bs bytes.
struct BenchJob {
  std::vector<std::string> paths;
  std::unique_ptr<io::FileSet> files;
  std::unique_ptr<io::IoQueue> queue;
  AlignedBuffer ring;
  // Completion time of each ticket, indexed by ticket modulo its size; written by the queue's
  // reaping thread before Wait returns the ticket.
  std::unique_ptr<std::atomic<uint64_t>[]> completed_ns;
  size_t completed_slots = 0;
  std::vector<uint64_t> latencies_ns;
  uint64_t bytes = 0;
  Status status;
};

namespace {

using Job = BenchJob;

struct Pass {
  io::Op op;
  bool random;
  bool measure;
  uint64_t deadline_ns;  // 0: one pass over the file
};

Status OpenJob(const IoBenchSpec& spec, uint32_t index, Job* job) {
  for (const std::string& dir : spec.dirs) {
    job->paths.push_back(fmt::format("{}/zoe-bench-{}-{}.dat", dir, ::getpid(), index));
  }
  io::FileSetOptions options;
  options.open.direct = spec.direct;
  options.open.truncate = true;
  options.stripe_unit = spec.stripe_unit;
  options.checksum_block = spec.verify ? spec.bs : 0;
  ZOE_ASSIGN_OR_RETURN(job->files, io::FileSet::Open(job->paths, options));
  for (size_t i = 0; i < job->files->file_count(); ++i) {
    ZOE_RETURN_IF_ERROR(job->files->file(i).Allocate(job->files->PerFileBytes(spec.size)));
  }
  ZOE_ASSIGN_OR_RETURN(job->ring, AlignedBuffer::Allocate(spec.iodepth * spec.bs, 4096));
  std::mt19937_64 random(index + 1);
  for (size_t i = 0; i + 8 <= job->ring.size(); i += 8) {
    const uint64_t word = random();
    std::memcpy(job->ring.data() + i, &word, 8);
  }
  job->completed_slots = 2 * spec.iodepth;
  job->completed_ns = std::make_unique<std::atomic<uint64_t>[]>(job->completed_slots);
  io::EngineOptions engine_options;
  engine_options.backend = spec.backend;
  engine_options.queue_depth = spec.iodepth;
  ZOE_ASSIGN_OR_RETURN(auto engine, io::CreateEngine(engine_options));
  io::QueueOptions queue_options;
  queue_options.on_complete = [job](io::Ticket ticket, const Status&) {
    job->completed_ns[ticket % job->completed_slots].store(NowNs(), std::memory_order_relaxed);
  };
  ZOE_ASSIGN_OR_RETURN(job->queue,
                       io::IoQueue::Create(std::move(engine), std::move(queue_options)));
  const io::BufferRegion region{job->ring.data(), job->ring.size()};
  (void)job->queue->RegisterBuffers(std::span(&region, 1));  // an optimisation only
  job->queue->RegisterFiles(*job->files);
  return Status::Ok();
}

// Keeps iodepth requests in flight over the file's blocks (in order, or a random permutation
// so every block is visited once per pass, as fio's random map does). The caller waits for the
// oldest request, then collects every request that has completed; once enough slots are free
// they are refilled in one batch, so contiguous requests reach the engine together.
Status RunPass(const IoBenchSpec& spec, const Pass& pass, uint32_t seed, Job* job) {
  const uint64_t blocks = spec.size / spec.bs;
  std::vector<uint64_t> order(blocks);
  std::iota(order.begin(), order.end(), 0);
  if (pass.random) std::shuffle(order.begin(), order.end(), std::mt19937_64(seed));
  struct InFlight {
    io::Ticket ticket;
    uint32_t slot;
    uint64_t submitted_ns;
  };
  std::deque<InFlight> in_flight;
  std::vector<uint32_t> free_slots(spec.iodepth);
  std::iota(free_slots.rbegin(), free_slots.rend(), 0);
  std::vector<io::IoRequest> batch;
  std::vector<io::Ticket> tickets;
  uint64_t issued = 0;
  const size_t refill_at = std::min<size_t>(
      spec.iodepth,
      spec.submit_batch != 0 ? spec.submit_batch : std::max<uint32_t>(1, spec.iodepth / 4));
  auto more = [&] { return pass.deadline_ns != 0 ? NowNs() < pass.deadline_ns : issued < blocks; };
  auto refill = [&]() -> Status {
    batch.clear();
    std::vector<uint32_t> slots;
    while (!free_slots.empty() && more()) {
      const uint32_t slot = free_slots.back();
      free_slots.pop_back();
      const uint64_t offset = order[issued++ % blocks] * spec.bs;
      batch.push_back(io::IoRequest{pass.op, job->files.get(), offset,
                                    job->ring.span().subspan(slot * spec.bs, spec.bs)});
      slots.push_back(slot);
    }
    if (batch.empty()) return Status::Ok();
    tickets.clear();
    const uint64_t now = NowNs();
    ZOE_RETURN_IF_ERROR(job->queue->SubmitBatch(batch, &tickets));
    for (size_t i = 0; i < tickets.size(); ++i)
      in_flight.push_back(InFlight{tickets[i], slots[i], now});
    return Status::Ok();
  };
  auto collect = [&](const InFlight& done, Status status) -> Status {
    ZOE_RETURN_IF_ERROR(status);
    if (pass.measure) {
      const uint64_t completed =
          job->completed_ns[done.ticket % job->completed_slots].load(std::memory_order_relaxed);
      job->latencies_ns.push_back(completed - done.submitted_ns);
      job->bytes += spec.bs;
    }
    free_slots.push_back(done.slot);
    return Status::Ok();
  };
  ZOE_RETURN_IF_ERROR(refill());
  while (!in_flight.empty()) {
    const InFlight oldest = in_flight.front();
    in_flight.pop_front();
    ZOE_RETURN_IF_ERROR(collect(oldest, job->queue->Wait(oldest.ticket)));
    // Every request that has completed frees its slot now, not only those ahead of the first
    // one still in flight: a slow request must not hold back the refill of free slots.
    for (auto it = in_flight.begin(); it != in_flight.end();) {
      std::optional<Status> status = job->queue->Poll(it->ticket);
      if (!status) {
        ++it;
        continue;
      }
      const InFlight done = *it;
      it = in_flight.erase(it);
      ZOE_RETURN_IF_ERROR(collect(done, std::move(*status)));
    }
    if (free_slots.size() >= refill_at || in_flight.empty()) ZOE_RETURN_IF_ERROR(refill());
  }
  return Status::Ok();
}

void CloseJob(Job* job) {
  if (job->queue && job->files) job->queue->UnregisterFiles(*job->files);
  job->queue.reset();
  if (job->files) {
    for (size_t i = 0; i < job->files->file_count(); ++i) (void)job->files->file(i).Remove();
  }
  job->files.reset();
}

}  // namespace

bool IsWrite(const std::string& rw) { return rw == "write" || rw == "randwrite"; }
bool IsRandom(const std::string& rw) { return rw == "randread" || rw == "randwrite"; }

Status ValidateSpec(const IoBenchSpec& spec) {
  if (spec.rw != "read" && spec.rw != "write" && spec.rw != "randread" && spec.rw != "randwrite") {
    return Status::InvalidArgument("--rw " + spec.rw +
                                   " is not one of read, write, randread, randwrite");
  }
  if (spec.bs == 0 || spec.bs > (uint64_t{1} << 30))
    return Status::InvalidArgument(fmt::format("--bs {} is out of range 1..1GiB", spec.bs));
  if (spec.iodepth == 0 || spec.iodepth > 4096)
    return Status::InvalidArgument(
        fmt::format("--iodepth {} is out of range 1..4096", spec.iodepth));
  if (spec.jobs == 0 || spec.jobs > 256)
    return Status::InvalidArgument(fmt::format("--jobs {} is out of range 1..256", spec.jobs));
  if (spec.size < spec.bs || spec.size % spec.bs != 0) {
    return Status::InvalidArgument(
        fmt::format("--size {} must be a positive multiple of --bs {}", spec.size, spec.bs));
  }
  if (spec.dirs.empty()) return Status::InvalidArgument("no --path to put the test files in");
  return Status::Ok();
}

Result<std::vector<IoBenchSpec>> ExpandSweep(const IoBenchSpec& base,
                                             const std::vector<std::string>& axes) {
  std::vector<IoBenchSpec> grid = {base};
  for (const std::string& axis : axes) {
    const size_t eq = axis.find('=');
    if (eq == std::string::npos)
      return Status::InvalidArgument("--sweep " + axis + ": expected key=v1,v2,...");
    const std::string key = axis.substr(0, eq);
    std::vector<IoBenchSpec> next;
    std::vector<std::string> values;
    std::stringstream list(axis.substr(eq + 1));
    for (std::string value; std::getline(list, value, ',');) values.push_back(value);
    for (const IoBenchSpec& base_spec : grid) {
      for (const std::string& value : values) {
        IoBenchSpec spec = base_spec;
        if (key == "bs") {
          ZOE_ASSIGN_OR_RETURN(spec.bs, config::ParseSizeString(value));
        } else if (key == "iodepth" || key == "jobs" || key == "submit_batch") {
          char* end = nullptr;
          const unsigned long n = std::strtoul(value.c_str(), &end, 10);
          if (*end != '\0' || n == 0)
            return Status::InvalidArgument("--sweep " + key + "=" + value +
                                           ": expected a positive integer");
          (key == "iodepth" ? spec.iodepth
           : key == "jobs"  ? spec.jobs
                            : spec.submit_batch) = static_cast<uint32_t>(n);
        } else if (key == "rw") {
          spec.rw = value;
        } else if (key == "backend") {
          ZOE_ASSIGN_OR_RETURN(spec.backend, io::ParseBackend(value));
        } else {
          return Status::InvalidArgument(
              "--sweep key '" + key +
              "' is not one of bs, iodepth, jobs, submit_batch, rw, backend");
        }
        next.push_back(spec);
      }
    }
    grid = std::move(next);
  }
  for (const IoBenchSpec& spec : grid) ZOE_RETURN_IF_ERROR(ValidateSpec(spec));
  return grid;
}

LatencyUs Percentiles(std::vector<uint64_t> ns) {
  LatencyUs out;
  if (ns.empty()) return out;
  std::sort(ns.begin(), ns.end());
  auto at = [&](double p) {
    const size_t rank = static_cast<size_t>(std::ceil(p * static_cast<double>(ns.size())));
    return static_cast<double>(ns[std::clamp<size_t>(rank, 1, ns.size()) - 1]) / 1000.0;
  };
  out.p50 = at(0.50);
  out.p90 = at(0.90);
  out.p99 = at(0.99);
  out.p999 = at(0.999);
  out.max = static_cast<double>(ns.back()) / 1000.0;
  return out;
}

IoBench::IoBench(IoBenchSpec spec) : spec_(std::move(spec)) {}

IoBench::~IoBench() {
  for (auto& job : jobs_) CloseJob(job.get());
}

Result<std::unique_ptr<IoBench>> IoBench::Prepare(const IoBenchSpec& spec) {
  ZOE_RETURN_IF_ERROR(ValidateSpec(spec));
  std::unique_ptr<IoBench> bench(new IoBench(spec));
  for (uint32_t i = 0; i < spec.jobs; ++i) {
    bench->jobs_.push_back(std::make_unique<Job>());
    Job* job = bench->jobs_.back().get();
    ZOE_RETURN_IF_ERROR(OpenJob(spec, i, job));
    ZOE_RETURN_IF_ERROR(RunPass(spec, Pass{io::Op::kWrite, false, false, 0}, i, job));
  }
  return bench;
}

std::vector<std::vector<std::string>> IoBench::files() const {
  std::vector<std::vector<std::string>> out;
  for (const auto& job : jobs_) out.push_back(job->paths);
  return out;
}

std::string IoBench::backend() const { return std::string(jobs_.front()->queue->backend()); }

Result<IoBenchResult> IoBench::Measure() {
  IoBenchResult result;
  result.spec = spec_;
  result.direct = true;
  for (auto& job : jobs_) {
    job->bytes = 0;
    job->latencies_ns.clear();
    result.backend = std::string(job->queue->backend());
    result.direct = result.direct && job->files->direct();
  }
  const io::Op op = IsWrite(spec_.rw) ? io::Op::kWrite : io::Op::kRead;
  const uint64_t start = NowNs();
  const uint64_t deadline =
      spec_.runtime_s > 0 ? start + static_cast<uint64_t>(spec_.runtime_s * 1e9) : 0;
  std::vector<std::thread> threads;
  for (uint32_t i = 0; i < spec_.jobs; ++i) {
    threads.emplace_back([&, i] {
      jobs_[i]->status =
          RunPass(spec_, Pass{op, IsRandom(spec_.rw), true, deadline}, 1000 + i, jobs_[i].get());
    });
  }
  for (auto& thread : threads) thread.join();
  result.seconds = static_cast<double>(NowNs() - start) / 1e9;
  std::vector<uint64_t> latencies;
  for (uint32_t i = 0; i < spec_.jobs; ++i) {
    Job& job = *jobs_[i];
    ZOE_RETURN_IF_ERROR(job.status);
    // A write with verification is read back (not measured) and checked against its checksums.
    if (spec_.verify && op == io::Op::kWrite) {
      ZOE_RETURN_IF_ERROR(RunPass(spec_, Pass{io::Op::kRead, false, false, 0}, i, &job));
    }
    result.bytes += job.bytes;
    latencies.insert(latencies.end(), job.latencies_ns.begin(), job.latencies_ns.end());
  }
  result.buffer_bytes = uint64_t{spec_.jobs} * spec_.iodepth * spec_.bs;
  result.bw_bytes = static_cast<double>(result.bytes) / result.seconds;
  result.iops = static_cast<double>(latencies.size()) / result.seconds;
  result.lat = Percentiles(std::move(latencies));
  return result;
}

Result<IoBenchResult> RunIoBench(const IoBenchSpec& spec) {
  ZOE_ASSIGN_OR_RETURN(auto bench, IoBench::Prepare(spec));
  return bench->Measure();
}

}  // namespace zoe::cli
