// ChunkPipeline: the NVMe chunk I/O of an optimizer group. It owns the chunks' slots
// (NvmeSlots) and the pipeline buffers (PipelineBufferPool), runs the pipeline that overlaps the
// reads, the chunk function and the writes (submit, consume, drain), starts reads ahead of a
// step, and keeps the chunks the last step wrote cached in the buffers for the next one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "offload/optimizer/chunk_update.h"
#include "offload/optimizer/nvme_slots.h"
#include "offload/optimizer/optimizer_group.h"
#include "offload/optimizer/optimizer_group_layout.h"
#include "offload/optimizer/pipeline_buffer_pool.h"

namespace zoe::offload {

// What a pipeline (or a step) moved and how long it waited and computed.
struct PipelineTotals {
  uint64_t bytes_read = 0;
  uint64_t bytes_reused = 0;  // state found in the pipeline buffers instead of read
  uint64_t bytes_written = 0;
  double io_wait_seconds = 0.0;
  double compute_seconds = 0.0;
};

// Runs on each chunk of a pipeline, whose state is at `state`. With checksums on it verifies
// `checksums.expected` (non-empty when the state was just read from disk) and fills
// `checksums.computed` (non-empty when the pipeline was asked to take the sums from it).
using ChunkFn =
    std::function<Status(size_t chunk, std::byte* state, const ChunkChecksums& checksums)>;

class ChunkPipeline {
 public:
  // `layout` is borrowed and outlives the pipeline; chunks [0, nvme_count) are on NVMe.
  ChunkPipeline(std::string group_name, const StateLayout& layout, size_t nvme_count,
                uint32_t slot_count, OptimizerResources resources);
  ~ChunkPipeline();  // frees the extents
  ChunkPipeline(const ChunkPipeline&) = delete;
  ChunkPipeline& operator=(const ChunkPipeline&) = delete;

  // min(buffer_count, NVMe chunks) buffers of the largest chunk's size, then (AllocateSlots)
  // the extents of every NVMe chunk.
  Status AllocateBuffers(uint32_t buffer_count);
  Status AllocateSlots();

  // "optimizer group 'g': chunk 3 (elements [a, b)) on NVMe", the context of every chunk error.
  std::string ChunkName(size_t chunk) const;
  NvmeSlots& slots() { return slots_; }
  const NvmeSlots& slots() const { return slots_; }
  const PipelineBufferPool& buffers() const { return buffers_; }

  // ---- Outside the pipeline (the group is idle).
  // Reads chunk `chunk`'s live slot into `buffer` and waits.
  Status ReadChunk(size_t chunk, std::byte* buffer);
  // The free pipeline buffer holding chunk `chunk`'s live state, or nullptr.
  std::byte* CachedState(size_t chunk);
  // A free pipeline buffer to read into: one holding no cached chunk if there is one, else the
  // first, whose cache is dropped.
  std::byte* ScratchBuffer();

  // ---- The pipeline (chunk_pipeline.cc). NVMe chunks go through the buffers in `order`: reads
  // run ahead as far as free buffers allow (the prefetched reads of its chunks first; they must
  // lead `order`), `fn` runs on chunk i while the reads of the chunks after it and the writes of
  // those before it are in flight, and every chunk is written to its inactive slot (with one
  // slot, in place). The first error stops the pipeline; every transfer still in flight is
  // waited for and every buffer returned before it is reported. Slots are not flipped here: the
  // caller flips them once the whole operation succeeded. `totals->bytes_written` counts every
  // write submitted, so a caller knows whether a failure came after the first write.
  // `keep_writes`: on success the writes are left in flight (the next pipeline or FinishWrites
  // collects them). `fn_hashes`: `fn` fills checksums.computed, which the chunk's write records.
  Status Run(std::span<const size_t> order, bool read, const ChunkFn& fn, PipelineTotals* totals,
             bool fn_hashes = false, bool keep_writes = false);
  // Collects the writes a pipeline left in flight: all of them (waiting), or those already
  // completed, oldest first. The first failed one is the error.
  Status FinishWrites();
  Status ReapWrites();

  // ---- Reads ahead and the cache (chunk_pipeline_prefetch.cc).
  // Makes chunk `chunk`'s state ready for the next pipeline in a buffer: claims the buffer that
  // still holds it, else starts its read into a free buffer (one holding no cached chunk
  // first). Does nothing when no buffer is free.
  void StartPrefetch(size_t chunk);
  bool IsPrefetched(size_t chunk) const;
  std::vector<size_t> PrefetchedChunks() const;  // in the order they started
  // At the start of a step: claims every buffer still holding a chunk's live state, then starts
  // reads of the `wanted` chunks into the buffers still free, in the step's direction.
  void StartStepReads(const std::vector<bool>& wanted);
  // Waits for a prefetched read the pipeline will not use and frees its buffer. One whose read
  // succeeded (or that was claimed from the cache) and whose chunk has not flipped since caches
  // that chunk again, so a skipped or failed step does not cost the next one its reads.
  void ReleasePrefetched();
  void ReleasePrefetchedChunks(std::span<const size_t> chunks);
  // After a successful step and its flip: the buffers' contents become the cache of their
  // chunks, and the next step goes the other way (so it starts with them).
  void CommitCache();
  bool descending() const { return descending_; }

 private:
  struct RunState;
  io::IoRequest ChunkIoRequest(io::Op op, size_t chunk, uint8_t slot, std::byte* buffer,
                               bool for_pipeline, std::span<const uint64_t> sums = {}) const;
  Result<io::Ticket> SubmitChunkIo(io::Op op, size_t chunk, uint8_t slot, std::byte* buffer,
                                   bool for_pipeline = false, std::span<const uint64_t> sums = {});
  ChunkChecksums ChecksumsFor(size_t chunk, size_t buffer, bool read_from_disk, bool fn_hashes,
                              Status* status);
  Status VerifyWhole(size_t chunk, const std::byte* state) const;
  Result<std::optional<size_t>> TakeBuffer(bool block, PipelineTotals* totals);
  Status ReadBehindWrite(size_t chunk, size_t b, PipelineTotals* totals);
  Status CollectFollowedWrite(size_t b);
  size_t AdoptPrefetchedReads(std::span<const size_t> order, PipelineTotals* totals);
  void SubmitReads(RunState& run, size_t pos);
  void StartPipelineRead(RunState& run, size_t b);
  void ConsumeRead(RunState& run);
  Status WaitForRead(RunState& run, size_t b);
  Status WriteChunk(RunState& run, size_t b, const ChunkChecksums& checksums);
  Status Drain(RunState& run, bool keep_writes);
  void ReleaseUnusedRead(size_t b);
  void ClaimCachedChunks();

  std::string name_;
  const StateLayout& layout_;
  size_t nvme_count_;
  OptimizerResources resources_;
  NvmeSlots slots_;
  PipelineBufferPool buffers_;
  // With checksums of kStripeChecksumBlock bytes, the chunk functions verify what the pipeline
  // reads and hash what it writes, stripe by stripe on the kernel threads (chunk_update.h): the
  // sums each buffer holds, and those expected of the chunk being updated.
  bool hashing_in_stripes_ = false;
  std::vector<uint64_t> expected_sums_;
  bool descending_ = false;  // the direction of the next step
};

}  // namespace zoe::offload
