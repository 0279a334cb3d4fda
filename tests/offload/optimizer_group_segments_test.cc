// Description: OptimizerGroup segments and absent gradients — segments without a gradient stay
// byte-identical (state, step count, parameter views) and unread on NVMe, every present segment
// takes its own bias correction exactly as an in-memory per-segment reference, on HOST and NVMe,
// given with the step or through AccumulateGrad; per-segment step counts survive a checkpoint
// round trip and older checkpoints still load; invalid absent ranges, segments and step counts
// are refused; an injected fault leaves the step counts as they were.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "offload/checkpoint/checkpoint_store.h"
#include "offload/optimizer/optimizer_group.h"
#include "tests/offload/optimizer_group_harness.h"

namespace zoe::offload {
namespace {

using optim::DType;
using testing::Bits;
using testing::GroupHarness;
using testing::HarnessOptions;
using testing::LoadFrom;
using testing::SaveTo;
using testing::StateBits;
using testing::TempDir;

// 100003 elements in chunks of 16384: segment 1 holds chunk 1 ([16384, 32768)) whole, segment
// 2 has 7 elements, segment 4 ends the group mid-chunk.
const std::vector<size_t> kSegments = {10000, 30000, 7, 19993, 40003};
constexpr size_t kChunkElements = 16384;

// Which segments have a gradient at step `step`: segment 1 on odd steps only, segment 2 from
// step 5 on (never before: its count starts late), segment 3 two steps out of three.
std::vector<bool> PresentAt(int step) {
  return {true, step % 2 == 1, step >= 5, step % 3 != 0, true};
}

HarnessOptions SegmentOptions(Tier placement, double ratio = 1.0) {
  HarnessOptions options;
  options.group.placement = placement;
  options.group.nvme_ratio = ratio;
  options.group.segments = kSegments;
  options.inject_faults = true;
  return options;
}

size_t SegmentBegin(size_t segment) {
  size_t begin = 0;
  for (size_t s = 0; s < segment; ++s) begin += kSegments[s];
  return begin;
}

// fp32 state bytes (master, m, v, each region 4096-aligned) of the chunks that hold an element
// of a present segment.
uint64_t PresentChunkStateBytes(size_t count, const std::vector<bool>& present) {
  uint64_t bytes = 0;
  for (size_t first = 0; first < count; first += kChunkElements) {
    const size_t end = std::min(count, first + kChunkElements);
    bool any = false;
    for (size_t s = 0; s < kSegments.size(); ++s) {
      const size_t begin = SegmentBegin(s);
      any = any || (present[s] && begin < end && begin + kSegments[s] > first);
    }
    const uint64_t region = ((end - first) * sizeof(float) + 4095) / 4096 * 4096;
    if (any) bytes += 3 * region;
  }
  return bytes;
}

// Gradient views of the harness's gradients: a present segment as two views cut mid-segment
// (views need not follow segments), an absent one as a view with null data.
std::vector<GradView> SegmentViews(const GroupHarness& harness, const std::vector<bool>& present) {
  std::vector<GradView> views;
  const auto* grads = reinterpret_cast<const float*>(harness.grads());
  for (size_t s = 0; s < kSegments.size(); ++s) {
    const size_t begin = SegmentBegin(s);
    if (!present[s]) {
      views.push_back({nullptr, DType::kFloat32, kSegments[s]});
      continue;
    }
    const size_t half = kSegments[s] / 2;
    views.push_back({grads + begin, DType::kFloat32, half});
    views.push_back({grads + begin + half, DType::kFloat32, kSegments[s] - half});
  }
  return views;
}

// The in-memory reference: per-segment step counts and bias correction, absent segments
// untouched and counted as zeros in the scan (the group's scan is that of one buffer).
class SegmentReference {
 public:
  explicit SegmentReference(const GroupHarness& harness)
      : run_(harness.group_options().run),
        max_grad_norm_(harness.group_options().max_grad_norm),
        master_(testing::Decode(harness.initial_params().data(), DType::kFloat32, harness.count())),
        exp_avg_(harness.count(), 0.0f),
        exp_avg_sq_(harness.count(), 0.0f),
        steps_(kSegments.size(), 0) {
    run_.executor = nullptr;
  }

  void Step(const optim::HyperParams& hyper, const GroupHarness& harness,
            const std::vector<bool>& present) {
    std::vector<float> grads(master_.size());
    std::memcpy(grads.data(), harness.grads(), grads.size() * sizeof(float));
    for (size_t s = 0; s < kSegments.size(); ++s) {
      if (!present[s]) std::fill_n(grads.begin() + SegmentBegin(s), kSegments[s], 0.0f);
    }
    Result<optim::GradScan> scan =
        optim::ScanGradients(grads.data(), DType::kFloat32, grads.size(), run_);
    ASSERT_TRUE(scan.ok());
    Result<optim::StepScaling> scaling = optim::MakeStepScaling(*scan, 1.0, max_grad_norm_);
    ASSERT_TRUE(scaling.ok());
    grad_norm_ = scaling->grad_norm;
    for (size_t s = 0; s < kSegments.size(); ++s) {
      if (!present[s]) continue;
      const size_t begin = SegmentBegin(s);
      optim::ChunkBuffers buffers;
      buffers.master = master_.data() + begin;
      buffers.grad = grads.data() + begin;
      buffers.exp_avg = exp_avg_.data() + begin;
      buffers.exp_avg_sq = exp_avg_sq_.data() + begin;
      buffers.count = kSegments[s];
      ASSERT_TRUE(optim::UpdateChunk(hyper, ++steps_[s], {}, buffers, scaling->scaling, run_).ok());
    }
  }

  StateBits State() const { return {Bits(master_), Bits(exp_avg_), Bits(exp_avg_sq_)}; }
  std::vector<std::byte> Params() const {
    std::vector<std::byte> bytes(master_.size() * sizeof(float));
    std::memcpy(bytes.data(), master_.data(), bytes.size());
    return bytes;
  }
  const std::vector<int64_t>& steps() const { return steps_; }
  double grad_norm() const { return grad_norm_; }

 private:
  optim::RunOptions run_;
  double max_grad_norm_;
  std::vector<float> master_;
  std::vector<float> exp_avg_;
  std::vector<float> exp_avg_sq_;
  std::vector<int64_t> steps_;
  double grad_norm_ = 0.0;
};

Result<StepReport> StepWithViews(GroupHarness& harness, const optim::HyperParams& hyper,
                                 const std::vector<GradView>& grads) {
  const std::vector<ParamView> params = harness.param_views();
  StepArgs args;
  args.hyper = hyper;
  args.grads = grads;
  args.params = params;
  return harness.group().Step(args);
}

// Bits of elements [begin, begin + length) of every state array.
StateBits Slice(const StateBits& state, size_t begin, size_t length) {
  StateBits out;
  for (const auto& array : state) {
    out.emplace_back(array.begin() + begin, array.begin() + begin + length);
  }
  return out;
}

std::vector<int64_t> SegmentSteps(const OptimizerGroup& group) {
  return {group.segment_steps().begin(), group.segment_steps().end()};
}

struct PlacementCase {
  std::string name;
  Tier placement;
  double ratio;
  bool accumulate;  // gradients through AccumulateGrad instead of with the step
};

class OptimizerGroupSegmentsTest : public ::testing::TestWithParam<PlacementCase> {};

TEST_P(OptimizerGroupSegmentsTest, AbsentSegmentsStayAsTheyWereAndPresentOnesMatchTheReference) {
  const PlacementCase& c = GetParam();
  GroupHarness harness(SegmentOptions(c.placement, c.ratio));
  ASSERT_TRUE(harness.ok());
  SegmentReference reference(harness);
  for (int step = 0; step < 12; ++step) {  // two periods of PresentAt
    const std::vector<bool> present = PresentAt(step);
    harness.NewGradients(step);
    const StateBits before = harness.Snapshot();
    const std::vector<std::byte> params_before = harness.params_bytes();
    const std::vector<GradView> views = SegmentViews(harness, present);
    if (c.accumulate) {
      size_t offset = 0;
      for (const GradView& view : views) {
        ASSERT_TRUE(harness.group().AccumulateGrad(offset, view).ok());
        offset += view.count;
      }
    }
    Result<StepReport> report =
        StepWithViews(harness, harness.Hyper(step), c.accumulate ? std::vector<GradView>() : views);
    ASSERT_TRUE(report.ok()) << "step " << step << ": " << report.status().ToString();
    reference.Step(harness.Hyper(step), harness, present);
    ASSERT_FALSE(report->skipped);
    EXPECT_EQ(report->grad_norm, reference.grad_norm()) << "step " << step;
    EXPECT_EQ(report->steps_taken, step + 1);
    EXPECT_EQ(report->segments_updated,
              static_cast<size_t>(std::count(present.begin(), present.end(), true)));
    EXPECT_EQ(SegmentSteps(harness.group()), reference.steps()) << "step " << step;

    const StateBits after = harness.Snapshot();
    const std::vector<std::byte> params_after = harness.params_bytes();
    for (size_t s = 0; s < kSegments.size(); ++s) {
      if (present[s]) continue;
      const size_t begin = SegmentBegin(s);
      EXPECT_EQ(Slice(after, begin, kSegments[s]), Slice(before, begin, kSegments[s]))
          << "step " << step << ": absent segment " << s << " changed";
      EXPECT_EQ(0, std::memcmp(params_after.data() + begin * sizeof(float),
                               params_before.data() + begin * sizeof(float),
                               kSegments[s] * sizeof(float)))
          << "step " << step << ": parameters of absent segment " << s << " written";
    }
    ASSERT_EQ(after, reference.State()) << "step " << step;
    EXPECT_EQ(params_after, reference.Params()) << "step " << step;

    // A chunk inside absent segments (chunk 1 without segment 1) is neither read nor written.
    if (c.placement == Tier::kNvme && c.ratio == 1.0) {
      const uint64_t expected = PresentChunkStateBytes(harness.count(), present);
      EXPECT_EQ(report->bytes_written, expected) << "step " << step;
      EXPECT_EQ(report->bytes_read + report->bytes_reused, expected) << "step " << step;
    }
  }
}

const PlacementCase kPlacementCases[] = {
    {"host", Tier::kHost, 1.0, false},
    {"nvme", Tier::kNvme, 1.0, false},
    {"nvme_accumulated", Tier::kNvme, 1.0, true},
    {"nvme_half_host_half", Tier::kNvme, 0.5, false},
};

INSTANTIATE_TEST_SUITE_P(Placements, OptimizerGroupSegmentsTest,
                         ::testing::ValuesIn(kPlacementCases),
                         [](const auto& param_info) { return param_info.param.name; });

TEST(OptimizerGroupSegmentsTest, WithoutSegmentsTheGroupIsOneSegment) {
  HarnessOptions options;
  GroupHarness harness(options);
  ASSERT_TRUE(harness.ok());
  EXPECT_EQ(harness.group().segment_count(), 1u);
  harness.NewGradients(0);
  ASSERT_TRUE(harness.Step(harness.Hyper(0)).ok());
  EXPECT_EQ(SegmentSteps(harness.group()), std::vector<int64_t>{1});
  harness.group().set_steps_taken(7);
  EXPECT_EQ(SegmentSteps(harness.group()), std::vector<int64_t>{7});
}

TEST(OptimizerGroupSegmentsTest, AStepWithEveryGradientAbsentChangesNothing) {
  GroupHarness harness(SegmentOptions(Tier::kNvme));
  ASSERT_TRUE(harness.ok());
  harness.NewGradients(0);
  const StateBits before = harness.Snapshot();
  Result<StepReport> report =
      StepWithViews(harness, harness.Hyper(0), SegmentViews(harness, std::vector(5, false)));
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_FALSE(report->skipped);
  EXPECT_EQ(report->grad_norm, 0.0);
  EXPECT_EQ(report->steps_taken, 0);
  EXPECT_EQ(report->segments_updated, 0u);
  EXPECT_EQ(report->bytes_read, 0u);
  EXPECT_EQ(report->bytes_written, 0u);
  EXPECT_EQ(harness.Snapshot(), before);
  EXPECT_EQ(SegmentSteps(harness.group()), std::vector<int64_t>(5, 0));
}

// Views of the initial parameters per segment, those of the segments `given` says, the others
// absent (null data).
std::vector<ParamView> InitialViewsOf(const GroupHarness& harness, const std::vector<bool>& given) {
  // Initial views are only read; ParamView's data is writable for the steps' views.
  auto* initial =
      const_cast<float*>(reinterpret_cast<const float*>(harness.initial_params().data()));
  std::vector<ParamView> views;
  for (size_t s = 0; s < kSegments.size(); ++s) {
    views.push_back(
        {given[s] ? initial + SegmentBegin(s) : nullptr, DType::kFloat32, kSegments[s]});
  }
  return views;
}

TEST(OptimizerGroupSegmentsTest, AbsentInitialValuesStartAtZeroAndWriteStateGivesThem) {
  // A group created with segments 0, 2 and 4 absent, which WriteState then fills one segment at
  // a time, equals the group created from every value, before and after steps.
  GroupHarness reference(SegmentOptions(Tier::kNvme));
  GroupHarness harness(SegmentOptions(Tier::kNvme), /*create=*/false);
  ASSERT_TRUE(reference.ok() && harness.ok());
  const std::vector<bool> given = {false, true, false, true, false};
  Result<std::unique_ptr<OptimizerGroup>> group =
      harness.CreateGroupFrom(harness.group_options(), InitialViewsOf(harness, given));
  ASSERT_TRUE(group.ok()) << group.status().ToString();
  harness.Adopt(std::move(group).value());
  std::vector<float> master(harness.count());
  ASSERT_TRUE(harness.group().ReadState(StateSlot::kMaster, 0, master).ok());
  const auto* initial = reinterpret_cast<const float*>(harness.initial_params().data());
  for (size_t s = 0; s < kSegments.size(); ++s) {
    const size_t begin = SegmentBegin(s);
    for (size_t i = begin; i < begin + kSegments[s]; ++i) {
      ASSERT_EQ(master[i], given[s] ? initial[i] : 0.0f) << "element " << i;
    }
    if (given[s]) continue;
    ASSERT_TRUE(harness.group()
                    .WriteState(StateSlot::kMaster, begin,
                                std::span<const float>(initial + begin, kSegments[s]))
                    .ok());
  }
  EXPECT_EQ(harness.Snapshot(), reference.Snapshot());
  for (int step = 0; step < 2; ++step) {
    reference.NewGradients(step);
    harness.NewGradients(step);
    ASSERT_TRUE(reference.Step(reference.Hyper(step)).ok());
    ASSERT_TRUE(harness.Step(harness.Hyper(step)).ok());
  }
  EXPECT_EQ(harness.Snapshot(), reference.Snapshot());
}

TEST(OptimizerGroupSegmentsTest, AbsentParameterViewsAreNotWrittenAndTheStateIsTheSame) {
  // One step with every parameter view, one with segments 1 and 3's views absent: the same state,
  // the same parameters where written, and the initial values where not (fp32 and int8 moments,
  // whose cut blocks go through staging).
  for (const DType moments : {DType::kFloat32, DType::kInt8}) {
    HarnessOptions options = SegmentOptions(Tier::kNvme);
    options.group.state_dtype = moments;
    GroupHarness full(options);
    GroupHarness partial(options);
    ASSERT_TRUE(full.ok() && partial.ok());
    full.NewGradients(0);
    partial.NewGradients(0);
    const std::vector<GradView> grads = full.grad_views();
    ASSERT_TRUE(StepWithViews(full, full.Hyper(0), grads).ok());
    auto* base = static_cast<float*>(partial.param_views().front().data);
    std::vector<ParamView> views;
    for (size_t s = 0; s < kSegments.size(); ++s) {
      const bool written = s != 1 && s != 3;
      views.push_back({written ? base + SegmentBegin(s) : nullptr, DType::kFloat32, kSegments[s]});
    }
    StepArgs args;
    args.hyper = partial.Hyper(0);
    const std::vector<GradView> partial_grads = partial.grad_views();
    args.grads = partial_grads;
    args.params = views;
    Result<StepReport> report = partial.group().Step(args);
    ASSERT_TRUE(report.ok()) << report.status().ToString();
    EXPECT_EQ(partial.Snapshot(), full.Snapshot()) << DTypeName(moments);
    const std::vector<std::byte> full_params = full.params_bytes();
    const auto* stepped = reinterpret_cast<const float*>(full_params.data());
    const auto* initial = reinterpret_cast<const float*>(partial.initial_params().data());
    for (size_t s = 0; s < kSegments.size(); ++s) {
      const bool written = s != 1 && s != 3;
      const size_t begin = SegmentBegin(s);
      for (size_t i = begin; i < begin + kSegments[s]; ++i) {
        ASSERT_EQ(base[i], written ? stepped[i] : initial[i]) << DTypeName(moments) << " " << i;
      }
    }
  }
}

// ---- invalid arguments ------------------------------------------------------------------------

TEST(OptimizerGroupSegmentsTest, AbsentInitialValuesAreRefusedWhenTheMasterIsTheParameters) {
  HarnessOptions options = SegmentOptions(Tier::kHost);
  options.group.master_in_params = true;
  GroupHarness harness(options, /*create=*/false);
  ASSERT_TRUE(harness.ok());
  Result<std::unique_ptr<OptimizerGroup>> group = harness.CreateGroupFrom(
      harness.group_options(), InitialViewsOf(harness, {true, false, true, true, true}));
  ASSERT_FALSE(group.ok());
  EXPECT_EQ(group.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(group.status().message().find("initial parameter view 1 of 30000 elements has a "
                                          "null buffer"),
            std::string::npos)
      << group.status().ToString();
}

TEST(OptimizerGroupSegmentsTest, AnAbsentRangeThatCutsASegmentIsRefusedAndChangesNothing) {
  GroupHarness harness(SegmentOptions(Tier::kNvme));
  ASSERT_TRUE(harness.ok());
  harness.NewGradients(0);
  const StateBits before = harness.Snapshot();
  const auto* grads = reinterpret_cast<const float*>(harness.grads());
  // Elements [10000, 25000) absent: the first 15000 of segment 1's 30000.
  const std::vector<GradView> views = {{grads, DType::kFloat32, 10000},
                                       {nullptr, DType::kFloat32, 15000},
                                       {grads + 25000, DType::kFloat32, harness.count() - 25000}};
  Result<StepReport> report = StepWithViews(harness, harness.Hyper(0), views);
  ASSERT_FALSE(report.ok());
  EXPECT_EQ(report.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(report.status().message().find("gradient view 1"), std::string::npos)
      << report.status().ToString();
  EXPECT_NE(report.status().message().find("[10000, 25000)"), std::string::npos);
  EXPECT_NE(report.status().message().find("segments 1..1 (elements [10000, 40000))"),
            std::string::npos)
      << report.status().ToString();
  EXPECT_NE(report.status().message().find("whole segments"), std::string::npos);
  EXPECT_EQ(harness.Snapshot(), before);
  EXPECT_EQ(SegmentSteps(harness.group()), std::vector<int64_t>(5, 0));

  // The same range through AccumulateGrad, and one spanning two segments' edges.
  Status accumulated = harness.group().AccumulateGrad(10000, {nullptr, DType::kFloat32, 15000});
  EXPECT_EQ(accumulated.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(accumulated.message().find("accumulated gradient view 0"), std::string::npos)
      << accumulated.ToString();
  accumulated = harness.group().AccumulateGrad(5000, {nullptr, DType::kFloat32, 40000});
  EXPECT_EQ(accumulated.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(accumulated.message().find("segments 0..3"), std::string::npos)
      << accumulated.ToString();
  EXPECT_EQ(harness.group().reads_started(), 0u);
  // Whole segments are accepted.
  EXPECT_TRUE(harness.group().AccumulateGrad(10000, {nullptr, DType::kFloat32, 30007}).ok());
}

TEST(OptimizerGroupSegmentsTest, SegmentsThatDoNotAddUpToTheCountAreRefused) {
  GroupHarness harness(SegmentOptions(Tier::kHost), /*create=*/false);
  ASSERT_TRUE(harness.ok());
  OptimizerGroupOptions options = harness.group_options();
  options.segments = {10000, 30000};
  Result<std::unique_ptr<OptimizerGroup>> short_of = harness.CreateGroup(options);
  ASSERT_FALSE(short_of.ok());
  EXPECT_EQ(short_of.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(short_of.status().message().find("the 2 segments hold 40000 elements, the group "
                                             "100003"),
            std::string::npos)
      << short_of.status().ToString();
  options.segments = {100000, 4};
  Result<std::unique_ptr<OptimizerGroup>> past = harness.CreateGroup(options);
  ASSERT_FALSE(past.ok());
  EXPECT_NE(past.status().message().find("more than the group's 100003"), std::string::npos)
      << past.status().ToString();
  // Empty segments (a parameter without elements) are allowed.
  options.segments = {0, 100003, 0};
  Result<std::unique_ptr<OptimizerGroup>> with_empty = harness.CreateGroup(options);
  ASSERT_TRUE(with_empty.ok()) << with_empty.status().ToString();
  EXPECT_EQ((*with_empty)->segment_count(), 3u);
}

TEST(OptimizerGroupSegmentsTest, SetSegmentStepsChecksEveryEntry) {
  GroupHarness harness(SegmentOptions(Tier::kHost));
  ASSERT_TRUE(harness.ok());
  const std::vector<int64_t> wrong_size = {1, 2};
  Status status = harness.group().SetSegmentSteps(wrong_size);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("2 segment step counts given; the group has 5"),
            std::string::npos)
      << status.ToString();
  const std::vector<int64_t> negative = {1, 2, -3, 4, 5};
  status = harness.group().SetSegmentSteps(negative);
  EXPECT_NE(status.message().find("segment 2 step count = -3"), std::string::npos)
      << status.ToString();
  // The step after INT64_MAX would overflow.
  const std::vector<int64_t> too_many = {1, 2, 3, std::numeric_limits<int64_t>::max(), 5};
  status = harness.group().SetSegmentSteps(too_many);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("segment 3 step count = 9223372036854775807 is out of range; "
                                  "allowed: [0, 9223372036854775806]"),
            std::string::npos)
      << status.ToString();
  EXPECT_EQ(SegmentSteps(harness.group()), std::vector<int64_t>(5, 0));
  const std::vector<int64_t> good = {3, 0, 9, 1, 3};
  ASSERT_TRUE(harness.group().SetSegmentSteps(good).ok());
  EXPECT_EQ(SegmentSteps(harness.group()), good);
  EXPECT_EQ(harness.group().steps_taken(), 9);
}

// ---- faults -----------------------------------------------------------------------------------

TEST(OptimizerGroupSegmentsTest, AFailedWriteLeavesStateAndStepCountsAsTheyWere) {
  GroupHarness harness(SegmentOptions(Tier::kNvme));
  ASSERT_TRUE(harness.ok());
  SegmentReference reference(harness);
  harness.NewGradients(0);
  ASSERT_TRUE(StepWithViews(harness, harness.Hyper(0), SegmentViews(harness, PresentAt(0))).ok());
  reference.Step(harness.Hyper(0), harness, PresentAt(0));
  const StateBits before = harness.Snapshot();
  const std::vector<int64_t> steps_before = SegmentSteps(harness.group());

  harness.NewGradients(1);
  harness.FailOnce(io::FaultKind::kEio, io::FaultOps::kWrites, 2);
  Result<StepReport> failed =
      StepWithViews(harness, harness.Hyper(1), SegmentViews(harness, PresentAt(1)));
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), StatusCode::kIoError) << failed.status().ToString();
  EXPECT_EQ(harness.Snapshot(), before);
  EXPECT_EQ(SegmentSteps(harness.group()), steps_before);
  EXPECT_EQ(harness.group().steps_taken(), 1);

  // The retry is the step that failed, with the same per-segment bias correction.
  ASSERT_TRUE(StepWithViews(harness, harness.Hyper(1), SegmentViews(harness, PresentAt(1))).ok());
  reference.Step(harness.Hyper(1), harness, PresentAt(1));
  EXPECT_EQ(harness.Snapshot(), reference.State());
  EXPECT_EQ(SegmentSteps(harness.group()), reference.steps());
}

// ---- checkpoints ------------------------------------------------------------------------------

void StepSegments(GroupHarness& harness, int first, int end) {
  for (int step = first; step < end; ++step) {
    harness.NewGradients(step);
    Result<StepReport> report =
        StepWithViews(harness, harness.Hyper(step), SegmentViews(harness, PresentAt(step)));
    ASSERT_TRUE(report.ok()) << report.status().ToString();
  }
}

TEST(OptimizerGroupSegmentsTest, CheckpointsKeepEachSegmentsStepCount) {
  TempDir checkpoints;
  const std::string dir = checkpoints.File("ckpt");
  GroupHarness saved(SegmentOptions(Tier::kNvme, 0.5));
  GroupHarness loaded(SegmentOptions(Tier::kNvme, 0.5));
  ASSERT_TRUE(saved.ok() && loaded.ok());
  StepSegments(saved, 0, 7);
  const std::vector<int64_t> steps = {7, 3, 2, 4, 7};
  ASSERT_EQ(SegmentSteps(saved.group()), steps);
  ASSERT_TRUE(SaveTo(dir, saved.group()).ok());

  Status load = LoadFrom(dir, loaded.group());
  ASSERT_TRUE(load.ok()) << load.ToString();
  EXPECT_EQ(SegmentSteps(loaded.group()), steps);
  EXPECT_EQ(loaded.group().steps_taken(), 7);
  EXPECT_EQ(loaded.Snapshot(), saved.Snapshot());
  StepSegments(saved, 7, 12);
  StepSegments(loaded, 7, 12);
  EXPECT_EQ(SegmentSteps(loaded.group()), SegmentSteps(saved.group()));
  EXPECT_EQ(loaded.Snapshot(), saved.Snapshot());
  EXPECT_EQ(loaded.params_bytes(), saved.params_bytes());
}

// A checkpoint whose state file is rewritten with `metadata` and the same payload.
Status RewriteStateFile(const std::string& from, const std::string& to,
                        const nlohmann::json& metadata) {
  ZOE_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader, CheckpointReader::Open(from));
  ZOE_ASSIGN_OR_RETURN(const uint64_t size, reader->file_size("g.state"));
  std::vector<std::byte> payload(size);
  ZOE_RETURN_IF_ERROR(reader->BeginFile("g.state"));
  ZOE_RETURN_IF_ERROR(reader->Read(payload));
  ZOE_RETURN_IF_ERROR(reader->EndFile());
  ZOE_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointWriter> writer,
                       CheckpointWriter::Begin(to, reader->metadata()));
  ZOE_RETURN_IF_ERROR(writer->BeginFile("g.state", metadata));
  ZOE_RETURN_IF_ERROR(writer->Append(payload));
  ZOE_RETURN_IF_ERROR(writer->EndFile());
  return writer->Commit();
}

TEST(OptimizerGroupSegmentsTest, ACheckpointWithOnlyStepsTakenGivesEverySegmentThatCount) {
  TempDir checkpoints;
  GroupHarness saved(SegmentOptions(Tier::kNvme, 0.5));
  GroupHarness loaded(SegmentOptions(Tier::kNvme, 0.5));
  ASSERT_TRUE(saved.ok() && loaded.ok());
  StepSegments(saved, 0, 4);
  ASSERT_TRUE(SaveTo(checkpoints.File("new"), saved.group()).ok());
  const nlohmann::json older = {
      {"identity", saved.group().Identity()}, {"steps_taken", 4}, {"payload_bytes", 100003 * 12}};
  ASSERT_TRUE(RewriteStateFile(checkpoints.File("new"), checkpoints.File("old"), older).ok());
  Status load = LoadFrom(checkpoints.File("old"), loaded.group());
  ASSERT_TRUE(load.ok()) << load.ToString();
  EXPECT_EQ(SegmentSteps(loaded.group()), std::vector<int64_t>(5, 4));
  EXPECT_EQ(loaded.group().steps_taken(), 4);
  EXPECT_EQ(loaded.Snapshot(), saved.Snapshot());
}

TEST(OptimizerGroupSegmentsTest, ACheckpointOfOtherSegmentsOrMalformedCountsChangesNothing) {
  TempDir checkpoints;
  GroupHarness saved(SegmentOptions(Tier::kNvme, 0.5));
  GroupHarness loaded(SegmentOptions(Tier::kNvme, 0.5));
  ASSERT_TRUE(saved.ok() && loaded.ok());
  StepSegments(saved, 0, 3);
  StepSegments(loaded, 0, 1);
  ASSERT_TRUE(SaveTo(checkpoints.File("new"), saved.group()).ok());
  const StateBits before = loaded.Snapshot();
  const std::vector<int64_t> steps_before = SegmentSteps(loaded.group());
  nlohmann::json other = {{"identity", saved.group().Identity()},
                          {"steps_taken", 3},
                          {"segments", {50000, 50003}},
                          {"segment_steps", {3, 1}},
                          {"payload_bytes", 100003 * 12}};
  ASSERT_TRUE(RewriteStateFile(checkpoints.File("new"), checkpoints.File("other"), other).ok());
  Status load = LoadFrom(checkpoints.File("other"), loaded.group());
  EXPECT_EQ(load.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(load.message().find("segments of lengths [50000,50003]"), std::string::npos)
      << load.ToString();

  other["segments"] = kSegments;
  other["segment_steps"] = {3, 1, -2, 2, 3};
  ASSERT_TRUE(RewriteStateFile(checkpoints.File("new"), checkpoints.File("bad"), other).ok());
  load = LoadFrom(checkpoints.File("bad"), loaded.group());
  EXPECT_EQ(load.code(), StatusCode::kCorruption);
  EXPECT_NE(load.message().find("malformed segments"), std::string::npos) << load.ToString();
  EXPECT_EQ(loaded.Snapshot(), before);
  EXPECT_EQ(SegmentSteps(loaded.group()), steps_before);
}

}  // namespace
}  // namespace zoe::offload
