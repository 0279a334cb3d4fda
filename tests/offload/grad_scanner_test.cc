// GradScanner: however a step's gradient is cut into views (of several dtypes, some absent), and
// however many calls deliver them, in whatever order, on one thread or several, the scan is the
// same bits as optim::ScanGradients of the whole gradient as one fp32 buffer.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/executor.h"
#include "offload/optimizer/optimizer_group_scan.h"

namespace zoe::offload {
namespace {

using optim::DType;

constexpr size_t kCount = 100003;
constexpr size_t kTile = 1000;

// Values over several decades whose low 16 bits are zero, so that bf16 holds them exactly and a
// bf16 piece widens to the fp32 gradient's very bits.
std::vector<float> GradientValues() {
  std::vector<float> values(kCount);
  std::mt19937 random(7);
  std::uniform_real_distribution<float> mantissa(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-20, 20);
  for (float& v : values) {
    const float x = std::ldexp(mantissa(random), exponent(random));
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    bits &= 0xFFFF0000u;
    std::memcpy(&v, &bits, sizeof v);
  }
  return values;
}

// The gradient cut into pieces: cuts inside tiles, on tile boundaries, pieces shorter than a tile
// and longer than several; every third piece in bf16, every fifth absent.
struct CutGradient {
  std::vector<float> whole;  // the fp32 pieces' data; zeros where a piece is absent
  std::vector<std::vector<uint16_t>> bf16;
  std::vector<GradScanner::Piece> pieces;
};

CutGradient Cut(const std::vector<float>& values) {
  CutGradient cut;
  cut.whole = values;
  const std::vector<size_t> lengths = {1, 999, 1000, 3, 2500, 17, 7000, 1, 1, 4096, 333};
  cut.bf16.reserve(kCount);
  for (size_t offset = 0, i = 0; offset < kCount; ++i) {
    const size_t count = std::min(lengths[i % lengths.size()], kCount - offset);
    GradScanner::Piece piece{offset, cut.whole.data() + offset, DType::kFloat32, count};
    if (i % 5 == 4) {
      piece.data = nullptr;
      std::fill(cut.whole.begin() + offset, cut.whole.begin() + offset + count, 0.0f);
    } else if (i % 3 == 2) {
      std::vector<uint16_t>& narrow = cut.bf16.emplace_back(count);
      for (size_t j = 0; j < count; ++j) {
        uint32_t bits;
        std::memcpy(&bits, &values[offset + j], sizeof bits);
        narrow[j] = static_cast<uint16_t>(bits >> 16);
      }
      piece.data = narrow.data();
      piece.dtype = DType::kBFloat16;
    }
    cut.pieces.push_back(piece);
    offset += count;
  }
  return cut;
}

double WholeScan(const std::vector<float>& whole) {
  optim::RunOptions run;
  run.tile_elements = kTile;
  Result<optim::GradScan> scan = optim::ScanGradients(whole.data(), DType::kFloat32, kCount, run);
  EXPECT_TRUE(scan.ok()) << scan.status().ToString();
  return scan.ok() ? scan->sum_squares : -1.0;
}

TEST(GradScanner, AnyCutOrderAndThreadCountGivesTheWholeBufferScan) {
  const CutGradient cut = Cut(GradientValues());
  const double expected = WholeScan(cut.whole);
  std::vector<GradScanner::Piece> shuffled = cut.pieces;
  std::shuffle(shuffled.begin(), shuffled.end(), std::mt19937(3));
  Executor executor(2);
  for (Executor* threads : {static_cast<Executor*>(nullptr), &executor}) {
    optim::RunOptions run;
    run.executor = threads;
    run.tile_elements = kTile;
    GradScanner scanner(kCount, kTile);
    for (int round = 0; round < 2; ++round) {  // the second after Reset, with kept buffers
      scanner.Reset();
      ASSERT_TRUE(scanner.Add(cut.pieces, run).ok());
      EXPECT_EQ(scanner.Total().sum_squares, expected) << "one call, round " << round;
    }
    scanner.Reset();
    ASSERT_TRUE(scanner.Add(shuffled, run).ok());
    EXPECT_EQ(scanner.Total().sum_squares, expected) << "one call, shuffled";
    scanner.Reset();
    for (const GradScanner::Piece& piece : shuffled)
      ASSERT_TRUE(scanner.Add({&piece, 1}, run).ok());
    EXPECT_EQ(scanner.Total().sum_squares, expected) << "a call per piece, shuffled";
  }
}

TEST(GradScanner, NonFiniteValueInAGatheredTileIsFound) {
  std::vector<float> values = GradientValues();
  values[500] = NAN;  // tile 0, which pieces 0 and 1 share
  const CutGradient cut = Cut(values);
  ASSERT_EQ(cut.pieces[1].offset, 1u);
  ASSERT_EQ(cut.pieces[1].count, 999u);
  GradScanner scanner(kCount, kTile);
  optim::RunOptions run;
  run.tile_elements = kTile;
  ASSERT_TRUE(scanner.Add(cut.pieces, run).ok());
  EXPECT_FALSE(scanner.Total().finite());
}

// A piece the kernels cannot read fails the call, whether its tiles would be scanned in place or
// gathered, and leaves nothing behind: the same scanner then scans the readable pieces exactly.
TEST(GradScanner, AnUnreadableDTypeIsAnErrorThatRecordsNothing) {
  const std::vector<float> values = GradientValues();
  const double expected = WholeScan(values);
  Executor executor(2);
  optim::RunOptions run;
  run.executor = &executor;
  run.tile_elements = kTile;
  for (size_t offset : {0ul, 500ul}) {  // whole tiles, then a cut tile
    GradScanner scanner(kCount, kTile);
    std::vector<GradScanner::Piece> pieces = {
        {0, values.data(), DType::kFloat32, offset},
        {offset, values.data() + offset, DType::kInt8, 3000},
        {offset + 3000, values.data() + offset + 3000, DType::kFloat32, kCount - offset - 3000}};
    const Status status = scanner.Add(pieces, run);
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << "offset " << offset;
    EXPECT_NE(status.message().find("int8"), std::string::npos) << status.ToString();
    // Alone, as AccumulateGrad hands pieces over, the bad piece is the first of its cut tiles.
    EXPECT_FALSE(scanner.Add({&pieces[1], 1}, run).ok());
    pieces[1].dtype = DType::kFloat32;
    for (size_t p : {1, 0, 2}) ASSERT_TRUE(scanner.Add({&pieces[p], 1}, run).ok()) << p;
    EXPECT_EQ(scanner.Total().sum_squares, expected) << "offset " << offset;
  }
}

// A tile longer than the gradient is one tile, gathered from every piece.
TEST(GradScanner, ATileLongerThanTheGradientIsOneGatheredTile) {
  const CutGradient cut = Cut(GradientValues());
  optim::RunOptions whole;
  whole.tile_elements = std::numeric_limits<size_t>::max();
  const Result<optim::GradScan> expected =
      optim::ScanGradients(cut.whole.data(), DType::kFloat32, kCount, whole);
  ASSERT_TRUE(expected.ok());
  Executor executor(2);
  optim::RunOptions run = whole;
  run.executor = &executor;
  GradScanner scanner(kCount, std::numeric_limits<size_t>::max());
  ASSERT_TRUE(scanner.Add(cut.pieces, run).ok());
  EXPECT_EQ(scanner.Total().sum_squares, expected->sum_squares);
}

}  // namespace
}  // namespace zoe::offload
