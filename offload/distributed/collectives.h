// Collectives: the communication a sharded optimizer group needs from the caller's distributed
// engine (torch.distributed, NCCL, MPI, ...). zoe never writes a transport: a framework adapts its
// own communicator to this interface (the C API's zoe_collectives, NcclCollectives).
//
// Contract of every method: a collective call -- every rank of the group makes the same calls, in
// the same order, with the same `counts`, from the thread that steps the group. A failure is a
// Status on the rank that saw it; the transport's own timeouts bound how long a rank waits for a
// peer that never arrives (a rank that fails zoe-side still makes every collective call of the
// step, so the peers learn of the failure instead of waiting for it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "core/result.h"

namespace zoe::offload {

// One piece of a Broadcast (below): `bytes` bytes at `data`, sent by rank `root`.
struct BroadcastSegment {
  int root = 0;
  void* data = nullptr;
  size_t bytes = 0;
};

class Collectives {
 public:
  virtual ~Collectives() = default;
  virtual int rank() const = 0;        // in [0, world_size)
  virtual int world_size() const = 0;  // >= 1

  // values[i] becomes the sum over ranks of values[i] (fp64, in place).
  virtual Status AllReduceSum(std::span<double> values) = 0;
  // `send` holds the sum of `counts` elements, rank r's part at the sum of counts[0..r); `recv`
  // (counts[rank] elements) receives the sum over ranks of this rank's part.
  virtual Status ReduceScatterSum(std::span<const float> send, std::span<float> recv,
                                  std::span<const uint64_t> counts) = 0;
  // `send` (counts[rank] elements) from every rank, concatenated in rank order into `recv`.
  virtual Status AllGather(std::span<const float> send, std::span<float> recv,
                           std::span<const uint64_t> counts) = 0;
  virtual Status Barrier() = 0;

  // Optional: whether Broadcast is offered. A transport without it (a C caller built against an
  // older zoe.h, NCCL) moves parameters with AllGather through the sharded group's own buffer.
  virtual bool OffersBroadcast() const { return false; }
  // Each segment's `bytes` at `data` on rank `root` are copied to `data` on every other rank
  // (each rank's own pointer): every rank passes the same roots and sizes, in the same order.
  // Lets a sharded group move each rank's updated parameters straight into the peers'
  // parameters, whatever their layout and dtype, with no staging buffer.
  virtual Status Broadcast(std::span<const BroadcastSegment> segments) {
    (void)segments;
    return Status::NotSupported("collectives: Broadcast is not offered (OffersBroadcast())");
  }
};

}  // namespace zoe::offload
