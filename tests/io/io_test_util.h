// Helpers shared by the io tests: temporary directories, test data, engines per backend.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <random>
#include <string>

#include "core/aligned_buffer.h"
#include "io/backend.h"
#include "io/file.h"
#include "io/queue.h"

namespace zoe::io::testing {

// A fresh directory under $TMPDIR (default /tmp), removed with everything in it.
class TempDir {
 public:
  TempDir() {
    const char* base = std::getenv("TMPDIR");
    std::string pattern = std::string(base ? base : "/tmp") + "/zoe-io-test.XXXXXX";
    char* made = ::mkdtemp(pattern.data());
    EXPECT_NE(made, nullptr) << "mkdtemp " << pattern;
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  const std::string& path() const { return path_; }
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// Deterministic bytes that differ at every offset and with every seed.
inline void FillPattern(std::span<std::byte> data, uint64_t seed) {
  std::mt19937_64 random(seed);
  for (size_t i = 0; i < data.size(); i += 8) {
    const uint64_t word = random();
    std::memcpy(data.data() + i, &word, std::min<size_t>(8, data.size() - i));
  }
}

inline AlignedBuffer MakeBuffer(size_t bytes, uint64_t seed = 0, size_t alignment = 4096) {
  Result<AlignedBuffer> buffer = AlignedBuffer::Allocate(bytes, alignment);
  EXPECT_TRUE(buffer.ok()) << buffer.status().ToString();
  AlignedBuffer out = std::move(buffer).value();
  if (seed != 0)
    FillPattern(out.span(), seed);
  else
    std::memset(out.data(), 0, out.size());
  return out;
}

// mlock()ed memory, the way pinned host buffers behave; unlocked on destruction.
class LockedBuffer {
 public:
  LockedBuffer(size_t bytes, uint64_t seed) : buffer_(MakeBuffer(bytes, seed)) {
    locked_ = ::mlock(buffer_.data(), buffer_.size()) == 0;
  }
  ~LockedBuffer() {
    if (locked_) ::munlock(buffer_.data(), buffer_.size());
  }
  bool locked() const { return locked_; }
  AlignedBuffer& buffer() { return buffer_; }

 private:
  AlignedBuffer buffer_;
  bool locked_ = false;
};

// A raw engine of the given kind, or nullptr with the reason when it cannot run here.
inline std::unique_ptr<Engine> MakeEngine(BackendKind kind, uint32_t depth, std::string* why) {
  EngineOptions options;
  options.backend = kind;
  options.queue_depth = depth;
  Result<std::unique_ptr<Engine>> engine = CreateEngine(options);
  if (!engine.ok()) {
    *why = engine.status().ToString();
    return nullptr;
  }
  return std::move(engine).value();
}

inline std::unique_ptr<IoQueue> MakeQueue(std::unique_ptr<Engine> engine,
                                          QueueOptions options = {}) {
  Result<std::unique_ptr<IoQueue>> queue = IoQueue::Create(std::move(engine), std::move(options));
  EXPECT_TRUE(queue.ok()) << queue.status().ToString();
  return queue.ok() ? std::move(queue).value() : nullptr;
}

inline std::unique_ptr<FileSet> OpenSet(const std::vector<std::string>& paths,
                                        FileSetOptions options = {}) {
  Result<std::unique_ptr<FileSet>> set = FileSet::Open(paths, options);
  EXPECT_TRUE(set.ok()) << set.status().ToString();
  return set.ok() ? std::move(set).value() : nullptr;
}

inline IoRequest Request(Op op, const FileSet& files, uint64_t offset,
                         std::span<std::byte> buffer) {
  return IoRequest{op, &files, offset, buffer};
}

// Holds every completion back until opened, so requests stay in flight as long as a test needs.
class GatedEngine : public EngineWrapper {
 public:
  using EngineWrapper::EngineWrapper;
  Result<size_t> Reap(std::span<RawCompletion> out, size_t min_completions) override {
    {
      std::unique_lock lock(mutex_);
      opened_.wait(lock, [&] { return open_; });
    }
    return EngineWrapper::Reap(out, min_completions);
  }
  void Open() {
    {
      std::lock_guard lock(mutex_);
      open_ = true;
    }
    opened_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable opened_;
  bool open_ = false;
};

}  // namespace zoe::io::testing
