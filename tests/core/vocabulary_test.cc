// Description: core/vocabulary.h's one name table per concept -- every value's name parses back
// to it, unknown names are refused with the allowed ones listed, and the tables' names are the
// spellings configuration documents, the CLI and the C API have always used.
#include "core/vocabulary.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

namespace zoe {
namespace {

using ::testing::HasSubstr;

TEST(Vocabulary, OptimizerKindNamesRoundTrip) {
  for (size_t i = 0; i < kOptimizerKindNames.size(); ++i) {
    const auto kind = static_cast<OptimizerKind>(i);
    Result<OptimizerKind> parsed = ParseOptimizerKind(OptimizerKindName(kind));
    ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
    EXPECT_EQ(*parsed, kind);
  }
  EXPECT_EQ(OptimizerKindName(OptimizerKind::kAdamW), "adamw");
  EXPECT_EQ(OptimizerKindName(OptimizerKind::kAdam), "adam");
  EXPECT_EQ(OptimizerKindName(OptimizerKind::kAdagrad), "adagrad");
  EXPECT_EQ(OptimizerKindName(OptimizerKind::kLion), "lion");
}

TEST(Vocabulary, ArithmeticAndEvictionNamesRoundTrip) {
  for (Arithmetic arithmetic : {Arithmetic::kExact, Arithmetic::kFast})
    EXPECT_EQ(*ParseArithmetic(ArithmeticName(arithmetic)), arithmetic);
  for (EvictionKind kind : {EvictionKind::kOpt, EvictionKind::kLru})
    EXPECT_EQ(*ParseEvictionKind(EvictionKindName(kind)), kind);
  EXPECT_EQ(ArithmeticName(Arithmetic::kExact), "exact");
  EXPECT_EQ(ArithmeticName(Arithmetic::kFast), "fast");
  EXPECT_EQ(EvictionKindName(EvictionKind::kOpt), "opt");
  EXPECT_EQ(EvictionKindName(EvictionKind::kLru), "lru");
  for (StoreMode mode : {StoreMode::kCached, StoreMode::kAuto, StoreMode::kStreaming})
    EXPECT_EQ(*ParseStoreMode(StoreModeName(mode)), mode);
  EXPECT_EQ(StoreModeName(StoreMode::kCached), "cached");
  EXPECT_EQ(StoreModeName(StoreMode::kAuto), "auto");
  EXPECT_EQ(StoreModeName(StoreMode::kStreaming), "streaming");
  Result<StoreMode> bad = ParseStoreMode("nontemporal");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("allowed: cached, auto, streaming"), std::string::npos)
      << bad.status().message();
}

TEST(Vocabulary, DTypeNamesRoundTripInEverySpelling) {
  for (const DTypeInfo& info : kDTypes) {
    SCOPED_TRACE(std::string(info.name));
    EXPECT_EQ(DTypeName(info.dtype), info.name);
    EXPECT_EQ(DTypeSize(info.dtype), info.bytes);
    EXPECT_EQ(*ParseDType(info.name), info.dtype);
    EXPECT_EQ(*ParseDType(info.torch_name), info.dtype);
    if (!info.short_name.empty()) {
      EXPECT_EQ(*ParseDType(info.short_name), info.dtype);
    }
  }
  EXPECT_EQ(*ParseDType("BFloat16"), DType::kBFloat16);  // any letter case
  EXPECT_EQ(DTypeName(DType::kFloat8E4M3), "fp8_e4m3");
}

TEST(Vocabulary, UnknownNamesListTheAllowedOnes) {
  const Status kind = ParseOptimizerKind("sgd").status();
  EXPECT_EQ(kind.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(kind.message()),
              HasSubstr("unknown optimizer 'sgd'; allowed: adamw, adam, adagrad, lion"));
  // Optimizer kinds match exactly; configuration readers lower-case DeepSpeed's spellings first.
  EXPECT_FALSE(ParseOptimizerKind("AdamW").ok());

  EXPECT_THAT(std::string(ParseArithmetic("approximate").status().message()),
              HasSubstr("unknown arithmetic 'approximate'; allowed: exact, fast"));
  EXPECT_THAT(std::string(ParseEvictionKind("fifo").status().message()),
              HasSubstr("unknown eviction 'fifo'; allowed: opt, lru"));
  EXPECT_THAT(std::string(ParseDType("float128").status().message()),
              HasSubstr("unknown dtype 'float128'; allowed: fp32, fp16, bf16, int8, uint8, int32, "
                        "int64, fp64, bool, fp8_e4m3, fp8_e5m2"));
}

TEST(Vocabulary, ValuesOutsideAnEnumAreUnknown) {
  EXPECT_EQ(OptimizerKindName(static_cast<OptimizerKind>(9)), "unknown");
  EXPECT_EQ(ArithmeticName(static_cast<Arithmetic>(2)), "unknown");
  EXPECT_EQ(EvictionKindName(static_cast<EvictionKind>(2)), "unknown");
  EXPECT_EQ(DTypeName(static_cast<DType>(200)), "unknown");
  EXPECT_EQ(DTypeSize(static_cast<DType>(200)), 0u);
  EXPECT_FALSE(IsValidDType(static_cast<DType>(11)));
  EXPECT_TRUE(IsValidDType(DType::kFloat8E5M2));
}

TEST(Vocabulary, MomentDTypesAreFp32Bf16Int8) {
  EXPECT_THAT(kMomentDTypeNames, ::testing::ElementsAre("fp32", "bf16", "int8"));
  for (DType dtype : kMomentDTypes) EXPECT_TRUE(CheckMomentDType(dtype, "moment_dtype").ok());
  const Status fp16 = CheckMomentDType(DType::kFloat16, "zoe.moment_dtype");
  EXPECT_EQ(fp16.code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(
      std::string(fp16.message()),
      HasSubstr("zoe.moment_dtype = fp16 is not a moment dtype; allowed: fp32, bf16, int8"));
}

}  // namespace
}  // namespace zoe
