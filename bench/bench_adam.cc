// zoe bench adam: optimizer-step throughput of the CPU kernels against the machine's streaming
// memory bandwidth measured in the same run (the roofline: a kernel with AdamW's access pattern,
// 4 fp32 reads + 3 fp32 writes per element, on the same threads, tiles and buffers). The roofline
// is the faster of two probes: ordinary stores, and the best this code knows for arrays larger
// than the cache (non-temporal stores, software prefetch); both are reported.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "bench/command.h"
#include "core/config.h"
#include "optim/chunk.h"
#include "optim/dispatch.h"
#include "optim/kernels.h"
#include "optim/threads.h"

namespace zoe::cli {
namespace {

using optim::ChunkBuffers;
using optim::ChunkLayout;
using optim::DType;
using optim::Kind;

struct AdamBenchOptions {
  std::string params = "64M";
  std::string threads = "all";
  std::string isa;  // empty: cpuid / ZOE_ISA
  std::string optimizers = "adamw";
  std::string arithmetic = "exact,fast";  // comma list: a row per arithmetic
  std::string stores = "cached";          // cached (the library's default), auto or streaming
  int steps = 10;
  int warmup = 3;
  uint64_t tile_elements = optim::kDefaultTileElements;
  std::string output_format = "table";
};

// One row of the report: an optimizer in one dtype layout. A separate cast pass (fp32 master to
// a 16-bit copy after the step, instead of a fused copy) is reported as "<dtype>-separate".
struct Config {
  Kind kind;
  ChunkLayout layout;
  std::optional<DType> separate_cast;
  optim::Arithmetic arithmetic = optim::Arithmetic::kExact;
};

struct Row {
  Config config;
  double seconds_per_step;
  double bytes_per_param;
};

// Bytes moved per parameter: reads and writes of master, grad, state and copy.
double BytesPerParam(const Config& c) {
  const double state = static_cast<double>(DTypeSize(c.layout.state));
  double bytes = 2 * 4 + static_cast<double>(DTypeSize(c.layout.grad));  // master r+w, grad r
  bytes += 2 * state * optim::StateTensors(c.kind);
  if (c.layout.param_copy) bytes += static_cast<double>(DTypeSize(*c.layout.param_copy));
  if (c.separate_cast) bytes += 4 + 2;  // the cast pass reads master, writes the copy
  return bytes;
}

std::string CopyName(const Config& c) {
  if (c.separate_cast) return std::string(DTypeName(*c.separate_cast)) + "-separate";
  return c.layout.param_copy ? std::string(DTypeName(*c.layout.param_copy)) : "none";
}

double Median(std::vector<double> samples) {
  std::sort(samples.begin(), samples.end());
  const size_t n = samples.size();
  return n % 2 ? samples[n / 2] : 0.5 * (samples[n / 2 - 1] + samples[n / 2]);
}

template <class Fn>
double MedianSeconds(int warmup, int steps, const Fn& fn) {
  std::vector<double> samples;
  for (int i = 0; i < warmup + steps; ++i) {
    const auto start = std::chrono::steady_clock::now();
    fn();
    const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
    if (i >= warmup) samples.push_back(elapsed.count());
  }
  return Median(samples);
}

// Buffers for every configuration, allocated once and first touched by the kernel threads.
// Buffer k starts k * 2112 bytes (33 cache lines) into its allocation so that the streams do
// not all sit at the same offset modulo large powers of two (which makes them compete for the
// same cache sets and DRAM banks); the roofline probe runs on the same buffers.
struct Buffers {
  static constexpr size_t kStagger = 2112;
  AlignedBuffer storage[8];
  void* master = nullptr;
  void* grad_f32 = nullptr;
  void* grad_bf16 = nullptr;
  void* m_f32 = nullptr;
  void* v_f32 = nullptr;
  void* m_bf16 = nullptr;
  void* v_bf16 = nullptr;
  void* copy = nullptr;

  static Result<Buffers> Create(size_t n, const optim::RunOptions& run) {
    Buffers b;
    void** slots[] = {&b.master, &b.grad_f32, &b.grad_bf16, &b.m_f32,
                      &b.v_f32,  &b.m_bf16,   &b.v_bf16,    &b.copy};
    const size_t element_bytes[] = {4, 4, 2, 4, 4, 2, 2, 4};  // the copy: fp32 at most
    for (size_t k = 0; k < 8; ++k) {
      const size_t pad = k * kStagger;
      const size_t int8_scales = 128;  // the bf16 moments' buffers also hold int8 moments (For)
      ZOE_ASSIGN_OR_RETURN(b.storage[k], optim::AllocateFirstTouch(
                                             element_bytes[k] * n + pad + int8_scales,
                                             run.tile_elements * element_bytes[k], run.executor));
      *slots[k] = b.storage[k].data() + pad;
    }
    FillPseudoRandom(static_cast<float*>(b.master), n, 1.0f, 1, run);
    FillPseudoRandom(static_cast<float*>(b.grad_f32), n, 0.01f, 2, run);
    ZOE_RETURN_IF_ERROR(optim::CastFromF32(static_cast<const float*>(b.grad_f32), DType::kBFloat16,
                                           b.grad_bf16, n, run));
    return b;
  }

  // Values in [-scale, scale) from a hash of the index: cheap, parallel, reproducible.
  static void FillPseudoRandom(float* out, size_t n, float scale, uint64_t seed,
                               const optim::RunOptions& run) {
    const auto fill = [&](size_t begin, size_t end) {
      for (size_t i = begin; i < end; ++i) {
        uint64_t x = (i + 1) * 0x9e3779b97f4a7c15ull ^ seed;
        x ^= x >> 31;
        x *= 0xbf58476d1ce4e5b9ull;
        x ^= x >> 29;
        out[i] = scale * (static_cast<float>(x >> 40) / 8388608.0f - 1.0f);
      }
    };
    if (run.executor != nullptr) {
      run.executor->ParallelFor(n, run.tile_elements, fill);
    } else {
      fill(0, n);
    }
  }

  ChunkBuffers For(const Config& c, size_t n) const {
    const bool bf16_state = c.layout.state == DType::kBFloat16;
    ChunkBuffers chunk{static_cast<float*>(master),
                       c.layout.grad == DType::kBFloat16 ? grad_bf16 : grad_f32,
                       bf16_state ? m_bf16 : m_f32,
                       bf16_state ? v_bf16 : v_f32,
                       c.layout.param_copy ? copy : nullptr,
                       n};
    if (c.layout.state == DType::kInt8) {
      // int8 moments in the bf16 moments' buffers (2 bytes per element): n codes, then the
      // block scales (1/64 byte per element) on a 64-byte boundary.
      const size_t scales_at = (n + 63) / 64 * 64;
      chunk.exp_avg = m_bf16;
      chunk.exp_avg_sq = v_bf16;
      chunk.exp_avg_scale = reinterpret_cast<float*>(static_cast<std::byte*>(m_bf16) + scales_at);
      chunk.exp_avg_sq_scale =
          reinterpret_cast<float*>(static_cast<std::byte*>(v_bf16) + scales_at);
      // Zero moments (the bf16 rows left their bytes there).
      const size_t bytes = scales_at + optim::QuantBlockCount(n, 0) * sizeof(float);
      std::memset(m_bf16, 0, bytes);
      std::memset(v_bf16, 0, bytes);
    }
    return chunk;
  }
};

// Rows for each arithmetic; fast arithmetic only for the kinds it changes (Adam, AdamW).
std::vector<Config> Configs(const std::vector<Kind>& kinds,
                            const std::vector<optim::Arithmetic>& arithmetics) {
  std::vector<Config> configs;
  for (optim::Arithmetic arithmetic : arithmetics) {
    for (Kind kind : kinds) {
      const bool adam = kind == Kind::kAdamW || kind == Kind::kAdam;
      if (arithmetic == optim::Arithmetic::kFast && !adam) continue;
      configs.push_back(
          {kind, {DType::kFloat32, DType::kFloat32, std::nullopt}, std::nullopt, arithmetic});
      if (kind != Kind::kAdamW) continue;
      // The fp32 parameters of the caller written in the update's pass (zoe.torch, params_out).
      configs.push_back(
          {kind, {DType::kFloat32, DType::kFloat32, DType::kFloat32}, std::nullopt, arithmetic});
      configs.push_back(
          {kind, {DType::kFloat32, DType::kFloat32, std::nullopt}, DType::kBFloat16, arithmetic});
      configs.push_back(
          {kind, {DType::kBFloat16, DType::kFloat32, DType::kBFloat16}, std::nullopt, arithmetic});
      configs.push_back(
          {kind, {DType::kBFloat16, DType::kBFloat16, DType::kBFloat16}, std::nullopt, arithmetic});
      // 8-bit moments (block-wise quantized, docs/int8-moments.md).
      configs.push_back(
          {kind, {DType::kFloat32, DType::kInt8, std::nullopt}, std::nullopt, arithmetic});
    }
  }
  return configs;
}

Result<std::vector<optim::Arithmetic>> ParseArithmetics(const std::string& text) {
  std::vector<optim::Arithmetic> arithmetics;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = std::min(text.find(',', start), text.size());
    Result<optim::Arithmetic> arithmetic =
        optim::ParseArithmetic(text.substr(start, comma - start));
    if (!arithmetic.ok()) return std::move(arithmetic).status().WithContext("--arithmetic");
    arithmetics.push_back(*arithmetic);
    start = comma + 1;
  }
  return arithmetics;
}

Result<std::vector<Kind>> ParseKinds(const std::string& text) {
  if (text == "all")
    return std::vector<Kind>(std::begin(optim::kAllKinds), std::end(optim::kAllKinds));
  std::vector<Kind> kinds;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = std::min(text.find(',', start), text.size());
    ZOE_ASSIGN_OR_RETURN(Kind kind, optim::ParseKind(text.substr(start, comma - start)));
    kinds.push_back(kind);
    start = comma + 1;
  }
  return kinds;
}

Result<unsigned> ParseThreads(const std::string& text) {
  if (text == "all") return 0u;
  try {
    const int value = std::stoi(text);
    if (value >= 1 && value <= 4096) return static_cast<unsigned>(value);
  } catch (const std::exception&) {
  }
  return Status::InvalidArgument("--threads '" + text + "'; allowed: all or 1..4096");
}

struct Report {
  std::string isa;
  unsigned threads = 0;
  size_t params = 0;
  std::string stores;
  double cached_roofline_seconds = 0;     // the probe with ordinary stores
  double streaming_roofline_seconds = 0;  // with non-temporal stores and prefetch
  std::vector<Row> rows;

  double roofline_seconds() const {
    return std::min(cached_roofline_seconds, streaming_roofline_seconds);
  }
};

// Median seconds of the roofline probe `stream` (a KernelTable::stream function) on the run's
// threads, as the update kernels are run: the same tiles, the same buffers.
template <class Stream>
double TimeRoofline(const AdamBenchOptions& options, const optim::RunOptions& run, size_t n,
                    const Stream& stream) {
  return MedianSeconds(options.warmup, options.steps, [&] {
    if (run.executor != nullptr) {
      run.executor->ParallelFor(n, run.tile_elements, stream);
    } else {
      stream(0, n);
    }
  });
}

Result<Report> RunAdamBench(const AdamBenchOptions& options) {
  ZOE_ASSIGN_OR_RETURN(uint64_t params, config::ParseSizeString(options.params));
  if (params == 0) return Status::InvalidArgument("--params 0; allowed: >= 1");
  ZOE_ASSIGN_OR_RETURN(unsigned threads, ParseThreads(options.threads));
  ZOE_ASSIGN_OR_RETURN(std::vector<Kind> kinds, ParseKinds(options.optimizers));
  ZOE_ASSIGN_OR_RETURN(std::vector<optim::Arithmetic> arithmetics,
                       ParseArithmetics(options.arithmetic));
  ZOE_ASSIGN_OR_RETURN(optim::StoreMode stores, optim::ParseStoreMode(options.stores));
  if (options.steps < 1 || options.warmup < 0) {
    return Status::InvalidArgument("--steps must be >= 1 and --warmup >= 0");
  }
  ZOE_ASSIGN_OR_RETURN(auto kernel_threads, optim::KernelThreads::Create(threads, /*pin=*/true));
  ZOE_RETURN_IF_ERROR(kernel_threads->PinCaller());
  optim::RunOptions run{.executor = kernel_threads->executor(),
                        .tile_elements = options.tile_elements,
                        .stores = stores};
  if (!options.isa.empty()) {
    ZOE_ASSIGN_OR_RETURN(run.isa, optim::ParseIsa(options.isa));
  } else {
    ZOE_ASSIGN_OR_RETURN(run.isa, optim::DefaultIsa());
  }
  ZOE_ASSIGN_OR_RETURN(const optim::KernelTable* kernels, optim::KernelsFor(*run.isa));
  const size_t n = params;
  ZOE_ASSIGN_OR_RETURN(Buffers buffers, Buffers::Create(n, run));

  Report report;
  report.isa = optim::IsaName(*run.isa);
  report.threads = kernel_threads->participants();
  report.params = n;
  report.stores = options.stores;
  auto* a = static_cast<float*>(buffers.master);
  auto* b = static_cast<const float*>(buffers.grad_f32);
  auto* c = static_cast<float*>(buffers.m_f32);
  auto* d = static_cast<float*>(buffers.v_f32);
  const auto cached = [&](size_t begin, size_t end) { kernels->stream(a, b, c, d, begin, end); };
  const auto streaming = [&](size_t begin, size_t end) {
    kernels->stream_nt(a, b, c, d, begin, end);
  };
  // Each probe is timed before and after the optimizer rows; the faster time of each counts.
  report.cached_roofline_seconds = TimeRoofline(options, run, n, cached);
  report.streaming_roofline_seconds = TimeRoofline(options, run, n, streaming);
  // Reset what the probe added so the optimizer starts from the same values on every run.
  Buffers::FillPseudoRandom(a, n, 1.0f, 1, run);
  std::fill_n(c, n, 0.0f);
  std::fill_n(d, n, 0.0f);

  for (const Config& config : Configs(kinds, arithmetics)) {
    optim::RunOptions row_run = run;
    row_run.arithmetic = config.arithmetic;
    optim::HyperParams hyper;
    hyper.kind = config.kind;
    hyper.weight_decay = 0.01;
    int64_t step = 0;
    Status status;
    const ChunkBuffers chunk = buffers.For(config, n);
    const double seconds = MedianSeconds(options.warmup, options.steps, [&] {
      if (!status.ok()) return;
      status = optim::UpdateChunk(hyper, ++step, config.layout, chunk, {}, row_run);
      if (status.ok() && config.separate_cast) {
        status = optim::CastFromF32(chunk.master, *config.separate_cast, buffers.copy, n, run);
      }
    });
    ZOE_RETURN_IF_ERROR(status);
    report.rows.push_back({config, seconds, BytesPerParam(config)});
  }
  report.streaming_roofline_seconds =
      std::min(report.streaming_roofline_seconds, TimeRoofline(options, run, n, streaming));
  report.cached_roofline_seconds =
      std::min(report.cached_roofline_seconds, TimeRoofline(options, run, n, cached));
  return report;
}

constexpr double kRooflineBytesPerParam = 7 * 4;

nlohmann::json ToJson(const Report& report) {
  nlohmann::json results = nlohmann::json::array();
  for (const Row& row : report.rows) {
    const double gparams = static_cast<double>(report.params) / row.seconds_per_step / 1e9;
    results.push_back({{"optimizer", optim::KindName(row.config.kind)},
                       {"grad_dtype", DTypeName(row.config.layout.grad)},
                       {"state_dtype", DTypeName(row.config.layout.state)},
                       {"param_copy_dtype", CopyName(row.config)},
                       {"arithmetic", optim::ArithmeticName(row.config.arithmetic)},
                       {"stores", report.stores},
                       {"isa", report.isa},
                       {"threads", report.threads},
                       {"params", report.params},
                       {"seconds_per_step", row.seconds_per_step},
                       {"gparams_per_s", gparams},
                       {"bytes_per_param", row.bytes_per_param},
                       {"gbytes_per_s", gparams * row.bytes_per_param}});
  }
  const auto gbytes = [&](double seconds) {
    return static_cast<double>(report.params) * kRooflineBytesPerParam / seconds / 1e9;
  };
  const double roofline_gbytes = gbytes(report.roofline_seconds());
  return {{"schema_version", 2},
          {"results", results},
          {"roofline",
           {{"gbytes_per_s", roofline_gbytes},
            {"gparams_per_s_fp32_adamw", roofline_gbytes / kRooflineBytesPerParam},
            {"probes",
             {{"cached", {{"gbytes_per_s", gbytes(report.cached_roofline_seconds)}}},
              {"streaming", {{"gbytes_per_s", gbytes(report.streaming_roofline_seconds)}}}}}}}};
}

void PrintTable(const nlohmann::json& json) {
  const auto& roof = json["roofline"];
  const double roof_gparams = roof["gparams_per_s_fp32_adamw"];
  std::printf("%-8s %-5s %-5s %-14s %-6s %-10s %7s %12s %10s %9s %9s %9s\n", "optim", "grad",
              "state", "param copy", "arith", "isa", "threads", "ms/step", "Gparam/s", "B/param",
              "GB/s", "x roof");
  for (const auto& r : json["results"]) {
    std::printf("%-8s %-5s %-5s %-14s %-6s %-10s %7u %12.3f %10.3f %9.0f %9.2f %9.2f\n",
                r["optimizer"].get<std::string>().c_str(),
                r["grad_dtype"].get<std::string>().c_str(),
                r["state_dtype"].get<std::string>().c_str(),
                r["param_copy_dtype"].get<std::string>().c_str(),
                r["arithmetic"].get<std::string>().c_str(), r["isa"].get<std::string>().c_str(),
                r["threads"].get<unsigned>(), 1e3 * r["seconds_per_step"].get<double>(),
                r["gparams_per_s"].get<double>(), r["bytes_per_param"].get<double>(),
                r["gbytes_per_s"].get<double>(), r["gparams_per_s"].get<double>() / roof_gparams);
  }
  std::printf(
      "roofline (4 fp32 reads + 3 fp32 writes per element): %.2f GB/s = %.3f G params/s "
      "of fp32 AdamW (%zu params); probes: ordinary stores %.2f GB/s, non-temporal stores and "
      "prefetch %.2f GB/s\n",
      roof["gbytes_per_s"].get<double>(), roof_gparams,
      json["results"].empty() ? size_t{0} : json["results"][0]["params"].get<size_t>(),
      roof["probes"]["cached"]["gbytes_per_s"].get<double>(),
      roof["probes"]["streaming"]["gbytes_per_s"].get<double>());
}

void Attach(CLI::App& bench) {
  auto options = std::make_shared<AdamBenchOptions>();
  CLI::App* cmd = bench.add_subcommand("adam", "CPU optimizer step throughput vs memory roofline");
  cmd->add_option("--params", options->params, "parameters per step (e.g. 64M = 64 Mi)");
  cmd->add_option("--threads", options->threads, "threads in all, or 'all' (one per CPU)");
  cmd->add_option("--isa", options->isa,
                  "avx512bf16|avx512|avx2|scalar (default: best, or ZOE_ISA)");
  cmd->add_option("--optimizer", options->optimizers,
                  "adamw|adam|adagrad|lion, comma list, or all");
  cmd->add_option("--steps", options->steps, "timed steps per row (median reported)");
  cmd->add_option("--warmup", options->warmup, "untimed steps before each row");
  cmd->add_option("--tile", options->tile_elements, "elements per tile handed to a thread");
  cmd->add_option("--arithmetic", options->arithmetic,
                  "exact, fast or a comma list (a row each; fast: Adam and AdamW only)");
  cmd->add_option(
      "--stores", options->stores,
      "cached (ordinary stores, the library's default), auto (streaming when the arrays exceed "
      "the last-level cache) or streaming");
  cmd->add_option("--output-format", options->output_format, "table or json")
      ->check(CLI::IsMember({"table", "json"}));
  cmd->callback([options] {
    Result<Report> report = RunAdamBench(*options);
    if (!report.ok()) {
      std::cerr << "zoe bench adam: " << report.status().ToString() << "\n";
      SetExitCode(1);
      return;
    }
    const nlohmann::json json = ToJson(*report);
    if (options->output_format == "json") {
      std::cout << json.dump(1) << "\n";
    } else {
      PrintTable(json);
    }
  });
}

const CommandRegistrar kRegistrar{Command{Parent::kBench, Attach}};

}  // namespace
}  // namespace zoe::cli
