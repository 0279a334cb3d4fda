// The AVX-512 path for CPUs without the bf16 extension (compiled with -mavx512f -mavx512bw
// -mavx512vl -mavx512dq -ffp-contract=off; see optim/CMakeLists.txt).
#include "optim/avx512_ops.h"
#include "optim/kernel_math.h"

namespace zoe::optim {
namespace {
constexpr KernelTable kAvx512Table = MakeKernelTable<Avx512Ops>(Isa::kAvx512);
}  // namespace

const KernelTable& Avx512KernelTable() { return kAvx512Table; }

}  // namespace zoe::optim
