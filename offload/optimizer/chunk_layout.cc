#include "offload/optimizer/chunk_layout.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <algorithm>
#include <string>

namespace zoe::offload {
namespace {

constexpr uint64_t kDirectIoUnit = 4096;

uint64_t AlignUp(uint64_t value, uint64_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

bool IsPowerOfTwo(uint64_t v) { return v != 0 && (v & (v - 1)) == 0; }

// Appends a fixed-width little-endian integer or a length-prefixed string to the canonical
// encoding that the fingerprint digests, so that ("ab", "c") and ("a", "bc") differ.
void AppendU64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>(v >> (8 * i)));
}

void AppendString(std::string& out, std::string_view s) {
  AppendU64(out, s.size());
  out.append(s);
}

}  // namespace

Result<ChunkLayout> ChunkLayout::Create(const ChunkLayoutOptions& options) {
  if (options.chunk_bytes == 0 || options.chunk_bytes % kDirectIoUnit != 0) {
    return Status::InvalidArgument(fmt::format("chunk_bytes {} must be a positive multiple of {}",
                                               options.chunk_bytes, kDirectIoUnit));
  }
  if (!IsPowerOfTwo(options.tensor_alignment) ||
      options.chunk_bytes % options.tensor_alignment != 0) {
    return Status::InvalidArgument(
        fmt::format("tensor_alignment {} must be a power of two dividing chunk_bytes {}",
                    options.tensor_alignment, options.chunk_bytes));
  }
  if (options.max_tensor_bytes == 0) {
    return Status::InvalidArgument("max_tensor_bytes must be positive");
  }
  return ChunkLayout(options);
}

Status ChunkLayout::Validate(const TensorDesc& desc) const {
  if (desc.name.empty()) return Status::InvalidArgument("a tensor needs a non-empty name");
  auto context = [&] { return fmt::format("tensor '{}'", desc.name); };
  if (by_name_.contains(desc.name)) {
    return Status::InvalidArgument(fmt::format("{} is already registered", context()));
  }
  if (!IsValidDType(desc.dtype)) {
    return Status::InvalidArgument(
        fmt::format("{}: unknown dtype {}", context(), static_cast<int>(desc.dtype)));
  }
  if (!IsValidTier(desc.home)) {
    return Status::InvalidArgument(
        fmt::format("{}: unknown home tier {}; allowed: device, host, nvme", context(),
                    static_cast<int>(desc.home)));
  }
  if (desc.bytes == 0) return Status::InvalidArgument(fmt::format("{} has 0 bytes", context()));
  if (desc.bytes > options_.max_tensor_bytes) {
    return Status::InvalidArgument(fmt::format("{} has {} bytes; at most {} are allowed", context(),
                                               desc.bytes, options_.max_tensor_bytes));
  }
  const size_t element = DTypeSize(desc.dtype);
  if (desc.bytes % element != 0) {
    return Status::InvalidArgument(
        fmt::format("{}: {} bytes is not a whole number of {} elements ({} bytes each)", context(),
                    desc.bytes, DTypeName(desc.dtype), element));
  }
  const uint64_t chunks_needed = AlignUp(desc.bytes, options_.chunk_bytes) / options_.chunk_bytes;
  if (chunks_.size() + chunks_needed >= ChunkId::kInvalidValue ||
      tensors_.size() + 1 >= TensorId::kInvalidValue) {
    return Status::InvalidArgument(fmt::format("{}: the registry is full ({} chunks, {} tensors)",
                                               context(), chunks_.size(), tensors_.size()));
  }
  return Status::Ok();
}

Result<TensorId> ChunkLayout::Register(TensorDesc desc) {
  ZOE_RETURN_IF_ERROR(Validate(desc));
  const TensorId id(static_cast<uint32_t>(tensors_.size()));
  const size_t group_index = GroupIndex(desc.group);
  TensorEntry entry{id, std::move(desc), {}};
  if (entry.desc.bytes <= options_.chunk_bytes) {
    PlaceSmall(entry, group_index);
  } else {
    PlaceLarge(entry, group_index);
  }
  by_name_.emplace(entry.desc.name, id);
  groups_[group_index].tensors.push_back(id);
  tensors_.push_back(std::move(entry));
  return id;
}

size_t ChunkLayout::GroupIndex(const std::string& group) {
  auto [it, inserted] = group_index_.emplace(group, groups_.size());
  if (inserted) groups_.push_back(GroupMembers{group, {}, {}});
  return it->second;
}

ChunkId ChunkLayout::NewChunk(const TensorDesc& desc, size_t group_index) {
  const ChunkId id(static_cast<uint32_t>(chunks_.size()));
  chunks_.push_back(ChunkEntry{id, desc.home, desc.group, 0, {}});
  groups_[group_index].chunks.push_back(id);
  open_chunks_[{desc.home, group_index}] = id;
  return id;
}

void ChunkLayout::AddPiece(TensorEntry& entry, ChunkId chunk, uint64_t chunk_offset,
                           uint64_t tensor_offset, uint64_t bytes) {
  entry.pieces.push_back(TensorPiece{chunk, chunk_offset, tensor_offset, bytes});
  ChunkEntry& c = chunks_[chunk.value];
  c.used_bytes = chunk_offset + bytes;
  c.tensors.push_back(entry.id);
}

// First fit into the open chunk of the tensor's (home, group), else a fresh chunk.
void ChunkLayout::PlaceSmall(TensorEntry& entry, size_t group_index) {
  auto open = open_chunks_.find({entry.desc.home, group_index});
  if (open != open_chunks_.end()) {
    const ChunkEntry& chunk = chunks_[open->second.value];
    const uint64_t offset = AlignUp(chunk.used_bytes, options_.tensor_alignment);
    if (offset + entry.desc.bytes <= options_.chunk_bytes) {
      AddPiece(entry, chunk.id, offset, 0, entry.desc.bytes);
      return;
    }
  }
  AddPiece(entry, NewChunk(entry.desc, group_index), 0, 0, entry.desc.bytes);
}

void ChunkLayout::PlaceLarge(TensorEntry& entry, size_t group_index) {
  for (uint64_t done = 0; done < entry.desc.bytes; done += options_.chunk_bytes) {
    const uint64_t bytes = std::min(options_.chunk_bytes, entry.desc.bytes - done);
    AddPiece(entry, NewChunk(entry.desc, group_index), 0, done, bytes);
  }
}

Result<TensorId> ChunkLayout::Find(std::string_view name) const {
  auto it = by_name_.find(std::string(name));
  if (it == by_name_.end()) {
    return Status::NotFound(fmt::format("no tensor named '{}' is registered", name));
  }
  return it->second;
}

Result<const TensorEntry*> ChunkLayout::tensor(TensorId id) const {
  if (id.value >= tensors_.size()) {
    return Status::NotFound(fmt::format("tensor id {} is not registered ({} tensors exist)",
                                        id.value, tensors_.size()));
  }
  return &tensors_[id.value];
}

Result<const ChunkEntry*> ChunkLayout::chunk(ChunkId id) const {
  if (id.value >= chunks_.size()) {
    return Status::NotFound(
        fmt::format("chunk id {} does not exist ({} chunks exist)", id.value, chunks_.size()));
  }
  return &chunks_[id.value];
}

std::span<const TensorPiece> ChunkLayout::Pieces(TensorId id) const {
  if (id.value >= tensors_.size()) return {};
  return tensors_[id.value].pieces;
}

std::span<const TensorId> ChunkLayout::TensorsIn(ChunkId id) const {
  if (id.value >= chunks_.size()) return {};
  return chunks_[id.value].tensors;
}

std::vector<std::string> ChunkLayout::Groups() const {
  std::vector<std::string> names;
  names.reserve(groups_.size());
  for (const GroupMembers& g : groups_) names.push_back(g.name);
  return names;
}

std::span<const TensorId> ChunkLayout::TensorsInGroup(std::string_view group) const {
  auto it = group_index_.find(std::string(group));
  if (it == group_index_.end()) return {};
  return groups_[it->second].tensors;
}

std::span<const ChunkId> ChunkLayout::ChunksInGroup(std::string_view group) const {
  auto it = group_index_.find(std::string(group));
  if (it == group_index_.end()) return {};
  return groups_[it->second].chunks;
}

uint64_t ChunkLayout::Fingerprint() const {
  std::string encoding;
  AppendString(encoding, "zoe chunk layout v1");
  AppendU64(encoding, options_.chunk_bytes);
  AppendU64(encoding, options_.tensor_alignment);
  AppendU64(encoding, tensors_.size());
  for (const TensorEntry& t : tensors_) {
    AppendString(encoding, t.desc.name);
    AppendU64(encoding, t.desc.bytes);
    AppendU64(encoding, static_cast<uint64_t>(t.desc.dtype));
    AppendU64(encoding, static_cast<uint64_t>(t.desc.home));
    AppendString(encoding, t.desc.group);
  }
  return XXH3_64bits(encoding.data(), encoding.size());
}

}  // namespace zoe::offload
