#include "io/queue.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <string>
#include <thread>

#include "core/aligned_buffer.h"
#include "core/log.h"

namespace zoe::io {
namespace {

// Linux transfers at most 0x7ffff000 bytes per call; pieces stay well below.
constexpr uint64_t kMaxPieceBytes = uint64_t{1} << 30;

std::string PieceContext(Op op, const File& file, uint64_t offset, uint64_t length) {
  return fmt::format("{} {} at offset {} ({} bytes)", OpName(op), file.path(), offset, length);
}

Status CheckAlignment(const IoRequest& request, const FileSet::Piece& piece,
                      const std::byte* data) {
  const File& file = *piece.file;
  if (!file.direct()) return Status::Ok();
  const bool memory_ok = IsAligned(data, file.mem_align());
  const bool offset_ok = IsAligned(piece.file_offset, file.offset_align());
  const bool length_ok = IsAligned(piece.length, file.offset_align());
  if (memory_ok && offset_ok && length_ok) return Status::Ok();
  return Status::InvalidArgument(fmt::format(
      "{}: O_DIRECT needs the buffer address aligned to {} B and the offset and length to {} B; "
      "got buffer {} (misaligned: {}), offset {} ({}), length {} ({})",
      PieceContext(request.op, file, piece.file_offset, piece.length), file.mem_align(),
      file.offset_align(), static_cast<const void*>(data), memory_ok ? "no" : "yes",
      piece.file_offset, offset_ok ? "aligned" : "misaligned", piece.length,
      length_ok ? "aligned" : "misaligned"));
}

// Waits before the next attempt after the engine accepted nothing with nothing in flight:
// 50 us doubling per retry, at most 1.6 ms (max_retries = 16 spends about 20 ms in all).
void BackOff(uint32_t retry) {
  const uint32_t doublings = std::min<uint32_t>(retry > 0 ? retry - 1 : 0, 5);
  std::this_thread::sleep_for(std::chrono::microseconds(50u << doublings));
}

}  // namespace

std::string_view OpName(Op op) { return op == Op::kRead ? "read" : "write"; }

IoQueue::IoQueue(std::unique_ptr<Engine> engine, QueueOptions options)
    : engine_(std::move(engine)), options_(std::move(options)) {
  const uint32_t depth = engine_->queue_depth();
  slots_.resize(depth);
  for (uint32_t i = depth; i > 0; --i) free_slots_.push_back(i - 1);
  batch_.reserve(depth);
  completions_.resize(depth);
  reaper_ = std::thread([this] { ReapLoop(); });
}

Result<std::unique_ptr<IoQueue>> IoQueue::Create(std::unique_ptr<Engine> engine,
                                                 QueueOptions options) {
  if (engine == nullptr) return Status::InvalidArgument("IoQueue needs an engine");
  if (engine->queue_depth() == 0) return Status::InvalidArgument("engine queue depth must be >= 1");
  return std::unique_ptr<IoQueue>(new IoQueue(std::move(engine), std::move(options)));
}

IoQueue::~IoQueue() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  work_.notify_all();
  reaper_.join();
}

Status IoQueue::Validate(const IoRequest& request, std::vector<FileSet::Piece>* pieces) const {
  if (request.files == nullptr) return Status::InvalidArgument("I/O request without a file set");
  if (request.buffer.empty()) {
    return Status::InvalidArgument(fmt::format("{} {} at offset {}: length must be > 0 bytes",
                                               OpName(request.op), request.files->Describe(),
                                               request.offset));
  }
  if (const ChecksumTable* sums = request.files->checksums()) {
    const std::string where = fmt::format("{} {}", OpName(request.op), request.files->Describe());
    ZOE_RETURN_IF_ERROR(sums->CheckCovers(request.offset, request.buffer.size(), where));
    const bool sums_match = request.caller_sums.empty() ||
                            (request.op == Op::kWrite &&
                             request.caller_sums.size() == sums->BlocksIn(request.buffer.size()));
    if (!sums_match) {
      return Status::InvalidArgument(fmt::format(
          "{} at offset {}: {} caller checksums for {} blocks of {} bytes (writes only)", where,
          request.offset, request.caller_sums.size(), sums->BlocksIn(request.buffer.size()),
          sums->block_size()));
    }
    if (request.caller_verifies && request.op != Op::kRead) {
      return Status::InvalidArgument(
          fmt::format("{} at offset {}: caller_verifies is for reads", where, request.offset));
    }
  }
  const size_t first = pieces->size();
  request.files->Map(request.offset, request.buffer.size(), pieces);
  for (size_t i = first; i < pieces->size(); ++i) {
    const FileSet::Piece& piece = (*pieces)[i];
    ZOE_RETURN_IF_ERROR(CheckAlignment(
        request, piece, request.buffer.data() + (piece.logical_offset - request.offset)));
  }
  return Status::Ok();
}

Result<Ticket> IoQueue::Submit(const IoRequest& request) {
  std::vector<Ticket> tickets;
  ZOE_RETURN_IF_ERROR(SubmitBatch(std::span(&request, 1), &tickets));
  return tickets.front();
}

Status IoQueue::SubmitBatch(std::span<const IoRequest> requests, std::vector<Ticket>* tickets) {
  std::vector<FileSet::Piece> pieces;
  std::vector<size_t> ends;  // pieces of request i are [ends[i-1], ends[i])
  for (const IoRequest& request : requests) {
    ZOE_RETURN_IF_ERROR(Validate(request, &pieces));
    ends.push_back(pieces.size());
  }
  std::unique_lock lock(mutex_);
  if (stopping_) return Status::FailedPrecondition("I/O queue is shutting down");
  if (!broken_.ok()) return broken_;
  for (const IoRequest& request : requests) ZOE_RETURN_IF_ERROR(CheckFollowed(request));
  const bool was_idle = in_flight_ == 0;
  // Requests the engine refused outright, and those following a request that already failed.
  std::vector<TicketState*> finished;
  size_t begin = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    const Ticket ticket = next_ticket_++;
    Enqueue(requests[i], {pieces.begin() + begin, pieces.begin() + ends[i]}, ticket, &finished);
    tickets->push_back(ticket);
    begin = ends[i];
  }
  stats_.requests += requests.size();
  Pump(&finished);
  const bool wake = was_idle && in_flight_ > 0;
  Finalize(&finished, lock);
  lock.unlock();
  if (wake) work_.notify_one();
  return Status::Ok();
}

// The ticket a request follows must be one still known to the queue (issued, not collected).
// Called with the mutex held.
Status IoQueue::CheckFollowed(const IoRequest& request) const {
  if (request.after == 0 || tickets_.contains(request.after)) return Status::Ok();
  return Status::InvalidArgument(fmt::format(
      "{} {} at offset {}: follows I/O ticket {}, which is unknown (never issued or already "
      "collected); allowed: 0 or a ticket not yet waited for",
      OpName(request.op), request.files->Describe(), request.offset, request.after));
}

namespace {

// The status of a request that follows one which failed: the same code, naming both.
Status NotStarted(const IoRequest& request, const Status& followed) {
  return Status(followed).WithContext(
      fmt::format("{} {} at offset {} not started: the request it follows failed",
                  OpName(request.op), request.files->Describe(), request.offset));
}

}  // namespace

// Splits the request's pieces into transfers of at most kMaxPieceBytes and queues them, or holds
// them while the request it follows is pending. One following a request that already failed
// fails at once (added to `finished`). Called with the mutex held.
void IoQueue::Enqueue(const IoRequest& request, const std::vector<FileSet::Piece>& pieces,
                      Ticket ticket, std::vector<TicketState*>* finished) {
  TicketState& state = tickets_[ticket];
  state.ticket = ticket;
  state.request = request;
  TicketState* followed = request.after != 0 ? &tickets_.at(request.after) : nullptr;
  if (followed != nullptr) ++stats_.followers;
  if (followed != nullptr && followed->done && !followed->status.ok()) {
    state.status = NotStarted(request, followed->status);
    finished->push_back(&state);
    return;
  }
  const bool hold = followed != nullptr && !followed->done;
  for (const FileSet::Piece& piece : pieces) {
    std::byte* data = request.buffer.data() + (piece.logical_offset - request.offset);
    for (uint64_t done = 0; done < piece.length; done += kMaxPieceBytes) {
      const uint64_t length = std::min(kMaxPieceBytes, piece.length - done);
      const Piece transfer{ticket,      request.op, piece.file, piece.file_offset + done,
                           data + done, length,     0};
      if (hold) {
        state.held.push_back(transfer);
      } else {
        queued_.push_back(transfer);
      }
      ++state.pieces_left;
    }
  }
  if (hold) {
    followed->followers.push_back(ticket);
    ++held_requests_;
  }
}

// Queues the held pieces of the requests that follow `state` (done) if it succeeded; otherwise
// fails them without starting (added to `finished`). Called with the mutex held.
void IoQueue::ReleaseFollowers(TicketState& state, std::vector<TicketState*>* finished) {
  for (Ticket ticket : state.followers) {
    TicketState& follower = tickets_.at(ticket);
    --held_requests_;
    if (state.status.ok()) {
      queued_.insert(queued_.end(), follower.held.begin(), follower.held.end());
    } else {
      follower.pieces_left = 0;
      follower.status = NotStarted(follower.request, state.status);
      finished->push_back(&follower);
    }
    follower.held.clear();
  }
  state.followers.clear();
}

// Hands queued pieces to the engine while there is room: everything that fits goes in one
// Submit call, so a batch of contiguous requests reaches the block layer together. Called with
// the mutex held; the back-off after a refusal with nothing in flight sleeps with it held (rare
// and brief: at most max_retries sleeps of at most 1.6 ms each).
void IoQueue::Pump(std::vector<TicketState*>* finished) {
  if (!broken_.ok()) {  // nothing more goes to an engine that could not be reaped
    while (!queued_.empty()) {
      const Piece piece = queued_.front();
      queued_.pop_front();
      FailPiece(piece, broken_, finished);
    }
    return;
  }
  while (!queued_.empty() && !free_slots_.empty()) {
    batch_.clear();
    const size_t n = std::min(queued_.size(), free_slots_.size());
    for (size_t i = 0; i < n; ++i) {
      const Piece& piece = queued_[i];
      batch_.push_back(RawRequest{piece.op, piece.file->fd(), piece.offset, piece.buffer,
                                  static_cast<uint32_t>(piece.length),
                                  free_slots_[free_slots_.size() - 1 - i]});
    }
    Result<size_t> accepted = engine_->Submit(batch_);
    ++stats_.engine_submits;
    const size_t count = accepted.ok() ? *accepted : 0;
    for (size_t i = 0; i < count; ++i) {
      slots_[free_slots_.back()] = queued_.front();
      free_slots_.pop_back();
      queued_.pop_front();
    }
    in_flight_ += static_cast<uint32_t>(count);
    stats_.pieces += count;
    if (count > 0) continue;
    if (in_flight_ > 0 && accepted.ok()) break;  // the engine is full: completions make room
    // Nothing accepted and nothing in flight whose completion would trigger another attempt.
    // Accepting nothing without an error means the kernel is short of resources for now (libaio
    // EAGAIN): back off briefly and try again, counting against the first piece's retries.
    Piece& first = queued_.front();
    if (accepted.ok() && ++first.retries <= options_.max_retries) {
      ++stats_.retries;
      BackOff(first.retries);
      continue;
    }
    const Piece failed = first;
    queued_.pop_front();
    Status status =
        accepted.ok()
            ? Status::IoError(fmt::format("{} accepted no request with none in flight after {} "
                                          "retries (short of resources)",
                                          engine_->name(), failed.retries - 1),
                              EAGAIN)
            : std::move(accepted).status();
    FailPiece(failed,
              std::move(status).WithContext(
                  PieceContext(failed.op, *failed.file, failed.offset, failed.length)),
              finished);
  }
}

void IoQueue::FailPiece(const Piece& piece, Status status, std::vector<TicketState*>* finished) {
  TicketState& state = tickets_.at(piece.ticket);
  if (state.status.ok()) state.status = std::move(status);
  PieceDone(piece.ticket, finished);
}

void IoQueue::PieceDone(Ticket ticket, std::vector<TicketState*>* finished) {
  TicketState& state = tickets_.at(ticket);
  if (--state.pieces_left == 0) finished->push_back(&state);
}

// Interprets one raw result: done, the rest of a short transfer, a retry, or a failure.
void IoQueue::HandleCompletion(const RawCompletion& completion,
                               std::vector<TicketState*>* finished) {
  const uint32_t slot = static_cast<uint32_t>(completion.tag);
  Piece piece = slots_[slot];
  free_slots_.push_back(slot);
  --in_flight_;
  const int64_t result = completion.result;
  if (piece.op == Op::kWrite && result > 0) {
    piece.file->CountWritten(std::min(static_cast<uint64_t>(result), piece.length));
  }
  if (result == static_cast<int64_t>(piece.length)) return PieceDone(piece.ticket, finished);
  const std::string context = PieceContext(piece.op, *piece.file, piece.offset, piece.length);
  if (result == -EINTR || result == -EAGAIN || (result == 0 && piece.op == Op::kWrite)) {
    if (++piece.retries > options_.max_retries) {
      Status status =
          result == 0
              ? Status::IoError(context + ": no progress after " +
                                std::to_string(piece.retries - 1) + " retries")
              : Status::FromErrno(
                    result, context + " after " + std::to_string(piece.retries - 1) + " retries");
      return FailPiece(piece, std::move(status), finished);
    }
    ++stats_.retries;
    queued_.push_front(piece);
    return;
  }
  if (result < 0) return FailPiece(piece, Status::FromErrno(result, context), finished);
  if (result == 0) return FailPiece(piece, Status::IoError(context + ": end of file"), finished);
  if (result > static_cast<int64_t>(piece.length)) {
    return FailPiece(
        piece, Status::Internal(context + ": engine reported " + std::to_string(result) + " bytes"),
        finished);
  }
  // Short transfer: resubmit the rest, ahead of newer work.
  const uint64_t moved = static_cast<uint64_t>(result);
  piece.offset += moved;
  piece.buffer += moved;
  piece.length -= moved;
  ++stats_.short_transfers;
  queued_.push_front(piece);
}

// Records or verifies checksums and runs the completion callback outside the lock, then marks
// the tickets done and releases the requests that follow them (which may finish in turn, without
// starting). The states stay put meanwhile: only a done ticket is ever erased.
void IoQueue::Finalize(std::vector<TicketState*>* finished, std::unique_lock<std::mutex>& lock) {
  while (!finished->empty()) FinalizeRound(finished, lock);
}

void IoQueue::FinalizeRound(std::vector<TicketState*>* finished,
                            std::unique_lock<std::mutex>& lock) {
  lock.unlock();
  for (TicketState* state : *finished) {
    const IoRequest& request = state->request;
    ChecksumTable* sums = request.files->checksums();
    if (sums == nullptr || !state->status.ok()) continue;
    if (request.op == Op::kWrite && !request.caller_sums.empty()) {
      sums->RecordSums(request.offset, request.caller_sums);
    } else if (request.op == Op::kWrite) {
      sums->Record(request.offset, request.buffer);
    } else if (!request.caller_verifies) {
      state->status =
          sums->Verify(request.offset, request.buffer, "read " + request.files->Describe());
    }
  }
  if (options_.on_complete) {
    for (TicketState* state : *finished) options_.on_complete(state->ticket, state->status);
  }
  lock.lock();
  std::vector<TicketState*> failed_followers;
  for (TicketState* state : *finished) {
    state->done = true;
    ReleaseFollowers(*state, &failed_followers);
  }
  Pump(&failed_followers);
  finished->swap(failed_followers);
  done_.notify_all();
  if (in_flight_ > 0) work_.notify_all();  // released followers went in flight
}

// One round of reaping by the thread holding the reaping turn (reaping_): waits for at least one
// completion outside the lock, interprets what arrived, refills the engine and finishes the
// requests that are complete. Called with the lock held, reaping_ false and requests in flight.
void IoQueue::ReapOnce(std::unique_lock<std::mutex>& lock) {
  reaping_ = true;
  lock.unlock();
  Result<size_t> reaped = engine_->Reap(completions_, 1);
  lock.lock();
  reaping_ = false;
  std::vector<TicketState*> finished;
  if (reaped.ok()) {
    reap_failures_ = 0;
    for (size_t i = 0; i < *reaped; ++i) HandleCompletion(completions_[i], &finished);
    Pump(&finished);
  } else {
    ReapFailed(std::move(reaped).status(), lock, &finished);
  }
  // The turn is free again: a waiting caller or the reaping thread may take it.
  work_.notify_all();
  done_.notify_all();
  Finalize(&finished, lock);
}

// The requests are still owned by the kernel, so a failed reap is retried after a back-off; after
// max_reap_failures in a row the engine is given up on (AbandonAll). Called with the lock held.
void IoQueue::ReapFailed(Status status, std::unique_lock<std::mutex>& lock,
                         std::vector<TicketState*>* finished) {
  ++reap_failures_;
  ZOE_LOG_ERROR("io: reaping completions from {} failed ({} of {} in a row): {}", engine_->name(),
                reap_failures_, options_.max_reap_failures, status.ToString());
  if (reap_failures_ < options_.max_reap_failures) {
    const uint32_t doublings = std::min<uint32_t>(reap_failures_ - 1, 7);
    lock.unlock();
    std::this_thread::sleep_for(std::chrono::milliseconds(1u << doublings));
    lock.lock();
    return;
  }
  broken_ = std::move(status).WithContext(fmt::format(
      "reaping completions from {} failed {} times in a row; the requests in flight were "
      "abandoned and this I/O queue accepts no more",
      engine_->name(), reap_failures_));
  AbandonAll(broken_, finished);
}

// Fails every request with a piece in flight or queued (those following them fail when they are
// finalized). The in-flight count drops to zero so that waiters and the destructor return.
void IoQueue::AbandonAll(const Status& status, std::vector<TicketState*>* finished) {
  std::vector<bool> free(slots_.size(), false);
  for (const uint32_t slot : free_slots_) free[slot] = true;
  std::vector<Ticket> abandoned;
  for (uint32_t slot = 0; slot < slots_.size(); ++slot) {
    if (!free[slot]) abandoned.push_back(slots_[slot].ticket);
  }
  for (const Piece& piece : queued_) abandoned.push_back(piece.ticket);
  queued_.clear();
  in_flight_ = 0;
  std::sort(abandoned.begin(), abandoned.end());
  abandoned.erase(std::unique(abandoned.begin(), abandoned.end()), abandoned.end());
  for (const Ticket ticket : abandoned) {
    TicketState& state = tickets_.at(ticket);
    if (state.status.ok()) state.status = status;
    state.pieces_left = 0;
    finished->push_back(&state);
  }
}

// The queue's own reaper takes the turn whenever requests are in flight and no caller is
// blocked in Wait (a waiting caller reaps for itself, saving a thread hand-off per completion).
void IoQueue::ReapLoop() {
  std::unique_lock lock(mutex_);
  while (true) {
    work_.wait(lock, [&] {
      return (in_flight_ > 0 && !reaping_ && waiters_ == 0) ||
             (stopping_ && in_flight_ == 0 && !reaping_);
    });
    if (in_flight_ == 0) break;  // stopping, and nothing left in flight or queued
    ReapOnce(lock);
  }
}

Status IoQueue::Collect(std::unordered_map<Ticket, TicketState>::iterator it) {
  Status status = std::move(it->second.status);
  tickets_.erase(it);
  return status;
}

Status IoQueue::Wait(Ticket ticket) {
  std::unique_lock lock(mutex_);
  ++waiters_;
  // Looked up again after every wake-up: other threads' inserts may rehash the map, which
  // invalidates iterators (not references).
  auto it = tickets_.find(ticket);
  while (it != tickets_.end() && !it->second.done) {
    if (!reaping_ && in_flight_ > 0) {
      ReapOnce(lock);
    } else {
      done_.wait(lock);
    }
    it = tickets_.find(ticket);
  }
  if (--waiters_ == 0) work_.notify_all();
  if (it == tickets_.end()) {
    return Status::InvalidArgument(
        fmt::format("I/O ticket {} is unknown: never issued or already collected", ticket));
  }
  return Collect(it);
}

std::optional<Status> IoQueue::Poll(Ticket ticket) {
  std::lock_guard lock(mutex_);
  auto it = tickets_.find(ticket);
  if (it == tickets_.end()) {
    return Status::InvalidArgument(
        fmt::format("I/O ticket {} is unknown: never issued or already collected", ticket));
  }
  if (!it->second.done) return std::nullopt;
  return Collect(it);
}

Status IoQueue::WaitAll() {
  std::unique_lock lock(mutex_);
  done_.wait(lock, [&] {
    return std::all_of(tickets_.begin(), tickets_.end(),
                       [](const auto& entry) { return entry.second.done; });
  });
  Status first;
  for (auto& [ticket, state] : tickets_) {
    if (first.ok() && !state.status.ok()) first = std::move(state.status);
  }
  tickets_.clear();
  return first;
}

Status IoQueue::RegisterBuffers(std::span<const BufferRegion> regions) {
  std::lock_guard lock(mutex_);
  if (in_flight_ > 0 || !queued_.empty() || held_requests_ > 0) {
    return Status::FailedPrecondition("buffers can be registered only while no I/O is in flight");
  }
  return engine_->RegisterBuffers(regions);
}

void IoQueue::RegisterFiles(const FileSet& files) {
  std::lock_guard lock(mutex_);
  for (size_t i = 0; i < files.file_count(); ++i) engine_->RegisterFile(files.file(i).fd());
}

void IoQueue::UnregisterFiles(const FileSet& files) {
  std::lock_guard lock(mutex_);
  for (size_t i = 0; i < files.file_count(); ++i) engine_->UnregisterFile(files.file(i).fd());
}

QueueStats IoQueue::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

}  // namespace zoe::io
