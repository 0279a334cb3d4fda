// Helpers shared by the optimizer tests: seeded random chunks in any layout, at any byte offset
// from an aligned address, and the list of instruction-set paths this CPU can run.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <random>
#include <vector>

#include "optim/chunk.h"
#include "optim/convert.h"
#include "optim/dispatch.h"

namespace zoe::optim::testing {

inline std::vector<Isa> SupportedIsas() {
  std::vector<Isa> isas;
  const CpuFeatures cpu = DetectCpuFeatures();
  for (Isa isa : kAllIsas) {
    if (IsaSupported(isa, cpu)) isas.push_back(isa);
  }
  return isas;
}

// Writes `value` as element i of a buffer of `type`, rounding as the kernels do.
inline void PutElement(std::byte* base, DType type, size_t i, float value) {
  if (type == DType::kFloat32) {
    std::memcpy(base + 4 * i, &value, 4);
    return;
  }
  const uint16_t bits = type == DType::kBFloat16 ? FloatToBf16(value) : FloatToF16(value);
  std::memcpy(base + 2 * i, &bits, 2);
}

inline float GetElement(const std::byte* base, DType type, size_t i) {
  if (type == DType::kFloat32) {
    float value;
    std::memcpy(&value, base + 4 * i, 4);
    return value;
  }
  uint16_t bits;
  std::memcpy(&bits, base + 2 * i, 2);
  return type == DType::kBFloat16 ? Bf16ToFloat(bits) : F16ToFloat(bits);
}

// A byte buffer whose usable region starts `offset` bytes past a 64-byte boundary.
class OffsetBuffer {
 public:
  OffsetBuffer() = default;
  OffsetBuffer(size_t bytes, size_t offset) : storage_(bytes + offset + 64), offset_(offset) {}
  std::byte* data() {
    const auto address = reinterpret_cast<uintptr_t>(storage_.data());
    return storage_.data() + ((64 - address % 64) % 64) + offset_;
  }
  const std::byte* data() const { return const_cast<OffsetBuffer*>(this)->data(); }

 private:
  std::vector<std::byte> storage_;
  size_t offset_ = 0;
};

// One chunk's buffers, filled from a seed: master in [-1, 1], gradients around 0 with scale
// `grad_scale`, exp_avg in [-0.1, 0.1], exp_avg_sq in [0, 0.01].
struct TestChunk {
  // `offset` is in elements: each buffer starts that many of its elements past a 64-byte
  // boundary.
  TestChunk(const ChunkLayout& chunk_layout, size_t elements, uint32_t seed, size_t offset = 0,
            float grad_scale = 1.0f)
      : layout(chunk_layout),
        count(elements),
        master(4 * count, 4 * offset),
        grad(DTypeSize(layout.grad) * count, DTypeSize(layout.grad) * offset),
        exp_avg(DTypeSize(layout.state) * count, DTypeSize(layout.state) * offset),
        exp_avg_sq(DTypeSize(layout.state) * count, DTypeSize(layout.state) * offset),
        copy(CopyBytes() * count, CopyBytes() * offset) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
    for (size_t i = 0; i < count; ++i) {
      PutElement(master.data(), DType::kFloat32, i, unit(rng));
      PutElement(grad.data(), layout.grad, i, grad_scale * unit(rng));
      PutElement(exp_avg.data(), layout.state, i, 0.1f * unit(rng));
      const float u = unit(rng);
      PutElement(exp_avg_sq.data(), layout.state, i, 0.01f * u * u);
    }
    std::memset(copy.data(), 0, CopyBytes() * count);
  }

  // Bytes of one element of the parameter copy (2 when there is none, as before fp32 copies).
  size_t CopyBytes() const { return layout.param_copy ? DTypeSize(*layout.param_copy) : 2; }

  ChunkBuffers buffers() {
    return ChunkBuffers{
        reinterpret_cast<float*>(master.data()),   grad.data(), exp_avg.data(), exp_avg_sq.data(),
        layout.param_copy ? copy.data() : nullptr, count};
  }

  // Every byte the optimizer may write: master, both states and the copy.
  std::vector<std::byte> StateBytes() const {
    std::vector<std::byte> bytes;
    const auto append = [&](const OffsetBuffer& b, size_t n) {
      bytes.insert(bytes.end(), b.data(), b.data() + n);
    };
    append(master, 4 * count);
    append(exp_avg, DTypeSize(layout.state) * count);
    append(exp_avg_sq, DTypeSize(layout.state) * count);
    append(copy, CopyBytes() * count);
    return bytes;
  }

  float Master(size_t i) const { return GetElement(master.data(), DType::kFloat32, i); }

  ChunkLayout layout;
  size_t count;
  OffsetBuffer master, grad, exp_avg, exp_avg_sq, copy;
};

// Every layout the kernels accept.
inline std::vector<ChunkLayout> AllLayouts() {
  std::vector<ChunkLayout> layouts;
  for (DType grad : kAllDTypes) {
    for (DType state : {DType::kFloat32, DType::kBFloat16}) {
      for (std::optional<DType> copy :
           {std::optional<DType>(), std::optional(DType::kBFloat16), std::optional(DType::kFloat16),
            std::optional(DType::kFloat32)}) {
        layouts.push_back(ChunkLayout{grad, state, copy});
      }
    }
  }
  return layouts;
}

inline HyperParams DefaultHyper(Kind kind) {
  HyperParams hyper;
  hyper.kind = kind;
  hyper.lr = kind == Kind::kLion ? 1e-4 : 1e-3;
  hyper.beta2 = kind == Kind::kLion ? 0.99 : 0.999;
  hyper.weight_decay = 0.01;
  return hyper;
}

}  // namespace zoe::optim::testing

// For a test of the kernels that hash what they read (the AVX-512 paths) when `hashed` is false:
// skips it on a CPU without AVX-512, which has no such kernel, and fails it on one with AVX-512,
// whose kernels must hash their reads (so a build that lost the hashing cannot pass by skipping).
#define ZOE_SKIP_UNLESS_READS_ARE_HASHED(hashed)                                              \
  if (!(hashed)) {                                                                            \
    if (::zoe::optim::DetectCpuFeatures().avx512) {                                           \
      FAIL() << "this CPU has AVX-512, whose update kernels hash their reads, yet none does"; \
    }                                                                                         \
    GTEST_SKIP() << "no kernel path of this CPU hashes its reads";                            \
  }
