// The boundary guard of the C API: every extern "C" body runs inside Guard, which clears the
// thread-local error, converts a Status into a zoe_status and catches every exception.
#pragma once

#include <exception>
#include <new>
#include <string>

#include "core/status.h"
#include "zoe.h"

namespace zoe::capi {

std::string& LastErrorSlot();

// Stores `make_message()` as the thread's last error. When that needs memory that is not there,
// `fallback` is stored instead: it is at most 15 characters, which every std::string holds in
// the storage it already has, so this never throws.
template <class MakeMessage>
void SetLastError(const char* fallback, MakeMessage&& make_message) noexcept {
  std::string& slot = LastErrorSlot();
  try {
    slot = make_message();
    return;
  } catch (...) {
  }
  slot.clear();
  try {
    slot.assign(fallback);
  } catch (...) {
  }
}

inline zoe_status Fail(const Status& status) noexcept {
  SetLastError("error", [&] { return status.ToString(); });
  return static_cast<zoe_status>(status.code());
}

// Runs `body` (returning Status) and maps its outcome, or any exception, to a zoe_status. The
// handlers build no Status and record their message through SetLastError, so a second bad_alloc
// inside one cannot escape this noexcept function.
template <class Body>
zoe_status Guard(Body&& body) noexcept {
  try {
    LastErrorSlot().clear();
    Status status = body();
    return status.ok() ? ZOE_OK : Fail(status);
  } catch (const std::bad_alloc&) {
    SetLastError("out of memory", [] { return std::string("out of memory"); });
    return static_cast<zoe_status>(StatusCode::kOutOfMemory);
  } catch (const std::exception& e) {
    SetLastError("internal error",
                 [&] { return std::string("unexpected exception: ") + e.what(); });
  } catch (...) {
    SetLastError("internal error", [] { return std::string("unexpected non-standard exception"); });
  }
  return static_cast<zoe_status>(StatusCode::kInternal);
}

}  // namespace zoe::capi
