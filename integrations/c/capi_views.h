// Conversions of the optimizer calls' arguments between zoe.h and the engine: buffer views,
// hyper-parameters and step results (zoe_optim_* and zoe_sharded_*).
#pragma once

#include <fmt/format.h>

#include <optional>
#include <string_view>
#include <vector>

#include "core/result.h"
#include "integrations/c/capi_handles.h"
#include "integrations/c/capi_sized.h"
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

// ToViews, each view's memory checked to be host memory (Engine::CheckHostMemory): a device
// address read or written on the host would crash the process or corrupt the device's memory.
template <class View>
Result<std::vector<View>> ToHostViews(const offload::Engine& engine, const zoe_buffer_view* views,
                                      size_t n, std::string_view name) {
  ZOE_ASSIGN_OR_RETURN(std::vector<View> out, ToViews<View>(views, n, name));
  for (size_t i = 0; i < out.size(); ++i) {
    ZOE_RETURN_IF_ERROR(engine.CheckHostMemory(out[i].data, out[i].count, DTypeSize(out[i].dtype),
                                               fmt::format("{}[{}].data", name, i)));
  }
  return out;
}

// The step's hyper-parameters: empty for NULL (the group's), else the caller's sized struct
// (members its struct_size leaves out at their ZOE_HYPER_PARAMS_INIT defaults).
// Only the per-step members are filled: the group keeps its kind and lr_decay
// (EngineStepArgs::hyper).
inline Result<std::optional<zoe::HyperParams>> ToHyper(const zoe_hyper_params* hyper) {
  if (hyper == nullptr) return std::optional<zoe::HyperParams>();
  ZOE_ASSIGN_OR_RETURN(const zoe_hyper_params in, ReadSized(hyper, "hyper"));
  zoe::HyperParams out;
  out.lr = in.lr;
  out.beta1 = in.beta1;
  out.beta2 = in.beta2;
  out.eps = in.eps;
  out.weight_decay = in.weight_decay;
  return std::optional<zoe::HyperParams>(out);
}

// Writes the members of *out (checked by ResetSized) that its struct_size covers.
inline void ToStepResult(const zoe::offload::StepReport& report, zoe_step_result* out) {
  zoe_step_result result = ZOE_STEP_RESULT_INIT;
  result.skipped = report.skipped ? 1 : 0;
  result.grad_norm = report.grad_norm;
  result.steps_taken = report.steps_taken;
  result.bytes_read = report.bytes_read;
  result.bytes_written = report.bytes_written;
  result.seconds = report.seconds;
  WriteSized(result, out);
}

}  // namespace zoe::capi
