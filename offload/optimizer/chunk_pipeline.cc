// The pipeline of an optimizer group's NVMe chunks (chunk_pipeline.h): the buffers and slots,
// a chunk's I/O, and the pipeline's stages: submit reads, consume them (wait, verify, the chunk
// function, the write), drain.
#include "offload/optimizer/chunk_pipeline.h"

#include <fmt/format.h>

#include <chrono>
#include <utility>

#include "core/log.h"

namespace zoe::offload {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace

// The running pipeline's progress through `order`.
struct ChunkPipeline::RunState {
  std::span<const size_t> order;
  bool read;
  const ChunkFn& fn;
  PipelineTotals* totals;
  bool fn_hashes;
  size_t next = 0;  // order[next] is the next chunk whose read starts
  Status failure;   // the first error; it stops the pipeline
};

ChunkPipeline::ChunkPipeline(std::string group_name, const StateLayout& layout, size_t nvme_count,
                             uint32_t slot_count, OptimizerResources resources)
    : name_(std::move(group_name)),
      layout_(layout),
      nvme_count_(nvme_count),
      resources_(resources),
      slots_(slot_count) {}

ChunkPipeline::~ChunkPipeline() {
  (void)FinishWrites();
  ReleasePrefetched();
  for (const io::Extent& extent : slots_.extents()) {
    Status freed = resources_.swap->Free(extent);
    if (!freed.ok()) ZOE_LOG_WARN("optimizer group '{}': {}", name_, freed.ToString());
  }
}

std::string ChunkPipeline::ChunkName(size_t chunk) const {
  const ChunkRegions regions = layout_.chunk(chunk);
  return fmt::format("optimizer group '{}': chunk {} (elements [{}, {})) on {}", name_, chunk,
                     regions.first, regions.first + regions.count,
                     chunk < nvme_count_ ? "NVMe" : "HOST");
}

Status ChunkPipeline::AllocateBuffers(uint32_t buffer_count) {
  const io::ChecksumTable* table = nvme_count_ > 0 ? resources_.swap->files().checksums() : nullptr;
  hashing_in_stripes_ = table != nullptr && table->block_size() == kStripeChecksumBlock;
  const size_t blocks = hashing_in_stripes_ ? layout_.max_chunk_bytes() / kStripeChecksumBlock : 0;
  expected_sums_.resize(blocks);
  for (size_t b = 0; b < std::min<size_t>(buffer_count, nvme_count_); ++b) {
    ZOE_ASSIGN_OR_RETURN(PinnedBuffer buffer,
                         resources_.pinned->Allocate(layout_.max_chunk_bytes()));
    buffers_.Add(std::move(buffer), blocks);
  }
  return Status::Ok();
}

Status ChunkPipeline::AllocateSlots() {
  const uint64_t io_block = layout_.io_block();
  slots_.Resize(nvme_count_);
  for (size_t c = 0; c < nvme_count_; ++c) {
    for (uint8_t s = 0; s < slots_.slot_count(); ++s) {
      Result<io::Extent> extent = resources_.swap->Allocate(layout_.chunk(c).bytes);
      if (!extent.ok()) return std::move(extent).status().WithContext(ChunkName(c));
      slots_.Assign(c, s, *extent);
      if (extent->offset % io_block != 0) {
        return Status::InvalidArgument(fmt::format(
            "{}: swap extent at offset {} is not aligned to the {}-byte checksum block; create "
            "the swap space with an alignment that is a multiple of it",
            ChunkName(c), extent->offset, io_block));
      }
    }
  }
  return Status::Ok();
}

io::IoRequest ChunkPipeline::ChunkIoRequest(io::Op op, size_t chunk, uint8_t slot,
                                            std::byte* buffer, bool for_pipeline,
                                            std::span<const uint64_t> sums) const {
  const io::Extent& extent = slots_.extent(chunk, slot);
  io::IoRequest request{op, &resources_.swap->files(), extent.offset,
                        std::span(buffer, layout_.chunk(chunk).bytes)};
  request.caller_verifies = for_pipeline && op == io::Op::kRead && hashing_in_stripes_;
  request.caller_sums = sums;
  return request;
}

Result<io::Ticket> ChunkPipeline::SubmitChunkIo(io::Op op, size_t chunk, uint8_t slot,
                                                std::byte* buffer, bool for_pipeline,
                                                std::span<const uint64_t> sums) {
  return resources_.io->Submit(ChunkIoRequest(op, chunk, slot, buffer, for_pipeline, sums));
}

Status ChunkPipeline::ReadChunk(size_t chunk, std::byte* buffer) {
  const std::string context = fmt::format("{}, slot {}", ChunkName(chunk), slots_.live(chunk));
  Result<io::Ticket> ticket = SubmitChunkIo(io::Op::kRead, chunk, slots_.live(chunk), buffer);
  if (!ticket.ok()) return std::move(ticket).status().WithContext(context);
  return resources_.io->Wait(*ticket).WithContext(context);
}

// Spans of the chunk's blocks: the sums recorded for its live slot when its state was just read
// from disk (to verify), and the buffer's own (to fill) when `fn_hashes`. A chunk function that
// does not hash does not verify either: its state is verified here, whole, before it runs.
ChunkChecksums ChunkPipeline::ChecksumsFor(size_t chunk, size_t buffer, bool read_from_disk,
                                           bool fn_hashes, Status* status) {
  ChunkChecksums checksums;
  if (!hashing_in_stripes_) return checksums;
  const size_t blocks = layout_.chunk(chunk).bytes / kStripeChecksumBlock;
  const uint8_t slot = slots_.live(chunk);
  const io::ChecksumTable& table = *resources_.swap->files().checksums();
  checksums.files = &resources_.swap->files();
  checksums.extent_offset = slots_.live_extent(chunk).offset;
  checksums.where = fmt::format("slot {}", slot);
  if (read_from_disk && fn_hashes) {
    checksums.expected = std::span(expected_sums_).subspan(0, blocks);
    *status = table.Expected(checksums.extent_offset, std::span(expected_sums_).subspan(0, blocks),
                             checksums.where);
  } else if (read_from_disk) {
    *status = VerifyWhole(chunk, buffers_.data(buffer));
  }
  if (fn_hashes) checksums.computed = buffers_.sums(buffer).subspan(0, blocks);
  return checksums;
}

Status ChunkPipeline::VerifyWhole(size_t chunk, const std::byte* state) const {
  const uint8_t slot = slots_.live(chunk);
  const io::FileSet& files = resources_.swap->files();
  return files.checksums()->Verify(slots_.live_extent(chunk).offset,
                                   std::span(state, layout_.chunk(chunk).bytes),
                                   fmt::format("slot {}, read {}", slot, files.Describe()));
}

// A free pipeline buffer; when none is free, the oldest write whose buffer no read took gives
// it back: waited for when `block`, else only if it already completed (nullopt otherwise). A
// failed write is the error; so is finding no buffer at all when `block` (every buffer held by
// reads, which the pipeline never lets happen).
Result<std::optional<size_t>> ChunkPipeline::TakeBuffer(bool block, PipelineTotals* totals) {
  const std::optional<size_t> writer = buffers_.OldestFreeingWrite();
  if (!buffers_.any_free() && writer) {
    const PipelineBuffer& oldest = buffers_[*writer];
    std::optional<Status> done;
    if (block) {
      const Clock::time_point start = Clock::now();
      done = resources_.io->Wait(oldest.write_ticket);
      totals->io_wait_seconds += SecondsSince(start);
    } else {
      done = resources_.io->Poll(oldest.write_ticket);
    }
    if (!done.has_value()) return std::optional<size_t>();
    const size_t written_chunk = oldest.written_chunk;
    buffers_.CollectWrite(*writer);
    if (!done->ok()) return std::move(*done).WithContext(ChunkName(written_chunk));
  }
  if (!buffers_.any_free()) {
    if (!block) return std::optional<size_t>();
    return Status::Internal(fmt::format(
        "optimizer group '{}': no pipeline buffer is free or being written ({} buffers)", name_,
        buffers_.size()));
  }
  return buffers_.NewestFree();
}

Status ChunkPipeline::ReadBehindWrite(size_t chunk, size_t b, PipelineTotals* totals) {
  io::IoRequest request = ChunkIoRequest(io::Op::kRead, chunk, slots_.live(chunk), buffers_.data(b),
                                         /*for_pipeline=*/true);
  request.after = buffers_[b].write_ticket;
  ZOE_ASSIGN_OR_RETURN(io::Ticket ticket, resources_.io->Submit(request));
  buffers_.QueueReadBehindWrite(b, chunk, slots_.version(chunk), ticket);
  totals->bytes_read += layout_.chunk(chunk).bytes;
  return Status::Ok();
}

Status ChunkPipeline::CollectFollowedWrite(size_t b) {
  const size_t written_chunk = buffers_[b].written_chunk;
  const io::Ticket ticket = buffers_[b].write_ticket;
  buffers_.CollectWrite(b);
  return resources_.io->Wait(ticket).WithContext(ChunkName(written_chunk));
}

Status ChunkPipeline::Run(std::span<const size_t> order, bool read, const ChunkFn& fn,
                          PipelineTotals* totals, bool fn_hashes, bool keep_writes) {
  buffers_.ForgetWritten();
  RunState run{order, read, fn, totals, fn_hashes};
  if (read) run.next = AdoptPrefetchedReads(order, totals);
  for (size_t pos = 0; pos < order.size() && run.failure.ok(); ++pos) {
    SubmitReads(run, pos);
    if (run.failure.ok()) ConsumeRead(run);
  }
  return Drain(run, keep_writes);
}

// The prefetched reads of the chunks in `order` become the pipeline's, in the order they started
// (which is the order's); returns how many.
size_t ChunkPipeline::AdoptPrefetchedReads(std::span<const size_t> order, PipelineTotals* totals) {
  std::vector<bool> in_order(nvme_count_, false);
  for (size_t c : order) in_order[c] = true;
  size_t adopted = 0;
  for (size_t b : buffers_.Prefetched()) {
    const PipelineBuffer& buffer = buffers_[b];
    if (!in_order[buffer.chunk]) continue;
    (buffer.read_ticket != 0 ? totals->bytes_read : totals->bytes_reused) +=
        layout_.chunk(buffer.chunk).bytes;
    buffers_.AdoptPrefetched(b);
    ++adopted;
  }
  return adopted;
}

// Starts reads ahead of chunk `pos` into the free buffers; the read of chunk `pos` itself waits
// for a buffer if none is free.
void ChunkPipeline::SubmitReads(RunState& run, size_t pos) {
  while (run.next < run.order.size() && run.failure.ok()) {
    Result<std::optional<size_t>> buffer = TakeBuffer(run.next == pos, run.totals);
    if (!buffer.ok()) {
      run.failure = std::move(buffer).status();
      return;
    }
    if (!buffer->has_value()) return;
    StartPipelineRead(run, **buffer);
  }
}

// Buffer `b` (free) receives chunk order[next]: its read, or nothing when the pipeline fills it.
void ChunkPipeline::StartPipelineRead(RunState& run, size_t b) {
  const size_t chunk = run.order[run.next];
  io::Ticket ticket = 0;
  if (run.read) {
    Result<io::Ticket> submitted = SubmitChunkIo(io::Op::kRead, chunk, slots_.live(chunk),
                                                 buffers_.data(b), /*for_pipeline=*/true);
    if (!submitted.ok()) {
      buffers_.Release(b);
      run.failure = std::move(submitted).status().WithContext(ChunkName(chunk));
      return;
    }
    ticket = *submitted;
    run.totals->bytes_read += layout_.chunk(chunk).bytes;
  }
  buffers_.StartRead(b, chunk, slots_.version(chunk), ticket);
  ++run.next;
}

// The oldest read: waited for, verified, `fn` run on it, its write submitted (and the next read
// queued behind that write).
void ChunkPipeline::ConsumeRead(RunState& run) {
  const size_t b = *buffers_.OldestRead();
  const size_t chunk = buffers_[b].chunk;
  const bool from_disk = run.read && buffers_[b].read_ticket != 0;
  Status status = WaitForRead(run, b);
  if (!run.failure.ok()) return;
  buffers_.Hold(b);
  // Only a state that came from the disk is verified: one found in a buffer was hashed by the
  // update that produced it and never left memory.
  ChunkChecksums checksums;
  if (status.ok()) checksums = ChecksumsFor(chunk, b, from_disk, run.fn_hashes, &status);
  if (status.ok()) {
    const Clock::time_point start = Clock::now();
    status = run.fn(chunk, buffers_.data(b), checksums);
    run.totals->compute_seconds += SecondsSince(start);
  }
  if (status.ok()) status = WriteChunk(run, b, checksums);
  if (!status.ok()) {
    buffers_.Release(b);
    run.failure = std::move(status).WithContext(ChunkName(chunk));
  }
}

// The read's status; a read behind a write also collects that write, whose failure (a read
// behind a failed write never started) stops the pipeline.
Status ChunkPipeline::WaitForRead(RunState& run, size_t b) {
  Status status;
  if (buffers_[b].read_ticket != 0) {
    const Clock::time_point start = Clock::now();
    status = resources_.io->Wait(buffers_[b].read_ticket);
    run.totals->io_wait_seconds += SecondsSince(start);
  }
  if (buffers_[b].state != BufferState::kWritingThenReading) return status;
  Status written = CollectFollowedWrite(b);
  if (!written.ok()) {
    buffers_.Release(b);
    run.failure = std::move(written);
  }
  return status;
}

// Submits the write of the chunk held in `b`; the read of the next chunk goes behind it at once,
// whatever this thread does meanwhile: a read waiting for a free buffer would otherwise start
// only after the next update. A failed submit is returned; a failed queued read stops the run.
Status ChunkPipeline::WriteChunk(RunState& run, size_t b, const ChunkChecksums& checksums) {
  const size_t chunk = buffers_[b].chunk;
  ZOE_ASSIGN_OR_RETURN(io::Ticket ticket, SubmitChunkIo(io::Op::kWrite, chunk,
                                                        slots_.write_slot(chunk), buffers_.data(b),
                                                        /*for_pipeline=*/true, checksums.computed));
  buffers_.StartWrite(b, ticket);
  run.totals->bytes_written += layout_.chunk(chunk).bytes;
  if (!run.read || run.next >= run.order.size()) return Status::Ok();
  const size_t next_chunk = run.order[run.next];
  Status queued = ReadBehindWrite(next_chunk, b, run.totals);
  if (queued.ok()) {
    ++run.next;
  } else {
    run.failure = std::move(queued).WithContext(ChunkName(next_chunk));
  }
  return Status::Ok();
}

// Releases the reads left unconsumed (only after a failure) and, unless `keep_writes` and the
// run succeeded, waits for every write and frees its buffer. The run's failure, else the first
// failed write's.
Status ChunkPipeline::Drain(RunState& run, bool keep_writes) {
  // One buffer at a time: a transfer stays recorded in its buffer until it is collected.
  while (const std::optional<size_t> b = buffers_.OldestRead()) {
    if (!run.read) {
      buffers_.Release(*b);
      continue;
    }
    // A read behind a write: the failure is already set, so the write's status is not reported.
    if (buffers_[*b].state == BufferState::kWritingThenReading) (void)CollectFollowedWrite(*b);
    ReleaseUnusedRead(*b);
  }
  if (keep_writes && run.failure.ok()) return run.failure;
  const Clock::time_point start = Clock::now();
  Status written = FinishWrites();
  if (!written.ok() && run.failure.ok()) run.failure = std::move(written);
  run.totals->io_wait_seconds += SecondsSince(start);
  return run.failure;
}

Status ChunkPipeline::FinishWrites() {
  Status failure;
  while (const std::optional<size_t> b = buffers_.OldestWrite()) {
    Status written = resources_.io->Wait(buffers_[*b].write_ticket);
    const size_t chunk = buffers_[*b].written_chunk;
    buffers_.CollectWrite(*b);
    if (!written.ok() && failure.ok()) failure = std::move(written).WithContext(ChunkName(chunk));
  }
  return failure;
}

Status ChunkPipeline::ReapWrites() {
  Status failure;
  while (const std::optional<size_t> b = buffers_.OldestWrite()) {
    std::optional<Status> written = resources_.io->Poll(buffers_[*b].write_ticket);
    if (!written.has_value()) break;
    const size_t chunk = buffers_[*b].written_chunk;
    buffers_.CollectWrite(*b);
    if (!written->ok() && failure.ok()) failure = std::move(*written).WithContext(ChunkName(chunk));
  }
  return failure;
}

}  // namespace zoe::offload
