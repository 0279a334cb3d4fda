#include "offload/paging/tier_residency.h"

#include <fmt/format.h>

#include <array>
#include <numeric>

#include "core/vocabulary.h"

namespace zoe::offload {

// Indexed by CopyState's and CopyEvent's values (core/vocabulary.h's mechanism).
constexpr std::array<std::string_view, kCopyStateCount> kCopyStateNames = {
    "absent", "loading", "resident", "writing_back"};
constexpr std::array<std::string_view, kCopyEventCount> kCopyEventNames = {
    "load_started",  "filled",  "loaded",       "load_failed",
    "write_started", "written", "write_failed", "freed"};

std::string_view CopyStateName(CopyState state) { return NameIn(kCopyStateNames, state); }

std::string_view CopyEventName(CopyEvent event) { return NameIn(kCopyEventNames, event); }

namespace {

// The state each event requires and the one it leads to (see the diagram in the header).
struct Move {
  CopyState from;
  CopyState to;
};

constexpr std::array<Move, kCopyEventCount> kMoves = {{
    {CopyState::kAbsent, CopyState::kLoading},        // kLoadStarted
    {CopyState::kAbsent, CopyState::kResident},       // kFilled
    {CopyState::kLoading, CopyState::kResident},      // kLoaded
    {CopyState::kLoading, CopyState::kAbsent},        // kLoadFailed
    {CopyState::kResident, CopyState::kWritingBack},  // kWriteStarted
    {CopyState::kWritingBack, CopyState::kResident},  // kWritten
    {CopyState::kWritingBack, CopyState::kResident},  // kWriteFailed
    {CopyState::kResident, CopyState::kAbsent},       // kFreed
}};

bool CompletesTransfer(CopyEvent event) {
  return event == CopyEvent::kLoaded || event == CopyEvent::kLoadFailed ||
         event == CopyEvent::kWritten || event == CopyEvent::kWriteFailed;
}

}  // namespace

Result<CopyState> Transition(CopyState from, CopyEvent event) {
  const size_t index = static_cast<size_t>(event);
  if (index >= kMoves.size() || kMoves[index].from != from) {
    return Status::FailedPrecondition(fmt::format("tier copy: event {} refused in state {}",
                                                  CopyEventName(event), CopyStateName(from)));
  }
  return kMoves[index].to;
}

uint32_t TierCopy::pinned() const { return std::accumulate(pins.begin(), pins.end(), 0u); }

Status TierCopy::Apply(CopyEvent event) {
  ZOE_ASSIGN_OR_RETURN(CopyState next, Transition(state, event));
  state = next;
  if (CompletesTransfer(event)) pending = PendingTransfer();
  return Status::Ok();
}

}  // namespace zoe::offload
