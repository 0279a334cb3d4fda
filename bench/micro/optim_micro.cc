// Google Benchmark cases for the optimizer kernels: every instruction-set path this CPU has, on
// one thread, for sizes that live in L1, L2, L3 and DRAM, in the fp32 layout and the bf16 one
// (bf16 grads, bf16 state, fused bf16 copy). Items are parameters; bytes are those moved.
//   zoe_micro_bench --benchmark_filter=AdamW
#include <benchmark/benchmark.h>

#include <string>
#include <vector>

#include "optim/chunk.h"
#include "optim/dispatch.h"

namespace zoe::optim {
namespace {

struct Case {
  const char* name;
  ChunkLayout layout;
  double bytes_per_param;
};

const Case kCases[] = {
    {"fp32", {DType::kFloat32, DType::kFloat32, std::nullopt}, 28},
    {"bf16", {DType::kBFloat16, DType::kBFloat16, DType::kBFloat16}, 20},
};

// Size classes, in parameters: 1 Ki (L1), 16 Ki (L2), 256 Ki (L3), 16 Mi (DRAM).
const size_t kSizes[] = {size_t{1} << 10, size_t{1} << 14, size_t{1} << 18, size_t{1} << 24};

void BM_AdamW(benchmark::State& state, Isa isa, Case c) {
  const auto n = static_cast<size_t>(state.range(0));
  std::vector<float> master(n, 0.5f);
  std::vector<float> grad(n, 0.01f), m(n, 0.0f), v(n, 0.0f);
  std::vector<uint16_t> copy(n);
  const ChunkBuffers chunk{master.data(),
                           grad.data(),
                           m.data(),
                           v.data(),
                           c.layout.param_copy ? copy.data() : nullptr,
                           n};
  // The bf16 case reads the fp32 vectors' first halves as bf16 data: values are irrelevant to
  // speed, only sizes matter.
  HyperParams hyper;
  hyper.weight_decay = 0.01;
  int64_t step = 0;
  for (auto _ : state) {
    Status status = UpdateChunk(hyper, ++step, c.layout, chunk, {}, {.isa = isa});
    if (!status.ok()) {
      state.SkipWithError(status.ToString().c_str());
      return;
    }
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * static_cast<int64_t>(n));
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(c.bytes_per_param * n));
}

void BM_GradScan(benchmark::State& state, Isa isa) {
  const auto n = static_cast<size_t>(state.range(0));
  std::vector<float> grad(n, 0.01f);
  for (auto _ : state) {
    auto scan = ScanGradients(grad.data(), DType::kFloat32, n, {.isa = isa});
    benchmark::DoNotOptimize(scan);
  }
  state.SetItemsProcessed(state.iterations() * static_cast<int64_t>(n));
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(4 * n));
}

int RegisterAll() {
  const CpuFeatures cpu = DetectCpuFeatures();
  for (Isa isa : kAllIsas) {
    if (!IsaSupported(isa, cpu)) continue;
    for (const Case& c : kCases) {
      auto* b = benchmark::RegisterBenchmark(
          ("AdamW/" + std::string(IsaName(isa)) + "/" + c.name).c_str(), BM_AdamW, isa, c);
      for (size_t n : kSizes) b->Arg(static_cast<int64_t>(n));
    }
    auto* scan = benchmark::RegisterBenchmark(("GradScan/" + std::string(IsaName(isa))).c_str(),
                                              BM_GradScan, isa);
    for (size_t n : kSizes) scan->Arg(static_cast<int64_t>(n));
  }
  return 0;
}

const int kRegistered = RegisterAll();

}  // namespace
}  // namespace zoe::optim
