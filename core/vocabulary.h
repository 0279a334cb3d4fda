// The vocabulary every layer shares -- element types, optimizer kinds, the optimizer kernels'
// arithmetic and stores and the tier manager's eviction -- each defined once, with the one table of
// the names it carries in configuration documents, CLI flags, the C API, logs and error messages.
// The other layers refer to these (optim/types.h and offload/types.h re-export them under their own
// namespaces); nothing else spells the names. DType is the one element-type enum: the optimizer
// kernels take a subset of it and index their tables through optim::KernelSlot, the one mapping
// from these values to theirs. C++17, for the CUDA sources that include it.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "core/result.h"

namespace zoe {

// Which update rule an optimizer step applies.
enum class OptimizerKind : uint8_t {
  kAdamW,    // Adam with decoupled weight decay (Loshchilov & Hutter), torch.optim.AdamW
  kAdam,     // Adam with L2 weight decay added to the gradient, torch.optim.Adam
  kAdagrad,  // torch.optim.Adagrad (lr_decay 0, initial accumulator 0)
  kLion,     // Lion (Chen et al. 2023): sign of an interpolated momentum
};

// How Adam and AdamW compute the bias-corrected denominator (optim/chunk.h states the bound).
enum class Arithmetic : uint8_t {
  kExact,  // sqrt(v) / sqrt(1 - beta2^t): torch's operations, bit-identical to torch
  kFast,   // sqrt(v) * (1 / sqrt(1 - beta2^t)): one division fewer per element
};

// How the CPU optimizer kernels write the fp32 arrays of an update (optim/chunk.h). Results do not
// depend on it.
enum class StoreMode : uint8_t {
  kCached,     // ordinary stores
  kAuto,       // non-temporal stores for a pass that reads more than the last-level cache
  kStreaming,  // non-temporal stores wherever the arrays allow
};

// Which resident chunk the tier manager evicts first: the one whose next use in the recorded
// trace is furthest away (Belady/OPT), or the least recently used.
enum class EvictionKind : uint8_t { kOpt, kLru };

// Element types. The numbers are part of the trace file format and of the C API (zoe_dtype): a
// value, once given, is never reused.
enum class DType : uint8_t {
  kFloat32 = 0,
  kFloat16 = 1,
  kBFloat16 = 2,
  kInt8 = 3,
  kUInt8 = 4,
  kInt32 = 5,
  kInt64 = 6,
  kFloat64 = 7,
  kBool = 8,
  kFloat8E4M3 = 9,
  kFloat8E5M2 = 10,
};

// The names, indexed by the enum's value: the one table of each.
inline constexpr std::array<std::string_view, 4> kOptimizerKindNames = {"adamw", "adam", "adagrad",
                                                                        "lion"};
inline constexpr std::array<std::string_view, 2> kArithmeticNames = {"exact", "fast"};
inline constexpr std::array<std::string_view, 2> kEvictionKindNames = {"opt", "lru"};
inline constexpr std::array<std::string_view, 3> kStoreModeNames = {"cached", "auto", "streaming"};

// One element type: its size, its name and the other spellings a parser accepts for it.
struct DTypeInfo {
  DType dtype;
  size_t bytes;
  std::string_view name;        // zoe's name: "fp32", "bf16", ...
  std::string_view torch_name;  // torch's: "float32", "bfloat16", ...
  std::string_view short_name;  // a third accepted spelling ("f32", "i8"), or empty
};
inline constexpr std::array<DTypeInfo, 11> kDTypes = {{
    {DType::kFloat32, 4, "fp32", "float32", "f32"},
    {DType::kFloat16, 2, "fp16", "float16", "f16"},
    {DType::kBFloat16, 2, "bf16", "bfloat16", ""},
    {DType::kInt8, 1, "int8", "int8", "i8"},
    {DType::kUInt8, 1, "uint8", "uint8", ""},
    {DType::kInt32, 4, "int32", "int32", ""},
    {DType::kInt64, 8, "int64", "int64", ""},
    {DType::kFloat64, 8, "fp64", "float64", ""},
    {DType::kBool, 1, "bool", "bool", ""},
    {DType::kFloat8E4M3, 1, "fp8_e4m3", "float8_e4m3fn", ""},
    {DType::kFloat8E5M2, 1, "fp8_e5m2", "float8_e5m2", ""},
}};

// The one mechanism for an enum's spellings, in every layer: a table of names indexed by the
// enum's value (its values numbered 0, 1, ... in order), NameIn to spell a value and ParseIn to
// read one back. NameIn gives "unknown" for a value cast from an out-of-range integer.
template <class Enum, size_t N>
constexpr std::string_view NameIn(const std::array<std::string_view, N>& names, Enum value) {
  const auto index = static_cast<size_t>(value);
  return index < N ? names[index] : std::string_view("unknown");
}

// The value named `name` in `names` (exactly, or in any letter case with Case::kIgnore), else an
// InvalidArgument "unknown <what> '<name>'; allowed: <the names>".
enum class Case : uint8_t { kExact, kIgnore };
Status UnknownName(std::string_view what, std::string_view name, const std::string_view* names,
                   size_t count);
bool SameName(std::string_view a, std::string_view b, Case letter_case);
template <class Enum, size_t N>
Result<Enum> ParseIn(const std::array<std::string_view, N>& names, std::string_view what,
                     std::string_view name, Case letter_case = Case::kExact) {
  for (size_t i = 0; i < N; ++i) {
    if (SameName(names[i], name, letter_case)) return static_cast<Enum>(i);
  }
  return UnknownName(what, name, names.data(), N);
}

// Names of the values above; "unknown" for a value cast from an out-of-range integer.
constexpr std::string_view OptimizerKindName(OptimizerKind kind) {
  return NameIn(kOptimizerKindNames, kind);
}
constexpr std::string_view ArithmeticName(Arithmetic arithmetic) {
  return NameIn(kArithmeticNames, arithmetic);
}
constexpr std::string_view EvictionKindName(EvictionKind kind) {
  return NameIn(kEvictionKindNames, kind);
}
constexpr std::string_view StoreModeName(StoreMode mode) { return NameIn(kStoreModeNames, mode); }
constexpr std::string_view DTypeName(DType dtype) {
  const auto index = static_cast<size_t>(dtype);
  return index < kDTypes.size() ? kDTypes[index].name : std::string_view("unknown");
}
// Bytes per element; 0 for a value outside the enum (an unknown dtype).
constexpr size_t DTypeSize(DType dtype) {
  const auto index = static_cast<size_t>(dtype);
  return index < kDTypes.size() ? kDTypes[index].bytes : 0;
}
constexpr bool IsValidDType(DType dtype) { return DTypeSize(dtype) != 0; }

// Element types the optimizer's moments (Adam's m and v) may have in every tier; int8 is
// block-wise quantized (docs/int8-moments.md). Configuration documents name them as below.
inline constexpr std::array<DType, 3> kMomentDTypes = {DType::kFloat32, DType::kBFloat16,
                                                       DType::kInt8};
inline constexpr std::array<std::string_view, 3> kMomentDTypeNames = {
    DTypeName(kMomentDTypes[0]), DTypeName(kMomentDTypes[1]), DTypeName(kMomentDTypes[2])};

// Inverses of the names above. Optimizer kinds, arithmetic, eviction and stores match exactly;
// element types match any of their three spellings in any letter case. An unknown name is an
// InvalidArgument "unknown <what> '<name>'; allowed: <the table's names>".
Result<OptimizerKind> ParseOptimizerKind(std::string_view name);
Result<Arithmetic> ParseArithmetic(std::string_view name);
Result<EvictionKind> ParseEvictionKind(std::string_view name);
Result<StoreMode> ParseStoreMode(std::string_view name);
Result<DType> ParseDType(std::string_view name);

// "a, b, c": a table's names as error messages list them.
std::string JoinNames(const std::string_view* names, size_t count);
template <size_t N>
std::string JoinNames(const std::array<std::string_view, N>& names) {
  return JoinNames(names.data(), N);
}

// Ok when `dtype` is one of kMomentDTypes, else an InvalidArgument naming `what`, the dtype and
// the allowed ones.
Status CheckMomentDType(DType dtype, std::string_view what);

}  // namespace zoe
