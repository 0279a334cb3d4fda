// The state of an optimizer group between its calls: memory, the broken flag of a single-slot
// group, a prepared load, and the gradients accumulated for the next step.
#include <fmt/format.h>

#include <algorithm>
#include <string>
#include <utility>

#include "core/log.h"
#include "offload/optimizer/optimizer_group_impl.h"

namespace zoe::offload {

OptimizerGroup::Impl::~Impl() { ResetAccumulation(); }

// Pipeline buffers first, then the HOST chunks (and their spares), then the NVMe extents.
Status OptimizerGroup::Impl::AllocateState(uint32_t buffer_count, bool speculative) {
  ZOE_RETURN_IF_ERROR(pipeline.AllocateBuffers(buffer_count));
  for (size_t c = nvme_count; c < layout.chunk_count(); ++c) {
    ZOE_ASSIGN_OR_RETURN(PinnedBuffer buffer, resources.pinned->Allocate(layout.chunk(c).bytes));
    host.push_back(std::move(buffer));
    if (!speculative) continue;
    ZOE_ASSIGN_OR_RETURN(PinnedBuffer spare, resources.pinned->Allocate(layout.chunk(c).bytes));
    host_spare.push_back(std::move(spare));
  }
  return pipeline.AllocateSlots();
}

Status OptimizerGroup::Impl::BreakIfWritten(Status failure, uint64_t written) {
  if (failure.ok() || !pipeline.slots().single_slot() || written == 0 || !broken.ok())
    return failure;
  broken = failure;
  ZOE_LOG_ERROR(
      "optimizer group '{}': a single-slot operation failed after writing {} bytes of state in "
      "place; the group refuses further work until a checkpoint is loaded: {}",
      name, written, failure.ToString());
  return failure;
}

Status OptimizerGroup::Impl::CheckUsable(std::string_view what) const {
  if (broken.ok()) return Status::Ok();
  return Status::FailedPrecondition(fmt::format(
      "optimizer group '{}': cannot {}: the group keeps one slot per NVMe chunk and an earlier "
      "operation failed after it began writing the state in place, so the state may be torn; "
      "load a checkpoint to go on (or use two slots, zoe.slots = 2, whose steps are atomic). "
      "The failure: {}",
      name, what, broken.ToString()));
}

void OptimizerGroup::Impl::DropPreparedLoad() {
  if (prepared_load && prepared_load->in_place && broken.ok()) {
    broken = Status::Aborted(fmt::format(
        "optimizer group '{}': a checkpoint load wrote the NVMe chunks in place and was "
        "discarded before it was committed",
        name));
  }
  prepared_load.reset();
}

// Drops the accumulated gradients; reads started for them are released (ReleaseUnusedRead).
void OptimizerGroup::Impl::ResetAccumulation() {
  FinishSpeculativeWrites();
  speculation.reset();
  pipeline.ReleasePrefetched();
  if (!completion_order.empty()) expected_completions.swap(completion_order);
  completion_order.clear();
  accumulated.clear();
  accumulated_elements = 0;
  std::fill(chunk_covered.begin(), chunk_covered.end(), 0);
  std::fill(chunk_present.begin(), chunk_present.end(), 0);
  scanner.Reset();
}

// FailedPrecondition naming the first range no accumulated gradient covers.
Status OptimizerGroup::Impl::CheckCoverage() const {
  size_t covered_to = 0;
  for (const auto& [offset, view] : accumulated) {
    if (offset > covered_to) break;
    covered_to = view.end();
  }
  if (covered_to == count) return Status::Ok();
  auto next = accumulated.upper_bound(covered_to);
  const size_t gap_end = next == accumulated.end() ? count : next->first;
  return Status::FailedPrecondition(fmt::format(
      "optimizer group '{}': step with accumulated gradients that do not cover the group; "
      "elements [{}, {}) are missing (the group has {})",
      name, covered_to, gap_end, count));
}

// FailedPrecondition while gradients are accumulated: their reads hold pipeline buffers and
// their step expects the state they were read from.
Status OptimizerGroup::Impl::CheckIdle(std::string_view what) const {
  if (accumulated.empty()) return Status::Ok();
  return Status::FailedPrecondition(fmt::format(
      "optimizer group '{}': cannot {} while {} accumulated gradient views wait for a step", name,
      what, accumulated.size()));
}

}  // namespace zoe::offload
