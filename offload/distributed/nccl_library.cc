// NcclLibrary: see nccl_library.h.
#include "offload/distributed/nccl_library.h"

#if defined(ZOE_HAVE_NCCL)
#include <dlfcn.h>
#include <fmt/format.h>

#include <cstdlib>
#include <mutex>
#include <string>

namespace zoe::offload {
namespace {

// dlopen's answer for `name`, or a NotSupported naming it and how to point zoe elsewhere.
Result<void*> OpenLibrary(const char* name) {
  void* handle = dlopen(name, RTLD_NOW | RTLD_LOCAL);
  if (handle != nullptr) return handle;
  const char* why = dlerror();
  return Status::NotSupported(fmt::format(
      "NCCL collectives: cannot load {} ({}); set ZOE_NCCL_LIBRARY to libnccl.so.2's path (pip's "
      "nvidia-nccl package keeps it in site-packages/nvidia/nccl/lib) or add its folder to "
      "LD_LIBRARY_PATH",
      name, why != nullptr ? why : "no reason given"));
}

template <class Function>
Status Bind(void* handle, const char* symbol, Function*& out) {
  out = reinterpret_cast<Function*>(dlsym(handle, symbol));
  if (out != nullptr) return Status::Ok();
  return Status::NotSupported(fmt::format(
      "NCCL collectives: the NCCL library loaded has no {} (NCCL 2.x is needed)", symbol));
}

Status BindAll(void* handle, NcclLibrary& nccl) {
  ZOE_RETURN_IF_ERROR(Bind(handle, "ncclGetErrorString", nccl.GetErrorString));
  ZOE_RETURN_IF_ERROR(Bind(handle, "ncclCommUserRank", nccl.CommUserRank));
  ZOE_RETURN_IF_ERROR(Bind(handle, "ncclCommCount", nccl.CommCount));
  ZOE_RETURN_IF_ERROR(Bind(handle, "ncclCommGetAsyncError", nccl.CommGetAsyncError));
  ZOE_RETURN_IF_ERROR(Bind(handle, "ncclCommInitAll", nccl.CommInitAll));
  ZOE_RETURN_IF_ERROR(Bind(handle, "ncclCommDestroy", nccl.CommDestroy));
  ZOE_RETURN_IF_ERROR(Bind(handle, "ncclAllReduce", nccl.AllReduce));
  ZOE_RETURN_IF_ERROR(Bind(handle, "ncclReduce", nccl.Reduce));
  ZOE_RETURN_IF_ERROR(Bind(handle, "ncclBroadcast", nccl.Broadcast));
  ZOE_RETURN_IF_ERROR(Bind(handle, "ncclGroupStart", nccl.GroupStart));
  return Bind(handle, "ncclGroupEnd", nccl.GroupEnd);
}

Result<const NcclLibrary*> LoadOnce() {
  static NcclLibrary nccl;
  const char* configured = std::getenv("ZOE_NCCL_LIBRARY");
  const char* name = configured != nullptr && *configured != '\0' ? configured : "libnccl.so.2";
  ZOE_ASSIGN_OR_RETURN(void* handle, OpenLibrary(name));
  // The handle is kept for the life of the process: NCCL's threads may outlive any one caller.
  ZOE_RETURN_IF_ERROR(BindAll(handle, nccl));
  return &nccl;
}

}  // namespace

Result<const NcclLibrary*> LoadNccl() {
  static std::once_flag once;
  static Result<const NcclLibrary*> loaded = Status::Internal("NCCL not loaded yet");
  std::call_once(once, [] { loaded = LoadOnce(); });
  return loaded;
}

}  // namespace zoe::offload
#endif
