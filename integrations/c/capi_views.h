// Conversions of the optimizer calls' arguments between zoe.h and the engine: buffer views,
// hyper-parameters and step results (zoe_optim_* and zoe_sharded_*).
#pragma once

#include <fmt/format.h>

#include <string_view>
#include <vector>

#include "core/result.h"
#include "integrations/c/capi_handles.h"
#include "offload/engine.h"
#include "zoe.h"

namespace zoe::capi {

// `n` views from C as the engine's views; `name` names the array in errors ("params[2].dtype").
template <class View>
Result<std::vector<View>> ToViews(const zoe_buffer_view* views, size_t n, std::string_view name) {
  std::vector<View> out;
  if (n == 0) return out;
  ZOE_RETURN_IF_ERROR(CheckNotNull(views, name));
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    View view;
    view.data = views[i].data;
    view.count = static_cast<size_t>(views[i].count);
    ZOE_ASSIGN_OR_RETURN(
        view.dtype, ToOptimDType(RawEnum(views[i].dtype), fmt::format("{}[{}].dtype", name, i)));
    out.push_back(view);
  }
  return out;
}

inline zoe::offload::StepHyperParams ToHyper(const zoe_hyper_params& hyper) {
  zoe::offload::StepHyperParams out;
  out.lr = hyper.lr;
  out.beta1 = hyper.beta1;
  out.beta2 = hyper.beta2;
  out.eps = hyper.eps;
  out.weight_decay = hyper.weight_decay;
  return out;
}

inline void ToStepResult(const zoe::offload::StepReport& report, zoe_step_result* out) {
  out->skipped = report.skipped ? 1 : 0;
  out->grad_norm = report.grad_norm;
  out->steps_taken = report.steps_taken;
  out->bytes_read = report.bytes_read;
  out->bytes_written = report.bytes_written;
  out->seconds = report.seconds;
}

}  // namespace zoe::capi
