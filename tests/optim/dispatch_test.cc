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
  EXPECT_EQ(ScanGradients(&x, DType::kFloat32, 1).status().code(), StatusCode::kInvalidArgument);
  ASSERT_EQ(unsetenv("ZOE_ISA"), 0);
  EXPECT_EQ(*DefaultIsa(), BestIsa(DetectCpuFeatures()));
  if (saved != nullptr) setenv("ZOE_ISA", saved, 1);
}

TEST(Dispatch, NamesRoundTrip) {
  for (Isa isa : kAllIsas) EXPECT_EQ(*ParseIsa(IsaName(isa)), isa);
  for (Kind kind : kAllKinds) EXPECT_EQ(*ParseKind(KindName(kind)), kind);
  for (DType type : kAllDTypes) EXPECT_EQ(*ParseDType(DTypeName(type)), type);
  EXPECT_EQ(ParseKind("sgd").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(*ParseDType("int8"), DType::kInt8);
  EXPECT_EQ(ParseDType("int4").status().code(), StatusCode::kInvalidArgument);
}

// The kernel tables' slots: fp32, bf16, fp16 and int8 take 0..3 and every other zoe::DType none.
TEST(KernelDTypes, KernelSlotNumbersTheKernelTypesOnly) {
  EXPECT_EQ(KernelSlot(DType::kFloat32), 0);
  EXPECT_EQ(KernelSlot(DType::kBFloat16), 1);
  EXPECT_EQ(KernelSlot(DType::kFloat16), 2);
  EXPECT_EQ(KernelSlot(DType::kInt8), 3);
  int slotted = 0;
  for (const DTypeInfo& info : zoe::kDTypes) {
    const int slot = KernelSlot(info.dtype);
    if (slot == kNoKernelSlot) continue;
    ++slotted;
    EXPECT_EQ(kKernelSlotDTypes[slot], info.dtype) << info.name;
  }
  EXPECT_EQ(slotted, 4);
  EXPECT_EQ(KernelSlot(DType::kFloat64), kNoKernelSlot);
  EXPECT_EQ(KernelSlot(DType::kInt32), kNoKernelSlot);
  EXPECT_EQ(KernelSlot(static_cast<DType>(200)), kNoKernelSlot);
}

// The check every entry point runs: ok for the allowed types, else the dtype and the allowed ones
// by name.
TEST(KernelDTypes, CheckNamesTheDTypeAndTheAllowedOnes) {
  for (DType type : kAllDTypes) EXPECT_TRUE(CheckKernelDType(type, kAllDTypes, "grads").ok());
  for (DType type : kStateDTypes) EXPECT_TRUE(CheckKernelDType(type, kStateDTypes, "state").ok());
  const Status fp64 = CheckKernelDType(DType::kFloat64, kAllDTypes, "grads.dtype");
  EXPECT_EQ(fp64.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(fp64.message(),
            "grads.dtype = fp64 is not an element type the optimizer takes; allowed: fp32, bf16, "
            "fp16");
  EXPECT_EQ(CheckKernelDType(DType::kInt32, kStateDTypes, "state").message(),
            "state = int32 is not an element type the optimizer takes; allowed: fp32, bf16, int8");
  EXPECT_EQ(CheckKernelDType(DType::kInt8, kAllDTypes, "grads").code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckKernelDType(DType::kFloat16, kStateDTypes, "state").code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckKernelDType(static_cast<DType>(200), kAllDTypes, "grads").message(),
            "grads = unknown (200) is not an element type the optimizer takes; allowed: fp32, "
            "bf16, fp16");
}

}  // namespace
}  // namespace zoe::optim
