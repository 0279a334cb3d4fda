// Status: the outcome of an operation that can fail, carried by value up the stack.
//
// Contract:
//  - An OK Status holds no allocation; an error holds a code, the errno that caused it (0 when
//    none) and a message to which callers prepend context as it travels up ("tensor 'w3': read
//    /nvme/zoe.swap at offset 4096: Input/output error").
//  - Syscall wrappers return -errno; conversion into a Status happens once, with FromErrno().
//  - Status is [[nodiscard]]: dropping one is a compile warning.
#pragma once

#include <memory>
#include <string>
#include <string_view>

namespace zoe {

// Numbered codes; a value, once given, is never reused (the C API exposes the same numbers).
enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument = 1,     // bad input from the caller: config, sizes, dtypes, handles
  kNotFound = 2,            // a named thing (file, tensor, group, key) does not exist
  kIoError = 3,             // an I/O syscall failed (EIO and friends)
  kNoSpace = 4,             // ENOSPC, EFBIG, EDQUOT, or a reservation that does not fit
  kCorruption = 5,          // a checksum, magic or version did not match
  kOutOfMemory = 6,         // allocation failed or a memory budget cannot be met
  kNotSupported = 7,        // the machine or kernel lacks a feature (io_uring, O_DIRECT, GPU)
  kFailedPrecondition = 8,  // a call in the wrong order or on a closed object
  kBusy = 9,                // every resource that could satisfy the request is pinned
  kPermissionDenied = 10,   // EACCES, EPERM, EROFS
  kAborted = 11,            // cancelled, or skipped (a step with non-finite gradients)
  kInternal = 12,           // a broken invariant inside zoe: a bug to report
};

// A short name for a code: "IO error", "no space", ...
std::string_view StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(StatusCode code, std::string message, int sys_errno = 0);

  Status(const Status& other);
  Status& operator=(const Status& other);
  Status(Status&&) noexcept = default;
  Status& operator=(Status&&) noexcept = default;

  static Status Ok() { return Status(); }
  static Status InvalidArgument(std::string msg) {
    return {StatusCode::kInvalidArgument, std::move(msg)};
  }
  static Status NotFound(std::string msg, int err = 0) {
    return {StatusCode::kNotFound, std::move(msg), err};
  }
  static Status IoError(std::string msg, int err = 0) {
    return {StatusCode::kIoError, std::move(msg), err};
  }
  static Status NoSpace(std::string msg, int err = 0) {
    return {StatusCode::kNoSpace, std::move(msg), err};
  }
  static Status Corruption(std::string msg) { return {StatusCode::kCorruption, std::move(msg)}; }
  static Status OutOfMemory(std::string msg) { return {StatusCode::kOutOfMemory, std::move(msg)}; }
  static Status NotSupported(std::string msg, int err = 0) {
    return {StatusCode::kNotSupported, std::move(msg), err};
  }
  static Status FailedPrecondition(std::string msg) {
    return {StatusCode::kFailedPrecondition, std::move(msg)};
  }
  static Status Busy(std::string msg) { return {StatusCode::kBusy, std::move(msg)}; }
  static Status PermissionDenied(std::string msg, int err = 0) {
    return {StatusCode::kPermissionDenied, std::move(msg), err};
  }
  static Status Aborted(std::string msg) { return {StatusCode::kAborted, std::move(msg)}; }
  static Status Internal(std::string msg) { return {StatusCode::kInternal, std::move(msg)}; }

  // Maps an errno (positive or negative) to the closest code and appends strerror to `context`:
  // FromErrno(-ENOSPC, "write /a at offset 0") -> NoSpace("write /a at offset 0: No space left on
  // device").
  static Status FromErrno(int err, std::string_view context);

  bool ok() const { return state_ == nullptr; }
  StatusCode code() const;
  int sys_errno() const;             // 0 when the error did not come from a syscall
  std::string_view message() const;  // empty for OK
  std::string ToString() const;      // "OK" or "<code name>: <message>"

  // Prepends "context: " to the message of an error; an OK status stays OK.
  Status& WithContext(std::string_view context) &;
  Status&& WithContext(std::string_view context) &&;

  friend bool operator==(const Status& a, const Status& b) {
    return a.code() == b.code() && a.message() == b.message();
  }

 private:
  struct State {
    StatusCode code;
    int sys_errno;
    std::string message;
  };
  std::unique_ptr<State> state_;
};

}  // namespace zoe

// Returns the Status of `expr` from the enclosing function when it is an error.
#define ZOE_RETURN_IF_ERROR(expr)                      \
  do {                                                 \
    ::zoe::Status zoe_status_tmp_ = (expr);            \
    if (!zoe_status_tmp_.ok()) return zoe_status_tmp_; \
  } while (0)
