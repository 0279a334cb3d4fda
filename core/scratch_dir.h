// A temporary directory for a benchmark's files when the user gives no --path: made with
// mkdtemp, removed with everything in it when the object is destroyed.
#pragma once

#include <stdlib.h>

#include <cerrno>
#include <filesystem>
#include <memory>
#include <string>
#include <system_error>

#include "core/result.h"

namespace zoe {

class ScratchDir {
 public:
  // `prefix` is the path up to the six random characters mkdtemp adds, e.g. "/var/tmp/zoe-step-".
  static Result<std::unique_ptr<ScratchDir>> Create(const std::string& prefix) {
    std::string pattern = prefix + "XXXXXX";
    if (::mkdtemp(pattern.data()) == nullptr) return Status::FromErrno(errno, "mkdtemp " + pattern);
    return std::unique_ptr<ScratchDir>(new ScratchDir(std::move(pattern)));
  }
  ~ScratchDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;

  const std::string& path() const { return path_; }

 private:
  explicit ScratchDir(std::string path) : path_(std::move(path)) {}

  std::string path_;
};

}  // namespace zoe
