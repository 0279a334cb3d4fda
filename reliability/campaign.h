// The fault campaign's workload and the forked runner that survives it, shared by the campaign
// test (tests/reliability/fault_campaign_test.cc), its regression cases and `zoe fault-campaign`
// (through campaign_run.h).
//
// RunWorkload builds an Engine whose two I/O engines (registered tensors, optimizer groups) are
// psync engines wrapped in one io::FaultInjectingEngine per rule of a FaultPlan, with checksums
// on, and drives a seeded workload through it: tensors acquired and released on HOST and DEVICE
// under budgets that force eviction, with a recorded trace replayed (prefetch) and explicit
// prefetch hints; an optimizer group whose state is half on NVMe and half in HOST, stepped with
// gradients given to the step and through AccumulateGrad; a checkpoint saved and loaded back
// (its system calls can fail too).
//
// While it runs it keeps a shadow of everything acknowledged: the bytes of each tensor as last
// written and released, and an in-memory optim::Group replaying exactly the steps that succeeded
// (rebuilt from that history when a checkpoint load succeeds). Every read compares against the
// shadow; a difference after a call that returned OK is a silent corruption. Every failed call is
// counted by its code. When the workload is done the faults are disarmed and a final pass (flush,
// read every tensor, step once more, read the optimizer state) checks that the engine recovered;
// an error there means the engine refused further work.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "io/fault_injection.h"

namespace zoe::reliability {

// What a rule applies to: one of the engine's two I/O engines, or the system calls of checkpoint
// saves and loads (EngineHooks::checkpoint_fault_for_testing). On checkpoints kEio and kEnospc
// fail the call (a load's opens and reads too, with kEio), kShortTransfer makes a write short,
// kEintr interrupts it; other kinds do not apply.
enum class Target : uint8_t { kTensors = 0, kOptimizer = 1, kCheckpoint = 2 };

struct TargetedRule {
  Target target = Target::kTensors;
  io::FaultRule rule;
};

struct FaultPlan {
  uint64_t seed = 1;  // the fault engines' generators and the workload's data
  std::vector<TargetedRule> rules;
  bool refuse_direct = false;  // swap files open as on a filesystem that refuses O_DIRECT
};

// What one run saw. Plain data: a forked child sends it to its parent through a pipe.
struct Outcome {
  uint64_t requests = 0;         // raw I/O requests submitted while faults were armed
  uint64_t injected_errors = 0;  // EIO, ENOSPC and corrupted reads injected
  // Short transfers, EINTR, EAGAIN, refused O_DIRECT, and failed removals of old checkpoint
  // versions (a save only logs those: the new version is complete).
  uint64_t injected_recoverable = 0;
  uint64_t errors_reported = 0;     // calls that failed with IoError, NoSpace or Corruption
  uint64_t other_errors = 0;        // calls that failed with any other code
  uint64_t silent_corruptions = 0;  // acknowledged data that differs from the shadow
  bool completed = false;           // the run reached its end
  bool final_pass_ok = false;       // after the faults were disarmed, every call succeeded
  char first_problem[512] = {};     // the first unexpected error or corruption, if any
  char first_error[512] = {};       // the first IoError, NoSpace or Corruption reported
};

// Runs the workload in `dir` (an existing, empty directory) with the faults of `plan`.
Outcome RunWorkload(const FaultPlan& plan, const std::string& dir);

enum class ExitKind : uint8_t { kNormal, kCrashed, kHung };

struct ForkedResult {
  ExitKind exit = ExitKind::kNormal;
  Outcome outcome;     // valid when exit is kNormal
  std::string detail;  // the signal or exit status of an abnormal end
};

// Runs `body` in a forked child and returns its outcome. A child that dies (signal, non-zero
// exit, no outcome written) is kCrashed; one still running after `deadline` is killed and is
// kHung. The caller must have no threads of its own running (fork copies only the caller).
ForkedResult RunForked(const std::function<Outcome()>& body, std::chrono::milliseconds deadline);

// True in builds with AddressSanitizer or ThreadSanitizer, or when ZOE_CAMPAIGN_SMALL is set:
// the campaign then runs a smaller countdown range and fewer seeds.
bool SmallCampaign();

}  // namespace zoe::reliability
