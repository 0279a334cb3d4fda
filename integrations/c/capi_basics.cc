// Version, status names, the thread-local last-error message and zoe_free.
#include <cstdlib>
#include <string>

#include "core/status.h"
#include "integrations/c/capi_guard.h"
#include "integrations/c/capi_handles.h"
#include "zoe.h"

namespace zoe::capi {

std::string& LastErrorSlot() {
  thread_local std::string message;
  return message;
}

}  // namespace zoe::capi

extern "C" {

const char* zoe_version(void) {
#define ZOE_STR_(x) #x
#define ZOE_STR(x) ZOE_STR_(x)
  return ZOE_STR(ZOE_VERSION_MAJOR) "." ZOE_STR(ZOE_VERSION_MINOR) "." ZOE_STR(ZOE_VERSION_PATCH);
}

const char* zoe_status_string(zoe_status status) {
  const int code = zoe::capi::RawEnum(status);
  if (code < 0 || code > static_cast<int>(zoe::StatusCode::kInternal)) return "unknown status";
  return zoe::StatusCodeName(static_cast<zoe::StatusCode>(code)).data();
}

const char* zoe_last_error(void) { return zoe::capi::LastErrorSlot().c_str(); }

void zoe_free(void* ptr) { std::free(ptr); }

}  // extern "C"
