#include "offload/optimizer_group_scan.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "offload/optimizer_group_layout.h"

namespace zoe::offload {

GradScanner::GradScanner(size_t count, size_t tile_elements)
    : count_(count), tile_(tile_elements), partials_(CeilDiv(count, tile_elements)) {}

void GradScanner::Reset() {
  std::fill(partials_.begin(), partials_.end(), 0.0);
  covered_.clear();
  pieces_.clear();
}

size_t GradScanner::TileLength(size_t tile) const { return std::min(tile_, count_ - tile * tile_); }

Status GradScanner::Add(size_t offset, const void* data, optim::DType dtype, size_t count,
                        const optim::RunOptions& run) {
  if (count == 0) return Status::Ok();
  const Piece piece{offset, data, dtype, count};
  const size_t end = offset + count;
  // Tiles [first_whole, end_whole) lie inside the piece; at most one tile at each end is cut.
  const size_t first_whole = CeilDiv(offset, tile_);
  const size_t end_whole = end == count_ ? partials_.size() : end / tile_;
  if (first_whole >= end_whole) {
    const size_t first = offset / tile_;
    const size_t last = (end - 1) / tile_;
    for (size_t t = first; t <= last; ++t) ZOE_RETURN_IF_ERROR(AddToPartialTile(t, piece, run));
    return Status::Ok();
  }
  if (offset % tile_ != 0) ZOE_RETURN_IF_ERROR(AddToPartialTile(offset / tile_, piece, run));
  ZOE_RETURN_IF_ERROR(ScanWholeTiles(first_whole, end_whole, piece, run));
  if (end_whole < partials_.size() && end % tile_ != 0) {
    ZOE_RETURN_IF_ERROR(AddToPartialTile(end_whole, piece, run));
  }
  return Status::Ok();
}

// Each tile is scanned on its own (one partial, so 0 + partial is exact); tiles are spread over
// the executor's threads and land in their own slot, so the order of completion does not matter.
Status GradScanner::ScanWholeTiles(size_t first_tile, size_t end_tile, const Piece& piece,
                                   const optim::RunOptions& run) {
  optim::RunOptions single = run;
  single.executor = nullptr;
  if (piece.data == nullptr) {
    std::fill(partials_.begin() + first_tile, partials_.begin() + end_tile, 0.0);
    return Status::Ok();
  }
  const size_t element = DTypeSize(piece.dtype);
  const auto* bytes = static_cast<const std::byte*>(piece.data);
  std::vector<Status> failures(end_tile - first_tile);
  auto scan = [&](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) {
      const size_t t = first_tile + i;
      const std::byte* start = bytes + (t * tile_ - piece.offset) * element;
      Result<optim::GradScan> scanned =
          optim::ScanGradients(start, piece.dtype, TileLength(t), single);
      if (scanned.ok()) {
        partials_[t] = scanned->sum_squares;
      } else {
        failures[i] = scanned.status();
      }
    }
  };
  if (run.executor != nullptr) {
    run.executor->ParallelFor(end_tile - first_tile, 1, scan);
  } else {
    scan(0, end_tile - first_tile);
  }
  for (Status& failure : failures) ZOE_RETURN_IF_ERROR(std::move(failure));
  return Status::Ok();
}

// Records the part of `piece` inside `tile`; when the tile is complete, gathers its pieces into
// fp32 and scans them as one tile.
Status GradScanner::AddToPartialTile(size_t tile, const Piece& piece,
                                     const optim::RunOptions& run) {
  const size_t tile_begin = tile * tile_;
  const size_t tile_end = tile_begin + TileLength(tile);
  const size_t begin = std::max(tile_begin, piece.offset);
  const size_t end = std::min(tile_end, piece.offset + piece.count);
  pieces_.emplace(tile, piece);
  size_t& covered = covered_[tile];
  covered += end - begin;
  if (covered < tile_end - tile_begin) return Status::Ok();

  optim::RunOptions single = run;
  single.executor = nullptr;
  std::vector<float> gathered(tile_end - tile_begin);  // zeros where a piece is absent
  auto [first, last] = pieces_.equal_range(tile);
  for (auto it = first; it != last; ++it) {
    const Piece& p = it->second;
    if (p.data == nullptr) continue;
    const size_t from = std::max(tile_begin, p.offset);
    const size_t to = std::min(tile_end, p.offset + p.count);
    const auto* src =
        static_cast<const std::byte*>(p.data) + (from - p.offset) * DTypeSize(p.dtype);
    float* dst = gathered.data() + (from - tile_begin);
    if (p.dtype == optim::DType::kFloat32) {
      std::memcpy(dst, src, (to - from) * sizeof(float));
    } else {
      ZOE_RETURN_IF_ERROR(optim::CastToF32(src, p.dtype, dst, to - from, single));
    }
  }
  pieces_.erase(first, last);
  covered_.erase(tile);
  ZOE_ASSIGN_OR_RETURN(
      optim::GradScan scanned,
      optim::ScanGradients(gathered.data(), optim::DType::kFloat32, gathered.size(), single));
  partials_[tile] = scanned.sum_squares;
  return Status::Ok();
}

optim::GradScan GradScanner::Total() const {
  optim::GradScan total;
  for (double partial : partials_) total.sum_squares += partial;
  return total;
}

}  // namespace zoe::offload
