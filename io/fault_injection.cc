#include "io/fault_injection.h"

#include <algorithm>
#include <cerrno>

namespace zoe::io {
namespace {

constexpr uint32_t kShortUnit = 4096;

int ErrnoFor(FaultKind kind) {
  switch (kind) {
    case FaultKind::kEio:
      return EIO;
    case FaultKind::kEnospc:
      return ENOSPC;
    case FaultKind::kEintr:
      return EINTR;
    case FaultKind::kEagain:
      return EAGAIN;
    default:
      return 0;
  }
}

bool Matches(FaultOps ops, Op op) {
  return ops == FaultOps::kAll || (ops == FaultOps::kReads) == (op == Op::kRead);
}

}  // namespace

FaultInjectingEngine::FaultInjectingEngine(std::unique_ptr<Engine> target, uint64_t seed)
    : EngineWrapper(std::move(target)), random_(seed) {}

void FaultInjectingEngine::AddRule(const FaultRule& rule) {
  std::lock_guard lock(mutex_);
  rules_.push_back(RuleState{rule});
}

uint64_t FaultInjectingEngine::injected() const {
  std::lock_guard lock(mutex_);
  return injected_;
}

bool FaultInjectingEngine::Fires(RuleState& state, Op op) {
  const FaultRule& rule = state.rule;
  if (!Matches(rule.ops, op)) return false;
  if (rule.kind == FaultKind::kCorruption && op != Op::kRead) return false;
  ++state.seen;
  if (state.fired >= rule.max_faults) return false;
  const bool by_position = rule.nth != 0 && state.seen == rule.nth;
  const bool by_chance = rule.one_in != 0 && random_() % rule.one_in == 0;
  return by_position || by_chance;
}

// Applies the first rule that fires to one request. Called with the mutex held.
FaultInjectingEngine::Decision FaultInjectingEngine::Decide(const RawRequest& request) {
  Decision decision;
  decision.forwarded = request;
  for (RuleState& state : rules_) {
    if (!Fires(state, request.op)) continue;
    const FaultKind kind = state.rule.kind;
    if (kind == FaultKind::kShortTransfer) {
      const uint32_t shorter = (request.length / 2) / kShortUnit * kShortUnit;
      if (shorter == 0) continue;  // too small to shorten on a sector boundary
      decision.forwarded.length = shorter;
    } else if (kind == FaultKind::kCorruption) {
      corrupt_tags_[request.tag] = request.buffer;
    } else {
      decision.synthetic = true;
      decision.result = -ErrnoFor(kind);
    }
    ++state.fired;
    ++injected_;
    break;
  }
  return decision;
}

// Decides every request first, sends the forwarded ones to the target in one call, and accepts
// the prefix of `requests` up to the first one the target did not take.
Result<size_t> FaultInjectingEngine::Submit(std::span<const RawRequest> requests) {
  decisions_.clear();
  forwarded_.clear();
  {
    std::lock_guard lock(mutex_);
    for (const RawRequest& request : requests) {
      decisions_.push_back(Decide(request));
      if (!decisions_.back().synthetic) forwarded_.push_back(decisions_.back().forwarded);
    }
  }
  size_t taken = 0;
  Status error;
  if (!forwarded_.empty()) {
    Result<size_t> result = target().Submit(forwarded_);
    if (result.ok())
      taken = *result;
    else
      error = std::move(result).status();
  }
  size_t accepted = 0;
  std::lock_guard lock(mutex_);
  for (size_t i = 0, forwarded = 0; i < decisions_.size(); ++i, ++accepted) {
    const Decision& d = decisions_[i];
    if (!d.synthetic && forwarded++ >= taken) break;
    if (d.synthetic) synthetic_.push_back(RawCompletion{requests[i].tag, d.result});
  }
  // Requests past the cut were not accepted: forget corruption planned for them.
  for (size_t i = accepted; i < requests.size(); ++i) corrupt_tags_.erase(requests[i].tag);
  if (accepted == 0 && !error.ok()) return error;
  return accepted;
}

Result<size_t> FaultInjectingEngine::Reap(std::span<RawCompletion> out, size_t min_completions) {
  size_t n = 0;
  {
    std::lock_guard lock(mutex_);
    n = std::min(out.size(), synthetic_.size());
    std::copy_n(synthetic_.begin(), n, out.begin());
    synthetic_.erase(synthetic_.begin(), synthetic_.begin() + static_cast<ptrdiff_t>(n));
  }
  const size_t still_needed = min_completions > n ? min_completions - n : 0;
  ZOE_ASSIGN_OR_RETURN(size_t reaped, target().Reap(out.subspan(n), still_needed));
  std::lock_guard lock(mutex_);
  for (size_t i = n; i < n + reaped; ++i) {
    auto it = corrupt_tags_.find(out[i].tag);
    if (it == corrupt_tags_.end()) continue;
    if (out[i].result > 0) it->second[out[i].result / 2] ^= std::byte{0x5a};
    corrupt_tags_.erase(it);
  }
  return n + reaped;
}

}  // namespace zoe::io
