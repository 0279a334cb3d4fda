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

inline zoe_status Fail(const Status& status) {
  LastErrorSlot() = status.ToString();
  return static_cast<zoe_status>(status.code());
}

// Runs `body` (returning Status) and maps its outcome, or any exception, to a zoe_status.
template <class Body>
zoe_status Guard(Body&& body) noexcept {
  try {
    LastErrorSlot().clear();
    Status status = body();
    return status.ok() ? ZOE_OK : Fail(status);
  } catch (const std::bad_alloc&) {
    return Fail(Status::OutOfMemory("out of memory"));
  } catch (const std::exception& e) {
    return Fail(Status::Internal(std::string("unexpected exception: ") + e.what()));
  } catch (...) {
    return Fail(Status::Internal("unexpected non-standard exception"));
  }
}

}  // namespace zoe::capi
