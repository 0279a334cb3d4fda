// Description: the residency of a tier copy — every state x event pair of Transition, faults
// included, allowed to its next state or refused, and TierCopy::Apply keeping the record whole.
#include "offload/paging/tier_residency.h"

#include <gtest/gtest.h>

#include <map>
#include <optional>
#include <utility>

namespace zoe::offload {
namespace {

using S = CopyState;
using E = CopyEvent;

constexpr std::array<S, kCopyStateCount> kStates = {S::kAbsent, S::kLoading, S::kResident,
                                                    S::kWritingBack};
constexpr std::array<E, kCopyEventCount> kEvents = {E::kLoadStarted, E::kFilled,       E::kLoaded,
                                                    E::kLoadFailed,  E::kWriteStarted, E::kWritten,
                                                    E::kWriteFailed, E::kFreed};

// The allowed moves, written out independently of the implementation; every pair not listed is
// refused.
const std::map<std::pair<S, E>, S>& Allowed() {
  static const std::map<std::pair<S, E>, S> allowed = {
      {{S::kAbsent, E::kLoadStarted}, S::kLoading},
      {{S::kAbsent, E::kFilled}, S::kResident},
      {{S::kLoading, E::kLoaded}, S::kResident},
      {{S::kLoading, E::kLoadFailed}, S::kAbsent},  // fault: a later acquire retries
      {{S::kResident, E::kWriteStarted}, S::kWritingBack},
      {{S::kResident, E::kFreed}, S::kAbsent},
      {{S::kWritingBack, E::kWritten}, S::kResident},
      {{S::kWritingBack, E::kWriteFailed}, S::kResident},  // fault: stays resident and dirty
  };
  return allowed;
}

std::optional<S> Expected(S state, E event) {
  auto it = Allowed().find({state, event});
  if (it == Allowed().end()) return std::nullopt;
  return it->second;
}

TEST(TierResidency, EveryStateAndEventIsAllowedOrRefused) {
  int allowed = 0;
  for (S state : kStates) {
    for (E event : kEvents) {
      SCOPED_TRACE(std::string(CopyStateName(state)) + " x " + std::string(CopyEventName(event)));
      Result<S> next = Transition(state, event);
      const std::optional<S> expected = Expected(state, event);
      if (expected) {
        ASSERT_TRUE(next.ok()) << next.status().ToString();
        EXPECT_EQ(*next, *expected);
        ++allowed;
      } else {
        ASSERT_FALSE(next.ok());
        EXPECT_EQ(next.status().code(), StatusCode::kFailedPrecondition);
        EXPECT_NE(next.status().message().find(CopyStateName(state)), std::string::npos);
      }
    }
  }
  EXPECT_EQ(allowed, 8);
}

TEST(TierResidency, RefusedApplyChangesNothing) {
  for (S state : kStates) {
    for (E event : kEvents) {
      if (Expected(state, event)) continue;
      TierCopy copy;
      copy.state = state;
      copy.pending.origin = Origin::kPrefetch;
      copy.pending.then = AfterWrite::kEvict;
      EXPECT_FALSE(copy.Apply(event).ok());
      EXPECT_EQ(copy.state, state);
      EXPECT_EQ(copy.pending.origin, Origin::kPrefetch);
      EXPECT_EQ(copy.pending.then, AfterWrite::kEvict);
    }
  }
}

TEST(TierResidency, CompletedTransfersForgetThePendingOne) {
  for (E event : {E::kLoaded, E::kLoadFailed, E::kWritten, E::kWriteFailed}) {
    TierCopy copy;
    copy.state = event == E::kLoaded || event == E::kLoadFailed ? S::kLoading : S::kWritingBack;
    copy.pending.transfer = io::Ticket{7};
    copy.pending.origin = Origin::kPrefetch;
    copy.pending.then = AfterWrite::kEvict;
    copy.pending.source_changed = true;
    ASSERT_TRUE(copy.Apply(event).ok()) << CopyEventName(event);
    EXPECT_TRUE(std::holds_alternative<std::monostate>(copy.pending.transfer));
    EXPECT_EQ(copy.pending.origin, Origin::kNone);
    EXPECT_EQ(copy.pending.then, AfterWrite::kStay);
    EXPECT_FALSE(copy.pending.source_changed);
    EXPECT_FALSE(copy.pending.claimed());
  }
}

TEST(TierResidency, StartingATransferKeepsItsRecord) {
  TierCopy copy;
  copy.pending.transfer = io::Ticket{3};
  copy.pending.origin = Origin::kPrefetch;
  ASSERT_TRUE(copy.Apply(E::kLoadStarted).ok());
  EXPECT_EQ(copy.state, S::kLoading);
  EXPECT_TRUE(copy.in_flight());
  EXPECT_EQ(std::get<io::Ticket>(copy.pending.transfer), 3u);
  EXPECT_EQ(copy.pending.origin, Origin::kPrefetch);
}

TEST(TierResidency, PinsCountEveryTenant) {
  TierCopy copy;
  EXPECT_EQ(copy.pinned(), 0u);
  copy.pins[static_cast<size_t>(Tenant::kAcquire)] = 2;
  copy.pins[static_cast<size_t>(Tenant::kUpperCopy)] = 1;
  EXPECT_EQ(copy.pinned(), 3u);
}

TEST(TierResidency, CopiesAreIndexedByTier) {
  EXPECT_EQ(kCopyTiers[CopyIndex(Tier::kDevice)], Tier::kDevice);
  EXPECT_EQ(kCopyTiers[CopyIndex(Tier::kHost)], Tier::kHost);
}

}  // namespace
}  // namespace zoe::offload
