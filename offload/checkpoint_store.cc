#include "offload/checkpoint_store.h"

namespace zoe::offload {

struct CheckpointWriter::Impl {
  std::string version_path;
};
struct CheckpointReader::Impl {
  std::string version_path;
  nlohmann::json metadata;
};

CheckpointWriter::CheckpointWriter(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CheckpointWriter::~CheckpointWriter() = default;
Result<std::unique_ptr<CheckpointWriter>> CheckpointWriter::Begin(const std::string&,
                                                                  nlohmann::json) {
  return Status::NotSupported("checkpoints are not implemented yet");
}
Status CheckpointWriter::BeginFile(std::string_view, nlohmann::json) {
  return Status::NotSupported("checkpoints are not implemented yet");
}
Status CheckpointWriter::Append(std::span<const std::byte>) {
  return Status::NotSupported("checkpoints are not implemented yet");
}
Status CheckpointWriter::EndFile() { return Status::NotSupported("not implemented yet"); }
Status CheckpointWriter::Commit() { return Status::NotSupported("not implemented yet"); }
const std::string& CheckpointWriter::version_path() const { return impl_->version_path; }

CheckpointReader::CheckpointReader(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CheckpointReader::~CheckpointReader() = default;
Result<std::unique_ptr<CheckpointReader>> CheckpointReader::Open(const std::string&) {
  return Status::NotSupported("checkpoints are not implemented yet");
}
const nlohmann::json& CheckpointReader::metadata() const { return impl_->metadata; }
std::vector<std::string> CheckpointReader::file_names() const { return {}; }
Result<nlohmann::json> CheckpointReader::file_metadata(std::string_view) const {
  return Status::NotSupported("not implemented yet");
}
Result<uint64_t> CheckpointReader::file_size(std::string_view) const {
  return Status::NotSupported("not implemented yet");
}
Status CheckpointReader::BeginFile(std::string_view) { return Status::NotSupported("no"); }
Status CheckpointReader::Read(std::span<std::byte>) { return Status::NotSupported("no"); }
Status CheckpointReader::EndFile() { return Status::NotSupported("no"); }
const std::string& CheckpointReader::version_path() const { return impl_->version_path; }

}  // namespace zoe::offload
