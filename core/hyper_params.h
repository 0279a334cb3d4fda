// The optimizer's hyper-parameters, defined once for every layer of zoe: the kernels
// (optim::UpdateChunk), the configuration's "optimizer" section (config::EngineConfig), an
// optimizer group's current values and its checkpoints, and the per-step values a caller gives
// (offload::EngineStepArgs). The C ABI carries the per-step members in zoe.h's zoe_hyper_params,
// and Python mirrors that struct in zoe._capi (integrations/python/tests/test_capi_header.py
// checks the mirror's members and defaults against the header).
#pragma once

#include "core/vocabulary.h"

namespace zoe {

struct HyperParams {
  OptimizerKind kind = OptimizerKind::kAdamW;  // a group's, fixed at its creation
  double lr = 1e-3;                            // >= 0
  double beta1 = 0.9;                          // [0, 1)
  double beta2 = 0.999;                        // [0, 1)
  double eps = 1e-8;                           // > 0 (unused by Lion)
  double weight_decay = 0.0;  // >= 0: decoupled for AdamW and Lion, L2 for Adam and Adagrad
  double lr_decay = 0.0;      // >= 0, Adagrad only: lr / (1 + (step - 1) * lr_decay); a group's

  // These values with the ones a scheduler may change on every step (lr, betas, eps,
  // weight_decay) taken from `step`; the kind and lr_decay stay these.
  HyperParams WithStepValues(const HyperParams& step) const {
    HyperParams out = step;
    out.kind = kind;
    out.lr_decay = lr_decay;
    return out;
  }

  bool operator==(const HyperParams&) const = default;
};

}  // namespace zoe
