// PipelineBufferPool: the pipeline buffers of an optimizer group, one record per buffer holding
// its memory, its block checksums and its one state, moved only by the named transitions below.
// Bookkeeping only: the caller submits and waits for the transfers and hands their tickets over.
//
// Transitions (free means kFree, kCached or kWritten):
//   free                  --StartRead-->             reading (the running pipeline's)
//   free                  --StartPrefetch-->         prefetched (for the next pipeline)
//   prefetched            --AdoptPrefetched-->       reading
//   reading               --Hold-->                  holding
//   holding               --StartWrite-->            writing
//   writing               --QueueReadBehindWrite-->  writing-then-reading
//   writing               --CollectWrite-->          written
//   writing-then-reading  --CollectWrite-->          reading
//   prefetched, reading   --ReleaseCaching-->        cached (its state is still live)
//   any but writing       --Release-->               free
//   written               --CommitWritten-->         cached;  --ForgetWritten--> free
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "core/pinned_memory.h"
#include "io/queue.h"

namespace zoe::offload {

enum class BufferState : uint8_t {
  kFree,                // holds nothing of use
  kCached,              // free; holds `chunk`'s state at `version`, usable while that is live
  kWritten,             // free; the latest pipeline's last write from it was of `written_chunk`
  kPrefetched,          // read of `chunk` at `version` for the next pipeline (ticket 0: cached)
  kReading,             // read the running pipeline consumes (ticket 0: nothing to wait for)
  kHolding,             // the running pipeline's chunk function works on `chunk` in it
  kWriting,             // write of `written_chunk` in flight; collecting it frees the buffer
  kWritingThenReading,  // write of `written_chunk` in flight, read of `chunk` queued behind it
};

std::string_view BufferStateName(BufferState state);

struct PipelineBuffer {
  PinnedBuffer memory;
  std::vector<uint64_t> sums;  // one per checksum block of the state it holds (may be empty)
  BufferState state = BufferState::kFree;
  size_t chunk = 0;             // cached, read or held
  uint64_t version = 0;         // of `chunk` when cached or when its read started
  io::Ticket read_ticket = 0;   // prefetched, reading, writing-then-reading (0: none)
  size_t written_chunk = 0;     // written, writing, writing-then-reading
  io::Ticket write_ticket = 0;  // writing, writing-then-reading
  uint64_t queued = 0;          // when it became free (newest taken first) or its read started
  uint64_t write_queued = 0;    // when its write started (oldest collected first)
};

class PipelineBufferPool {
 public:
  // A new buffer, free, with `sum_blocks` checksums; returns its index.
  size_t Add(PinnedBuffer memory, size_t sum_blocks);

  size_t size() const { return buffers_.size(); }
  const PipelineBuffer& operator[](size_t b) const { return buffers_[b]; }
  std::byte* data(size_t b) { return buffers_[b].memory.data(); }
  std::span<uint64_t> sums(size_t b) { return buffers_[b].sums; }
  uint64_t pinned_bytes() const;
  size_t count(BufferState state) const;

  // ---- Choosing a free buffer.
  bool IsFree(size_t b) const;
  bool any_free() const;
  // The free buffer freed last (the pipeline takes it: its memory is likeliest in cache).
  std::optional<size_t> NewestFree() const;
  // The free buffer freed first that holds no cached chunk, else the one freed first.
  std::optional<size_t> FreeToOverwrite() const;
  // The free buffer (freed first) caching `chunk` at `version`.
  std::optional<size_t> FindCached(size_t chunk, uint64_t version) const;

  // ---- Queues, each oldest first.
  std::vector<size_t> Prefetched() const;
  // The running pipeline's read to consume next (reading or writing-then-reading).
  std::optional<size_t> OldestRead() const;
  // The write to collect for a buffer: the oldest whose buffer no read took.
  std::optional<size_t> OldestFreeingWrite() const;
  // The oldest write of any kind (writing or writing-then-reading); it does not allocate.
  std::optional<size_t> OldestWrite() const;
  std::vector<size_t> Writes() const;  // writing and writing-then-reading

  // ---- Transitions (each checks its source state in debug builds).
  void StartPrefetch(size_t b, size_t chunk, uint64_t version, io::Ticket ticket);  // free →
  void StartRead(size_t b, size_t chunk, uint64_t version, io::Ticket ticket);      // free →
  void AdoptPrefetched(size_t b);                // prefetched → reading
  void Hold(size_t b);                           // reading → holding
  void StartWrite(size_t b, io::Ticket ticket);  // holding → writing
  void QueueReadBehindWrite(size_t b, size_t chunk, uint64_t version, io::Ticket ticket);
  // writing → written (free); writing-then-reading → reading (its read is next).
  void CollectWrite(size_t b);
  void Release(size_t b);         // any but writing → free
  void ReleaseCaching(size_t b);  // a read or claimed copy whose state is still live → cached
  void DropCache(size_t b);       // cached or written → free, in place
  void ForgetWritten();           // every written → free (a new pipeline starts)
  // Every written buffer caches its chunk at the version `version_of(chunk)` gives.
  template <class VersionOf>
  void CommitWritten(const VersionOf& version_of) {
    for (PipelineBuffer& buffer : buffers_) {
      if (buffer.state != BufferState::kWritten) continue;
      buffer.state = BufferState::kCached;
      buffer.chunk = buffer.written_chunk;
      buffer.version = version_of(buffer.chunk);
    }
  }

 private:
  void MakeFree(size_t b, BufferState free_state);
  template <class Pred>
  std::optional<size_t> OldestWhere(const Pred& pred, bool by_write) const;

  std::vector<PipelineBuffer> buffers_;
  uint64_t clock_ = 0;  // stamps `queued` and `write_queued`
};

}  // namespace zoe::offload
