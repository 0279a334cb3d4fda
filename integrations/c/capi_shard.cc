// Sharded optimizer groups (zoe_sharded_*): the caller's zoe_collectives as an
// offload::Collectives, and the handle that owns a rank's ShardedGroup.
#include <fmt/format.h>

#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "integrations/c/capi_names.h"
#include "offload/distributed/collectives.h"
#include "offload/distributed/sharded_group.h"

namespace {

// Calls the caller's callbacks; a nonzero return is Aborted naming the callback and the rank.
class CallbackCollectives final : public offload::Collectives {
 public:
  explicit CallbackCollectives(const zoe_collectives& c) : c_(c) {}
  int rank() const override { return c_.rank; }
  int world_size() const override { return c_.world_size; }
  Status AllReduceSum(std::span<double> values) override {
    return Check("all_reduce_sum", c_.all_reduce_sum(c_.context, values.data(), values.size()));
  }
  Status ReduceScatterSum(std::span<const float> send, std::span<float> recv,
                          std::span<const uint64_t> counts) override {
    return Check("reduce_scatter_sum",
                 c_.reduce_scatter_sum(c_.context, send.data(), recv.data(), counts.data()));
  }
  Status AllGather(std::span<const float> send, std::span<float> recv,
                   std::span<const uint64_t> counts) override {
    return Check("all_gather", c_.all_gather(c_.context, send.data(), recv.data(), counts.data()));
  }
  Status Barrier() override { return Check("barrier", c_.barrier(c_.context)); }
  bool OffersBroadcast() const override { return c_.broadcast != nullptr; }
  Status Broadcast(std::span<const offload::BroadcastSegment> segments) override {
    std::vector<int32_t> roots;
    std::vector<void*> data;
    std::vector<uint64_t> bytes;
    for (const offload::BroadcastSegment& segment : segments) {
      roots.push_back(segment.root);
      data.push_back(segment.data);
      bytes.push_back(segment.bytes);
    }
    return Check("broadcast",
                 c_.broadcast(c_.context, roots.data(), data.data(), bytes.data(), roots.size()));
  }

 private:
  Status Check(const char* callback, int result) const {
    if (result == 0) return Status::Ok();
    return Status::Aborted(fmt::format("collective {} returned {} on rank {} of {}", callback,
                                       result, c_.rank, c_.world_size));
  }
  zoe_collectives c_;
};

// The caller's collectives (a sized struct), checked: rank, world size and every callback.
Result<zoe_collectives> ReadCollectives(const zoe_collectives* in) {
  ZOE_ASSIGN_OR_RETURN(const zoe_collectives copy, zoe::capi::ReadSized(in, "collectives"));
  const zoe_collectives* c = &copy;
  if (c->world_size < 1 || c->rank < 0 || c->rank >= c->world_size) {
    return Status::InvalidArgument(
        fmt::format("collectives: rank {} of world size {}; allowed: world_size >= 1 and 0 <= "
                    "rank < world_size",
                    c->rank, c->world_size));
  }
  ZOE_RETURN_IF_ERROR(CheckNotNull(reinterpret_cast<const void*>(c->all_reduce_sum),
                                   "collectives->all_reduce_sum"));
  ZOE_RETURN_IF_ERROR(CheckNotNull(reinterpret_cast<const void*>(c->reduce_scatter_sum),
                                   "collectives->reduce_scatter_sum"));
  ZOE_RETURN_IF_ERROR(
      CheckNotNull(reinterpret_cast<const void*>(c->all_gather), "collectives->all_gather"));
  ZOE_RETURN_IF_ERROR(
      CheckNotNull(reinterpret_cast<const void*>(c->barrier), "collectives->barrier"));
  return copy;
}

}  // namespace

// Owns a rank's group and the collectives it calls; `engine` is the handle it was created in.
struct zoe_sharded_group {
  zoe_engine* engine = nullptr;
  std::unique_ptr<CallbackCollectives> collectives;
  std::unique_ptr<offload::ShardedGroup> group;
};

namespace {

Result<offload::ShardedGroup*> GroupOf(zoe_engine* engine, zoe_sharded_group* group) {
  ZOE_RETURN_IF_ERROR(CheckNotNull(group, "group"));
  if (group->engine != engine) {
    return Status::InvalidArgument("group was created in another engine; allowed: its own engine");
  }
  return group->group.get();
}

}  // namespace

extern "C" {

zoe_status zoe_sharded_group_create(zoe_engine* engine, const char* optim_json,
                                    const zoe_buffer_view* params, size_t n,
                                    const zoe_collectives* collectives, zoe_sharded_group** out) {
  return Guard([&]() -> Status {
    ZOE_RETURN_IF_ERROR(CheckNotNull(out, "out"));
    *out = nullptr;
    ZOE_ASSIGN_OR_RETURN(offload::Engine * e, EngineOf(engine));
    ZOE_RETURN_IF_ERROR(CheckNotNull(optim_json, "optim_json"));
    ZOE_ASSIGN_OR_RETURN(const zoe_collectives c, ReadCollectives(collectives));
    ZOE_ASSIGN_OR_RETURN(const std::vector<offload::ParamView> views,
                         zoe::capi::ToHostViews<offload::ParamView>(*e, params, n, "params"));
    auto handle = std::make_unique<zoe_sharded_group>();
    handle->engine = engine;
    handle->collectives = std::make_unique<CallbackCollectives>(c);
    ZOE_ASSIGN_OR_RETURN(
        handle->group, offload::ShardedGroup::Create(*e, optim_json, views, *handle->collectives));
    *out = handle.release();
    return Status::Ok();
  });
}

void zoe_sharded_group_destroy(zoe_sharded_group* group) { delete group; }

zoe_status zoe_shard_range(uint64_t count, int32_t rank, int32_t world_size, uint64_t* begin,
                           uint64_t* end) {
  return Guard([&]() -> Status {
    if (begin != nullptr) *begin = 0;  // what a failure leaves (zoe.h, convention 6)
    if (end != nullptr) *end = 0;
    ZOE_RETURN_IF_ERROR(CheckNotNull(begin, "begin"));
    ZOE_RETURN_IF_ERROR(CheckNotNull(end, "end"));
    if (world_size < 1 || rank < 0 || rank >= world_size) {
      return Status::InvalidArgument(
          fmt::format("shard range: rank {} of world size {}; allowed: world_size >= 1 and 0 <= "
                      "rank < world_size",
                      rank, world_size));
    }
    const offload::ShardRange shard = offload::ShardOf(count, rank, world_size);
    *begin = shard.begin;
    *end = shard.end;
    return Status::Ok();
  });
}

zoe_status zoe_sharded_group_local(zoe_sharded_group* group, zoe_group_id* out_id, uint64_t* begin,
                                   uint64_t* end) {
  return Guard([&]() -> Status {
    if (out_id != nullptr) *out_id = ZOE_GROUP_ID_INVALID;  // what a failure leaves
    if (begin != nullptr) *begin = 0;
    if (end != nullptr) *end = 0;
    ZOE_RETURN_IF_ERROR(CheckNotNull(group, "group"));
    if (out_id != nullptr) *out_id = group->group->group().value;
    if (begin != nullptr) *begin = group->group->shard().begin;
    if (end != nullptr) *end = group->group->shard().end;
    return Status::Ok();
  });
}

zoe_status zoe_sharded_step(zoe_engine* engine, zoe_sharded_group* group,
                            const zoe_hyper_params* hyper, const zoe_buffer_view* grads,
                            size_t n_grads, const zoe_buffer_view* params_out, size_t n_params,
                            double loss_scale, zoe_step_result* out) {
  return Guard([&]() -> Status {
    const Status out_ok = out != nullptr ? zoe::capi::ResetSized(out, "out") : Status::Ok();
    ZOE_ASSIGN_OR_RETURN(offload::Engine * e, EngineOf(engine));
    ZOE_ASSIGN_OR_RETURN(offload::ShardedGroup * sharded, GroupOf(engine, group));
    // Arguments refused here still reach the peers as this rank's failure (ShardedGroup::Abort).
    Result<std::vector<offload::GradView>> grad_views =
        zoe::capi::ToHostViews<offload::GradView>(*e, grads, n_grads, "grads");
    Result<std::vector<offload::ParamView>> param_views =
        zoe::capi::ToHostViews<offload::ParamView>(*e, params_out, n_params, "params_out");
    Result<std::optional<zoe::HyperParams>> step_hyper = zoe::capi::ToHyper(hyper);
    if (!out_ok.ok()) return sharded->Abort(out_ok, n_grads > 0);
    if (!grad_views.ok()) return sharded->Abort(grad_views.status(), n_grads > 0);
    if (!param_views.ok()) return sharded->Abort(param_views.status(), n_grads > 0);
    if (!step_hyper.ok()) return sharded->Abort(step_hyper.status(), n_grads > 0);
    offload::ShardedStepArgs args;
    args.hyper = *step_hyper;
    args.grads = *grad_views;
    args.params = *param_views;
    args.loss_scale = loss_scale;
    ZOE_ASSIGN_OR_RETURN(const offload::StepReport report, sharded->Step(args));
    if (out != nullptr) zoe::capi::ToStepResult(report, out);
    return Status::Ok();
  });
}

}  // extern "C"
