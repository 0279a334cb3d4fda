#include "optim/group.h"

#include <cstdint>
#include <string>

#include "optim/threads.h"

namespace zoe::optim {

namespace {

// The state dtypes a Group keeps (no int8: its moments are not block-quantized).
constexpr DType kGroupStateDTypes[] = {DType::kFloat32, DType::kBFloat16};

}  // namespace

Result<std::unique_ptr<Group>> Group::Create(const GroupOptions& options) {
  ZOE_RETURN_IF_ERROR(ValidateLayout(options.layout));
  ZOE_RETURN_IF_ERROR(
      CheckKernelDType(options.layout.state, kGroupStateDTypes, "optimizer state dtype"));
  if (options.run.tile_elements == 0) {
    return Status::InvalidArgument("tile_elements is 0; allowed: >= 1");
  }
  const size_t element = DTypeSize(options.layout.state);
  if (options.count > SIZE_MAX / 4) {
    return Status::InvalidArgument("group of " + std::to_string(options.count) +
                                   " parameters is too large; allowed: < 2^62");
  }
  auto group = std::unique_ptr<Group>(new Group(options));
  const size_t bytes = options.count * element;
  const size_t tile_bytes = options.run.tile_elements * element;
  if (UsesExpAvg(options.kind) && bytes > 0) {
    ZOE_ASSIGN_OR_RETURN(group->exp_avg_,
                         AllocateFirstTouch(bytes, tile_bytes, options.run.executor));
  }
  if (UsesExpAvgSq(options.kind) && bytes > 0) {
    ZOE_ASSIGN_OR_RETURN(group->exp_avg_sq_,
                         AllocateFirstTouch(bytes, tile_bytes, options.run.executor));
  }
  return group;
}

Result<StepScaling> Group::Step(const HyperParams& hyper, float* master, const void* grad,
                                void* param_copy, double loss_scale) {
  if (hyper.kind != options_.kind) {
    return Status::InvalidArgument("step with optimizer " + std::string(KindName(hyper.kind)) +
                                   " on a group created for " +
                                   std::string(KindName(options_.kind)));
  }
  const ChunkBuffers chunk{master, grad, exp_avg(), exp_avg_sq(), param_copy, options_.count};
  ZOE_ASSIGN_OR_RETURN(StepScaling outcome,
                       StepChunk(hyper, steps_taken_ + 1, options_.layout, chunk, loss_scale,
                                 options_.max_grad_norm, options_.run));
  if (outcome.skip) {
    ++steps_skipped_;
  } else {
    ++steps_taken_;
  }
  return outcome;
}

}  // namespace zoe::optim
