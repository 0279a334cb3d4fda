// Tier residency as data: the record of one copy of a run in one cached tier (DEVICE or HOST) and
// the one function that moves it between states.
//
// Contract:
//  - A run holds one TierCopy per cached tier, indexed by CopyIndex(tier). NVMe is the backing
//    store, not a copy: whether it holds the run is a fact of the run (TierManager::Run::on_nvme).
//  - Every change of TierCopy::state goes through Transition (or TierCopy::Apply, which also
//    forgets the pending transfer when it completes). The allowed moves:
//
//        Absent --kLoadStarted--> Loading --kLoaded----> Resident
//        Absent --kFilled-------> Resident  (nothing to read: zeros, or a whole overwrite)
//        Loading --kLoadFailed--> Absent    (fault: a later acquire retries the read)
//        Resident --kWriteStarted--> WritingBack --kWritten|kWriteFailed--> Resident
//        Resident --kFreed------> Absent
//
//    Every other (state, event) pair is refused with FailedPrecondition and changes nothing. A
//    failed write-back (kWriteFailed) keeps the copy resident and dirty: no written data is lost.
//  - Tenants are who holds a copy in its tier; each kind counts its own pins. A new kind of tenant
//    is one more Tenant enumerator, not another flag on the record.
//  - A pending transfer (while Loading or WritingBack) belongs to no thread until one claims it
//    (PendingTransfer::waiter): that thread waits for it and applies the outcome; the others wait
//    on the manager's condition variable.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>
#include <thread>

#include "core/result.h"
#include "offload/paging/tier_backend.h"
#include "offload/types.h"

namespace zoe::offload {

enum class CopyState : uint8_t { kAbsent, kLoading, kResident, kWritingBack };
inline constexpr size_t kCopyStateCount = 4;

enum class CopyEvent : uint8_t {
  kLoadStarted,   // a transfer from the tier below was submitted
  kFilled,        // the bytes need no read (never written below, or about to be overwritten)
  kLoaded,        // the load finished
  kLoadFailed,    // the load failed (EIO, checksum mismatch, a failed copy)
  kWriteStarted,  // a transfer to the tier below was submitted
  kWritten,       // the write-back finished
  kWriteFailed,   // the write-back failed (EIO, ENOSPC, a failed copy)
  kFreed,         // the copy's memory was given back
};
inline constexpr size_t kCopyEventCount = 8;

std::string_view CopyStateName(CopyState state);  // "absent", "loading", ...
std::string_view CopyEventName(CopyEvent event);  // "load_started", ...

// The state `event` leads to from `from`; FailedPrecondition naming both when it is refused.
Result<CopyState> Transition(CopyState from, CopyEvent event);

// Who holds a copy in its tier (one pin count each).
enum class Tenant : uint8_t {
  kAcquire = 0,    // an outstanding Acquire of one of the run's tensors
  kUpperCopy = 1,  // the copy one tier up (a DEVICE copy stages through its HOST copy)
};
inline constexpr size_t kTenantCount = 2;

// Why a transfer was started, or a copy wanted: the demand of an acquire, or a hint ahead of it.
enum class Origin : uint8_t {
  kNone,      // nothing asked
  kDemand,    // an acquire (or eviction, or flush) needs it
  kPrefetch,  // a prefetch started it; it counts against the prefetch in-flight limit
  kHint,      // a DEVICE hint: copy up once the tier below holds the run
};

// What to do once a write-back finishes.
enum class AfterWrite : uint8_t { kStay, kEvict };

struct PendingTransfer {
  Transfer transfer;              // the backend's handle of the transfer in flight
  Origin origin = Origin::kNone;  // kPrefetch until an acquire takes it over
  std::thread::id waiter;         // the thread waiting for it; none: unclaimed
  AfterWrite then = AfterWrite::kStay;
  // The copy above came back into this one while it was being written below: the write may hold
  // some of the old bytes, so the copy stays dirty after it.
  bool source_changed = false;

  bool claimed() const { return waiter != std::thread::id(); }
};

struct TierCopy {
  CopyState state = CopyState::kAbsent;
  TierMemory memory;   // while not kAbsent
  bool dirty = false;  // holds bytes the tier below does not
  std::array<uint32_t, kTenantCount> pins{};
  PendingTransfer pending;        // while kLoading or kWritingBack
  Origin wanted = Origin::kNone;  // kHint: start a copy here once the tier below holds the run
  // A load nobody was waiting on failed: the next acquire of the run in this tier reports it,
  // the one after retries.
  Status load_error;
  Status write_error;  // of the last write-back, until one succeeds

  uint32_t pinned() const;  // pins of every tenant
  bool in_flight() const {
    return state == CopyState::kLoading || state == CopyState::kWritingBack;
  }
  // Moves the state by Transition; a completed transfer (kLoaded, kLoadFailed, kWritten,
  // kWriteFailed) also clears `pending`. Refused moves change nothing.
  Status Apply(CopyEvent event);
};

// The cached tiers, in CopyIndex order.
inline constexpr size_t kCopyTierCount = 2;
inline constexpr std::array<Tier, kCopyTierCount> kCopyTiers = {Tier::kDevice, Tier::kHost};
constexpr size_t CopyIndex(Tier tier) { return static_cast<size_t>(tier); }  // DEVICE 0, HOST 1
// The cached tier a copy loads from and writes back to (none: NVMe, the backing store), and the
// one whose copies stage through it.
constexpr std::optional<Tier> CachedTierBelow(Tier tier) {
  return tier == Tier::kDevice ? std::optional<Tier>(Tier::kHost) : std::nullopt;
}
constexpr std::optional<Tier> CachedTierAbove(Tier tier) {
  return tier == Tier::kHost ? std::optional<Tier>(Tier::kDevice) : std::nullopt;
}

}  // namespace zoe::offload
