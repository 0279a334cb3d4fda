// zoe_nccl_collectives_*: a zoe_collectives whose callbacks run offload's NcclCollectives (its
// context owns the object).
#include <fmt/format.h>

#include <cstddef>
#include <memory>
#include <span>

#include "integrations/c/capi_names.h"
#include "offload/distributed/nccl_collectives.h"

namespace {

// The callbacks: each returns the Status code (0 for OK); the message is logged by the Status's
// receiver, the sharded step, which names the callback.
offload::Collectives& Of(void* context) { return *static_cast<offload::Collectives*>(context); }

int Code(const Status& status) { return static_cast<int>(status.code()); }

int AllReduceSum(void* context, double* values, size_t count) {
  return Code(Of(context).AllReduceSum(std::span<double>(values, count)));
}

int ReduceScatterSum(void* context, const float* send, float* recv, const uint64_t* counts) {
  offload::Collectives& c = Of(context);
  const std::span<const uint64_t> all(counts, static_cast<size_t>(c.world_size()));
  size_t total = 0;
  for (const uint64_t n : all) total += n;
  return Code(c.ReduceScatterSum(std::span<const float>(send, total),
                                 std::span<float>(recv, all[static_cast<size_t>(c.rank())]), all));
}

int AllGather(void* context, const float* send, float* recv, const uint64_t* counts) {
  offload::Collectives& c = Of(context);
  const std::span<const uint64_t> all(counts, static_cast<size_t>(c.world_size()));
  size_t total = 0;
  for (const uint64_t n : all) total += n;
  return Code(c.AllGather(std::span<const float>(send, all[static_cast<size_t>(c.rank())]),
                          std::span<float>(recv, total), all));
}

int Barrier(void* context) { return Code(Of(context).Barrier()); }

}  // namespace

extern "C" {

zoe_status zoe_nccl_collectives_create(void* nccl_comm, void* cuda_stream, zoe_collectives* out) {
  return Guard([&]() -> Status {
    ZOE_RETURN_IF_ERROR(ResetSized(out, "out"));
    // Collectives missing a member it fills could be neither called nor released; the optional
    // broadcast (after barrier) it leaves NULL, so a caller built before it was added is served.
    constexpr size_t kFilledEnd = offsetof(zoe_collectives, barrier) + sizeof(void*);
    if (StructSize(out) < kFilledEnd) {
      return Status::InvalidArgument(
          fmt::format("out: zoe_collectives.struct_size = {} leaves out members that "
                      "zoe_nccl_collectives_create fills; allowed: at least {}",
                      StructSize(out), kFilledEnd));
    }
    ZOE_ASSIGN_OR_RETURN(std::unique_ptr<offload::Collectives> collectives,
                         offload::MakeNcclCollectives(nccl_comm, cuda_stream));
    zoe_collectives result = ZOE_COLLECTIVES_INIT;
    result.rank = collectives->rank();
    result.world_size = collectives->world_size();
    result.all_reduce_sum = AllReduceSum;
    result.reduce_scatter_sum = ReduceScatterSum;
    result.all_gather = AllGather;
    result.barrier = Barrier;
    result.context = collectives.release();
    WriteSized(result, out);
    return Status::Ok();
  });
}

void zoe_nccl_collectives_destroy(zoe_collectives* collectives) {
  constexpr size_t kContextEnd = offsetof(zoe_collectives, context) + sizeof(void*);
  if (collectives == nullptr || StructSize(collectives) < kContextEnd) return;
  if (collectives->context == nullptr) return;
  delete static_cast<offload::Collectives*>(collectives->context);
  collectives->context = nullptr;
}

}  // extern "C"
