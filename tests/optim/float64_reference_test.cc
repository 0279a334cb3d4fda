// Description: one step of every optimizer in every dtype layout stays within a stated ulp bound
// of the same step computed in float64 from the same (decoded) inputs.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "optim/chunk.h"
#include "optim_test_util.h"

namespace zoe::optim {
namespace {

using testing::GetElement;
using testing::TestChunk;

// The result of one step in double, with the magnitude each value is built from (the sum of the
// absolute values of its terms): rounding errors of fp32 arithmetic are relative to that, not to
// the result, which cancellation can make arbitrarily small.
struct Reference {
  double master, exp_avg, exp_avg_sq;
  double master_scale, exp_avg_scale, exp_avg_sq_scale;
};

// The update rules of kernel_math.h, in double.
Reference Step64(const HyperParams& h, int64_t step, double grad_factor, double p, double g,
                 double m, double v) {
  const double t = static_cast<double>(step);
  g *= grad_factor;
  double g_scale = std::fabs(g);
  if (h.kind == Kind::kAdam || h.kind == Kind::kAdagrad) {
    g_scale += std::fabs(h.weight_decay * p);
    g += h.weight_decay * p;
  }
  switch (h.kind) {
    case Kind::kAdamW:
    case Kind::kAdam: {
      const double decayed = h.kind == Kind::kAdamW ? p * (1 - h.lr * h.weight_decay) : p;
      const double m_scale = std::fabs(h.beta1 * m) + (1 - h.beta1) * g_scale;
      m = h.beta1 * m + (1 - h.beta1) * g;
      v = h.beta2 * v + (1 - h.beta2) * g * g;
      const double denom = std::sqrt(v) / std::sqrt(1 - std::pow(h.beta2, t)) + h.eps;
      const double step_size = h.lr / (1 - std::pow(h.beta1, t));
      return {decayed - step_size * m / denom,
              m,
              v,
              std::fabs(decayed) + step_size * m_scale / denom,
              m_scale,
              v};
    }
    case Kind::kAdagrad: {
      v += g * g;
      const double clr = h.lr / (1 + (t - 1) * h.lr_decay);
      const double denom = std::sqrt(v) + h.eps;
      return {p - clr * g / denom, m, v, std::fabs(p) + clr * g_scale / denom, 0, v};
    }
    case Kind::kLion: {
      const double decayed = p * (1 - h.lr * h.weight_decay);
      const double c = h.beta1 * m + (1 - h.beta1) * g;
      const double m_scale = std::fabs(h.beta2 * m) + (1 - h.beta2) * g_scale;
      m = h.beta2 * m + (1 - h.beta2) * g;
      return {decayed - h.lr * ((c > 0) - (c < 0)), m, v, std::fabs(decayed) + h.lr, m_scale, v};
    }
  }
  return {};
}

// Unit in the last place of `magnitude` in a format with `mantissa_bits` explicit bits.
double Ulp(double magnitude, int mantissa_bits) {
  int exponent;
  std::frexp(std::max(magnitude, 1e-30), &exponent);
  return std::ldexp(1.0, exponent - 1 - mantissa_bits);
}

int MantissaBits(DType type) {
  return type == DType::kFloat32 ? 23 : type == DType::kBFloat16 ? 7 : 10;
}

// fp32 values: each rule is about ten correctly rounded operations on constants themselves
// rounded to fp32, so 8 fp32 ulps of the value's scale (see Reference) bound the error. Stored
// state and copies: one rounding to their format (half an ulp) on top of the fp32 error, so 1 ulp
// of that format (plus 8 fp32 ulps).
constexpr double kMasterUlps = 8;

class Float64Reference : public ::testing::TestWithParam<Kind> {};

TEST_P(Float64Reference, EveryLayoutWithinUlpBound) {
  const Kind kind = GetParam();
  HyperParams hyper = testing::DefaultHyper(kind);
  hyper.lr_decay = kind == Kind::kAdagrad ? 0.01 : 0.0;
  const GradScaling scaling{1.0 / 8.0, 1.0};
  const int64_t step = 3;
  for (const ChunkLayout& layout : testing::AllLayouts()) {
    const size_t count = 1000;
    TestChunk chunk(layout, count, 11, 0, 8.0f);
    const TestChunk before(layout, count, 11, 0, 8.0f);
    ASSERT_TRUE(UpdateChunk(hyper, step, layout, chunk.buffers(), scaling).ok());
    for (size_t i = 0; i < count; ++i) {
      const Reference ref = Step64(hyper, step, 1.0 / 8.0, before.Master(i),
                                   GetElement(before.grad.data(), layout.grad, i),
                                   GetElement(before.exp_avg.data(), layout.state, i),
                                   GetElement(before.exp_avg_sq.data(), layout.state, i));
      const std::string where = std::string(DTypeName(layout.grad)) + "/" +
                                std::string(DTypeName(layout.state)) + " i=" + std::to_string(i);
      ASSERT_LE(std::fabs(chunk.Master(i) - ref.master), kMasterUlps * Ulp(ref.master_scale, 23))
          << where;
      const int state_bits = MantissaBits(layout.state);
      const auto state_bound = [&](double value, double scale) {
        return Ulp(std::fabs(value), state_bits) + kMasterUlps * Ulp(scale, 23);
      };
      if (UsesExpAvg(kind)) {
        ASSERT_LE(std::fabs(GetElement(chunk.exp_avg.data(), layout.state, i) - ref.exp_avg),
                  state_bound(ref.exp_avg, ref.exp_avg_scale))
            << where;
      }
      if (UsesExpAvgSq(kind)) {
        ASSERT_LE(std::fabs(GetElement(chunk.exp_avg_sq.data(), layout.state, i) - ref.exp_avg_sq),
                  state_bound(ref.exp_avg_sq, ref.exp_avg_sq_scale))
            << where;
      }
      if (layout.param_copy) {
        const double copy = GetElement(chunk.copy.data(), *layout.param_copy, i);
        ASSERT_LE(std::fabs(copy - ref.master),
                  Ulp(std::fabs(ref.master), MantissaBits(*layout.param_copy)) +
                      kMasterUlps * Ulp(ref.master_scale, 23))
            << where;
      }
    }
  }
}

std::string KindParamName(const ::testing::TestParamInfo<Kind>& param) {
  return std::string(KindName(param.param));
}

INSTANTIATE_TEST_SUITE_P(AllKinds, Float64Reference, ::testing::ValuesIn(kAllKinds), KindParamName);

}  // namespace
}  // namespace zoe::optim
