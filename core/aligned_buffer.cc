#include "core/aligned_buffer.h"

#include <string>
#include <utility>

#include "core/io_memory.h"

namespace zoe {

AlignedBuffer::AlignedBuffer(AlignedBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      alignment_(std::exchange(other.alignment_, 0)) {}

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& other) noexcept {
  if (this != &other) {
    FreeIoMemory(data_, size_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    alignment_ = std::exchange(other.alignment_, 0);
  }
  return *this;
}

AlignedBuffer::~AlignedBuffer() { FreeIoMemory(data_, size_); }

Result<AlignedBuffer> AlignedBuffer::Allocate(size_t bytes, size_t alignment) {
  if (alignment == 0 || (alignment & (alignment - 1)) != 0 || alignment < sizeof(void*)) {
    return Status::InvalidArgument("buffer alignment " + std::to_string(alignment) +
                                   " is not a power of two >= " + std::to_string(sizeof(void*)));
  }
  AlignedBuffer buffer;
  buffer.alignment_ = alignment;
  if (bytes == 0) return buffer;
  const size_t rounded = AlignUp(bytes, alignment);
  buffer.data_ = static_cast<std::byte*>(AllocateIoMemory(rounded, alignment));
  if (buffer.data_ == nullptr) {
    return Status::OutOfMemory("cannot allocate " + std::to_string(rounded) + " bytes aligned to " +
                               std::to_string(alignment));
  }
  buffer.size_ = rounded;
  return buffer;
}

}  // namespace zoe
