// Description: offload vocabulary: tier, access and dtype names, parsing, sizes and strong ids.
#include "offload/types.h"

#include <gtest/gtest.h>

#include <unordered_set>

namespace zoe::offload {
namespace {

TEST(Types, TierNamesRoundTrip) {
  for (Tier tier : {Tier::kDevice, Tier::kHost, Tier::kNvme}) {
    Result<Tier> parsed = ParseTier(TierName(tier));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, tier);
    EXPECT_TRUE(IsValidTier(tier));
  }
  EXPECT_EQ(*ParseTier("NVMe"), Tier::kNvme);
  EXPECT_FALSE(IsValidTier(static_cast<Tier>(7)));
  EXPECT_EQ(TierName(static_cast<Tier>(7)), "unknown");
}

TEST(Types, UnknownTierListsTheAllowedNames) {
  Result<Tier> parsed = ParseTier("gpu");
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(parsed.status().message(), "unknown tier 'gpu'; allowed: device, host, nvme");
}

TEST(Types, AccessNamesAndDirections) {
  EXPECT_EQ(*ParseAccess("read_write"), Access::kReadWrite);
  EXPECT_EQ(AccessName(Access::kWrite), "write");
  EXPECT_TRUE(Reads(Access::kRead));
  EXPECT_FALSE(Writes(Access::kRead));
  EXPECT_FALSE(Reads(Access::kWrite));
  EXPECT_TRUE(Writes(Access::kWrite));
  EXPECT_TRUE(Reads(Access::kReadWrite) && Writes(Access::kReadWrite));
  EXPECT_FALSE(ParseAccess("append").ok());
  EXPECT_FALSE(IsValidAccess(static_cast<Access>(3)));
}

TEST(Types, DTypeSizesAndNames) {
  EXPECT_EQ(DTypeSize(DType::kFloat32), 4u);
  EXPECT_EQ(DTypeSize(DType::kFloat16), 2u);
  EXPECT_EQ(DTypeSize(DType::kBFloat16), 2u);
  EXPECT_EQ(DTypeSize(DType::kInt8), 1u);
  EXPECT_EQ(DTypeSize(DType::kInt64), 8u);
  EXPECT_EQ(DTypeSize(DType::kFloat64), 8u);
  EXPECT_EQ(DTypeSize(DType::kFloat8E4M3), 1u);
  EXPECT_EQ(DTypeName(DType::kBFloat16), "bf16");
  EXPECT_EQ(*ParseDType("bfloat16"), DType::kBFloat16);
  EXPECT_EQ(*ParseDType("FP16"), DType::kFloat16);
  EXPECT_EQ(*ParseDType("float8_e4m3fn"), DType::kFloat8E4M3);
}

TEST(Types, UnknownDTypeIsRejected) {
  const auto bogus = static_cast<DType>(200);
  EXPECT_EQ(DTypeSize(bogus), 0u);
  EXPECT_FALSE(IsValidDType(bogus));
  EXPECT_EQ(DTypeName(bogus), "unknown");
  Result<DType> parsed = ParseDType("fp4");
  ASSERT_FALSE(parsed.ok());
  EXPECT_NE(parsed.status().message().find("allowed: fp32, fp16, bf16"), std::string_view::npos);
}

TEST(Types, StrongIdsCompareAndHash) {
  TensorId a(3), b(3), c(4);
  EXPECT_EQ(a, b);
  EXPECT_LT(a, c);
  EXPECT_TRUE(a.valid());
  EXPECT_FALSE(TensorId().valid());
  std::unordered_set<ChunkId> set{ChunkId(1), ChunkId(2), ChunkId(1)};
  EXPECT_EQ(set.size(), 2u);
  static_assert(!std::is_convertible_v<TensorId, ChunkId>, "ids of different kinds must not mix");
}

}  // namespace
}  // namespace zoe::offload
