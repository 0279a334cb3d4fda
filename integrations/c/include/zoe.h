/* zoe.h: the stable C API of zoe, a heterogeneous-memory offload engine.
 *
 * Conventions
 *  1. Every function that can fail returns a zoe_status; ZOE_OK is 0. Codes are numbered
 *     explicitly and a number is never reused.
 *  2. After a failure, zoe_last_error() returns a message naming what was wrong; it is
 *     thread-local and valid until the same thread's next call into zoe.
 *  3. Handles are opaque; destroy functions accept NULL.
 *  4. Ownership is stated on every function: "borrowed" pointers stay owned by the caller;
 *     strings returned as "free with zoe_free" belong to the caller.
 *  5. No C++ exception and no abort crosses this boundary.
 *  6. A NULL engine or a NULL required pointer is ZOE_ERR_INVALID_ARGUMENT naming the argument;
 *     an id that names no tensor or group is ZOE_ERR_NOT_FOUND; an enum value outside its list is
 *     ZOE_ERR_INVALID_ARGUMENT. On failure, out-parameters (when not NULL themselves) are set to
 *     NULL, ZOE_TENSOR_ID_INVALID / ZOE_GROUP_ID_INVALID, or 0 (numbers, and the members of an
 *     output struct that its struct_size covers). Output arrays (a pointer and a count the caller
 *     gives) are not cleared, as a refused count cannot size them: untouched when the call is
 *     refused for its arguments, possibly partly written when it fails later (an I/O error);
 *     their contents mean nothing after a failure.
 *  7. A destroyed engine cannot be told from a live one: using it is undefined behaviour.
 *  8. Structs carry their size. Every struct a caller fills for zoe (zoe_tensor_desc,
 *     zoe_hyper_params, zoe_collectives) or zoe fills for a caller (zoe_step_result,
 *     zoe_speculation_stats, and zoe_collectives from zoe_nccl_collectives_create) starts with
 *     `size_t struct_size`, the struct's sizeof as the caller was compiled. Its ZOE_<NAME>_INIT
 *     macro (a compound literal, C99 and C++20) sets it and every other member to the documented
 *     default: `zoe_hyper_params h = ZOE_HYPER_PARAMS_INIT; h.lr = 1e-3;` (a static object takes
 *     a braced list with `.struct_size = sizeof(type)`). Members are only ever added at the end.
 *     - struct_size < sizeof(size_t) (where the first member after struct_size starts), 0
 *       included, is ZOE_ERR_INVALID_ARGUMENT naming the struct and both sizes.
 *     - A smaller struct (a caller built against an older zoe.h): zoe reads only the members
 *       struct_size covers whole; the others take their INIT default. zoe writes only the
 *       members struct_size covers whole.
 *     - A larger struct (a caller built against a newer zoe.h): accepted when every byte beyond
 *       this library's sizeof is zero (members it does not know, left at their default);
 *       otherwise ZOE_ERR_INVALID_ARGUMENT naming the struct, its struct_size and the size this
 *       library knows. zoe never writes beyond its own sizeof, and never changes struct_size.
 *     - A struct refused for its size is not written, not even cleared (item 6).
 *     So a member added later has all-zero bytes as its default, and is laid out leaving no
 *     padding (an explicit reserved member instead), because those bytes are checked.
 *     zoe_buffer_view carries no size: it is an array element (a pointer and a count), where a
 *     size per element would make callers step through arrays by bytes; it is frozen, and a view
 *     that needs more gets a new type and new functions.
 *
 * Usage
 *     printf("zoe %s\n", zoe_version());
 *     zoe_hyper_params hyper = ZOE_HYPER_PARAMS_INIT;
 *     zoe_step_result result = ZOE_STEP_RESULT_INIT;
 *     hyper.lr = 1e-3;
 *     if (zoe_optim_step(engine, group, &hyper, &grad, 1, NULL, 0, 1.0, &result) != ZOE_OK)
 *       fprintf(stderr, "zoe: %s\n", zoe_last_error());
 */
#ifndef ZOE_H_
#define ZOE_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(ZOE_BUILDING_LIBRARY)
#define ZOE_API __attribute__((visibility("default")))
#else
#define ZOE_API
#endif

#define ZOE_VERSION_MAJOR 0
#define ZOE_VERSION_MINOR 2
#define ZOE_VERSION_PATCH 0

/* The INIT macros' compound literal: `(type){...}` in C99, `type{...}` (designated
 * initializers) in C++20. */
#ifdef __cplusplus
#define ZOE_LITERAL_(type) type
#else
#define ZOE_LITERAL_(type) (type)
#endif

typedef enum zoe_status {
  ZOE_OK = 0,
  ZOE_ERR_INVALID_ARGUMENT = 1,
  ZOE_ERR_NOT_FOUND = 2,
  ZOE_ERR_IO = 3,
  ZOE_ERR_NO_SPACE = 4,
  ZOE_ERR_CORRUPTION = 5,
  ZOE_ERR_OUT_OF_MEMORY = 6,
  ZOE_ERR_NOT_SUPPORTED = 7,
  ZOE_ERR_FAILED_PRECONDITION = 8,
  ZOE_ERR_BUSY = 9,
  ZOE_ERR_PERMISSION_DENIED = 10,
  ZOE_ERR_ABORTED = 11,
  ZOE_ERR_INTERNAL = 12
} zoe_status;

/* "MAJOR.MINOR.PATCH" of the loaded library. Static storage; never free. Thread-safe. */
ZOE_API const char* zoe_version(void);

/* A short constant name for a status ("IO error"); "unknown status" for numbers not in the
 * enum. Static storage; never free. Thread-safe. */
ZOE_API const char* zoe_status_string(zoe_status status);

/* The message of this thread's most recent failure, or "" if the last call succeeded. Borrowed:
 * valid until this thread's next call into zoe. Never NULL. */
ZOE_API const char* zoe_last_error(void);

/* Frees memory that zoe returned with "free with zoe_free". Accepts NULL. */
ZOE_API void zoe_free(void* ptr);

/* ---------------------------------------------------------------------------------------------
 * Engine: the tiers, the tensors placed in them, and the optimizer groups.
 * ------------------------------------------------------------------------------------------- */

/* Opaque. Created by zoe_engine_create, destroyed by zoe_engine_destroy. Every function taking an
 * engine is thread-safe unless it says otherwise.
 *
 * An engine belongs to the process that created it. After fork() (e.g. a PyTorch DataLoader
 * worker) the child's copy of the handle is unusable: every call on it is
 * ZOE_ERR_FAILED_PRECONDITION ("engine was created by process P and this is process C; after
 * fork() a child process must create its own engine"), and zoe_engine_destroy in the child
 * releases nothing the parent owns (its swap files, I/O rings and threads stay the parent's; the
 * child's copy of the engine's memory is left to the child's exit). The parent's engine is
 * unaffected. */
typedef struct zoe_engine zoe_engine;

typedef uint32_t zoe_tensor_id;
typedef uint32_t zoe_group_id;

/* What an id out-parameter holds after a failure; never the id of a tensor or group. */
#define ZOE_TENSOR_ID_INVALID ((zoe_tensor_id)UINT32_MAX)
#define ZOE_GROUP_ID_INVALID ((zoe_group_id)UINT32_MAX)

/* Numbers are part of the ABI and never reused. */
typedef enum zoe_tier { ZOE_TIER_DEVICE = 0, ZOE_TIER_HOST = 1, ZOE_TIER_NVME = 2 } zoe_tier;

typedef enum zoe_access {
  ZOE_ACCESS_READ = 0,
  ZOE_ACCESS_WRITE = 1,
  ZOE_ACCESS_READ_WRITE = 2
} zoe_access;

typedef enum zoe_dtype {
  ZOE_DTYPE_FLOAT32 = 0,
  ZOE_DTYPE_FLOAT16 = 1,
  ZOE_DTYPE_BFLOAT16 = 2,
  ZOE_DTYPE_INT8 = 3,
  ZOE_DTYPE_UINT8 = 4,
  ZOE_DTYPE_INT32 = 5,
  ZOE_DTYPE_INT64 = 6,
  ZOE_DTYPE_FLOAT64 = 7,
  ZOE_DTYPE_BOOL = 8,
  ZOE_DTYPE_FLOAT8_E4M3 = 9,
  ZOE_DTYPE_FLOAT8_E5M2 = 10
} zoe_dtype;

/* Which optimizer-state array zoe_optim_state_read/write address. */
typedef enum zoe_state_slot {
  ZOE_STATE_MASTER = 0,    /* fp32 master weights */
  ZOE_STATE_EXP_AVG = 1,   /* first moment (torch: exp_avg) */
  ZOE_STATE_EXP_AVG_SQ = 2 /* second moment (torch: exp_avg_sq) */
} zoe_state_slot;

/* A tensor to place (input; sized, convention 8). name: borrowed, copied; unique and non-empty.
 * bytes: a multiple of the dtype's size. group: borrowed, copied; NULL or "" for the default
 * group. Defaults (ZOE_TENSOR_DESC_INIT, and members a smaller struct_size leaves out): name NULL
 * (so it must be given), bytes 0, dtype ZOE_DTYPE_FLOAT32, home ZOE_TIER_NVME, group NULL. */
typedef struct zoe_tensor_desc {
  size_t struct_size; /* sizeof(zoe_tensor_desc) */
  const char* name;
  uint64_t bytes;
  zoe_dtype dtype;
  zoe_tier home;
  const char* group;
} zoe_tensor_desc;

#define ZOE_TENSOR_DESC_INIT                                                                      \
  ZOE_LITERAL_(zoe_tensor_desc) {                                                                 \
    .struct_size = sizeof(zoe_tensor_desc), .name = NULL, .bytes = 0, .dtype = ZOE_DTYPE_FLOAT32, \
    .home = ZOE_TIER_NVME, .group = NULL                                                          \
  }

/* A caller's host buffer of `count` elements of `dtype` (FLOAT32, BFLOAT16 or FLOAT16 where
 * optimizer groups take them). Borrowed for the duration of the call unless a function says
 * otherwise. Not sized (convention 8): an array element passed with a count, frozen as it is.
 * Host memory: data inside the engine's device tier (a pointer zoe_tensor_acquire gave for
 * ZOE_TIER_DEVICE) is ZOE_ERR_INVALID_ARGUMENT naming the view, as for out / values below. */
typedef struct zoe_buffer_view {
  void* data;
  zoe_dtype dtype;
  uint64_t count;
} zoe_buffer_view;

/* The hyper-parameters of one step (input; sized, convention 8); schedulers may change them on
 * every call. Defaults (ZOE_HYPER_PARAMS_INIT, and members a smaller struct_size leaves out):
 * lr 1e-3, beta1 0.9, beta2 0.999, eps 1e-8, weight_decay 0. */
typedef struct zoe_hyper_params {
  size_t struct_size; /* sizeof(zoe_hyper_params) */
  double lr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
} zoe_hyper_params;

#define ZOE_HYPER_PARAMS_INIT                                                          \
  ZOE_LITERAL_(zoe_hyper_params) {                                                     \
    .struct_size = sizeof(zoe_hyper_params), .lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, \
    .eps = 1e-8, .weight_decay = 0.0                                                   \
  }

/* What a step did (output; sized, convention 8): zoe writes the members struct_size covers.
 * ZOE_STEP_RESULT_INIT sets struct_size and zeros the rest; a failed step leaves those members
 * 0. */
typedef struct zoe_step_result {
  size_t struct_size;  /* sizeof(zoe_step_result); set by the caller, never changed by zoe */
  int32_t skipped;     /* 1: a gradient was inf/NaN and nothing changed */
  double grad_norm;    /* L2 norm of the unscaled gradients */
  int64_t steps_taken; /* the group's step count after this call */
  uint64_t bytes_read; /* NVMe bytes */
  uint64_t bytes_written;
  double seconds;
} zoe_step_result;

#define ZOE_STEP_RESULT_INIT                                                                  \
  ZOE_LITERAL_(zoe_step_result) {                                                             \
    .struct_size = sizeof(zoe_step_result), .skipped = 0, .grad_norm = 0.0, .steps_taken = 0, \
    .bytes_read = 0, .bytes_written = 0, .seconds = 0.0                                       \
  }

/* Creates an engine from a JSON configuration (DeepSpeed-shaped:
 * zero_optimization.offload_optimizer, offload_param, aio, plus zoe's own "zoe" section; see
 * docs/configuration.md). NULL or "" means all defaults. Unknown keys are errors naming the closest
 * valid key. On success *out owns the engine (destroy with zoe_engine_destroy); on failure *out is
 * set to NULL. */
ZOE_API zoe_status zoe_engine_create(const char* config_json, zoe_engine** out);

/* Reads a JSON configuration as zoe_engine_create reads it and creates nothing (no memory, swap
 * space, threads or log output): for a framework that runs without an engine yet accepts zoe's
 * configuration. NULL or "" means all defaults. Unknown keys and bad values are INVALID_ARGUMENT
 * as in zoe_engine_create; whether the swap directories, the swap space, pinned memory or the
 * device can be had is not checked. *out_warnings_json (when not NULL; free with zoe_free): a
 * JSON array of the warnings zoe_engine_create would log for it (e.g. a key the configuration's
 * stage does not read), set on success only. */
ZOE_API zoe_status zoe_config_check(const char* config_json, char** out_warnings_json);

/* A DeepSpeed configuration with the sections DeepSpeed reads through pydantic models
 * (zero_optimization with offload_optimizer and offload_param, fp16, bf16, hybrid_engine,
 * tensor_parallel) read as those models read them, as zoe_engine_create reads them first: quoted
 * booleans and numbers converted to the key's type ("false" is false, "2" is 2), and
 * zero_optimization's deprecated cpu_offload and cpu_offload_param replaced by the sections they
 * stand for. "auto", null and every other key are left as given, for a framework that reads the
 * rest itself. NULL or "" means {}. A value pydantic refuses is INVALID_ARGUMENT naming the key,
 * the value and what is allowed. On success *out_json (free with zoe_free) is the document as
 * compact JSON text, with non-finite numbers written NaN, Infinity and -Infinity as Python's json
 * module writes them; on failure it is set to NULL. */
ZOE_API zoe_status zoe_config_normalize(const char* config_json, char** out_json);

/* Waits for background work, releases memory and removes swap files. Accepts NULL. The handle
 * must not be used afterwards, and no other thread may be inside a call on it. In a child process
 * forked after the engine was created it frees only the handle (see zoe_engine). */
ZOE_API void zoe_engine_destroy(zoe_engine* engine);

/* The first failure of background work (e.g. a prefetch) since the last call, then cleared;
 * ZOE_OK when there was none. */
ZOE_API zoe_status zoe_engine_async_error(zoe_engine* engine);

/* Writes every dirty tensor down to NVMe and waits. */
ZOE_API zoe_status zoe_engine_flush(zoe_engine* engine);

/* Statistics (bytes per link, prefetch hits, stalls, evictions, occupancy, per-group step
 * figures) as a JSON object. *out_json: free with zoe_free. */
ZOE_API zoe_status zoe_engine_stats_json(zoe_engine* engine, char** out_json);

/* The configuration in effect, every key with its value, as JSON. *out_json: free with
 * zoe_free. */
ZOE_API zoe_status zoe_engine_config_json(zoe_engine* engine, char** out_json);

/* Places a tensor; its bytes read as zeros until written. NO_SPACE / OUT_OF_MEMORY when it cannot
 * fit the swap space / HOST budget. */
ZOE_API zoe_status zoe_tensor_register(zoe_engine* engine, const zoe_tensor_desc* desc,
                                       zoe_tensor_id* out);

/* The id of a registered tensor; NOT_FOUND otherwise. name: borrowed. */
ZOE_API zoe_status zoe_tensor_find(zoe_engine* engine, const char* name, zoe_tensor_id* out);

/* Makes the tensor resident in `tier` (DEVICE or HOST) and stores its address in *out_ptr. The
 * memory is owned by the engine and stays valid and pinned until the matching
 * zoe_tensor_release. Blocks for transfers and for other tensors' releases when the tier is full
 * (BUSY after the configured timeout). FAILED_PRECONDITION when the tensor shares a chunk with
 * tensors acquired for writing on the tier below (acquiring it on DEVICE while a chunk-mate is
 * acquired on HOST for WRITE / READ_WRITE): release those first. */
ZOE_API zoe_status zoe_tensor_acquire(zoe_engine* engine, zoe_tensor_id tensor, zoe_tier tier,
                                      zoe_access access, void** out_ptr);

/* Undoes the most recent acquire of the tensor. FAILED_PRECONDITION when it is not acquired. */
ZOE_API zoe_status zoe_tensor_release(zoe_engine* engine, zoe_tensor_id tensor);

/* A hint to start moving the tensor towards `tier`; never blocks. */
ZOE_API zoe_status zoe_tensor_prefetch(zoe_engine* engine, zoe_tensor_id tensor, zoe_tier tier);

/* Moves the tensor out of DEVICE and HOST, writing it to NVMe first when dirty. BUSY while it is
 * acquired. */
ZOE_API zoe_status zoe_tensor_evict(zoe_engine* engine, zoe_tensor_id tensor);

/* Brackets one iteration: the first iteration under a name is recorded, later ones replay it
 * (prefetch and eviction by next use). name: borrowed. */
ZOE_API zoe_status zoe_trace_begin(zoe_engine* engine, const char* name);
ZOE_API zoe_status zoe_trace_end(zoe_engine* engine);

/* Writes the recorded trace `name` to `path` (versioned, checksummed). Both borrowed. */
ZOE_API zoe_status zoe_trace_save(zoe_engine* engine, const char* name, const char* path);

/* Loads a trace saved by zoe_trace_save for the same registrations. CORRUPTION for a file that is
 * not a zoe trace or is damaged (magic, version, size or checksum wrong); FAILED_PRECONDITION for
 * a sound trace recorded against other registrations (tensors, sizes or order differ), or when
 * tensors were registered while it loaded; NOT_FOUND for a missing file. *out_name (may be NULL):
 * the trace's name, free with zoe_free. */
ZOE_API zoe_status zoe_trace_load(zoe_engine* engine, const char* path, char** out_name);

/* Creates an optimizer group whose fp32 master weights are initialised from `params` (n views
 * that, concatenated, are the group's parameters; borrowed for the call) and whose state is
 * placed as the engine's configuration says (offload_optimizer: nvme / cpu, ratio, buffer_count,
 * sub_group_size). optim_json: {"name": str, "type": "AdamW"|"Adam"|"Adagrad"|"Lion",
 * "lr", "betas": [b1, b2], "eps", "weight_decay", "max_grad_norm",
 * "moment_dtype": "fp32"|"bf16"|"int8", "segments": [n0, n1, ...]} (all but "name" optional; "Adam"
 * is torch's Adam with L2 weight decay; Adagrad also takes "lr_decay"; defaults come from the
 * engine's configuration). "segments" cuts the group into segments of those lengths (integers >= 0
 * adding up to the group's elements; a framework's parameters), each with its own step count and
 * bias correction like torch's per-parameter state['step']; without it the group is one segment.
 * "master": "params" makes the fp32 `params` the master weights themselves (zero copy, as
 * DeepSpeed's CPU Adam keeps them): they stay borrowed for the group's life and every step updates
 * them in place, so the group holds only the moments (4 bytes per parameter less) and a step needs
 * no params_out; it needs offload_optimizer.device cpu (every chunk in DRAM), no "speculative", and
 * fp32 views (INVALID_ARGUMENT naming the violation otherwise). State reads and writes, checkpoints
 * and their files are the same as with "master": "zoe" (the default, a copy). A view with NULL
 * data (not with "master": "params") leaves its elements' master weights zero, to be written with
 * zoe_optim_state_write: a framework whose parameters do not fit in memory at once writes them one
 * at a time. Names are unique, and name the group's checkpoint file "<name>.state": 1 to 249
 * bytes of UTF-8 without '/' or control characters (NUL included), not "." or ".."
 * (INVALID_ARGUMENT naming the rule otherwise, as a save would refuse them). Ids are given 0, 1,
 * 2, ... in creation order. NO_SPACE /
 * OUT_OF_MEMORY name the bytes needed and free. */
ZOE_API zoe_status zoe_optim_group_create(zoe_engine* engine, const char* optim_json,
                                          const zoe_buffer_view* params, size_t n,
                                          zoe_group_id* out);

/* One optimizer step of the group. hyper: NULL keeps the group's hyper-parameters. grads: n_grads
 * views covering the group, or n_grads 0 to use those given to zoe_optim_accumulate_grad. A grads
 * view with data NULL (and count > 0) says its elements have no gradient in this step (torch: .grad
 * is None): it must cover whole segments (INVALID_ARGUMENT naming them otherwise), and those
 * segments keep their master, moments, step count and params_out elements untouched and count as
 * zero in the gradient norm; the step count of every other segment advances.
 * params_out: n_params views covering the group that receive the updated parameters in their
 * dtype (a view with NULL data is not written; its elements' state is still updated), or n_params
 * 0. loss_scale > 0 (1 for none). A step with a non-finite gradient changes
 * nothing and reports skipped. On any error the state is as it was before the call. out may be
 * NULL. Not to be called concurrently for the same group. */
ZOE_API zoe_status zoe_optim_step(zoe_engine* engine, zoe_group_id group,
                                  const zoe_hyper_params* hyper, const zoe_buffer_view* grads,
                                  size_t n_grads, const zoe_buffer_view* params_out,
                                  size_t n_params, double loss_scale, zoe_step_result* out);

/* Hands over the gradients of elements [offset, offset + grad->count) before the step that uses
 * them, so reading their state starts during backward. The buffer stays borrowed until that
 * zoe_optim_step returns. grad->data NULL: no gradient for whole segments, as in zoe_optim_step. */
ZOE_API zoe_status zoe_optim_accumulate_grad(zoe_engine* engine, zoe_group_id group,
                                             uint64_t offset, const zoe_buffer_view* grad);

/* Drops the gradients given with zoe_optim_accumulate_grad since the last zoe_optim_step (and
 * speculation armed for it): the state reads they started are released and the group's state is
 * unchanged; the next step needs gradients again. For a framework abandoning an iteration after a
 * failure (a step that fails on accumulated gradients otherwise keeps them, to be retried). */
ZOE_API zoe_status zoe_optim_discard_grads(zoe_engine* engine, zoe_group_id group);

/* The sum of squares of the gradients handed over with zoe_optim_accumulate_grad since the last
 * zoe_optim_step, as that step scans them (still multiplied by the loss scale; +inf or NaN when
 * one is not finite; elements without a gradient count as zeros). FAILED_PRECONDITION until they
 * cover the group. For a framework that clips several groups by the norm of them all, as
 * torch.nn.utils.clip_grad_norm_ over every parameter does: it adds the groups' sums (and the
 * ranks'), and steps each group with its loss_scale divided by the clip factor. *out: 0 on
 * error. */
ZOE_API zoe_status zoe_optim_grad_sum_squares(zoe_engine* engine, zoe_group_id group, double* out);

/* Speculation: arms the group's next step to update each chunk as soon as
 * zoe_optim_accumulate_grad completes its gradients, before the global inf/NaN check and gradient
 * norm are known, into the chunk's other slot (the previous version stays untouched). The
 * zoe_optim_step that follows (n_grads 0) then commits those updates (all finite, no clipping),
 * discards them (a non-finite gradient: skipped, nothing changed) or recomputes them from the
 * previous version (the norm exceeds max_grad_norm); state and params_out come out bit-identical
 * to the same step without speculation. The group must be created with "speculative": true in
 * optim_json (its HOST chunks then take a second copy from the pinned budget); FAILED_PRECONDITION
 * otherwise, or once gradients are accumulated. hyper (NULL: the group's), params_out (borrowed
 * until the step returns; that step must give the same views or none) and loss_scale are those
 * of the coming step. A speculative update that fails is reported by the step, which then changes
 * nothing. */
ZOE_API zoe_status zoe_optim_speculate(zoe_engine* engine, zoe_group_id group,
                                       const zoe_hyper_params* hyper,
                                       const zoe_buffer_view* params_out, size_t n_params,
                                       double loss_scale);

/* What speculation did in a group's steps since the group was created (output; sized,
 * convention 8): zoe writes the members struct_size covers. ZOE_SPECULATION_STATS_INIT sets
 * struct_size and zeros the rest. */
typedef struct zoe_speculation_stats {
  size_t struct_size;          /* sizeof(zoe_speculation_stats); never changed by zoe */
  uint64_t steps;              /* steps that speculated */
  uint64_t chunks_speculative; /* chunks updated before their step's global checks */
  uint64_t chunks_committed;   /* of those, updates that were final */
  uint64_t chunks_recomputed;  /* updated again with the clip factor */
  uint64_t chunks_discarded;   /* dropped: a non-finite gradient, or a failed step */
} zoe_speculation_stats;

#define ZOE_SPECULATION_STATS_INIT                                                     \
  ZOE_LITERAL_(zoe_speculation_stats) {                                                \
    .struct_size = sizeof(zoe_speculation_stats), .steps = 0, .chunks_speculative = 0, \
    .chunks_committed = 0, .chunks_recomputed = 0, .chunks_discarded = 0               \
  }

/* Fills *out (caller-owned) with the group's speculation counts. */
ZOE_API zoe_status zoe_optim_group_speculation_stats(zoe_engine* engine, zoe_group_id group,
                                                     zoe_speculation_stats* out);

/* Copies `count` elements of a state array starting at `offset` out as fp32 (read) or in from
 * fp32 (write; moments are rounded to the group's moment dtype). out / values: borrowed host
 * memory (the device tier's is ZOE_ERR_INVALID_ARGUMENT). */
ZOE_API zoe_status zoe_optim_state_read(zoe_engine* engine, zoe_group_id group, zoe_state_slot slot,
                                        uint64_t offset, uint64_t count, float* out);
ZOE_API zoe_status zoe_optim_state_write(zoe_engine* engine, zoe_group_id group,
                                         zoe_state_slot slot, uint64_t offset, uint64_t count,
                                         const float* values);

/* The group's step count (steps taken, skipped ones excluded), and setting it (for loading a
 * state dict): steps in [0, INT64_MAX - 1], so that the next step's count fits an int64_t;
 * ZOE_ERR_INVALID_ARGUMENT naming that range otherwise. */
ZOE_API zoe_status zoe_optim_group_steps(zoe_engine* engine, zoe_group_id group, int64_t* out);
ZOE_API zoe_status zoe_optim_group_set_steps(zoe_engine* engine, zoe_group_id group, int64_t steps);

/* The step count of each segment of the group (see "segments" in zoe_optim_group_create), and
 * setting them (loading a state dict whose parameters took different numbers of steps; the group's
 * step count becomes the largest). n must be the number of segments (INVALID_ARGUMENT naming it
 * otherwise); out / steps: n entries, borrowed. Setting needs every entry in [0, INT64_MAX - 1].
 * zoe_optim_group_set_steps sets every segment's count too. */
ZOE_API zoe_status zoe_optim_group_segment_steps(zoe_engine* engine, zoe_group_id group,
                                                 int64_t* out, size_t n);
ZOE_API zoe_status zoe_optim_group_set_segment_steps(zoe_engine* engine, zoe_group_id group,
                                                     const int64_t* steps, size_t n);

/* Saves every optimizer group (master, moments, step counts, hyper-parameters) to `dir`,
 * streamed and crash-safe: a process killed during the save leaves the previous checkpoint
 * loadable. A save that does not fit beside the previous checkpoint is ZOE_ERR_NO_SPACE naming
 * `dir`, the bytes needed and the bytes available, and leaves the previous checkpoint as it was
 * (and no partial version behind). Loading verifies every checksum and that the checkpoint is of
 * the same groups (FAILED_PRECONDITION otherwise); on any error the engine's state is unchanged.
 * dir: borrowed. */
ZOE_API zoe_status zoe_checkpoint_save(zoe_engine* engine, const char* dir);
ZOE_API zoe_status zoe_checkpoint_load(zoe_engine* engine, const char* dir);

/* ---------------------------------------------------------------------------------------------
 * Sharded optimizer groups: ZeRO stages 1 and 2 across data-parallel ranks. Each rank has its own
 * engine (its own DRAM budget and NVMe path) and creates the same group in it with the same
 * arguments; the group's elements, concatenated, are cut into world_size contiguous shards and
 * rank r keeps only shard r = [floor(r * count / world_size), floor((r + 1) * count / world_size))
 * (sizes differ by at most one element). Collectives come from the caller's distributed engine.
 * ------------------------------------------------------------------------------------------- */

/* The shard rank keeps of count elements cut among world_size ranks: *begin = floor(rank * count /
 * world_size), *end = floor((rank + 1) * count / world_size), computed without overflow. The one
 * formula of every sharded group and of zoe.torch's sharded parameters (stage 3), so callers cut
 * what zoe cuts. InvalidArgument unless world_size >= 1 and 0 <= rank < world_size, or when begin
 * or end is NULL. */
ZOE_API zoe_status zoe_shard_range(uint64_t count, int32_t rank, int32_t world_size,
                                   uint64_t* begin, uint64_t* end);

/* The caller's collectives, called on the thread that called zoe_sharded_*; every rank calls them
 * in the same order with the same counts. Each returns 0 on success and anything else on failure
 * (the zoe call then fails on that rank with ZOE_ERR_ABORTED naming the callback). The
 * transport's own timeouts bound how long a rank waits for a peer: zoe never waits otherwise, and
 * a rank that fails inside zoe (arguments, I/O, a checksum) still makes every collective call of
 * the step with its failure flag set, so its peers fail too instead of waiting. A callback that
 * fails is different: it means the transport failed, so zoe makes no further collective in that
 * call and returns ABORTED on that rank, while its peers' next collectives pair with the wrong
 * call or wait for the transport's timeout. After a callback failure on any rank, restart every
 * rank and load a checkpoint. counts: world_size entries, borrowed for the
 * call. context: borrowed, passed to every callback; the struct is copied at creation.
 * Sized (convention 8): an input of zoe_sharded_group_create and an output of
 * zoe_nccl_collectives_create. Defaults (ZOE_COLLECTIVES_INIT, and members a smaller struct_size
 * leaves out): context NULL, rank 0, world_size 1, every callback NULL (so each must be given,
 * except broadcast, which is optional). */
typedef struct zoe_collectives {
  size_t struct_size; /* sizeof(zoe_collectives) */
  void* context;
  int32_t rank;       /* in [0, world_size) */
  int32_t world_size; /* >= 1 */
  /* values[i] = sum over ranks of values[i], in place (fp64). */
  int (*all_reduce_sum)(void* context, double* values, size_t count);
  /* send: sum(counts) fp32 elements, rank r's part starting at counts[0] + ... + counts[r - 1];
   * recv (counts[rank] elements) = the sum over ranks of this rank's part. */
  int (*reduce_scatter_sum)(void* context, const float* send, float* recv, const uint64_t* counts);
  /* send (counts[rank] fp32 elements) of every rank, concatenated in rank order into recv. */
  int (*all_gather)(void* context, const float* send, float* recv, const uint64_t* counts);
  int (*barrier)(void* context);
  /* Optional (NULL: the updated parameters are all-gathered through a buffer of zoe's instead).
   * For each i < count: the bytes[i] bytes at data[i] on rank roots[i] are copied to data[i] on
   * every other rank (each rank's own pointer). Every rank passes the same roots and bytes in the
   * same order; roots, data and bytes are borrowed for the call. zoe uses it to move each rank's
   * updated parameters straight into the peers' parameters, in their own dtype. */
  int (*broadcast)(void* context, const int32_t* roots, void* const* data, const uint64_t* bytes,
                   size_t count);
} zoe_collectives;

#define ZOE_COLLECTIVES_INIT                                                                 \
  ZOE_LITERAL_(zoe_collectives) {                                                            \
    .struct_size = sizeof(zoe_collectives), .context = NULL, .rank = 0, .world_size = 1,     \
    .all_reduce_sum = NULL, .reduce_scatter_sum = NULL, .all_gather = NULL, .barrier = NULL, \
    .broadcast = NULL                                                                        \
  }

/* Opaque: one rank's part of a sharded group. Lives until zoe_sharded_group_destroy; the engine
 * must outlive it. */
typedef struct zoe_sharded_group zoe_sharded_group;

/* Creates this rank's part of a sharded group: optim_json as for zoe_optim_group_create
 * ("segments", if given, are the whole group's: rank r's group has one segment per entry, holding
 * its part in shard r, 0 elements when none), params: n views covering the whole group (borrowed
 * for the call; rank r reads only shard r). collectives: borrowed for the call and copied; its
 * context must stay valid until the group is destroyed. Creation is agreed by an all-reduce: when
 * any rank fails every rank fails (ABORTED naming the ranks on the others; a group created on
 * them stays in their engine, as groups do). INVALID_ARGUMENT when a rank would hold no element.
 * On success *out owns the group (destroy with zoe_sharded_group_destroy). */
ZOE_API zoe_status zoe_sharded_group_create(zoe_engine* engine, const char* optim_json,
                                            const zoe_buffer_view* params, size_t n,
                                            const zoe_collectives* collectives,
                                            zoe_sharded_group** out);

/* Frees the handle; the group's state stays in the engine (groups live as long as it). Accepts
 * NULL. */
ZOE_API void zoe_sharded_group_destroy(zoe_sharded_group* group);

/* The id of this rank's group in its engine, for zoe_optim_accumulate_grad (offsets relative to the
 * shard), zoe_optim_state_read/write, step counts and checkpoints; and the shard's elements
 * [*begin, *end) of the whole group (either pointer may be NULL). */
ZOE_API zoe_status zoe_sharded_group_local(zoe_sharded_group* group, zoe_group_id* out_id,
                                           uint64_t* begin, uint64_t* end);

/* One step of every rank together. grads: n_grads views covering the whole group, this rank's
 * gradients (a view with data NULL: no gradient on this rank for whole segments; a segment with no
 * gradient on any rank keeps its state and step count, one with a gradient on some rank counts
 * zeros on the others); they are reduce-scattered and averaged over the ranks. n_grads 0: the
 * shard's gradients given with zoe_optim_accumulate_grad on zoe_sharded_group_local's id (already
 * reduced by the caller). The inf/NaN skip and the gradient norm for max_grad_norm are those of the
 * whole, reduced gradient, agreed by an all-reduce: every rank skips or clips together, and
 * out->grad_norm is the global norm. params_out: n_params views covering the whole group that
 * receive every rank's updated parameters (all-gathered; untouched when the step is skipped); or
 * views covering only this rank's shard [begin, end) of
 * zoe_sharded_group_local, which receive its own updated values and nothing gathered (the caller
 * gathers them, e.g. on the device holding the model; segments without a gradient are left as
 * they were); or n_params 0. Every rank passes the same kind. On failure every rank fails: the rank
 * that failed with its own error, the others ABORTED naming it. A failure before the update (bad
 * arguments on a rank) changes no rank's state; one during the update (an I/O error) leaves that
 * rank's state as before and the others' updated: resume from a checkpoint. Every rank passes
 * gradients or none, and parameters or none. */
ZOE_API zoe_status zoe_sharded_step(zoe_engine* engine, zoe_sharded_group* group,
                                    const zoe_hyper_params* hyper, const zoe_buffer_view* grads,
                                    size_t n_grads, const zoe_buffer_view* params_out,
                                    size_t n_params, double loss_scale, zoe_step_result* out);

/* Fills *out with collectives over an NCCL communicator the caller created (nccl_comm: an
 * ncclComm_t; cuda_stream: a cudaStream_t, NULL for the default stream), staging the host buffers
 * through device memory. out->struct_size must cover every member of this version (they are all
 * needed to use or release the collectives; INVALID_ARGUMENT otherwise). out->context is owned by
 * zoe: release it with zoe_nccl_collectives_destroy after the last group using it is destroyed.
 * libzoe does not link NCCL: it uses the libnccl.so.2 already in the process (the one the caller's
 * communicator came from), else the path in the environment variable ZOE_NCCL_LIBRARY, else the
 * dynamic loader's search. NOT_SUPPORTED when libzoe was built without NCCL or no libnccl.so.2 can
 * be loaded. */
ZOE_API zoe_status zoe_nccl_collectives_create(void* nccl_comm, void* cuda_stream,
                                               zoe_collectives* out);
/* Releases what zoe_nccl_collectives_create allocated (not the communicator) and sets
 * collectives->context to NULL. Accepts NULL, and a struct whose struct_size does not cover
 * context. */
ZOE_API void zoe_nccl_collectives_destroy(zoe_collectives* collectives);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* ZOE_H_ */
