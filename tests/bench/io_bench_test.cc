// The parts of `zoe bench io` that turn numbers into figures: sweep expansion, latency
// percentiles, fio's command line and JSON, and the report. A wrong figure here would make every
// published comparison wrong, so each is checked against values worked out by hand.
#include "bench/io_bench.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench/io_fio.h"
#include "bench/io_report.h"

namespace zoe::cli {
namespace {

using ::testing::Contains;
using ::testing::HasSubstr;

IoBenchSpec BaseSpec() {
  IoBenchSpec spec;
  spec.dirs = {"/var/tmp"};
  spec.size = uint64_t{64} << 20;
  return spec;
}

TEST(ExpandSweep, FirstAxisVariesSlowest) {
  auto grid = ExpandSweep(BaseSpec(), {"bs=256K,1M", "iodepth=4,16,32"});
  ASSERT_TRUE(grid.ok()) << grid.status().ToString();
  ASSERT_EQ(grid->size(), 6u);
  const std::vector<std::pair<uint64_t, uint32_t>> expected = {
      {256 << 10, 4}, {256 << 10, 16}, {256 << 10, 32}, {1 << 20, 4}, {1 << 20, 16}, {1 << 20, 32}};
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ((*grid)[i].bs, expected[i].first) << i;
    EXPECT_EQ((*grid)[i].iodepth, expected[i].second) << i;
  }
}

TEST(ExpandSweep, NoAxesIsTheBaseSpec) {
  auto grid = ExpandSweep(BaseSpec(), {});
  ASSERT_TRUE(grid.ok());
  ASSERT_EQ(grid->size(), 1u);
  EXPECT_EQ((*grid)[0].bs, BaseSpec().bs);
}

TEST(ExpandSweep, KeysOtherThanSizesAndDepths) {
  auto grid =
      ExpandSweep(BaseSpec(), {"rw=read,randwrite", "jobs=2", "submit_batch=3", "backend=psync"});
  ASSERT_TRUE(grid.ok()) << grid.status().ToString();
  ASSERT_EQ(grid->size(), 2u);
  EXPECT_EQ((*grid)[1].rw, "randwrite");
  EXPECT_EQ((*grid)[1].jobs, 2u);
  EXPECT_EQ((*grid)[1].submit_batch, 3u);
  EXPECT_EQ((*grid)[1].backend, io::BackendKind::kPsync);
}

TEST(ExpandSweep, BadAxesNameWhatWasWrong) {
  auto no_equals = ExpandSweep(BaseSpec(), {"bs"});
  ASSERT_FALSE(no_equals.ok());
  EXPECT_THAT(no_equals.status().message(), HasSubstr("expected key=v1,v2"));

  auto unknown_key = ExpandSweep(BaseSpec(), {"blocksize=1M"});
  ASSERT_FALSE(unknown_key.ok());
  EXPECT_THAT(unknown_key.status().message(), HasSubstr("'blocksize'"));
  EXPECT_THAT(unknown_key.status().message(), HasSubstr("bs, iodepth"));

  auto zero_depth = ExpandSweep(BaseSpec(), {"iodepth=8,0"});
  ASSERT_FALSE(zero_depth.ok());
  EXPECT_THAT(zero_depth.status().message(), HasSubstr("iodepth=0"));

  auto not_a_number = ExpandSweep(BaseSpec(), {"jobs=two"});
  ASSERT_FALSE(not_a_number.ok());
  EXPECT_THAT(not_a_number.status().message(), HasSubstr("jobs=two"));

  // Values are validated as whole specs: a block larger than the file is refused.
  auto too_big = ExpandSweep(BaseSpec(), {"bs=128M"});
  ASSERT_FALSE(too_big.ok());
  EXPECT_THAT(too_big.status().message(), HasSubstr("--size"));

  auto bad_rw = ExpandSweep(BaseSpec(), {"rw=trim"});
  ASSERT_FALSE(bad_rw.ok());
  EXPECT_THAT(bad_rw.status().message(), HasSubstr("trim"));
}

TEST(ValidateSpec, EachRangeIsChecked) {
  IoBenchSpec spec = BaseSpec();
  EXPECT_TRUE(ValidateSpec(spec).ok());
  spec.iodepth = 0;
  EXPECT_THAT(ValidateSpec(spec).message(), HasSubstr("--iodepth 0"));
  spec = BaseSpec();
  spec.jobs = 1000;
  EXPECT_THAT(ValidateSpec(spec).message(), HasSubstr("--jobs 1000"));
  spec = BaseSpec();
  spec.size = spec.bs + 1;
  EXPECT_THAT(ValidateSpec(spec).message(), HasSubstr("multiple of --bs"));
  spec = BaseSpec();
  spec.dirs.clear();
  EXPECT_THAT(ValidateSpec(spec).message(), HasSubstr("--path"));
}

TEST(Percentiles, NearestRankOnKnownValues) {
  // 1..1000 µs in nanoseconds, shuffled: the nearest-rank p-th percentile of 1..N is ceil(p*N).
  std::vector<uint64_t> ns(1000);
  std::iota(ns.begin(), ns.end(), 1);
  for (uint64_t& v : ns) v *= 1000;
  std::shuffle(ns.begin(), ns.end(), std::mt19937(7));
  const LatencyUs lat = Percentiles(ns);
  EXPECT_DOUBLE_EQ(lat.p50, 500);
  EXPECT_DOUBLE_EQ(lat.p90, 900);
  EXPECT_DOUBLE_EQ(lat.p99, 990);
  EXPECT_DOUBLE_EQ(lat.p999, 999);
  EXPECT_DOUBLE_EQ(lat.max, 1000);
}

TEST(Percentiles, SmallAndEmptySamples) {
  const LatencyUs one = Percentiles({5000});
  EXPECT_DOUBLE_EQ(one.p50, 5);
  EXPECT_DOUBLE_EQ(one.p999, 5);
  EXPECT_DOUBLE_EQ(one.max, 5);
  // Two samples: the median is the lower one (rank ceil(0.5 * 2) = 1), p90 the upper one.
  const LatencyUs two = Percentiles({3000, 1000});
  EXPECT_DOUBLE_EQ(two.p50, 1);
  EXPECT_DOUBLE_EQ(two.p90, 3);
  const LatencyUs none = Percentiles({});
  EXPECT_DOUBLE_EQ(none.p50, 0);
  EXPECT_DOUBLE_EQ(none.max, 0);
}

// What fio 3.33 prints for a read job (trimmed to the fields zoe reads), after a warning line
// that fio writes before its JSON.
constexpr char kFioReadJson[] = R"(fio: note: a warning before the document
{
 "fio version": "fio-3.33",
 "jobs": [
  {
   "jobname": "job0",
   "read": {
    "bw_bytes": 113359567,
    "iops": 108.108108,
    "clat_ns": {
     "percentile": {
      "50.000000": 2670592,
      "90.000000": 26869760,
      "99.000000": 26869760,
      "99.900000": 26900000
     }
    },
    "lat_ns": {"max": 26922416}
   },
   "write": {"bw_bytes": 0, "iops": 0}
  }
 ]
})";

TEST(ParseFioJson, ReadsThroughputAndLatencyOfTheRightSide) {
  auto read = ParseFioJson(kFioReadJson, /*write=*/false);
  ASSERT_TRUE(read.ok()) << read.status().ToString();
  EXPECT_DOUBLE_EQ(read->bw_bytes, 113359567);
  EXPECT_DOUBLE_EQ(read->iops, 108.108108);
  EXPECT_DOUBLE_EQ(read->lat.p50, 2670.592);
  EXPECT_DOUBLE_EQ(read->lat.p90, 26869.76);
  EXPECT_DOUBLE_EQ(read->lat.p999, 26900);
  EXPECT_DOUBLE_EQ(read->lat.max, 26922.416);

  auto write = ParseFioJson(kFioReadJson, /*write=*/true);
  ASSERT_TRUE(write.ok());
  EXPECT_DOUBLE_EQ(write->bw_bytes, 0);
}

TEST(ParseFioJson, RejectsOutputWithoutJobs) {
  EXPECT_FALSE(ParseFioJson("fio: engine io_uring not loadable", false).ok());
  EXPECT_FALSE(ParseFioJson("{\"jobs\": []}", false).ok());
  EXPECT_FALSE(ParseFioJson("{\"jobs\": [ {", false).ok());
}

TEST(FioArguments, MirrorTheZoeJob) {
  IoBenchSpec spec = BaseSpec();
  spec.rw = "randwrite";
  spec.bs = 256 << 10;
  spec.iodepth = 32;
  spec.jobs = 2;
  const auto args = FioArguments("/usr/bin/fio", spec, "io_uring", {{"/d/a0"}, {"/d/a1", "/e/b1"}});
  ASSERT_FALSE(args.empty());
  EXPECT_EQ(args.front(), "/usr/bin/fio");
  EXPECT_THAT(args, Contains("--rw=randwrite"));
  EXPECT_THAT(args, Contains("--bs=262144"));
  EXPECT_THAT(args, Contains("--iodepth=32"));
  EXPECT_THAT(args, Contains("--ioengine=io_uring"));
  EXPECT_THAT(args, Contains("--direct=1"));
  EXPECT_THAT(args, Contains("--output-format=json"));
  EXPECT_THAT(args, Contains("--filename=/d/a0"));
  EXPECT_THAT(args, Contains("--filename=/d/a1:/e/b1"));
}

TEST(FioEngineFor, MapsEveryBackend) {
  EXPECT_EQ(FioEngineFor("io_uring"), "io_uring");
  EXPECT_EQ(FioEngineFor("libaio"), "libaio");
  EXPECT_EQ(FioEngineFor("psync"), "psync");
}

TEST(Report, JsonCarriesTheRatioToFio) {
  IoBenchRow row;
  row.zoe.spec = BaseSpec();
  row.zoe.backend = "io_uring";
  row.zoe.bw_bytes = 3e9;
  FioResult fio;
  fio.ioengine = "io_uring";
  fio.bw_bytes = 2e9;
  row.fio = fio;
  const auto doc = ToJson({row});
  EXPECT_EQ(doc["schema_version"], 1);
  ASSERT_EQ(doc["jobs"].size(), 1u);
  EXPECT_DOUBLE_EQ(doc["jobs"][0]["fio"]["ratio"].get<double>(), 1.5);
  EXPECT_EQ(doc["jobs"][0]["backend"], "io_uring");

  IoBenchRow without_fio = row;
  without_fio.fio.reset();
  EXPECT_FALSE(ToJson({without_fio})["jobs"][0].contains("fio"));
}

TEST(Report, FormatBytesPicksTheLargestExactUnit) {
  EXPECT_EQ(FormatBytes(1 << 20), "1 MiB");
  EXPECT_EQ(FormatBytes(256 << 10), "256 KiB");
  EXPECT_EQ(FormatBytes(1536), "1536 B");
}

}  // namespace
}  // namespace zoe::cli
