// Run-time choice of the instruction-set path: cpuid says what the CPU has, ZOE_ISA may force a
// lesser path (for tests and comparisons), and the choice is logged once per process.
#pragma once

#include <string_view>

#include "core/result.h"
#include "optim/kernels.h"
#include "optim/types.h"

namespace zoe::optim {

// What the running CPU (and OS, for the AVX-512 register state) supports.
struct CpuFeatures {
  bool avx2_fma_f16c = false;
  bool avx512 = false;       // F, BW, VL and DQ
  bool avx512_bf16 = false;  // the above plus AVX512_BF16 and AVX512_VBMI
};

CpuFeatures DetectCpuFeatures();

bool IsaSupported(Isa isa, const CpuFeatures& cpu);

// The best path `cpu` supports.
Isa BestIsa(const CpuFeatures& cpu);

// The path to use given the value of ZOE_ISA (empty: the best one). A name the CPU cannot run is
// NotSupported, an unknown name InvalidArgument; both name what is allowed.
Result<Isa> SelectIsa(std::string_view zoe_isa, const CpuFeatures& cpu);

// SelectIsa(getenv("ZOE_ISA"), DetectCpuFeatures()); logs the choice once per process.
Result<Isa> DefaultIsa();

// The kernel table of `isa`, or NotSupported when the running CPU lacks it.
Result<const KernelTable*> KernelsFor(Isa isa);

}  // namespace zoe::optim
