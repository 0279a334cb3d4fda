// ShardedGroup: the shard's range and segments, the agreed presence, scan and outcome, the
// reduce-scatter of the gradients and the parameters' broadcast or all-gather.
#include "offload/distributed/sharded_group.h"

#include <fmt/format.h>

#include <algorithm>
#include <string>
#include <type_traits>
#include <utility>

#include "core/config.h"
#include "optim/chunk.h"

namespace zoe::offload {
namespace {

// floor(rank * count / world_size) without overflow: with count = q * world_size + m, it is
// rank * q + floor(rank * m / world_size), and rank * m < world_size^2.
size_t ShardStart(size_t count, int rank, int world_size) {
  const auto r = static_cast<size_t>(rank);
  const auto n = static_cast<size_t>(world_size);
  return r * (count / n) + r * (count % n) / n;
}

// The intersections of `segments` (lengths, in order) with [shard.begin, shard.end).
std::vector<size_t> CutSegments(std::span<const size_t> segments, ShardRange shard) {
  std::vector<size_t> local;
  local.reserve(segments.size());
  size_t begin = 0;
  for (const size_t length : segments) {
    const size_t lo = std::max(begin, shard.begin);
    const size_t hi = std::min(begin + length, shard.end);
    local.push_back(hi > lo ? hi - lo : 0);
    begin += length;
  }
  return local;
}

// The parts of `views` (covering a whole group, concatenated) that fall in [range.begin,
// range.end), with their data pointers advanced; null data stays null.
template <class View>
std::vector<View> SliceViews(std::span<const View> views, ShardRange range) {
  std::vector<View> out;
  size_t begin = 0;
  for (const View& view : views) {
    const size_t lo = std::max(begin, range.begin);
    const size_t hi = std::min(begin + view.count, range.end);
    if (hi > lo) {
      View part = view;
      if (view.data != nullptr) {
        using Byte = std::conditional_t<std::is_const_v<std::remove_pointer_t<decltype(view.data)>>,
                                        const std::byte, std::byte>;
        part.data = static_cast<Byte*>(view.data) + (lo - begin) * DTypeSize(view.dtype);
      }
      part.count = hi - lo;
      out.push_back(part);
    }
    begin += view.count;
  }
  return out;
}

Status CheckCovers(size_t total, size_t count, std::string_view what) {
  if (total == count) return Status::Ok();
  return Status::InvalidArgument(
      fmt::format("sharded group: the {} views cover {} elements; allowed: exactly the group's {}",
                  what, total, count));
}

// The layout of parameter views that stand for this rank's shard only, for AgreeScan: no
// fingerprint of whole-group views (a multiple of 2^-1 below 2^52 or 0) equals it.
constexpr double kShardOnlyLayout = -1.0;

// InvalidArgument for a parameter view of elements without memory (the step would write there).
Status CheckParamData(std::span<const ParamView> views) {
  for (size_t i = 0; i < views.size(); ++i) {
    if (views[i].data != nullptr || views[i].count == 0) continue;
    return Status::InvalidArgument(fmt::format(
        "sharded group: parameter view {} of {} elements has no data; allowed: a view of the "
        "caller's parameters",
        i, views[i].count));
  }
  return Status::Ok();
}

// The layout of parameter views (each one's element count and dtype, in order) as a number a
// double holds exactly (an FNV-1a hash cut to 52 bits): ranks passing the same views agree on it.
double LayoutFingerprint(std::span<const ParamView> views) {
  uint64_t hash = 14695981039346656037ull;
  const auto mix = [&hash](uint64_t value) {
    for (int byte = 0; byte < 8; ++byte) {
      hash ^= (value >> (8 * byte)) & 0xffu;
      hash *= 1099511628211ull;
    }
  };
  for (const ParamView& view : views) {
    mix(view.count);
    mix(static_cast<uint64_t>(view.dtype));
  }
  return static_cast<double>(hash >> 12);
}

template <class View>
size_t TotalCount(std::span<const View> views) {
  size_t total = 0;
  for (const View& view : views) total += view.count;
  return total;
}

// Calls part(view, at, offset, n) for each part of the elements [first, first + count) of the
// consecutive `views`: n elements from element `at` of `view`, which are elements
// [offset, offset + n) of the range. Stops at the first error.
template <class View, class Part>
Status ForEachViewPart(std::span<const View> views, size_t first, size_t count, Part part) {
  const size_t end = first + count;
  size_t view_begin = 0;
  for (const View& view : views) {
    const size_t from = std::max(first, view_begin);
    const size_t to = std::min(end, view_begin + view.count);
    if (from < to) ZOE_RETURN_IF_ERROR(part(view, from - view_begin, from - first, to - from));
    view_begin += view.count;
    if (view_begin >= end) break;
  }
  return Status::Ok();
}

// Widens the elements [first, first + count) of the consecutive `views` into `out` (fp32); null
// views give zeros. The inverse of NarrowIntoViews.
template <class View>
Status WidenRange(std::span<const View> views, size_t first, size_t count, float* out) {
  return ForEachViewPart(
      views, first, count, [out](const View& view, size_t at, size_t offset, size_t n) {
        float* dst = out + offset;
        if (view.data == nullptr) {
          std::fill_n(dst, n, 0.0f);
          return Status::Ok();
        }
        if (view.dtype == optim::DType::kFloat32) {
          std::copy_n(static_cast<const float*>(view.data) + at, n, dst);
          return Status::Ok();
        }
        const std::byte* src =
            static_cast<const std::byte*>(view.data) + at * DTypeSize(view.dtype);
        return optim::CastToF32(src, view.dtype, dst, n);
      });
}

// Writes `count` fp32 `values` into the elements [first, first + count) of the consecutive
// `views`, each in its dtype.
Status NarrowIntoViews(const float* values, size_t first, size_t count,
                       std::span<const ParamView> views) {
  return ForEachViewPart(
      views, first, count, [values](const ParamView& view, size_t at, size_t offset, size_t n) {
        if (view.dtype == optim::DType::kFloat32) {
          std::copy_n(values + offset, n, static_cast<float*>(view.data) + at);
          return Status::Ok();
        }
        std::byte* dst = static_cast<std::byte*>(view.data) + at * DTypeSize(view.dtype);
        return optim::CastFromF32(values + offset, view.dtype, dst, n);
      });
}

// "1, 2" for the ranks whose flag in `flags` is set.
std::string FlaggedRanks(std::span<const double> flags) {
  std::string out;
  for (size_t r = 0; r < flags.size(); ++r) {
    if (flags[r] == 0.0) continue;
    out += out.empty() ? fmt::format("{}", r) : fmt::format(", {}", r);
  }
  return out;
}

// The segment lengths of `optim_json` ("segments"), or one segment of `count`.
Result<std::vector<size_t>> GlobalSegments(const nlohmann::json& spec, size_t count) {
  if (!spec.contains("segments")) return std::vector<size_t>{count};
  const nlohmann::json& list = spec["segments"];
  std::vector<size_t> segments;
  if (!list.is_array()) {
    return Status::InvalidArgument("sharded group: \"segments\" must be an array of lengths");
  }
  for (const nlohmann::json& length : list) {
    if (!length.is_number_unsigned()) {
      return Status::InvalidArgument(
          fmt::format("sharded group: segment length {} is not allowed; allowed: integers >= 0",
                      length.dump()));
    }
    segments.push_back(length.get<size_t>());
  }
  return segments;
}

}  // namespace

ShardRange ShardOf(size_t count, int rank, int world_size) {
  return {ShardStart(count, rank, world_size), ShardStart(count, rank + 1, world_size)};
}

ShardedGroup::ShardedGroup(Engine& engine, Collectives& collectives, GroupId group, size_t count,
                           std::vector<size_t> segments, const ShardedGroupOptions& options)
    : engine_(engine),
      collectives_(collectives),
      group_(group),
      count_(count),
      shard_(ShardOf(count, collectives.rank(), collectives.world_size())),
      segments_(std::move(segments)),
      local_segments_(CutSegments(segments_, shard_)),
      shard_params_(shard_.size()),
      options_(options) {}

Result<std::unique_ptr<ShardedGroup>> ShardedGroup::Create(Engine& engine,
                                                           std::string_view optim_json,
                                                           std::span<const ParamView> params,
                                                           Collectives& collectives,
                                                           const ShardedGroupOptions& options) {
  const int world = collectives.world_size();
  const int rank = collectives.rank();
  if (world < 1 || rank < 0 || rank >= world) {
    return Status::InvalidArgument(fmt::format(
        "sharded group: rank {} of world size {}; allowed: world size >= 1, 0 <= rank < world size",
        rank, world));
  }
  const size_t count = TotalCount(params);
  Result<GroupId> created = Status::InvalidArgument("sharded group: no parameters");
  std::vector<size_t> segments;
  Result<nlohmann::json> spec = config::ParseJson(optim_json);
  Result<std::vector<size_t>> parsed =
      spec.ok() ? GlobalSegments(*spec, count) : Result<std::vector<size_t>>(spec.status());
  if (options.round_elements == 0) {
    created = Status::InvalidArgument(
        "sharded group: round_elements is 0; allowed: elements per rank per round, > 0");
  } else if (parsed.ok() && count > 0) {
    segments = *parsed;
    const ShardRange shard = ShardOf(count, rank, world);
    (*spec)["segments"] = CutSegments(segments, shard);
    const std::vector<ParamView> local = SliceViews(params, shard);
    created = shard.size() == 0
                  ? Result<GroupId>(Status::InvalidArgument(fmt::format(
                        "sharded group: {} elements leave rank {} of {} none; allowed: at least "
                        "one element per rank",
                        count, rank, world)))
                  : engine.CreateGroup(spec->dump(), local);
  } else if (!parsed.ok()) {
    created = parsed.status();
  }
  // Agreed: every rank learns whether any rank failed.
  std::vector<double> flags(static_cast<size_t>(world), 0.0);
  flags[static_cast<size_t>(rank)] = created.ok() ? 0.0 : 1.0;
  ZOE_RETURN_IF_ERROR(collectives.AllReduceSum(flags));
  if (!created.ok()) return created.status();
  if (std::any_of(flags.begin(), flags.end(), [](double f) { return f != 0.0; })) {
    return Status::Aborted(fmt::format(
        "sharded group: creation failed on rank(s) {}; see the error there", FlaggedRanks(flags)));
  }
  return std::unique_ptr<ShardedGroup>(
      new ShardedGroup(engine, collectives, *created, count, std::move(segments), options));
}

Result<optim::GradScan> ShardedGroup::AgreeScan(const optim::GradScan& local, bool failed,
                                                double layout) {
  const size_t world = static_cast<size_t>(collectives_.world_size());
  const size_t rank = static_cast<size_t>(collectives_.rank());
  std::vector<double> values(1 + 2 * world, 0.0);
  values[0] = failed ? 0.0 : local.sum_squares;
  values[1 + rank] = failed ? 1.0 : 0.0;
  values[1 + world + rank] = layout;
  ZOE_RETURN_IF_ERROR(collectives_.AllReduceSum(values));
  const std::span<const double> flags(values.data() + 1, world);
  if (std::any_of(flags.begin(), flags.end(), [](double f) { return f != 0.0; })) {
    return Status::Aborted(
        fmt::format("sharded group: rank(s) {} failed before the update; no rank changed its state",
                    FlaggedRanks(flags)));
  }
  std::vector<double> differs(world, 0.0);  // 1 for a rank whose layout is not rank 0's
  for (size_t r = 0; r < world; ++r) differs[r] = values[1 + world + r] != values[1 + world];
  if (std::any_of(differs.begin(), differs.end(), [](double d) { return d != 0.0; })) {
    return Status::InvalidArgument(fmt::format(
        "sharded group: rank(s) {} passed parameter views laid out unlike rank 0's (element "
        "counts or dtypes, or the shard only against the whole group); every rank must pass "
        "the same kind of views, and with broadcast the same views, since each rank's part is "
        "broadcast into the same place of the peers' views; no rank changed its state",
        FlaggedRanks(differs)));
  }
  return optim::GradScan{values[0]};
}

Status ShardedGroup::AgreeOutcome(const Status& local) {
  std::vector<double> flags(static_cast<size_t>(collectives_.world_size()), 0.0);
  flags[static_cast<size_t>(collectives_.rank())] = local.ok() ? 0.0 : 1.0;
  Status exchanged = collectives_.AllReduceSum(flags);
  if (!exchanged.ok() && local.ok()) {
    return std::move(exchanged).WithContext(
        "sharded group: agreeing the step's outcome after this rank updated its shard; other "
        "ranks may not have: resume from a checkpoint");
  }
  if (!local.ok()) return local;
  if (std::all_of(flags.begin(), flags.end(), [](double f) { return f == 0.0; })) {
    return Status::Ok();
  }
  return Status::Aborted(fmt::format(
      "sharded group: rank(s) {} failed the step (see the error there) after this rank updated "
      "its shard; the ranks are out of step: resume from a checkpoint",
      FlaggedRanks(flags)));
}

// Which global segments have a gradient on some rank, agreed with every rank's failure flag (the
// flags follow the segments in one all-reduce).
Result<std::vector<bool>> ShardedGroup::AgreePresence(std::span<const GradView> grads,
                                                      const Status& local) {
  const size_t world = static_cast<size_t>(collectives_.world_size());
  std::vector<double> values(segments_.size() + world, 0.0);
  std::vector<size_t> ends(segments_.size());
  size_t end = 0;
  for (size_t s = 0; s < ends.size(); ++s) ends[s] = end += segments_[s];
  size_t begin = 0;
  for (const GradView& view : grads) {
    if (!local.ok()) break;
    const size_t view_end = begin + view.count;
    if (view.data != nullptr) {
      // Every segment with an element in [begin, view_end) is present.
      size_t s =
          static_cast<size_t>(std::upper_bound(ends.begin(), ends.end(), begin) - ends.begin());
      for (; s < ends.size() && ends[s] - segments_[s] < view_end; ++s) values[s] = 1.0;
    }
    begin = view_end;
  }
  values[segments_.size() + static_cast<size_t>(collectives_.rank())] = local.ok() ? 0.0 : 1.0;
  ZOE_RETURN_IF_ERROR(collectives_.AllReduceSum(values));
  if (!local.ok()) return local;
  const std::span<const double> flags(values.data() + segments_.size(), world);
  if (std::any_of(flags.begin(), flags.end(), [](double f) { return f != 0.0; })) {
    return Status::Aborted(fmt::format(
        "sharded group: rank(s) {} gave gradients that cannot be used; no rank changed its state",
        FlaggedRanks(flags)));
  }
  std::vector<bool> present(segments_.size());
  for (size_t s = 0; s < present.size(); ++s) present[s] = values[s] != 0.0;
  return present;
}

// Every rank's shard of the local gradient, widened to fp32 and reduce-scattered round by round
// into shard_grads_, then averaged; the shard's views: one per local segment with elements, null
// where no rank has a gradient. A widening that fails after the presence was agreed still makes
// every round's collective (with zeros) and then fails the scan's agreement, so no peer waits.
Result<std::vector<GradView>> ShardedGroup::ReduceGradients(std::span<const GradView> grads) {
  const Status local = CheckCovers(TotalCount(grads), count_, "gradient");
  ZOE_ASSIGN_OR_RETURN(const std::vector<bool> present, AgreePresence(grads, local));
  shard_grads_.resize(shard_.size());
  const Rounds rounds = PlanRounds();
  round_buffer_.resize(rounds.buffer_elements());
  Status widened = Status::Ok();
  std::vector<uint64_t> counts;
  for (size_t first = 0; first < rounds.largest; first += rounds.piece) {
    const size_t total = rounds.Counts(first, counts);
    float* part = round_buffer_.data();
    for (size_t r = 0; r < counts.size(); ++r) {
      if (widened.ok())
        widened = WidenRange(grads, rounds.shards[r].begin + first, counts[r], part);
      if (!widened.ok()) std::fill_n(part, counts[r], 0.0f);
      part += counts[r];
    }
    const size_t mine = counts[static_cast<size_t>(collectives_.rank())];
    ZOE_RETURN_IF_ERROR(collectives_.ReduceScatterSum(
        std::span<const float>(round_buffer_.data(), total),
        std::span<float>(shard_grads_.data() + (mine > 0 ? first : 0), mine), counts));
  }
  if (!widened.ok()) return Abort(widened, /*with_grads=*/false);
  const float inverse = 1.0f / static_cast<float>(collectives_.world_size());
  for (float& g : shard_grads_) g *= inverse;
  std::vector<GradView> views;
  size_t offset = 0;
  for (size_t s = 0; s < local_segments_.size(); ++s) {
    if (local_segments_[s] == 0) continue;
    GradView view{present[s] ? shard_grads_.data() + offset : nullptr, optim::DType::kFloat32,
                  local_segments_[s]};
    views.push_back(view);
    offset += local_segments_[s];
  }
  return views;
}

ShardedGroup::Rounds ShardedGroup::PlanRounds() const {
  Rounds rounds;
  const int world = collectives_.world_size();
  rounds.shards.resize(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    rounds.shards[static_cast<size_t>(r)] = ShardOf(count_, r, world);
    rounds.largest = std::max(rounds.largest, rounds.shards[static_cast<size_t>(r)].size());
  }
  rounds.piece = std::min(options_.round_elements, rounds.largest);
  return rounds;
}

size_t ShardedGroup::Rounds::Counts(size_t first, std::vector<uint64_t>& counts) const {
  counts.resize(shards.size());
  size_t total = 0;
  for (size_t r = 0; r < shards.size(); ++r) {
    const size_t size = shards[r].size();
    counts[r] = first < size ? std::min(piece, size - first) : 0;
    total += counts[r];
  }
  return total;
}

Status ShardedGroup::GatherParams(std::span<const ParamView> params) {
  if (collectives_.OffersBroadcast()) return BroadcastParams(params);
  return GatherParamsThroughBuffer(params);
}

Status ShardedGroup::BroadcastParams(std::span<const ParamView> params) {
  ZOE_RETURN_IF_ERROR(NarrowIntoViews(shard_params_.data(), shard_.begin, shard_.size(), params));
  std::vector<BroadcastSegment> segments;
  const int world = collectives_.world_size();
  for (int r = 0; r < world; ++r) {
    const ShardRange shard = ShardOf(count_, r, world);
    ZOE_RETURN_IF_ERROR(ForEachViewPart(
        params, shard.begin, shard.size(),
        [&segments, r](const ParamView& view, size_t at, size_t /*offset*/, size_t n) {
          const size_t size = DTypeSize(view.dtype);
          segments.push_back({r, static_cast<std::byte*>(view.data) + at * size, n * size});
          return Status::Ok();
        }));
  }
  return collectives_.Broadcast(segments);
}

Status ShardedGroup::GatherParamsThroughBuffer(std::span<const ParamView> params) {
  const Rounds rounds = PlanRounds();
  round_buffer_.resize(rounds.buffer_elements());
  std::vector<uint64_t> counts;
  for (size_t first = 0; first < rounds.largest; first += rounds.piece) {
    const size_t total = rounds.Counts(first, counts);
    const size_t mine = counts[static_cast<size_t>(collectives_.rank())];
    const std::span<const float> send(shard_params_.data() + (mine > 0 ? first : 0), mine);
    ZOE_RETURN_IF_ERROR(
        collectives_.AllGather(send, std::span<float>(round_buffer_.data(), total), counts));
    const float* part = round_buffer_.data();
    for (size_t r = 0; r < counts.size(); ++r) {
      ZOE_RETURN_IF_ERROR(NarrowIntoViews(part, rounds.shards[r].begin + first, counts[r], params));
      part += counts[r];
    }
  }
  return Status::Ok();
}

// The step updates shard_params_, which start as the caller's values (segments without a
// gradient, which the step leaves untouched, then give what every rank already holds); the
// caller's views take them only once every rank updated its shard.
Status ShardedGroup::WidenCallerParams(std::span<const ParamView> params, bool shard_only) {
  if (!shard_only) ZOE_RETURN_IF_ERROR(CheckCovers(TotalCount(params), count_, "parameter"));
  ZOE_RETURN_IF_ERROR(CheckParamData(params));
  return WidenRange(params, shard_only ? 0 : shard_.begin, shard_.size(), shard_params_.data());
}

bool ShardedGroup::CoversShardOnly(std::span<const ParamView> params) const {
  // With one rank the shard is the whole group, and its own values are all a gather would give.
  return !params.empty() && TotalCount(params) == shard_.size();
}

Status ShardedGroup::Abort(Status error, bool with_grads) {
  if (with_grads) {
    (void)AgreePresence({}, error);
  } else {
    (void)AgreeScan({}, /*failed=*/true);
  }
  return error;
}

Result<StepReport> ShardedGroup::Step(const ShardedStepArgs& args) {
  std::vector<GradView> shard_grads;
  Status prepared = Status::Ok();
  if (!args.grads.empty()) {
    Result<std::vector<GradView>> reduced = ReduceGradients(args.grads);
    if (!reduced.ok()) return reduced.status();  // every rank knows (AgreePresence)
    shard_grads = std::move(reduced).value();
  }
  const bool shard_only = CoversShardOnly(args.params);
  std::vector<ParamView> shard_params;
  if (!args.params.empty()) {
    prepared = WidenCallerParams(args.params, shard_only);
    shard_params.push_back({shard_params_.data(), optim::DType::kFloat32, shard_params_.size()});
  }
  bool agreed = false;
  bool stopped = false;  // the scan's agreement failed: every rank stops before the update
  EngineStepArgs step;
  step.hyper = args.hyper;
  step.grads = shard_grads;
  step.params = shard_params;
  step.loss_scale = args.loss_scale;
  // Broadcast moves each view's parts between the same places on every rank, and a rank passing
  // its shard only gathers nothing: both agreed with the scan.
  double layout = collectives_.OffersBroadcast() ? LayoutFingerprint(args.params) : 0.0;
  if (shard_only) layout = kShardOnlyLayout;
  step.agree_scan = [&](const optim::GradScan& local) {
    agreed = true;
    Result<optim::GradScan> scan = AgreeScan(local, /*failed=*/false, layout);
    stopped = !scan.ok();
    return scan;
  };
  Result<StepReport> report = prepared.ok() ? engine_.Step(group_, step) : prepared;
  if (!agreed) {
    // Failed before the scan was agreed: the peers still wait for this rank's flag.
    (void)AgreeScan({}, /*failed=*/true);
    if (report.ok()) return Status::Internal("sharded group: a step never agreed its scan");
    return report.status();
  }
  if (stopped) return report.status();
  ZOE_RETURN_IF_ERROR(AgreeOutcome(report.status()));
  if (!report->skipped && shard_only) {
    ZOE_RETURN_IF_ERROR(NarrowIntoViews(shard_params_.data(), 0, shard_.size(), args.params));
  } else if (!report->skipped && !args.params.empty()) {
    Status gathered = GatherParams(args.params);
    if (!gathered.ok()) {
      return std::move(gathered).WithContext(
          "sharded group: gathering the updated parameters after every rank updated its shard; "
          "the parameters may hold updated values in some places and earlier ones in others: "
          "resume from a checkpoint");
    }
  }
  return report;
}

}  // namespace zoe::offload
