// Google Benchmark cases for the optimizer kernels: every instruction-set path this CPU has, on
// one thread, for sizes that live in L1, L2, L3 and DRAM, in the fp32 layout and the bf16 one
// (bf16 grads, bf16 state, fused bf16 copy). Items are parameters; bytes are those moved. Also
// the int8 moments' block quantization and dequantization alone, in L1/L2 (items are elements).
//   zoe_micro_bench --benchmark_filter=AdamW
//   zoe_micro_bench --benchmark_filter=Int8
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

// Moments over several decades, as the int8 cases quantize them (exp_avg_sq: non-negative).
std::vector<float> MomentValues(size_t n, Moment moment) {
  std::vector<float> values(n);
  for (size_t i = 0; i < n; ++i) {
    const float magnitude = 1.0f / static_cast<float>(1 + (i * 2654435761u) % 100000);
    values[i] = moment == Moment::kExpAvg && i % 2 == 1 ? -magnitude : magnitude;
  }
  return values;
}

constexpr size_t kInt8Elements = size_t{1} << 14;

void BM_Int8Quantize(benchmark::State& state, Isa isa, Moment moment) {
  const std::vector<float> values = MomentValues(kInt8Elements, moment);
  std::vector<uint8_t> codes(kInt8Elements);
  std::vector<float> scales(QuantBlockCount(kInt8Elements, 0));
  for (auto _ : state) {
    const Status status = QuantizeMoments(moment, values.data(), kInt8Elements, 0, codes.data(),
                                          scales.data(), {.isa = isa});
    if (!status.ok()) {
      state.SkipWithError(status.ToString().c_str());
      return;
    }
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * static_cast<int64_t>(kInt8Elements));
}

void BM_Int8Dequantize(benchmark::State& state, Isa isa, Moment moment) {
  const std::vector<float> values = MomentValues(kInt8Elements, moment);
  std::vector<uint8_t> codes(kInt8Elements);
  std::vector<float> scales(QuantBlockCount(kInt8Elements, 0)), out(kInt8Elements);
  if (!QuantizeMoments(moment, values.data(), kInt8Elements, 0, codes.data(), scales.data()).ok()) {
    state.SkipWithError("quantizing the input failed");
    return;
  }
  for (auto _ : state) {
    const Status status = DequantizeMoments(moment, codes.data(), scales.data(), kInt8Elements, 0,
                                            out.data(), {.isa = isa});
    if (!status.ok()) {
      state.SkipWithError(status.ToString().c_str());
      return;
    }
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * static_cast<int64_t>(kInt8Elements));
}

void RegisterInt8(Isa isa) {
  for (Moment moment : {Moment::kExpAvg, Moment::kExpAvgSq}) {
    const std::string suffix =
        std::string(IsaName(isa)) + (moment == Moment::kExpAvg ? "/exp_avg" : "/exp_avg_sq");
    benchmark::RegisterBenchmark(("Int8Quantize/" + suffix).c_str(), BM_Int8Quantize, isa, moment);
    benchmark::RegisterBenchmark(("Int8Dequantize/" + suffix).c_str(), BM_Int8Dequantize, isa,
                                 moment);
  }
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
    RegisterInt8(isa);
  }
  return 0;
}

const int kRegistered = RegisterAll();

}  // namespace
}  // namespace zoe::optim
