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
  for (NvmeChunk& chunk : nvme) {
    for (const io::Extent& extent : chunk.slots) {
      if (extent.length == 0) continue;
      Status freed = resources.swap->Free(extent);
      if (!freed.ok()) ZOE_LOG_WARN("optimizer group '{}': {}", name, freed.ToString());
    }
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
  for (size_t b = 0; b < pipeline_buffers(buffer_count); ++b) {
    ZOE_ASSIGN_OR_RETURN(PinnedBuffer buffer, resources.pinned->Allocate(layout.max_chunk_bytes()));
    buffers.push_back(std::move(buffer));
    free_buffers.push_back(b);
  }
  cached.resize(buffers.size());
  last_written.resize(buffers.size());
  const io::ChecksumTable* table = nvme_count > 0 ? resources.swap->files().checksums() : nullptr;
  hashing_in_stripes = table != nullptr && table->block_size() == kStripeChecksumBlock;
  if (hashing_in_stripes) {
    const size_t blocks = layout.max_chunk_bytes() / kStripeChecksumBlock;
    buffer_sums.assign(buffers.size(), std::vector<uint64_t>(blocks));
    expected_sums.resize(blocks);
  }
  prefetched.reserve(buffers.size());
  speculative_writes.reserve(buffers.size());
  held_reads.reserve(buffers.size());
  for (size_t c = nvme_count; c < layout.chunk_count(); ++c) {
    ZOE_ASSIGN_OR_RETURN(PinnedBuffer buffer, resources.pinned->Allocate(layout.chunk(c).bytes));
    host.push_back(std::move(buffer));
    if (!speculative) continue;
    ZOE_ASSIGN_OR_RETURN(PinnedBuffer spare, resources.pinned->Allocate(layout.chunk(c).bytes));
    host_spare.push_back(std::move(spare));
  }
  nvme.resize(nvme_count);
  for (size_t c = 0; c < nvme_count; ++c) {
    for (uint32_t s = 0; s < slot_count; ++s) {
      io::Extent& slot = nvme[c].slots[s];
      Result<io::Extent> extent = resources.swap->Allocate(layout.chunk(c).bytes);
      if (!extent.ok()) return std::move(extent).status().WithContext(ChunkName(c));
      slot = *extent;
      if (slot.offset % io_block != 0) {
        return Status::InvalidArgument(fmt::format(
            "{}: swap extent at offset {} is not aligned to the {}-byte checksum block; create "
            "the swap space with an alignment that is a multiple of it",
            ChunkName(c), slot.offset, io_block));
      }
    }
  }
  return Status::Ok();
}

io::IoRequest OptimizerGroup::Impl::ChunkIoRequest(io::Op op, size_t chunk, uint8_t slot,
                                                   std::byte* buffer, bool for_pipeline,
                                                   std::span<const uint64_t> sums) const {
  const io::Extent& extent = nvme[chunk].slots[slot];
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
  const std::string context = fmt::format("{}, slot {}", ChunkName(chunk), nvme[chunk].live);
  Result<io::Ticket> ticket = SubmitChunkIo(io::Op::kRead, chunk, nvme[chunk].live, buffer);
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
  const uint8_t slot = nvme[chunk].live;
  const io::ChecksumTable& table = *resources.swap->files().checksums();
  checksums.files = &resources.swap->files();
  checksums.extent_offset = nvme[chunk].slots[slot].offset;
  checksums.where = fmt::format("slot {}", slot);
  if (read_from_disk && fn_hashes) {
    checksums.expected = std::span(expected_sums).subspan(0, blocks);
    *status = table.Expected(checksums.extent_offset, std::span(expected_sums).subspan(0, blocks),
                             checksums.where);
  } else if (read_from_disk) {
    *status = VerifyWhole(chunk, buffers[buffer].data());
  }
  if (fn_hashes) checksums.computed = std::span(buffer_sums[buffer]).subspan(0, blocks);
  return checksums;
}

Status OptimizerGroup::Impl::VerifyWhole(size_t chunk, const std::byte* state) const {
  const uint8_t slot = nvme[chunk].live;
  const io::FileSet& files = resources.swap->files();
  return files.checksums()->Verify(nvme[chunk].slots[slot].offset,
                                   std::span(state, layout.chunk(chunk).bytes),
                                   fmt::format("slot {}, read {}", slot, files.Describe()));
}

// A free pipeline buffer; when none is free, the oldest write whose buffer no read took
// (!handed_on) gives it back: waited for when `block`, else only if it already completed
// (nullopt otherwise). A failed write is the error; so is finding no buffer at all when `block`
// (every buffer held by reads, which the pipeline never lets happen).
Result<std::optional<size_t>> OptimizerGroup::Impl::TakeBuffer(InFlightList& writing, bool block,
                                                               Totals* totals) {
  const auto oldest_freeing =
      std::find_if(writing.begin(), writing.end(), [](const InFlight& w) { return !w.handed_on; });
  if (free_buffers.empty() && oldest_freeing != writing.end()) {
    const InFlight oldest = *oldest_freeing;
    std::optional<Status> done;
    if (block) {
      const Clock::time_point start = Clock::now();
      done = resources.io->Wait(oldest.ticket);
      totals->io_wait_seconds += SecondsSince(start);
    } else {
      done = resources.io->Poll(oldest.ticket);
    }
    if (!done.has_value()) return std::optional<size_t>();
    writing.erase(oldest_freeing);
    free_buffers.push_back(oldest.buffer);
    if (!done->ok()) return std::move(*done).WithContext(ChunkName(oldest.chunk));
  }
  if (free_buffers.empty()) {
    if (!block) return std::optional<size_t>();
    return Status::Internal(fmt::format(
        "optimizer group '{}': no pipeline buffer is free or being written ({} buffers)", name,
        buffers.size()));
  }
  const size_t buffer = free_buffers.back();
  free_buffers.pop_back();
  cached[buffer].reset();
  return std::optional<size_t>(buffer);
}

Status OptimizerGroup::Impl::ReadBehindWrite(size_t chunk, InFlight& write, InFlightList& reading,
                                             Totals* totals) {
  io::IoRequest request = ChunkIoRequest(io::Op::kRead, chunk, nvme[chunk].live,
                                         buffers[write.buffer].data(), /*for_pipeline=*/true);
  request.after = write.ticket;
  ZOE_ASSIGN_OR_RETURN(io::Ticket ticket, resources.io->Submit(request));
  reading.push_back({chunk, write.buffer, ticket, nvme[chunk].version, write.ticket});
  write.handed_on = true;
  last_written[write.buffer].reset();
  cached[write.buffer].reset();
  totals->bytes_read += layout.chunk(chunk).bytes;
  return Status::Ok();
}

Status OptimizerGroup::Impl::CollectFollowedWrite(const InFlight& read, InFlightList& writing) {
  const auto write = std::find_if(writing.begin(), writing.end(),
                                  [&](const InFlight& w) { return w.ticket == read.follows; });
  if (write == writing.end()) {
    return Status::Internal(ChunkName(read.chunk) + ": its read follows a write not in flight");
  }
  const InFlight written = *write;
  writing.erase(write);
  return resources.io->Wait(written.ticket).WithContext(ChunkName(written.chunk));
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
                                         InFlightList* carried) {
  InFlightList reading;
  reading.reserve(buffers.size());
  if (read) reading.swap(prefetched);
  for (const InFlight& entry : reading) {
    (entry.ticket != 0 ? totals->bytes_read : totals->bytes_reused) +=
        layout.chunk(entry.chunk).bytes;
  }
  std::fill(last_written.begin(), last_written.end(), std::nullopt);
  InFlightList writing;
  writing.reserve(buffers.size());
  if (carried != nullptr) writing.swap(*carried);
  size_t next = reading.size();
  Status failure;
  for (size_t pos = 0; pos < order.size() && failure.ok(); ++pos) {
    while (next < order.size()) {
      Result<std::optional<size_t>> buffer = TakeBuffer(writing, next == pos, totals);
      if (!buffer.ok()) {
        failure = std::move(buffer).status();
        break;
      }
      if (!buffer->has_value()) break;
      InFlight entry{order[next], **buffer, 0, nvme[order[next]].version};
      if (read) {
        Result<io::Ticket> ticket =
            SubmitChunkIo(io::Op::kRead, entry.chunk, nvme[entry.chunk].live,
                          buffers[entry.buffer].data(), /*for_pipeline=*/true);
        if (!ticket.ok()) {
          free_buffers.push_back(entry.buffer);
          failure = std::move(ticket).status().WithContext(ChunkName(entry.chunk));
          break;
        }
        entry.ticket = *ticket;
        totals->bytes_read += layout.chunk(entry.chunk).bytes;
      }
      reading.push_back(entry);
      ++next;
    }
    if (!failure.ok()) break;
    const InFlight entry = reading.front();
    reading.erase(reading.begin());
    std::byte* state = buffers[entry.buffer].data();
    Status status;
    if (entry.ticket != 0) {
      const Clock::time_point start = Clock::now();
      status = resources.io->Wait(entry.ticket);
      totals->io_wait_seconds += SecondsSince(start);
    }
    if (entry.follows != 0) {
      // A read behind a failed write never started: the write's failure is the one to report.
      Status written = CollectFollowedWrite(entry, writing);
      if (!written.ok()) {
        free_buffers.push_back(entry.buffer);
        failure = std::move(written);
        break;
      }
    }
    // Only a state that came from the disk is verified: one found in a buffer was hashed by the
    // update that produced it and never left memory.
    ChunkChecksums checksums;
    if (status.ok()) {
      checksums =
          ChecksumsFor(entry.chunk, entry.buffer, read && entry.ticket != 0, fn_hashes, &status);
    }
    if (status.ok()) {
      const Clock::time_point start = Clock::now();
      status = fn(entry.chunk, state, checksums);
      totals->compute_seconds += SecondsSince(start);
    }
    if (status.ok()) {
      Result<io::Ticket> ticket =
          SubmitChunkIo(io::Op::kWrite, entry.chunk, WriteSlot(entry.chunk), state,
                        /*for_pipeline=*/true, checksums.computed);
      if (ticket.ok()) {
        writing.push_back({entry.chunk, entry.buffer, *ticket});
        last_written[entry.buffer] = entry.chunk;
        totals->bytes_written += layout.chunk(entry.chunk).bytes;
        // The next read goes behind this write at once, whatever this thread does meanwhile: a
        // read waiting for a free buffer would otherwise start only after the next update.
        if (read && next < order.size()) {
          Status queued = ReadBehindWrite(order[next], writing.back(), reading, totals);
          if (queued.ok()) {
            ++next;
          } else {
            failure = std::move(queued).WithContext(ChunkName(order[next]));
          }
        }
      } else {
        status = std::move(ticket).status();
      }
    }
    if (!status.ok()) {
      free_buffers.push_back(entry.buffer);
      failure = std::move(status).WithContext(ChunkName(entry.chunk));
    }
  }
  for (const InFlight& entry : reading) {
    if (read) {
      ReleaseUnusedRead(entry);
    } else {
      free_buffers.push_back(entry.buffer);
    }
  }
  if (carried != nullptr && failure.ok()) {
    carried->swap(writing);
    return failure;
  }
  const Clock::time_point start = Clock::now();
  for (const InFlight& entry : writing) {
    Status written = resources.io->Wait(entry.ticket);
    if (!entry.handed_on) free_buffers.push_back(entry.buffer);
    if (!written.ok() && failure.ok()) {
      failure = std::move(written).WithContext(ChunkName(entry.chunk));
    }
  }
  totals->io_wait_seconds += SecondsSince(start);
  return failure;
}

void OptimizerGroup::Impl::Flip(std::span<const size_t> chunks) {
  for (size_t c : chunks) {
    if (slot_count == 2) nvme[c].live ^= 1;
    ++nvme[c].version;
  }
}

Status OptimizerGroup::Impl::BreakIfWritten(Status failure, uint64_t written) {
  if (failure.ok() || slot_count != 1 || written == 0 || !broken.ok()) return failure;
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
  for (size_t b = 0; b < buffers.size(); ++b) {
    if (last_written[b]) cached[b] = CachedChunk{*last_written[b], nvme[*last_written[b]].version};
  }
  descending = !descending;
}

void OptimizerGroup::Impl::ReleaseUnusedRead(const InFlight& read) {
  bool usable = read.ticket == 0 || resources.io->Wait(read.ticket).ok();
  free_buffers.push_back(read.buffer);
  if (!usable || nvme[read.chunk].version != read.version) return;
  // A read the pipeline would have verified is verified before its buffer may serve as a cache:
  // a cached state is used as it is.
  if (read.ticket != 0 && hashing_in_stripes) {
    usable = VerifyWhole(read.chunk, buffers[read.buffer].data()).ok();
  }
  if (usable) cached[read.buffer] = CachedChunk{read.chunk, read.version};
}

void OptimizerGroup::Impl::ReleasePrefetched() {
  for (const InFlight& entry : prefetched) ReleaseUnusedRead(entry);
  prefetched.clear();
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

// The order a step visits NVMe chunks: those already claimed (still cached, or read early; all
// present, ReleaseAbsentReads released the others), then the rest of the present ones in this
// step's direction.
std::vector<size_t> OptimizerGroup::Impl::StepOrder(const std::vector<bool>& present) const {
  std::vector<size_t> order;
  std::vector<bool> listed(nvme_count, false);
  for (const InFlight& entry : prefetched) {
    order.push_back(entry.chunk);
    listed[entry.chunk] = true;
  }
  for (size_t i = 0; i < nvme_count; ++i) {
    const size_t c = descending ? nvme_count - 1 - i : i;
    if (!listed[c] && present[c]) order.push_back(c);
  }
  return order;
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
  if (free_buffers.empty()) return;  // the step reads it
  auto holder = std::find_if(free_buffers.begin(), free_buffers.end(), [&](size_t b) {
    return cached[b] && cached[b]->Holds(chunk, nvme[chunk].version);
  });
  if (holder != free_buffers.end()) {
    const size_t buffer = *holder;
    free_buffers.erase(holder);
    cached[buffer].reset();
    prefetched.push_back({chunk, buffer, 0, nvme[chunk].version});
    return;
  }
  // Keep cached chunks as long as possible: overwrite a buffer that holds none first.
  auto empty = std::find_if(free_buffers.begin(), free_buffers.end(),
                            [&](size_t b) { return !cached[b].has_value(); });
  auto taken = empty != free_buffers.end() ? empty : free_buffers.begin();
  const size_t buffer = *taken;
  Result<io::Ticket> ticket = SubmitChunkIo(io::Op::kRead, chunk, nvme[chunk].live,
                                            buffers[buffer].data(), /*for_pipeline=*/true);
  if (!ticket.ok()) return;  // the step reads it again and reports the error
  free_buffers.erase(taken);
  cached[buffer].reset();
  prefetched.push_back({chunk, buffer, *ticket, nvme[chunk].version});
}

bool OptimizerGroup::Impl::IsPrefetched(size_t chunk) const {
  return std::any_of(prefetched.begin(), prefetched.end(),
                     [&](const InFlight& entry) { return entry.chunk == chunk; });
}

std::byte* OptimizerGroup::Impl::CachedState(size_t chunk) {
  for (size_t b : free_buffers) {
    if (cached[b] && cached[b]->Holds(chunk, nvme[chunk].version)) return buffers[b].data();
  }
  return nullptr;
}

std::byte* OptimizerGroup::Impl::ScratchBuffer() {
  auto empty = std::find_if(free_buffers.begin(), free_buffers.end(),
                            [&](size_t b) { return !cached[b].has_value(); });
  const size_t buffer = empty != free_buffers.end() ? *empty : free_buffers.front();
  cached[buffer].reset();
  return buffers[buffer].data();
}

void OptimizerGroup::Impl::StartStepReads(const std::vector<bool>& present_chunks) {
  ClaimCachedChunks();
  std::vector<bool> claimed(nvme_count, false);
  for (const InFlight& entry : prefetched) claimed[entry.chunk] = true;
  for (size_t i = 0; i < nvme_count && !free_buffers.empty(); ++i) {
    const size_t c = descending ? nvme_count - 1 - i : i;
    if (!claimed[c] && present_chunks[c]) StartPrefetch(c);
  }
}

void OptimizerGroup::Impl::ClaimCachedChunks() {
  for (size_t i = 0; i < nvme_count; ++i) {
    const size_t c = descending ? nvme_count - 1 - i : i;
    const bool held = std::any_of(free_buffers.begin(), free_buffers.end(), [&](size_t b) {
      return cached[b] && cached[b]->Holds(c, nvme[c].version);
    });
    if (held) StartPrefetch(c);
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
