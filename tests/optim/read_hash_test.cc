// Description: the update kernels that hash what they read (UpdatePointers::read_sums, the
// AVX-512 paths of Adam and AdamW with fp32, bf16 or int8 state): every block sum they report
// equals XXH3-64 of the block as it was before the update (the function io::Xxh3 computes),
// entries outside the hashed units are left alone, and the update's bits are the same with and
// without hashing -- for every grad type, copy, fast/exact, streaming/plain, aligned or not; for
// int8 state, for several block layouts and read origins and ranges of whole blocks.
#include <gtest/gtest.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <cstring>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "optim/chunk.h"
#include "optim/dispatch.h"
#include "optim/kernels.h"
#include "optim/quantize.h"
#include "optim_test_util.h"

namespace zoe::optim {
namespace {

constexpr uint64_t kUntouched = 0x5a5a5a5a5a5a5a5aULL;
constexpr size_t kArrays = 3;  // master, exp_avg, exp_avg_sq

// One chunk's arrays, each starting `offset` bytes after a 4096-byte boundary (so all fp32
// arrays are congruent modulo 64 bytes, as streaming needs), filled with seeded random values.
struct Arrays {
  Arrays(size_t elements, DType grad, DType state, size_t misalignment, uint32_t seed)
      : count(elements), grad_type(grad), state_type(state), offset(misalignment) {
    for (auto& buffer : storage) buffer.resize(count * 4 + offset + kReadHashBlock * 2);
    std::mt19937 random(seed);
    std::uniform_real_distribution<float> value(-1.0f, 1.0f);
    for (size_t i = 0; i < count; ++i) {
      testing::PutElement(Base(0), DType::kFloat32, i, value(random));
      testing::PutElement(Base(1), grad, i, value(random));
      testing::PutElement(Base(2), state, i, value(random) * 0.1f);
      testing::PutElement(Base(3), state, i, value(random) * value(random) * 0.01f);
    }
  }

  std::byte* Base(size_t a) {
    auto* raw = storage[a].data();
    const auto misalignment = reinterpret_cast<uintptr_t>(raw) % kReadHashBlock;
    return raw + (kReadHashBlock - misalignment) % kReadHashBlock + offset;
  }
  // master, grad, exp_avg, exp_avg_sq, copy (bf16)
  UpdatePointers Pointers() {
    UpdatePointers p;
    p.master = reinterpret_cast<float*>(Base(0));
    p.grad = Base(1);
    p.exp_avg = Base(2);
    p.exp_avg_sq = Base(3);
    p.param_copy = Base(4);
    return p;
  }
  // Bytes of hashed array a (0 master, 1 exp_avg, 2 exp_avg_sq).
  std::vector<std::byte> Hashed(size_t a) {
    const size_t bytes = count * (a == 0 ? 4 : DTypeSize(state_type));
    std::byte* base = Base(a == 0 ? 0 : a + 1);
    return {base, base + bytes};
  }
  std::vector<std::byte> All() {
    std::vector<std::byte> all;
    for (size_t a = 0; a < std::size(storage); ++a) {
      all.insert(all.end(), Base(a), Base(a) + count * 4);
    }
    return all;
  }

  size_t count;
  DType grad_type;
  DType state_type;
  size_t offset;
  std::vector<std::byte> storage[5];
};

std::string Describe(Isa isa, Kind kind, DType grad, DType state, CopySlot copy,
                     UpdateVariant variant, size_t offset, size_t begin, size_t end) {
  return std::string(IsaName(isa)) + " " + std::string(KindName(kind)) +
         " grad=" + std::string(DTypeName(grad)) + " state=" + std::string(DTypeName(state)) +
         " copy=" + std::to_string(static_cast<int>(copy)) +
         " fast=" + std::to_string(variant.fast) +
         " streaming=" + std::to_string(variant.streaming) + " offset=" + std::to_string(offset) +
         " range=[" + std::to_string(begin) + "," + std::to_string(end) + ")";
}

// Every block of the hashed arrays wholly inside elements [first, last) (counted from the arrays'
// start) has the XXH3 of its bytes in `before`; every other entry is untouched.
void ExpectSums(const std::vector<uint64_t> (&sums)[kArrays],
                const std::vector<std::byte> (&before)[kArrays], DType state, size_t first,
                size_t last, const std::string& what) {
  for (size_t a = 0; a < kArrays; ++a) {
    const size_t element_bytes = a == 0 ? 4 : DTypeSize(state);
    for (size_t b = 0; b < sums[a].size(); ++b) {
      const size_t start = b * kReadHashBlock;
      const bool inside = first < last && start >= first * element_bytes &&
                          start + kReadHashBlock <= last * element_bytes;
      if (!inside) {
        EXPECT_EQ(sums[a][b], kUntouched) << what << ": array " << a << " block " << b;
        continue;
      }
      const uint64_t expected = XXH3_64bits(before[a].data() + start, kReadHashBlock);
      EXPECT_EQ(sums[a][b], expected) << what << ": array " << a << " block " << b;
    }
  }
}

// Runs `update` on [begin, end) of `hashed` with read sums (element i of the call is element
// i + origin of the hashed arrays) and of `plain` without: the same bytes, and the sums of every
// block inside the range's whole units, nothing else (ExpectSums). A is Arrays or Int8Arrays.
template <class A>
void ExpectHashedUpdate(UpdateFn update, const UpdateConstants& constants, A& hashed, A& plain,
                        DType state, size_t origin, size_t begin, size_t end,
                        const std::string& what) {
  std::vector<std::byte> before[kArrays];
  for (size_t a = 0; a < kArrays; ++a) before[a] = hashed.Hashed(a);
  std::vector<uint64_t> sums[kArrays];
  UpdatePointers with_sums = hashed.Pointers();
  with_sums.read_origin = origin;
  for (size_t a = 0; a < kArrays; ++a) {
    sums[a].assign(before[a].size() / kReadHashBlock + 1, kUntouched);
    with_sums.read_sums[a] = sums[a].data();
  }
  update(constants, with_sums, begin, end);
  update(constants, plain.Pointers(), begin, end);
  EXPECT_TRUE(hashed.All() == plain.All()) << what << ": hashing changed the update";
  const size_t unit = ReadHashElements(state);
  const size_t first = (begin + origin + unit - 1) / unit * unit;  // in the hashed arrays
  const size_t last = (end + origin) / unit * unit;
  ExpectSums(sums, before, state, first, last, what);
}

void CheckOne(const KernelTable& table, Kind kind, DType grad, DType state, CopySlot copy,
              UpdateVariant variant, size_t offset, size_t count, size_t begin, size_t end) {
  const std::string what =
      Describe(table.isa, kind, grad, state, copy, variant, offset, begin, end);
  const uint32_t seed = static_cast<uint32_t>(count + begin * 7 + offset);
  Arrays hashed(count, grad, state, offset, seed);
  Arrays plain(count, grad, state, offset, seed);
  const UpdateConstants constants =
      MakeUpdateConstants(testing::DefaultHyper(kind), 3, {1.0 / 512.0, 0.5});
  const UpdateFn update = table.update[KernelTable::UpdateIndex(kind, grad, state, copy, variant)];
  ExpectHashedUpdate(update, constants, hashed, plain, state, 0, begin, end, what);
}

std::vector<const KernelTable*> HashingTables() {
  std::vector<const KernelTable*> tables;
  for (Isa isa : testing::SupportedIsas()) {
    auto table = KernelsFor(isa);
    if (table.ok() && (*table)->hashes_reads) tables.push_back(*table);
  }
  return tables;
}

// Every hashing table, kind, state type, arithmetic, store kind, alignment and range; the
// gradient and copy types (which the read hashing does not touch) rotate through their values
// from case to case, so each appears with every other dimension's values without the full
// product.
TEST(ReadHash, BlockSumsMatchXxh3AndUpdatesAreBitIdentical) {
  const auto tables = HashingTables();
  ZOE_SKIP_UNLESS_READS_ARE_HASHED(!tables.empty());
  constexpr size_t kCount = 3 * 2048 + 777;
  const std::pair<size_t, size_t> ranges[] = {{0, kCount}, {100, kCount}, {2048, 6144}, {5, 900}};
  const DType grads[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
  const CopySlot copies[] = {CopySlot::kNone, CopySlot::kBF16, CopySlot::kF32, CopySlot::kNone};
  size_t rotation = 0;
  for (const KernelTable* table : tables) {
    for (Kind kind : {Kind::kAdamW, Kind::kAdam}) {
      for (DType state : {DType::kFloat32, DType::kBFloat16}) {
        ASSERT_TRUE(table->HashesReads(kind, state));
        for (bool fast : {false, true}) {
          for (bool streaming : {false, true}) {
            for (size_t offset : {size_t{0}, size_t{4}}) {
              for (auto [begin, end] : ranges) {
                const DType grad = grads[rotation % std::size(grads)];
                const CopySlot copy = copies[rotation % std::size(copies)];
                ++rotation;
                CheckOne(*table, kind, grad, state, copy, {fast, streaming}, offset, kCount, begin,
                         end);
              }
            }
          }
        }
      }
    }
  }
}

// A byte flipped in one block of one array after its sums were taken (as a disk would return it)
// gives that block, and only that block, a sum other than the recorded one.
TEST(ReadHash, AFlippedByteChangesOnlyItsBlocksSum) {
  const auto tables = HashingTables();
  ZOE_SKIP_UNLESS_READS_ARE_HASHED(!tables.empty());
  constexpr size_t kCount = 4096;
  for (const KernelTable* table : tables) {
    for (DType state : {DType::kFloat32, DType::kBFloat16}) {
      for (size_t flipped = 0; flipped < kArrays; ++flipped) {
        Arrays arrays(kCount, DType::kFloat32, state, 0, 7);
        std::vector<uint64_t> recorded[kArrays], read[kArrays];
        UpdatePointers p = arrays.Pointers();
        for (size_t a = 0; a < kArrays; ++a) {
          const std::vector<std::byte> bytes = arrays.Hashed(a);
          for (size_t b = 0; b < bytes.size() / kReadHashBlock; ++b) {
            recorded[a].push_back(XXH3_64bits(bytes.data() + b * kReadHashBlock, kReadHashBlock));
          }
          read[a].assign(recorded[a].size(), kUntouched);
          p.read_sums[a] = read[a].data();
        }
        const size_t block = recorded[flipped].size() - 1;
        const size_t byte = block * kReadHashBlock + 1234;
        arrays.Base(flipped == 0 ? 0 : flipped + 1)[byte] ^= std::byte{0x10};
        const UpdateConstants constants =
            MakeUpdateConstants(testing::DefaultHyper(Kind::kAdamW), 1, {});
        table->update[KernelTable::UpdateIndex(Kind::kAdamW, DType::kFloat32, state,
                                               CopySlot::kNone)](constants, p, 0, kCount);
        for (size_t a = 0; a < kArrays; ++a) {
          for (size_t b = 0; b < recorded[a].size(); ++b) {
            const bool damaged = a == flipped && b == block;
            EXPECT_EQ(read[a][b] != recorded[a][b], damaged)
                << IsaName(table->isa) << " state=" << DTypeName(state) << " array " << a
                << " block " << b;
          }
        }
      }
    }
  }
}

// ---- int8 state: the block kernels (BlockUpdateFn) ----

// One chunk of int8 AdamW state: master and both moments' codes hold `origin` elements before the
// chunk (the hashed arrays start there, on a 4096-byte boundary), then `count`; scales per block
// of the layout `block_offset` places; seeded random values (every byte is a valid code).
struct Int8Arrays {
  Int8Arrays(size_t elements, size_t first_offset, size_t read_origin, DType grad, uint32_t seed)
      : count(elements), block_offset(first_offset), origin(read_origin), grad_type(grad) {
    const size_t blocks = QuantBlockCount(count, block_offset);
    master.resize((origin + count) * 4 + kReadHashBlock);
    codes[0].resize(origin + count + kReadHashBlock);
    codes[1].resize(origin + count + kReadHashBlock);
    grads.resize(count * 4);
    copy.resize(count * 4);
    std::mt19937 random(seed);
    std::uniform_real_distribution<float> value(-1.0f, 1.0f);
    std::uniform_int_distribution<int> byte(0, 255);
    auto* m = reinterpret_cast<float*>(Aligned(master));
    for (size_t i = 0; i < origin + count; ++i) m[i] = value(random);
    for (auto& c : codes) {
      for (size_t i = 0; i < origin + count; ++i) Aligned(c)[i] = std::byte(byte(random));
    }
    for (size_t i = 0; i < count; ++i) testing::PutElement(grads.data(), grad, i, value(random));
    for (auto& s : scales) {
      s.resize(blocks);
      for (float& x : s) x = 0.05f + 0.05f * value(random);
    }
  }

  static std::byte* Aligned(std::vector<std::byte>& v) {
    const auto misalignment = reinterpret_cast<uintptr_t>(v.data()) % kReadHashBlock;
    return v.data() + (kReadHashBlock - misalignment) % kReadHashBlock;
  }
  UpdatePointers Pointers() {
    UpdatePointers p;
    p.master = reinterpret_cast<float*>(Aligned(master)) + origin;
    p.grad = grads.data();
    p.exp_avg = Aligned(codes[0]) + origin;
    p.exp_avg_sq = Aligned(codes[1]) + origin;
    p.param_copy = copy.data();
    p.exp_avg_scale = scales[0].data();
    p.exp_avg_sq_scale = scales[1].data();
    p.block_offset = block_offset;
    return p;
  }
  // The bytes of hashed array a (0 master, 1 exp_avg, 2 exp_avg_sq) from its start.
  std::vector<std::byte> Hashed(size_t a) {
    std::byte* base = a == 0 ? Aligned(master) : Aligned(codes[a - 1]);
    return {base, base + (origin + count) * (a == 0 ? 4 : 1)};
  }
  std::vector<std::byte> All() {
    std::vector<std::byte> all;
    for (size_t a = 0; a < kArrays; ++a) {
      const std::vector<std::byte> bytes = Hashed(a);
      all.insert(all.end(), bytes.begin(), bytes.end());
    }
    all.insert(all.end(), copy.begin(), copy.end());
    for (auto& s : scales) {
      const auto* bytes = reinterpret_cast<const std::byte*>(s.data());
      all.insert(all.end(), bytes, bytes + s.size() * sizeof(float));
    }
    return all;
  }

  size_t count;
  size_t block_offset;
  size_t origin;
  DType grad_type;
  std::vector<std::byte> master, codes[2], grads, copy;
  std::vector<float> scales[2];
};

// The first block boundary of the layout at or after element `at`.
size_t BlockBoundaryFrom(size_t at, size_t block_offset) {
  if (at == 0) return 0;
  return ((at + block_offset + kQuantBlock - 1) / kQuantBlock) * kQuantBlock - block_offset;
}

void CheckInt8(const KernelTable& table, Kind kind, DType grad, CopySlot copy, bool fast,
               size_t block_offset, size_t origin, size_t count, size_t begin, size_t end) {
  const std::string what =
      std::string(IsaName(table.isa)) + " " + std::string(KindName(kind)) +
      " grad=" + std::string(DTypeName(grad)) + " copy=" + std::to_string(static_cast<int>(copy)) +
      " fast=" + std::to_string(fast) + " block_offset=" + std::to_string(block_offset) +
      " origin=" + std::to_string(origin) + " range=[" + std::to_string(begin) + "," +
      std::to_string(end) + ")";
  const uint32_t seed = static_cast<uint32_t>(begin * 7 + origin + block_offset);
  Int8Arrays hashed(count, block_offset, origin, grad, seed);
  Int8Arrays plain(count, block_offset, origin, grad, seed);
  const UpdateConstants constants =
      MakeUpdateConstants(testing::DefaultHyper(kind), 3, {1.0 / 512.0, 0.5});
  const BlockUpdateFn update =
      table.block_update[KernelTable::BlockUpdateIndex(kind, grad, copy, fast)];
  ExpectHashedUpdate(update, constants, hashed, plain, DType::kInt8, origin, begin, end, what);
}

// Every hashing table, both kinds, both arithmetics, block layouts starting a block at element 0
// or 100 elements into one, read origins putting unit boundaries at different blocks, and ranges
// of whole blocks: all of the chunk, ones starting and ending inside units, and one shorter than a
// unit (nothing hashed).
TEST(ReadHash, Int8BlockSumsMatchXxh3AndUpdatesAreBitIdentical) {
  const auto tables = HashingTables();
  ZOE_SKIP_UNLESS_READS_ARE_HASHED(!tables.empty());
  constexpr size_t kCount = 3 * 4096 + 777;
  const std::pair<size_t, size_t> layouts[] = {{0, 0}, {0, 1024}, {100, 100}, {100, 100 + 5 * 256}};
  const DType grads[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
  const CopySlot copies[] = {CopySlot::kNone, CopySlot::kBF16, CopySlot::kF32, CopySlot::kF16};
  size_t rotation = 0;
  for (const KernelTable* table : tables) {
    for (Kind kind : {Kind::kAdamW, Kind::kAdam}) {
      ASSERT_TRUE(table->HashesReads(kind, DType::kInt8));
      for (bool fast : {false, true}) {
        for (auto [block_offset, origin] : layouts) {
          const std::pair<size_t, size_t> ranges[] = {
              {0, kCount},
              {BlockBoundaryFrom(300, block_offset), BlockBoundaryFrom(9000, block_offset)},
              {BlockBoundaryFrom(5000, block_offset), kCount},
              {0, BlockBoundaryFrom(200, block_offset)}};
          for (auto [begin, end] : ranges) {
            const DType grad = grads[rotation % std::size(grads)];
            const CopySlot copy = copies[rotation % std::size(copies)];
            ++rotation;
            CheckInt8(*table, kind, grad, copy, fast, block_offset, origin, kCount, begin, end);
          }
        }
      }
    }
  }
}

TEST(ReadHash, OnlyAdamFamilyHashes) {
  for (Isa isa : testing::SupportedIsas()) {
    auto table = KernelsFor(isa);
    ASSERT_TRUE(table.ok());
    const bool avx512 = isa == Isa::kAvx512 || isa == Isa::kAvx512Bf16;
    EXPECT_EQ((*table)->hashes_reads, avx512) << IsaName(isa);
    for (DType state : {DType::kFloat32, DType::kBFloat16, DType::kInt8}) {
      EXPECT_EQ((*table)->HashesReads(Kind::kAdamW, state), avx512) << IsaName(isa);
      EXPECT_EQ((*table)->HashesReads(Kind::kAdam, state), avx512) << IsaName(isa);
      EXPECT_FALSE((*table)->HashesReads(Kind::kAdagrad, state));
      EXPECT_FALSE((*table)->HashesReads(Kind::kLion, state));
    }
    EXPECT_FALSE((*table)->HashesReads(Kind::kAdamW, DType::kFloat16));
  }
}

}  // namespace
}  // namespace zoe::optim
