#include "optim/dispatch.h"

#if defined(__x86_64__)
#include <cpuid.h>
#endif

#include <cstdlib>
#include <mutex>
#include <string>

#include "core/log.h"

namespace zoe::optim {
namespace {

#if defined(__x86_64__)
// F16C from cpuid leaf 1: clang before 15 has no "f16c" for __builtin_cpu_supports.
bool HasF16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
}
#endif

}  // namespace

CpuFeatures DetectCpuFeatures() {
  CpuFeatures cpu;
#if defined(__x86_64__)
  __builtin_cpu_init();
  cpu.avx2_fma_f16c = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && HasF16c();
  cpu.avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  cpu.avx512_bf16 =
      cpu.avx512 && __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vbmi");
#endif
  return cpu;
}

bool IsaSupported(Isa isa, const CpuFeatures& cpu) {
  switch (isa) {
    case Isa::kAvx512Bf16:
      return cpu.avx512_bf16;
    case Isa::kAvx512:
      return cpu.avx512;
    case Isa::kAvx2:
      return cpu.avx2_fma_f16c;
    case Isa::kScalar:
      return true;
  }
  return false;
}

Isa BestIsa(const CpuFeatures& cpu) {
  for (Isa isa : kAllIsas) {
    if (IsaSupported(isa, cpu)) return isa;
  }
  return Isa::kScalar;
}

Result<Isa> SelectIsa(std::string_view zoe_isa, const CpuFeatures& cpu) {
  if (zoe_isa.empty()) return BestIsa(cpu);
  Result<Isa> isa = ParseIsa(zoe_isa);
  if (!isa.ok()) return std::move(isa).status().WithContext("ZOE_ISA");
  if (!IsaSupported(*isa, cpu)) {
    return Status::NotSupported("ZOE_ISA=" + std::string(zoe_isa) +
                                ": this CPU does not support it; it supports up to " +
                                std::string(IsaName(BestIsa(cpu))));
  }
  return isa;
}

// The CPU's features, detected once: cpuid traps to the hypervisor on a virtual machine (several
// microseconds), the kernels ask on every call, and the answer cannot change while we run.
static const CpuFeatures& HostCpuFeatures() {
  static const CpuFeatures features = DetectCpuFeatures();
  return features;
}

Result<Isa> DefaultIsa() {
  const char* forced = std::getenv("ZOE_ISA");
  const CpuFeatures& cpu = HostCpuFeatures();
  ZOE_ASSIGN_OR_RETURN(Isa isa, SelectIsa(forced == nullptr ? "" : forced, cpu));
  static std::once_flag logged;
  std::call_once(logged, [&] {
    ZOE_LOG_INFO("optimizer kernels: {} ({}; best on this CPU: {})", IsaName(isa),
                 forced == nullptr ? "chosen by cpuid" : "forced by ZOE_ISA",
                 IsaName(BestIsa(cpu)));
  });
  return isa;
}

Result<const KernelTable*> KernelsFor(Isa isa) {
  if (!IsaSupported(isa, HostCpuFeatures())) {
    return Status::NotSupported("instruction set " + std::string(IsaName(isa)) +
                                " is not supported by this CPU");
  }
  switch (isa) {
    case Isa::kAvx512Bf16:
      return &Avx512Bf16KernelTable();
    case Isa::kAvx512:
      return &Avx512KernelTable();
    case Isa::kAvx2:
      return &Avx2KernelTable();
    case Isa::kScalar:
      return &ScalarKernelTable();
  }
  return Status::Internal("unknown instruction set");
}

}  // namespace zoe::optim
