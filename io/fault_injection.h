// FaultInjectingEngine: wraps any raw engine and makes chosen operations fail the way real
// hardware and kernels fail, below IoQueue's retry layer so that its resubmission and retry
// paths run exactly as they would for a real fault.
//
// Each rule picks operations either by position (the nth matching operation, 1-based) or by
// chance (one in N, from a seeded generator, so a failing run repeats with the same seed):
//  - kEio, kEnospc, kEintr, kEagain: the operation completes with that -errno without reaching
//    the disk;
//  - kShortTransfer: the operation is sent with about half its length (aligned down to 4096), so
//    the completion reports fewer bytes than asked, as a real short read or write does;
//  - kCorruption: a read reaches the disk, then one byte of what it read is flipped.
// Faults that happen before any engine exists are injected through options: a filesystem that
// refuses O_DIRECT (OpenOptions::refuse_direct_for_testing) and a kernel that refuses io_uring or
// libaio (EngineOptions::refuse_for_testing).
#pragma once

#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <random>
#include <unordered_map>
#include <vector>

#include "io/engine.h"

namespace zoe::io {

enum class FaultKind { kEio, kEnospc, kEintr, kEagain, kShortTransfer, kCorruption };
enum class FaultOps { kAll, kReads, kWrites };

struct FaultRule {
  FaultKind kind = FaultKind::kEio;
  FaultOps ops = FaultOps::kAll;
  uint64_t nth = 0;     // inject on the nth matching operation (1-based); 0: not by position
  uint64_t one_in = 0;  // inject on each matching operation with probability 1/one_in; 0: never
  uint64_t max_faults = std::numeric_limits<uint64_t>::max();
};

class FaultInjectingEngine : public EngineWrapper {
 public:
  FaultInjectingEngine(std::unique_ptr<Engine> target, uint64_t seed);

  void AddRule(const FaultRule& rule);
  uint64_t injected() const;  // faults injected so far, all rules

  Result<size_t> Submit(std::span<const RawRequest> requests) override;
  Result<size_t> Reap(std::span<RawCompletion> out, size_t min_completions) override;

 private:
  struct RuleState {
    FaultRule rule;
    uint64_t seen = 0;
    uint64_t fired = 0;
  };
  struct Decision {
    bool synthetic = false;  // completes without reaching the target
    int64_t result = 0;      // -errno for a synthetic completion
    RawRequest forwarded;    // what the target gets otherwise
  };

  Decision Decide(const RawRequest& request);
  bool Fires(RuleState& state, Op op);

  mutable std::mutex mutex_;
  std::mt19937_64 random_;
  std::vector<RuleState> rules_;
  uint64_t injected_ = 0;
  std::vector<RawCompletion> synthetic_;                   // ready completions not from the target
  std::unordered_map<uint64_t, std::byte*> corrupt_tags_;  // reads to corrupt on completion
  std::vector<RawRequest> forwarded_;                      // used by the submitting thread only
  std::vector<Decision> decisions_;                        // used by the submitting thread only
};

}  // namespace zoe::io
