// Description: instruction-set selection: cpuid features, ZOE_ISA forcing, and clear errors for
// unknown or unsupported paths.
#include "optim/dispatch.h"

#include <gtest/gtest.h>

#include <cstdlib>

#include "optim/chunk.h"

namespace zoe::optim {
namespace {

constexpr CpuFeatures kNoSimd{};
constexpr CpuFeatures kAvx2Only{.avx2_fma_f16c = true};
constexpr CpuFeatures kEverything{.avx2_fma_f16c = true, .avx512 = true, .avx512_bf16 = true};

TEST(Dispatch, BestIsaFollowsFeatures) {
  EXPECT_EQ(BestIsa(kNoSimd), Isa::kScalar);
  EXPECT_EQ(BestIsa(kAvx2Only), Isa::kAvx2);
  EXPECT_EQ(BestIsa({.avx2_fma_f16c = true, .avx512 = true}), Isa::kAvx512);
  EXPECT_EQ(BestIsa(kEverything), Isa::kAvx512Bf16);
}

TEST(Dispatch, ZoeIsaForcesALesserPath) {
  EXPECT_EQ(*SelectIsa("", kEverything), Isa::kAvx512Bf16);
  EXPECT_EQ(*SelectIsa("avx2", kEverything), Isa::kAvx2);
  EXPECT_EQ(*SelectIsa("scalar", kEverything), Isa::kScalar);
  EXPECT_EQ(*SelectIsa("scalar", kNoSimd), Isa::kScalar);
}

TEST(Dispatch, UnknownOrUnsupportedNamesAreErrors) {
  const Result<Isa> unknown = SelectIsa("sse9", kEverything);
  EXPECT_EQ(unknown.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(unknown.status().message().find("ZOE_ISA"), std::string_view::npos);
  EXPECT_NE(unknown.status().message().find("avx2"), std::string_view::npos);
  const Result<Isa> unsupported = SelectIsa("avx512", kAvx2Only);
  EXPECT_EQ(unsupported.status().code(), StatusCode::kNotSupported);
  EXPECT_NE(unsupported.status().message().find("up to avx2"), std::string_view::npos);
}

TEST(Dispatch, KernelsForRefusesWhatThisCpuLacks) {
  const CpuFeatures cpu = DetectCpuFeatures();
  for (Isa isa : kAllIsas) {
    Result<const KernelTable*> table = KernelsFor(isa);
    if (IsaSupported(isa, cpu)) {
      ASSERT_TRUE(table.ok());
      EXPECT_EQ((*table)->isa, isa);
    } else {
      EXPECT_EQ(table.status().code(), StatusCode::kNotSupported);
    }
  }
}

TEST(Dispatch, DefaultIsaReadsTheEnvironment) {
  const char* saved = std::getenv("ZOE_ISA");
  ASSERT_EQ(setenv("ZOE_ISA", "scalar", 1), 0);
  EXPECT_EQ(*DefaultIsa(), Isa::kScalar);
  ASSERT_EQ(setenv("ZOE_ISA", "bogus", 1), 0);
  EXPECT_EQ(DefaultIsa().status().code(), StatusCode::kInvalidArgument);
  // A kernel call without an explicit path reports the bad variable instead of running.
  float x = 0;
  EXPECT_EQ(ScanGradients(&x, DType::kF32, 1).status().code(), StatusCode::kInvalidArgument);
  ASSERT_EQ(unsetenv("ZOE_ISA"), 0);
  EXPECT_EQ(*DefaultIsa(), BestIsa(DetectCpuFeatures()));
  if (saved != nullptr) setenv("ZOE_ISA", saved, 1);
}

TEST(Dispatch, NamesRoundTrip) {
  for (Isa isa : kAllIsas) EXPECT_EQ(*ParseIsa(IsaName(isa)), isa);
  for (Kind kind : kAllKinds) EXPECT_EQ(*ParseKind(KindName(kind)), kind);
  for (DType type : kAllDTypes) EXPECT_EQ(*ParseDType(DTypeName(type)), type);
  EXPECT_EQ(ParseKind("sgd").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(*ParseDType("int8"), DType::kI8);
  EXPECT_EQ(ParseDType("int4").status().code(), StatusCode::kInvalidArgument);
}

// The kernels' element types are the zoe::DType values of the same name, and no others.
TEST(Dispatch, KernelDTypesBridgeToZoeDTypes) {
  for (DType type : {DType::kF32, DType::kBF16, DType::kF16, DType::kI8}) {
    EXPECT_EQ(zoe::DTypeName(ToDType(type)), DTypeName(type));
    EXPECT_EQ(*ToKernelDType(ToDType(type), "x"), type);
  }
  const Status uint8 = ToKernelDType(zoe::DType::kUInt8, "grads.dtype").status();
  EXPECT_EQ(uint8.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(uint8.message().find("grads.dtype = uint8 is not an element type the optimizer "
                                 "takes; allowed: fp32, bf16, fp16, int8"),
            std::string::npos)
      << uint8.message();
  EXPECT_NE(ParseDType("uint8").status().message().find(
                "unknown element type 'uint8'; allowed: fp32, bf16, fp16, int8"),
            std::string::npos);
}

}  // namespace
}  // namespace zoe::optim
