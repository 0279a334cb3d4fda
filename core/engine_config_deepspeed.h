// The DeepSpeed keys the engine reads no value from, listed in one place (engine_config.cc reads
// the ones it acts on):
//  - ignored: they change nothing zoe computes (monitors and profilers, communication and
//    bucketing knobs, DeepSpeed's own partitioning and checkpointing switches), or they are
//    DeepSpeed features that are switched off;
//  - the framework's: read by the framework integration, not the engine (zoe.torch.initialize
//    reads the batch sizes, the schedule, the gradient buckets, activation checkpointing and the
//    precision the gradients are accumulated and reduced in);
//  - switches of DeepSpeed features that change what is trained and that zoe does not implement
//    (amp, elasticity, curriculum learning, ZeRO++ quantization, ...): accepted while off, and a
//    document turning one on is refused naming it, what DeepSpeed then does and the way out.
// Any other key is an unknown key, so a typo is still an error with a "did you mean".
#pragma once

#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "core/config.h"
#include "core/result.h"

namespace zoe::config {

// A section of the document that holds DeepSpeed keys the engine reads no value from.
enum class DeepSpeedSection { kTopLevel, kZero, kOffloadOptimizer, kOptimizer, kFp16, kBf16 };

// Where the keys present go: their dotted paths are appended to `ignored` or to `framework`.
struct AcceptedKeys {
  std::vector<std::string>* ignored;
  std::vector<std::string>* framework;
};

// Accepts with `reader` the keys of `section` the engine reads no value from, unvalidated.
void AcceptDeepSpeedKeys(ObjectReader& reader, DeepSpeedSection section, const AcceptedKeys& keys);

// OK unless `document` (its "auto" values removed, their paths in `auto_keys`) turns on a
// DeepSpeed feature zoe does not implement; then InvalidArgument naming the switch and its value,
// what DeepSpeed does with it on, and how to get a document zoe accepts. A switch is on as
// DeepSpeed reads it: a value that is true for Python (true, a number other than 0, a non-empty
// string; the switches of pydantic sections hold booleans by then: ReadPydanticSections). A
// switch DeepSpeed reads only with another one on (fp16.auto_cast with fp16.enabled) counts too
// when that one is "auto": DeepSpeed up to 0.16 takes the string "auto" for true, later releases
// read the switch whatever enabled is, and the framework may fill in true.
Status CheckDeepSpeedSwitches(const nlohmann::json& document,
                              std::span<const std::string> auto_keys);

}  // namespace zoe::config
