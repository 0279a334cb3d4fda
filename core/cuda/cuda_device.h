// The CUDA device backend (cudaMalloc, one non-blocking stream per queue, events recorded after
// each cudaMemcpyAsync). Compiled only when ZOE_HAVE_CUDA is defined; this header names no CUDA
// type. Use zoe::CreateDeviceBackend("cuda" | "auto", ...) rather than calling it directly.
#pragma once

#include <cstdint>
#include <memory>

#include "core/device.h"

namespace zoe::cuda {

// The backend for device `ordinal`. NotSupported when the runtime reports no such device (the
// message carries the runtime's reason). capacity_bytes == 0 takes the memory free on the device
// now; a larger capacity than the device has is InvalidArgument.
Result<std::unique_ptr<DeviceBackend>> CreateCudaDevice(int ordinal, uint64_t capacity_bytes);

}  // namespace zoe::cuda
