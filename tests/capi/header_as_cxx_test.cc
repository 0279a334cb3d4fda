// Description: zoe.h compiles as C++ and its declarations have C linkage and the documented types;
// the structs keep the layout the Python binding (ctypes) mirrors on x86-64 and aarch64.
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "zoe.h"

static_assert(std::is_same_v<decltype(&zoe_version), const char* (*)()>);
static_assert(std::is_same_v<decltype(&zoe_status_string), const char* (*)(zoe_status)>);
static_assert(static_cast<int>(ZOE_OK) == 0);
static_assert(static_cast<int>(ZOE_ERR_INTERNAL) == 12);

// The engine's functions, with the exact parameter types callers bind to.
static_assert(
    std::is_same_v<decltype(&zoe_engine_create), zoe_status (*)(const char*, zoe_engine**)>);
static_assert(std::is_same_v<decltype(&zoe_config_check), zoe_status (*)(const char*, char**)>);
static_assert(std::is_same_v<decltype(&zoe_config_normalize), zoe_status (*)(const char*, char**)>);
static_assert(std::is_same_v<decltype(&zoe_engine_destroy), void (*)(zoe_engine*)>);
static_assert(
    std::is_same_v<decltype(&zoe_engine_stats_json), zoe_status (*)(zoe_engine*, char**)>);
static_assert(std::is_same_v<decltype(&zoe_tensor_register),
                             zoe_status (*)(zoe_engine*, const zoe_tensor_desc*, zoe_tensor_id*)>);
static_assert(
    std::is_same_v<decltype(&zoe_tensor_acquire),
                   zoe_status (*)(zoe_engine*, zoe_tensor_id, zoe_tier, zoe_access, void**)>);
static_assert(
    std::is_same_v<decltype(&zoe_trace_load), zoe_status (*)(zoe_engine*, const char*, char**)>);
static_assert(std::is_same_v<decltype(&zoe_optim_group_create),
                             zoe_status (*)(zoe_engine*, const char*, const zoe_buffer_view*,
                                            size_t, zoe_group_id*)>);
static_assert(std::is_same_v<decltype(&zoe_optim_step),
                             zoe_status (*)(zoe_engine*, zoe_group_id, const zoe_hyper_params*,
                                            const zoe_buffer_view*, size_t, const zoe_buffer_view*,
                                            size_t, double, zoe_step_result*)>);
static_assert(std::is_same_v<decltype(&zoe_optim_state_read),
                             zoe_status (*)(zoe_engine*, zoe_group_id, zoe_state_slot, uint64_t,
                                            uint64_t, float*)>);
static_assert(
    std::is_same_v<decltype(&zoe_checkpoint_load), zoe_status (*)(zoe_engine*, const char*)>);

// Ids and enums.
static_assert(std::is_same_v<zoe_tensor_id, uint32_t> && std::is_same_v<zoe_group_id, uint32_t>);
static_assert(ZOE_TENSOR_ID_INVALID == UINT32_MAX && ZOE_GROUP_ID_INVALID == UINT32_MAX);
static_assert(ZOE_TIER_NVME == 2 && ZOE_ACCESS_READ_WRITE == 2 && ZOE_DTYPE_FLOAT8_E5M2 == 10);
static_assert(ZOE_STATE_EXP_AVG_SQ == 2);
static_assert(sizeof(zoe_tier) == sizeof(int) && sizeof(zoe_dtype) == sizeof(int));

// Struct layouts (LP64). Every sized struct starts with struct_size (zoe.h, convention 8).
static_assert(offsetof(zoe_tensor_desc, struct_size) == 0 && offsetof(zoe_tensor_desc, name) == 8 &&
              offsetof(zoe_tensor_desc, bytes) == 16 && offsetof(zoe_tensor_desc, dtype) == 24 &&
              offsetof(zoe_tensor_desc, home) == 28 && offsetof(zoe_tensor_desc, group) == 32 &&
              sizeof(zoe_tensor_desc) == 40);
static_assert(offsetof(zoe_buffer_view, dtype) == 8 && offsetof(zoe_buffer_view, count) == 16 &&
              sizeof(zoe_buffer_view) == 24);
static_assert(offsetof(zoe_hyper_params, lr) == 8 && sizeof(zoe_hyper_params) == 6 * 8);
static_assert(offsetof(zoe_step_result, skipped) == 8 &&
              offsetof(zoe_step_result, grad_norm) == 16 &&
              offsetof(zoe_step_result, steps_taken) == 24 &&
              offsetof(zoe_step_result, bytes_read) == 32 &&
              offsetof(zoe_step_result, seconds) == 48 && sizeof(zoe_step_result) == 56);
static_assert(offsetof(zoe_speculation_stats, steps) == 8 && sizeof(zoe_speculation_stats) == 48);
static_assert(offsetof(zoe_collectives, context) == 8 && offsetof(zoe_collectives, rank) == 16 &&
              offsetof(zoe_collectives, all_reduce_sum) == 24 &&
              offsetof(zoe_collectives, barrier) == 48 &&
              offsetof(zoe_collectives, broadcast) == 56 && sizeof(zoe_collectives) == 64);

// The INIT macros are C++20 designated initializers here, and constant expressions.
constexpr zoe_tensor_desc kDesc = ZOE_TENSOR_DESC_INIT;
static_assert(kDesc.struct_size == sizeof(zoe_tensor_desc) && kDesc.name == nullptr &&
              kDesc.dtype == ZOE_DTYPE_FLOAT32 && kDesc.home == ZOE_TIER_NVME);
constexpr zoe_hyper_params kHyper = ZOE_HYPER_PARAMS_INIT;
static_assert(kHyper.struct_size == sizeof(zoe_hyper_params) && kHyper.lr == 1e-3 &&
              kHyper.beta1 == 0.9 && kHyper.beta2 == 0.999 && kHyper.eps == 1e-8 &&
              kHyper.weight_decay == 0.0);
constexpr zoe_step_result kResult = ZOE_STEP_RESULT_INIT;
static_assert(kResult.struct_size == sizeof(zoe_step_result) && kResult.steps_taken == 0);
constexpr zoe_speculation_stats kStats = ZOE_SPECULATION_STATS_INIT;
static_assert(kStats.struct_size == sizeof(zoe_speculation_stats) && kStats.steps == 0);
constexpr zoe_collectives kCollectives = ZOE_COLLECTIVES_INIT;
static_assert(kCollectives.struct_size == sizeof(zoe_collectives) && kCollectives.world_size == 1 &&
              kCollectives.barrier == nullptr && kCollectives.broadcast == nullptr);

int main() { return zoe_version() != nullptr ? 0 : 1; }
