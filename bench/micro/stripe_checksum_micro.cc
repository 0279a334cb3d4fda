// Google Benchmark cases for the CPU time checksums add to the optimizer step's update of one
// chunk (offload/optimizer/chunk_update.h): the AdamW update of chunks of 8 Mi elements in the
// step's own layout, on one thread, with no checksums, with the read side verified, with the
// written side hashed, with both in separate passes, and with the read side verified by the kernel
// as it loads the state, alone and with the written side hashed (the step's default where the
// kernel hashes its reads: AVX-512). Four chunk buffers (384 MiB with fp32 moments) are updated in
// turn, so every chunk comes from DRAM as it does after a read from NVMe. Items are parameters;
// compare the CPU time of the cases.
//   zoe_micro_bench --benchmark_filter=StripeChecksum
#include <benchmark/benchmark.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <span>
#include <string>
#include <vector>

#include "io/checksum.h"
#include "offload/optimizer/chunk_update.h"
#include "offload/optimizer/optimizer_group_layout.h"
#include "optim/chunk.h"

namespace zoe::offload {
namespace {

constexpr size_t kElements = size_t{8} << 20;  // the step bench's chunk at 256 Mi parameters
constexpr size_t kBuffers = 4;                 // the step's pipeline buffers

enum class Sums { kNone, kVerify, kHash, kBoth, kFusedVerify, kFusedBoth };

// The xxh3 of every checksum block of `extent`.
std::vector<uint64_t> HashExtent(std::span<const std::byte> extent) {
  std::vector<uint64_t> sums(extent.size() / kStripeChecksumBlock);
  for (size_t b = 0; b < sums.size(); ++b) {
    sums[b] = io::Xxh3(extent.subspan(b * kStripeChecksumBlock, kStripeChecksumBlock));
  }
  return sums;
}

// The update of chunk elements [begin, end) whose state is at `base`, as the group's step does
// it for a chunk with one fp32 gradient view; `sums`: where the kernel hashes its reads, or null.
Status UpdateRange(const ChunkRegions& regions, std::byte* base, const float* grad,
                   optim::DType moments, int64_t step, size_t begin, size_t end,
                   const optim::RunOptions& run, const ReadSums* sums = nullptr) {
  const size_t moment_bytes = DTypeSize(moments);
  optim::ChunkLayout layout;
  layout.grad = optim::DType::kFloat32;
  layout.state = moments;
  optim::ChunkBuffers buffers;
  buffers.master = reinterpret_cast<float*>(base + regions.offset[0]) + begin;
  buffers.grad = grad + begin;
  buffers.exp_avg = base + regions.offset[1] + begin * moment_bytes;
  buffers.exp_avg_sq = base + regions.offset[2] + begin * moment_bytes;
  buffers.count = end - begin;
  if (sums != nullptr) {
    std::copy(std::begin(sums->region), std::end(sums->region), buffers.read_sums);
    buffers.read_origin = begin;
  }
  optim::HyperParams hyper;
  hyper.weight_decay = 0.01;
  return optim::UpdateChunk(hyper, step, layout, buffers, {}, run);
}

void BM_StripeChecksum(benchmark::State& state, optim::DType moments, Sums sums) {
  const StateLayout layout(optim::Kind::kAdamW, moments, kElements, kElements,
                           kStripeChecksumBlock);
  const ChunkRegions regions = layout.chunk(0);
  std::vector<float> grad(kElements, 0.01f);
  std::array<std::vector<std::byte>, kBuffers> extents;
  std::array<std::vector<uint64_t>, kBuffers> expected;
  std::vector<uint64_t> computed(regions.bytes / kStripeChecksumBlock);
  for (size_t i = 0; i < kBuffers; ++i) {
    extents[i].assign(regions.bytes, std::byte{0});
    expected[i] = HashExtent(extents[i]);
  }
  const bool fused = sums == Sums::kFusedVerify || sums == Sums::kFusedBoth;
  const bool verify = sums != Sums::kNone && sums != Sums::kHash;
  const bool hash = sums == Sums::kHash || sums == Sums::kBoth || sums == Sums::kFusedBoth;
  const optim::RunOptions run;  // one thread: the CPU time of one kernel thread
  if (fused && !optim::UpdateHashesReads(optim::Kind::kAdamW, moments, run)) {
    state.SkipWithError("the kernels of this machine do not hash what they read");
    return;
  }
  int64_t step = 0;
  size_t next = 0;
  for (auto _ : state) {
    std::byte* base = extents[next].data();
    ChunkChecksums checksums;
    if (verify) checksums.expected = expected[next];
    if (hash) checksums.computed = computed;
    ++step;
    Status status;
    if (fused) {
      HashingRangeUpdate update;
      update.unit = optim::ReadHashElements(moments);
      update.ranges = [](size_t begin, size_t end, std::vector<ElementRange>* ranges) {
        ranges->push_back({begin, end});
      };
      update.update = [&](size_t begin, size_t end, const optim::RunOptions& r,
                          const ReadSums& read) {
        return UpdateRange(regions, base, grad.data(), moments, step, begin, end, r, &read);
      };
      status = UpdateInStripes(regions, base, checksums, run, update);
    } else {
      status = UpdateInStripes(
          regions, base, checksums, run, [&](size_t begin, size_t end, const optim::RunOptions& r) {
            return UpdateRange(regions, base, grad.data(), moments, step, begin, end, r);
          });
    }
    if (!status.ok()) {
      state.SkipWithError(status.ToString().c_str());
      return;
    }
    // The next verification of this buffer needs the sums of its updated state.
    state.PauseTiming();
    if (verify) expected[next] = hash ? computed : HashExtent(extents[next]);
    state.ResumeTiming();
    next = (next + 1) % kBuffers;
  }
  state.SetItemsProcessed(state.iterations() * static_cast<int64_t>(kElements));
}

int RegisterAll() {
  const std::pair<const char*, optim::DType> kMoments[] = {{"fp32", optim::DType::kFloat32},
                                                           {"bf16", optim::DType::kBFloat16}};
  const std::pair<const char*, Sums> kSums[] = {
      {"none", Sums::kNone},         {"verify", Sums::kVerify},
      {"hash", Sums::kHash},         {"verify+hash", Sums::kBoth},
      {"fused", Sums::kFusedVerify}, {"fused+hash", Sums::kFusedBoth}};
  for (const auto& [moment_name, moments] : kMoments) {
    for (const auto& [sums_name, sums] : kSums) {
      benchmark::RegisterBenchmark(
          ("StripeChecksum/" + std::string(moment_name) + "/" + sums_name).c_str(),
          BM_StripeChecksum, moments, sums)
          ->Unit(benchmark::kMillisecond);
    }
  }
  return 0;
}

const int kRegistered = RegisterAll();

}  // namespace
}  // namespace zoe::offload
