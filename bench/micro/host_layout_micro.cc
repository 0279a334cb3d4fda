// Google Benchmark case for how a DRAM group's update meets memory: the AdamW update of 64 Mi
// parameters in HOST chunks of 8 Mi elements on two threads, in the four combinations of
//  - the chunk layout: every region on a 4096-byte boundary (the NVMe layout), or the HOST
//    chunks' staggered regions (offload/optimizer/optimizer_group_layout.h, "Staggered host
//    chunks");
//  - the stores: ordinary (zoe.stores "cached", the default) or non-temporal ("streaming").
// Chunks are 2 MiB-aligned huge-page memory, as the pinned pool's. All four are run in every
// iteration, in rotating order, so a change in what the machine gives (other tenants' memory
// traffic) hits them alike; the counters are each one's median pass in milliseconds.
//   zoe_micro_bench --benchmark_filter=HostChunkLayout
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <string>
#include <vector>

#include "core/aligned_buffer.h"
#include "core/executor.h"
#include "offload/optimizer/optimizer_group_layout.h"
#include "optim/chunk.h"
#include "optim/threads.h"

namespace zoe::offload {
namespace {

constexpr size_t kChunkElements = size_t{8} << 20;
constexpr size_t kChunks = 8;
constexpr size_t kTileBytes = size_t{1} << 20;

struct HostGroup {
  StateLayout layout;
  std::vector<AlignedBuffer> chunks;
};

HostGroup MakeGroup(size_t first_host_chunk, Executor& executor) {
  HostGroup group{StateLayout(optim::Kind::kAdamW, optim::DType::kFloat32, kChunks * kChunkElements,
                              kChunkElements, 4096, {},
                              /*external_master=*/false, first_host_chunk),
                  {}};
  for (size_t c = 0; c < kChunks; ++c) {
    // Zeroed by the kernel threads (first touch): master and moments start at 0.
    group.chunks.push_back(
        optim::AllocateFirstTouch(group.layout.chunk(c).bytes, kTileBytes, &executor).value());
  }
  return group;
}

// One step over every chunk of `group`; its seconds, or a negative value on an error.
double StepSeconds(HostGroup& group, const float* grads, int64_t step,
                   const optim::RunOptions& run) {
  optim::HyperParams hyper;
  hyper.kind = optim::Kind::kAdamW;
  hyper.weight_decay = 0.01;
  const auto start = std::chrono::steady_clock::now();
  for (size_t c = 0; c < kChunks; ++c) {
    const ChunkRegions regions = group.layout.chunk(c);
    std::byte* base = group.chunks[c].data();
    optim::ChunkBuffers buffers;
    buffers.master = reinterpret_cast<float*>(base + regions.offset[0]);
    buffers.grad = grads + regions.first;
    buffers.exp_avg = base + regions.offset[1];
    buffers.exp_avg_sq = base + regions.offset[2];
    buffers.count = regions.count;
    if (!optim::UpdateChunk(hyper, step, optim::ChunkLayout{}, buffers, {}, run).ok()) return -1;
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

void BM_HostChunkLayout(benchmark::State& state) {
  Executor executor(2);
  HostGroup groups[2] = {MakeGroup(kNoHostChunks, executor), MakeGroup(0, executor)};
  AlignedBuffer grad_buffer =
      optim::AllocateFirstTouch(kChunks * kChunkElements * sizeof(float), kTileBytes, &executor)
          .value();
  auto* grads = reinterpret_cast<float*>(grad_buffer.data());
  for (size_t i = 0; i < kChunks * kChunkElements; ++i) grads[i] = 1e-3f * float(i % 97);
  // Variant v: layout v / 2 (unstaggered, staggered), stores v % 2 (ordinary, non-temporal).
  constexpr size_t kVariants = 4;
  const char* const names[kVariants] = {"unstaggered_cached", "unstaggered_streaming",
                                        "staggered_cached", "staggered_streaming"};
  std::vector<double> seconds[kVariants];
  int64_t step = 0;
  for (auto _ : state) {
    ++step;
    for (size_t k = 0; k < kVariants; ++k) {
      const size_t v = (k + static_cast<size_t>(step)) % kVariants;  // rotating order
      optim::RunOptions run;
      run.executor = &executor;
      run.stores = v % 2 == 0 ? optim::StoreMode::kCached : optim::StoreMode::kStreaming;
      const double elapsed = StepSeconds(groups[v / 2], grads, step, run);
      if (elapsed < 0) {
        state.SkipWithError("UpdateChunk failed");
        return;
      }
      seconds[v].push_back(elapsed);
    }
  }
  state.SetItemsProcessed(state.iterations() * kVariants * kChunks * kChunkElements);
  for (size_t v = 0; v < kVariants; ++v) {
    state.counters[std::string(names[v]) + "_ms"] = 1e3 * Median(seconds[v]);
  }
}
BENCHMARK(BM_HostChunkLayout)->Unit(benchmark::kMillisecond)->Iterations(30)->UseRealTime();

}  // namespace
}  // namespace zoe::offload
