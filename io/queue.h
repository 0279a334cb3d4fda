// IoQueue: the layer callers use on top of a raw io::Engine.
//
// It validates every request before submission (direct-I/O alignment of buffer address, offset
// and length, checksum block coverage), splits requests over the files of a striped FileSet,
// submits everything queued in as few engine calls as the queue depth allows (contiguous
// requests submitted together reach the block layer together and are merged there), resubmits
// the rest of short reads and writes, retries EINTR and EAGAIN, and gives every request its own
// Status naming the path and offset that failed. Requests beyond the queue depth wait inside the
// queue, so a caller may submit any number.
//
// Completion model: Submit returns a Ticket per request; Wait(ticket) blocks for that request
// only, Poll(ticket) never blocks, WaitAll() drains everything. A ticket is collected (forgotten)
// by the Wait or Poll that returns its status.
//
// Ordering: a request may name an earlier ticket it follows (IoRequest::after). It is held in the
// queue, not handed to the engine, until that request has completed successfully and its
// checksums were recorded; then it is queued like any other. So a read into the buffer a write is
// writing from starts the moment the write ends, whoever is waiting. If the earlier request
// fails, the later one fails without starting, with the earlier one's status.
//
// Threads: Submit, Wait and Poll may be called from any number of threads at once (submission is
// serialised by a mutex). One thread at a time reaps completions: a caller blocked in Wait, or
// else the queue's own reaping thread, so requests complete even when nobody waits (Poll) and a
// waiting caller is woken by the kernel directly rather than through another thread.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "core/result.h"
#include "io/engine.h"
#include "io/file.h"

namespace zoe::io {

using Ticket = uint64_t;  // 0 is never issued

struct IoRequest {
  Op op = Op::kRead;
  const FileSet* files = nullptr;  // borrowed; must outlive the request
  uint64_t offset = 0;             // logical offset within the file set
  std::span<std::byte> buffer;     // read into or written from; valid until the request completes
  // With checksums on (files->checksums()), who hashes the buffer (io/checksum.h). By default
  // the queue: a write's blocks are hashed when it completes, a read's verified before Wait
  // returns. A caller that touches the data anyway may do it instead:
  //  - caller_sums (writes): the Xxh3 of each block of `buffer`, recorded when the write
  //    succeeds; borrowed until the request completes;
  //  - caller_verifies (reads): the queue does not verify; the caller checks every block against
  //    ChecksumTable::Expected before using any of it.
  std::span<const uint64_t> caller_sums;
  bool caller_verifies = false;
  // 0, or a ticket issued by an earlier call and not yet collected: this request starts only
  // once that one has completed successfully (see Ordering above).
  Ticket after = 0;
};

struct QueueOptions {
  // Resubmissions of one piece after EINTR or EAGAIN, after a transfer of zero bytes, or after
  // the engine accepted nothing with nothing in flight (with a short back-off), before the
  // request fails.
  uint32_t max_retries = 16;
  // Engine::Reap failures in a row (each followed by a back-off: 1 ms doubling, at most 128 ms;
  // 16 spend about 1.3 s) before the queue gives up on its engine: every request still in flight
  // or queued then fails with the reap's error, and the queue refuses new ones (see Broken below).
  uint32_t max_reap_failures = 16;
  // Runs once per request, after its checksums were recorded or verified and before Wait returns
  // it, on the thread that reaped it (the queue's or a waiting caller's), or on the submitting
  // thread for a request the engine refused outright. Must not call back into the queue.
  std::function<void(Ticket, const Status&)> on_complete;
};

struct QueueStats {
  uint64_t requests = 0;         // submitted by callers
  uint64_t pieces = 0;           // transfers handed to the engine, resubmissions included
  uint64_t engine_submits = 0;   // calls to Engine::Submit
  uint64_t short_transfers = 0;  // resubmissions of the rest of a short read or write
  uint64_t retries = 0;          // resubmissions after EINTR/EAGAIN or a zero-byte transfer
  uint64_t followers = 0;        // requests submitted to follow another (IoRequest::after)
};

class IoQueue {
 public:
  static Result<std::unique_ptr<IoQueue>> Create(std::unique_ptr<Engine> engine,
                                                 QueueOptions options = {});
  ~IoQueue();  // waits for every request still queued or in flight
  IoQueue(const IoQueue&) = delete;
  IoQueue& operator=(const IoQueue&) = delete;

  // Validates and queues one request. A validation error is returned here and nothing is queued.
  Result<Ticket> Submit(const IoRequest& request);
  // Validates every request, then queues all of them (or none) and submits them together.
  // Appends one ticket per request to `tickets`.
  Status SubmitBatch(std::span<const IoRequest> requests, std::vector<Ticket>* tickets);

  // A queue whose engine could not be reaped max_reap_failures times in a row is broken: the
  // requests that were in flight were failed with that error although the kernel may still own
  // them (their buffers must not be reused until the engine is destroyed: the queue's owner
  // treats the error as fatal for what it was moving), and Submit returns the same error.
  //
  // Blocks until `ticket` completes and returns its status; InvalidArgument for a ticket that was
  // never issued or was already collected.
  Status Wait(Ticket ticket);
  // The status of a completed ticket (collecting it), or nullopt while it is still in flight.
  std::optional<Status> Poll(Ticket ticket);
  // Waits for every request submitted so far, collects them all and returns the first error.
  // Meant for a queue with one user: tickets other threads still wait for are collected too
  // (their Wait then returns InvalidArgument).
  Status WaitAll();

  // io_uring fixed buffers for the given regions (requests inside one use READ/WRITE_FIXED).
  // FailedPrecondition while requests are in flight.
  Status RegisterBuffers(std::span<const BufferRegion> regions);
  // Registers the files of `files` with the engine (io_uring fixed files). Unregister before the
  // file set is closed, with none of its requests in flight.
  void RegisterFiles(const FileSet& files);
  void UnregisterFiles(const FileSet& files);

  std::string_view backend() const { return engine_->name(); }
  uint32_t queue_depth() const { return engine_->queue_depth(); }
  Engine& engine() { return *engine_; }
  QueueStats stats() const;

 private:
  // A physical transfer in one file: queued, or in flight under a slot index used as its tag.
  struct Piece {
    Ticket ticket;
    Op op;
    const File* file;
    uint64_t offset;
    std::byte* buffer;
    uint64_t length;
    uint32_t retries;
  };
  struct TicketState {
    Ticket ticket = 0;
    IoRequest request;
    uint32_t pieces_left = 0;
    Status status;
    bool done = false;
    std::vector<Piece> held;        // pieces waiting for request.after to complete
    std::vector<Ticket> followers;  // held requests that follow this one
  };

  IoQueue(std::unique_ptr<Engine> engine, QueueOptions options);
  Status Validate(const IoRequest& request, std::vector<FileSet::Piece>* pieces) const;
  Status CheckFollowed(const IoRequest& request) const;
  void Enqueue(const IoRequest& request, const std::vector<FileSet::Piece>& pieces, Ticket ticket,
               std::vector<TicketState*>* finished);
  void ReleaseFollowers(TicketState& state, std::vector<TicketState*>* finished);
  void Pump(std::vector<TicketState*>* finished);
  void HandleCompletion(const RawCompletion& completion, std::vector<TicketState*>* finished);
  void FailPiece(const Piece& piece, Status status, std::vector<TicketState*>* finished);
  void PieceDone(Ticket ticket, std::vector<TicketState*>* finished);
  void Finalize(std::vector<TicketState*>* finished, std::unique_lock<std::mutex>& lock);
  void FinalizeRound(std::vector<TicketState*>* finished, std::unique_lock<std::mutex>& lock);
  void ReapOnce(std::unique_lock<std::mutex>& lock);
  void ReapFailed(Status status, std::unique_lock<std::mutex>& lock,
                  std::vector<TicketState*>* finished);
  void AbandonAll(const Status& status, std::vector<TicketState*>* finished);
  void ReapLoop();
  Status Collect(std::unordered_map<Ticket, TicketState>::iterator it);

  std::unique_ptr<Engine> engine_;
  QueueOptions options_;

  mutable std::mutex mutex_;
  std::condition_variable work_;  // the reaper waits for requests in flight
  std::condition_variable done_;  // callers wait for tickets
  std::unordered_map<Ticket, TicketState> tickets_;
  std::deque<Piece> queued_;
  std::vector<Piece> slots_;  // in-flight pieces by tag
  std::vector<uint32_t> free_slots_;
  std::vector<RawRequest> batch_;
  std::vector<RawCompletion> completions_;  // used by the thread holding the reaping turn
  uint32_t in_flight_ = 0;
  uint32_t held_requests_ = 0;  // requests waiting for the one they follow
  bool reaping_ = false;        // one thread at a time waits in Engine::Reap
  uint32_t waiters_ = 0;        // callers blocked in Wait
  Ticket next_ticket_ = 1;
  bool stopping_ = false;
  uint32_t reap_failures_ = 0;  // Engine::Reap failures in a row
  Status broken_;               // not OK once the engine could not be reaped (see Wait's comment)
  QueueStats stats_;
  std::thread reaper_;  // last: started once everything above exists
};

}  // namespace zoe::io
