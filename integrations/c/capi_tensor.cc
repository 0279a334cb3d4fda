// Tensors (register, find, acquire, release, prefetch, evict) and traces.
#include <string>

#include "integrations/c/capi_names.h"

namespace {

zoe::Result<offload::TensorDesc> ToTensorDesc(const zoe_tensor_desc* in) {
  ZOE_ASSIGN_OR_RETURN(const zoe_tensor_desc desc, zoe::capi::ReadSized(in, "desc"));
  ZOE_RETURN_IF_ERROR(CheckNotNull(desc.name, "desc->name"));
  offload::TensorDesc out;
  out.name = desc.name;
  out.bytes = desc.bytes;
  ZOE_ASSIGN_OR_RETURN(out.dtype,
                       zoe::capi::ToTensorDType(zoe::capi::RawEnum(desc.dtype), "desc->dtype"));
  ZOE_ASSIGN_OR_RETURN(out.home, zoe::capi::ToTier(zoe::capi::RawEnum(desc.home), "desc->home"));
  if (desc.group != nullptr) out.group = desc.group;
  return out;
}

}  // namespace

extern "C" {

zoe_status zoe_tensor_register(zoe_engine* engine, const zoe_tensor_desc* desc,
                               zoe_tensor_id* out) {
  return Guard([&]() -> Status {
    ZOE_RETURN_IF_ERROR(CheckNotNull(out, "out"));
    *out = ZOE_TENSOR_ID_INVALID;
    ZOE_ASSIGN_OR_RETURN(Engine * e, EngineOf(engine));
    ZOE_ASSIGN_OR_RETURN(offload::TensorDesc tensor, ToTensorDesc(desc));
    ZOE_ASSIGN_OR_RETURN(const offload::TensorId id, e->RegisterTensor(std::move(tensor)));
    *out = id.value;
    return Status::Ok();
  });
}

zoe_status zoe_tensor_find(zoe_engine* engine, const char* name, zoe_tensor_id* out) {
  return Guard([&]() -> Status {
    ZOE_RETURN_IF_ERROR(CheckNotNull(out, "out"));
    *out = ZOE_TENSOR_ID_INVALID;
    ZOE_ASSIGN_OR_RETURN(Engine * e, EngineOf(engine));
    ZOE_RETURN_IF_ERROR(CheckNotNull(name, "name"));
    ZOE_ASSIGN_OR_RETURN(const offload::TensorId id, e->FindTensor(name));
    *out = id.value;
    return Status::Ok();
  });
}

zoe_status zoe_tensor_acquire(zoe_engine* engine, zoe_tensor_id tensor, zoe_tier tier,
                              zoe_access access, void** out_ptr) {
  return Guard([&]() -> Status {
    ZOE_RETURN_IF_ERROR(CheckNotNull(out_ptr, "out_ptr"));
    *out_ptr = nullptr;
    ZOE_ASSIGN_OR_RETURN(Engine * e, EngineOf(engine));
    ZOE_ASSIGN_OR_RETURN(const offload::Tier to,
                         zoe::capi::ToTier(zoe::capi::RawEnum(tier), "tier"));
    ZOE_ASSIGN_OR_RETURN(const offload::Access how,
                         zoe::capi::ToAccess(zoe::capi::RawEnum(access)));
    ZOE_ASSIGN_OR_RETURN(*out_ptr, e->Acquire(ToTensorId(tensor), to, how));
    return Status::Ok();
  });
}

zoe_status zoe_tensor_release(zoe_engine* engine, zoe_tensor_id tensor) {
  return Guard([&]() -> Status {
    ZOE_ASSIGN_OR_RETURN(Engine * e, EngineOf(engine));
    return e->Release(ToTensorId(tensor));
  });
}

zoe_status zoe_tensor_prefetch(zoe_engine* engine, zoe_tensor_id tensor, zoe_tier tier) {
  return Guard([&]() -> Status {
    ZOE_ASSIGN_OR_RETURN(Engine * e, EngineOf(engine));
    ZOE_ASSIGN_OR_RETURN(const offload::Tier to,
                         zoe::capi::ToTier(zoe::capi::RawEnum(tier), "tier"));
    return e->Prefetch(ToTensorId(tensor), to);
  });
}

zoe_status zoe_tensor_evict(zoe_engine* engine, zoe_tensor_id tensor) {
  return Guard([&]() -> Status {
    ZOE_ASSIGN_OR_RETURN(Engine * e, EngineOf(engine));
    return e->Evict(ToTensorId(tensor));
  });
}

zoe_status zoe_trace_begin(zoe_engine* engine, const char* name) {
  return Guard([&]() -> Status {
    ZOE_ASSIGN_OR_RETURN(Engine * e, EngineOf(engine));
    ZOE_RETURN_IF_ERROR(CheckNotNull(name, "name"));
    return e->TraceBegin(name);
  });
}

zoe_status zoe_trace_end(zoe_engine* engine) {
  return Guard([&]() -> Status {
    ZOE_ASSIGN_OR_RETURN(Engine * e, EngineOf(engine));
    return e->TraceEnd();
  });
}

zoe_status zoe_trace_save(zoe_engine* engine, const char* name, const char* path) {
  return Guard([&]() -> Status {
    ZOE_ASSIGN_OR_RETURN(Engine * e, EngineOf(engine));
    ZOE_RETURN_IF_ERROR(CheckNotNull(name, "name"));
    ZOE_RETURN_IF_ERROR(CheckNotNull(path, "path"));
    return e->TraceSave(name, path);
  });
}

zoe_status zoe_trace_load(zoe_engine* engine, const char* path, char** out_name) {
  return Guard([&]() -> Status {
    if (out_name != nullptr) *out_name = nullptr;
    ZOE_ASSIGN_OR_RETURN(Engine * e, EngineOf(engine));
    ZOE_RETURN_IF_ERROR(CheckNotNull(path, "path"));
    ZOE_ASSIGN_OR_RETURN(const std::string name, e->TraceLoad(path));
    if (out_name != nullptr) {
      ZOE_ASSIGN_OR_RETURN(*out_name, CopyForCaller(name));
    }
    return Status::Ok();
  });
}

}  // extern "C"
