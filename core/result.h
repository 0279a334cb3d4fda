// Result<T>: a value or the Status that explains why there is none (std::expected arrives in
// C++23; this is the subset zoe needs).
#pragma once

#include <optional>
#include <utility>

#include "core/status.h"

namespace zoe {

template <class T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}         // NOLINT: implicit by design
  Result(Status status) : status_(std::move(status)) {  // NOLINT: implicit by design
    if (status_.ok())
      status_ = Status::Internal("Result constructed from an OK status without a value");
  }

  bool ok() const { return status_.ok(); }
  const Status& status() const& { return status_; }
  Status status() && { return std::move(status_); }

  // Precondition: ok(). Accessing the value of an error is a bug in the caller.
  T& value() & { return *value_; }
  const T& value() const& { return *value_; }
  T&& value() && { return std::move(*value_); }
  T& operator*() & { return *value_; }
  const T& operator*() const& { return *value_; }
  T* operator->() { return &*value_; }
  const T* operator->() const { return &*value_; }

 private:
  Status status_;
  std::optional<T> value_;
};

}  // namespace zoe

#define ZOE_CONCAT_INNER_(a, b) a##b
#define ZOE_CONCAT_(a, b) ZOE_CONCAT_INNER_(a, b)

// Declares-and-assigns `lhs` from a Result expression, or returns its Status from the enclosing
// function: ZOE_ASSIGN_OR_RETURN(auto file, File::Open(path));
#define ZOE_ASSIGN_OR_RETURN(lhs, expr) \
  ZOE_ASSIGN_OR_RETURN_IMPL_(ZOE_CONCAT_(zoe_result_tmp_, __LINE__), lhs, expr)
#define ZOE_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                               \
  if (!tmp.ok()) return std::move(tmp).status();   \
  lhs = std::move(tmp).value()
