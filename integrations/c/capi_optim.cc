// Optimizer groups (create, step, accumulate_grad, state and step count) and checkpoints.
#include <fmt/format.h>

#include <algorithm>
#include <span>
#include <string>
#include <vector>

#include "integrations/c/capi_names.h"

extern "C" {

zoe_status zoe_optim_group_create(zoe_engine* engine, const char* optim_json,
                                  const zoe_buffer_view* params, size_t n, zoe_group_id* out) {
  return Guard([&]() -> Status {
    ZOE_RETURN_IF_ERROR(CheckNotNull(out, "out"));
    *out = ZOE_GROUP_ID_INVALID;
    ZOE_ASSIGN_OR_RETURN(Engine * e, EngineOf(engine));
    ZOE_RETURN_IF_ERROR(CheckNotNull(optim_json, "optim_json"));
    ZOE_ASSIGN_OR_RETURN(const std::vector<offload::ParamView> views,
                         ToHostViews<offload::ParamView>(*e, params, n, "params"));
    ZOE_ASSIGN_OR_RETURN(const offload::GroupId id, e->CreateGroup(optim_json, views));
    *out = id.value;
    return Status::Ok();
  });
}

zoe_status zoe_optim_step(zoe_engine* engine, zoe_group_id group, const zoe_hyper_params* hyper,
                          const zoe_buffer_view* grads, size_t n_grads,
                          const zoe_buffer_view* params_out, size_t n_params, double loss_scale,
                          zoe_step_result* out) {
  return Guard([&]() -> Status {
    if (out != nullptr) ZOE_RETURN_IF_ERROR(ResetSized(out, "out"));
    ZOE_ASSIGN_OR_RETURN(Engine * e, EngineOf(engine));
    ZOE_ASSIGN_OR_RETURN(const std::vector<offload::GradView> grad_views,
                         ToHostViews<offload::GradView>(*e, grads, n_grads, "grads"));
    ZOE_ASSIGN_OR_RETURN(const std::vector<offload::ParamView> param_views,
                         ToHostViews<offload::ParamView>(*e, params_out, n_params, "params_out"));
    offload::EngineStepArgs args;
    ZOE_ASSIGN_OR_RETURN(args.hyper, ToHyper(hyper));
    args.grads = grad_views;
    args.params = param_views;
    args.loss_scale = loss_scale;
    ZOE_ASSIGN_OR_RETURN(const offload::StepReport report, e->Step(ToGroupId(group), args));
    if (out != nullptr) ToStepResult(report, out);
    return Status::Ok();
  });
}

zoe_status zoe_optim_accumulate_grad(zoe_engine* engine, zoe_group_id group, uint64_t offset,
                                     const zoe_buffer_view* grad) {
  return Guard([&]() -> Status {
    ZOE_ASSIGN_OR_RETURN(Engine * e, EngineOf(engine));
    ZOE_RETURN_IF_ERROR(CheckNotNull(grad, "grad"));
    ZOE_ASSIGN_OR_RETURN(const std::vector<offload::GradView> views,
                         ToHostViews<offload::GradView>(*e, grad, 1, "grad"));
    return e->AccumulateGrad(ToGroupId(group), offset, views.front());
  });
}

zoe_status zoe_optim_discard_grads(zoe_engine* engine, zoe_group_id group) {
  return Guard([&]() -> Status {
    ZOE_ASSIGN_OR_RETURN(Engine * e, EngineOf(engine));
    return e->DiscardGradients(ToGroupId(group));
  });
}

zoe_status zoe_optim_grad_sum_squares(zoe_engine* engine, zoe_group_id group, double* out) {
  return Guard([&]() -> Status {
    ZOE_RETURN_IF_ERROR(CheckNotNull(out, "out"));
    *out = 0.0;
    ZOE_ASSIGN_OR_RETURN(Engine * e, EngineOf(engine));
    ZOE_ASSIGN_OR_RETURN(*out, e->AccumulatedGradSumSquares(ToGroupId(group)));
    return Status::Ok();
  });
}

zoe_status zoe_optim_speculate(zoe_engine* engine, zoe_group_id group,
                               const zoe_hyper_params* hyper, const zoe_buffer_view* params_out,
                               size_t n_params, double loss_scale) {
  return Guard([&]() -> Status {
    ZOE_ASSIGN_OR_RETURN(Engine * e, EngineOf(engine));
    ZOE_ASSIGN_OR_RETURN(const std::vector<offload::ParamView> param_views,
                         ToHostViews<offload::ParamView>(*e, params_out, n_params, "params_out"));
    offload::EngineStepArgs args;
    ZOE_ASSIGN_OR_RETURN(args.hyper, ToHyper(hyper));
    args.params = param_views;
    args.loss_scale = loss_scale;
    return e->Speculate(ToGroupId(group), args);
  });
}

zoe_status zoe_optim_group_speculation_stats(zoe_engine* engine, zoe_group_id group,
                                             zoe_speculation_stats* out) {
  return Guard([&]() -> Status {
    ZOE_RETURN_IF_ERROR(ResetSized(out, "out"));
    ZOE_ASSIGN_OR_RETURN(Engine * e, EngineOf(engine));
    ZOE_ASSIGN_OR_RETURN(const offload::SpeculationStats stats,
                         e->GroupSpeculationStats(ToGroupId(group)));
    zoe_speculation_stats result = ZOE_SPECULATION_STATS_INIT;
    result.steps = stats.steps;
    result.chunks_speculative = stats.chunks_speculative;
    result.chunks_committed = stats.chunks_committed;
    result.chunks_recomputed = stats.chunks_recomputed;
    result.chunks_discarded = stats.chunks_discarded;
    WriteSized(result, out);
    return Status::Ok();
  });
}

zoe_status zoe_optim_state_read(zoe_engine* engine, zoe_group_id group, zoe_state_slot slot,
                                uint64_t offset, uint64_t count, float* out) {
  return Guard([&]() -> Status {
    ZOE_ASSIGN_OR_RETURN(Engine * e, EngineOf(engine));
    ZOE_ASSIGN_OR_RETURN(const offload::StateSlot which,
                         zoe::capi::ToStateSlot(zoe::capi::RawEnum(slot)));
    if (count > 0) ZOE_RETURN_IF_ERROR(CheckNotNull(out, "out"));
    ZOE_RETURN_IF_ERROR(e->CheckHostMemory(out, count, sizeof(float), "out"));
    return e->ReadState(ToGroupId(group), which, offset,
                        std::span<float>(out, static_cast<size_t>(count)));
  });
}

zoe_status zoe_optim_state_write(zoe_engine* engine, zoe_group_id group, zoe_state_slot slot,
                                 uint64_t offset, uint64_t count, const float* values) {
  return Guard([&]() -> Status {
    ZOE_ASSIGN_OR_RETURN(Engine * e, EngineOf(engine));
    ZOE_ASSIGN_OR_RETURN(const offload::StateSlot which,
                         zoe::capi::ToStateSlot(zoe::capi::RawEnum(slot)));
    if (count > 0) ZOE_RETURN_IF_ERROR(CheckNotNull(values, "values"));
    ZOE_RETURN_IF_ERROR(e->CheckHostMemory(values, count, sizeof(float), "values"));
    return e->WriteState(ToGroupId(group), which, offset,
                         std::span<const float>(values, static_cast<size_t>(count)));
  });
}

zoe_status zoe_optim_group_steps(zoe_engine* engine, zoe_group_id group, int64_t* out) {
  return Guard([&]() -> Status {
    ZOE_RETURN_IF_ERROR(CheckNotNull(out, "out"));
    *out = 0;
    ZOE_ASSIGN_OR_RETURN(Engine * e, EngineOf(engine));
    ZOE_ASSIGN_OR_RETURN(*out, e->GroupSteps(ToGroupId(group)));
    return Status::Ok();
  });
}

zoe_status zoe_optim_group_set_steps(zoe_engine* engine, zoe_group_id group, int64_t steps) {
  return Guard([&]() -> Status {
    ZOE_ASSIGN_OR_RETURN(Engine * e, EngineOf(engine));
    return e->SetGroupSteps(ToGroupId(group), steps);
  });
}

zoe_status zoe_optim_group_segment_steps(zoe_engine* engine, zoe_group_id group, int64_t* out,
                                         size_t n) {
  return Guard([&]() -> Status {
    ZOE_ASSIGN_OR_RETURN(Engine * e, EngineOf(engine));
    if (n > 0) ZOE_RETURN_IF_ERROR(CheckNotNull(out, "out"));
    ZOE_RETURN_IF_ERROR(e->CheckHostMemory(out, n, sizeof(int64_t), "out"));
    return e->CopyGroupSegmentSteps(ToGroupId(group), std::span<int64_t>(out, n));
  });
}

zoe_status zoe_optim_group_set_segment_steps(zoe_engine* engine, zoe_group_id group,
                                             const int64_t* steps, size_t n) {
  return Guard([&]() -> Status {
    ZOE_ASSIGN_OR_RETURN(Engine * e, EngineOf(engine));
    if (n > 0) ZOE_RETURN_IF_ERROR(CheckNotNull(steps, "steps"));
    ZOE_RETURN_IF_ERROR(e->CheckHostMemory(steps, n, sizeof(int64_t), "steps"));
    return e->SetGroupSegmentSteps(ToGroupId(group), std::span<const int64_t>(steps, n));
  });
}

zoe_status zoe_checkpoint_save(zoe_engine* engine, const char* dir) {
  return Guard([&]() -> Status {
    ZOE_ASSIGN_OR_RETURN(Engine * e, EngineOf(engine));
    ZOE_RETURN_IF_ERROR(CheckNotNull(dir, "dir"));
    return e->SaveCheckpoint(dir);
  });
}

zoe_status zoe_checkpoint_load(zoe_engine* engine, const char* dir) {
  return Guard([&]() -> Status {
    ZOE_ASSIGN_OR_RETURN(Engine * e, EngineOf(engine));
    ZOE_RETURN_IF_ERROR(CheckNotNull(dir, "dir"));
    return e->LoadCheckpoint(dir);
  });
}

}  // extern "C"
