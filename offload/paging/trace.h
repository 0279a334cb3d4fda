// Trace: the recorded sequence of acquire events of one iteration (a training step, an evaluation
// pass), kept under a name, and its file format.
//
// An acquire of a tensor becomes one event per chunk the tensor touches (EventsForAcquire), so
// replay, prefetch and eviction can work on chunks while matching stays per tensor. Each event
// keeps the tier the acquire asked for, so replay can prefetch into DEVICE what was used there.
//
// File format, version 2, every integer little-endian (version 1 had no tier; its files are
// rejected as an unsupported version, to be recorded again):
//   offset  size  field
//        0     8  magic "ZOETRACE"
//        8     4  version (2)
//       12     4  name length N (at most kMaxTraceNameBytes)
//       16     8  fingerprint of the tensor registry (ChunkLayout::Fingerprint) it was recorded on
//       24     8  event count E
//       32     N  name (UTF-8, not terminated)
//     32+N  18*E  events: tensor id u32, chunk id u32, access u8, tier u8 (device 0, host 1),
//                 bytes u64
//      end     8  XXH3-64 of every byte before it
// Loading checks, in this order: magic, version, size (truncated or trailing bytes), checksum,
// registry fingerprint, and the values of each event; each failure names the file and what was
// expected.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "core/result.h"
#include "offload/optimizer/chunk_layout.h"
#include "offload/types.h"

namespace zoe::offload {

struct TraceEvent {
  TensorId tensor;
  ChunkId chunk;
  Access access = Access::kRead;
  uint64_t bytes = 0;       // bytes of the tensor inside this chunk
  Tier tier = Tier::kHost;  // where it was acquired: DEVICE or HOST

  // Replay matches on what is needed (tensor and chunk), not on how or where it is accessed.
  bool SameTarget(const TraceEvent& other) const {
    return tensor == other.tensor && chunk == other.chunk;
  }
  friend bool operator==(const TraceEvent&, const TraceEvent&) = default;
};

struct Trace {
  std::string name;
  uint64_t registry_fingerprint = 0;
  std::vector<TraceEvent> events;
};

inline constexpr char kTraceMagic[8] = {'Z', 'O', 'E', 'T', 'R', 'A', 'C', 'E'};
inline constexpr uint32_t kTraceFormatVersion = 2;
inline constexpr size_t kMaxTraceNameBytes = 4096;

// One event per piece of the tensor, in tensor order, acquired on `tier`; NotFound for an unknown
// tensor.
Result<std::vector<TraceEvent>> EventsForAcquire(const ChunkLayout& layout, TensorId tensor,
                                                 Access access, Tier tier = Tier::kHost);

// The bytes of a trace file, and their inverse. Decode checks everything listed above; `source`
// (a path) prefixes its messages.
std::string EncodeTrace(const Trace& trace);
Result<Trace> DecodeTrace(std::string_view bytes, uint64_t expected_fingerprint,
                          std::string_view source);

// Writes the file through a temporary sibling ("<path>.tmp") renamed over `path` once complete
// and synced, so a crash never leaves a half-written trace under the final name.
Status SaveTrace(const Trace& trace, const std::string& path);
Result<Trace> LoadTrace(const std::string& path, uint64_t expected_fingerprint);

// Records traces and keeps them by name: Begin(name) ... Record(event)* ... End(). Recording a
// name again replaces the old trace when End() is called. One recording at a time.
// Not thread-safe: the tier manager calls it under its own lock.
class TraceSet {
 public:
  // `max_events` bounds one recording, so a forgotten End() cannot eat all memory.
  explicit TraceSet(size_t max_events = size_t{1} << 24) : max_events_(max_events) {}

  // FailedPrecondition while another recording is open; InvalidArgument for an empty or too long
  // name.
  Status Begin(std::string_view name, uint64_t registry_fingerprint);
  // FailedPrecondition when not recording; OutOfMemory past max_events (the recording stays open
  // and keeps what it has).
  Status Record(const TraceEvent& event);
  // Stores the recording under its name and returns it; FailedPrecondition when not recording.
  Result<const Trace*> End();
  // Drops the open recording, if any.
  void Abandon();

  bool recording() const { return recording_; }
  // The trace being recorded; valid only while recording().
  const Trace& current() const { return current_; }

  // Adds (or replaces) a trace, e.g. one loaded from a file.
  Status Insert(Trace trace);
  Result<const Trace*> Find(std::string_view name) const;
  std::vector<std::string> Names() const;  // sorted

 private:
  size_t max_events_;
  bool recording_ = false;
  Trace current_;
  std::map<std::string, Trace, std::less<>> traces_;
};

}  // namespace zoe::offload
