// The chunk I/O of an optimizer group: memory and extents, reads and writes of a chunk's
// state, the pipeline, and the reads AccumulateGrad starts early.
#include <fmt/format.h>

#include <algorithm>
#include <string>
#include <utility>

#include "core/log.h"
#include "offload/optimizer/optimizer_group_impl.h"

namespace zoe::offload {

using detail::Clock;
using detail::SecondsSince;

OptimizerGroup::Impl::~Impl() {
  ResetAccumulation();
  for (const io::Extent& extent : nvme.extents()) {
    Status freed = resources.swap->Free(extent);
    if (!freed.ok()) ZOE_LOG_WARN("optimizer group '{}': {}", name, freed.ToString());
  }
}

std::string OptimizerGroup::Impl::ChunkName(size_t chunk) const {
  const ChunkRegions regions = layout.chunk(chunk);
  return fmt::format("optimizer group '{}': chunk {} (elements [{}, {})) on {}", name, chunk,
                     regions.first, regions.first + regions.count,
                     on_nvme(chunk) ? "NVMe" : "HOST");
}

Status OptimizerGroup::Impl::AllocateState(uint32_t buffer_count, bool speculative) {
  const uint64_t io_block = layout.io_block();
  const io::ChecksumTable* table = nvme_count > 0 ? resources.swap->files().checksums() : nullptr;
  hashing_in_stripes = table != nullptr && table->block_size() == kStripeChecksumBlock;
  const size_t blocks = hashing_in_stripes ? layout.max_chunk_bytes() / kStripeChecksumBlock : 0;
  expected_sums.resize(blocks);
  for (size_t b = 0; b < pipeline_buffers(buffer_count); ++b) {
    ZOE_ASSIGN_OR_RETURN(PinnedBuffer buffer, resources.pinned->Allocate(layout.max_chunk_bytes()));
    buffers.Add(std::move(buffer), blocks);
  }
  for (size_t c = nvme_count; c < layout.chunk_count(); ++c) {
    ZOE_ASSIGN_OR_RETURN(PinnedBuffer buffer, resources.pinned->Allocate(layout.chunk(c).bytes));
    host.push_back(std::move(buffer));
    if (!speculative) continue;
    ZOE_ASSIGN_OR_RETURN(PinnedBuffer spare, resources.pinned->Allocate(layout.chunk(c).bytes));
    host_spare.push_back(std::move(spare));
  }
  nvme.Resize(nvme_count);
  for (size_t c = 0; c < nvme_count; ++c) {
    for (uint8_t s = 0; s < nvme.slot_count(); ++s) {
      Result<io::Extent> extent = resources.swap->Allocate(layout.chunk(c).bytes);
      if (!extent.ok()) return std::move(extent).status().WithContext(ChunkName(c));
      nvme.Assign(c, s, *extent);
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

io::IoRequest OptimizerGroup::Impl::ChunkIoRequest(io::Op op, size_t chunk, uint8_t slot,
                                                   std::byte* buffer, bool for_pipeline,
                                                   std::span<const uint64_t> sums) const {
  const io::Extent& extent = nvme.extent(chunk, slot);
  io::IoRequest request{op, &resources.swap->files(), extent.offset,
                        std::span(buffer, layout.chunk(chunk).bytes)};
  request.caller_verifies = for_pipeline && op == io::Op::kRead && hashing_in_stripes;
  request.caller_sums = sums;
  return request;
}

Result<io::Ticket> OptimizerGroup::Impl::SubmitChunkIo(io::Op op, size_t chunk, uint8_t slot,
                                                       std::byte* buffer, bool for_pipeline,
                                                       std::span<const uint64_t> sums) {
  return resources.io->Submit(ChunkIoRequest(op, chunk, slot, buffer, for_pipeline, sums));
}

Status OptimizerGroup::Impl::ReadChunk(size_t chunk, std::byte* buffer) {
  const std::string context = fmt::format("{}, slot {}", ChunkName(chunk), nvme.live(chunk));
  Result<io::Ticket> ticket = SubmitChunkIo(io::Op::kRead, chunk, nvme.live(chunk), buffer);
  if (!ticket.ok()) return std::move(ticket).status().WithContext(context);
  return resources.io->Wait(*ticket).WithContext(context);
}

// Spans of the chunk's blocks: the sums recorded for its live slot when its state was just read
// from disk (to verify), and the buffer's own (to fill) when `fn_hashes`. A chunk function that
// does not hash does not verify either: its state is verified here, whole, before it runs.
ChunkChecksums OptimizerGroup::Impl::ChecksumsFor(size_t chunk, size_t buffer, bool read_from_disk,
                                                  bool fn_hashes, Status* status) {
  ChunkChecksums checksums;
  if (!hashing_in_stripes) return checksums;
  const size_t blocks = layout.chunk(chunk).bytes / kStripeChecksumBlock;
  const uint8_t slot = nvme.live(chunk);
  const io::ChecksumTable& table = *resources.swap->files().checksums();
  checksums.files = &resources.swap->files();
  checksums.extent_offset = nvme.live_extent(chunk).offset;
  checksums.where = fmt::format("slot {}", slot);
  if (read_from_disk && fn_hashes) {
    checksums.expected = std::span(expected_sums).subspan(0, blocks);
    *status = table.Expected(checksums.extent_offset, std::span(expected_sums).subspan(0, blocks),
                             checksums.where);
  } else if (read_from_disk) {
    *status = VerifyWhole(chunk, buffers.data(buffer));
  }
  if (fn_hashes) checksums.computed = buffers.sums(buffer).subspan(0, blocks);
  return checksums;
}

Status OptimizerGroup::Impl::VerifyWhole(size_t chunk, const std::byte* state) const {
  const uint8_t slot = nvme.live(chunk);
  const io::FileSet& files = resources.swap->files();
  return files.checksums()->Verify(nvme.live_extent(chunk).offset,
                                   std::span(state, layout.chunk(chunk).bytes),
                                   fmt::format("slot {}, read {}", slot, files.Describe()));
}

// A free pipeline buffer; when none is free, the oldest write whose buffer no read took gives
// it back: waited for when `block`, else only if it already completed (nullopt otherwise). A
// failed write is the error; so is finding no buffer at all when `block` (every buffer held by
// reads, which the pipeline never lets happen).
Result<std::optional<size_t>> OptimizerGroup::Impl::TakeBuffer(bool block, Totals* totals) {
  const std::optional<size_t> writer = buffers.OldestFreeingWrite();
  if (!buffers.any_free() && writer) {
    const PipelineBuffer& oldest = buffers[*writer];
    std::optional<Status> done;
    if (block) {
      const Clock::time_point start = Clock::now();
      done = resources.io->Wait(oldest.write_ticket);
      totals->io_wait_seconds += SecondsSince(start);
    } else {
      done = resources.io->Poll(oldest.write_ticket);
    }
    if (!done.has_value()) return std::optional<size_t>();
    const size_t written_chunk = oldest.written_chunk;
    buffers.CollectWrite(*writer);
    if (!done->ok()) return std::move(*done).WithContext(ChunkName(written_chunk));
  }
  if (!buffers.any_free()) {
    if (!block) return std::optional<size_t>();
    return Status::Internal(fmt::format(
        "optimizer group '{}': no pipeline buffer is free or being written ({} buffers)", name,
        buffers.size()));
  }
  return buffers.NewestFree();
}

Status OptimizerGroup::Impl::ReadBehindWrite(size_t chunk, size_t b, Totals* totals) {
  io::IoRequest request = ChunkIoRequest(io::Op::kRead, chunk, nvme.live(chunk), buffers.data(b),
                                         /*for_pipeline=*/true);
  request.after = buffers[b].write_ticket;
  ZOE_ASSIGN_OR_RETURN(io::Ticket ticket, resources.io->Submit(request));
  buffers.QueueReadBehindWrite(b, chunk, nvme.version(chunk), ticket);
  totals->bytes_read += layout.chunk(chunk).bytes;
  return Status::Ok();
}

Status OptimizerGroup::Impl::CollectFollowedWrite(size_t b) {
  const size_t written_chunk = buffers[b].written_chunk;
  const io::Ticket ticket = buffers[b].write_ticket;
  buffers.CollectWrite(b);
  return resources.io->Wait(ticket).WithContext(ChunkName(written_chunk));
}

// The pipeline. NVMe chunks go through the buffers in `order`: reads run ahead as far as free
// buffers allow (the reads AccumulateGrad started come first), `fn` runs on chunk i while the
// reads of the chunks after it and the write of the chunks before it are in flight, and every
// chunk is written to its inactive slot (with one slot, in place). The first error stops the
// pipeline; every transfer still in flight is waited for and every buffer returned before it is
// reported. Slots are not flipped here: the caller flips them once the whole operation
// succeeded. `totals->bytes_written` counts every write submitted, so a caller knows whether a
// failure came after the first write.
Status OptimizerGroup::Impl::RunPipeline(std::span<const size_t> order, bool read,
                                         const ChunkFn& fn, Totals* totals, bool fn_hashes,
                                         bool keep_writes) {
  buffers.ForgetWritten();
  PipelineRun run{order, read, fn, totals, fn_hashes};
  if (read) run.next = AdoptPrefetchedReads(order, totals);
  for (size_t pos = 0; pos < order.size() && run.failure.ok(); ++pos) {
    SubmitReads(run, pos);
    if (run.failure.ok()) ConsumeRead(run);
  }
  return Drain(run, keep_writes);
}

// The prefetched reads of the chunks in `order` become the pipeline's, in the order they started
// (which is the order's); returns how many.
size_t OptimizerGroup::Impl::AdoptPrefetchedReads(std::span<const size_t> order, Totals* totals) {
  std::vector<bool> in_order(nvme_count, false);
  for (size_t c : order) in_order[c] = true;
  size_t adopted = 0;
  for (size_t b : buffers.Prefetched()) {
    const PipelineBuffer& buffer = buffers[b];
    if (!in_order[buffer.chunk]) continue;
    (buffer.read_ticket != 0 ? totals->bytes_read : totals->bytes_reused) +=
        layout.chunk(buffer.chunk).bytes;
    buffers.AdoptPrefetched(b);
    ++adopted;
  }
  return adopted;
}

// Starts reads ahead of chunk `pos` into the free buffers; the read of chunk `pos` itself waits
// for a buffer if none is free.
void OptimizerGroup::Impl::SubmitReads(PipelineRun& run, size_t pos) {
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
void OptimizerGroup::Impl::StartPipelineRead(PipelineRun& run, size_t b) {
  const size_t chunk = run.order[run.next];
  io::Ticket ticket = 0;
  if (run.read) {
    Result<io::Ticket> submitted = SubmitChunkIo(io::Op::kRead, chunk, nvme.live(chunk),
                                                 buffers.data(b), /*for_pipeline=*/true);
    if (!submitted.ok()) {
      buffers.Release(b);
      run.failure = std::move(submitted).status().WithContext(ChunkName(chunk));
      return;
    }
    ticket = *submitted;
    run.totals->bytes_read += layout.chunk(chunk).bytes;
  }
  buffers.StartRead(b, chunk, nvme.version(chunk), ticket);
  ++run.next;
}

// The oldest read: waited for, verified, `fn` run on it, its write submitted (and the next read
// queued behind that write).
void OptimizerGroup::Impl::ConsumeRead(PipelineRun& run) {
  const size_t b = *buffers.OldestRead();
  const size_t chunk = buffers[b].chunk;
  const bool from_disk = run.read && buffers[b].read_ticket != 0;
  Status status = WaitForRead(run, b);
  if (!run.failure.ok()) return;
  buffers.Hold(b);
  // Only a state that came from the disk is verified: one found in a buffer was hashed by the
  // update that produced it and never left memory.
  ChunkChecksums checksums;
  if (status.ok()) checksums = ChecksumsFor(chunk, b, from_disk, run.fn_hashes, &status);
  if (status.ok()) {
    const Clock::time_point start = Clock::now();
    status = run.fn(chunk, buffers.data(b), checksums);
    run.totals->compute_seconds += SecondsSince(start);
  }
  if (status.ok()) status = WriteChunk(run, b, checksums);
  if (!status.ok()) {
    buffers.Release(b);
    run.failure = std::move(status).WithContext(ChunkName(chunk));
  }
}

// The read's status; a read behind a write also collects that write, whose failure (a read
// behind a failed write never started) stops the pipeline.
Status OptimizerGroup::Impl::WaitForRead(PipelineRun& run, size_t b) {
  Status status;
  if (buffers[b].read_ticket != 0) {
    const Clock::time_point start = Clock::now();
    status = resources.io->Wait(buffers[b].read_ticket);
    run.totals->io_wait_seconds += SecondsSince(start);
  }
  if (buffers[b].state != BufferState::kWritingThenReading) return status;
  Status written = CollectFollowedWrite(b);
  if (!written.ok()) {
    buffers.Release(b);
    run.failure = std::move(written);
  }
  return status;
}

// Submits the write of the chunk held in `b`; the read of the next chunk goes behind it at once,
// whatever this thread does meanwhile: a read waiting for a free buffer would otherwise start
// only after the next update. A failed submit is returned; a failed queued read stops the run.
Status OptimizerGroup::Impl::WriteChunk(PipelineRun& run, size_t b,
                                        const ChunkChecksums& checksums) {
  const size_t chunk = buffers[b].chunk;
  ZOE_ASSIGN_OR_RETURN(io::Ticket ticket,
                       SubmitChunkIo(io::Op::kWrite, chunk, nvme.write_slot(chunk), buffers.data(b),
                                     /*for_pipeline=*/true, checksums.computed));
  buffers.StartWrite(b, ticket);
  run.totals->bytes_written += layout.chunk(chunk).bytes;
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
Status OptimizerGroup::Impl::Drain(PipelineRun& run, bool keep_writes) {
  while (const std::optional<size_t> b = buffers.OldestRead()) {
    if (!run.read) {
      buffers.Release(*b);
      continue;
    }
    // A read behind a write: the failure is already set, so the write's status is not reported.
    if (buffers[*b].state == BufferState::kWritingThenReading) (void)CollectFollowedWrite(*b);
    ReleaseUnusedRead(*b);
  }
  if (keep_writes && run.failure.ok()) return run.failure;
  const Clock::time_point start = Clock::now();
  for (size_t b : buffers.Writes()) {
    const size_t written_chunk = buffers[b].written_chunk;
    Status written = resources.io->Wait(buffers[b].write_ticket);
    buffers.CollectWrite(b);
    if (!written.ok() && run.failure.ok()) {
      run.failure = std::move(written).WithContext(ChunkName(written_chunk));
    }
  }
  run.totals->io_wait_seconds += SecondsSince(start);
  return run.failure;
}

Status OptimizerGroup::Impl::BreakIfWritten(Status failure, uint64_t written) {
  if (failure.ok() || !nvme.single_slot() || written == 0 || !broken.ok()) return failure;
  broken = failure;
  ZOE_LOG_ERROR(
      "optimizer group '{}': a single-slot operation failed after writing {} bytes of state in "
      "place; the group refuses further work until a checkpoint is loaded: {}",
      name, written, failure.ToString());
  return failure;
}

Status OptimizerGroup::Impl::CheckUsable(std::string_view what) const {
  if (broken.ok()) return Status::Ok();
  return Status::FailedPrecondition(fmt::format(
      "optimizer group '{}': cannot {}: the group keeps one slot per NVMe chunk and an earlier "
      "operation failed after it began writing the state in place, so the state may be torn; "
      "load a checkpoint to go on (or use two slots, zoe.slots = 2, whose steps are atomic). "
      "The failure: {}",
      name, what, broken.ToString()));
}

void OptimizerGroup::Impl::DropPreparedLoad() {
  if (prepared_load && prepared_load->in_place && broken.ok()) {
    broken = Status::Aborted(fmt::format(
        "optimizer group '{}': a checkpoint load wrote the NVMe chunks in place and was "
        "discarded before it was committed",
        name));
  }
  prepared_load.reset();
}

void OptimizerGroup::Impl::CommitCache() {
  buffers.CommitWritten([&](size_t chunk) { return nvme.version(chunk); });
  descending = !descending;
}

void OptimizerGroup::Impl::ReleaseUnusedRead(size_t b) {
  const PipelineBuffer& read = buffers[b];
  bool usable = read.read_ticket == 0 || resources.io->Wait(read.read_ticket).ok();
  if (!usable || nvme.version(read.chunk) != read.version) {
    buffers.Release(b);
    return;
  }
  // A read the pipeline would have verified is verified before its buffer may serve as a cache:
  // a cached state is used as it is.
  if (read.read_ticket != 0 && hashing_in_stripes) {
    usable = VerifyWhole(read.chunk, buffers.data(b)).ok();
  }
  if (usable) {
    buffers.ReleaseCaching(b);
  } else {
    buffers.Release(b);
  }
}

void OptimizerGroup::Impl::ReleasePrefetched() {
  for (size_t b : buffers.Prefetched()) ReleaseUnusedRead(b);
}

// Drops the accumulated gradients; reads started for them are released (ReleaseUnusedRead).
void OptimizerGroup::Impl::ResetAccumulation() {
  FinishSpeculativeWrites();
  speculation.reset();
  ReleasePrefetched();
  if (!completion_order.empty()) expected_completions.swap(completion_order);
  completion_order.clear();
  accumulated.clear();
  accumulated_elements = 0;
  std::fill(chunk_covered.begin(), chunk_covered.end(), 0);
  std::fill(chunk_present.begin(), chunk_present.end(), 0);
  scanner.Reset();
}

// FailedPrecondition naming the first range no accumulated gradient covers.
Status OptimizerGroup::Impl::CheckCoverage() const {
  size_t covered_to = 0;
  for (const auto& [offset, view] : accumulated) {
    if (offset > covered_to) break;
    covered_to = view.end();
  }
  if (covered_to == count) return Status::Ok();
  auto next = accumulated.upper_bound(covered_to);
  const size_t gap_end = next == accumulated.end() ? count : next->first;
  return Status::FailedPrecondition(fmt::format(
      "optimizer group '{}': step with accumulated gradients that do not cover the group; "
      "elements [{}, {}) are missing (the group has {})",
      name, covered_to, gap_end, count));
}

void OptimizerGroup::Impl::StartPrefetch(size_t chunk) {
  if (!buffers.any_free()) return;  // the step reads it
  const uint64_t version = nvme.version(chunk);
  if (const std::optional<size_t> holder = buffers.FindCached(chunk, version)) {
    buffers.StartPrefetch(*holder, chunk, version, 0);
    return;
  }
  // Keep cached chunks as long as possible: overwrite a buffer that holds none first.
  const size_t b = *buffers.FreeToOverwrite();
  Result<io::Ticket> ticket =
      SubmitChunkIo(io::Op::kRead, chunk, nvme.live(chunk), buffers.data(b), /*for_pipeline=*/true);
  if (!ticket.ok()) return;  // the step reads it again and reports the error
  buffers.StartPrefetch(b, chunk, version, *ticket);
}

bool OptimizerGroup::Impl::IsPrefetched(size_t chunk) const {
  const std::vector<size_t> prefetched = buffers.Prefetched();
  return std::any_of(prefetched.begin(), prefetched.end(),
                     [&](size_t b) { return buffers[b].chunk == chunk; });
}

std::byte* OptimizerGroup::Impl::CachedState(size_t chunk) {
  const std::optional<size_t> holder = buffers.FindCached(chunk, nvme.version(chunk));
  return holder ? buffers.data(*holder) : nullptr;
}

std::byte* OptimizerGroup::Impl::ScratchBuffer() {
  const size_t b = *buffers.FreeToOverwrite();
  buffers.DropCache(b);
  return buffers.data(b);
}

void OptimizerGroup::Impl::StartStepReads(const std::vector<bool>& present_chunks) {
  ClaimCachedChunks();
  std::vector<bool> wanted = present_chunks;
  for (size_t b : buffers.Prefetched()) wanted[buffers[b].chunk] = false;
  for (size_t c : ChunksInDirection(wanted, nvme_count, descending)) {
    if (!buffers.any_free()) return;
    StartPrefetch(c);
  }
}

void OptimizerGroup::Impl::ClaimCachedChunks() {
  for (size_t i = 0; i < nvme_count; ++i) {
    const size_t c = descending ? nvme_count - 1 - i : i;
    if (buffers.FindCached(c, nvme.version(c))) StartPrefetch(c);
  }
}

// FailedPrecondition while gradients are accumulated: their reads hold pipeline buffers and
// their step expects the state they were read from.
Status OptimizerGroup::Impl::CheckIdle(std::string_view what) const {
  if (accumulated.empty()) return Status::Ok();
  return Status::FailedPrecondition(fmt::format(
      "optimizer group '{}': cannot {} while {} accumulated gradient views wait for a step", name,
      what, accumulated.size()));
}

}  // namespace zoe::offload
