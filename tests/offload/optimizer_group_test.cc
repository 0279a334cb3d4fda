// Description: OptimizerGroup — the offloaded step is bit-identical to the in-memory optimizer
// on every I/O backend, placement, ratio and dtype; skipped steps; injected read, write and
// checksum faults leave the state as it was; argument, capacity and coverage errors;
// AccumulateGrad; ReadState/WriteState.
#include "offload/optimizer/optimizer_group.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <ostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "io/backend.h"
#include "io/fault_injection.h"
#include "optim/group.h"
#include "tests/offload/optimizer_group_harness.h"

namespace zoe::offload {
namespace {

using optim::DType;
using testing::GroupHarness;
using testing::HarnessOptions;
using testing::Reference;

// ---- bit-identical to the in-memory reference ---------------------------------------------

struct EquivalenceCase {
  std::string name;
  io::BackendKind backend = io::BackendKind::kPsync;
  Tier placement = Tier::kNvme;
  double ratio = 1.0;
  optim::Kind kind = optim::Kind::kAdamW;
  DType state = DType::kFloat32;
  DType param = DType::kFloat32;
  DType grad = DType::kFloat32;
  // 0: none; 4096: verified and hashed by the update's stripes; larger: by the I/O queue.
  uint64_t checksum_block = 0;
};

void PrintTo(const EquivalenceCase& c, std::ostream* os) { *os << c.name; }

class OptimizerGroupEquivalenceTest : public ::testing::TestWithParam<EquivalenceCase> {};

// 50 steps with a changing lr and clipping on; gradients and parameters are cut at odd
// boundaries that differ from the chunks and from each other.
TEST_P(OptimizerGroupEquivalenceTest, FiftyStepsMatchTheInMemoryGroup) {
  const EquivalenceCase& c = GetParam();
  io::EngineOptions probe;
  probe.backend = c.backend;
  if (!io::CreateEngine(probe).ok()) GTEST_SKIP() << io::BackendName(c.backend) << " unavailable";
  HarnessOptions options;
  options.backend = c.backend;
  options.checksum_block = c.checksum_block;
  options.group.placement = c.placement;
  options.group.nvme_ratio = c.ratio;
  options.group.kind = c.kind;
  options.group.state_dtype = c.state;
  options.param_dtype = c.param;
  options.grad_dtype = c.grad;
  options.threads = 2;
  GroupHarness harness(options);
  ASSERT_TRUE(harness.ok());
  Reference reference(harness);
  for (int step = 0; step < 50; ++step) {
    harness.NewGradients(step);
    const optim::HyperParams hyper = harness.Hyper(step);
    Result<StepReport> report = harness.Step(hyper);
    ASSERT_TRUE(report.ok()) << "step " << step << ": " << report.status().ToString();
    ASSERT_TRUE(reference.Step(hyper, harness)) << "step " << step;
    ASSERT_FALSE(report->skipped);
    EXPECT_EQ(report->steps_taken, step + 1);
    EXPECT_EQ(report->grad_norm, reference.last_grad_norm());  // the same scan, bit for bit
    const uint64_t nvme_state = harness.group().nvme_bytes() / 2;
    EXPECT_EQ(report->bytes_read + report->bytes_reused, nvme_state);
    EXPECT_EQ(report->bytes_written, nvme_state);
    // After the first step, the chunks it left in the pipeline buffers are not read again.
    if (step > 0 && nvme_state > 0) {
      EXPECT_GT(report->bytes_reused, 0u);
    }
    if (step == 0 || step == 49) harness.ExpectMatches(reference);
  }
  EXPECT_GT(reference.clipped_steps(), 0) << "clipping never engaged";
}

const EquivalenceCase kEquivalenceCases[] = {
    {"nvme_io_uring", io::BackendKind::kIoUring},
    {"nvme_libaio", io::BackendKind::kLibaio},
    {"nvme_psync", io::BackendKind::kPsync},
    {"nvme_psync_queue_checksums_bf16_state", io::BackendKind::kPsync, Tier::kNvme, 1.0,
     optim::Kind::kAdamW, DType::kBFloat16, DType::kFloat32, DType::kFloat32, 8192},
    {"nvme_io_uring_stripe_checksums", io::BackendKind::kIoUring, Tier::kNvme, 1.0,
     optim::Kind::kAdamW, DType::kFloat32, DType::kFloat32, DType::kFloat32, 4096},
    {"ratio_half_stripe_checksums_bf16_state_fp16_params", io::BackendKind::kPsync, Tier::kNvme,
     0.5, optim::Kind::kAdamW, DType::kBFloat16, DType::kFloat16, DType::kFloat32, 4096},
    {"nvme_lion_stripe_checksums", io::BackendKind::kPsync, Tier::kNvme, 1.0, optim::Kind::kLion,
     DType::kFloat32, DType::kFloat32, DType::kFloat32, 4096},
    {"nvme_adagrad_stripe_checksums_bf16_state", io::BackendKind::kPsync, Tier::kNvme, 1.0,
     optim::Kind::kAdagrad, DType::kBFloat16, DType::kFloat32, DType::kFloat32, 4096},
    {"host_bf16_state_bf16_params", io::BackendKind::kPsync, Tier::kHost, 1.0, optim::Kind::kAdamW,
     DType::kBFloat16, DType::kBFloat16},
    // fp32 parameters in DRAM: written by the update kernel's own pass, as the master's bits.
    {"host_fp32_params_bf16_grads", io::BackendKind::kPsync, Tier::kHost, 1.0, optim::Kind::kAdamW,
     DType::kFloat32, DType::kFloat32, DType::kBFloat16},
    {"ratio_half_fp16_params_bf16_grads", io::BackendKind::kPsync, Tier::kNvme, 0.5,
     optim::Kind::kAdamW, DType::kFloat32, DType::kFloat16, DType::kBFloat16},
    {"ratio_half_bf16_state_bf16_params_adam", io::BackendKind::kPsync, Tier::kNvme, 0.5,
     optim::Kind::kAdam, DType::kBFloat16, DType::kBFloat16},
    {"nvme_lion", io::BackendKind::kPsync, Tier::kNvme, 1.0, optim::Kind::kLion},
    {"nvme_adagrad_bf16_state", io::BackendKind::kPsync, Tier::kNvme, 1.0, optim::Kind::kAdagrad,
     DType::kBFloat16},
};

INSTANTIATE_TEST_SUITE_P(Cases, OptimizerGroupEquivalenceTest,
                         ::testing::ValuesIn(kEquivalenceCases),
                         [](const auto& param_info) { return param_info.param.name; });

// ---- skipped steps ----------------------------------------------------------------------------

TEST(OptimizerGroupTest, NonFiniteGradientSkipsTheStepAndChangesNothing) {
  HarnessOptions options;
  options.group.placement = Tier::kNvme;
  options.group.nvme_ratio = 0.5;
  GroupHarness harness(options);
  ASSERT_TRUE(harness.ok());
  Reference reference(harness);
  harness.NewGradients(0);
  ASSERT_TRUE(harness.Step(harness.Hyper(0)).ok());
  ASSERT_TRUE(reference.Step(harness.Hyper(0), harness));
  const auto before = harness.Snapshot();
  const std::vector<std::byte> params_before = harness.params_bytes();

  harness.NewGradients(1);
  harness.PoisonGradient(harness.count() - 7, NAN);
  Result<StepReport> report = harness.Step(harness.Hyper(1));
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_TRUE(report->skipped);
  EXPECT_TRUE(std::isinf(report->grad_norm));
  EXPECT_EQ(report->steps_taken, 1);
  EXPECT_EQ(report->bytes_read, 0u);
  EXPECT_EQ(report->bytes_written, 0u);
  EXPECT_EQ(harness.group().steps_taken(), 1);
  EXPECT_EQ(harness.Snapshot(), before);
  EXPECT_EQ(harness.params_bytes(), params_before);

  // The next step counts as step 2, as if the skipped one never happened. The chunks the first
  // step left in the pipeline buffers, and those the skipped one read ahead, are still valid.
  harness.NewGradients(2);
  Result<StepReport> next = harness.Step(harness.Hyper(2));
  ASSERT_TRUE(next.ok()) << next.status().ToString();
  EXPECT_GT(next->bytes_reused, 0u);
  EXPECT_EQ(next->bytes_read + next->bytes_reused, harness.group().nvme_bytes() / 2);
  ASSERT_TRUE(reference.Step(harness.Hyper(2), harness));
  harness.ExpectMatches(reference);
}

// A failed step returns the buffers it read into but did not update to the cache: the retry
// finds them there and still matches the reference. The first step reads chunks 0, 1 and 2 into
// its three buffers before the update of chunk 0 finds its read failed.
TEST(OptimizerGroupTest, ChunksReadByAFailedStepServeItsRetry) {
  HarnessOptions options;
  options.inject_faults = true;
  options.group.buffer_count = 3;
  GroupHarness harness(options);
  ASSERT_TRUE(harness.ok());
  Reference reference(harness);
  harness.FailOnce(io::FaultKind::kEio, io::FaultOps::kReads, 1);
  harness.NewGradients(0);
  EXPECT_EQ(harness.Step(harness.Hyper(0)).status().code(), StatusCode::kIoError);
  Result<StepReport> retried = harness.Step(harness.Hyper(0));
  ASSERT_TRUE(retried.ok()) << retried.status().ToString();
  EXPECT_GT(retried->bytes_reused, 0u);
  EXPECT_EQ(retried->bytes_read + retried->bytes_reused, harness.group().nvme_bytes() / 2);
  ASSERT_TRUE(reference.Step(harness.Hyper(0), harness));
  harness.ExpectMatches(reference);
}

// Once the first reads fill the buffers, each chunk's read is queued behind the write out of
// the buffer it will use (IoRequest::after), at the moment that write is submitted: a step over
// 7 NVMe chunks and 3 buffers queues 4 such reads, and still matches the reference.
TEST(OptimizerGroupTest, ReadsBeyondTheBuffersAreQueuedBehindTheWritesThatFreeThem) {
  HarnessOptions options;
  GroupHarness harness(options);
  ASSERT_TRUE(harness.ok());
  ASSERT_EQ(harness.group().nvme_chunk_count(), 7u);
  ASSERT_EQ(options.group.buffer_count, 3u);
  Reference reference(harness);
  harness.NewGradients(0);
  const io::QueueStats before = harness.queue_stats();
  Result<StepReport> report = harness.Step(harness.Hyper(0));
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  const io::QueueStats after = harness.queue_stats();
  EXPECT_EQ(after.followers - before.followers, 7u - 3u);
  EXPECT_EQ(after.requests - before.requests, 7u + 7u);  // every chunk read once, written once
  ASSERT_TRUE(reference.Step(harness.Hyper(0), harness));
  harness.ExpectMatches(reference);
}

// ---- injected faults --------------------------------------------------------------------------

struct FaultCase {
  std::string name;
  io::FaultKind kind;
  io::FaultOps ops;
  uint64_t nth;
  StatusCode expected;
};

void PrintTo(const FaultCase& c, std::ostream* os) { *os << c.name; }

class OptimizerGroupFaultTest : public ::testing::TestWithParam<FaultCase> {};

// A step hit by a fault returns the error naming the group and a chunk and leaves the state as it
// was; the next step succeeds and matches the reference as if the failed step never happened.
TEST_P(OptimizerGroupFaultTest, FailedStepLeavesTheStateAndTheNextStepMatches) {
  const FaultCase& c = GetParam();
  HarnessOptions options;
  options.inject_faults = true;
  options.checksum_block = 4096;
  options.group.nvme_ratio = 0.75;
  GroupHarness harness(options);
  ASSERT_TRUE(harness.ok());
  Reference reference(harness);
  for (int step = 0; step < 2; ++step) {
    harness.NewGradients(step);
    ASSERT_TRUE(harness.Step(harness.Hyper(step)).ok());
    ASSERT_TRUE(reference.Step(harness.Hyper(step), harness));
  }
  const auto before = harness.Snapshot();

  harness.FailOnce(c.kind, c.ops, c.nth);
  harness.NewGradients(2);
  Result<StepReport> failed = harness.Step(harness.Hyper(2));
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), c.expected) << failed.status().ToString();
  EXPECT_NE(failed.status().message().find("optimizer group 'g'"), std::string::npos)
      << failed.status().ToString();
  EXPECT_NE(failed.status().message().find("chunk "), std::string::npos)
      << failed.status().ToString();
  // The injected failure itself, not a read that was queued behind a failed write.
  EXPECT_EQ(failed.status().message().find("not started"), std::string::npos)
      << failed.status().ToString();
  EXPECT_EQ(harness.faults()->injected(), 1u);
  EXPECT_EQ(harness.group().steps_taken(), 2);
  EXPECT_EQ(harness.Snapshot(), before);

  harness.NewGradients(3);
  Result<StepReport> next = harness.Step(harness.Hyper(3));
  ASSERT_TRUE(next.ok()) << next.status().ToString();
  ASSERT_TRUE(reference.Step(harness.Hyper(3), harness));
  EXPECT_EQ(next->steps_taken, 3);
  harness.ExpectMatches(reference);
}

INSTANTIATE_TEST_SUITE_P(
    Faults, OptimizerGroupFaultTest,
    ::testing::Values(FaultCase{"eio_first_read", io::FaultKind::kEio, io::FaultOps::kReads, 1,
                                StatusCode::kIoError},
                      // Of the step's reads: the chunks the last step left in the three
                      // pipeline buffers are not read again, so two of five are.
                      FaultCase{"eio_second_read", io::FaultKind::kEio, io::FaultOps::kReads, 2,
                                StatusCode::kIoError},
                      FaultCase{"eio_middle_write", io::FaultKind::kEio, io::FaultOps::kWrites, 2,
                                StatusCode::kIoError},
                      FaultCase{"enospc_last_write", io::FaultKind::kEnospc, io::FaultOps::kWrites,
                                4, StatusCode::kNoSpace},
                      FaultCase{"corrupted_read", io::FaultKind::kCorruption, io::FaultOps::kReads,
                                2, StatusCode::kCorruption}),
    [](const auto& param_info) { return param_info.param.name; });

TEST(OptimizerGroupTest, FailedWriteStateChangesNothing) {
  HarnessOptions options;
  options.inject_faults = true;
  GroupHarness harness(options);
  ASSERT_TRUE(harness.ok());
  const auto before = harness.Snapshot();
  harness.FailOnce(io::FaultKind::kEio, io::FaultOps::kWrites, 2);
  std::vector<float> values(harness.count(), 0.25f);
  Status written = harness.group().WriteState(StateSlot::kMaster, 0, values);
  EXPECT_EQ(written.code(), StatusCode::kIoError) << written.ToString();
  EXPECT_EQ(harness.Snapshot(), before);
  ASSERT_TRUE(harness.group().WriteState(StateSlot::kMaster, 0, values).ok());
  std::vector<float> master(harness.count());
  ASSERT_TRUE(harness.group().ReadState(StateSlot::kMaster, 0, master).ok());
  EXPECT_EQ(master, values);
}

// ---- state access -----------------------------------------------------------------------------

TEST(OptimizerGroupTest, CreateWidensInitialParametersAndZeroesMoments) {
  HarnessOptions options;
  options.param_dtype = DType::kBFloat16;
  options.group.nvme_ratio = 0.5;
  GroupHarness harness(options);
  ASSERT_TRUE(harness.ok());
  std::vector<float> expected(harness.count());
  ASSERT_TRUE(optim::CastToF32(harness.params_bytes().data(), DType::kBFloat16, expected.data(),
                               expected.size())
                  .ok());
  std::vector<float> master(harness.count());
  ASSERT_TRUE(harness.group().ReadState(StateSlot::kMaster, 0, master).ok());
  EXPECT_EQ(master, expected);
  std::vector<float> moment(harness.count(), 1.0f);
  ASSERT_TRUE(harness.group().ReadState(StateSlot::kExpAvgSq, 0, moment).ok());
  EXPECT_EQ(moment, std::vector<float>(harness.count(), 0.0f));
}

TEST(OptimizerGroupTest, WriteStateRoundsMomentsToTheStateDtypeAndReadsBack) {
  HarnessOptions options;
  options.group.state_dtype = DType::kBFloat16;
  options.group.nvme_ratio = 0.5;
  GroupHarness harness(options);
  ASSERT_TRUE(harness.ok());
  const size_t offset = 5000;  // inside chunk 0, ends inside a HOST chunk
  std::vector<float> values(harness.count() - offset - 3000);
  std::mt19937 random(3);
  std::normal_distribution<float> normal;
  for (float& v : values) v = normal(random);
  ASSERT_TRUE(harness.group().WriteState(StateSlot::kExpAvg, offset, values).ok());
  std::vector<uint16_t> rounded(values.size());
  ASSERT_TRUE(
      optim::CastFromF32(values.data(), DType::kBFloat16, rounded.data(), values.size()).ok());
  std::vector<float> expected(values.size());
  ASSERT_TRUE(
      optim::CastToF32(rounded.data(), DType::kBFloat16, expected.data(), expected.size()).ok());
  std::vector<float> read(values.size());
  ASSERT_TRUE(harness.group().ReadState(StateSlot::kExpAvg, offset, read).ok());
  EXPECT_EQ(read, expected);
  std::vector<float> untouched(offset);
  ASSERT_TRUE(harness.group().ReadState(StateSlot::kExpAvg, 0, untouched).ok());
  EXPECT_EQ(untouched, std::vector<float>(offset, 0.0f));
}

TEST(OptimizerGroupTest, StateAccessErrors) {
  HarnessOptions options;
  options.group.kind = optim::Kind::kAdagrad;
  GroupHarness harness(options);
  ASSERT_TRUE(harness.ok());
  std::vector<float> out(10);
  Status unused = harness.group().ReadState(StateSlot::kExpAvg, 0, out);
  EXPECT_EQ(unused.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(unused.message().find("adagrad keeps no exp_avg"), std::string::npos)
      << unused.ToString();
  Status outside = harness.group().ReadState(StateSlot::kMaster, harness.count() - 5, out);
  EXPECT_EQ(outside.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(outside.message().find("outside"), std::string::npos) << outside.ToString();
  EXPECT_EQ(harness.group().WriteState(StateSlot::kMaster, harness.count(), out).code(),
            StatusCode::kInvalidArgument);
}

// ---- AccumulateGrad ---------------------------------------------------------------------------

// Gradients delivered piece by piece in reverse order (as backward produces them) give exactly
// what one Step with all of them gives.
TEST(OptimizerGroupTest, AccumulatedGradientsEqualThePlainStep) {
  HarnessOptions options;
  options.group.nvme_ratio = 0.75;
  options.group.buffer_count = 3;
  GroupHarness plain(options);
  GroupHarness accumulated(options);
  ASSERT_TRUE(plain.ok() && accumulated.ok());
  for (int step = 0; step < 4; ++step) {
    plain.NewGradients(step);
    accumulated.NewGradients(step);
    ASSERT_TRUE(plain.Step(plain.Hyper(step)).ok());
    const std::vector<GradView> views = accumulated.grad_views();
    for (size_t i = views.size(); i-- > 0;) {
      size_t offset = 0;
      for (size_t j = 0; j < i; ++j) offset += views[j].count;
      ASSERT_TRUE(accumulated.group().AccumulateGrad(offset, views[i]).ok());
    }
    // Chunks 4, 3 and 2 (NVMe) were completed first and took the three pipeline buffers.
    EXPECT_EQ(accumulated.group().reads_started(), 3u);
    Result<StepReport> report = accumulated.StepAccumulated(accumulated.Hyper(step));
    ASSERT_TRUE(report.ok()) << report.status().ToString();
    EXPECT_EQ(report->steps_taken, step + 1);
    EXPECT_EQ(accumulated.group().reads_started(), 0u);
    // The reads started early count with the step's own.
    EXPECT_EQ(report->bytes_read + report->bytes_reused, accumulated.group().nvme_bytes() / 2);
  }
  EXPECT_EQ(accumulated.Snapshot(), plain.Snapshot());
  EXPECT_EQ(accumulated.params_bytes(), plain.params_bytes());
}

// A read AccumulateGrad started fails: the step reports it, nothing changes, the accumulated
// gradients stay, and retrying the step on them matches the reference.
TEST(OptimizerGroupTest, FailedEarlyReadFailsTheStepAndTheRetryUsesTheSameGradients) {
  HarnessOptions options;
  options.inject_faults = true;
  GroupHarness harness(options);
  ASSERT_TRUE(harness.ok());
  Reference reference(harness);
  const auto before = harness.Snapshot();
  harness.FailOnce(io::FaultKind::kEio, io::FaultOps::kReads, 1);
  harness.NewGradients(0);
  ASSERT_TRUE(harness.AccumulateAll());
  EXPECT_GT(harness.group().reads_started(), 0u);
  Result<StepReport> failed = harness.StepAccumulated(harness.Hyper(0));
  EXPECT_EQ(failed.status().code(), StatusCode::kIoError) << failed.status().ToString();
  EXPECT_NE(failed.status().message().find("optimizer group 'g': chunk 0"), std::string::npos)
      << failed.status().ToString();
  EXPECT_EQ(harness.group().reads_started(), 0u);
  EXPECT_EQ(harness.group().steps_taken(), 0);
  EXPECT_EQ(harness.Snapshot(), before);
  EXPECT_EQ(harness.Step(harness.Hyper(0)).status().code(), StatusCode::kFailedPrecondition);
  Result<StepReport> retried = harness.StepAccumulated(harness.Hyper(0));
  ASSERT_TRUE(retried.ok()) << retried.status().ToString();
  EXPECT_EQ(retried->steps_taken, 1);
  ASSERT_TRUE(reference.Step(harness.Hyper(0), harness));
  harness.ExpectMatches(reference);
  // The step consumed them: the next one needs new gradients.
  EXPECT_EQ(harness.StepAccumulated(harness.Hyper(1)).status().code(),
            StatusCode::kFailedPrecondition);
}

TEST(OptimizerGroupTest, AccumulateGradErrors) {
  GroupHarness harness(HarnessOptions{});
  ASSERT_TRUE(harness.ok());
  harness.NewGradients(0);
  const std::vector<GradView> views = harness.grad_views();
  OptimizerGroup& group = harness.group();
  const size_t n = harness.count();
  GradView piece = views.front();
  piece.count = 1000;
  ASSERT_TRUE(group.AccumulateGrad(2000, piece).ok());

  Status overlap = group.AccumulateGrad(2500, piece);
  EXPECT_EQ(overlap.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(overlap.message().find("overlaps [2000, 3000)"), std::string::npos)
      << overlap.ToString();
  EXPECT_EQ(group.AccumulateGrad(1500, piece).code(), StatusCode::kInvalidArgument);
  Status outside = group.AccumulateGrad(n - 10, piece);
  EXPECT_EQ(outside.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(outside.message().find("outside"), std::string::npos) << outside.ToString();

  Result<StepReport> incomplete = harness.StepAccumulated(harness.Hyper(0));
  ASSERT_FALSE(incomplete.ok());
  EXPECT_EQ(incomplete.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(incomplete.status().message().find("[0, 2000) are missing"), std::string::npos)
      << incomplete.status().ToString();

  std::vector<float> values(10, 1.0f);
  EXPECT_EQ(group.WriteState(StateSlot::kMaster, 0, values).code(),
            StatusCode::kFailedPrecondition);
  Result<StepReport> mixed = harness.Step(harness.Hyper(0));
  EXPECT_EQ(mixed.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(group.steps_taken(), 0);
}

// ---- argument and capacity errors -------------------------------------------------------------

TEST(OptimizerGroupTest, StepArgumentErrorsChangeNothing) {
  GroupHarness harness(HarnessOptions{});
  ASSERT_TRUE(harness.ok());
  harness.NewGradients(0);
  const auto before = harness.Snapshot();
  OptimizerGroup& group = harness.group();
  std::vector<GradView> grads = harness.grad_views();

  StepArgs args;
  args.hyper = harness.Hyper(0);
  grads.back().count -= 1;
  args.grads = grads;
  Result<StepReport> short_grads = group.Step(args);
  EXPECT_EQ(short_grads.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(short_grads.status().message().find("hold " + std::to_string(harness.count() - 1)),
            std::string::npos)
      << short_grads.status().ToString();

  // A dtype outside the enum, and zoe::DTypes the kernels do not take.
  const std::pair<DType, std::string> bad_dtypes[] = {
      {static_cast<DType>(200), "gradient view 1 dtype = unknown (200)"},
      {DType::kFloat64, "gradient view 1 dtype = fp64"},
      {DType::kInt32, "gradient view 1 dtype = int32"},
      {DType::kInt8, "gradient view 1 dtype = int8"}};
  for (const auto& [dtype, message] : bad_dtypes) {
    grads = harness.grad_views();
    grads[1].dtype = dtype;
    args.grads = grads;
    Result<StepReport> bad_dtype = group.Step(args);
    EXPECT_EQ(bad_dtype.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(
        bad_dtype.status().message().find(
            message + " is not an element type the optimizer takes; allowed: fp32, bf16, fp16"),
        std::string::npos)
        << bad_dtype.status().ToString();
  }

  grads = harness.grad_views();
  args.grads = grads;
  args.hyper.kind = optim::Kind::kLion;
  Result<StepReport> wrong_kind = group.Step(args);
  EXPECT_EQ(wrong_kind.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(wrong_kind.status().message().find("lion"), std::string::npos);

  args.hyper = harness.Hyper(0);
  args.loss_scale = 0.0;
  EXPECT_EQ(group.Step(args).status().code(), StatusCode::kInvalidArgument);
  args.loss_scale = 1.0;
  args.hyper.beta1 = 1.0;
  EXPECT_EQ(group.Step(args).status().code(), StatusCode::kInvalidArgument);

  EXPECT_EQ(group.steps_taken(), 0);
  EXPECT_EQ(harness.Snapshot(), before);
}

// View counts whose sum wraps around to the group's count are refused at the view that runs
// past the end.
TEST(OptimizerGroupTest, ViewCountsThatWrapAroundAreRejected) {
  GroupHarness harness(HarnessOptions{});
  ASSERT_TRUE(harness.ok());
  harness.NewGradients(0);
  const auto before = harness.Snapshot();
  const std::vector<GradView> valid = harness.grad_views();
  const std::vector<GradView> grads = {
      {valid[0].data, DType::kFloat32, SIZE_MAX},
      {valid[0].data, DType::kFloat32, harness.count() + 1},
  };
  StepArgs args;
  args.hyper = harness.Hyper(0);
  args.grads = grads;
  Result<StepReport> wrapped = harness.group().Step(args);
  EXPECT_EQ(wrapped.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(wrapped.status().message().find("gradient view 0"), std::string::npos)
      << wrapped.status().ToString();

  std::vector<float> small(4, 0.5f);
  const std::vector<ParamView> params = {{small.data(), DType::kFloat32, 2},
                                         {small.data(), DType::kFloat32, SIZE_MAX},
                                         {small.data(), DType::kFloat32, 3}};
  OptimizerGroupOptions options = testing::DefaultGroupOptions();
  options.placement = Tier::kHost;
  options.count = 4;
  OptimizerResources resources;
  resources.pinned = &harness.pinned();
  Result<std::unique_ptr<OptimizerGroup>> rejected =
      OptimizerGroup::Create(options, resources, params);
  EXPECT_EQ(rejected.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(rejected.status().message().find("initial parameter view 1"), std::string::npos)
      << rejected.status().ToString();
  EXPECT_EQ(harness.group().steps_taken(), 0);
  EXPECT_EQ(harness.Snapshot(), before);
}

// Chunks as long as size_t allows: one chunk, the same step.
TEST(OptimizerGroupTest, HugeChunkLengthMakesOneChunkAndMatchesTheReference) {
  HarnessOptions options;
  options.count = 5000;
  options.group.chunk_elements = SIZE_MAX;
  GroupHarness harness(options);
  ASSERT_TRUE(harness.ok());
  EXPECT_EQ(harness.group().chunk_count(), 1u);
  Reference reference(harness);
  harness.NewGradients(0);
  ASSERT_TRUE(harness.Step(harness.Hyper(0)).ok());
  ASSERT_TRUE(reference.Step(harness.Hyper(0), harness));
  harness.ExpectMatches(reference);
}

TEST(OptimizerGroupTest, CreateRejectsBadOptions) {
  struct Bad {
    std::string field;
    void (*change)(OptimizerGroupOptions&);
  };
  const Bad cases[] = {
      {"name", [](OptimizerGroupOptions& o) { o.name.clear(); }},
      {"count", [](OptimizerGroupOptions& o) { o.count = 0; }},
      {"state_dtype", [](OptimizerGroupOptions& o) { o.state_dtype = DType::kFloat16; }},
      {"state_dtype = fp64", [](OptimizerGroupOptions& o) { o.state_dtype = DType::kFloat64; }},
      {"state_dtype = int32 is not an element type the optimizer takes; allowed: fp32, bf16, int8",
       [](OptimizerGroupOptions& o) { o.state_dtype = DType::kInt32; }},
      {"nvme_ratio", [](OptimizerGroupOptions& o) { o.nvme_ratio = 0.0; }},
      {"nvme_ratio", [](OptimizerGroupOptions& o) { o.nvme_ratio = 1.5; }},
      {"buffer_count", [](OptimizerGroupOptions& o) { o.buffer_count = 1; }},
      {"chunk_elements", [](OptimizerGroupOptions& o) { o.chunk_elements = 0; }},
      {"max_grad_norm", [](OptimizerGroupOptions& o) { o.max_grad_norm = -1.0; }},
      {"placement", [](OptimizerGroupOptions& o) { o.placement = Tier::kDevice; }},
      {"kind", [](OptimizerGroupOptions& o) { o.kind = static_cast<optim::Kind>(9); }},
  };
  GroupHarness harness(HarnessOptions{}, /*create=*/false);
  for (const Bad& bad : cases) {
    OptimizerGroupOptions options = harness.group_options();
    bad.change(options);
    Result<std::unique_ptr<OptimizerGroup>> group = harness.CreateGroup(options);
    ASSERT_FALSE(group.ok()) << bad.field;
    EXPECT_EQ(group.status().code(), StatusCode::kInvalidArgument) << bad.field;
    EXPECT_NE(group.status().message().find(bad.field), std::string::npos)
        << group.status().ToString();
  }
  OptimizerGroupOptions options = harness.group_options();
  options.count += 1;  // the initial parameters no longer cover the group
  Result<std::unique_ptr<OptimizerGroup>> uncovered = harness.CreateGroup(options);
  EXPECT_EQ(uncovered.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(harness.pinned().used_bytes(), 0u);
}

TEST(OptimizerGroupTest, NvmePlacementWithoutSwapIsRejected) {
  GroupHarness harness(HarnessOptions{}, /*create=*/false);
  OptimizerResources resources{nullptr, nullptr, &harness.pinned()};
  Result<std::unique_ptr<OptimizerGroup>> group =
      OptimizerGroup::Create(harness.group_options(), resources, harness.initial_param_views());
  EXPECT_EQ(group.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(group.status().message().find("swap space"), std::string::npos)
      << group.status().ToString();
}

TEST(OptimizerGroupTest, TooSmallSwapSpaceIsNoSpaceWithTheNumbers) {
  HarnessOptions options;
  options.swap_capacity = 256 << 10;
  GroupHarness harness(options, /*create=*/false);
  const uint64_t free_before = harness.swap().free_bytes();
  Result<std::unique_ptr<OptimizerGroup>> group = harness.CreateGroup(harness.group_options());
  ASSERT_FALSE(group.ok());
  EXPECT_EQ(group.status().code(), StatusCode::kNoSpace);
  EXPECT_NE(group.status().message().find("needs"), std::string::npos);
  EXPECT_NE(group.status().message().find(std::to_string(free_before) + " of"), std::string::npos)
      << group.status().ToString();
  EXPECT_EQ(harness.swap().free_bytes(), free_before);
  EXPECT_EQ(harness.pinned().used_bytes(), 0u);
}

TEST(OptimizerGroupTest, TooSmallPinnedBudgetIsOutOfMemoryWithTheNumbers) {
  HarnessOptions options;
  options.pinned_budget = 128 << 10;
  GroupHarness harness(options, /*create=*/false);
  const uint64_t free_before = harness.swap().free_bytes();
  Result<std::unique_ptr<OptimizerGroup>> group = harness.CreateGroup(harness.group_options());
  ASSERT_FALSE(group.ok());
  EXPECT_EQ(group.status().code(), StatusCode::kOutOfMemory);
  EXPECT_NE(group.status().message().find("pinned memory"), std::string::npos);
  EXPECT_NE(group.status().message().find(std::to_string(128 << 10) + " of"), std::string::npos)
      << group.status().ToString();
  EXPECT_EQ(harness.swap().free_bytes(), free_before);
  EXPECT_EQ(harness.pinned().used_bytes(), 0u);
}

TEST(OptimizerGroupTest, ExtentsThatSplitAChecksumBlockAreRejected) {
  HarnessOptions options;
  options.checksum_block = 8192;
  options.swap_alignment = 4096;
  GroupHarness harness(options, /*create=*/false);
  Result<io::Extent> leading =
      harness.swap().Allocate(4096);  // later extents start at 4096 + k * 8192
  ASSERT_TRUE(leading.ok());
  const uint64_t free_before = harness.swap().free_bytes();
  Result<std::unique_ptr<OptimizerGroup>> group = harness.CreateGroup(harness.group_options());
  EXPECT_EQ(group.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(group.status().message().find("not aligned to the 8192-byte checksum block"),
            std::string::npos)
      << group.status().ToString();
  EXPECT_EQ(harness.swap().free_bytes(), free_before);
  EXPECT_EQ(harness.pinned().used_bytes(), 0u);
}

TEST(OptimizerGroupTest, DestroyingTheGroupReturnsItsSpaceAndMemory) {
  HarnessOptions options;
  options.group.nvme_ratio = 0.5;
  GroupHarness harness(options, /*create=*/false);
  const uint64_t free_before = harness.swap().free_bytes();
  {
    Result<std::unique_ptr<OptimizerGroup>> group = harness.CreateGroup(harness.group_options());
    ASSERT_TRUE(group.ok()) << group.status().ToString();
    EXPECT_EQ((*group)->chunk_count(), 7u);
    EXPECT_EQ((*group)->nvme_chunk_count(), 4u);
    EXPECT_EQ(harness.swap().free_bytes(), free_before - (*group)->nvme_bytes());
    EXPECT_EQ(harness.pinned().used_bytes(), (*group)->pinned_bytes());
  }
  EXPECT_EQ(harness.swap().free_bytes(), free_before);
  EXPECT_EQ(harness.pinned().used_bytes(), 0u);
}

}  // namespace
}  // namespace zoe::offload
