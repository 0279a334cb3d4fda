// Group: an in-memory parameter group that owns its optimizer state and step counter, built on
// the chunk-level entry points (chunk.h). The offloaded pipeline drives chunks itself; Group is
// for state that fits in memory (tests, benchmarks, small models).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "core/aligned_buffer.h"
#include "core/result.h"
#include "optim/chunk.h"

namespace zoe::optim {

struct GroupOptions {
  Kind kind = Kind::kAdamW;
  ChunkLayout layout;
  size_t count = 0;            // parameters in the group
  double max_grad_norm = 0.0;  // > 0: clip the global gradient norm to it; 0: no clipping
  RunOptions run;              // threads, instruction set and tile size of every step
};

class Group {
 public:
  // Validates the options and allocates zeroed state, first touched by the run's threads.
  static Result<std::unique_ptr<Group>> Create(const GroupOptions& options);

  // One step: scan the gradients (inf/NaN check, norm, clip), then update master, state and the
  // optional param_copy. `hyper.kind` must be the group's kind; other fields may change on every
  // call. A step with a non-finite gradient writes nothing, does not advance the step counter
  // and comes back with skip set. Buffers are options.count elements long and borrowed.
  Result<StepScaling> Step(const HyperParams& hyper, float* master, const void* grad,
                           void* param_copy = nullptr, double loss_scale = 1.0);

  int64_t steps_taken() const { return steps_taken_; }
  int64_t steps_skipped() const { return steps_skipped_; }
  const GroupOptions& options() const { return options_; }
  // State buffers in options.layout.state; null for a slot the kind does not use.
  void* exp_avg() { return exp_avg_.empty() ? nullptr : exp_avg_.data(); }
  void* exp_avg_sq() { return exp_avg_sq_.empty() ? nullptr : exp_avg_sq_.data(); }

 private:
  explicit Group(const GroupOptions& options) : options_(options) {}

  GroupOptions options_;
  AlignedBuffer exp_avg_;
  AlignedBuffer exp_avg_sq_;
  int64_t steps_taken_ = 0;
  int64_t steps_skipped_ = 0;
};

}  // namespace zoe::optim
