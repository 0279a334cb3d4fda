// Covers PipelineBufferPool: each transition's source and target state, the order buffers are
// chosen in (newest free taken, oldest read consumed, oldest write collected) and the cache.
#include <gtest/gtest.h>

#include "offload/optimizer/pipeline_buffer_pool.h"

namespace zoe::offload {
namespace {

PipelineBufferPool MakePool(size_t buffers) {
  PipelineBufferPool pool;
  for (size_t b = 0; b < buffers; ++b) pool.Add(PinnedBuffer(), 4);
  return pool;
}

TEST(PipelineBufferPoolTest, StartsFreeAndTakesTheNewestFreeFirst) {
  PipelineBufferPool pool = MakePool(3);
  EXPECT_EQ(pool.count(BufferState::kFree), 3u);
  EXPECT_EQ(pool.sums(0).size(), 4u);
  EXPECT_EQ(pool.NewestFree(), 2u);
  pool.StartRead(2, /*chunk=*/7, /*version=*/1, /*ticket=*/11);
  EXPECT_EQ(pool.NewestFree(), 1u);
  pool.Release(2);
  EXPECT_EQ(pool.NewestFree(), 2u);
}

TEST(PipelineBufferPoolTest, ReadHoldWriteCollect) {
  PipelineBufferPool pool = MakePool(2);
  pool.StartRead(1, 5, 3, 21);
  EXPECT_EQ(pool[1].state, BufferState::kReading);
  EXPECT_EQ(pool.OldestRead(), 1u);
  pool.Hold(1);
  EXPECT_EQ(pool[1].state, BufferState::kHolding);
  EXPECT_EQ(pool[1].read_ticket, 0u);
  EXPECT_FALSE(pool.OldestRead().has_value());
  pool.StartWrite(1, 22);
  EXPECT_EQ(pool[1].state, BufferState::kWriting);
  EXPECT_EQ(pool[1].written_chunk, 5u);
  EXPECT_EQ(pool.OldestFreeingWrite(), 1u);
  pool.CollectWrite(1);
  EXPECT_EQ(pool[1].state, BufferState::kWritten);
  EXPECT_TRUE(pool.IsFree(1));
  EXPECT_EQ(pool.NewestFree(), 1u);
}

TEST(PipelineBufferPoolTest, ReadsAreConsumedAndWritesCollectedOldestFirst) {
  PipelineBufferPool pool = MakePool(3);
  pool.StartRead(2, 0, 0, 1);
  pool.StartRead(0, 1, 0, 2);
  pool.StartRead(1, 2, 0, 3);
  EXPECT_EQ(pool.OldestRead(), 2u);
  pool.Hold(2);
  EXPECT_EQ(pool.OldestRead(), 0u);
  pool.Hold(0);
  pool.StartWrite(0, 4);
  pool.StartWrite(2, 5);
  EXPECT_EQ(pool.OldestFreeingWrite(), 0u);
  EXPECT_EQ(pool.Writes(), (std::vector<size_t>{0, 2}));
}

TEST(PipelineBufferPoolTest, AReadBehindAWriteIsHandedOnAndFollowsIt) {
  PipelineBufferPool pool = MakePool(2);
  pool.StartRead(0, 3, 1, 1);
  pool.Hold(0);
  pool.StartWrite(0, 2);
  pool.StartRead(1, 4, 1, 3);
  pool.QueueReadBehindWrite(0, /*chunk=*/5, /*version=*/2, /*ticket=*/4);
  EXPECT_EQ(pool[0].state, BufferState::kWritingThenReading);
  EXPECT_EQ(pool[0].written_chunk, 3u);
  EXPECT_EQ(pool[0].chunk, 5u);
  // Its write frees no buffer, and its read comes after the reads started before it.
  EXPECT_FALSE(pool.OldestFreeingWrite().has_value());
  EXPECT_EQ(pool.Writes(), (std::vector<size_t>{0}));
  EXPECT_EQ(pool.OldestWrite(), 0u);
  EXPECT_EQ(pool.OldestRead(), 1u);
  pool.Hold(1);
  EXPECT_EQ(pool.OldestRead(), 0u);
  pool.CollectWrite(0);
  EXPECT_EQ(pool[0].state, BufferState::kReading);
  EXPECT_EQ(pool[0].read_ticket, 4u);
  EXPECT_FALSE(pool.IsFree(0));
}

TEST(PipelineBufferPoolTest, PrefetchedReadsWaitUntilAdoptedInOrder) {
  PipelineBufferPool pool = MakePool(3);
  pool.StartPrefetch(0, 8, 1, 1);
  pool.StartPrefetch(2, 9, 1, 0);  // a claimed cached copy
  EXPECT_EQ(pool.count(BufferState::kPrefetched), 2u);
  EXPECT_EQ(pool.Prefetched(), (std::vector<size_t>{0, 2}));
  EXPECT_FALSE(pool.OldestRead().has_value());
  pool.AdoptPrefetched(2);
  EXPECT_EQ(pool.OldestRead(), 2u);
  EXPECT_EQ(pool.Prefetched(), (std::vector<size_t>{0}));
}

TEST(PipelineBufferPoolTest, CacheIsFoundKeptAndDropped) {
  PipelineBufferPool pool = MakePool(3);
  pool.StartPrefetch(0, 4, 7, 1);
  pool.ReleaseCaching(0);
  EXPECT_EQ(pool[0].state, BufferState::kCached);
  EXPECT_EQ(pool.FindCached(4, 7), 0u);
  EXPECT_FALSE(pool.FindCached(4, 8).has_value());
  // Overwriting prefers the oldest free buffer holding no cached chunk.
  EXPECT_EQ(pool.FreeToOverwrite(), 1u);
  pool.StartRead(1, 0, 0, 2);
  pool.StartRead(2, 1, 0, 3);
  EXPECT_EQ(pool.FreeToOverwrite(), 0u);
  pool.DropCache(0);
  EXPECT_EQ(pool[0].state, BufferState::kFree);
  EXPECT_FALSE(pool.FindCached(4, 7).has_value());
}

TEST(PipelineBufferPoolTest, WrittenBuffersBecomeTheCacheOrAreForgotten) {
  PipelineBufferPool pool = MakePool(2);
  for (size_t b = 0; b < 2; ++b) {
    pool.StartRead(b, 10 + b, 0, 1 + b);
    pool.Hold(b);
    pool.StartWrite(b, 5 + b);
    pool.CollectWrite(b);
  }
  pool.CommitWritten([](size_t chunk) { return chunk * 2; });
  EXPECT_EQ(pool.FindCached(10, 20), 0u);
  EXPECT_EQ(pool.FindCached(11, 22), 1u);
  pool.StartRead(0, 12, 0, 9);
  pool.Hold(0);
  pool.StartWrite(0, 10);
  pool.CollectWrite(0);
  pool.ForgetWritten();
  EXPECT_EQ(pool[0].state, BufferState::kFree);
  EXPECT_EQ(pool[1].state, BufferState::kCached);
}

TEST(PipelineBufferPoolTest, EveryStateHasAName) {
  EXPECT_EQ(BufferStateName(BufferState::kWritingThenReading), "writing-then-reading");
  EXPECT_EQ(BufferStateName(BufferState::kFree), "free");
}

}  // namespace
}  // namespace zoe::offload
