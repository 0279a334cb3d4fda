// Description: TraceCursor replay: in-order matching, next-use distances (checked against a
// brute-force scan), look-ahead prefetch limits, and resynchronisation for a mixture-of-experts
// layer choosing other experts, a shorter evaluation pass (prefix and subsequence), repeats,
// spurious far matches, and re-recording after repeated mismatches.
#include "offload/paging/trace_cursor.h"

#include <gtest/gtest.h>

#include <random>
#include <set>
#include <vector>

namespace zoe::offload {
namespace {

constexpr size_t kChunks = 256;

// Tensor t lives alone in chunk t unless said otherwise.
TraceEvent E(uint32_t tensor, uint64_t bytes = 100) {
  return TraceEvent{TensorId(tensor), ChunkId(tensor), Access::kRead, bytes};
}

Trace MakeTrace(const std::vector<uint32_t>& tensors) {
  Trace trace{"t", 0, {}};
  for (uint32_t t : tensors) trace.events.push_back(E(t));
  return trace;
}

TraceCursor MakeCursor(const std::vector<uint32_t>& tensors, TraceCursorOptions options = {}) {
  Result<TraceCursor> cursor = TraceCursor::Create(MakeTrace(tensors), kChunks, options);
  EXPECT_TRUE(cursor.ok()) << cursor.status().ToString();
  return std::move(cursor).value();
}

std::vector<ChunkId> Chunks(const std::vector<uint32_t>& ids) {
  std::vector<ChunkId> out;
  for (uint32_t id : ids) out.push_back(ChunkId(id));
  return out;
}

PrefetchLimits Limits(uint64_t bytes, size_t chunks) { return PrefetchLimits{bytes, chunks, {}}; }

const std::function<bool(ChunkId)> kNothingResident = [](ChunkId) { return false; };

TEST(TraceCursor, CreateRejectsEventsOutsideTheRegistryAndBadOptions) {
  Result<TraceCursor> outside = TraceCursor::Create(MakeTrace({1, 300}), kChunks);
  ASSERT_FALSE(outside.ok());
  EXPECT_EQ(outside.status().message(),
            "trace 't': event 1 names chunk 300 of tensor 300, but the registry has 256 chunks");
  TraceCursorOptions bad_fraction;
  bad_fraction.rerecord_mismatch_fraction = 1.5;
  EXPECT_EQ(TraceCursor::Create(MakeTrace({1}), kChunks, bad_fraction).status().code(),
            StatusCode::kInvalidArgument);
  TraceCursorOptions no_lookahead;
  no_lookahead.max_lookahead_events = 0;
  EXPECT_FALSE(TraceCursor::Create(MakeTrace({1}), kChunks, no_lookahead).ok());
}

TEST(TraceCursor, InOrderReplayMatchesAndWrapsIntoTheNextIteration) {
  TraceCursor cursor = MakeCursor({1, 2, 3});
  for (int iteration = 0; iteration < 2; ++iteration) {
    for (uint32_t t : {1u, 2u, 3u}) EXPECT_EQ(cursor.OnAcquire(E(t)), AcquireMatch::kMatched);
    EXPECT_EQ(cursor.position(), 0u);
  }
  EXPECT_EQ(cursor.matched(), 6u);
  EXPECT_EQ(cursor.mismatches_this_iteration(), 0u);
  EXPECT_FALSE(cursor.ShouldRerecord());
}

TEST(TraceCursor, MatchingIgnoresAccessButNotTheChunk) {
  Trace trace{
      "t",
      0,
      {{TensorId(1), ChunkId(1), Access::kRead, 8}, {TensorId(1), ChunkId(2), Access::kRead, 8}}};
  Result<TraceCursor> cursor = TraceCursor::Create(trace, kChunks);
  ASSERT_TRUE(cursor.ok());
  EXPECT_EQ(cursor->OnAcquire({TensorId(1), ChunkId(1), Access::kReadWrite, 8}),
            AcquireMatch::kMatched);
  EXPECT_EQ(cursor->OnAcquire({TensorId(1), ChunkId(3), Access::kRead, 8}),
            AcquireMatch::kUnmatched);
  EXPECT_EQ(cursor->position(), 1u);
}

TEST(TraceCursor, NonCyclicReplayFinishesUntilRestart) {
  TraceCursorOptions options;
  options.cyclic = false;
  TraceCursor cursor = MakeCursor({1, 2}, options);
  EXPECT_EQ(cursor.OnAcquire(E(1)), AcquireMatch::kMatched);
  EXPECT_EQ(cursor.OnAcquire(E(2)), AcquireMatch::kMatched);
  EXPECT_TRUE(cursor.finished());
  EXPECT_EQ(cursor.NextUseDistance(ChunkId(1)), TraceCursor::kNever);
  EXPECT_TRUE(cursor.NextPrefetches(Limits(1000, 4), kNothingResident).empty());
  EXPECT_EQ(cursor.OnAcquire(E(1)), AcquireMatch::kUnmatched);
  cursor.Restart();
  EXPECT_EQ(cursor.mismatches_this_iteration(), 0u);
  EXPECT_EQ(cursor.OnAcquire(E(1)), AcquireMatch::kMatched);
}

TEST(TraceCursor, EmptyTraceNeverMatchesOrPrefetches) {
  TraceCursor cursor = MakeCursor({});
  EXPECT_EQ(cursor.OnAcquire(E(1)), AcquireMatch::kUnmatched);
  EXPECT_TRUE(cursor.NextPrefetches(Limits(1000, 4), kNothingResident).empty());
  EXPECT_EQ(cursor.NextUseDistance(ChunkId(1)), TraceCursor::kNever);
}

TEST(TraceCursor, NextUseDistanceCountsEventsAndWraps) {
  TraceCursor cursor = MakeCursor({1, 2, 3, 1, 4});
  EXPECT_EQ(cursor.NextUseDistance(ChunkId(1)), 0u);
  EXPECT_EQ(cursor.NextUseDistance(ChunkId(4)), 4u);
  EXPECT_EQ(cursor.NextUseDistance(ChunkId(9)), TraceCursor::kNever);
  EXPECT_EQ(cursor.NextUseDistance(ChunkId(100000)), TraceCursor::kNever);
  for (uint32_t t : {1u, 2u, 3u, 1u}) ASSERT_EQ(cursor.OnAcquire(E(t)), AcquireMatch::kMatched);
  EXPECT_EQ(cursor.NextUseDistance(ChunkId(4)), 0u);
  EXPECT_EQ(cursor.NextUseDistance(ChunkId(1)), 1u) << "first event of the next iteration";
  EXPECT_EQ(cursor.NextUseDistance(ChunkId(3)), 3u);
}

TEST(TraceCursor, NextUseDistanceAgreesWithABruteForceScan) {
  std::mt19937 random(42);
  for (bool cyclic : {true, false}) {
    std::vector<uint32_t> tensors(500);
    for (uint32_t& t : tensors) t = random() % 40;
    TraceCursorOptions options;
    options.cyclic = cyclic;
    TraceCursor cursor = MakeCursor(tensors, options);
    for (size_t position = 0; position < tensors.size(); ++position) {
      for (uint32_t chunk = 0; chunk < 42; ++chunk) {
        uint64_t expected = TraceCursor::kNever;
        const size_t span = cyclic ? tensors.size() : tensors.size() - position;
        for (size_t d = 0; d < span; ++d) {
          if (tensors[(position + d) % tensors.size()] == chunk) {
            expected = d;
            break;
          }
        }
        ASSERT_EQ(cursor.NextUseDistance(ChunkId(chunk)), expected)
            << "cyclic " << cyclic << " position " << position << " chunk " << chunk;
      }
      ASSERT_EQ(cursor.OnAcquire(E(tensors[position])), AcquireMatch::kMatched);
    }
  }
}

TEST(TraceCursor, PrefetchesDistinctUpcomingChunksInOrder) {
  TraceCursor cursor = MakeCursor({1, 2, 1, 3, 4, 5});
  EXPECT_EQ(cursor.NextPrefetches(Limits(10000, 10), kNothingResident), Chunks({1, 2, 3, 4, 5}));
  ASSERT_EQ(cursor.OnAcquire(E(1)), AcquireMatch::kMatched);
  EXPECT_EQ(cursor.NextPrefetches(Limits(10000, 3), kNothingResident), Chunks({2, 1, 3}));
}

TEST(TraceCursor, PrefetchWindowCountsResidentChunksAndSkipsThem) {
  TraceCursor cursor = MakeCursor({1, 2, 3, 4, 5, 6});
  auto resident = [](ChunkId c) { return c == ChunkId(2) || c == ChunkId(3); };
  // 100 bytes each: a 450-byte window spans chunks 1..4, of which 1 and 4 are missing.
  EXPECT_EQ(cursor.NextPrefetches(Limits(450, 10), resident), Chunks({1, 4}));
  EXPECT_EQ(cursor.NextPrefetches(Limits(450, 1), resident), Chunks({1}));
  EXPECT_TRUE(cursor.NextPrefetches(Limits(450, 0), resident).empty());
  EXPECT_TRUE(cursor.NextPrefetches(Limits(99, 10), resident).empty());
}

// The DEVICE look-ahead: only chunks whose next use is a device acquire count, and a chunk used
// on HOST first is left to the HOST look-ahead even when a device use follows.
TEST(TraceCursor, PrefetchWindowOfOneTierChargesOnlyThatTier) {
  Trace trace{"t", 0, {}};
  for (uint32_t t : {1u, 2u, 3u, 4u, 5u, 2u}) trace.events.push_back(E(t));
  for (size_t i : {1u, 3u, 4u, 5u}) trace.events[i].tier = Tier::kDevice;
  Result<TraceCursor> made = TraceCursor::Create(trace, kChunks);
  ASSERT_TRUE(made.ok());
  TraceCursor cursor = std::move(made).value();
  PrefetchLimits device = Limits(10000, 10);
  device.only_tier = Tier::kDevice;
  EXPECT_EQ(cursor.NextPrefetches(device, kNothingResident), Chunks({2, 4, 5}));
  device.byte_budget = 250;  // two device chunks of 100 bytes; the HOST chunks cost nothing
  EXPECT_EQ(cursor.NextPrefetches(device, kNothingResident), Chunks({2, 4}));
  PrefetchLimits host = Limits(10000, 10);
  host.only_tier = Tier::kHost;
  EXPECT_EQ(cursor.NextPrefetches(host, kNothingResident), Chunks({1, 3}));
}

// A chunk acquired to be overwritten needs no read but takes its room when acquired, so it counts
// against the window: a look-ahead past it would fill the room its acquire will take.
TEST(TraceCursor, ChunksWrittenBeforeTheyAreReadAreChargedButNotPrefetched) {
  Trace trace = MakeTrace({1, 2, 3, 4, 1});
  trace.events[0].access = Access::kWrite;      // chunk 1: written, then read
  trace.events[2].access = Access::kWrite;      // chunk 3: only written
  trace.events[3].access = Access::kReadWrite;  // chunk 4: its bytes are read
  Result<TraceCursor> made = TraceCursor::Create(trace, kChunks);
  ASSERT_TRUE(made.ok());
  TraceCursor cursor = std::move(made).value();
  EXPECT_EQ(cursor.NextPrefetches(Limits(10000, 10), kNothingResident), Chunks({2, 4}));
  EXPECT_EQ(cursor.NextPrefetches(Limits(400, 10), kNothingResident), Chunks({2, 4}));
  EXPECT_EQ(cursor.NextPrefetches(Limits(399, 10), kNothingResident), Chunks({2}));
  EXPECT_EQ(cursor.NextPrefetches(Limits(200, 10), kNothingResident), Chunks({2}));
  EXPECT_EQ(cursor.NextPrefetches(Limits(199, 10), kNothingResident), Chunks({}));
}

TEST(TraceCursor, PrefetchWindowUsesTheChunkCostWhenGiven) {
  TraceCursor cursor = MakeCursor({1, 2, 3});
  PrefetchLimits limits{4096 * 2, 10, [](ChunkId) -> uint64_t { return 4096; }};
  EXPECT_EQ(cursor.NextPrefetches(limits, kNothingResident), Chunks({1, 2}));
}

TEST(TraceCursor, PrefetchLooksIntoTheNextIterationOnlyWhenCyclic) {
  TraceCursor cyclic = MakeCursor({1, 2, 3});
  TraceCursorOptions once;
  once.cyclic = false;
  TraceCursor single = MakeCursor({1, 2, 3}, once);
  for (TraceCursor* c : {&cyclic, &single}) {
    ASSERT_EQ(c->OnAcquire(E(1)), AcquireMatch::kMatched);
    ASSERT_EQ(c->OnAcquire(E(2)), AcquireMatch::kMatched);
  }
  EXPECT_EQ(cyclic.NextPrefetches(Limits(1000, 10), kNothingResident), Chunks({3, 1, 2}));
  EXPECT_EQ(single.NextPrefetches(Limits(1000, 10), kNothingResident), Chunks({3}));
}

TEST(TraceCursor, TensorsSharingAChunkArePrefetchedOnce) {
  Trace trace{"t",
              0,
              {{TensorId(0), ChunkId(0), Access::kRead, 10},
               {TensorId(1), ChunkId(0), Access::kRead, 10},
               {TensorId(2), ChunkId(1), Access::kRead, 10}}};
  Result<TraceCursor> cursor = TraceCursor::Create(trace, kChunks);
  ASSERT_TRUE(cursor.ok());
  EXPECT_EQ(cursor->NextPrefetches(Limits(1000, 10), kNothingResident), Chunks({0, 1}));
  EXPECT_EQ(cursor->OnAcquire(trace.events[1]), AcquireMatch::kResynced);
  EXPECT_EQ(cursor->position(), 2u);
}

// A mixture-of-experts model: per layer, attention, two routed experts (of eight), then the
// output projection. The trace was recorded with experts {0, 1} everywhere; this iteration routes
// layer 1 to {2, 3} and layer 2 to {0, 5}.
uint32_t Attn(uint32_t layer) { return layer * 2; }
uint32_t Out(uint32_t layer) { return layer * 2 + 1; }
uint32_t Expert(uint32_t layer, uint32_t e) { return 100 + layer * 8 + e; }

std::vector<uint32_t> MoeIteration(const std::vector<std::vector<uint32_t>>& routing) {
  std::vector<uint32_t> tensors;
  for (uint32_t layer = 0; layer < routing.size(); ++layer) {
    tensors.push_back(Attn(layer));
    for (uint32_t e : routing[layer]) tensors.push_back(Expert(layer, e));
    tensors.push_back(Out(layer));
  }
  return tensors;
}

TEST(TraceCursor, MixtureOfExpertsChoosingOtherExpertsKeepsPrefetching) {
  const std::vector<std::vector<uint32_t>> recorded = {{0, 1}, {0, 1}, {0, 1}, {0, 1}};
  const std::vector<std::vector<uint32_t>> actual = {{0, 1}, {2, 3}, {0, 5}, {0, 1}};
  TraceCursor cursor = MakeCursor(MoeIteration(recorded));
  std::set<uint32_t> unknown_experts = {Expert(1, 2), Expert(1, 3), Expert(2, 5)};
  for (uint32_t layer = 0; layer < 4; ++layer) {
    for (uint32_t t : MoeIteration({actual[layer]})) {
      const uint32_t tensor = t >= 100 ? t + layer * 8 : (t == 0 ? Attn(layer) : Out(layer));
      const AcquireMatch match = cursor.OnAcquire(E(tensor));
      if (unknown_experts.contains(tensor)) {
        EXPECT_EQ(match, AcquireMatch::kUnmatched) << tensor;
      } else {
        EXPECT_NE(match, AcquireMatch::kUnmatched) << tensor;
      }
    }
    // After each layer's output projection, the next layer's attention is the next prefetch.
    const std::vector<ChunkId> next = cursor.NextPrefetches(Limits(1000, 2), kNothingResident);
    ASSERT_FALSE(next.empty());
    EXPECT_EQ(next[0], ChunkId(Attn((layer + 1) % 4))) << "after layer " << layer;
  }
  EXPECT_EQ(cursor.unmatched(), 3u);
  EXPECT_EQ(cursor.resynced(), 2u) << "out_1 skips experts 0 and 1; out_2 skips expert 1";
  EXPECT_EQ(cursor.mismatches_this_iteration(), 5u);
  EXPECT_FALSE(cursor.ShouldRerecord());
  EXPECT_EQ(cursor.position(), 0u) << "the iteration ended in step with the trace";
}

// A training trace: forward over eight layers, then backward in reverse.
std::vector<uint32_t> TrainingTrace() { return {0, 1, 2, 3, 4, 5, 6, 7, 7, 6, 5, 4, 3, 2, 1, 0}; }

TEST(TraceCursor, EvaluationPrefixMatchesAndPrefetchesAhead) {
  TraceCursor cursor = MakeCursor(TrainingTrace());
  for (int iteration = 0; iteration < 2; ++iteration) {
    cursor.Restart();
    for (uint32_t layer = 0; layer < 8; ++layer) {
      EXPECT_EQ(cursor.OnAcquire(E(layer)), AcquireMatch::kMatched);
      if (layer < 6) {
        EXPECT_EQ(cursor.NextPrefetches(Limits(200, 2), kNothingResident),
                  Chunks({layer + 1, layer + 2}));
      }
    }
    EXPECT_FALSE(cursor.ShouldRerecord());
  }
  EXPECT_EQ(cursor.matched(), 16u);
}

TEST(TraceCursor, EvaluationPrefixWithoutRestartResynchronisesAtTheNextPass) {
  TraceCursor cursor = MakeCursor(TrainingTrace());
  for (uint32_t layer = 0; layer < 8; ++layer)
    ASSERT_EQ(cursor.OnAcquire(E(layer)), AcquireMatch::kMatched);
  // The next pass starts: layer 0 is found last in the backward pass, within the window, which
  // puts the cursor at the start of the next iteration. Prefetch is right again at once.
  EXPECT_EQ(cursor.OnAcquire(E(0)), AcquireMatch::kResynced);
  EXPECT_EQ(cursor.position(), 0u);
  EXPECT_EQ(cursor.NextPrefetches(Limits(300, 2), [](ChunkId c) { return c == ChunkId(0); }),
            Chunks({1, 2}));
  // Layer 1 skips the trace's own layer-0 event; from there on everything matches.
  EXPECT_EQ(cursor.OnAcquire(E(1)), AcquireMatch::kResynced);
  for (uint32_t layer = 2; layer < 8; ++layer) {
    EXPECT_EQ(cursor.OnAcquire(E(layer)), AcquireMatch::kMatched);
  }
}

TEST(TraceCursor, EvaluationSubsequenceSkipsLayersAndStaysInStep) {
  TraceCursor cursor = MakeCursor(TrainingTrace());
  const std::vector<uint32_t> eval = {0, 1, 2, 4, 5, 7};  // layers 3 and 6 skipped
  for (uint32_t layer : eval) {
    const AcquireMatch match = cursor.OnAcquire(E(layer));
    EXPECT_EQ(match, (layer == 4 || layer == 7) ? AcquireMatch::kResynced : AcquireMatch::kMatched)
        << layer;
    if (layer == 4) {
      EXPECT_EQ(cursor.NextPrefetches(Limits(1000, 1), kNothingResident), Chunks({5}));
    }
  }
  EXPECT_EQ(cursor.position(), 8u);
  EXPECT_FALSE(cursor.ShouldRerecord());
}

TEST(TraceCursor, LostCursorRelocatesOnceTwoAcquiresAgree) {
  TraceCursorOptions narrow;
  narrow.resync_window = 2;
  TraceCursor cursor = MakeCursor(TrainingTrace(), narrow);
  for (uint32_t layer = 0; layer < 8; ++layer)
    ASSERT_EQ(cursor.OnAcquire(E(layer)), AcquireMatch::kMatched);
  // Layer 0 is 7 events ahead: beyond the window, so the cursor stays and remembers the spot.
  EXPECT_EQ(cursor.OnAcquire(E(0)), AcquireMatch::kUnmatched);
  EXPECT_EQ(cursor.position(), 8u);
  // Layer 1 follows that spot (wrapping into the next iteration): both agree, the cursor moves.
  EXPECT_EQ(cursor.OnAcquire(E(1)), AcquireMatch::kResynced);
  EXPECT_EQ(cursor.position(), 2u);
  EXPECT_EQ(cursor.OnAcquire(E(2)), AcquireMatch::kMatched);
}

TEST(TraceCursor, OneSpuriousFarMatchDoesNotMoveTheCursor) {
  TraceCursorOptions narrow;
  narrow.resync_window = 2;
  TraceCursor cursor = MakeCursor(TrainingTrace(), narrow);
  ASSERT_EQ(cursor.OnAcquire(E(0)), AcquireMatch::kMatched);
  ASSERT_EQ(cursor.OnAcquire(E(1)), AcquireMatch::kMatched);
  // Layer 6 occurs ahead, but beyond the window; the forward pass then goes on as recorded.
  EXPECT_EQ(cursor.OnAcquire(E(6)), AcquireMatch::kUnmatched);
  EXPECT_EQ(cursor.position(), 2u);
  EXPECT_EQ(cursor.OnAcquire(E(2)), AcquireMatch::kMatched);
  EXPECT_EQ(cursor.OnAcquire(E(3)), AcquireMatch::kMatched);
}

TEST(TraceCursor, RepeatOfARecentTensorKeepsThePosition) {
  TraceCursor cursor = MakeCursor(TrainingTrace());
  ASSERT_EQ(cursor.OnAcquire(E(0)), AcquireMatch::kMatched);
  ASSERT_EQ(cursor.OnAcquire(E(1)), AcquireMatch::kMatched);
  // Layer 1 again: its next occurrence is in the backward pass, but it was just used.
  EXPECT_EQ(cursor.OnAcquire(E(1)), AcquireMatch::kUnmatched);
  EXPECT_EQ(cursor.position(), 2u);
  EXPECT_EQ(cursor.OnAcquire(E(2)), AcquireMatch::kMatched);
}

TEST(TraceCursor, RepeatedMismatchesAskForARerecordUntilRestart) {
  TraceCursorOptions options;
  options.rerecord_min_mismatches = 4;
  options.rerecord_mismatch_fraction = 0.25;
  TraceCursor cursor = MakeCursor(TrainingTrace(), options);  // threshold max(4, 0.25 * 16) = 4
  for (uint32_t t : {50u, 51u, 52u}) EXPECT_EQ(cursor.OnAcquire(E(t)), AcquireMatch::kUnmatched);
  EXPECT_FALSE(cursor.ShouldRerecord());
  EXPECT_EQ(cursor.OnAcquire(E(53)), AcquireMatch::kUnmatched);
  EXPECT_TRUE(cursor.ShouldRerecord());
  EXPECT_EQ(cursor.position(), 0u) << "unplaceable acquires never move the cursor";
  cursor.Restart();
  EXPECT_FALSE(cursor.ShouldRerecord());
  EXPECT_EQ(cursor.unmatched(), 4u) << "lifetime counters survive Restart";
}

TEST(TraceCursor, RerecordThresholdScalesWithTheTrace) {
  TraceCursorOptions options;
  options.rerecord_min_mismatches = 1;
  options.rerecord_mismatch_fraction = 0.5;
  TraceCursor cursor = MakeCursor(TrainingTrace(), options);  // threshold 8
  for (uint32_t t = 50; t < 57; ++t) ASSERT_EQ(cursor.OnAcquire(E(t)), AcquireMatch::kUnmatched);
  EXPECT_FALSE(cursor.ShouldRerecord());
  ASSERT_EQ(cursor.OnAcquire(E(57)), AcquireMatch::kUnmatched);
  EXPECT_TRUE(cursor.ShouldRerecord());
}

}  // namespace
}  // namespace zoe::offload
