// NcclCollectives: Collectives over an NCCL communicator the caller created (built when CMake
// found nccl.h and CUDA: ZOE_HAVE_NCCL and ZOE_HAVE_CUDA; NCCL itself is found at run time, see
// nccl_library.h). zoe's buffers are in host memory and
// NCCL moves device memory, so every call copies its input into a device buffer (grown as needed,
// kept between calls), runs the collective on the caller's stream, waits for the stream and copies
// the result back. Uneven counts use NCCL's grouped point operations: a reduce-scatter is one
// ncclReduce per root inside ncclGroupStart/End, an all-gather one ncclBroadcast per root.
//
// Waiting: cudaStreamSynchronize returns when the collective completes or the communicator is
// aborted (ncclCommAbort from another thread, or NCCL's own timeouts); an asynchronous NCCL error
// (ncclCommGetAsyncError) is reported as a Status.
#pragma once

#include <memory>

#include "core/result.h"
#include "offload/distributed/collectives.h"

namespace zoe::offload {

// `nccl_comm` is an ncclComm_t, `cuda_stream` a cudaStream_t (nullptr: the default stream); both
// borrowed and must outlive the result. NotSupported when zoe was built without NCCL.
Result<std::unique_ptr<Collectives>> MakeNcclCollectives(void* nccl_comm, void* cuda_stream);

}  // namespace zoe::offload
