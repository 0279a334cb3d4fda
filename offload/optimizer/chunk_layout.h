// ChunkLayout: the tensor registry's packing of tensors into fixed-size, aligned chunks. A chunk
// is the unit the tier manager moves, evicts and prefetches; a tensor is what callers name.
//
// Packing rules (deterministic: the same registrations in the same order give the same layout):
//  - Tensors share a chunk only when they have the same home tier and group, because a chunk has
//    one home and groups (an optimizer's parameter group, a layer) move together.
//  - A tensor of at most chunk_bytes is never split: it goes at the next offset aligned to
//    tensor_alignment in its (home, group)'s open chunk, or at offset 0 of a new chunk, which then
//    becomes the open one.
//  - A larger tensor gets ceil(bytes / chunk_bytes) new chunks with consecutive ids, each piece
//    starting at offset 0, so the tier manager can place them contiguously and hand out one
//    pointer. Its last, partly used chunk becomes the open chunk for later small tensors.
//
// Not thread-safe: registration happens before training starts; afterwards the layout is read-only
// and may be read from any thread.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/result.h"
#include "offload/types.h"

namespace zoe::offload {

struct ChunkLayoutOptions {
  uint64_t chunk_bytes = uint64_t{64} << 20;      // a multiple of 4096 (the O_DIRECT unit)
  uint64_t tensor_alignment = 256;                // a power of two dividing chunk_bytes
  uint64_t max_tensor_bytes = uint64_t{1} << 44;  // 16 TiB: anything larger is a caller bug
};

struct TensorDesc {
  std::string name;    // unique, non-empty
  uint64_t bytes = 0;  // > 0, a multiple of the dtype's element size
  DType dtype = DType::kFloat32;
  Tier home = Tier::kHost;  // where the tensor lives when nothing needs it nearer
  std::string group;        // "" is the default group
};

// One contiguous part of a tensor inside one chunk.
struct TensorPiece {
  ChunkId chunk;
  uint64_t chunk_offset = 0;   // where the piece starts inside the chunk
  uint64_t tensor_offset = 0;  // where the piece starts inside the tensor
  uint64_t bytes = 0;
  friend bool operator==(const TensorPiece&, const TensorPiece&) = default;
};

struct TensorEntry {
  TensorId id;
  TensorDesc desc;
  std::vector<TensorPiece> pieces;  // ordered by tensor_offset, covering [0, desc.bytes)
};

struct ChunkEntry {
  ChunkId id;
  Tier home = Tier::kHost;
  std::string group;
  uint64_t used_bytes = 0;        // end of the last piece; the rest of the chunk is unused
  std::vector<TensorId> tensors;  // in placement order (ascending chunk_offset)
};

class ChunkLayout {
 public:
  // Checks the options: chunk_bytes a positive multiple of 4096, tensor_alignment a power of two
  // dividing chunk_bytes, max_tensor_bytes positive.
  static Result<ChunkLayout> Create(const ChunkLayoutOptions& options);

  // Places a tensor and returns its id (0, 1, 2, ... in registration order). Rejects an empty or
  // duplicate name, 0 bytes, more than max_tensor_bytes, a byte count that is not a whole number
  // of elements, an unknown dtype or tier; a rejected registration changes nothing.
  Result<TensorId> Register(TensorDesc desc);

  // The id of a registered name, or NotFound.
  Result<TensorId> Find(std::string_view name) const;

  // The tensor or chunk behind an id, or NotFound naming the valid range. The pointer stays valid
  // until the next Register.
  Result<const TensorEntry*> tensor(TensorId id) const;
  Result<const ChunkEntry*> chunk(ChunkId id) const;

  // Shortcuts over tensor()/chunk(); an unknown id gives an empty span.
  std::span<const TensorPiece> Pieces(TensorId id) const;
  std::span<const TensorId> TensorsIn(ChunkId id) const;

  // Group names in order of first registration, and the members of one group (empty if unknown).
  std::vector<std::string> Groups() const;
  std::span<const TensorId> TensorsInGroup(std::string_view group) const;
  std::span<const ChunkId> ChunksInGroup(std::string_view group) const;

  size_t tensor_count() const { return tensors_.size(); }
  size_t chunk_count() const { return chunks_.size(); }
  const ChunkLayoutOptions& options() const { return options_; }

  // An xxh3 digest of the options and of every registration in order: equal fingerprints mean
  // equal layouts, so a trace recorded against one layout can be checked against another.
  uint64_t Fingerprint() const;

 private:
  explicit ChunkLayout(const ChunkLayoutOptions& options) : options_(options) {}

  Status Validate(const TensorDesc& desc) const;
  size_t GroupIndex(const std::string& group);
  ChunkId NewChunk(const TensorDesc& desc, size_t group_index);
  void PlaceSmall(TensorEntry& entry, size_t group_index);
  void PlaceLarge(TensorEntry& entry, size_t group_index);
  void AddPiece(TensorEntry& entry, ChunkId chunk, uint64_t chunk_offset, uint64_t tensor_offset,
                uint64_t bytes);

  struct GroupMembers {
    std::string name;
    std::vector<TensorId> tensors;
    std::vector<ChunkId> chunks;
  };

  ChunkLayoutOptions options_;
  std::vector<TensorEntry> tensors_;
  std::vector<ChunkEntry> chunks_;
  std::unordered_map<std::string, TensorId> by_name_;
  std::vector<GroupMembers> groups_;  // in order of first registration
  std::unordered_map<std::string, size_t> group_index_;
  std::map<std::pair<Tier, size_t>, ChunkId> open_chunks_;  // (home, group) -> chunk being filled
};

}  // namespace zoe::offload
