// Segments of an optimizer group and the absent gradients that skip them: which segment an
// element is in, the check that an absent range is whole segments, and which segments and
// chunks a step updates.
#include <fmt/format.h>

#include <algorithm>

#include "offload/optimizer/optimizer_group_impl.h"

namespace zoe::offload {

size_t OptimizerGroup::Impl::SegmentOf(size_t element) const {
  return detail::SegmentAt(segment_ends, element);
}

// A boundary is 0 or the end of some segment.
Status OptimizerGroup::Impl::CheckAbsentRange(std::string_view what, size_t index, size_t offset,
                                              size_t length) const {
  auto is_boundary = [&](size_t element) {
    return element == 0 || std::binary_search(segment_ends.begin(), segment_ends.end(), element);
  };
  if (is_boundary(offset) && is_boundary(offset + length)) return Status::Ok();
  const size_t first = SegmentOf(offset);
  const size_t last = SegmentOf(offset + length - 1);
  const size_t first_begin = first == 0 ? 0 : segment_ends[first - 1];
  return Status::InvalidArgument(fmt::format(
      "optimizer group '{}': {} view {} has no gradient (null data) for elements [{}, {}), which "
      "cut segments {}..{} (elements [{}, {})); allowed: an absent gradient covers whole segments",
      name, what, index, offset, offset + length, first, last, first_begin, segment_ends[last]));
}

std::vector<bool> OptimizerGroup::Impl::PresentSegments(const detail::PlacedViews& grads) const {
  std::vector<bool> present(segment_ends.size(), false);
  for (const detail::PlacedView& view : grads) {
    if (!view.present()) continue;
    for (size_t s = SegmentOf(view.offset); s < segment_ends.size(); ++s) {
      present[s] = true;
      if (segment_ends[s] >= view.end()) break;
    }
  }
  return present;
}

std::vector<bool> OptimizerGroup::Impl::PresentChunks(const detail::PlacedViews& grads) const {
  std::vector<bool> present(layout.chunk_count(), false);
  for (const detail::PlacedView& view : grads) {
    if (!view.present()) continue;
    const size_t last = layout.ChunkOf(view.end() - 1);
    for (size_t c = layout.ChunkOf(view.offset); c <= last; ++c) present[c] = true;
  }
  return present;
}

}  // namespace zoe::offload
