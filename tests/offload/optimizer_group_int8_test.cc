// Description: OptimizerGroup with int8 moments — in DRAM and on NVMe, every kind, gradient and
// parameter views that cut quantization blocks, segments whose starts split blocks: the state
// matches the kernels run piece by piece bit for bit; an absent segment keeps every byte of its
// state; speculative, single-slot and fast-arithmetic steps match plain ones; bytes per
// parameter; state reads and writes; checkpoint round trip; a corrupted read is detected.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "optim/quantize.h"
#include "tests/offload/optimizer_group_harness.h"

namespace zoe::offload {
namespace {

using optim::DType;
using optim::Kind;
using testing::GroupHarness;
using testing::HarnessOptions;
using testing::StateBits;

constexpr size_t kChunkElements = 16384;

// The kernels run directly on each piece (a segment's part of a chunk), each with its own block
// grid and scales, as the group's layout promises.
class PieceReference {
 public:
  PieceReference(const GroupHarness& harness, const std::vector<size_t>& segments)
      : kind_(harness.group_options().kind),
        run_(harness.group_options().run),
        master_(harness.count()),
        exp_avg_(harness.count()),
        exp_avg_sq_(harness.count()) {
    std::memcpy(master_.data(), harness.initial_params().data(), harness.count() * 4);
    std::vector<size_t> starts = {0};
    for (size_t length : segments) starts.push_back(starts.back() + length);
    if (segments.empty()) starts.push_back(harness.count());
    for (size_t s = 0; s + 1 < starts.size(); ++s) {
      for (size_t a = starts[s]; a < starts[s + 1];) {
        const size_t chunk_end = (a / kChunkElements + 1) * kChunkElements;
        const size_t b = std::min(starts[s + 1], chunk_end);
        const size_t offset = (a % kChunkElements) % optim::kQuantBlock;
        pieces_.push_back({s, a, b, offset,
                           std::vector<float>(optim::QuantBlockCount(b - a, offset)),
                           std::vector<float>(optim::QuantBlockCount(b - a, offset))});
        a = b;
      }
    }
  }

  // One step of the pieces of present segments, each with its segment's step number.
  void Step(const optim::HyperParams& hyper, const float* grads,
            const std::vector<int64_t>& segment_steps, const std::vector<bool>& present) {
    const optim::ChunkLayout layout{DType::kFloat32, DType::kInt8, std::nullopt};
    for (Piece& p : pieces_) {
      if (!present[p.segment]) continue;
      optim::ChunkBuffers buffers;
      buffers.master = master_.data() + p.begin;
      buffers.grad = grads + p.begin;
      buffers.exp_avg = exp_avg_.data() + p.begin;
      buffers.exp_avg_sq = exp_avg_sq_.data() + p.begin;
      buffers.count = p.end - p.begin;
      buffers.block_offset = p.block_offset;
      buffers.exp_avg_scale = p.exp_avg_scale.data();
      buffers.exp_avg_sq_scale = p.exp_avg_sq_scale.data();
      ASSERT_TRUE(
          optim::UpdateChunk(hyper, segment_steps[p.segment], layout, buffers, {}, run_).ok());
    }
  }

  // Master and the dequantized moments the kind keeps.
  StateBits State() const {
    StateBits state = {testing::Bits(master_)};
    for (auto moment : {optim::Moment::kExpAvg, optim::Moment::kExpAvgSq}) {
      if (moment == optim::Moment::kExpAvg ? !optim::UsesExpAvg(kind_)
                                           : !optim::UsesExpAvgSq(kind_)) {
        continue;
      }
      std::vector<float> values(master_.size());
      for (const Piece& p : pieces_) {
        const bool first = moment == optim::Moment::kExpAvg;
        EXPECT_TRUE(
            optim::DequantizeMoments(moment, (first ? exp_avg_ : exp_avg_sq_).data() + p.begin,
                                     (first ? p.exp_avg_scale : p.exp_avg_sq_scale).data(),
                                     p.end - p.begin, p.block_offset, values.data() + p.begin)
                .ok());
      }
      state.push_back(testing::Bits(values));
    }
    return state;
  }
  const std::vector<float>& master() const { return master_; }

 private:
  struct Piece {
    size_t segment, begin, end, block_offset;
    std::vector<float> exp_avg_scale, exp_avg_sq_scale;
  };
  Kind kind_;
  optim::RunOptions run_;
  std::vector<float> master_;
  std::vector<uint8_t> exp_avg_, exp_avg_sq_;
  std::vector<Piece> pieces_;
};

HarnessOptions Int8Options(Kind kind, Tier placement) {
  HarnessOptions options;
  options.group.kind = kind;
  options.group.state_dtype = DType::kInt8;
  options.group.placement = placement;
  options.group.max_grad_norm = 0.0;  // the reference applies no clipping
  options.threads = 2;
  options.checksum_block = 4096;  // every block verified on the way back, the scales' included
  return options;
}

void ExpectSameBits(const StateBits& actual, const StateBits& expected) {
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t s = 0; s < expected.size(); ++s) {
    size_t mismatches = 0, first = 0;
    for (size_t i = 0; i < expected[s].size(); ++i) {
      if (actual[s][i] != expected[s][i] && mismatches++ == 0) first = i;
    }
    EXPECT_EQ(mismatches, 0u) << "state array " << s << ": first mismatch at element " << first;
  }
}

struct Int8Case {
  Kind kind;
  Tier placement;
};

class OptimizerGroupInt8Test : public ::testing::TestWithParam<Int8Case> {};

// The harness cuts gradient and parameter views at odd elements (7, 16387, ...), inside
// quantization blocks: those blocks are updated staged, with the same bits.
TEST_P(OptimizerGroupInt8Test, MatchesTheKernelsWithViewsCuttingBlocks) {
  GroupHarness harness(Int8Options(GetParam().kind, GetParam().placement));
  ASSERT_TRUE(harness.ok());
  PieceReference reference(harness, {});
  for (int step = 1; step <= 3; ++step) {
    harness.NewGradients(step);
    Result<StepReport> report = harness.Step(harness.Hyper(step));
    ASSERT_TRUE(report.ok()) << report.status().ToString();
    reference.Step(harness.Hyper(step), reinterpret_cast<const float*>(harness.grads()), {step},
                   {true});
  }
  ExpectSameBits(harness.Snapshot(), reference.State());
  std::vector<std::byte> params = harness.params_bytes();
  EXPECT_EQ(std::memcmp(params.data(), reference.master().data(), params.size()), 0);
}

INSTANTIATE_TEST_SUITE_P(KindsAndPlacements, OptimizerGroupInt8Test,
                         ::testing::Values(Int8Case{Kind::kAdamW, Tier::kNvme},
                                           Int8Case{Kind::kAdamW, Tier::kHost},
                                           Int8Case{Kind::kAdam, Tier::kNvme},
                                           Int8Case{Kind::kAdagrad, Tier::kNvme},
                                           Int8Case{Kind::kLion, Tier::kHost}),
                         [](const auto& param_info) {
                           return std::string(optim::KindName(param_info.param.kind)) +
                                  (param_info.param.placement == Tier::kNvme ? "_nvme" : "_dram");
                         });

// Segment starts 1000, 4001 and 4008 split blocks; segment 1 is absent on even steps.
const std::vector<size_t> kSegments = {1000, 3001, 7, 95995};

std::vector<GradView> SegmentViews(const GroupHarness& harness, const std::vector<bool>& present) {
  std::vector<GradView> views;
  const auto* grads = reinterpret_cast<const float*>(harness.grads());
  size_t begin = 0;
  for (size_t s = 0; s < kSegments.size(); ++s) {
    if (!present[s]) {
      views.push_back({nullptr, DType::kFloat32, kSegments[s]});
    } else {
      const size_t half = kSegments[s] / 2;  // a view cut inside the segment, inside a block
      views.push_back({grads + begin, DType::kFloat32, half});
      views.push_back({grads + begin + half, DType::kFloat32, kSegments[s] - half});
    }
    begin += kSegments[s];
  }
  return views;
}

TEST(OptimizerGroupInt8, AnAbsentSegmentKeepsEveryByteAndSplitBlocksMatchTheKernels) {
  for (Tier placement : {Tier::kNvme, Tier::kHost}) {
    HarnessOptions options = Int8Options(Kind::kAdamW, placement);
    options.group.segments = kSegments;
    GroupHarness harness(options);
    ASSERT_TRUE(harness.ok());
    PieceReference reference(harness, kSegments);
    std::vector<int64_t> steps(kSegments.size(), 0);
    for (int step = 1; step <= 4; ++step) {
      const std::vector<bool> present = {true, step % 2 == 1, true, true};
      harness.NewGradients(step);
      const StateBits before = harness.Snapshot();
      const std::vector<GradView> grads = SegmentViews(harness, present);
      const std::vector<ParamView> params = harness.param_views();
      StepArgs args;
      args.hyper = harness.Hyper(step);
      args.grads = grads;
      args.params = params;
      Result<StepReport> report = harness.group().Step(args);
      ASSERT_TRUE(report.ok()) << report.status().ToString();
      for (size_t s = 0; s < steps.size(); ++s) steps[s] += present[s] ? 1 : 0;
      reference.Step(args.hyper, reinterpret_cast<const float*>(harness.grads()), steps, present);
      const StateBits after = harness.Snapshot();
      // Segment 1 ([1000, 4001)): master and both moments (codes and the scales of its own
      // blocks) as they were when absent, changed when present.
      for (size_t slot = 0; slot < after.size(); ++slot) {
        const bool same = std::equal(after[slot].begin() + 1000, after[slot].begin() + 4001,
                                     before[slot].begin() + 1000);
        EXPECT_EQ(same, !present[1]) << "step " << step << " slot " << slot;
      }
    }
    ExpectSameBits(harness.Snapshot(), reference.State());
  }
}

// A parameter's state is 4 + 1 + 1 bytes plus two scales per 256-element block (and one more
// block per segment start that splits one).
// Speculate, then the gradient views handed over last to first, then the Step on them.
Result<StepReport> SpeculativeStep(GroupHarness& harness, const optim::HyperParams& hyper) {
  const std::vector<ParamView> params = harness.param_views();
  StepArgs args;
  args.hyper = hyper;
  args.params = params;
  ZOE_RETURN_IF_ERROR(harness.group().Speculate(args));
  const std::vector<GradView> views = harness.grad_views();
  std::vector<size_t> offsets(views.size(), 0);
  for (size_t i = 1; i < views.size(); ++i) offsets[i] = offsets[i - 1] + views[i - 1].count;
  for (size_t i = views.size(); i-- > 0;) {
    ZOE_RETURN_IF_ERROR(harness.group().AccumulateGrad(offsets[i], views[i]));
  }
  return harness.StepAccumulated(hyper);
}

// Speculative steps (their chunks updated through the same UpdateChunkState, int8 blocks
// included) and a single slot give the bits of plain two-slot steps, fp32 parameters written by
// the block kernels in their pass, on a DRAM/NVMe mix with checksums on; streaming stores asked
// for change nothing (the int8 kernels store ordinarily). Fast arithmetic does change int8 bytes
// (tests/optim/quantize_test.cc).
TEST(OptimizerGroupInt8, SpeculativeSingleSlotAndStreamingStepsMatchThePlainStep) {
  HarnessOptions options = Int8Options(Kind::kAdamW, Tier::kNvme);
  options.group.nvme_ratio = 0.5;
  options.param_dtype = DType::kFloat32;
  GroupHarness plain(options);
  options.group.speculative = true;
  GroupHarness speculative(options);
  options.group.speculative = false;
  options.group.slots = 1;
  options.group.run.stores = optim::StoreMode::kStreaming;
  GroupHarness single_streaming(options);
  ASSERT_TRUE(plain.ok() && speculative.ok() && single_streaming.ok());
  for (int step = 1; step <= 3; ++step) {
    for (GroupHarness* h : {&plain, &speculative, &single_streaming}) h->NewGradients(step);
    Result<StepReport> expected = plain.Step(plain.Hyper(step));
    ASSERT_TRUE(expected.ok()) << expected.status().ToString();
    Result<StepReport> report = SpeculativeStep(speculative, speculative.Hyper(step));
    ASSERT_TRUE(report.ok()) << report.status().ToString();
    EXPECT_EQ(report->chunks_speculative, 7u);
    EXPECT_EQ(report->chunks_committed, 7u);
    Result<StepReport> single = single_streaming.Step(single_streaming.Hyper(step));
    ASSERT_TRUE(single.ok()) << single.status().ToString();
    ExpectSameBits(speculative.Snapshot(), plain.Snapshot());
    ExpectSameBits(single_streaming.Snapshot(), plain.Snapshot());
    EXPECT_TRUE(speculative.params_bytes() == plain.params_bytes()) << "after step " << step;
    EXPECT_TRUE(single_streaming.params_bytes() == plain.params_bytes()) << "after step " << step;
  }
}

TEST(OptimizerGroupInt8, HoldsAboutSixBytesPerParameter) {
  HarnessOptions options = Int8Options(Kind::kAdamW, Tier::kNvme);
  options.group.segments = kSegments;
  GroupHarness harness(options);
  ASSERT_TRUE(harness.ok());
  uint64_t expected = 0;
  for (size_t first = 0; first < harness.count(); first += kChunkElements) {
    const size_t count = std::min(kChunkElements, harness.count() - first);
    const size_t splits = first == 0 ? 3 : 0;  // 1000, 4001, 4008 lie in chunk 0
    expected += count * 6 + 2 * 4 * ((count + 255) / 256 + splits);
  }
  EXPECT_EQ(harness.group().checkpoint_bytes(), expected);
  EXPECT_LT(static_cast<double>(expected) / harness.count(), 6.07);
}

TEST(OptimizerGroupInt8, StateWritesRoundTripWithinTheCodesErrorAndBadValuesChangeNothing) {
  GroupHarness harness(Int8Options(Kind::kAdamW, Tier::kNvme));
  ASSERT_TRUE(harness.ok());
  harness.NewGradients(1);
  ASSERT_TRUE(harness.Step(harness.Hyper(1)).ok());
  const size_t offset = 16000, length = 1000;  // crosses a chunk, starts and ends mid-block
  std::vector<float> values(length);
  for (size_t i = 0; i < length; ++i) values[i] = std::sin(0.01f * i) * 1e-3f;
  ASSERT_TRUE(harness.group().WriteState(StateSlot::kExpAvg, offset, values).ok());
  std::vector<float> back(length);
  ASSERT_TRUE(harness.group().ReadState(StateSlot::kExpAvg, offset, back).ok());
  // Blocks hold written values and ones left from the step (|m| <= 0.1 * max |g| = 0.1).
  std::vector<float> all(harness.count());
  ASSERT_TRUE(harness.group().ReadState(StateSlot::kExpAvg, 0, all).ok());
  for (size_t i = 0; i < length; ++i) {
    const size_t block = (offset + i) / optim::kQuantBlock * optim::kQuantBlock;
    float absmax = 0.0f;
    for (size_t j = block; j < std::min(harness.count(), block + optim::kQuantBlock); ++j) {
      absmax = std::max(absmax, std::fabs(all[j]));
    }
    // The block's scale is its largest magnitude, which reads back as itself, or as
    // |kSignedCode.value[0]| (0.993) of itself when negative.
    const float scale = absmax / std::fabs(optim::kSignedCode.value[0]);
    ASSERT_LE(std::fabs(back[i] - values[i]),
              optim::MaxQuantError(optim::kSignedCode) * scale * 1.0001f)
        << i;
  }
  const StateBits before = harness.Snapshot();
  for (float& v : values) v = std::fabs(v);
  values[500] = -1.0f;
  Status negative = harness.group().WriteState(StateSlot::kExpAvgSq, offset, values);
  EXPECT_EQ(negative.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(negative.message().find("element 16500 is -1"), std::string::npos)
      << negative.ToString();
  values[500] = NAN;
  EXPECT_EQ(harness.group().WriteState(StateSlot::kExpAvg, offset, values).code(),
            StatusCode::kInvalidArgument);
  ExpectSameBits(harness.Snapshot(), before);
}

TEST(OptimizerGroupInt8, CheckpointRoundTripKeepsEveryBit) {
  testing::TempDir dir;
  GroupHarness harness(Int8Options(Kind::kAdamW, Tier::kNvme));
  ASSERT_TRUE(harness.ok());
  for (int step = 1; step <= 2; ++step) {
    harness.NewGradients(step);
    ASSERT_TRUE(harness.Step(harness.Hyper(step)).ok());
  }
  ASSERT_TRUE(testing::SaveTo(dir.File("ckpt"), harness.group()).ok());
  const StateBits saved = harness.Snapshot();
  GroupHarness other(Int8Options(Kind::kAdamW, Tier::kHost));
  ASSERT_TRUE(other.ok());
  Status loaded = testing::LoadFrom(dir.File("ckpt"), other.group());
  ASSERT_TRUE(loaded.ok()) << loaded.ToString();
  ExpectSameBits(other.Snapshot(), saved);
  // Both continue identically.
  harness.NewGradients(3);
  other.NewGradients(3);
  ASSERT_TRUE(harness.Step(harness.Hyper(3)).ok());
  ASSERT_TRUE(other.Step(other.Hyper(3)).ok());
  ExpectSameBits(other.Snapshot(), harness.Snapshot());
  // fp32 moments cannot load an int8 checkpoint.
  HarnessOptions fp32 = Int8Options(Kind::kAdamW, Tier::kHost);
  fp32.group.state_dtype = DType::kFloat32;
  GroupHarness mismatched(fp32);
  ASSERT_TRUE(mismatched.ok());
  EXPECT_FALSE(testing::LoadFrom(dir.File("ckpt"), mismatched.group()).ok());
}

// A block corrupted on its way back from disk is caught by its checksum before the step uses it,
// and the step changes nothing.
TEST(OptimizerGroupInt8, ACorruptedReadIsDetectedAndChangesNothing) {
  HarnessOptions options = Int8Options(Kind::kAdamW, Tier::kNvme);
  options.inject_faults = true;
  GroupHarness harness(options);
  ASSERT_TRUE(harness.ok());
  harness.NewGradients(1);
  ASSERT_TRUE(harness.Step(harness.Hyper(1)).ok());
  const StateBits before = harness.Snapshot();
  io::FaultRule rule;
  rule.kind = io::FaultKind::kCorruption;
  rule.ops = io::FaultOps::kReads;
  rule.nth = 1;
  rule.max_faults = 1;
  harness.faults()->AddRule(rule);
  harness.NewGradients(2);
  Result<StepReport> report = harness.Step(harness.Hyper(2));
  EXPECT_FALSE(report.ok());
  if (!report.ok()) {
    EXPECT_EQ(report.status().code(), StatusCode::kCorruption);
  }
  ExpectSameBits(harness.Snapshot(), before);
}

}  // namespace
}  // namespace zoe::offload
