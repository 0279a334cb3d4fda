// Description: EvictionPolicy: LRU order, pins, OPT by next-use distance with clean-then-LRU tie
// breaks, a policy driven by a real TraceCursor, and the errors (all pinned, misuse).
#include "offload/paging/eviction_policy.h"

#include <gtest/gtest.h>

#include <map>

#include "offload/paging/trace_cursor.h"

namespace zoe::offload {
namespace {

ChunkId C(uint32_t id) { return ChunkId(id); }

EvictionPolicy WithChunks(std::initializer_list<uint32_t> ids, Tier tier = Tier::kDevice) {
  EvictionPolicy policy(tier);
  for (uint32_t id : ids) EXPECT_TRUE(policy.Insert(C(id), false).ok());
  return policy;
}

TEST(EvictionPolicy, LruEvictsTheLeastRecentlyUsed) {
  EvictionPolicy policy = WithChunks({1, 2, 3});
  EXPECT_EQ(*policy.ChooseVictim(), C(1));
  ASSERT_TRUE(policy.Touch(C(1)).ok());
  EXPECT_EQ(*policy.ChooseVictim(), C(2));
  ASSERT_TRUE(policy.Remove(C(2)).ok());
  EXPECT_EQ(*policy.ChooseVictim(), C(3));
  EXPECT_EQ(policy.size(), 2u);
  EXPECT_FALSE(policy.Contains(C(2)));
}

TEST(EvictionPolicy, PinnedChunksAreNeverChosenAndPinsNest) {
  EvictionPolicy policy = WithChunks({1, 2});
  ASSERT_TRUE(policy.Pin(C(1)).ok());
  ASSERT_TRUE(policy.Pin(C(1)).ok());
  EXPECT_TRUE(policy.IsPinned(C(1)));
  EXPECT_EQ(*policy.ChooseVictim(), C(2));
  EXPECT_EQ(policy.evictable(), 1u);
  ASSERT_TRUE(policy.Unpin(C(1)).ok());
  EXPECT_TRUE(policy.IsPinned(C(1)));
  ASSERT_TRUE(policy.Unpin(C(1)).ok());
  EXPECT_FALSE(policy.IsPinned(C(1)));
  // Unpinning counts as a use: chunk 1 is now the most recently used.
  EXPECT_EQ(*policy.ChooseVictim(), C(2));
  ASSERT_TRUE(policy.Touch(C(2)).ok());
  EXPECT_EQ(*policy.ChooseVictim(), C(1));
}

TEST(EvictionPolicy, TouchingAPinnedChunkKeepsItOutOfTheCandidates) {
  EvictionPolicy policy = WithChunks({1, 2});
  ASSERT_TRUE(policy.Pin(C(1)).ok());
  ASSERT_TRUE(policy.Touch(C(1)).ok());
  EXPECT_EQ(policy.evictable(), 1u);
  EXPECT_EQ(*policy.ChooseVictim(), C(2));
}

TEST(EvictionPolicy, AllPinnedIsBusyAndEmptyIsNotFound) {
  EvictionPolicy empty(Tier::kHost);
  Result<ChunkId> none = empty.ChooseVictim();
  EXPECT_EQ(none.status().code(), StatusCode::kNotFound);
  EXPECT_EQ(none.status().message(),
            "no chunk is resident in the host tier, so none can be evicted");
  EvictionPolicy policy = WithChunks({1, 2});
  ASSERT_TRUE(policy.Pin(C(1)).ok());
  ASSERT_TRUE(policy.Pin(C(2)).ok());
  Result<ChunkId> busy = policy.ChooseVictim();
  EXPECT_EQ(busy.status().code(), StatusCode::kBusy);
  EXPECT_EQ(busy.status().message(),
            "all 2 chunks resident in the device tier are pinned; release a tensor or raise the "
            "device budget");
  policy.SetNextUse([](ChunkId) { return uint64_t{5}; });
  EXPECT_EQ(policy.ChooseVictim().status().code(), StatusCode::kBusy);
}

TEST(EvictionPolicy, MisuseIsReportedAndChangesNothing) {
  EvictionPolicy policy = WithChunks({1});
  EXPECT_EQ(policy.Insert(C(1), true).code(), StatusCode::kFailedPrecondition);
  EXPECT_FALSE(policy.IsDirty(C(1)));
  EXPECT_EQ(policy.Remove(C(9)).message(), "remove chunk 9: it is not resident in the device tier");
  EXPECT_EQ(policy.Touch(C(9)).code(), StatusCode::kNotFound);
  EXPECT_EQ(policy.Pin(C(9)).code(), StatusCode::kNotFound);
  EXPECT_EQ(policy.MarkDirty(C(9), true).code(), StatusCode::kNotFound);
  EXPECT_EQ(policy.Unpin(C(1)).message(), "unpin chunk 1 in the device tier: it is not pinned");
  ASSERT_TRUE(policy.Pin(C(1)).ok());
  EXPECT_EQ(policy.Remove(C(1)).message(),
            "remove chunk 1 from the device tier: it is pinned 1 times");
  EXPECT_TRUE(policy.Contains(C(1)));
}

TEST(EvictionPolicy, OptEvictsTheFarthestNextUse) {
  EvictionPolicy policy = WithChunks({1, 2, 3, 4});
  std::map<uint32_t, uint64_t> next_use = {{1, 3}, {2, 10}, {3, 1}, {4, 7}};
  policy.SetNextUse([&](ChunkId c) { return next_use.at(c.value); });
  EXPECT_TRUE(policy.uses_next_use());
  EXPECT_EQ(*policy.ChooseVictim(), C(2));
  next_use[4] = TraceCursor::kNever;
  EXPECT_EQ(*policy.ChooseVictim(), C(4));
  ASSERT_TRUE(policy.Pin(C(4)).ok());
  EXPECT_EQ(*policy.ChooseVictim(), C(2));
  policy.SetNextUse({});
  EXPECT_EQ(*policy.ChooseVictim(), C(1)) << "back to LRU";
}

TEST(EvictionPolicy, OptTiesPreferCleanThenLeastRecentlyUsed) {
  EvictionPolicy policy(Tier::kHost);
  ASSERT_TRUE(policy.Insert(C(1), true).ok());
  ASSERT_TRUE(policy.Insert(C(2), true).ok());
  ASSERT_TRUE(policy.Insert(C(3), false).ok());
  ASSERT_TRUE(policy.Insert(C(4), false).ok());
  policy.SetNextUse([](ChunkId) { return uint64_t{8}; });
  EXPECT_EQ(*policy.ChooseVictim(), C(3)) << "the least recently used clean chunk";
  ASSERT_TRUE(policy.Touch(C(3)).ok());
  EXPECT_EQ(*policy.ChooseVictim(), C(4));
  ASSERT_TRUE(policy.MarkDirty(C(3), true).ok());
  ASSERT_TRUE(policy.MarkDirty(C(4), true).ok());
  EXPECT_EQ(*policy.ChooseVictim(), C(1)) << "all dirty: least recently used";
  ASSERT_TRUE(policy.MarkDirty(C(2), false).ok());
  EXPECT_TRUE(policy.IsDirty(C(1)));
  EXPECT_FALSE(policy.IsDirty(C(2)));
  EXPECT_EQ(*policy.ChooseVictim(), C(2));
  // Never used again beats clean: distance decides first.
  policy.SetNextUse([](ChunkId c) { return c == C(4) ? TraceCursor::kNever : uint64_t{8}; });
  EXPECT_EQ(*policy.ChooseVictim(), C(4));
}

// Belady with a real cursor: a device tier holding three of the five layers of a forward and
// backward pass evicts the layer needed last.
TEST(EvictionPolicy, OptFollowsTheTraceCursor) {
  Trace trace{"step", 0, {}};
  for (uint32_t layer : {0, 1, 2, 3, 4, 4, 3, 2, 1, 0}) {
    trace.events.push_back({TensorId(layer), ChunkId(layer), Access::kRead, 64});
  }
  Result<TraceCursor> cursor = TraceCursor::Create(trace, 5);
  ASSERT_TRUE(cursor.ok());
  EvictionPolicy policy(Tier::kDevice);
  policy.SetNextUse([&](ChunkId c) { return cursor->NextUseDistance(c); });
  for (uint32_t layer : {0, 1, 2}) {
    ASSERT_EQ(cursor->OnAcquire(trace.events[layer]), AcquireMatch::kMatched);
    ASSERT_TRUE(policy.Insert(C(layer), false).ok());
  }
  // Next: 3, 4, 4, 3, 2, 1, 0. Layer 0 is needed last, although it is the LRU choice too.
  EXPECT_EQ(*policy.ChooseVictim(), C(0));
  ASSERT_TRUE(policy.Touch(C(0)).ok());
  EXPECT_EQ(*policy.ChooseVictim(), C(0)) << "recency does not matter, distance does";
  ASSERT_TRUE(policy.Remove(C(0)).ok());
  ASSERT_EQ(cursor->OnAcquire(trace.events[3]), AcquireMatch::kMatched);
  ASSERT_TRUE(policy.Insert(C(3), false).ok());
  EXPECT_EQ(*policy.ChooseVictim(), C(1)) << "of 1, 2 and 3, layer 1 returns last";
}

}  // namespace
}  // namespace zoe::offload
