#include "core/status.h"

#include <array>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "core/vocabulary.h"

namespace zoe {

// Indexed by StatusCode's value (core/vocabulary.h's mechanism).
constexpr std::array<std::string_view, 13> kStatusCodeNames = {"OK",
                                                               "invalid argument",
                                                               "not found",
                                                               "IO error",
                                                               "no space",
                                                               "corruption",
                                                               "out of memory",
                                                               "not supported",
                                                               "failed precondition",
                                                               "busy",
                                                               "permission denied",
                                                               "aborted",
                                                               "internal error"};
static_assert(kStatusCodeNames.size() == static_cast<size_t>(StatusCode::kInternal) + 1);

std::string_view StatusCodeName(StatusCode code) {
  const std::string_view name = NameIn(kStatusCodeNames, code);
  return name == "unknown" ? std::string_view("unknown status") : name;
}

Status::Status(StatusCode code, std::string message, int sys_errno) {
  if (code == StatusCode::kOk) return;
  state_ = std::make_unique<State>(State{code, sys_errno, std::move(message)});
}

Status::Status(const Status& other)
    : state_(other.state_ ? std::make_unique<State>(*other.state_) : nullptr) {}

Status& Status::operator=(const Status& other) {
  if (this != &other) state_ = other.state_ ? std::make_unique<State>(*other.state_) : nullptr;
  return *this;
}

// The code of each errno zoe tells apart; every other errno is an I/O error. zoe.errors in Python
// mirrors this table (_BY_ERRNO).
constexpr std::pair<int, StatusCode> kErrnoCodes[] = {
    {ENOSPC, StatusCode::kNoSpace},
    {EFBIG, StatusCode::kNoSpace},
    {EDQUOT, StatusCode::kNoSpace},
    {ENOENT, StatusCode::kNotFound},
    {ENOTDIR, StatusCode::kNotFound},
    {EACCES, StatusCode::kPermissionDenied},
    {EPERM, StatusCode::kPermissionDenied},
    {EROFS, StatusCode::kPermissionDenied},
    {ENOMEM, StatusCode::kOutOfMemory},
    {EINVAL, StatusCode::kInvalidArgument},
    {EBADF, StatusCode::kInvalidArgument},
    {EFAULT, StatusCode::kInvalidArgument},
    {ENOSYS, StatusCode::kNotSupported},
    {EOPNOTSUPP, StatusCode::kNotSupported},
    {EBUSY, StatusCode::kBusy},
    {ECANCELED, StatusCode::kAborted},
};

static StatusCode CodeForErrno(int err) {
  for (const auto& [number, code] : kErrnoCodes) {
    if (number == err) return code;
  }
  return StatusCode::kIoError;
}

Status Status::FromErrno(int err, std::string_view context) {
  err = std::abs(err);
  std::string message(context);
  message += ": ";
  message += std::strerror(err);
  return Status(CodeForErrno(err), std::move(message), err);
}

StatusCode Status::code() const { return state_ ? state_->code : StatusCode::kOk; }
int Status::sys_errno() const { return state_ ? state_->sys_errno : 0; }
std::string_view Status::message() const {
  return state_ ? std::string_view(state_->message) : std::string_view();
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  std::string out(StatusCodeName(state_->code));
  out += ": ";
  out += state_->message;
  return out;
}

Status& Status::WithContext(std::string_view context) & {
  if (state_) state_->message = std::string(context) + ": " + state_->message;
  return *this;
}

Status&& Status::WithContext(std::string_view context) && {
  WithContext(context);
  return std::move(*this);
}

}  // namespace zoe
