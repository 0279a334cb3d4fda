// Description: offload Stats: links between neighbouring tiers, counters, occupancy peaks,
// concurrent updates from several threads, reset and the JSON dump.
#include "offload/stats.h"

#include <gtest/gtest.h>

#include <thread>
#include <vector>

namespace zoe::offload {
namespace {

TEST(Stats, LinksExistOnlyBetweenNeighbours) {
  EXPECT_EQ(*LinkBetween(Tier::kDevice, Tier::kHost), Link::kDeviceToHost);
  EXPECT_EQ(*LinkBetween(Tier::kHost, Tier::kDevice), Link::kHostToDevice);
  EXPECT_EQ(*LinkBetween(Tier::kHost, Tier::kNvme), Link::kHostToNvme);
  EXPECT_EQ(*LinkBetween(Tier::kNvme, Tier::kHost), Link::kNvmeToHost);
  Result<Link> skip = LinkBetween(Tier::kDevice, Tier::kNvme);
  EXPECT_EQ(skip.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(
      skip.status().message(),
      "no link from device to nvme; data moves only between neighbours: device<->host<->nvme");
  EXPECT_FALSE(LinkBetween(Tier::kHost, Tier::kHost).ok());
  EXPECT_EQ(LinkName(Link::kNvmeToHost), "nvme_to_host");
}

TEST(Stats, CountersAccumulate) {
  Stats stats;
  stats.AddTransfer(Link::kNvmeToHost, 4096);
  stats.AddTransfer(Link::kNvmeToHost, 8192);
  stats.AddTransfer(Link::kHostToDevice, 100);
  stats.AddPrefetchIssued(3);
  stats.AddPrefetchHit();
  stats.AddPrefetchHit();
  stats.AddPrefetchMiss();
  stats.AddStall(1500);
  stats.AddEviction(Tier::kDevice, false);
  stats.AddEviction(Tier::kHost, true);
  stats.AddTraceMatched();
  stats.AddTraceResynced();
  stats.AddTraceUnmatched();
  StatsSnapshot s = stats.Snapshot();
  EXPECT_EQ(s.links[static_cast<size_t>(Link::kNvmeToHost)].bytes, 12288u);
  EXPECT_EQ(s.links[static_cast<size_t>(Link::kNvmeToHost)].transfers, 2u);
  EXPECT_EQ(s.links[static_cast<size_t>(Link::kHostToDevice)].bytes, 100u);
  EXPECT_EQ(s.links[static_cast<size_t>(Link::kDeviceToHost)].transfers, 0u);
  EXPECT_EQ(s.prefetches_issued, 3u);
  EXPECT_EQ(s.prefetch_hits, 2u);
  EXPECT_EQ(s.prefetch_misses, 1u);
  EXPECT_EQ(s.stall_nanoseconds, 1500u);
  EXPECT_EQ(s.stalls, 1u);
  EXPECT_EQ(s.tiers[0].evictions_clean, 1u);
  EXPECT_EQ(s.tiers[1].evictions_dirty, 1u);
  EXPECT_EQ(s.trace_matched + s.trace_resynced + s.trace_unmatched, 3u);
}

TEST(Stats, OccupancyTracksItsPeakAndRejectsUnderflow) {
  Stats stats;
  stats.AddOccupancy(Tier::kDevice, 100);
  stats.AddOccupancy(Tier::kDevice, 50);
  ASSERT_TRUE(stats.SubtractOccupancy(Tier::kDevice, 120).ok());
  StatsSnapshot s = stats.Snapshot();
  EXPECT_EQ(s.tiers[0].occupancy_bytes, 30u);
  EXPECT_EQ(s.tiers[0].peak_occupancy_bytes, 150u);
  Status under = stats.SubtractOccupancy(Tier::kDevice, 31);
  EXPECT_EQ(under.code(), StatusCode::kInternal);
  EXPECT_EQ(under.message(), "device tier occupancy of 30 bytes cannot drop by 31 bytes");
  EXPECT_EQ(stats.Snapshot().tiers[0].occupancy_bytes, 0u);
}

TEST(Stats, ResetKeepsOccupancyAndRestartsThePeak) {
  Stats stats;
  stats.AddOccupancy(Tier::kHost, 500);
  ASSERT_TRUE(stats.SubtractOccupancy(Tier::kHost, 300).ok());
  stats.AddTransfer(Link::kHostToNvme, 9);
  stats.AddPrefetchMiss();
  stats.Reset();
  StatsSnapshot s = stats.Snapshot();
  EXPECT_EQ(s.tiers[1].occupancy_bytes, 200u);
  EXPECT_EQ(s.tiers[1].peak_occupancy_bytes, 200u);
  EXPECT_EQ(s.links[static_cast<size_t>(Link::kHostToNvme)].bytes, 0u);
  EXPECT_EQ(s.prefetch_misses, 0u);
}

TEST(Stats, ConcurrentUpdatesAreNotLost) {
  Stats stats;
  constexpr int kThreads = 4;
  constexpr int kPerThread = 5000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < kPerThread; ++i) {
        stats.AddTransfer(Link::kDeviceToHost, 2);
        stats.AddPrefetchHit();
        stats.AddOccupancy(Tier::kNvme, 8);
        EXPECT_TRUE(stats.SubtractOccupancy(Tier::kNvme, 8).ok());
      }
    });
  }
  for (std::thread& t : threads) t.join();
  StatsSnapshot s = stats.Snapshot();
  EXPECT_EQ(s.links[0].bytes, uint64_t{2} * kThreads * kPerThread);
  EXPECT_EQ(s.links[0].transfers, uint64_t{kThreads} * kPerThread);
  EXPECT_EQ(s.prefetch_hits, uint64_t{kThreads} * kPerThread);
  EXPECT_EQ(s.tiers[2].occupancy_bytes, 0u);
  EXPECT_GE(s.tiers[2].peak_occupancy_bytes, 8u);
  EXPECT_LE(s.tiers[2].peak_occupancy_bytes, uint64_t{8} * kThreads);
}

TEST(Stats, JsonDumpHasEveryCounter) {
  Stats stats;
  stats.AddTransfer(Link::kHostToNvme, 4096);
  stats.AddPrefetchHit();
  stats.AddPrefetchHit();
  stats.AddPrefetchHit();
  stats.AddPrefetchMiss();
  stats.AddStall(250);
  stats.AddEviction(Tier::kHost, true);
  stats.AddOccupancy(Tier::kDevice, 64);
  stats.AddTraceResynced();
  const nlohmann::json j = stats.ToJson();
  EXPECT_EQ(j["schema_version"], 1);
  EXPECT_EQ(j["links"]["host_to_nvme"]["bytes"], 4096);
  EXPECT_EQ(j["links"]["host_to_nvme"]["transfers"], 1);
  EXPECT_EQ(j["links"]["device_to_host"]["bytes"], 0);
  EXPECT_EQ(j["links"].size(), 4u);
  EXPECT_EQ(j["tiers"]["host"]["evictions_dirty"], 1);
  EXPECT_EQ(j["tiers"]["device"]["occupancy_bytes"], 64);
  EXPECT_EQ(j["tiers"]["device"]["peak_occupancy_bytes"], 64);
  EXPECT_EQ(j["tiers"].size(), 3u);
  EXPECT_EQ(j["prefetch"]["hits"], 3);
  EXPECT_EQ(j["prefetch"]["misses"], 1);
  EXPECT_DOUBLE_EQ(j["prefetch"]["hit_rate"].get<double>(), 0.75);
  EXPECT_EQ(j["stall"]["nanoseconds"], 250);
  EXPECT_EQ(j["trace"]["resynced"], 1);
  EXPECT_DOUBLE_EQ(StatsToJson(StatsSnapshot{})["prefetch"]["hit_rate"].get<double>(), 0.0);
}

}  // namespace
}  // namespace zoe::offload
