// NcclLibrary: NCCL's entry points, looked up at run time in the libnccl.so.2 of the process (the
// one torch loaded, or the first the dynamic loader finds), so libzoe neither links NCCL nor
// ships it. Built only with ZOE_HAVE_NCCL (nccl.h found at build time, for the types).
//
// Where the library comes from, in order: ZOE_NCCL_LIBRARY (a path), then "libnccl.so.2" as the
// dynamic loader resolves it (already loaded, LD_LIBRARY_PATH, the ld.so cache). Python wheels
// keep it in site-packages/nvidia/nccl/lib (the nvidia-nccl-cu13 package torch depends on).
#pragma once

#if defined(ZOE_HAVE_NCCL)
#include <nccl.h>

#include "core/result.h"

namespace zoe::offload {

struct NcclLibrary {
  const char* (*GetErrorString)(ncclResult_t);
  ncclResult_t (*CommUserRank)(const ncclComm_t, int*);
  ncclResult_t (*CommCount)(const ncclComm_t, int*);
  ncclResult_t (*CommGetAsyncError)(ncclComm_t, ncclResult_t*);
  ncclResult_t (*CommInitAll)(ncclComm_t*, int, const int*);
  ncclResult_t (*CommDestroy)(ncclComm_t);
  ncclResult_t (*AllReduce)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                            cudaStream_t);
  ncclResult_t (*Reduce)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, int, ncclComm_t,
                         cudaStream_t);
  ncclResult_t (*Broadcast)(const void*, void*, size_t, ncclDataType_t, int, ncclComm_t,
                            cudaStream_t);
  ncclResult_t (*GroupStart)();
  ncclResult_t (*GroupEnd)();
};

// The process's NCCL, loaded on the first call and kept until exit. NotSupported, naming
// ZOE_NCCL_LIBRARY and what the loader said, when no library or one of the entry points is found.
Result<const NcclLibrary*> LoadNccl();

}  // namespace zoe::offload
#endif
