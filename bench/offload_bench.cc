#include "bench/offload_bench.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <thread>

#include "core/aligned_buffer.h"
#include "io/queue.h"
#include "io/swap_space.h"
#include "offload/paging/tier_manager.h"

namespace zoe::cli {
namespace {

using Clock = std::chrono::steady_clock;
using offload::Link;
using offload::StatsSnapshot;
using offload::TensorId;
using offload::Tier;
using offload::TierManager;

struct Policy {
  bool trace = false;
  EvictionKind eviction = EvictionKind::kLru;
};

Result<Policy> ParsePolicy(const std::string& name) {
  if (name == "none+lru") return Policy{false, EvictionKind::kLru};
  if (name == "trace+lru") return Policy{true, EvictionKind::kLru};
  if (name == "trace+opt") return Policy{true, EvictionKind::kOpt};
  return Status::InvalidArgument("policy '" + name + "'; allowed: none+lru, trace+lru, trace+opt");
}

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

uint64_t RoundUp(uint64_t value, uint64_t unit) { return (value + unit - 1) / unit * unit; }

// The work a layer does while its weights are held. Sleeping ends with a short spin to the
// deadline, because a sleeping thread wakes up late by the scheduler's latency (milliseconds on a
// busy machine), which would be counted as compute.
void Compute(const OffloadBenchSpec& spec) {
  const auto duration = std::chrono::duration_cast<std::chrono::nanoseconds>(
      std::chrono::duration<double, std::milli>(spec.compute_ms));
  const Clock::time_point end = Clock::now() + duration;
  constexpr auto kSpinTail = std::chrono::microseconds(500);
  if (spec.compute == ComputeMode::kSleep && duration > kSpinTail)
    std::this_thread::sleep_until(end - kSpinTail);
  while (Clock::now() < end) {
  }
}

// A value per layer, so every layer's bytes differ and a wrong page would show in a check.
void FillLayer(std::span<std::byte> bytes, uint32_t layer) {
  std::memset(bytes.data(), static_cast<int>(layer * 37 + 1), bytes.size());
}

offload::TierManagerOptions ManagerOptions(const OffloadBenchSpec& spec, const Policy& policy) {
  offload::TierManagerOptions options;
  const uint64_t layer = RoundUp(spec.layer_bytes, 4096);
  options.device_backend = "host";
  options.device_budget_bytes = spec.device_budget_layers * layer;
  options.host_budget_bytes = spec.host_budget_layers * layer;
  options.layout.chunk_bytes = layer;  // one layer, one chunk
  options.nvme_paths = {spec.dir};
  options.nvme_capacity_bytes = spec.layers * layer;
  options.io_backend = spec.backend;
  options.queue_depth = spec.queue_depth;
  const uint32_t lookahead =
      spec.lookahead_layers ? spec.lookahead_layers : spec.host_budget_layers - 1;
  options.lookahead_bytes = lookahead * layer;
  options.prefetch_in_flight = spec.prefetch_in_flight;
  options.eviction = policy.eviction;
  return options;
}

// Writes every layer once and drops it from memory, so iterations read real bytes from NVMe.
Result<std::vector<TensorId>> PopulateLayers(TierManager& manager, const OffloadBenchSpec& spec) {
  std::vector<TensorId> ids;
  for (uint32_t i = 0; i < spec.layers; ++i) {
    offload::TensorDesc desc{fmt::format("layer{}", i), spec.layer_bytes, offload::DType::kUInt8,
                             Tier::kHost, ""};
    ZOE_ASSIGN_OR_RETURN(TensorId id, manager.RegisterTensor(desc));
    ZOE_ASSIGN_OR_RETURN(void* data, manager.Acquire(id, Tier::kHost, offload::Access::kWrite));
    FillLayer({static_cast<std::byte*>(data), spec.layer_bytes}, i);
    ZOE_RETURN_IF_ERROR(manager.Release(id));
    ZOE_RETURN_IF_ERROR(manager.Evict(id));  // writes it back
    ids.push_back(id);
  }
  return ids;
}

// Seconds spent inside the tier manager's calls during one iteration.
struct CallSeconds {
  double acquire = 0;
  double release = 0;
  double compute = 0;  // as measured, for the scheduler's share of it
};

Status Step(TierManager& manager, TensorId id, const OffloadBenchSpec& spec, CallSeconds* calls) {
  Clock::time_point start = Clock::now();
  ZOE_ASSIGN_OR_RETURN(void* weights, manager.Acquire(id, Tier::kDevice, offload::Access::kRead));
  (void)weights;
  calls->acquire += SecondsSince(start);
  start = Clock::now();
  Compute(spec);
  calls->compute += SecondsSince(start);
  start = Clock::now();
  Status released = manager.Release(id);
  calls->release += SecondsSince(start);
  return released;
}

Status RunIteration(TierManager& manager, const std::vector<TensorId>& ids,
                    const OffloadBenchSpec& spec, CallSeconds* calls) {
  for (TensorId id : ids) ZOE_RETURN_IF_ERROR(Step(manager, id, spec, calls));
  for (auto it = ids.rbegin(); it != ids.rend(); ++it)
    ZOE_RETURN_IF_ERROR(Step(manager, *it, spec, calls));
  return Status::Ok();
}

void AddTraffic(PolicyTraffic& sum, const StatsSnapshot& after, const StatsSnapshot& before) {
  const auto link = [&](Link l) {
    const auto i = static_cast<size_t>(l);
    return static_cast<double>(after.links[i].bytes - before.links[i].bytes);
  };
  sum.nvme_to_host_bytes += link(Link::kNvmeToHost);
  sum.host_to_nvme_bytes += link(Link::kHostToNvme);
  sum.host_to_device_bytes += link(Link::kHostToDevice);
  sum.device_to_host_bytes += link(Link::kDeviceToHost);
  sum.prefetches_issued += static_cast<double>(after.prefetches_issued - before.prefetches_issued);
  sum.prefetch_hits += static_cast<double>(after.prefetch_hits - before.prefetch_hits);
  sum.prefetch_misses += static_cast<double>(after.prefetch_misses - before.prefetch_misses);
}

void DivideTraffic(PolicyTraffic& sum, double n) {
  for (double* v : {&sum.nvme_to_host_bytes, &sum.host_to_nvme_bytes, &sum.host_to_device_bytes,
                    &sum.device_to_host_bytes, &sum.prefetches_issued, &sum.prefetch_hits,
                    &sum.prefetch_misses}) {
    *v /= n;
  }
}

Result<PolicyResult> RunPolicy(const OffloadBenchSpec& spec, const std::string& name,
                               std::string* backend) {
  ZOE_ASSIGN_OR_RETURN(Policy policy, ParsePolicy(name));
  ZOE_ASSIGN_OR_RETURN(std::unique_ptr<TierManager> manager,
                       TierManager::Create(ManagerOptions(spec, policy)));
  *backend = std::string(manager->io_backend());
  ZOE_ASSIGN_OR_RETURN(std::vector<TensorId> ids, PopulateLayers(*manager, spec));
  PolicyResult result;
  result.policy = name;
  for (uint32_t i = 0; i < spec.warmup + spec.iterations; ++i) {
    if (policy.trace) ZOE_RETURN_IF_ERROR(manager->TraceBegin("iteration"));
    const StatsSnapshot before = manager->stats().Snapshot();
    const Clock::time_point start = Clock::now();
    CallSeconds calls;
    ZOE_RETURN_IF_ERROR(RunIteration(*manager, ids, spec, &calls));
    const double seconds = SecondsSince(start);
    const StatsSnapshot after = manager->stats().Snapshot();
    if (policy.trace) ZOE_RETURN_IF_ERROR(manager->TraceEnd());
    if (i < spec.warmup) continue;
    result.iteration_seconds.push_back(seconds);
    result.stall_seconds.push_back(
        static_cast<double>(after.stall_nanoseconds - before.stall_nanoseconds) / 1e9);
    result.acquire_seconds.push_back(calls.acquire);
    result.release_seconds.push_back(calls.release);
    result.compute_seconds.push_back(calls.compute);
    AddTraffic(result.traffic, after, before);
  }
  DivideTraffic(result.traffic, spec.iterations);
  const StatsSnapshot end = manager->stats().Snapshot();
  result.peak_host_bytes =
      static_cast<double>(end.tiers[static_cast<size_t>(Tier::kHost)].peak_occupancy_bytes);
  result.peak_device_bytes =
      static_cast<double>(end.tiers[static_cast<size_t>(Tier::kDevice)].peak_occupancy_bytes);
  result.median_iteration_seconds = MedianOf(result.iteration_seconds);
  result.median_stall_seconds = MedianOf(result.stall_seconds);
  result.median_acquire_seconds = MedianOf(result.acquire_seconds);
  result.median_release_seconds = MedianOf(result.release_seconds);
  result.median_compute_seconds = MedianOf(result.compute_seconds);
  const double lookups = result.traffic.prefetch_hits + result.traffic.prefetch_misses;
  result.hit_rate = lookups > 0 ? result.traffic.prefetch_hits / lookups : 0;
  return result;
}

// Reads `order` (layer indices) with up to `in_flight` layer reads outstanding: a sliding window,
// each completion (oldest first) refilled with the next layer.
Status ReadLayers(io::IoQueue& queue, io::SwapSpace& swap, const std::vector<io::Extent>& extents,
                  std::vector<AlignedBuffer>& buffers, const std::vector<uint32_t>& order) {
  std::deque<std::pair<io::Ticket, size_t>> pending;  // ticket, buffer
  size_t next = 0;
  std::vector<size_t> free_buffers;
  for (size_t b = 0; b < buffers.size(); ++b) free_buffers.push_back(b);
  while (next < order.size() || !pending.empty()) {
    while (next < order.size() && !free_buffers.empty()) {
      const size_t b = free_buffers.back();
      free_buffers.pop_back();
      const io::Extent& extent = extents[order[next++]];
      io::IoRequest request{io::Op::kRead, &swap.files(), extent.offset,
                            buffers[b].span().first(extent.length)};
      ZOE_ASSIGN_OR_RETURN(io::Ticket ticket, queue.Submit(request));
      pending.emplace_back(ticket, b);
    }
    const auto [ticket, b] = pending.front();
    pending.pop_front();
    ZOE_RETURN_IF_ERROR(queue.Wait(ticket));
    free_buffers.push_back(b);
  }
  return Status::Ok();
}

Result<IoOnlyResult> MeasureIoOnly(const OffloadBenchSpec& spec) {
  const uint64_t layer = RoundUp(spec.layer_bytes, 4096);
  io::SwapOptions swap_options;
  swap_options.alignment = 4096;
  swap_options.name_prefix = "zoe-bench-io-only";
  ZOE_ASSIGN_OR_RETURN(std::unique_ptr<io::SwapSpace> swap,
                       io::SwapSpace::Create({spec.dir}, spec.layers * layer, swap_options));
  io::EngineOptions engine_options;
  engine_options.backend = spec.backend;
  engine_options.queue_depth = spec.queue_depth;
  ZOE_ASSIGN_OR_RETURN(std::unique_ptr<io::Engine> engine, io::CreateEngine(engine_options));
  ZOE_ASSIGN_OR_RETURN(std::unique_ptr<io::IoQueue> queue, io::IoQueue::Create(std::move(engine)));
  std::vector<AlignedBuffer> buffers;
  for (uint32_t i = 0; i < std::max<uint32_t>(spec.prefetch_in_flight, 1); ++i) {
    ZOE_ASSIGN_OR_RETURN(AlignedBuffer buffer, AlignedBuffer::Allocate(layer));
    buffers.push_back(std::move(buffer));
  }
  std::vector<io::Extent> extents;
  for (uint32_t i = 0; i < spec.layers; ++i) {  // written once, as the tier manager's are
    ZOE_ASSIGN_OR_RETURN(io::Extent extent, swap->Allocate(layer));
    FillLayer(buffers[0].span().first(layer), i);
    ZOE_ASSIGN_OR_RETURN(io::Ticket ticket,
                         queue->Submit({io::Op::kWrite, &swap->files(), extent.offset,
                                        buffers[0].span().first(layer)}));
    ZOE_RETURN_IF_ERROR(queue->Wait(ticket));
    extents.push_back(extent);
  }
  std::vector<uint32_t> order;
  for (uint32_t i = 0; i < spec.layers; ++i) order.push_back(i);
  for (uint32_t i = spec.layers; i-- > 0;) order.push_back(i);
  std::vector<double> samples;
  for (uint32_t pass = 0; pass < spec.warmup + spec.iterations; ++pass) {
    const Clock::time_point start = Clock::now();
    ZOE_RETURN_IF_ERROR(ReadLayers(*queue, *swap, extents, buffers, order));
    if (pass >= spec.warmup) samples.push_back(SecondsSince(start));
  }
  IoOnlyResult result;
  result.backend = std::string(queue->backend());
  result.bytes = order.size() * layer;
  result.seconds = MedianOf(samples);
  result.bytes_per_s = static_cast<double>(result.bytes) / result.seconds;
  return result;
}

}  // namespace

double MedianOf(std::vector<double> samples) {
  if (samples.empty()) return 0;
  std::sort(samples.begin(), samples.end());
  const size_t n = samples.size();
  return n % 2 ? samples[n / 2] : 0.5 * (samples[n / 2 - 1] + samples[n / 2]);
}

Status ValidateOffloadSpec(const OffloadBenchSpec& spec) {
  if (spec.layers < 1) return Status::InvalidArgument("--layers must be >= 1");
  if (spec.layer_bytes == 0) return Status::InvalidArgument("--layer-bytes must be > 0");
  if (spec.device_budget_layers < 1)
    return Status::InvalidArgument("--device-budget must be >= 1 layer");
  if (spec.host_budget_layers <= spec.device_budget_layers) {
    return Status::InvalidArgument(fmt::format(
        "--host-budget {} must exceed --device-budget {}: HOST holds a copy of every device-"
        "resident layer and stages the next ones",
        spec.host_budget_layers, spec.device_budget_layers));
  }
  if (spec.compute_ms < 0) return Status::InvalidArgument("--compute-ms must be >= 0");
  if (spec.iterations < 1) return Status::InvalidArgument("--iterations must be >= 1");
  if (spec.warmup < 1)
    return Status::InvalidArgument("--warmup must be >= 1 (the first iteration records)");
  if (spec.dir.empty()) return Status::InvalidArgument("no directory for the swap files");
  for (const std::string& policy : spec.policies) ZOE_RETURN_IF_ERROR(ParsePolicy(policy).status());
  return Status::Ok();
}

Result<OffloadBenchResult> RunOffloadBench(const OffloadBenchSpec& spec) {
  ZOE_RETURN_IF_ERROR(ValidateOffloadSpec(spec));
  OffloadBenchResult result;
  result.spec = spec;
  result.device = "host stand-in";
  result.compute_seconds = 2.0 * spec.layers * spec.compute_ms / 1e3;
  for (const std::string& name : spec.policies) {
    ZOE_ASSIGN_OR_RETURN(PolicyResult policy, RunPolicy(spec, name, &result.io_backend));
    result.policies.push_back(std::move(policy));
  }
  ZOE_ASSIGN_OR_RETURN(result.io_only, MeasureIoOnly(spec));
  for (PolicyResult& policy : result.policies)
    policy.io_only_seconds = policy.traffic.nvme_to_host_bytes / result.io_only.bytes_per_s;
  return result;
}

}  // namespace zoe::cli
