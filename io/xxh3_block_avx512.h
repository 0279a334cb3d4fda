// XXH3-64 (seed 0, default secret) of 4096-byte blocks, fed one 64-byte stripe at a time in
// AVX-512 registers, for a loop that reads the block anyway (the optimizer's update kernel):
// the block is hashed from the registers its data was loaded into, with no second pass over
// memory. Gives exactly io::Xxh3 of the block (libxxhash's XXH3_hashLong_64b with the default
// secret): for a 4096-byte input that is 3 rounds of 16 stripes, each followed by a scramble,
// then 15 stripes, then the last stripe (bytes 4032..4095) with the secret at offset
// 192 - 64 - 7, then the merge of the accumulators with the length.
//
// Included only by translation units compiled with -mavx512f -mavx512bw (internal linkage).
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

namespace zoe::io {
namespace {  // NOLINT: internal linkage on purpose (compiled per instruction set)

class Xxh3BlockHasher {
 public:
  static constexpr size_t kBlockBytes = 4096;
  static constexpr size_t kStripeBytes = 64;
  static constexpr unsigned kStripesPerBlock = kBlockBytes / kStripeBytes;

  Xxh3BlockHasher() { Reset(); }

  // Feeds the next stripe of the block (64 bytes as loaded). Returns true when it was the
  // block's last stripe: Finish() then gives the block's hash.
  bool Consume(__m512i data) {
    const unsigned s = stripe_++;
    const bool last = s == kStripesPerBlock - 1;
    const size_t key = last ? kLastAccumulateKey : (s % kStripesPerRound) * kKeyAdvance;
    Accumulate(data, _mm512_loadu_si512(kSecret + key));
    if (s % kStripesPerRound == kStripesPerRound - 1 && !last) Scramble();
    return last;
  }

  // The hash of the block whose 64 stripes were consumed; starts the next block.
  uint64_t Finish() {
    alignas(64) uint64_t acc[8];
    _mm512_store_si512(acc, acc_);
    uint64_t result = kBlockBytes * kPrime64_1;
    for (size_t i = 0; i < 4; ++i) {
      result += Mix(acc[2 * i] ^ Read64(kMergeKey + 16 * i),
                    acc[2 * i + 1] ^ Read64(kMergeKey + 16 * i + 8));
    }
    Reset();
    return Avalanche(result);
  }

 private:
  static constexpr uint32_t kPrime32_1 = 0x9E3779B1U;
  static constexpr uint32_t kPrime32_2 = 0x85EBCA77U;
  static constexpr uint32_t kPrime32_3 = 0xC2B2AE3DU;
  static constexpr uint64_t kPrime64_1 = 0x9E3779B185EBCA87ULL;
  static constexpr uint64_t kPrime64_2 = 0xC2B2AE3D27D4EB4FULL;
  static constexpr uint64_t kPrime64_3 = 0x165667B19E3779F9ULL;
  static constexpr uint64_t kPrime64_4 = 0x85EBCA77C2B2AE63ULL;
  static constexpr uint64_t kPrime64_5 = 0x27D4EB2F165667C5ULL;
  static constexpr size_t kSecretBytes = 192;
  static constexpr unsigned kStripesPerRound = (kSecretBytes - kStripeBytes) / 8;  // 16
  static constexpr size_t kKeyAdvance = 8;
  static constexpr size_t kLastAccumulateKey = kSecretBytes - kStripeBytes - 7;
  static constexpr size_t kScrambleKey = kSecretBytes - kStripeBytes;
  static constexpr size_t kMergeKeyStart = 11;
  alignas(64) static constexpr uint8_t kSecret[kSecretBytes] = {
      0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad,
      0x1c, 0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3,
      0x67, 0x1f, 0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc,
      0xff, 0x72, 0x21, 0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6,
      0x81, 0x3a, 0x26, 0x4c, 0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65,
      0x8b, 0x1b, 0x53, 0x2e, 0xa3, 0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19,
      0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8, 0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9,
      0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d, 0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31,
      0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64, 0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb,
      0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb, 0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0,
      0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e, 0x2b, 0x16, 0xbe, 0x58, 0x7d,
      0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce, 0x45, 0xcb, 0x3a, 0x8f,
      0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
  };
  static constexpr const uint8_t* kMergeKey = kSecret + kMergeKeyStart;

  void Reset() {
    acc_ = _mm512_set_epi64(static_cast<int64_t>(kPrime32_1), static_cast<int64_t>(kPrime64_5),
                            static_cast<int64_t>(kPrime32_2), static_cast<int64_t>(kPrime64_4),
                            static_cast<int64_t>(kPrime64_3), static_cast<int64_t>(kPrime64_2),
                            static_cast<int64_t>(kPrime64_1), static_cast<int64_t>(kPrime32_3));
    stripe_ = 0;
  }

  // The plain intrinsics of these four read an undefined vector that GCC 12 warns about
  // (-Wuninitialized); their zero-masked forms with every lane selected are the same
  // instructions without it.
  template <int kPattern>
  static __m512i ShuffleBy(__m512i a) {
    return _mm512_maskz_shuffle_epi32(0xFFFF, a, _MM_PERM_ENUM(kPattern));
  }
  static __m512i MulLow32(__m512i a, __m512i b) { return _mm512_maskz_mul_epu32(0xFF, a, b); }
  static __m512i ShiftRight47(__m512i a) { return _mm512_maskz_srli_epi64(0xFF, a, 47); }
  static __m512i ShiftLeft32(__m512i a) { return _mm512_maskz_slli_epi64(0xFF, a, 32); }

  // acc[i] += swap-pair(data)[i] + lo32(data ^ key)[i] * hi32(data ^ key)[i]
  void Accumulate(__m512i data, __m512i key) {
    const __m512i data_key = _mm512_xor_si512(data, key);
    const __m512i data_key_hi = ShuffleBy<_MM_SHUFFLE(0, 3, 0, 1)>(data_key);
    const __m512i product = MulLow32(data_key, data_key_hi);
    const __m512i swapped = ShuffleBy<_MM_SHUFFLE(1, 0, 3, 2)>(data);
    acc_ = _mm512_add_epi64(product, _mm512_add_epi64(acc_, swapped));
  }

  // acc = ((acc ^ (acc >> 47)) ^ key) * kPrime32_1
  void Scramble() {
    const __m512i key = _mm512_loadu_si512(kSecret + kScrambleKey);
    const __m512i mixed = _mm512_xor_si512(_mm512_xor_si512(acc_, ShiftRight47(acc_)), key);
    const __m512i prime = _mm512_set1_epi32(static_cast<int>(kPrime32_1));
    const __m512i high = ShuffleBy<_MM_SHUFFLE(0, 3, 0, 1)>(mixed);
    const __m512i product_lo = MulLow32(mixed, prime);
    const __m512i product_hi = MulLow32(high, prime);
    acc_ = _mm512_add_epi64(product_lo, ShiftLeft32(product_hi));
  }

  static uint64_t Read64(const uint8_t* p) {
    uint64_t value = 0;
    for (size_t i = 0; i < 8; ++i) value |= static_cast<uint64_t>(p[i]) << (8 * i);
    return value;
  }
  // The 128-bit product folded to 64 bits (low ^ high).
  static uint64_t Mix(uint64_t a, uint64_t b) {
    __extension__ typedef unsigned __int128 Product;  // NOLINT: no "using" form takes __extension__
    const Product product = static_cast<Product>(a) * b;
    return static_cast<uint64_t>(product) ^ static_cast<uint64_t>(product >> 64);
  }
  static uint64_t Avalanche(uint64_t h) {
    h ^= h >> 37;
    h *= 0x165667919E3779F9ULL;
    return h ^ (h >> 32);
  }

  __m512i acc_;
  unsigned stripe_ = 0;
};

}  // namespace
}  // namespace zoe::io
