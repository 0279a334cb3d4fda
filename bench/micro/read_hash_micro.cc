// Google Benchmark cases for verifying optimizer state inside the update kernel: the AdamW update
// (fp32 master, fp32, bf16 or int8 moments, one thread) of chunks of 8 Mi elements in stripes of
// 32 Ki elements, with no checksums, with a separate verification pass (io::Xxh3 of each block
// of master, exp_avg and exp_avg_sq before the stripe's update, as
// offload/optimizer/chunk_update.cc does today), and with the kernel hashing the blocks it reads
// (UpdatePointers::read_sums, compared with the expected sums after each stripe). Four chunks are
// updated in turn, so each comes from DRAM as after a read from NVMe. Only on a CPU whose default
// kernels hash their reads.
//   zoe_micro_bench --benchmark_filter=ReadHash
#include <benchmark/benchmark.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "io/checksum.h"
#include "optim/chunk.h"
#include "optim/dispatch.h"
#include "optim/kernels.h"
#include "optim/quantize.h"

namespace zoe::optim {
namespace {

constexpr size_t kElements = size_t{8} << 20;  // the step bench's chunk at 256 Mi parameters
constexpr size_t kStripe = size_t{32}
                           << 10;  // the longest hashed stripe (kMaxHashedStripeElements)
constexpr size_t kChunks = 4;
constexpr size_t kArrays = 3;  // master, exp_avg, exp_avg_sq

enum class Sums { kNone, kVerifyPass, kHashedReads };

// One chunk's three state arrays, each starting on a block boundary, and their expected sums.
struct Chunk {
  explicit Chunk(DType state) : moment_bytes(DTypeSize(state)) {
    const size_t bytes[kArrays] = {kElements * 4, kElements * moment_bytes,
                                   kElements * moment_bytes};
    for (size_t a = 0; a < kArrays; ++a) {
      storage[a].assign(bytes[a] + kReadHashBlock, std::byte{0});
      auto address = reinterpret_cast<uintptr_t>(storage[a].data());
      base[a] = storage[a].data() + (kReadHashBlock - address % kReadHashBlock) % kReadHashBlock;
      size[a] = bytes[a];
      expected[a].resize(bytes[a] / kReadHashBlock);
      read[a].resize(bytes[a] / kReadHashBlock);
    }
    // int8 moments: codes 0 with scales 0 (zero moments), one scale per quantization block.
    if (state == DType::kInt8) {
      for (auto& s : scales) s.assign(kElements / kQuantBlock, 0.0f);
    }
    Rehash();
  }
  void Rehash() {
    for (size_t a = 0; a < kArrays; ++a) {
      for (size_t b = 0; b < expected[a].size(); ++b) {
        expected[a][b] = io::Xxh3(std::span(base[a] + b * kReadHashBlock, kReadHashBlock));
      }
    }
  }
  size_t ElementBytes(size_t a) const { return a == 0 ? 4 : moment_bytes; }

  size_t moment_bytes;
  std::vector<std::byte> storage[kArrays];
  std::byte* base[kArrays] = {};
  size_t size[kArrays] = {};
  std::vector<uint64_t> expected[kArrays];
  std::vector<uint64_t> read[kArrays];
  std::vector<float> scales[2];  // int8 moments only
};

// Mismatching blocks of array `a` of elements [begin, end), hashing them (or taking the kernel's
// sums) -- counted so the work cannot be dropped.
size_t CheckStripe(const Chunk& chunk, size_t a, size_t begin, size_t end, bool hash) {
  size_t bad = 0;
  const size_t first = begin * chunk.ElementBytes(a) / kReadHashBlock;
  const size_t last = end * chunk.ElementBytes(a) / kReadHashBlock;
  for (size_t b = first; b < last; ++b) {
    const uint64_t sum =
        hash ? io::Xxh3(std::span(chunk.base[a] + b * kReadHashBlock, kReadHashBlock))
             : chunk.read[a][b];
    bad += sum != chunk.expected[a][b];
  }
  return bad;
}

void BM_ReadHash(benchmark::State& state, DType moments, Sums sums) {
  auto isa = DefaultIsa();
  auto table = isa.ok() ? KernelsFor(*isa) : Result<const KernelTable*>(isa.status());
  if (!table.ok() || !(*table)->HashesReads(Kind::kAdamW, moments)) {
    state.SkipWithError("the default kernels of this CPU do not hash their reads");
    return;
  }
  std::vector<Chunk> chunks;
  for (size_t c = 0; c < kChunks; ++c) chunks.emplace_back(moments);
  std::vector<float> grad(kElements, 0.01f);
  ChunkLayout layout;
  layout.grad = DType::kFloat32;
  layout.state = moments;
  ChunkBuffers buffers;
  buffers.master = reinterpret_cast<float*>(chunks[0].base[0]);
  buffers.grad = grad.data();
  buffers.exp_avg = chunks[0].base[1];
  buffers.exp_avg_sq = chunks[0].base[2];
  buffers.count = kElements;
  const UpdateVariant variant = ChooseUpdateVariant(Kind::kAdamW, layout, buffers, RunOptions{});
  const UpdateFn update =
      moments == DType::kInt8
          ? (*table)->block_update[KernelTable::BlockUpdateIndex(Kind::kAdamW, DType::kFloat32,
                                                                 CopySlot::kNone, variant.fast)]
          : (*table)->update[KernelTable::UpdateIndex(Kind::kAdamW, DType::kFloat32, moments,
                                                      CopySlot::kNone, variant)];
  HyperParams hyper;
  hyper.weight_decay = 0.01;
  int64_t step = 0;
  size_t next = 0;
  size_t bad = 0;
  for (auto _ : state) {
    Chunk& chunk = chunks[next];
    next = (next + 1) % kChunks;
    const UpdateConstants constants = MakeUpdateConstants(hyper, ++step, {});
    UpdatePointers p;
    p.master = reinterpret_cast<float*>(chunk.base[0]);
    p.grad = grad.data();
    p.exp_avg = chunk.base[1];
    p.exp_avg_sq = chunk.base[2];
    p.exp_avg_scale = chunk.scales[0].data();
    p.exp_avg_sq_scale = chunk.scales[1].data();
    if (sums == Sums::kHashedReads) {
      for (size_t a = 0; a < kArrays; ++a) p.read_sums[a] = chunk.read[a].data();
    }
    for (size_t begin = 0; begin < kElements; begin += kStripe) {
      const size_t end = std::min(kElements, begin + kStripe);
      if (sums == Sums::kVerifyPass) {
        for (size_t a = 0; a < kArrays; ++a) bad += CheckStripe(chunk, a, begin, end, true);
      }
      update(constants, p, begin, end);
      if (sums == Sums::kHashedReads) {
        for (size_t a = 0; a < kArrays; ++a) bad += CheckStripe(chunk, a, begin, end, false);
      }
    }
    state.PauseTiming();  // the next verification of this chunk needs its updated state's sums
    if (sums != Sums::kNone) chunk.Rehash();
    state.ResumeTiming();
  }
  if (bad != 0) state.SkipWithError("a block did not match its sum");
  state.SetItemsProcessed(state.iterations() * static_cast<int64_t>(kElements));
}

int RegisterAll() {
  const std::pair<const char*, DType> kMoments[] = {
      {"fp32", DType::kFloat32}, {"bf16", DType::kBFloat16}, {"int8", DType::kInt8}};
  const std::pair<const char*, Sums> kSums[] = {{"none", Sums::kNone},
                                                {"verify-pass", Sums::kVerifyPass},
                                                {"hashed-reads", Sums::kHashedReads}};
  for (const auto& [moment_name, moments] : kMoments) {
    for (const auto& [sums_name, sums] : kSums) {
      benchmark::RegisterBenchmark(
          ("ReadHash/" + std::string(moment_name) + "/" + sums_name).c_str(), BM_ReadHash, moments,
          sums)
          ->Unit(benchmark::kMillisecond);
    }
  }
  return 0;
}

const int kRegistered = RegisterAll();

}  // namespace
}  // namespace zoe::optim
