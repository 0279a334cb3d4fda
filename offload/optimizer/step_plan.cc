// The plan of an optimizer step (step_plan.h).
#include "offload/optimizer/step_plan.h"

namespace zoe::offload {

std::vector<size_t> PipelineOrder(std::span<const size_t> prefetched,
                                  std::span<const size_t> candidates, size_t nvme_count) {
  std::vector<bool> candidate(nvme_count, false);
  for (size_t c : candidates) candidate[c] = true;
  std::vector<size_t> order;
  for (size_t c : prefetched) {
    if (!candidate[c]) continue;
    order.push_back(c);
    candidate[c] = false;
  }
  for (size_t c : candidates) {
    if (candidate[c]) order.push_back(c);
  }
  return order;
}

std::vector<size_t> ChunksInDirection(const std::vector<bool>& wanted, size_t nvme_count,
                                      bool descending) {
  std::vector<size_t> chunks;
  for (size_t i = 0; i < nvme_count; ++i) {
    const size_t c = descending ? nvme_count - 1 - i : i;
    if (wanted[c]) chunks.push_back(c);
  }
  return chunks;
}

std::vector<bool> WithoutSpeculated(const std::vector<bool>& present,
                                    const std::vector<bool>& speculated) {
  std::vector<bool> pending = present;
  for (size_t c = 0; c < speculated.size() && c < pending.size(); ++c) {
    if (speculated[c]) pending[c] = false;
  }
  return pending;
}

StepPlan PlanStep(const StepPlanInputs& in) {
  StepPlan plan;
  const bool committing = in.commit && !in.speculated.empty();
  plan.update = committing ? WithoutSpeculated(in.present, in.speculated) : in.present;
  for (size_t c : in.prefetched) {
    if (!plan.update[c]) plan.release.push_back(c);
  }
  plan.nvme_order = PipelineOrder(
      in.prefetched, ChunksInDirection(plan.update, in.nvme_count, in.descending), in.nvme_count);
  plan.host_commit.assign(plan.update.size(), false);
  for (size_t c = 0; committing && c < in.speculated.size(); ++c) {
    if (!in.speculated[c]) continue;
    if (c < in.nvme_count) plan.nvme_commit.push_back(c);
    if (c >= in.nvme_count) plan.host_commit[c] = true;
  }
  for (size_t c = plan.update.size(); c-- > in.nvme_count;) {
    if (plan.update[c] || plan.host_commit[c]) plan.host_order.push_back(c);
  }
  return plan;
}

}  // namespace zoe::offload
