// The portable path: kernel_math.h over plain floats, built for baseline x86-64 (or any CPU).
#include "optim/kernel_math.h"

namespace zoe::optim {
namespace {
constexpr KernelTable kScalarTable = MakeKernelTable<ScalarOps>(Isa::kScalar);
}  // namespace

const KernelTable& ScalarKernelTable() { return kScalarTable; }

}  // namespace zoe::optim
