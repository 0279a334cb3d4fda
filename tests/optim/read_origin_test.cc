// Description: UpdateChunk with ChunkBuffers::read_sums and read_origin, the form the offloaded
// step uses for a piece that starts inside a block: the pointers at element `origin` of arrays
// whose blocks count from element 0. Every block wholly inside the piece gets the XXH3 of its
// bytes before the update, at its index in the whole array, whatever the origin, count and tile
// size (tiles cut the piece only at unit boundaries); other entries are left alone; the update's
// bits equal those of the same call without sums. fp32, bf16 and int8 state (whose piece starts
// where its quantization block layout says: block_offset = origin % kQuantBlock); int8 sums with
// a read origin that disagrees with the block layout are refused.
#include <gtest/gtest.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "optim/chunk.h"
#include "optim/dispatch.h"
#include "optim/quantize.h"
#include "optim_test_util.h"

namespace zoe::optim {
namespace {

constexpr uint64_t kUntouched = 0x5a5a5a5a5a5a5a5aULL;
constexpr size_t kArrayElements = 12288;

// master (fp32), exp_avg and exp_avg_sq (`state`), each on a 4096-byte boundary, and a gradient.
struct State {
  explicit State(DType state) : dtype(state) {
    std::mt19937 random(7);
    std::uniform_real_distribution<float> value(-1.0f, 1.0f);
    for (auto& array : arrays) array.resize(kArrayElements * 4 + 4096);
    grad.resize(kArrayElements);
    for (float& g : grad) g = value(random);
    auto* master = reinterpret_cast<float*>(Base(0));
    for (size_t i = 0; i < kArrayElements; ++i) master[i] = value(random);
    std::vector<float> moments(kArrayElements);
    for (size_t a = 1; a < 3; ++a) {
      for (float& m : moments) {
        const float v = value(random);
        m = a == 1 ? v * 0.1f : v * v * 0.01f;  // exp_avg_sq >= 0
      }
      if (state == DType::kFloat32) {
        std::memcpy(Base(a), moments.data(), Bytes(a));
      } else if (state == DType::kInt8) {
        scales[a - 1].resize(kArrayElements / kQuantBlock);
        EXPECT_TRUE(QuantizeMoments(a == 1 ? Moment::kExpAvg : Moment::kExpAvgSq, moments.data(),
                                    kArrayElements, 0, reinterpret_cast<uint8_t*>(Base(a)),
                                    scales[a - 1].data())
                        .ok());
      } else {
        EXPECT_TRUE(CastFromF32(moments.data(), state, Base(a), kArrayElements).ok());
      }
    }
  }
  std::byte* Base(size_t a) {
    std::byte* raw = arrays[a].data();
    return raw + (4096 - reinterpret_cast<uintptr_t>(raw) % 4096) % 4096;
  }
  size_t Bytes(size_t a) const { return kArrayElements * (a == 0 ? 4 : DTypeSize(dtype)); }
  size_t ElementBytes(size_t a) const { return a == 0 ? 4 : DTypeSize(dtype); }
  std::vector<uint64_t> Sums(size_t a) {
    std::vector<uint64_t> sums(Bytes(a) / 4096);
    for (size_t b = 0; b < sums.size(); ++b) {
      sums[b] = XXH3_64bits(Base(a) + b * 4096, 4096);  // io::Xxh3's hash
    }
    return sums;
  }
  std::vector<std::byte> All() {
    std::vector<std::byte> all;
    for (size_t a = 0; a < 3; ++a) all.insert(all.end(), Base(a), Base(a) + Bytes(a));
    for (const auto& s : scales) {
      const auto* bytes = reinterpret_cast<const std::byte*>(s.data());
      all.insert(all.end(), bytes, bytes + s.size() * sizeof(float));
    }
    return all;
  }

  // The update of elements [origin, origin + count), with the sums in `sums` when given.
  // int8 state: the blocks of the whole array start at element 0, so the piece's layout starts
  // origin % kQuantBlock elements into a block (`block_offset` overrides that).
  Status Update(size_t origin, size_t count, size_t tile, std::vector<uint64_t>* sums,
                std::optional<size_t> block_offset = std::nullopt) {
    ChunkLayout layout;
    layout.grad = DType::kFloat32;
    layout.state = dtype;
    ChunkBuffers buffers;
    buffers.master = reinterpret_cast<float*>(Base(0)) + origin;
    buffers.grad = grad.data() + origin;
    buffers.exp_avg = Base(1) + origin * DTypeSize(dtype);
    buffers.exp_avg_sq = Base(2) + origin * DTypeSize(dtype);
    buffers.count = count;
    if (dtype == DType::kInt8) {
      buffers.block_offset = block_offset.value_or(origin % kQuantBlock);
      buffers.exp_avg_scale = scales[0].data() + origin / kQuantBlock;
      buffers.exp_avg_sq_scale = scales[1].data() + origin / kQuantBlock;
    }
    if (sums != nullptr) {
      for (size_t a = 0; a < 3; ++a) buffers.read_sums[a] = sums[a].data();
      buffers.read_origin = origin;
    }
    HyperParams hyper;
    hyper.weight_decay = 0.01;
    RunOptions run;
    run.tile_elements = tile;
    return UpdateChunk(hyper, 3, layout, buffers, {}, run);
  }

  DType dtype;
  std::vector<std::byte> arrays[3];
  std::vector<float> scales[2];  // int8 state: per block of 256 elements from element 0
  std::vector<float> grad;
};

TEST(ReadOriginTest, BlocksInsideAPieceAreHashedAtTheirIndexInTheWholeArray) {
  ZOE_SKIP_UNLESS_READS_ARE_HASHED(UpdateHashesReads(Kind::kAdamW, DType::kFloat32, {}));
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kInt8}) {
    const size_t unit = ReadHashElements(dtype);
    for (size_t origin : {size_t{0}, size_t{7}, size_t{1000}, size_t{2048}, size_t{2049}}) {
      for (size_t count : {size_t{5}, size_t{2047}, size_t{4096}, size_t{7001}}) {
        for (size_t tile : {size_t{1000}, size_t{4096}, size_t{32768}}) {
          const std::string where = std::to_string(static_cast<int>(dtype)) + " origin " +
                                    std::to_string(origin) + " count " + std::to_string(count) +
                                    " tile " + std::to_string(tile);
          State hashed(dtype), plain(dtype);
          std::vector<uint64_t> before[3];
          std::vector<uint64_t> sums[3];
          for (size_t a = 0; a < 3; ++a) {
            before[a] = hashed.Sums(a);
            sums[a].assign(before[a].size(), kUntouched);
          }
          ASSERT_TRUE(hashed.Update(origin, count, tile, sums).ok()) << where;
          ASSERT_TRUE(plain.Update(origin, count, tile, nullptr).ok()) << where;
          EXPECT_TRUE(hashed.All() == plain.All()) << "the update differs: " << where;
          const size_t first = (origin + unit - 1) / unit * unit;
          const size_t last = (origin + count) / unit * unit;
          for (size_t a = 0; a < 3; ++a) {
            for (size_t b = 0; b < sums[a].size(); ++b) {
              const size_t element = b * 4096 / hashed.ElementBytes(a);
              const bool inside = first < last && element >= first && element < last;
              ASSERT_EQ(sums[a][b], inside ? before[a][b] : kUntouched)
                  << "array " << a << " block " << b << ": " << where;
            }
          }
        }
      }
    }
  }
}

// The hashed units of int8 state must start quantization blocks: sums with a read origin that is
// not congruent to block_offset are refused before anything is updated.
TEST(ReadOriginTest, Int8SumsWithAnOriginOffTheBlockLayoutAreRefused) {
  ZOE_SKIP_UNLESS_READS_ARE_HASHED(UpdateHashesReads(Kind::kAdamW, DType::kInt8, {}));
  State state(DType::kInt8);
  const std::vector<std::byte> before = state.All();
  std::vector<uint64_t> sums[3];
  for (auto& s : sums) s.assign(kArrayElements, kUntouched);
  const Status status = state.Update(1000, 8000, 4096, sums, /*block_offset=*/0);
  ASSERT_EQ(status.code(), StatusCode::kInvalidArgument) << status.ToString();
  for (const char* part :
       {"read_origin 1000", "block_offset 0", "read_origin % 256 == block_offset"}) {
    EXPECT_NE(status.message().find(part), std::string::npos) << part << ": " << status.ToString();
  }
  EXPECT_TRUE(state.All() == before) << "a refused update changed the state";
  // The same piece with the layout its origin implies is hashed.
  ASSERT_TRUE(state.Update(1000, 8000, 4096, sums).ok());
  EXPECT_NE(sums[1][1], kUntouched);
}

}  // namespace
}  // namespace zoe::optim
