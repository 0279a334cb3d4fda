#include "offload/optimizer/optimizer_group_scan.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "offload/optimizer/optimizer_group_layout.h"

namespace zoe::offload {

GradScanner::GradScanner(size_t count, size_t tile_elements)
    : count_(count), tile_(tile_elements), partials_(CeilDiv(count, tile_elements)) {}

void GradScanner::Reset() {
  std::fill(partials_.begin(), partials_.end(), 0.0);
  covered_.clear();
  pieces_.clear();
}

size_t GradScanner::TileLength(size_t tile) const { return std::min(tile_, count_ - tile * tile_); }

Status GradScanner::Add(std::span<const Piece> pieces, const optim::RunOptions& run) {
  // Refused before anything is recorded, so a failed call leaves the scanner as it was: a
  // zero-element scan checks a dtype and the kernels without reading.
  for (const Piece& piece : pieces) {
    ZOE_RETURN_IF_ERROR(optim::ScanGradients(nullptr, piece.dtype, 0, run).status());
  }
  std::vector<TileJob> jobs;
  for (const Piece& piece : pieces) {
    if (piece.count > 0) PlanPiece(piece, &jobs);
  }
  if (jobs.empty()) return Status::Ok();
  // One contiguous share of the jobs per thread that may run them; share s gathers its cut tiles
  // into gather_buffers_[s]. Each job writes only its own tile's partial, so the order of
  // completion does not matter.
  const size_t threads = run.executor != nullptr ? run.executor->threads() + 1 : 1;
  const size_t per_share = CeilDiv(jobs.size(), std::min(threads, jobs.size()));
  const size_t shares = CeilDiv(jobs.size(), per_share);
  PrepareGatherBuffers(jobs, per_share);
  std::vector<Status> failures(jobs.size());
  auto scan = [&](size_t begin, size_t end) {
    const size_t share = begin / per_share;
    float* gathered = gather_buffers_[share].data();  // null where the share gathers nothing
    for (size_t j = begin; j < end; ++j) {
      Result<double> partial = ScanTile(jobs[j], run, gathered);
      if (partial.ok()) {
        partials_[jobs[j].tile] = *partial;
      } else {
        failures[j] = partial.status();
      }
    }
  };
  if (shares > 1) {
    run.executor->ParallelFor(jobs.size(), per_share, scan);
  } else {
    scan(0, jobs.size());
  }
  for (Status& failure : failures) ZOE_RETURN_IF_ERROR(std::move(failure));
  return Status::Ok();
}

// A job gathers unless a single piece holds its whole tile.
bool GradScanner::Gathers(const TileJob& job) const {
  const Piece& first = job.parts.front();
  const size_t tile_begin = job.tile * tile_;
  return job.parts.size() > 1 || first.offset > tile_begin ||
         first.offset + first.count < tile_begin + TileLength(job.tile);
}

// Gives each share of `per_share` jobs that gathers a tile's worth of floats, allocated and
// touched (zero-filled) here, on the calling thread. The buffers are kept: the same views give the
// same shares at every step, so steady-state steps fault in no fresh pages (a buffer allocated per
// job would be mapped afresh each time once it passes glibc's mmap threshold).
void GradScanner::PrepareGatherBuffers(std::span<const TileJob> jobs, size_t per_share) {
  const size_t shares = CeilDiv(jobs.size(), per_share);
  if (gather_buffers_.size() < shares) gather_buffers_.resize(shares);
  for (size_t share = 0; share < shares; ++share) {
    const auto first = jobs.begin() + static_cast<ptrdiff_t>(share * per_share);
    const auto last =
        jobs.begin() + static_cast<ptrdiff_t>(std::min(jobs.size(), (share + 1) * per_share));
    const bool gathers = std::any_of(first, last, [&](const TileJob& job) { return Gathers(job); });
    if (gathers && gather_buffers_[share].empty()) {
      gather_buffers_[share].resize(std::min(tile_, count_));
    }
  }
}

// Adds a job for every tile inside the piece (none for an absent piece: its tiles' partials are
// zero) and records the piece's part of the tiles it cuts, adding a job for each one it completes.
void GradScanner::PlanPiece(const Piece& piece, std::vector<TileJob>* jobs) {
  const size_t end = piece.offset + piece.count;
  // Tiles [first_whole, end_whole) lie inside the piece; at most one tile at each end is cut.
  const size_t first_whole = CeilDiv(piece.offset, tile_);
  const size_t end_whole = end == count_ ? partials_.size() : end / tile_;
  if (first_whole >= end_whole) {
    for (size_t t = piece.offset / tile_; t <= (end - 1) / tile_; ++t) {
      AddToPartialTile(t, piece, jobs);
    }
    return;
  }
  if (piece.offset % tile_ != 0) AddToPartialTile(piece.offset / tile_, piece, jobs);
  for (size_t t = first_whole; t < end_whole; ++t) {
    if (piece.data == nullptr) {
      partials_[t] = 0.0;
    } else {
      jobs->push_back({t, {piece}});
    }
  }
  if (end_whole < partials_.size() && end % tile_ != 0) AddToPartialTile(end_whole, piece, jobs);
}

// Records the part of `piece` inside `tile`; once the tile is covered, hands its pieces to a job.
void GradScanner::AddToPartialTile(size_t tile, const Piece& piece, std::vector<TileJob>* jobs) {
  const size_t tile_begin = tile * tile_;
  const size_t tile_end = tile_begin + TileLength(tile);
  pieces_.emplace(tile, piece);
  size_t& covered = covered_[tile];
  covered += std::min(tile_end, piece.offset + piece.count) - std::max(tile_begin, piece.offset);
  if (covered < tile_end - tile_begin) return;
  TileJob job{tile, {}};
  auto [first, last] = pieces_.equal_range(tile);
  for (auto it = first; it != last; ++it) job.parts.push_back(it->second);
  pieces_.erase(first, last);
  covered_.erase(tile);
  jobs->push_back(std::move(job));
}

Result<double> GradScanner::ScanTile(const TileJob& job, const optim::RunOptions& run,
                                     float* gathered) const {
  optim::RunOptions single = run;  // the same kernels, tile by tile on this thread
  single.executor = nullptr;
  const size_t tile_begin = job.tile * tile_;
  const size_t length = TileLength(job.tile);
  if (!Gathers(job)) {
    const Piece& whole = job.parts.front();
    const auto* start = static_cast<const std::byte*>(whole.data) +
                        (tile_begin - whole.offset) * DTypeSize(whole.dtype);
    ZOE_ASSIGN_OR_RETURN(optim::GradScan scanned,
                         optim::ScanGradients(start, whole.dtype, length, single));
    return scanned.sum_squares;
  }
  // The parts cover the tile without overlapping, so every element is written once.
  for (const Piece& p : job.parts) {
    const size_t from = std::max(tile_begin, p.offset);
    const size_t to = std::min(tile_begin + length, p.offset + p.count);
    float* dst = gathered + (from - tile_begin);
    if (p.data == nullptr) {
      std::fill(dst, dst + (to - from), 0.0f);
      continue;
    }
    const auto* src =
        static_cast<const std::byte*>(p.data) + (from - p.offset) * DTypeSize(p.dtype);
    if (p.dtype == optim::DType::kFloat32) {
      std::memcpy(dst, src, (to - from) * sizeof(float));
    } else {
      ZOE_RETURN_IF_ERROR(optim::CastToF32(src, p.dtype, dst, to - from, single));
    }
  }
  ZOE_ASSIGN_OR_RETURN(optim::GradScan scanned,
                       optim::ScanGradients(gathered, optim::DType::kFloat32, length, single));
  return scanned.sum_squares;
}

optim::GradScan GradScanner::Total() const {
  optim::GradScan total;
  for (double partial : partials_) total.sum_squares += partial;
  return total;
}

}  // namespace zoe::offload
