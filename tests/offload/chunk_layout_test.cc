// Description: ChunkLayout: packing tensors into aligned chunks, spanning, groups, rejections and
// the registry fingerprint.
#include "offload/optimizer/chunk_layout.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace zoe::offload {
namespace {

constexpr uint64_t kChunk = 64 * 1024;

ChunkLayout MakeLayout(uint64_t chunk_bytes = kChunk, uint64_t alignment = 256) {
  Result<ChunkLayout> layout = ChunkLayout::Create({chunk_bytes, alignment, uint64_t{1} << 40});
  EXPECT_TRUE(layout.ok()) << layout.status().ToString();
  return std::move(layout).value();
}

TensorId Add(ChunkLayout& layout, std::string name, uint64_t bytes, std::string group = "",
             Tier home = Tier::kHost, DType dtype = DType::kUInt8) {
  Result<TensorId> id = layout.Register({std::move(name), bytes, dtype, home, std::move(group)});
  EXPECT_TRUE(id.ok()) << id.status().ToString();
  return id.ok() ? *id : TensorId();
}

TEST(ChunkLayout, RejectsBadOptions) {
  EXPECT_EQ(ChunkLayout::Create({0, 256, 1}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ChunkLayout::Create({5000, 256, 1}).status().message(),
            "chunk_bytes 5000 must be a positive multiple of 4096");
  EXPECT_FALSE(ChunkLayout::Create({kChunk, 3, 1}).ok());
  EXPECT_FALSE(ChunkLayout::Create({kChunk, 2 * kChunk, 1}).ok());
  EXPECT_FALSE(ChunkLayout::Create({kChunk, 256, 0}).ok());
}

TEST(ChunkLayout, SmallTensorsShareAChunkAtAlignedOffsets) {
  ChunkLayout layout = MakeLayout();
  TensorId a = Add(layout, "a", 100);
  TensorId b = Add(layout, "b", 300);
  TensorId c = Add(layout, "c", 256);
  ASSERT_EQ(layout.chunk_count(), 1u);
  EXPECT_EQ(layout.Pieces(a)[0], (TensorPiece{ChunkId(0), 0, 0, 100}));
  EXPECT_EQ(layout.Pieces(b)[0], (TensorPiece{ChunkId(0), 256, 0, 300}));
  EXPECT_EQ(layout.Pieces(c)[0], (TensorPiece{ChunkId(0), 768, 0, 256}));
  auto in_chunk = layout.TensorsIn(ChunkId(0));
  EXPECT_EQ(std::vector<TensorId>(in_chunk.begin(), in_chunk.end()),
            (std::vector<TensorId>{a, b, c}));
  EXPECT_EQ((*layout.chunk(ChunkId(0)))->used_bytes, 1024u);
}

TEST(ChunkLayout, AlignmentIsConfigurable) {
  ChunkLayout layout = MakeLayout(kChunk, 4096);
  Add(layout, "a", 10);
  TensorId b = Add(layout, "b", 10);
  EXPECT_EQ(layout.Pieces(b)[0].chunk_offset, 4096u);
}

TEST(ChunkLayout, ATensorThatDoesNotFitOpensANewChunkAndIsNeverSplit) {
  ChunkLayout layout = MakeLayout();
  Add(layout, "a", kChunk - 1000);
  TensorId b = Add(layout, "b", 2000);
  ASSERT_EQ(layout.Pieces(b).size(), 1u);
  EXPECT_EQ(layout.Pieces(b)[0], (TensorPiece{ChunkId(1), 0, 0, 2000}));
  TensorId exact = Add(layout, "exact", kChunk);
  EXPECT_EQ(layout.Pieces(exact)[0], (TensorPiece{ChunkId(2), 0, 0, kChunk}));
}

TEST(ChunkLayout, LargeTensorsSpanConsecutiveChunksAndShareTheirTail) {
  ChunkLayout layout = MakeLayout();
  Add(layout, "small", 100);
  TensorId big = Add(layout, "big", 2 * kChunk + 512);
  auto pieces = layout.Pieces(big);
  ASSERT_EQ(pieces.size(), 3u);
  uint64_t covered = 0;
  for (size_t i = 0; i < pieces.size(); ++i) {
    EXPECT_EQ(pieces[i].chunk, ChunkId(static_cast<uint32_t>(1 + i)));
    EXPECT_EQ(pieces[i].chunk_offset, 0u);
    EXPECT_EQ(pieces[i].tensor_offset, covered);
    covered += pieces[i].bytes;
  }
  EXPECT_EQ(covered, 2 * kChunk + 512);
  EXPECT_EQ(pieces[2].bytes, 512u);
  TensorId after = Add(layout, "after", 100);
  EXPECT_EQ(layout.Pieces(after)[0], (TensorPiece{ChunkId(3), 512, 0, 100}));
}

TEST(ChunkLayout, DifferentGroupsAndHomesNeverShareAChunk) {
  ChunkLayout layout = MakeLayout();
  TensorId a = Add(layout, "a", 100, "layer0");
  TensorId b = Add(layout, "b", 100, "layer1");
  TensorId c = Add(layout, "c", 100, "layer0", Tier::kNvme);
  TensorId d = Add(layout, "d", 100, "layer0");
  EXPECT_EQ(layout.Pieces(a)[0].chunk, ChunkId(0));
  EXPECT_EQ(layout.Pieces(b)[0].chunk, ChunkId(1));
  EXPECT_EQ(layout.Pieces(c)[0].chunk, ChunkId(2));
  EXPECT_EQ(layout.Pieces(d)[0].chunk, ChunkId(0));
  EXPECT_EQ((*layout.chunk(ChunkId(2)))->home, Tier::kNvme);
  EXPECT_EQ(layout.Groups(), (std::vector<std::string>{"layer0", "layer1"}));
  auto group0 = layout.TensorsInGroup("layer0");
  EXPECT_EQ(std::vector<TensorId>(group0.begin(), group0.end()), (std::vector<TensorId>{a, c, d}));
  auto chunks0 = layout.ChunksInGroup("layer0");
  EXPECT_EQ(std::vector<ChunkId>(chunks0.begin(), chunks0.end()),
            (std::vector<ChunkId>{ChunkId(0), ChunkId(2)}));
  EXPECT_TRUE(layout.TensorsInGroup("nope").empty());
}

TEST(ChunkLayout, FindAndLookupErrors) {
  ChunkLayout layout = MakeLayout();
  TensorId a = Add(layout, "a", 16, "", Tier::kHost, DType::kFloat32);
  EXPECT_EQ(*layout.Find("a"), a);
  EXPECT_EQ(layout.Find("b").status().message(), "no tensor named 'b' is registered");
  EXPECT_EQ(layout.tensor(TensorId(5)).status().message(),
            "tensor id 5 is not registered (1 tensors exist)");
  EXPECT_EQ(layout.chunk(ChunkId(9)).status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(layout.Pieces(TensorId(5)).empty());
  EXPECT_TRUE(layout.TensorsIn(ChunkId(9)).empty());
  EXPECT_EQ((*layout.tensor(a))->desc.dtype, DType::kFloat32);
}

TEST(ChunkLayout, RejectedRegistrationsChangeNothing) {
  ChunkLayout layout = MakeLayout();
  Add(layout, "w", 64, "", Tier::kHost, DType::kFloat32);
  const uint64_t before = layout.Fingerprint();
  struct Case {
    TensorDesc desc;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{"", 4, DType::kFloat32, Tier::kHost, ""}, "a tensor needs a non-empty name"},
      {{"w", 4, DType::kFloat32, Tier::kHost, ""}, "tensor 'w' is already registered"},
      {{"z", 0, DType::kFloat32, Tier::kHost, ""}, "tensor 'z' has 0 bytes"},
      {{"z", (uint64_t{1} << 40) + 4, DType::kFloat32, Tier::kHost, ""},
       "tensor 'z' has 1099511627780 bytes; at most 1099511627776 are allowed"},
      {{"z", 6, DType::kFloat32, Tier::kHost, ""},
       "tensor 'z': 6 bytes is not a whole number of fp32 elements (4 bytes each)"},
      {{"z", 4, static_cast<DType>(99), Tier::kHost, ""}, "tensor 'z': unknown dtype 99"},
      {{"z", 4, DType::kFloat32, static_cast<Tier>(5), ""},
       "tensor 'z': unknown home tier 5; allowed: device, host, nvme"},
  };
  for (const Case& c : cases) {
    Result<TensorId> id = layout.Register(c.desc);
    ASSERT_FALSE(id.ok()) << c.message;
    EXPECT_EQ(id.status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(id.status().message(), c.message);
  }
  EXPECT_EQ(layout.tensor_count(), 1u);
  EXPECT_EQ(layout.chunk_count(), 1u);
  EXPECT_EQ(layout.Fingerprint(), before);
  EXPECT_FALSE(layout.Find("z").ok());
}

// Registers a model-shaped mix of tensors; used to compare two registries.
void RegisterModel(ChunkLayout& layout, int layers) {
  for (int i = 0; i < layers; ++i) {
    const std::string g = "layer" + std::to_string(i);
    Add(layout, g + ".w", 3 * kChunk / 2, g, Tier::kHost, DType::kBFloat16);
    Add(layout, g + ".b", 512, g, Tier::kHost, DType::kBFloat16);
    Add(layout, g + ".norm", 256, g, Tier::kDevice, DType::kFloat32);
  }
}

TEST(ChunkLayout, SameRegistrationsGiveTheSameLayoutAndFingerprint) {
  ChunkLayout a = MakeLayout(), b = MakeLayout();
  RegisterModel(a, 4);
  RegisterModel(b, 4);
  ASSERT_EQ(a.chunk_count(), b.chunk_count());
  for (uint32_t t = 0; t < a.tensor_count(); ++t) {
    auto pa = a.Pieces(TensorId(t)), pb = b.Pieces(TensorId(t));
    EXPECT_TRUE(std::equal(pa.begin(), pa.end(), pb.begin(), pb.end())) << t;
  }
  EXPECT_EQ(a.Fingerprint(), b.Fingerprint());
}

TEST(ChunkLayout, FingerprintChangesWithAnyRegistrationDetail) {
  ChunkLayout base = MakeLayout();
  RegisterModel(base, 2);
  ChunkLayout more = MakeLayout();
  RegisterModel(more, 3);
  EXPECT_NE(base.Fingerprint(), more.Fingerprint());
  ChunkLayout other_chunk = MakeLayout(2 * kChunk);
  RegisterModel(other_chunk, 2);
  EXPECT_NE(base.Fingerprint(), other_chunk.Fingerprint());
  ChunkLayout renamed = MakeLayout(), regrouped = MakeLayout();
  Add(renamed, "ab", 4);
  Add(regrouped, "a", 4, "b");
  EXPECT_NE(renamed.Fingerprint(), regrouped.Fingerprint());
}

}  // namespace
}  // namespace zoe::offload
