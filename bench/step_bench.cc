#include "bench/step_bench.h"

#include <fmt/format.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <sstream>
#include <thread>

#include "core/aligned_buffer.h"
#include "core/pinned_memory.h"
#include "core/scratch_dir.h"
#include "io/queue.h"
#include "io/swap_space.h"
#include "offload/optimizer/optimizer_group.h"
#include "offload/optimizer/optimizer_group_layout.h"
#include "optim/chunk.h"
#include "optim/dispatch.h"
#include "optim/quantize.h"
#include "optim/threads.h"

namespace zoe::cli {
namespace {

using Clock = std::chrono::steady_clock;
using optim::DType;

constexpr uint64_t kDefaultPinnedBudget = uint64_t{384} << 20;  // DeepSpeed reference run
constexpr uint64_t kElementGranule = 4096;  // NVMe chunks keep every region 4096-byte aligned
constexpr uint64_t kPage = 4096;
constexpr uint64_t kBaselineBlock = uint64_t{1} << 20;  // DeepSpeed aio's default block size

uint64_t AlignUp(uint64_t value, uint64_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double Median(std::vector<double> samples) {
  std::sort(samples.begin(), samples.end());
  const size_t n = samples.size();
  return n % 2 ? samples[n / 2] : 0.5 * (samples[n / 2 - 1] + samples[n / 2]);
}

// Runs `fn` warmup + steps times and returns the median of the timed runs; stops at an error.
Result<double> MedianSeconds(int warmup, int steps, const std::function<Status()>& fn) {
  std::vector<double> samples;
  for (int i = 0; i < warmup + steps; ++i) {
    const Clock::time_point start = Clock::now();
    ZOE_RETURN_IF_ERROR(fn());
    if (i >= warmup) samples.push_back(SecondsSince(start));
  }
  return Median(samples);
}

// Peak resident set (VmHWM) since the last ResetPeakRss; 0 when /proc is not readable.
uint64_t PeakRssBytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  }
  return 0;
}

// Writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0), so each phase reports
// its own peak.
void ResetPeakRss() { std::ofstream("/proc/self/clear_refs") << "5"; }

uint64_t BytesPerElement(DType moments) { return 4 + 2 * DTypeSize(moments); }

uint64_t ChunkElementsFor(const StepBenchSpec& spec, DType moments) {
  if (spec.chunk_elements > 0) return spec.chunk_elements;
  const uint64_t budget = spec.pinned_budget > 0 ? spec.pinned_budget : kDefaultPinnedBudget;
  const uint64_t elements = budget / spec.buffer_count / BytesPerElement(moments);
  return std::max(kElementGranule, elements / kElementGranule * kElementGranule);
}

// What every phase shares: kernel threads, one I/O queue (engine and queue depth), the paths.
struct Rig {
  const StepBenchSpec& spec;
  std::vector<std::string> paths;
  std::unique_ptr<ScratchDir> scratch;
  std::unique_ptr<optim::KernelThreads> threads;
  optim::RunOptions run;
  std::unique_ptr<io::IoQueue> queue;
};

Result<std::unique_ptr<Rig>> MakeRig(const StepBenchSpec& spec) {
  auto rig = std::make_unique<Rig>(Rig{spec, spec.paths, nullptr, nullptr, {}, nullptr});
  if (rig->paths.empty()) {
    ZOE_ASSIGN_OR_RETURN(rig->scratch, ScratchDir::Create("/var/tmp/zoe-bench-step-"));
    rig->paths.push_back(rig->scratch->path());
  }
  ZOE_ASSIGN_OR_RETURN(rig->threads, optim::KernelThreads::Create(spec.threads, /*pin=*/true));
  ZOE_RETURN_IF_ERROR(rig->threads->PinCaller());
  rig->run.executor = rig->threads->executor();
  ZOE_ASSIGN_OR_RETURN(rig->run.isa, optim::DefaultIsa());
  io::EngineOptions engine_options;
  engine_options.backend = spec.backend;
  engine_options.queue_depth = spec.iodepth;
  ZOE_ASSIGN_OR_RETURN(auto engine, io::CreateEngine(engine_options));
  ZOE_ASSIGN_OR_RETURN(rig->queue, io::IoQueue::Create(std::move(engine)));
  return rig;
}

// One chunk-sized fp32 buffer that every gradient view (and every initial parameter view) points
// at, so memory does not grow with the parameter count.
struct SharedViews {
  AlignedBuffer values;
  std::vector<offload::GradView> grads;
  std::vector<offload::ParamView> params;
};

Result<SharedViews> MakeSharedViews(uint64_t count, uint64_t chunk_elements) {
  SharedViews views;
  ZOE_ASSIGN_OR_RETURN(views.values, AlignedBuffer::Allocate(chunk_elements * sizeof(float)));
  auto* values = reinterpret_cast<float*>(views.values.data());
  for (uint64_t i = 0; i < chunk_elements; ++i) {
    values[i] = 1e-3f * static_cast<float>(static_cast<int64_t>(i % 2001) - 1000);
  }
  for (uint64_t first = 0; first < count; first += chunk_elements) {
    const size_t n = std::min(chunk_elements, count - first);
    views.grads.push_back({values, DType::kFloat32, n});
    views.params.push_back({values, DType::kFloat32, n});
  }
  return views;
}

optim::HyperParams BenchHyper() {
  optim::HyperParams hyper;
  hyper.kind = optim::Kind::kAdamW;
  hyper.weight_decay = 0.01;
  return hyper;
}

uint64_t SwapCapacity(const offload::StateLayout& layout, size_t nvme_chunks, uint64_t alignment,
                      uint32_t slots = 2) {
  uint64_t bytes = 0;
  for (size_t c = 0; c < nvme_chunks; ++c) {
    bytes += slots * AlignUp(layout.chunk(c).bytes, alignment);
  }
  return bytes;
}

// `speculative`: HOST chunks take a spare each.
uint64_t PinnedNeed(const offload::StateLayout& layout, size_t nvme_chunks, uint32_t buffers,
                    bool speculative = false) {
  uint64_t bytes =
      std::min<uint64_t>(buffers, nvme_chunks) * AlignUp(layout.max_chunk_bytes(), kPage);
  for (size_t c = nvme_chunks; c < layout.chunk_count(); ++c) {
    bytes += (speculative ? 2 : 1) * AlignUp(layout.chunk(c).bytes, kPage);
  }
  return bytes;
}

// ---- the group's step ---------------------------------------------------------------------

// One group under test: its memory, its swap space and its step reports.
struct GroupUnderTest {
  StepBenchResult* out;
  std::unique_ptr<io::SwapSpace> swap;  // null: the state lives in HOST
  std::optional<PinnedMemoryPool> pinned;
  SharedViews views;
  std::unique_ptr<offload::OptimizerGroup> group;
  std::vector<offload::StepReport> reports;
  std::vector<double> samples;
  std::array<std::vector<double>, 3> iteration_samples;  // per IterationMode
  std::vector<uint64_t> written_before_timed;  // per swap file, when the timed steps began
};

Status CreateGroupUnderTest(Rig& rig, DType moments, GroupUnderTest* g) {
  const StepBenchSpec& spec = rig.spec;
  StepBenchResult& out = *g->out;
  // Laid out as the group lays out its chunks (HOST ones staggered), to size its pinned pool.
  const offload::StateLayout layout(optim::Kind::kAdamW, moments, spec.params, out.chunk_elements,
                                    kPage, {}, /*external_master=*/false,
                                    /*first_host_chunk=*/out.nvme_chunks);
  if (out.nvme_chunks > 0) {
    io::SwapOptions swap_options;
    swap_options.name_prefix = "zoe-bench-step";
    swap_options.files.checksum_block = out.checksum ? kPage : 0;
    out.checksum_block = swap_options.files.checksum_block;
    ZOE_ASSIGN_OR_RETURN(
        g->swap,
        io::SwapSpace::Create(
            rig.paths, SwapCapacity(layout, out.nvme_chunks, swap_options.alignment, spec.slots),
            swap_options));
  }
  ZOE_ASSIGN_OR_RETURN(PinnedMemoryPool pinned,
                       PinnedMemoryPool::Create(
                           {.name = "bench step",
                            .budget_bytes = PinnedNeed(layout, out.nvme_chunks, spec.buffer_count,
                                                       spec.backward_ms > 0)}));
  g->pinned.emplace(std::move(pinned));
  ZOE_ASSIGN_OR_RETURN(g->views, MakeSharedViews(spec.params, out.chunk_elements));
  offload::OptimizerGroupOptions options;
  options.name = "bench";
  options.state_dtype = moments;
  options.count = spec.params;
  options.placement = spec.offload;
  options.chunk_elements = out.chunk_elements;
  options.buffer_count = spec.buffer_count;
  options.max_grad_norm = spec.max_grad_norm;
  options.speculative = spec.backward_ms > 0;
  options.slots = spec.slots;
  options.run = rig.run;
  ZOE_ASSIGN_OR_RETURN(
      g->group, offload::OptimizerGroup::Create(
                    options, {rig.queue.get(), g->swap.get(), &*g->pinned}, g->views.params));
  return Status::Ok();
}

// The median step speaks for the rest of the accounting.
void Summarize(const StepBenchSpec& spec, GroupUnderTest& g) {
  StepBenchResult& out = *g.out;
  out.step_seconds = Median(g.samples);
  const auto median = std::min_element(
      g.reports.begin() + spec.warmup, g.reports.end(), [&](const auto& a, const auto& b) {
        return std::abs(a.seconds - out.step_seconds) < std::abs(b.seconds - out.step_seconds);
      });
  out.bytes_read = median->bytes_read;
  out.bytes_reused = median->bytes_reused;
  out.bytes_written = median->bytes_written;
  out.io_wait_seconds = median->io_wait_seconds;
  out.compute_seconds = median->compute_seconds;
  out.pinned_bytes = g.group->pinned_bytes();
  out.nvme_bytes = g.group->nvme_bytes();
}

// ---- iterations around an emulated backward ----------------------------------------------

enum class IterationMode : uint8_t { kAfter = 0, kOverlap = 1, kSpeculative = 2 };

// One iteration: over backward_ms the chunks' gradients become available last chunk first (the
// k-th of n at (k + 1) / n of it), handed to AccumulateGrad as they arrive unless `mode` is kAfter;
// then the step. Sleeping leaves the CPU to the group, as a GPU's backward does.
Result<double> RunIteration(const StepBenchSpec& spec, GroupUnderTest& g, IterationMode mode) {
  const Clock::time_point start = Clock::now();
  const std::chrono::duration<double, std::milli> backward(spec.backward_ms);
  const std::vector<offload::GradView>& grads = g.views.grads;
  offload::StepArgs args;
  args.hyper = BenchHyper();
  if (mode == IterationMode::kSpeculative) ZOE_RETURN_IF_ERROR(g.group->Speculate(args));
  for (size_t k = 0; k < grads.size(); ++k) {
    const size_t chunk = grads.size() - 1 - k;
    std::this_thread::sleep_until(
        start + std::chrono::duration_cast<Clock::duration>(backward * static_cast<double>(k + 1) /
                                                            static_cast<double>(grads.size())));
    if (mode == IterationMode::kAfter) continue;
    ZOE_RETURN_IF_ERROR(g.group->AccumulateGrad(chunk * g.out->chunk_elements, grads[chunk]));
  }
  if (mode == IterationMode::kAfter) args.grads = grads;
  ZOE_RETURN_IF_ERROR(g.group->Step(args).status());
  return SecondsSince(start);
}

// Every group runs `warmup + steps` rounds of one iteration per mode, the modes' order rotating
// from round to round and the groups taking turns, as the steps do.
Status RunIterations(const StepBenchSpec& spec, std::vector<GroupUnderTest>& groups) {
  for (int round = 0; round < spec.warmup + spec.steps; ++round) {
    for (size_t k = 0; k < groups.size(); ++k) {
      GroupUnderTest& g = groups[round % 2 == 0 ? k : groups.size() - 1 - k];
      for (int m = 0; m < 3; ++m) {
        const auto mode = static_cast<IterationMode>((m + round) % 3);
        ZOE_ASSIGN_OR_RETURN(const double seconds, RunIteration(spec, g, mode));
        if (round >= spec.warmup) g.iteration_samples[static_cast<size_t>(mode)].push_back(seconds);
      }
    }
  }
  return Status::Ok();
}

// Bytes written per swap file so far.
std::vector<uint64_t> BytesWrittenPerFile(io::SwapSpace& swap) {
  std::vector<uint64_t> written;
  for (size_t i = 0; i < swap.files().file_count(); ++i) {
    written.push_back(swap.files().file(i).bytes_written());
  }
  return written;
}

// The wear of each path: the swap space has one file per path, in the order of rig.paths.
Status ProjectGroupWear(const Rig& rig, const GroupUnderTest& g) {
  if (!g.swap) return Status::Ok();
  const StepBenchSpec& spec = rig.spec;
  const std::vector<uint64_t> written = BytesWrittenPerFile(*g.swap);
  const double steps_per_day = spec.steps_per_day.value_or(StepsPerDayAt(g.out->step_seconds));
  for (size_t i = 0; i < written.size() && i < rig.paths.size(); ++i) {
    uint64_t capacity = spec.drive_capacity;
    if (capacity == 0) {
      ZOE_ASSIGN_OR_RETURN(capacity, FilesystemBytes(rig.paths[i]));
    }
    const uint64_t per_step = (written[i] - g.written_before_timed[i]) / spec.steps;
    ZOE_ASSIGN_OR_RETURN(WearProjection wear,
                         ProjectWear({rig.paths[i], per_step, capacity, steps_per_day}));
    g.out->wear.push_back(std::move(wear));
  }
  return Status::Ok();
}

void SummarizeIterations(const StepBenchSpec& spec, GroupUnderTest& g) {
  IterationResult it;
  it.after = Median(g.iteration_samples[static_cast<size_t>(IterationMode::kAfter)]);
  it.overlap = Median(g.iteration_samples[static_cast<size_t>(IterationMode::kOverlap)]);
  it.speculative = Median(g.iteration_samples[static_cast<size_t>(IterationMode::kSpeculative)]);
  it.step_alone = g.out->step_seconds;
  it.bound = std::max(spec.backward_ms / 1e3, it.step_alone);
  const offload::SpeculationStats& stats = g.group->speculation_stats();
  it.chunks_speculative = stats.chunks_speculative;
  it.chunks_recomputed = stats.chunks_recomputed;
  it.steps_declined = stats.steps_declined;
  g.out->iteration = it;
}

// Steps every group `warmup + steps` times, the groups taking turns step by step (in reverse
// order every other round), so that each sees the same disk and machine: on these shared
// machines throughput drifts within seconds, and phases run one after the other would compare
// different moments. peak_rss_bytes covers every group of the phase.
Status RunGroupPhase(Rig& rig, DType moments, std::span<StepBenchResult* const> outs) {
  const StepBenchSpec& spec = rig.spec;
  ResetPeakRss();
  std::vector<GroupUnderTest> groups(outs.size());
  for (size_t i = 0; i < outs.size(); ++i) {
    groups[i].out = outs[i];
    ZOE_RETURN_IF_ERROR(CreateGroupUnderTest(rig, moments, &groups[i]));
  }
  offload::StepArgs args;
  args.hyper = BenchHyper();
  for (int round = 0; round < spec.warmup + spec.steps; ++round) {
    for (size_t k = 0; k < groups.size(); ++k) {
      GroupUnderTest& g = groups[round % 2 == 0 ? k : groups.size() - 1 - k];
      if (round == spec.warmup && g.swap) g.written_before_timed = BytesWrittenPerFile(*g.swap);
      args.grads = g.views.grads;
      const Clock::time_point start = Clock::now();
      ZOE_ASSIGN_OR_RETURN(offload::StepReport report, g.group->Step(args));
      if (round >= spec.warmup) g.samples.push_back(SecondsSince(start));
      g.reports.push_back(report);
    }
  }
  // The wear counts the timed steps only, so it is taken before the iterations.
  for (GroupUnderTest& g : groups) {
    Summarize(spec, g);
    ZOE_RETURN_IF_ERROR(ProjectGroupWear(rig, g));
  }
  if (spec.backward_ms > 0) ZOE_RETURN_IF_ERROR(RunIterations(spec, groups));
  const uint64_t peak = PeakRssBytes();
  for (GroupUnderTest& g : groups) {
    if (spec.backward_ms > 0) SummarizeIterations(spec, g);
    g.out->peak_rss_bytes = peak;
    g.group.reset();
    if (g.swap) ZOE_RETURN_IF_ERROR(g.swap->Close());
  }
  return Status::Ok();
}

// ---- the same bytes with no compute -------------------------------------------------------

// Moves every NVMe chunk as the step's pipeline does -- read one slot into a free pipeline buffer,
// write it to the other slot from the same buffer -- with `buffer_count` buffers, reads running
// ahead of writes as far as free buffers allow, and the slots swapping roles every pass. Like the
// step, passes alternate direction and do not read again the chunks the previous pass left in
// the buffers. Only the update between the read and the write is missing.
class IoOnlyPipeline {
 public:
  static Result<std::unique_ptr<IoOnlyPipeline>> Create(Rig& rig, io::SwapSpace& swap,
                                                        const offload::StateLayout& layout,
                                                        size_t nvme_chunks) {
    auto p = std::unique_ptr<IoOnlyPipeline>(new IoOnlyPipeline(rig, swap));
    const size_t buffers = std::min<size_t>(rig.spec.buffer_count, nvme_chunks);
    ZOE_ASSIGN_OR_RETURN(
        PinnedMemoryPool pool,
        PinnedMemoryPool::Create({.name = "bench step io-only",
                                  .budget_bytes = PinnedNeed(layout, nvme_chunks, buffers)}));
    p->pool_.emplace(std::move(pool));
    for (size_t b = 0; b < buffers; ++b) {
      ZOE_ASSIGN_OR_RETURN(PinnedBuffer buffer, p->pool_->Allocate(layout.max_chunk_bytes()));
      std::fill_n(buffer.data(), buffer.size(), std::byte{0x3c});
      p->buffers_.push_back(std::move(buffer));
    }
    for (size_t c = 0; c < nvme_chunks; ++c) {
      const uint64_t bytes = layout.chunk(c).bytes;
      p->lengths_.push_back(bytes);
      for (auto& slots : p->slots_) {
        ZOE_ASSIGN_OR_RETURN(io::Extent extent, swap.Allocate(bytes));
        slots.push_back(extent);
      }
    }
    // Fill the slot read first, so the timed reads come from the disk (not from holes).
    for (size_t c = 0; c < nvme_chunks; ++c) {
      ZOE_RETURN_IF_ERROR(p->Transfer(io::Op::kWrite, p->slots_[0][c], 0, c));
    }
    return p;
  }
  ~IoOnlyPipeline() {
    for (auto& slots : slots_) {
      for (const io::Extent& extent : slots) (void)swap_.Free(extent);
    }
  }

  // One pass: the algorithm of the class comment.
  Status Pass() {
    const auto& from = slots_[pass_ % 2];
    const auto& to = slots_[1 - pass_ % 2];
    const bool descending = pass_ % 2 == 1;
    const size_t n = lengths_.size();
    // After the first pass, the chunks the last one ended with are still in the buffers.
    const size_t kept = pass_ > 0 ? std::min(buffers_.size(), n) : 0;
    ++pass_;
    const auto chunk_at = [&](size_t position) { return descending ? n - 1 - position : position; };
    std::deque<size_t> free;
    std::deque<std::pair<io::Ticket, size_t>> reads, writes;  // ticket (0: kept), buffer
    for (size_t b = 0; b < buffers_.size(); ++b) {
      if (b < kept) {
        reads.emplace_back(0, b);
      } else {
        free.push_back(b);
      }
    }
    size_t issued = kept;
    for (size_t position = 0; position < n; ++position) {
      const size_t c = chunk_at(position);
      // Reads run ahead while buffers are free; a buffer whose write has finished is taken back
      // without waiting, and waited for only when chunk c's own read cannot start otherwise.
      while (issued < n) {
        if (free.empty() && !writes.empty()) {
          std::optional<Status> done;
          if (issued == position) {
            done = rig_.queue->Wait(writes.front().first);
          } else {
            done = rig_.queue->Poll(writes.front().first);
          }
          if (!done) break;
          ZOE_RETURN_IF_ERROR(*done);
          free.push_back(writes.front().second);
          writes.pop_front();
        }
        if (free.empty()) break;
        const size_t b = free.front();
        free.pop_front();
        const size_t next = chunk_at(issued);
        ZOE_ASSIGN_OR_RETURN(io::Ticket t, Submit(io::Op::kRead, from[next], b, next));
        reads.emplace_back(t, b);
        ++issued;
      }
      if (reads.front().first != 0) ZOE_RETURN_IF_ERROR(rig_.queue->Wait(reads.front().first));
      const size_t b = reads.front().second;
      reads.pop_front();
      ZOE_ASSIGN_OR_RETURN(io::Ticket t, Submit(io::Op::kWrite, to[c], b, c));
      writes.emplace_back(t, b);
    }
    for (const auto& [ticket, buffer] : writes) ZOE_RETURN_IF_ERROR(rig_.queue->Wait(ticket));
    return Status::Ok();
  }

 private:
  IoOnlyPipeline(Rig& rig, io::SwapSpace& swap) : rig_(rig), swap_(swap) {}

  Result<io::Ticket> Submit(io::Op op, const io::Extent& extent, size_t buffer, size_t chunk) {
    return rig_.queue->Submit(
        {op, &swap_.files(), extent.offset, std::span(buffers_[buffer].data(), lengths_[chunk])});
  }
  Status Transfer(io::Op op, const io::Extent& extent, size_t buffer, size_t chunk) {
    ZOE_ASSIGN_OR_RETURN(io::Ticket ticket, Submit(op, extent, buffer, chunk));
    return rig_.queue->Wait(ticket);
  }

  Rig& rig_;
  io::SwapSpace& swap_;
  std::optional<PinnedMemoryPool> pool_;
  std::vector<PinnedBuffer> buffers_;
  std::vector<uint64_t> lengths_;
  std::array<std::vector<io::Extent>, 2> slots_;
  uint64_t pass_ = 0;
};

Status RunIoOnlyPhase(Rig& rig, DType moments, io::SwapSpace& swap, StepBenchResult* out) {
  const offload::StateLayout layout(optim::Kind::kAdamW, moments, rig.spec.params,
                                    out->chunk_elements, kPage);
  ZOE_ASSIGN_OR_RETURN(auto pipeline, IoOnlyPipeline::Create(rig, swap, layout, out->nvme_chunks));
  ZOE_ASSIGN_OR_RETURN(out->io_only_seconds, MedianSeconds(rig.spec.warmup, rig.spec.steps,
                                                           [&] { return pipeline->Pass(); }));
  return Status::Ok();
}

// ---- the kernels with no I/O --------------------------------------------------------------

// The step's compute on in-memory buffers of one chunk: the gradient scan over every element,
// then the update of every chunk (the same chunk sizes), reusing the buffers.
// int8 moments: the block scales of `elements` elements (none for other dtypes), held in memory.
class QuantScales {
 public:
  QuantScales(DType moments, uint64_t elements)
      : exp_avg_(moments == DType::kInt8 ? optim::QuantBlockCount(elements, 0) : 0),
        exp_avg_sq_(exp_avg_.size()) {}
  // Points `buffers` (starting at element `first`, a multiple of kQuantBlock) at its scales.
  void Attach(uint64_t first, optim::ChunkBuffers* buffers) {
    if (exp_avg_.empty()) return;
    buffers->exp_avg_scale = exp_avg_.data() + first / optim::kQuantBlock;
    buffers->exp_avg_sq_scale = exp_avg_sq_.data() + first / optim::kQuantBlock;
  }

 private:
  std::vector<float> exp_avg_, exp_avg_sq_;
};

Status RunComputeOnlyPhase(Rig& rig, DType moments, StepBenchResult* out) {
  const uint64_t count = rig.spec.params;
  const uint64_t chunk = out->chunk_elements;
  const size_t state_bytes = DTypeSize(moments);
  ZOE_ASSIGN_OR_RETURN(SharedViews views, MakeSharedViews(std::min(count, chunk), chunk));
  const size_t tile = rig.run.tile_elements;
  ZOE_ASSIGN_OR_RETURN(AlignedBuffer master,
                       optim::AllocateFirstTouch(chunk * 4, tile * 4, rig.run.executor));
  ZOE_ASSIGN_OR_RETURN(
      AlignedBuffer m,
      optim::AllocateFirstTouch(chunk * state_bytes, tile * state_bytes, rig.run.executor));
  ZOE_ASSIGN_OR_RETURN(
      AlignedBuffer v,
      optim::AllocateFirstTouch(chunk * state_bytes, tile * state_bytes, rig.run.executor));
  const optim::ChunkLayout chunk_layout{DType::kFloat32, moments, std::nullopt};
  const optim::HyperParams hyper = BenchHyper();
  QuantScales scales(moments, chunk);
  int64_t step = 0;
  ZOE_ASSIGN_OR_RETURN(
      out->compute_only_seconds, MedianSeconds(rig.spec.warmup, rig.spec.steps, [&]() -> Status {
        ++step;
        optim::GradScan total;
        for (uint64_t first = 0; first < count; first += chunk) {
          ZOE_ASSIGN_OR_RETURN(optim::GradScan scan,
                               optim::ScanGradients(views.values.data(), DType::kFloat32,
                                                    std::min(chunk, count - first), rig.run));
          total = optim::CombineScans(total, scan);
        }
        ZOE_ASSIGN_OR_RETURN(optim::StepScaling scaling, optim::MakeStepScaling(total, 1.0, 0.0));
        for (uint64_t first = 0; first < count; first += chunk) {
          optim::ChunkBuffers buffers{reinterpret_cast<float*>(master.data()),
                                      views.values.data(),
                                      m.data(),
                                      v.data(),
                                      nullptr,
                                      std::min(chunk, count - first)};
          scales.Attach(0, &buffers);
          ZOE_RETURN_IF_ERROR(
              optim::UpdateChunk(hyper, step, chunk_layout, buffers, scaling.scaling, rig.run));
        }
        return Status::Ok();
      }));
  return Status::Ok();
}

// ---- DeepSpeed-style synchronous baseline -------------------------------------------------

// Releases the DeepSpeed-style buffer, unlocking it first when mlock succeeded.
struct UnlockAndFree {
  uint64_t bytes = 0;
  bool locked = false;
  void operator()(std::byte* data) const {
    if (locked) (void)munlock(data, bytes);
    std::free(data);
  }
};

// The baseline's pinned buffer. kDeepSpeed allocates it as DeepSpeed's aio handle allocates its
// pinned tensors (posix_memalign to the page size, then mlock), so the disk transfers into 4 KiB
// pages; kZoe takes it from a zoe pinned pool (huge pages where the kernel has them, see
// core/io_memory.h). When mlock is refused the DeepSpeed-style buffer stays unlocked, as
// DeepSpeed's does after printing the error.
class BaselineBuffer {
 public:
  static Result<BaselineBuffer> Allocate(BaselineMemory memory, uint64_t bytes) {
    BaselineBuffer buffer;
    if (memory == BaselineMemory::kZoe) {
      ZOE_ASSIGN_OR_RETURN(
          PinnedMemoryPool pool,
          PinnedMemoryPool::Create({.name = "bench step baseline", .budget_bytes = bytes}));
      buffer.pool_.emplace(std::move(pool));
      ZOE_ASSIGN_OR_RETURN(buffer.pinned_, buffer.pool_->Allocate(bytes));
      buffer.data_ = buffer.pinned_.data();
      buffer.size_ = buffer.pinned_.size();
      buffer.locked_ = buffer.pinned_.pinned();
      return buffer;
    }
    void* data = nullptr;
    if (posix_memalign(&data, static_cast<size_t>(sysconf(_SC_PAGESIZE)), bytes) != 0) {
      return Status::OutOfMemory(fmt::format("baseline: cannot allocate {} bytes", bytes));
    }
    buffer.locked_ = mlock(data, bytes) == 0;
    buffer.page_aligned_ = std::unique_ptr<std::byte, UnlockAndFree>(
        static_cast<std::byte*>(data), UnlockAndFree{bytes, buffer.locked_});
    buffer.data_ = buffer.page_aligned_.get();
    buffer.size_ = bytes;
    return buffer;
  }

  std::byte* data() { return data_; }
  uint64_t size() const { return size_; }
  bool locked() const { return locked_; }

 private:
  std::optional<PinnedMemoryPool> pool_;
  PinnedBuffer pinned_;
  std::unique_ptr<std::byte, UnlockAndFree> page_aligned_;
  std::byte* data_ = nullptr;
  uint64_t size_ = 0;
  bool locked_ = false;
};

// One file per tensor (master, exp_avg, exp_avg_sq) in the first path; for each sub-group that
// fits the pinned budget: read the three tensors' slices (in 1 MiB requests, all submitted
// together, as DeepSpeed's aio handle does), wait, update, write them back, wait.
class Baseline {
 public:
  static Result<std::unique_ptr<Baseline>> Create(Rig& rig, DType moments, uint64_t budget,
                                                  BaselineMemory memory) {
    auto b = std::unique_ptr<Baseline>(new Baseline(rig, moments));
    const uint64_t per_element = BytesPerElement(moments);
    b->subgroup_ =
        std::max(kElementGranule, budget / per_element / kElementGranule * kElementGranule);
    b->subgroup_ = std::min(b->subgroup_, AlignUp(rig.spec.params, kElementGranule));
    b->scales_ = QuantScales(moments, b->subgroup_);
    ZOE_ASSIGN_OR_RETURN(b->buffer_, BaselineBuffer::Allocate(memory, b->subgroup_ * per_element));
    std::fill_n(b->buffer_.data(), b->buffer_.size(), std::byte{0});
    const char* names[] = {"master", "exp_avg", "exp_avg_sq"};
    const uint64_t padded = AlignUp(rig.spec.params, kElementGranule);
    for (size_t t = 0; t < 3; ++t) {
      const std::string path =
          fmt::format("{}/zoe-bench-step-{}-{}.tensor", rig.paths[0], ::getpid(), names[t]);
      io::FileSetOptions options;
      options.open.truncate = true;
      ZOE_ASSIGN_OR_RETURN(b->files_[t], io::FileSet::Open({path}, options));
      ZOE_RETURN_IF_ERROR(b->files_[t]->file(0).Allocate(padded * b->element_bytes(t)));
    }
    // Lay the tensors down once (untimed), so the timed reads come from the disk.
    for (uint64_t first = 0; first < rig.spec.params; first += b->subgroup_) {
      ZOE_RETURN_IF_ERROR(b->Move(io::Op::kWrite, first));
    }
    ZOE_ASSIGN_OR_RETURN(b->views_,
                         MakeSharedViews(std::min<uint64_t>(rig.spec.params, 1 << 20), 1 << 20));
    return b;
  }
  ~Baseline() {
    for (auto& files : files_) {
      if (files) (void)files->file(0).Remove();
    }
  }

  uint64_t subgroup_elements() const { return subgroup_; }
  uint64_t pinned_bytes() const { return buffer_.size(); }
  bool locked() const { return buffer_.locked(); }
  uint64_t bytes_per_step() const {
    return 2 * AlignUp(rig_.spec.params, kElementGranule) * BytesPerElement(moments_);
  }

  Status Step() {
    ++step_;
    const uint64_t count = rig_.spec.params;
    const uint64_t grad_elements = views_.grads.front().count;
    optim::GradScan total;
    for (uint64_t first = 0; first < count; first += grad_elements) {
      ZOE_ASSIGN_OR_RETURN(optim::GradScan scan,
                           optim::ScanGradients(views_.values.data(), DType::kFloat32,
                                                std::min(grad_elements, count - first), rig_.run));
      total = optim::CombineScans(total, scan);
    }
    ZOE_ASSIGN_OR_RETURN(optim::StepScaling scaling, optim::MakeStepScaling(total, 1.0, 0.0));
    for (uint64_t first = 0; first < count; first += subgroup_) {
      ZOE_RETURN_IF_ERROR(Move(io::Op::kRead, first));
      ZOE_RETURN_IF_ERROR(Update(std::min(subgroup_, count - first), scaling, grad_elements));
      ZOE_RETURN_IF_ERROR(Move(io::Op::kWrite, first));
    }
    return Status::Ok();
  }

 private:
  Baseline(Rig& rig, DType moments) : rig_(rig), moments_(moments), scales_(moments, 0) {}

  uint64_t element_bytes(size_t tensor) const { return tensor == 0 ? 4 : DTypeSize(moments_); }
  std::byte* region(size_t tensor) {
    uint64_t offset = 0;
    for (size_t t = 0; t < tensor; ++t) offset += subgroup_ * element_bytes(t);
    return buffer_.data() + offset;
  }

  // Reads or writes the sub-group starting at element `first` of all three tensors and waits.
  Status Move(io::Op op, uint64_t first) {
    const uint64_t elements =
        std::min(subgroup_, AlignUp(rig_.spec.params, kElementGranule) - first);
    std::vector<io::IoRequest> requests;
    for (size_t t = 0; t < 3; ++t) {
      const uint64_t bytes = elements * element_bytes(t);
      const uint64_t base = first * element_bytes(t);
      for (uint64_t at = 0; at < bytes; at += kBaselineBlock) {
        const uint64_t length = std::min(kBaselineBlock, bytes - at);
        requests.push_back({op, files_[t].get(), base + at, std::span(region(t) + at, length)});
      }
    }
    std::vector<io::Ticket> tickets;
    ZOE_RETURN_IF_ERROR(rig_.queue->SubmitBatch(requests, &tickets));
    return rig_.queue->WaitAll();
  }

  // The update of one sub-group, in pieces as long as the shared gradient buffer.
  Status Update(uint64_t elements, const optim::StepScaling& scaling, uint64_t grad_elements) {
    const optim::ChunkLayout layout{DType::kFloat32, moments_, std::nullopt};
    const size_t state = DTypeSize(moments_);
    for (uint64_t at = 0; at < elements; at += grad_elements) {
      optim::ChunkBuffers buffers{reinterpret_cast<float*>(region(0)) + at,
                                  views_.values.data(),
                                  region(1) + at * state,
                                  region(2) + at * state,
                                  nullptr,
                                  std::min(grad_elements, elements - at)};
      scales_.Attach(at, &buffers);
      ZOE_RETURN_IF_ERROR(
          optim::UpdateChunk(BenchHyper(), step_, layout, buffers, scaling.scaling, rig_.run));
    }
    return Status::Ok();
  }

  Rig& rig_;
  DType moments_;
  // int8 moments: their scales (1/64 of the moments' bytes) stay in memory, not moved by I/O.
  QuantScales scales_;
  uint64_t subgroup_ = 0;
  BaselineBuffer buffer_;
  std::array<std::unique_ptr<io::FileSet>, 3> files_;
  SharedViews views_;
  int64_t step_ = 0;
};

Result<BaselineResult> RunBaselinePhase(Rig& rig, DType moments, uint64_t budget,
                                        BaselineMemory memory) {
  ResetPeakRss();
  ZOE_ASSIGN_OR_RETURN(auto baseline, Baseline::Create(rig, moments, budget, memory));
  BaselineResult result;
  result.memory = memory;
  result.locked = baseline->locked();
  result.subgroup_elements = baseline->subgroup_elements();
  result.pinned_bytes = baseline->pinned_bytes();
  ZOE_ASSIGN_OR_RETURN(result.seconds, MedianSeconds(rig.spec.warmup, rig.spec.steps,
                                                     [&] { return baseline->Step(); }));
  result.bytes_read = baseline->bytes_per_step() / 2;
  result.bytes_written = baseline->bytes_per_step() / 2;
  result.peak_rss_bytes = PeakRssBytes();
  return result;
}

// ---- one moment dtype ---------------------------------------------------------------------

// The phases other than the group step, measured once per moment dtype, shared by its rows.
void CopyOtherPhases(const StepBenchResult& from, StepBenchResult* to) {
  to->io_only_seconds = from.io_only_seconds;
  to->compute_only_seconds = from.compute_only_seconds;
  to->baseline = from.baseline;
  to->baseline_zoe_memory = from.baseline_zoe_memory;
}

// The rows of one moment dtype: the group step with each checksum setting (interleaved), then
// the phases it overlaps (I/O only, compute only) and the baseline, measured once and shared.
Result<std::vector<StepBenchResult>> RunMoments(Rig& rig, DType moments) {
  const StepBenchSpec& spec = rig.spec;
  std::vector<StepBenchResult> rows(spec.checksums.size());
  std::vector<StepBenchResult*> outs;
  for (size_t i = 0; i < rows.size(); ++i) {
    StepBenchResult& out = rows[i];
    out.moment_dtype = moments;
    out.checksum = spec.checksums[i];
    out.backend = std::string(rig.queue->backend());
    out.chunk_elements = ChunkElementsFor(spec, moments);
    out.chunks = offload::CeilDiv(spec.params, out.chunk_elements);
    out.nvme_chunks = spec.offload == offload::Tier::kNvme ? out.chunks : 0;
    outs.push_back(&out);
  }
  ZOE_RETURN_IF_ERROR(RunGroupPhase(rig, moments, outs).WithContext("group step"));
  StepBenchResult& out = rows.front();
  const offload::StateLayout layout(optim::Kind::kAdamW, moments, spec.params, out.chunk_elements,
                                    kPage);
  if (out.nvme_chunks > 0) {
    io::SwapOptions options;  // the disk's own ceiling: no checksums
    options.name_prefix = "zoe-bench-step-io";
    ZOE_ASSIGN_OR_RETURN(
        auto swap,
        io::SwapSpace::Create(rig.paths, SwapCapacity(layout, out.nvme_chunks, options.alignment),
                              options));
    ZOE_RETURN_IF_ERROR(RunIoOnlyPhase(rig, moments, *swap, &out).WithContext("io-only"));
    ZOE_RETURN_IF_ERROR(swap->Close());
  }
  ZOE_RETURN_IF_ERROR(RunComputeOnlyPhase(rig, moments, &out).WithContext("compute-only"));
  if (spec.baseline && out.nvme_chunks > 0) {
    const uint64_t budget = PinnedNeed(layout, out.nvme_chunks, spec.buffer_count);
    ZOE_ASSIGN_OR_RETURN(out.baseline,
                         RunBaselinePhase(rig, moments, budget, BaselineMemory::kDeepSpeed));
    ZOE_ASSIGN_OR_RETURN(out.baseline_zoe_memory,
                         RunBaselinePhase(rig, moments, budget, BaselineMemory::kZoe));
  }
  for (size_t i = 1; i < rows.size(); ++i) CopyOtherPhases(out, &rows[i]);
  return rows;
}

double Gbps(uint64_t bytes, double seconds) {
  return seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0.0;
}

const char* BaselineMemoryName(BaselineMemory memory) {
  return memory == BaselineMemory::kDeepSpeed ? "deepspeed" : "zoe";
}

nlohmann::json BaselineJson(const BaselineResult& b, uint64_t step_bytes, double step_seconds) {
  const double baseline_gbps = Gbps(b.bytes_read + b.bytes_written, b.seconds);
  return {{"memory", BaselineMemoryName(b.memory)},
          {"locked", b.locked},
          {"subgroup_elements", b.subgroup_elements},
          {"pinned_bytes", b.pinned_bytes},
          {"seconds", b.seconds},
          {"bytes_read", b.bytes_read},
          {"bytes_written", b.bytes_written},
          {"gbytes_per_s", baseline_gbps},
          {"peak_rss_bytes", b.peak_rss_bytes},
          {"step_gbytes_per_s_ratio", Gbps(step_bytes, step_seconds) / baseline_gbps},
          {"step_speedup", b.seconds / step_seconds}};
}

nlohmann::json IterationJson(const IterationResult& it) {
  return {{"after", it.after},
          {"overlap", it.overlap},
          {"speculative", it.speculative},
          {"step_alone", it.step_alone},
          {"bound", it.bound},
          {"speculative_over_bound", it.speculative / it.bound},
          {"speedup_over_after", it.after / it.speculative},
          {"chunks_speculative", it.chunks_speculative},
          {"chunks_recomputed", it.chunks_recomputed},
          {"steps_declined", it.steps_declined}};
}

}  // namespace

Status ValidateStepSpec(const StepBenchSpec& spec) {
  if (spec.params == 0) return Status::InvalidArgument("--params 0; allowed: >= 1");
  if (spec.offload != offload::Tier::kNvme && spec.offload != offload::Tier::kHost) {
    return Status::InvalidArgument("--offload: allowed nvme or cpu");
  }
  if (spec.moment_dtypes.empty()) return Status::InvalidArgument("--moment-dtype: none given");
  for (DType dtype : spec.moment_dtypes) {
    ZOE_RETURN_IF_ERROR(optim::CheckKernelDType(dtype, optim::kStateDTypes, "--moment-dtype"));
  }
  if (spec.checksums.empty() || spec.checksums.size() > 2 ||
      (spec.checksums.size() == 2 && spec.checksums[0] == spec.checksums[1])) {
    return Status::InvalidArgument("--checksum: allowed on, off, on,off or off,on");
  }
  if (spec.steps < 1 || spec.warmup < 0) {
    return Status::InvalidArgument("--steps must be >= 1 and --warmup >= 0");
  }
  if (spec.buffer_count < 2) return Status::InvalidArgument("--buffer-count must be >= 2");
  if (spec.chunk_elements > 0 && spec.pinned_budget > 0) {
    return Status::InvalidArgument("give --chunk-elements or --pinned-budget, not both");
  }
  if (spec.chunk_elements % kElementGranule != 0) {
    return Status::InvalidArgument(fmt::format("--chunk-elements {} must be a multiple of {}",
                                               spec.chunk_elements, kElementGranule));
  }
  if (spec.iodepth < 1 || spec.iodepth > 4096) {
    return Status::InvalidArgument("--iodepth must be in 1..4096");
  }
  if (!(spec.backward_ms >= 0 && spec.backward_ms <= 3.6e6)) {
    return Status::InvalidArgument(
        fmt::format("--backward-ms {} is out of range; allowed: 0 (no iterations) to 3600000",
                    spec.backward_ms));
  }
  if (!(spec.max_grad_norm >= 0 && std::isfinite(spec.max_grad_norm))) {
    return Status::InvalidArgument(fmt::format(
        "--max-grad-norm {} is out of range; allowed: 0 (no clipping) or > 0", spec.max_grad_norm));
  }
  if (spec.slots != 1 && spec.slots != 2) {
    return Status::InvalidArgument(
        fmt::format("--slots {}; allowed: 1 (in place) or 2 (atomic steps)", spec.slots));
  }
  if (spec.steps_per_day &&
      (!(*spec.steps_per_day >= 0.0) || !std::isfinite(*spec.steps_per_day))) {
    return Status::InvalidArgument(
        fmt::format("--steps-per-day {}; allowed: a finite number >= 0", *spec.steps_per_day));
  }
  return Status::Ok();
}

Result<StepBenchReport> RunStepBench(const StepBenchSpec& spec) {
  ZOE_RETURN_IF_ERROR(ValidateStepSpec(spec));
  ZOE_ASSIGN_OR_RETURN(auto rig, MakeRig(spec));
  StepBenchReport report;
  report.spec = spec;
  report.spec.paths = rig->paths;
  report.threads = rig->threads->participants();
  report.isa = std::string(optim::IsaName(*rig->run.isa));
  for (DType moments : spec.moment_dtypes) {
    ZOE_ASSIGN_OR_RETURN(std::vector<StepBenchResult> rows, RunMoments(*rig, moments));
    for (StepBenchResult& row : rows) report.results.push_back(std::move(row));
  }
  return report;
}

namespace {

const StepBenchResult* FindRow(const StepBenchReport& report, DType moments, bool checksum) {
  for (const StepBenchResult& r : report.results) {
    if (r.moment_dtype == moments && r.checksum == checksum) return &r;
  }
  return nullptr;
}

// "1.25x faster than", or for a ratio below 1 "1.45x slower than" (speculative over after).
std::string FasterOrSlower(double speedup) {
  if (speedup >= 1.0 || !(speedup > 0.0)) return fmt::format("{:.2f}x faster than", speedup);
  return fmt::format("{:.2f}x slower than", 1.0 / speedup);
}

}  // namespace

nlohmann::json StepReportJson(const StepBenchReport& report) {
  nlohmann::json results = nlohmann::json::array();
  for (const StepBenchResult& r : report.results) {
    const uint64_t bytes = r.bytes_read + r.bytes_written;
    // The state a step streams through the optimizer, read (or found in the buffers) and written:
    // what the baseline moves for the same step.
    const uint64_t state_bytes = bytes + r.bytes_reused;
    nlohmann::json row = {{"moment_dtype", DTypeName(r.moment_dtype)},
                          {"checksum", r.checksum},
                          {"checksum_block", r.checksum_block},
                          {"backend", r.backend},
                          {"chunk_elements", r.chunk_elements},
                          {"chunks", r.chunks},
                          {"nvme_chunks", r.nvme_chunks},
                          {"step_seconds", r.step_seconds},
                          {"bytes_read", r.bytes_read},
                          {"bytes_written", r.bytes_written},
                          {"bytes_reused", r.bytes_reused},
                          {"gbytes_per_s", Gbps(bytes, r.step_seconds)},
                          {"state_gbytes_per_s", Gbps(state_bytes, r.step_seconds)},
                          {"step_io_wait_seconds", r.io_wait_seconds},
                          {"step_compute_seconds", r.compute_seconds},
                          {"io_only_seconds", r.io_only_seconds},
                          {"io_only_gbytes_per_s", Gbps(bytes, r.io_only_seconds)},
                          {"compute_only_seconds", r.compute_only_seconds},
                          {"overlap_efficiency",
                           std::max(r.io_only_seconds, r.compute_only_seconds) / r.step_seconds},
                          {"pinned_bytes", r.pinned_bytes},
                          {"nvme_bytes", r.nvme_bytes},
                          {"peak_rss_bytes", r.peak_rss_bytes},
                          {"wear", nlohmann::json::array()},
                          {"baseline", nullptr}};
    for (const WearProjection& wear : r.wear) row["wear"].push_back(WearJson(wear));
    if (r.baseline) row["baseline"] = BaselineJson(*r.baseline, state_bytes, r.step_seconds);
    if (r.iteration) row["iteration"] = IterationJson(*r.iteration);
    if (r.baseline_zoe_memory) {
      row["baseline_zoe_memory"] =
          BaselineJson(*r.baseline_zoe_memory, state_bytes, r.step_seconds);
    }
    results.push_back(std::move(row));
  }
  nlohmann::json json = {{"schema_version", 1},
                         {"params", report.spec.params},
                         {"offload", report.spec.offload == offload::Tier::kNvme ? "nvme" : "cpu"},
                         {"paths", report.spec.paths},
                         {"buffer_count", report.spec.buffer_count},
                         {"slots", report.spec.slots},
                         {"iodepth", report.spec.iodepth},
                         {"steps", report.spec.steps},
                         {"backward_ms", report.spec.backward_ms},
                         {"max_grad_norm", report.spec.max_grad_norm},
                         {"threads", report.threads},
                         {"isa", report.isa},
                         {"results", results}};
  const StepBenchResult* fp32 = FindRow(report, DType::kFloat32, report.spec.checksums[0]);
  const StepBenchResult* bf16 = FindRow(report, DType::kBFloat16, report.spec.checksums[0]);
  if (fp32 != nullptr && bf16 != nullptr) {
    json["bf16_speedup_over_fp32"] = fp32->step_seconds / bf16->step_seconds;
  }
  const StepBenchResult* int8 = FindRow(report, DType::kInt8, report.spec.checksums[0]);
  if (fp32 != nullptr && int8 != nullptr) {
    json["int8_speedup_over_fp32"] = fp32->step_seconds / int8->step_seconds;
  }
  // What verifying every block read back costs the step: (with / without) - 1.
  nlohmann::json cost = nlohmann::json::object();
  for (DType moments : report.spec.moment_dtypes) {
    const StepBenchResult* on = FindRow(report, moments, true);
    const StepBenchResult* off = FindRow(report, moments, false);
    if (on != nullptr && off != nullptr) {
      cost[std::string(DTypeName(moments))] = on->step_seconds / off->step_seconds - 1.0;
    }
  }
  if (!cost.empty()) json["checksum_cost"] = std::move(cost);
  return json;
}

std::string StepReportTable(const nlohmann::json& json) {
  std::ostringstream out;
  out << fmt::format(
      "zoe bench step: {} params, offload {}, {} kernel threads ({}), {} buffers, {} slot(s) "
      "per chunk, queue depth {}, median of {} steps\n",
      json["params"].get<uint64_t>(), json["offload"].get<std::string>(),
      json["threads"].get<unsigned>(), json["isa"].get<std::string>(),
      json["buffer_count"].get<uint32_t>(), json["slots"].get<uint32_t>(),
      json["iodepth"].get<uint32_t>(), json["steps"].get<int>());
  out << fmt::format(
      "{:<6} {:<6} {:<9} {:>10} {:>9} {:>9} {:>9} {:>8} {:>11} {:>9} {:>9} {:>8} {:>10} {:>10}\n",
      "moment", "cksum", "backend", "chunk", "step s", "GB moved", "GB reused", "GB/s",
      "state GB/s", "io-only s", "compute s", "overlap", "pinned MiB", "peak RSS MiB");
  for (const auto& r : json["results"]) {
    out << fmt::format(
        "{:<6} {:<6} {:<9} {:>10} {:>9.3f} {:>9.2f} {:>9.2f} {:>8.2f} {:>11.2f} {:>9.3f} {:>9.3f} "
        "{:>8.3f} {:>10.0f} {:>10.0f}\n",
        r["moment_dtype"].get<std::string>(), r["checksum"].get<bool>() ? "on" : "off",
        r["backend"].get<std::string>(), r["chunk_elements"].get<uint64_t>(),
        r["step_seconds"].get<double>(),
        static_cast<double>(r["bytes_read"].get<uint64_t>() + r["bytes_written"].get<uint64_t>()) /
            1e9,
        static_cast<double>(r["bytes_reused"].get<uint64_t>()) / 1e9,
        r["gbytes_per_s"].get<double>(), r["state_gbytes_per_s"].get<double>(),
        r["io_only_seconds"].get<double>(), r["compute_only_seconds"].get<double>(),
        r["overlap_efficiency"].get<double>(),
        static_cast<double>(r["pinned_bytes"].get<uint64_t>()) / (1 << 20),
        static_cast<double>(r["peak_rss_bytes"].get<uint64_t>()) / (1 << 20));
    if (r.contains("iteration")) {
      const auto& it = r["iteration"];
      out << fmt::format(
          "  iteration with a {:.0f} ms backward: after {:.3f} s, overlap {:.3f} s, speculative "
          "{:.3f} s; step alone {:.3f} s, bound {:.3f} s; speculative = {:.2f}x the bound, "
          "{} after ({} chunks recomputed of {}; {} steps declined to speculate)\n",
          json["backward_ms"].get<double>(), it["after"].get<double>(), it["overlap"].get<double>(),
          it["speculative"].get<double>(), it["step_alone"].get<double>(),
          it["bound"].get<double>(), it["speculative_over_bound"].get<double>(),
          FasterOrSlower(it["speedup_over_after"].get<double>()),
          it["chunks_recomputed"].get<uint64_t>(), it["chunks_speculative"].get<uint64_t>(),
          it["steps_declined"].get<uint64_t>());
    }
    for (const auto& w : r["wear"]) {
      out << fmt::format(
          "  wear of {}: {:.3f} GB written per step; at {:.0f} steps a day on {:.0f} GB, "
          "{:.2f} drive writes per day\n",
          w["path"].get<std::string>(),
          static_cast<double>(w["bytes_written_per_step"].get<uint64_t>()) / 1e9,
          w["steps_per_day"].get<double>(),
          static_cast<double>(w["drive_capacity_bytes"].get<uint64_t>()) / 1e9,
          w["drive_writes_per_day"].get<double>());
    }
    for (const char* key : {"baseline", "baseline_zoe_memory"}) {
      if (!r.contains(key) || r[key].is_null()) continue;
      const auto& b = r[key];
      out << fmt::format(
          "  baseline on {} memory (synchronous, one file per tensor, {} elements per sub-group, "
          "{:.0f} MiB pinned): {:.3f} s, {:.2f} GB/s; step / baseline state GB/s = {:.2f}\n",
          b["memory"].get<std::string>(), b["subgroup_elements"].get<uint64_t>(),
          static_cast<double>(b["pinned_bytes"].get<uint64_t>()) / (1 << 20),
          b["seconds"].get<double>(), b["gbytes_per_s"].get<double>(),
          b["step_gbytes_per_s_ratio"].get<double>());
    }
  }
  if (json.contains("checksum_cost")) {
    for (const auto& [moments, cost] : json["checksum_cost"].items()) {
      out << fmt::format("{} moments: checksums cost {:+.1f}% of the step{}\n", moments,
                         100.0 * cost.get<double>(),
                         cost.get<double>() < 0 ? " (below zero: within the runs' noise)" : "");
    }
  }
  if (json.contains("bf16_speedup_over_fp32")) {
    out << fmt::format("bf16 moments: {:.2f}x the speed of fp32 moments\n",
                       json["bf16_speedup_over_fp32"].get<double>());
  }
  if (json.contains("int8_speedup_over_fp32")) {
    out << fmt::format("int8 moments: {:.2f}x the speed of fp32 moments\n",
                       json["int8_speedup_over_fp32"].get<double>());
  }
  return out.str();
}

}  // namespace zoe::cli
