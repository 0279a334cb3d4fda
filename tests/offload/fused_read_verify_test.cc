// Description: the step verifies the state it reads inside the update kernel (the AVX-512 Adam
// and AdamW kernels hash master and moments as they load them) — a flipped byte is Corruption
// with two slots and with one (in place), inside a piece, in a block a piece boundary cuts and
// in a piece without a gradient, and the damaged chunk never reaches the disk; the same damage
// on the AVX2 path (a separate pass before the kernel) gives the same result; with int8 state, a
// flipped byte of master or of either moment's codes, in a unit the kernel hashes and in a staged
// block. UpdateInStripes' hashing form compares the blocks the kernel hashed after the stripe's
// update and verifies the others before it.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <vector>

#include "io/checksum.h"
#include "offload/optimizer/chunk_update.h"
#include "offload/optimizer/optimizer_group.h"
#include "optim/chunk.h"
#include "optim/dispatch.h"
#include "tests/offload/optimizer_group_harness.h"

namespace zoe::offload {
namespace {

using optim::DType;
using testing::GroupHarness;
using testing::HarnessOptions;
using testing::Reference;

// ---- UpdateInStripes with a HashingRangeUpdate, its kernel simulated ----

constexpr size_t kUnit = 1024;  // fp32 state: one block of master and of each moment

// An extent of fp32 AdamW state, its expected sums, and an update that, like the kernel, stores
// the sum of every block inside the whole units of each range it is given before it changes the
// range's bytes. `ranges` are the chunk's ranges the kernel runs on; the rest is skipped.
struct FusedFixture {
  explicit FusedFixture(std::vector<ElementRange> kernel_ranges)
      : layout(optim::Kind::kAdamW, DType::kFloat32, 20000, 20000, kStripeChecksumBlock),
        regions(layout.chunk(0)),
        extent(regions.bytes),
        ranges(std::move(kernel_ranges)) {
    for (size_t i = 0; i < extent.size(); ++i) extent[i] = std::byte(i * 131 % 251);
    expected.resize(regions.bytes / kStripeChecksumBlock);
    for (size_t b = 0; b < expected.size(); ++b) expected[b] = io::Xxh3(Block(b));
    run.tile_elements = 8192;  // stripes [0, 8192), [8192, 16384), [16384, 20000)
  }

  std::span<const std::byte> Block(uint64_t b) const {
    return std::span(extent).subspan(b * kStripeChecksumBlock, kStripeChecksumBlock);
  }

  HashingRangeUpdate Update() {
    HashingRangeUpdate update;
    update.unit = kUnit;
    update.ranges = [this](size_t begin, size_t end, std::vector<ElementRange>* out) {
      for (const ElementRange& r : ranges) {
        if (r.end > begin && r.begin < end) {
          out->push_back({std::max(r.begin, begin), std::min(r.end, end)});
        }
      }
    };
    update.update = [this](size_t begin, size_t end, const optim::RunOptions&,
                           const ReadSums& sums) {
      stripes_updated.push_back(begin / 8192);
      std::vector<ElementRange> mine;
      Update().ranges(begin, end, &mine);
      for (const ElementRange& r : mine) Kernel(r, sums);
      return Status::Ok();
    };
    return update;
  }

  // Hashes the whole units of `r` in every region, then adds one to each of their bytes.
  void Kernel(const ElementRange& r, const ReadSums& sums) {
    const size_t first = (r.begin + kUnit - 1) / kUnit * kUnit, last = r.end / kUnit * kUnit;
    for (size_t region = 0; region < kElementRegions; ++region) {
      for (size_t e = first; e < last; e += kUnit) {
        const uint64_t at = regions.offset[region] + e * 4;
        sums.region[region][e * 4 / kStripeChecksumBlock] =
            io::Xxh3(Block(at / kStripeChecksumBlock));
      }
      for (uint64_t at = regions.offset[region] + r.begin * 4;
           at < regions.offset[region] + r.end * 4; ++at) {
        extent[at] = std::byte(static_cast<unsigned>(extent[at]) + 1);
      }
    }
  }

  Status Run(std::span<uint64_t> computed = {}) {
    ChunkChecksums checksums;
    checksums.expected = expected;
    checksums.computed = computed;
    checksums.where = "chunk 0, slot 1";
    return UpdateInStripes(regions, extent.data(), checksums, run, Update());
  }

  StateLayout layout;
  ChunkRegions regions;
  std::vector<std::byte> extent;
  std::vector<ElementRange> ranges;
  std::vector<uint64_t> expected;
  optim::RunOptions run;
  std::vector<size_t> stripes_updated;
};

// Stripes that are verified or hashed stay short enough for L2 whatever the tile; others follow
// the tile. Both start on the granule.
TEST(StripeElementsTest, HashedStripesAreCappedAndAllAreWholeGranules) {
  optim::RunOptions run;
  run.tile_elements = size_t{1} << 18;
  EXPECT_EQ(StripeElements(run, /*hashing=*/true), kMaxHashedStripeElements);
  EXPECT_EQ(StripeElements(run, /*hashing=*/false), size_t{1} << 18);
  run.tile_elements = 1000;
  EXPECT_EQ(StripeElements(run, true), kStripeGranule);
  EXPECT_EQ(StripeElements(run, false), kStripeGranule);
  run.tile_elements = kStripeGranule + 1;
  EXPECT_EQ(StripeElements(run, false), 2 * kStripeGranule);
  EXPECT_EQ(kMaxHashedStripeElements % kStripeGranule, 0u);
}

TEST(FusedReadVerifyTest, CleanStateVerifiesAndTheWrittenSumsAreThoseOfTheUpdatedExtent) {
  // Ranges cut inside blocks (7, 12345) and a skipped range [15000, 15500).
  FusedFixture f({{0, 7}, {7, 12345}, {12345, 15000}, {15500, 20000}});
  std::vector<uint64_t> computed(f.expected.size(), 0);
  ASSERT_TRUE(f.Run(computed).ok());
  EXPECT_EQ(f.stripes_updated, (std::vector<size_t>{0, 1, 2}));
  for (size_t b = 0; b < computed.size(); ++b) {
    ASSERT_EQ(computed[b], io::Xxh3(f.Block(b))) << "block " << b;
  }
  // Without sums to fill, the kernel's sums go to a buffer of the update's own.
  FusedFixture again({{0, 20000}});
  EXPECT_TRUE(again.Run().ok());
}

// A block the kernel hashes is checked after its stripe's update (the stripe was updated, and
// the caller must not use the state), with the same message as the separate pass.
TEST(FusedReadVerifyTest, DamageInAHashedBlockIsFoundAfterTheKernelRead) {
  FusedFixture f({{0, 20000}});
  // exp_avg_sq of element 9000: block 8 of its region, in stripe 1.
  f.extent[f.regions.offset[2] + 9000 * 4] ^= std::byte{1};
  const Status status = f.Run();
  EXPECT_EQ(status.code(), StatusCode::kCorruption) << status.ToString();
  const uint64_t block = (f.regions.offset[2] + 9000 * 4) / kStripeChecksumBlock;
  EXPECT_NE(status.message().find("chunk 0, slot 1, block " + std::to_string(block)),
            std::string_view::npos)
      << status.ToString();
  EXPECT_NE(status.message().find("checksum mismatch"), std::string_view::npos);
  EXPECT_EQ(f.stripes_updated, (std::vector<size_t>{0, 1, 2}));
}

// A block a range boundary cuts, and a block of a skipped range, are verified before the
// update: the stripe holding them is not updated.
TEST(FusedReadVerifyTest, DamageInACutOrSkippedBlockIsFoundBeforeTheUpdate) {
  for (size_t damaged : {size_t{12400}, size_t{15100}}) {
    FusedFixture f({{0, 12345}, {12345, 15000}, {15500, 20000}});
    f.extent[f.regions.offset[0] + damaged * 4] ^= std::byte{0x40};
    const Status status = f.Run();
    EXPECT_EQ(status.code(), StatusCode::kCorruption) << damaged << ": " << status.ToString();
    EXPECT_EQ(f.stripes_updated, (std::vector<size_t>{0, 2})) << damaged;
  }
}

// ---- The optimizer group, kernels and pipeline real ----

constexpr size_t kCount = 16384;  // one chunk: nothing else of the group can reach the disk

std::vector<std::byte> ReadWholeFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  std::vector<std::byte> bytes(static_cast<size_t>(in.tellg()));
  in.seekg(0);
  in.read(reinterpret_cast<char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  return bytes;
}

std::vector<std::byte> SwapBytes(io::SwapSpace& swap) {
  std::vector<std::byte> all;
  for (size_t i = 0; i < swap.files().file_count(); ++i) {
    const std::vector<std::byte> bytes = ReadWholeFile(swap.files().file(i).path());
    all.insert(all.end(), bytes.begin(), bytes.end());
  }
  return all;
}

// XORs `mask` into the byte at `at` of swap file 0.
void FlipByte(io::SwapSpace& swap, uint64_t at, std::byte mask) {
  const int fd = ::open(swap.files().file(0).path().c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  std::byte byte{};
  ASSERT_EQ(::pread(fd, &byte, 1, static_cast<off_t>(at)), 1);
  byte ^= mask;
  ASSERT_EQ(::pwrite(fd, &byte, 1, static_cast<off_t>(at)), 1);
  ::close(fd);
}

// The offsets in swap file 0 of the 4096-byte blocks that hold the 1024 master elements around
// `element` as the reference has them: the live copy of that block, and with two slots the
// inactive one when it holds the same bytes.
std::vector<uint64_t> MasterBlocks(io::SwapSpace& swap, const Reference& reference,
                                   size_t element) {
  const testing::StateBits state = reference.State();
  const std::vector<uint32_t>& master = state[0];
  const std::vector<std::byte> file = ReadWholeFile(swap.files().file(0).path());
  std::vector<uint64_t> found;
  for (uint64_t at = 0; at + kStripeChecksumBlock <= file.size(); at += kStripeChecksumBlock) {
    if (std::memcmp(file.data() + at, master.data() + element / 1024 * 1024,
                    kStripeChecksumBlock) == 0) {
      found.push_back(at);
    }
  }
  return found;
}

// Two clean steps, then the master written back unchanged through WriteState, so that the
// next step reads the chunk from the disk (a chunk the previous step wrote is otherwise served
// from the pipeline buffer that still holds it).
void TwoStepsThenFromDisk(GroupHarness& harness, Reference& reference) {
  for (int step = 0; step < 2; ++step) {
    harness.NewGradients(step);
    ASSERT_TRUE(harness.Step(harness.Hyper(step)).ok());
    ASSERT_TRUE(reference.Step(harness.Hyper(step), harness));
  }
  const std::vector<uint32_t> bits = reference.State()[0];
  std::vector<float> master(bits.size());
  std::memcpy(master.data(), bits.data(), bits.size() * sizeof(float));
  ASSERT_TRUE(harness.group().WriteState(StateSlot::kMaster, 0, master).ok());
}

// XORs `mask` into byte `byte` of each block at `blocks`: the live copy is among them.
void FlipInEach(io::SwapSpace& swap, const std::vector<uint64_t>& blocks, size_t byte,
                std::byte mask) {
  for (uint64_t block : blocks) FlipByte(swap, block + byte, mask);
}

// One chunk of kCount elements, checksums on, kernels on two threads.
HarnessOptions OneChunkOptions(std::optional<optim::Isa> isa, uint32_t slots, DType state) {
  HarnessOptions options;
  options.checksum_block = kStripeChecksumBlock;
  options.threads = 2;
  options.count = kCount;
  options.group.slots = slots;
  options.group.state_dtype = state;
  options.group.run.isa = isa;
  return options;
}

struct Case {
  std::optional<optim::Isa> isa;  // unset: the best path (the kernel hashes its reads)
  uint32_t slots;
  DType state;
};

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return std::string(c.isa.has_value() ? "Avx2" : "Best") + "_" + std::to_string(c.slots) +
         "Slots_" + (c.state == DType::kFloat32 ? "F32" : "BF16");
}

class FusedGroupTest : public ::testing::TestWithParam<Case> {
 protected:
  HarnessOptions Options() const {
    return OneChunkOptions(GetParam().isa, GetParam().slots, GetParam().state);
  }
  bool Hashes() const {
    return optim::UpdateHashesReads(optim::Kind::kAdamW, GetParam().state, Options().group.run);
  }

  // Two clean steps, then a flipped byte in the live master block holding `element`: the next
  // step, which reads the chunk from the disk, is Corruption naming the group, chunk, slot, file
  // and offset, changes no byte of the swap files and no step count; with the byte restored, the
  // step gives the reference's state.
  void ExpectCaught(size_t element) {
    if (!GetParam().isa.has_value() && optim::DetectCpuFeatures().avx512) {
      EXPECT_TRUE(Hashes()) << "the AVX-512 path does not hash its reads";
    }
    GroupHarness harness(Options());
    ASSERT_TRUE(harness.ok());
    Reference reference(harness);
    TwoStepsThenFromDisk(harness, reference);
    const std::vector<uint64_t> blocks = MasterBlocks(harness.swap(), reference, element);
    ASSERT_FALSE(blocks.empty());
    const size_t byte = element % 1024 * 4 + 2;
    FlipInEach(harness.swap(), blocks, byte, std::byte{0x10});
    const std::vector<std::byte> damaged = SwapBytes(harness.swap());

    harness.NewGradients(2);
    Result<StepReport> failed = harness.Step(harness.Hyper(2));
    ASSERT_EQ(failed.status().code(), StatusCode::kCorruption) << failed.status().ToString();
    const std::string message(failed.status().message());
    for (const std::string& part :
         {std::string("optimizer group 'g': chunk 0"), std::string("slot "),
          "file " + harness.swap().files().file(0).path() + " at offset "}) {
      EXPECT_NE(message.find(part), std::string::npos) << part << " missing from: " << message;
    }
    bool names_block = false;
    for (uint64_t block : blocks) {
      names_block |= message.find("at offset " + std::to_string(block) + " ") != std::string::npos;
    }
    EXPECT_TRUE(names_block) << message;
    EXPECT_TRUE(SwapBytes(harness.swap()) == damaged) << "the failed step wrote to the disk";
    EXPECT_EQ(harness.group().steps_taken(), 2);

    FlipInEach(harness.swap(), blocks, byte, std::byte{0x10});
    Result<StepReport> retried = harness.Step(harness.Hyper(2));
    ASSERT_TRUE(retried.ok()) << retried.status().ToString();
    ASSERT_TRUE(reference.Step(harness.Hyper(2), harness));
    harness.ExpectMatches(reference);
  }
};

// Master elements [5120, 6144): inside the piece [7, 12345) (gradient views end at 7, parameter
// views at 12345), a block the kernel hashes whole.
TEST_P(FusedGroupTest, FlippedByteInsideAPieceIsCorruptionAndNeverWritten) { ExpectCaught(5500); }

// Master elements [12288, 13312): the parameter view boundary at 12345 cuts the block.
TEST_P(FusedGroupTest, FlippedByteInABlockAPieceBoundaryCutsIsCorruption) { ExpectCaught(12300); }

// Two segments; the second has no gradient in the third step, so its state is only verified.
TEST_P(FusedGroupTest, FlippedByteInAPieceWithoutGradientIsCorruptionAndNeverWritten) {
  HarnessOptions options = Options();
  options.group.segments = {8192, 8192};
  GroupHarness harness(options);
  ASSERT_TRUE(harness.ok());
  Reference reference(harness);
  TwoStepsThenFromDisk(harness, reference);
  const std::vector<uint64_t> blocks = MasterBlocks(harness.swap(), reference, 10240);
  ASSERT_FALSE(blocks.empty());
  FlipInEach(harness.swap(), blocks, 100, std::byte{0x01});
  const std::vector<std::byte> damaged = SwapBytes(harness.swap());

  harness.NewGradients(2);
  const auto* grads = reinterpret_cast<const float*>(harness.grads());
  const std::vector<GradView> views = {{grads, DType::kFloat32, 8192},
                                       {nullptr, DType::kFloat32, 8192}};
  const std::vector<ParamView> params = harness.param_views();
  StepArgs args;
  args.hyper = harness.Hyper(2);
  args.grads = views;
  args.params = params;
  Result<StepReport> failed = harness.group().Step(args);
  ASSERT_EQ(failed.status().code(), StatusCode::kCorruption) << failed.status().ToString();
  EXPECT_TRUE(SwapBytes(harness.swap()) == damaged) << "the failed step wrote to the disk";
  EXPECT_EQ(harness.group().steps_taken(), 2);
}

INSTANTIATE_TEST_SUITE_P(PathsSlotsStates, FusedGroupTest,
                         ::testing::Values(Case{std::nullopt, 2, DType::kFloat32},
                                           Case{std::nullopt, 1, DType::kFloat32},
                                           Case{std::nullopt, 2, DType::kBFloat16},
                                           Case{std::nullopt, 1, DType::kBFloat16},
                                           Case{optim::Isa::kAvx2, 2, DType::kFloat32},
                                           Case{optim::Isa::kAvx2, 1, DType::kFloat32}),
                         CaseName);

// ---- int8 state: the block kernels hash master and both moments' codes ----

enum class Int8Array { kMaster = 0, kExpAvg = 1, kExpAvgSq = 2 };  // the chunk's element regions

struct Int8Case {
  std::optional<optim::Isa> isa;  // unset: the best path
  uint32_t slots;
  Int8Array array;
};

std::string Int8CaseName(const ::testing::TestParamInfo<Int8Case>& info) {
  const Int8Case& c = info.param;
  static constexpr const char* kArrays[] = {"Master", "ExpAvg", "ExpAvgSq"};
  return std::string(c.isa.has_value() ? "Avx2" : "Best") + "_" + std::to_string(c.slots) +
         "Slots_" + kArrays[static_cast<size_t>(c.array)];
}

class FusedInt8Test : public ::testing::TestWithParam<Int8Case> {
 protected:
  HarnessOptions Options() const {
    return OneChunkOptions(GetParam().isa, GetParam().slots, DType::kInt8);
  }

  // Two clean steps, then the master written back unchanged, so that the next step reads the
  // chunk from the disk.
  static void TwoStepsThenFromDisk(GroupHarness& harness) {
    for (int step = 0; step < 2; ++step) {
      harness.NewGradients(step);
      ASSERT_TRUE(harness.Step(harness.Hyper(step)).ok());
    }
    std::vector<float> master(kCount);
    ASSERT_TRUE(harness.group().ReadState(StateSlot::kMaster, 0, master).ok());
    ASSERT_TRUE(harness.group().WriteState(StateSlot::kMaster, 0, master).ok());
  }

  // The offsets in swap file 0 of the byte of `element` in the chosen array, in every slot whose
  // master starts as the group's does (the live slot is among them).
  std::vector<uint64_t> ElementBytes(GroupHarness& harness, size_t element) const {
    const StateLayout layout(optim::Kind::kAdamW, DType::kInt8, kCount, kCount,
                             kStripeChecksumBlock);
    const ChunkRegions regions = layout.chunk(0);
    std::vector<float> master(kCount);
    EXPECT_TRUE(harness.group().ReadState(StateSlot::kMaster, 0, master).ok());
    const std::vector<std::byte> file = ReadWholeFile(harness.swap().files().file(0).path());
    const auto region = static_cast<size_t>(GetParam().array);
    const size_t element_bytes = region == 0 ? 4 : 1;
    std::vector<uint64_t> found;
    for (uint64_t at = regions.offset[0]; at + kStripeChecksumBlock <= file.size();
         at += kStripeChecksumBlock) {
      if (std::memcmp(file.data() + at, master.data(), kStripeChecksumBlock) == 0) {
        const uint64_t extent = at - regions.offset[0];
        found.push_back(extent + regions.offset[region] + element * element_bytes);
      }
    }
    return found;
  }

  // A flipped byte in the chosen array at `element` after two clean steps: the next step is
  // Corruption, writes nothing to the swap files and takes no step; with the byte restored, the
  // step gives the state of a twin group that was never damaged.
  void ExpectCaught(size_t element) {
    if (!GetParam().isa.has_value() && optim::DetectCpuFeatures().avx512) {
      EXPECT_TRUE(optim::UpdateHashesReads(optim::Kind::kAdamW, DType::kInt8, {}))
          << "the AVX-512 path does not hash its int8 reads";
    }
    GroupHarness harness(Options()), twin(Options());
    ASSERT_TRUE(harness.ok() && twin.ok());
    TwoStepsThenFromDisk(harness);
    TwoStepsThenFromDisk(twin);
    const std::vector<uint64_t> bytes = ElementBytes(harness, element);
    ASSERT_FALSE(bytes.empty());
    for (uint64_t at : bytes) FlipByte(harness.swap(), at, std::byte{0x04});
    const std::vector<std::byte> damaged = SwapBytes(harness.swap());

    harness.NewGradients(2);
    Result<StepReport> failed = harness.Step(harness.Hyper(2));
    ASSERT_EQ(failed.status().code(), StatusCode::kCorruption) << failed.status().ToString();
    EXPECT_NE(failed.status().message().find("optimizer group 'g': chunk 0"), std::string::npos)
        << failed.status().ToString();
    EXPECT_TRUE(SwapBytes(harness.swap()) == damaged) << "the failed step wrote to the disk";
    EXPECT_EQ(harness.group().steps_taken(), 2);

    for (uint64_t at : bytes) FlipByte(harness.swap(), at, std::byte{0x04});
    ASSERT_TRUE(harness.Step(harness.Hyper(2)).ok());
    twin.NewGradients(2);
    ASSERT_TRUE(twin.Step(twin.Hyper(2)).ok());
    EXPECT_TRUE(harness.Snapshot() == twin.Snapshot()) << "the retried step differs";
  }
};

// Element 5500: in the unit [4096, 8192), the stripe of 4096 elements that the piece [256, 12288)
// (the gradient view boundary at 7 and the parameter view boundary at 12345 cut blocks, which
// are staged) covers whole; the kernel hashes it on the AVX-512 path.
TEST_P(FusedInt8Test, FlippedByteInAHashedUnitIsCorruptionAndNeverWritten) { ExpectCaught(5500); }

// Element 12300: in the staged block [12288, 12544), verified by the pass before the update.
TEST_P(FusedInt8Test, FlippedByteInAStagedBlockIsCorruptionAndNeverWritten) { ExpectCaught(12300); }

INSTANTIATE_TEST_SUITE_P(PathsSlotsArrays, FusedInt8Test,
                         ::testing::Values(Int8Case{std::nullopt, 2, Int8Array::kMaster},
                                           Int8Case{std::nullopt, 2, Int8Array::kExpAvg},
                                           Int8Case{std::nullopt, 2, Int8Array::kExpAvgSq},
                                           Int8Case{std::nullopt, 1, Int8Array::kExpAvg},
                                           Int8Case{std::nullopt, 1, Int8Array::kExpAvgSq},
                                           Int8Case{optim::Isa::kAvx2, 2, Int8Array::kExpAvg},
                                           Int8Case{optim::Isa::kAvx2, 1, Int8Array::kExpAvgSq}),
                         Int8CaseName);

}  // namespace
}  // namespace zoe::offload
