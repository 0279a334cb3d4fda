// The plan of an optimizer step: which chunks it updates, in which order the pipeline visits the
// NVMe ones, which reads started ahead it keeps (their state is reused) or releases, and which
// chunks a speculation commit makes live. Pure functions of the group's bookkeeping, so that the
// Step and speculation order chunks the same way and the plan is tested on its own.
#pragma once

#include <cstddef>
#include <span>
#include <vector>

namespace zoe::offload {

// The chunks a pipeline visits: those of `candidates` whose read already started (or whose
// cached copy was claimed), in the order of `prefetched`, then the other candidates in their
// own order. The pipeline consumes the prefetched reads first, so they must lead.
std::vector<size_t> PipelineOrder(std::span<const size_t> prefetched,
                                  std::span<const size_t> candidates, size_t nvme_count);

// The NVMe chunks [0, nvme_count) that `wanted` marks, in the step's direction.
std::vector<size_t> ChunksInDirection(const std::vector<bool>& wanted, size_t nvme_count,
                                      bool descending);

struct StepPlanInputs {
  size_t nvme_count = 0;           // chunks [0, nvme_count) on NVMe, the rest in HOST
  std::vector<bool> present;       // per chunk: the step has a gradient for it
  std::vector<bool> speculated;    // per chunk: speculation updated it (empty: none)
  bool commit = false;             // the speculated updates are final
  bool descending = false;         // the direction of this step
  std::vector<size_t> prefetched;  // NVMe chunks read ahead (or claimed from cache), in order
};

struct StepPlan {
  std::vector<bool> update;         // per chunk: this step updates it now
  std::vector<size_t> release;      // prefetched chunks it does not update: reads released
  std::vector<size_t> nvme_order;   // NVMe chunks through the pipeline
  std::vector<size_t> nvme_commit;  // NVMe chunks whose speculated slot the commit makes live
  std::vector<size_t> host_order;   // HOST chunks, last first, with their speculated spare
  std::vector<bool> host_commit;    //   swapped in first where this is set (per chunk)
};

// `present` without the chunks speculation updated: what a commit still updates.
std::vector<bool> WithoutSpeculated(const std::vector<bool>& present,
                                    const std::vector<bool>& speculated);

StepPlan PlanStep(const StepPlanInputs& in);

}  // namespace zoe::offload
