// Reads ahead of a pipeline and the cache of chunks kept in its buffers (chunk_pipeline.h).
#include <algorithm>
#include <vector>

#include "offload/optimizer/chunk_pipeline.h"
#include "offload/optimizer/step_plan.h"

namespace zoe::offload {

void ChunkPipeline::CommitCache() {
  buffers_.CommitWritten([&](size_t chunk) { return slots_.version(chunk); });
  descending_ = !descending_;
}

void ChunkPipeline::ReleaseUnusedRead(size_t b) {
  const PipelineBuffer& read = buffers_[b];
  bool usable = read.read_ticket == 0 || resources_.io->Wait(read.read_ticket).ok();
  if (!usable || slots_.version(read.chunk) != read.version) {
    buffers_.Release(b);
    return;
  }
  // A read the pipeline would have verified is verified before its buffer may serve as a cache:
  // a cached state is used as it is.
  if (read.read_ticket != 0 && hashing_in_stripes_) {
    usable = VerifyWhole(read.chunk, buffers_.data(b)).ok();
  }
  if (usable) {
    buffers_.ReleaseCaching(b);
  } else {
    buffers_.Release(b);
  }
}

void ChunkPipeline::ReleasePrefetched() {
  for (size_t b : buffers_.Prefetched()) ReleaseUnusedRead(b);
}

void ChunkPipeline::StartPrefetch(size_t chunk) {
  if (!buffers_.any_free()) return;  // the step reads it
  const uint64_t version = slots_.version(chunk);
  if (const std::optional<size_t> holder = buffers_.FindCached(chunk, version)) {
    buffers_.StartPrefetch(*holder, chunk, version, 0);
    return;
  }
  // Keep cached chunks as long as possible: overwrite a buffer that holds none first.
  const size_t b = *buffers_.FreeToOverwrite();
  Result<io::Ticket> ticket = SubmitChunkIo(io::Op::kRead, chunk, slots_.live(chunk),
                                            buffers_.data(b), /*for_pipeline=*/true);
  if (!ticket.ok()) return;  // the step reads it again and reports the error
  buffers_.StartPrefetch(b, chunk, version, *ticket);
}

bool ChunkPipeline::IsPrefetched(size_t chunk) const {
  const std::vector<size_t> prefetched = buffers_.Prefetched();
  return std::any_of(prefetched.begin(), prefetched.end(),
                     [&](size_t b) { return buffers_[b].chunk == chunk; });
}

std::byte* ChunkPipeline::CachedState(size_t chunk) {
  const std::optional<size_t> holder = buffers_.FindCached(chunk, slots_.version(chunk));
  return holder ? buffers_.data(*holder) : nullptr;
}

std::byte* ChunkPipeline::ScratchBuffer() {
  const size_t b = *buffers_.FreeToOverwrite();
  buffers_.DropCache(b);
  return buffers_.data(b);
}

void ChunkPipeline::StartStepReads(const std::vector<bool>& wanted) {
  ClaimCachedChunks();
  std::vector<bool> unclaimed = wanted;
  for (size_t b : buffers_.Prefetched()) unclaimed[buffers_[b].chunk] = false;
  for (size_t c : ChunksInDirection(unclaimed, nvme_count_, descending_)) {
    if (!buffers_.any_free()) return;
    StartPrefetch(c);
  }
}

void ChunkPipeline::ClaimCachedChunks() {
  for (size_t i = 0; i < nvme_count_; ++i) {
    const size_t c = descending_ ? nvme_count_ - 1 - i : i;
    if (buffers_.FindCached(c, slots_.version(c))) StartPrefetch(c);
  }
}

std::vector<size_t> ChunkPipeline::PrefetchedChunks() const {
  std::vector<size_t> chunks;
  for (size_t b : buffers_.Prefetched()) chunks.push_back(buffers_[b].chunk);
  return chunks;
}

void ChunkPipeline::ReleasePrefetchedChunks(std::span<const size_t> chunks) {
  std::vector<bool> released(nvme_count_, false);
  for (size_t c : chunks) released[c] = true;
  for (size_t b : buffers_.Prefetched()) {
    if (released[buffers_[b].chunk]) ReleaseUnusedRead(b);
  }
}

}  // namespace zoe::offload
