// GradScanner: the gradient scan of a step (sum of squares, inf/NaN check) computed the same way
// however the caller cuts its gradients into views, and however many calls deliver them.
//
// optim::ScanGradients on one buffer adds one partial per tile of `tile_elements` (lanes counted
// from the tile's start), in tile order. GradScanner keeps that order over the whole group: tile
// t always covers elements [t * tile, (t + 1) * tile) of the group. A tile that lies inside one
// view is scanned in place as soon as the view arrives; a tile cut by view boundaries is gathered
// into fp32 (bf16/fp16 widen exactly, so the sums are the same) once all of its pieces have
// arrived. Total() adds the partials in tile order, so the result is bit-identical to a scan of
// the whole gradient as one buffer. The tiles that a call completes, whole or gathered, are
// scanned in one pass over the executor, so a step's gradient views are scanned together rather
// than one view at a time.
#pragma once

#include <cstddef>
#include <map>
#include <span>
#include <vector>

#include "core/result.h"
#include "optim/chunk.h"

namespace zoe::offload {

class GradScanner {
 public:
  // Elements [offset, offset + count) of the group's gradient, held in `data` (of `dtype`); null
  // `data` means the elements have no gradient, and they count as zeros (their tiles' partials
  // are those of the present elements, summed in the same lanes as a buffer with zeros there).
  struct Piece {
    size_t offset = 0;
    const void* data = nullptr;
    optim::DType dtype = optim::DType::kFloat32;
    size_t count = 0;
  };

  GradScanner(size_t count, size_t tile_elements);

  // Forgets every gradient added.
  void Reset();
  // Scans `pieces`. Preconditions, checked by the caller: each lies inside the group and overlaps
  // no other piece added since Reset. Tiles run on run.executor when it is set. A dtype or ISA the
  // kernels cannot take fails the call before any piece is recorded.
  Status Add(std::span<const Piece> pieces, const optim::RunOptions& run);
  // The scan of every element; precondition: every element was added since Reset.
  optim::GradScan Total() const;

 private:
  // One tile to scan and the pieces that cover it: one piece holding the whole tile is scanned in
  // place, several are gathered into fp32 first.
  struct TileJob {
    size_t tile;
    std::vector<Piece> parts;
  };
  size_t TileLength(size_t tile) const;
  void PlanPiece(const Piece& piece, std::vector<TileJob>* jobs);
  void AddToPartialTile(size_t tile, const Piece& piece, std::vector<TileJob>* jobs);
  bool Gathers(const TileJob& job) const;
  void PrepareGatherBuffers(std::span<const TileJob> jobs, size_t per_share);
  // The tile's partial, on the calling thread; `gathered` holds a tile when the job gathers
  // (PrepareGatherBuffers), else may be null.
  Result<double> ScanTile(const TileJob& job, const optim::RunOptions& run, float* gathered) const;

  size_t count_;
  size_t tile_;
  std::vector<double> partials_;         // one per tile, valid once the tile is complete
  std::map<size_t, size_t> covered_;     // tile -> elements seen, for tiles still incomplete
  std::multimap<size_t, Piece> pieces_;  // tile -> pieces of an incomplete tile
  std::vector<std::vector<float>> gather_buffers_;  // per share of a scan's jobs; empty: none
};

}  // namespace zoe::offload
