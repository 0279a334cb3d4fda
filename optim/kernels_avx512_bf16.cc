// The AVX-512 path with the native bf16 conversion and byte permutes (compiled with the AVX-512
// flags plus -mavx512bf16 -mavx512vbmi -ffp-contract=off; see optim/CMakeLists.txt).
#define ZOE_AVX512_NATIVE_BF16 1
#define ZOE_AVX512_VBMI 1
#include "optim/avx512_ops.h"
#include "optim/kernel_math.h"

namespace zoe::optim {
namespace {
constexpr KernelTable kAvx512Bf16Table = MakeKernelTable<Avx512Ops>(Isa::kAvx512Bf16);
}  // namespace

const KernelTable& Avx512Bf16KernelTable() { return kAvx512Bf16Table; }

}  // namespace zoe::optim
