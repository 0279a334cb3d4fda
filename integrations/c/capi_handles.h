// The C API's handle and the conversions between zoe.h's types and the C++ engine's: every check
// that an argument coming from C is usable (NULL pointers, enum values out of range) lives here,
// so each extern "C" body is only the translation of one call.
#pragma once

#include <sys/types.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>

#include "core/result.h"
#include "offload/engine.h"
#include "offload/optimizer/optimizer_group.h"
#include "offload/types.h"
#include "zoe.h"

// The opaque handle: owns the engine. A destroyed handle cannot be recognised (its memory is
// gone), so using one is undefined, as zoe.h says. `creator` is the process that created the
// engine: its threads, I/O rings, swap files and locked memory are that process's, so a child
// forked from it must not use or release them (EngineOf, zoe_engine_destroy).
struct zoe_engine {
  std::unique_ptr<zoe::offload::Engine> engine;
  pid_t creator = ::getpid();
};

namespace zoe::capi {

// InvalidArgument "<name> is NULL" for a NULL pointer argument.
inline Status CheckNotNull(const void* pointer, std::string_view name) {
  if (pointer != nullptr) return Status::Ok();
  return Status::InvalidArgument(std::string(name) + " is NULL");
}

// OK in the process that created the engine; FailedPrecondition in a child forked from it.
// getpid() is a system call of tens of nanoseconds, so every call can afford the check.
inline Status CheckCreatorProcess(const zoe_engine& handle) {
  if (handle.creator == ::getpid()) return Status::Ok();
  return Status::FailedPrecondition(
      "engine was created by process " + std::to_string(handle.creator) + " and this is process " +
      std::to_string(::getpid()) + "; after fork() a child process must create its own engine");
}

// The engine behind a handle; InvalidArgument for NULL, FailedPrecondition in a forked child.
// Every extern "C" function taking an engine, except zoe_engine_destroy, goes through it.
inline Result<offload::Engine*> EngineOf(zoe_engine* handle) {
  if (handle == nullptr || handle->engine == nullptr)
    return Status::InvalidArgument("engine is NULL");
  ZOE_RETURN_IF_ERROR(CheckCreatorProcess(*handle));
  return handle->engine.get();
}

// The integer a C caller stored in an enum-typed object. Reading an out-of-range value through
// the enum type is undefined behaviour in C++ (its range ends at the next power of two), so the
// object's bytes are copied into an int instead; the To* functions below then check the range.
template <class Enum>
int RawEnum(const Enum& value) {
  static_assert(sizeof(Enum) == sizeof(int), "zoe.h's enums have the size of int");
  int raw = 0;
  std::memcpy(&raw, &value, sizeof raw);
  return raw;
}

Result<offload::Tier> ToTier(int value, std::string_view name);
Result<offload::Access> ToAccess(int value);
Result<DType> ToTensorDType(int value, std::string_view name);
// FLOAT32, BFLOAT16 and FLOAT16 only: the types optimizer groups read and write.
Result<optim::DType> ToOptimDType(int value, std::string_view name);
Result<offload::StateSlot> ToStateSlot(int value);

inline offload::TensorId ToTensorId(zoe_tensor_id id) { return offload::TensorId(id); }
inline offload::GroupId ToGroupId(zoe_group_id id) { return offload::GroupId(id); }

// A copy of `text` in memory the caller frees with zoe_free (std::free); OutOfMemory when malloc
// fails.
Result<char*> CopyForCaller(std::string_view text);

}  // namespace zoe::capi
