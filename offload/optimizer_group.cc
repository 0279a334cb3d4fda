#include "offload/optimizer_group.h"

namespace zoe::offload {

struct OptimizerGroup::Impl {};

OptimizerGroup::OptimizerGroup(OptimizerGroupOptions options, std::unique_ptr<Impl> impl)
    : options_(std::move(options)), impl_(std::move(impl)) {}
OptimizerGroup::~OptimizerGroup() = default;

Result<std::unique_ptr<OptimizerGroup>> OptimizerGroup::Create(OptimizerGroupOptions,
                                                               OptimizerResources,
                                                               std::span<const ParamView>) {
  return Status::NotSupported("OptimizerGroup is not implemented yet");
}
Result<StepReport> OptimizerGroup::Step(const StepArgs&) {
  return Status::NotSupported("OptimizerGroup is not implemented yet");
}
Status OptimizerGroup::AccumulateGrad(size_t, const GradView&) {
  return Status::NotSupported("OptimizerGroup is not implemented yet");
}
Status OptimizerGroup::ReadState(StateSlot, size_t, std::span<float>) const {
  return Status::NotSupported("OptimizerGroup is not implemented yet");
}
Status OptimizerGroup::WriteState(StateSlot, size_t, std::span<const float>) {
  return Status::NotSupported("OptimizerGroup is not implemented yet");
}
size_t OptimizerGroup::chunk_count() const { return 0; }
size_t OptimizerGroup::nvme_chunk_count() const { return 0; }
uint64_t OptimizerGroup::pinned_bytes() const { return 0; }
uint64_t OptimizerGroup::nvme_bytes() const { return 0; }
nlohmann::json OptimizerGroup::Identity() const { return {}; }
Status OptimizerGroup::Save(CheckpointWriter&) const {
  return Status::NotSupported("OptimizerGroup is not implemented yet");
}
Status OptimizerGroup::Load(CheckpointReader&) {
  return Status::NotSupported("OptimizerGroup is not implemented yet");
}

}  // namespace zoe::offload
