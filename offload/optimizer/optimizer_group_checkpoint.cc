// Save and Load of an optimizer group's state through the checkpoint store.
#include <fmt/format.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <string>
#include <vector>

#include "offload/checkpoint/checkpoint_store.h"
#include "offload/optimizer/optimizer_group_impl.h"

namespace zoe::offload {

nlohmann::json OptimizerGroup::Identity() const {
  return {{"name", options_.name},
          {"kind", optim::KindName(options_.kind)},
          {"count", options_.count},
          {"state_dtype", DTypeName(options_.state_dtype)},
          {"chunk_elements", options_.chunk_elements}};
}

uint64_t OptimizerGroup::checkpoint_bytes() const { return impl_->layout.payload_bytes(); }

namespace {

constexpr std::string_view kStateFileSuffix = ".state";
static_assert(kMaxGroupNameBytes + kStateFileSuffix.size() == NAME_MAX);

std::string StateFileName(std::string_view group) {
  return std::string(group) + std::string(kStateFileSuffix);
}

}  // namespace

Status CheckGroupName(std::string_view name) {
  if (CheckCheckpointFileName(StateFileName(name)).ok()) return Status::Ok();
  return Status::InvalidArgument(fmt::format(
      "optimizer group name {} ({} bytes) cannot name a checkpoint file ('<name>{}'); allowed: 1 "
      "to {} bytes of UTF-8 without '/' or control characters, not '.' or '..'",
      QuoteForMessage(name), name.size(), kStateFileSuffix, kMaxGroupNameBytes));
}

namespace {

// Reads one chunk's regions from the reader into the padded layout at `state`; an external
// master (regions.master_external) into `master` instead, the chunk's first element at master[0].
Status ReadChunkPayload(CheckpointReader& reader, const ChunkRegions& regions, std::byte* state,
                        float* master = nullptr) {
  std::memset(state, 0, regions.bytes);
  for (size_t r = 0; r < kStateRegions; ++r) {
    if (!regions.used[r]) continue;
    std::byte* target = state + regions.offset[r];
    if (r == 0 && regions.master_external) target = reinterpret_cast<std::byte*>(master);
    ZOE_RETURN_IF_ERROR(reader.Read(std::span(target, regions.payload(r))));
  }
  return Status::Ok();
}

// Appends the external master of chunk elements [first, first + count) from the caller's views.
Status AppendExternalMaster(CheckpointWriter& writer, const detail::PlacedViews& masters,
                            size_t first, size_t count) {
  const size_t end = first + count;
  for (auto view = detail::FindView(masters, first); view != masters.end() && view->offset < end;
       ++view) {
    const size_t a = std::max(first, view->offset), b = std::min(end, view->end());
    ZOE_RETURN_IF_ERROR(
        writer.Append(std::span(detail::ElementAt(*view, a), (b - a) * sizeof(float))));
  }
  return Status::Ok();
}

std::vector<size_t> SegmentLengths(const std::vector<size_t>& segment_ends) {
  std::vector<size_t> lengths(segment_ends.size());
  for (size_t s = 0; s < segment_ends.size(); ++s) {
    lengths[s] = segment_ends[s] - (s == 0 ? 0 : segment_ends[s - 1]);
  }
  return lengths;
}

// Whether `value` is an array of integers >= 0.
bool IsCountList(const nlohmann::json& value) {
  return value.is_array() && std::all_of(value.begin(), value.end(), [](const auto& entry) {
           return entry.is_number_integer() && entry.template get<int64_t>() >= 0;
         });
}

}  // namespace

// The file holds, chunk after chunk, the used regions of each chunk without their padding.
Status OptimizerGroup::Save(CheckpointWriter& writer) const {
  Impl& impl = *impl_;
  ZOE_RETURN_IF_ERROR(impl.CheckIdle("save"));
  ZOE_RETURN_IF_ERROR(impl.CheckUsable("save a checkpoint"));
  const nlohmann::json metadata = {{"identity", Identity()},
                                   {"steps_taken", steps_taken_},
                                   {"segments", SegmentLengths(impl.segment_ends)},
                                   {"segment_steps", segment_steps_},
                                   {"payload_bytes", impl.layout.payload_bytes()}};
  ZOE_RETURN_IF_ERROR(writer.BeginFile(StateFileName(options_.name), metadata));
  for (size_t c = 0; c < impl.layout.chunk_count(); ++c) {
    const ChunkRegions regions = impl.layout.chunk(c);
    std::byte* state = nullptr;
    if (impl.on_nvme(c)) {
      state = impl.pipeline.CachedState(c);
      if (state == nullptr) {
        state = impl.pipeline.ScratchBuffer();
        ZOE_RETURN_IF_ERROR(impl.pipeline.ReadChunk(c, state));
      }
    } else {
      state = impl.host_state(c);
    }
    for (size_t r = 0; r < kStateRegions; ++r) {
      if (!regions.used[r]) continue;
      Status appended =
          r == 0 && regions.master_external
              ? AppendExternalMaster(writer, impl.masters, regions.first, regions.count)
              : writer.Append(std::span(state + regions.offset[r], regions.payload(r)));
      ZOE_RETURN_IF_ERROR(appended.WithContext(impl.ChunkName(c)));
    }
  }
  return writer.EndFile();
}

// FailedPrecondition unless the checkpoint holds this group's state file with this identity.
Status OptimizerGroup::CheckCheckpoint(const CheckpointReader& reader, int64_t* steps,
                                       std::vector<int64_t>* segment_steps) const {
  const std::string file = StateFileName(options_.name);
  Result<nlohmann::json> metadata = reader.file_metadata(file);
  if (!metadata.ok()) {
    std::string held;
    for (const std::string& name : reader.file_names()) {
      Result<nlohmann::json> other = reader.file_metadata(name);
      if (!other.ok() || !other->is_object() || !other->contains("identity")) continue;
      held += fmt::format("{}{} {}", held.empty() ? "" : ", ", name, (*other)["identity"].dump());
    }
    return Status::FailedPrecondition(fmt::format(
        "optimizer group '{}': checkpoint {} holds no state of this group (identity {}); it "
        "holds: {}",
        options_.name, reader.version_path(), Identity().dump(), held.empty() ? "nothing" : held));
  }
  const nlohmann::json& meta = *metadata;
  if (!meta.is_object() || !meta.contains("identity") || !meta.contains("steps_taken") ||
      !meta["steps_taken"].is_number_integer() || meta["steps_taken"].get<int64_t>() < 0) {
    return Status::Corruption(
        fmt::format("optimizer group '{}': checkpoint {} file {} has malformed metadata: {}",
                    options_.name, reader.version_path(), file, meta.dump()));
  }
  if (meta["identity"] != Identity()) {
    return Status::FailedPrecondition(fmt::format(
        "optimizer group '{}': checkpoint {} is of another group: its identity is {}, this "
        "group's is {}",
        options_.name, reader.version_path(), meta["identity"].dump(), Identity().dump()));
  }
  ZOE_ASSIGN_OR_RETURN(const uint64_t size, reader.file_size(file));
  if (size != impl_->layout.payload_bytes()) {
    return Status::Corruption(fmt::format(
        "optimizer group '{}': checkpoint {} file {} has {} bytes; the group's state has {}",
        options_.name, reader.version_path(), file, size, impl_->layout.payload_bytes()));
  }
  *steps = meta["steps_taken"].get<int64_t>();
  return CheckSegmentSteps(reader, meta, *steps, segment_steps);
}

// The segments' step counts of a checkpoint: "segment_steps" for segments that must be the
// group's, or, in a checkpoint written before segments existed, steps_taken for every segment.
Status OptimizerGroup::CheckSegmentSteps(const CheckpointReader& reader, const nlohmann::json& meta,
                                         int64_t steps, std::vector<int64_t>* segment_steps) const {
  const std::vector<size_t> lengths = SegmentLengths(impl_->segment_ends);
  if (!meta.contains("segment_steps")) {
    segment_steps->assign(lengths.size(), steps);
    return Status::Ok();
  }
  const nlohmann::json& saved_steps = meta["segment_steps"];
  const nlohmann::json saved_lengths = meta.value("segments", nlohmann::json());
  if (!IsCountList(saved_steps) || !IsCountList(saved_lengths) ||
      saved_steps.size() != saved_lengths.size()) {
    return Status::Corruption(fmt::format(
        "optimizer group '{}': checkpoint {} has malformed segments {} or segment_steps {}",
        options_.name, reader.version_path(), saved_lengths.dump(), saved_steps.dump()));
  }
  if (saved_lengths != nlohmann::json(lengths)) {
    return Status::FailedPrecondition(fmt::format(
        "optimizer group '{}': checkpoint {} has segments of lengths {}, this group {}; a "
        "checkpoint loads only into a group with the same segments (parameters)",
        options_.name, reader.version_path(), saved_lengths.dump(),
        nlohmann::json(lengths).dump()));
  }
  *segment_steps = saved_steps.get<std::vector<int64_t>>();
  return Status::Ok();
}

// NVMe chunks go through the pipeline into their inactive slots and HOST chunks into staging
// buffers from the pinned pool; CommitLoad makes both live.
Status OptimizerGroup::PrepareLoad(CheckpointReader& reader) {
  Impl& impl = *impl_;
  impl.DropPreparedLoad();
  ZOE_RETURN_IF_ERROR(impl.CheckIdle("load"));
  Impl::PreparedLoad prepared;
  ZOE_RETURN_IF_ERROR(CheckCheckpoint(reader, &prepared.steps_taken, &prepared.segment_steps));
  ZOE_RETURN_IF_ERROR(impl.AllocateLoadStaging(&prepared.host));
  ZOE_RETURN_IF_ERROR(reader.BeginFile(StateFileName(options_.name)));
  prepared.nvme_chunks.resize(impl.nvme_count);
  for (size_t c = 0; c < impl.nvme_count; ++c) prepared.nvme_chunks[c] = c;
  prepared.in_place = impl.pipeline.slots().single_slot() && impl.nvme_count > 0;
  PipelineTotals totals;
  Status read = impl.pipeline.Run(
      prepared.nvme_chunks, /*read=*/false,
      [&](size_t chunk, std::byte* state, const ChunkChecksums&) {
        return ReadChunkPayload(reader, impl.layout.chunk(chunk), state);
      },
      &totals);
  // An external master is staged whole, and copied into the caller's views by CommitLoad.
  if (!impl.masters.empty()) prepared.master.resize(impl.count);
  for (size_t c = impl.nvme_count; c < impl.layout.chunk_count() && read.ok(); ++c) {
    std::byte* staged = prepared.host[c - impl.nvme_count].data();
    const ChunkRegions regions = impl.layout.chunk(c);
    float* master = prepared.master.empty() ? nullptr : prepared.master.data() + regions.first;
    read = ReadChunkPayload(reader, regions, staged, master).WithContext(impl.ChunkName(c));
  }
  if (read.ok()) read = reader.EndFile();
  ZOE_RETURN_IF_ERROR(impl.BreakIfWritten(std::move(read), totals.bytes_written));
  impl.prepared_load = std::move(prepared);
  return Status::Ok();
}

// One staging buffer per HOST chunk, the size of the chunk's own buffer, so that CommitLoad
// swaps them in without copying. OutOfMemory names the bytes the load needs.
Status OptimizerGroup::Impl::AllocateLoadStaging(std::vector<PinnedBuffer>* staging) {
  uint64_t needed = 0;
  for (const PinnedBuffer& buffer : host) needed += buffer.size();
  staging->reserve(host.size());
  for (size_t c = nvme_count; c < layout.chunk_count(); ++c) {
    Result<PinnedBuffer> buffer = resources.pinned->Allocate(host[c - nvme_count].size());
    if (!buffer.ok()) {
      return std::move(buffer).status().WithContext(fmt::format(
          "optimizer group '{}': a checkpoint load stages its {} bytes of HOST chunks in "
          "pinned memory until it is committed",
          name, needed));
    }
    staging->push_back(std::move(buffer).value());
  }
  return Status::Ok();
}

void OptimizerGroup::CommitLoad() {
  Impl& impl = *impl_;
  if (!impl.prepared_load.has_value()) return;
  impl.pipeline.slots().Flip(impl.prepared_load->nvme_chunks);
  // Reads started by AccumulateGrad since PrepareLoad hold the state before the load; the step
  // reads those chunks again.
  impl.pipeline.ReleasePrefetched();
  impl.host.swap(impl.prepared_load->host);
  if (!impl.masters.empty()) {
    detail::ScatterToViews(impl.masters, 0, impl.count, impl.prepared_load->master.data());
  }
  steps_taken_ = impl.prepared_load->steps_taken;
  segment_steps_ = std::move(impl.prepared_load->segment_steps);
  impl.prepared_load.reset();
  // Every chunk now holds the checkpoint's state: a group broken by a torn write works again.
  impl.broken = Status::Ok();
}

void OptimizerGroup::DiscardLoad() { impl_->DropPreparedLoad(); }

Status OptimizerGroup::Load(CheckpointReader& reader) {
  ZOE_RETURN_IF_ERROR(PrepareLoad(reader));
  CommitLoad();
  return Status::Ok();
}

}  // namespace zoe::offload
