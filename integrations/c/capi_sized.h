// Structs that carry their size (zoe.h, convention 8): the one place that reads a caller's sized
// input struct and writes a sized output struct. ReadSized / ResetSized / WriteSized check
// struct_size and move only the members it covers whole; SizedTraits<T> names each struct, its
// defaults (its ZOE_*_INIT macro) and where its members lie.
#pragma once

#include <fmt/format.h>

#include <array>
#include <cstddef>
#include <cstring>
#include <string_view>

#include "core/result.h"
#include "integrations/c/capi_handles.h"
#include "zoe.h"

namespace zoe::capi {

// Where one member after struct_size lies in this library's layout.
struct SizedMember {
  size_t offset;
  size_t size;
  constexpr size_t end() const { return offset + size; }
};

#define ZOE_CAPI_MEMBER(type, member) \
  SizedMember { offsetof(type, member), sizeof(type::member) }

template <class T>
struct SizedTraits;

template <>
struct SizedTraits<zoe_tensor_desc> {
  static constexpr std::string_view kName = "zoe_tensor_desc";
  static constexpr std::string_view kInit = "ZOE_TENSOR_DESC_INIT";
  static constexpr zoe_tensor_desc Defaults() { return ZOE_TENSOR_DESC_INIT; }
  static constexpr std::array kMembers = {
      ZOE_CAPI_MEMBER(zoe_tensor_desc, name), ZOE_CAPI_MEMBER(zoe_tensor_desc, bytes),
      ZOE_CAPI_MEMBER(zoe_tensor_desc, dtype), ZOE_CAPI_MEMBER(zoe_tensor_desc, home),
      ZOE_CAPI_MEMBER(zoe_tensor_desc, group)};
};

template <>
struct SizedTraits<zoe_hyper_params> {
  static constexpr std::string_view kName = "zoe_hyper_params";
  static constexpr std::string_view kInit = "ZOE_HYPER_PARAMS_INIT";
  static constexpr zoe_hyper_params Defaults() { return ZOE_HYPER_PARAMS_INIT; }
  static constexpr std::array kMembers = {
      ZOE_CAPI_MEMBER(zoe_hyper_params, lr), ZOE_CAPI_MEMBER(zoe_hyper_params, beta1),
      ZOE_CAPI_MEMBER(zoe_hyper_params, beta2), ZOE_CAPI_MEMBER(zoe_hyper_params, eps),
      ZOE_CAPI_MEMBER(zoe_hyper_params, weight_decay)};
};

template <>
struct SizedTraits<zoe_step_result> {
  static constexpr std::string_view kName = "zoe_step_result";
  static constexpr std::string_view kInit = "ZOE_STEP_RESULT_INIT";
  static constexpr zoe_step_result Defaults() { return ZOE_STEP_RESULT_INIT; }
  static constexpr std::array kMembers = {
      ZOE_CAPI_MEMBER(zoe_step_result, skipped),       ZOE_CAPI_MEMBER(zoe_step_result, grad_norm),
      ZOE_CAPI_MEMBER(zoe_step_result, steps_taken),   ZOE_CAPI_MEMBER(zoe_step_result, bytes_read),
      ZOE_CAPI_MEMBER(zoe_step_result, bytes_written), ZOE_CAPI_MEMBER(zoe_step_result, seconds)};
};

template <>
struct SizedTraits<zoe_speculation_stats> {
  static constexpr std::string_view kName = "zoe_speculation_stats";
  static constexpr std::string_view kInit = "ZOE_SPECULATION_STATS_INIT";
  static constexpr zoe_speculation_stats Defaults() { return ZOE_SPECULATION_STATS_INIT; }
  static constexpr std::array kMembers = {
      ZOE_CAPI_MEMBER(zoe_speculation_stats, steps),
      ZOE_CAPI_MEMBER(zoe_speculation_stats, chunks_speculative),
      ZOE_CAPI_MEMBER(zoe_speculation_stats, chunks_committed),
      ZOE_CAPI_MEMBER(zoe_speculation_stats, chunks_recomputed),
      ZOE_CAPI_MEMBER(zoe_speculation_stats, chunks_discarded)};
};

template <>
struct SizedTraits<zoe_collectives> {
  static constexpr std::string_view kName = "zoe_collectives";
  static constexpr std::string_view kInit = "ZOE_COLLECTIVES_INIT";
  static constexpr zoe_collectives Defaults() { return ZOE_COLLECTIVES_INIT; }
  static constexpr std::array kMembers = {ZOE_CAPI_MEMBER(zoe_collectives, context),
                                          ZOE_CAPI_MEMBER(zoe_collectives, rank),
                                          ZOE_CAPI_MEMBER(zoe_collectives, world_size),
                                          ZOE_CAPI_MEMBER(zoe_collectives, all_reduce_sum),
                                          ZOE_CAPI_MEMBER(zoe_collectives, reduce_scatter_sum),
                                          ZOE_CAPI_MEMBER(zoe_collectives, all_gather),
                                          ZOE_CAPI_MEMBER(zoe_collectives, barrier),
                                          ZOE_CAPI_MEMBER(zoe_collectives, broadcast)};
};

#undef ZOE_CAPI_MEMBER

// The caller's struct_size, read as bytes: the caller's struct may be shorter than T.
template <class T>
size_t StructSize(const T* sized) {
  size_t size = 0;
  std::memcpy(&size, reinterpret_cast<const unsigned char*>(sized) + offsetof(T, struct_size),
              sizeof size);
  return size;
}

// OK when `sized` (not NULL) has a struct_size this library accepts: at least struct_size itself,
// and any bytes beyond this library's sizeof(T) all zero. `name` is the argument ("hyper").
template <class T>
Status CheckStructSize(const T* sized, std::string_view name) {
  static_assert(offsetof(T, struct_size) == 0, "struct_size comes first");
  constexpr size_t kMinimum = SizedTraits<T>::kMembers.front().offset;
  const size_t size = StructSize(sized);
  if (size < kMinimum) {
    return Status::InvalidArgument(fmt::format(
        "{}: {}.struct_size = {} is smaller than {}, where its first member starts; initialise it "
        "with {} (this library's {} is {} bytes)",
        name, SizedTraits<T>::kName, size, kMinimum, SizedTraits<T>::kInit, SizedTraits<T>::kName,
        sizeof(T)));
  }
  const auto* bytes = reinterpret_cast<const unsigned char*>(sized);
  for (size_t at = sizeof(T); at < size; ++at) {
    if (bytes[at] == 0) continue;
    return Status::InvalidArgument(fmt::format(
        "{}: {}.struct_size = {} is larger than the {} bytes this library (zoe {}) knows, and byte "
        "{} beyond them is not zero: it sets a member this library does not have",
        name, SizedTraits<T>::kName, size, sizeof(T), zoe_version(), at));
  }
  return Status::Ok();
}

// A copy of the caller's input struct: the members its struct_size covers whole, the others at
// their defaults. InvalidArgument for NULL or a refused struct_size.
template <class T>
Result<T> ReadSized(const T* in, std::string_view name) {
  ZOE_RETURN_IF_ERROR(CheckNotNull(in, name));
  ZOE_RETURN_IF_ERROR(CheckStructSize(in, name));
  const size_t size = StructSize(in);
  T out = SizedTraits<T>::Defaults();
  for (const SizedMember member : SizedTraits<T>::kMembers) {
    if (member.end() > size) break;
    std::memcpy(reinterpret_cast<unsigned char*>(&out) + member.offset,
                reinterpret_cast<const unsigned char*>(in) + member.offset, member.size);
  }
  return out;
}

// Writes `value`'s members that the caller's struct_size covers whole into *out; struct_size and
// everything beyond stay as they are. *out must have passed CheckStructSize (ResetSized).
template <class T>
void WriteSized(const T& value, T* out) {
  const size_t size = StructSize(out);
  for (const SizedMember member : SizedTraits<T>::kMembers) {
    if (member.end() > size) break;
    std::memcpy(reinterpret_cast<unsigned char*>(out) + member.offset,
                reinterpret_cast<const unsigned char*>(&value) + member.offset, member.size);
  }
}

// At the start of a call with an output struct: checks its struct_size and sets the members it
// covers to their defaults, so a failed call leaves them so. A refused struct is not written.
template <class T>
Status ResetSized(T* out, std::string_view name) {
  ZOE_RETURN_IF_ERROR(CheckNotNull(out, name));
  ZOE_RETURN_IF_ERROR(CheckStructSize(out, name));
  WriteSized(SizedTraits<T>::Defaults(), out);
  return Status::Ok();
}

}  // namespace zoe::capi
