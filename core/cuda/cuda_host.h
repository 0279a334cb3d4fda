// CUDA host-memory registration for core/pinned_memory.cc. Compiled only when ZOE_HAVE_CUDA is
// defined; this header names no CUDA type, so callers need no CUDA include path.
#pragma once

#include <memory>

#include "core/pinned_memory.h"

namespace zoe::cuda {

// True when the CUDA runtime reports at least one device (checked once per process).
bool HostRegistrationAvailable();

// A locker that runs `inner` and then cudaHostRegister on the same range (and undoes both in
// reverse order). A registration failure undoes `inner` and reports -ENOMEM or -EIO.
std::shared_ptr<PageLocker> MakeHostRegisterLocker(std::shared_ptr<PageLocker> inner);

}  // namespace zoe::cuda
