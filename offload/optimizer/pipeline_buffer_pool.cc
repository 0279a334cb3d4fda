// The pipeline buffers' records and their transitions (pipeline_buffer_pool.h).
#include "offload/optimizer/pipeline_buffer_pool.h"

#include <algorithm>
#include <array>
#include <cassert>
#include <utility>

#include "core/vocabulary.h"

namespace zoe::offload {

// Indexed by BufferState's value (core/vocabulary.h's mechanism).
constexpr std::array<std::string_view, 8> kBufferStateNames = {
    "free",    "cached",  "written", "prefetched",
    "reading", "holding", "writing", "writing-then-reading"};
static_assert(kBufferStateNames.size() ==
              static_cast<size_t>(BufferState::kWritingThenReading) + 1);

std::string_view BufferStateName(BufferState state) { return NameIn(kBufferStateNames, state); }

size_t PipelineBufferPool::Add(PinnedBuffer memory, size_t sum_blocks) {
  PipelineBuffer& buffer = buffers_.emplace_back();
  buffer.memory = std::move(memory);
  buffer.sums.resize(sum_blocks);
  buffer.queued = ++clock_;
  return buffers_.size() - 1;
}

uint64_t PipelineBufferPool::pinned_bytes() const {
  uint64_t total = 0;
  for (const PipelineBuffer& buffer : buffers_) total += buffer.memory.size();
  return total;
}

size_t PipelineBufferPool::count(BufferState state) const {
  size_t n = 0;
  for (const PipelineBuffer& buffer : buffers_) n += buffer.state == state ? 1 : 0;
  return n;
}

bool PipelineBufferPool::IsFree(size_t b) const {
  const BufferState state = buffers_[b].state;
  return state == BufferState::kFree || state == BufferState::kCached ||
         state == BufferState::kWritten;
}

bool PipelineBufferPool::any_free() const {
  for (size_t b = 0; b < buffers_.size(); ++b) {
    if (IsFree(b)) return true;
  }
  return false;
}

std::optional<size_t> PipelineBufferPool::NewestFree() const {
  std::optional<size_t> newest;
  for (size_t b = 0; b < buffers_.size(); ++b) {
    if (IsFree(b) && (!newest || buffers_[b].queued > buffers_[*newest].queued)) newest = b;
  }
  return newest;
}

template <class Pred>
std::optional<size_t> PipelineBufferPool::OldestWhere(const Pred& pred, bool by_write) const {
  std::optional<size_t> oldest;
  auto stamp = [&](size_t b) { return by_write ? buffers_[b].write_queued : buffers_[b].queued; };
  for (size_t b = 0; b < buffers_.size(); ++b) {
    if (pred(b) && (!oldest || stamp(b) < stamp(*oldest))) oldest = b;
  }
  return oldest;
}

std::optional<size_t> PipelineBufferPool::FreeToOverwrite() const {
  std::optional<size_t> empty = OldestWhere(
      [&](size_t b) { return IsFree(b) && buffers_[b].state != BufferState::kCached; }, false);
  if (empty) return empty;
  return OldestWhere([&](size_t b) { return IsFree(b); }, false);
}

std::optional<size_t> PipelineBufferPool::FindCached(size_t chunk, uint64_t version) const {
  return OldestWhere(
      [&](size_t b) {
        const PipelineBuffer& buffer = buffers_[b];
        return buffer.state == BufferState::kCached && buffer.chunk == chunk &&
               buffer.version == version;
      },
      false);
}

std::vector<size_t> PipelineBufferPool::Prefetched() const {
  std::vector<size_t> order;
  for (size_t b = 0; b < buffers_.size(); ++b) {
    if (buffers_[b].state == BufferState::kPrefetched) order.push_back(b);
  }
  std::sort(order.begin(), order.end(),
            [&](size_t x, size_t y) { return buffers_[x].queued < buffers_[y].queued; });
  return order;
}

std::optional<size_t> PipelineBufferPool::OldestRead() const {
  return OldestWhere(
      [&](size_t b) {
        const BufferState state = buffers_[b].state;
        return state == BufferState::kReading || state == BufferState::kWritingThenReading;
      },
      false);
}

std::optional<size_t> PipelineBufferPool::OldestFreeingWrite() const {
  return OldestWhere([&](size_t b) { return buffers_[b].state == BufferState::kWriting; }, true);
}

std::optional<size_t> PipelineBufferPool::OldestWrite() const {
  return OldestWhere(
      [&](size_t b) {
        const BufferState state = buffers_[b].state;
        return state == BufferState::kWriting || state == BufferState::kWritingThenReading;
      },
      true);
}

std::vector<size_t> PipelineBufferPool::Writes() const {
  std::vector<size_t> order;
  for (size_t b = 0; b < buffers_.size(); ++b) {
    const BufferState state = buffers_[b].state;
    if (state == BufferState::kWriting || state == BufferState::kWritingThenReading) {
      order.push_back(b);
    }
  }
  std::sort(order.begin(), order.end(), [&](size_t x, size_t y) {
    return buffers_[x].write_queued < buffers_[y].write_queued;
  });
  return order;
}

void PipelineBufferPool::StartPrefetch(size_t b, size_t chunk, uint64_t version,
                                       io::Ticket ticket) {
  StartRead(b, chunk, version, ticket);
  buffers_[b].state = BufferState::kPrefetched;
}

void PipelineBufferPool::StartRead(size_t b, size_t chunk, uint64_t version, io::Ticket ticket) {
  assert(IsFree(b));
  PipelineBuffer& buffer = buffers_[b];
  buffer.state = BufferState::kReading;
  buffer.chunk = chunk;
  buffer.version = version;
  buffer.read_ticket = ticket;
  buffer.queued = ++clock_;
}

void PipelineBufferPool::AdoptPrefetched(size_t b) {
  assert(buffers_[b].state == BufferState::kPrefetched);
  buffers_[b].state = BufferState::kReading;
}

void PipelineBufferPool::Hold(size_t b) {
  assert(buffers_[b].state == BufferState::kReading);
  buffers_[b].state = BufferState::kHolding;
  buffers_[b].read_ticket = 0;
}

void PipelineBufferPool::StartWrite(size_t b, io::Ticket ticket) {
  assert(buffers_[b].state == BufferState::kHolding);
  PipelineBuffer& buffer = buffers_[b];
  buffer.state = BufferState::kWriting;
  buffer.written_chunk = buffer.chunk;
  buffer.write_ticket = ticket;
  buffer.write_queued = ++clock_;
}

void PipelineBufferPool::QueueReadBehindWrite(size_t b, size_t chunk, uint64_t version,
                                              io::Ticket ticket) {
  assert(buffers_[b].state == BufferState::kWriting);
  PipelineBuffer& buffer = buffers_[b];
  buffer.state = BufferState::kWritingThenReading;
  buffer.chunk = chunk;
  buffer.version = version;
  buffer.read_ticket = ticket;
  buffer.queued = ++clock_;
}

void PipelineBufferPool::CollectWrite(size_t b) {
  PipelineBuffer& buffer = buffers_[b];
  assert(buffer.state == BufferState::kWriting || buffer.state == BufferState::kWritingThenReading);
  buffer.write_ticket = 0;
  if (buffer.state == BufferState::kWritingThenReading) {
    buffer.state = BufferState::kReading;
    return;
  }
  MakeFree(b, BufferState::kWritten);
}

void PipelineBufferPool::Release(size_t b) {
  assert(buffers_[b].state != BufferState::kWriting &&
         buffers_[b].state != BufferState::kWritingThenReading);
  MakeFree(b, BufferState::kFree);
}

void PipelineBufferPool::ReleaseCaching(size_t b) {
  assert(buffers_[b].state == BufferState::kPrefetched ||
         buffers_[b].state == BufferState::kReading);
  MakeFree(b, BufferState::kCached);
}

void PipelineBufferPool::DropCache(size_t b) {
  assert(IsFree(b));
  buffers_[b].state = BufferState::kFree;
}

void PipelineBufferPool::ForgetWritten() {
  for (PipelineBuffer& buffer : buffers_) {
    if (buffer.state == BufferState::kWritten) buffer.state = BufferState::kFree;
  }
}

void PipelineBufferPool::MakeFree(size_t b, BufferState free_state) {
  PipelineBuffer& buffer = buffers_[b];
  buffer.state = free_state;
  buffer.read_ticket = 0;
  buffer.queued = ++clock_;
}

}  // namespace zoe::offload
