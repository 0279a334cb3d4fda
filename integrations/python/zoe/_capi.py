"""ctypes declarations of zoe.h, one per C function, each under a comment quoting its prototype.

Nothing here checks statuses or converts values: that is ``errors.check`` and ``engine.py``.
The declarations bind lazily, on their first call, so ``import zoe`` works before the library
is built; a test compares every declaration with the header (names, argument counts and the
quoted prototypes).
"""

import ctypes
import enum
from ctypes import (
    POINTER,
    Structure,
    c_char_p,
    c_double,
    c_int,
    c_int32,
    c_int64,
    c_size_t,
    c_uint32,
    c_uint64,
    c_void_p,
)

from . import _library

# --- enums (numbers are part of the ABI) -------------------------------------------------------


class Status(enum.IntEnum):
    """zoe_status."""

    OK = 0
    INVALID_ARGUMENT = 1
    NOT_FOUND = 2
    IO = 3
    NO_SPACE = 4
    CORRUPTION = 5
    OUT_OF_MEMORY = 6
    NOT_SUPPORTED = 7
    FAILED_PRECONDITION = 8
    BUSY = 9
    PERMISSION_DENIED = 10
    ABORTED = 11
    INTERNAL = 12


class Tier(enum.IntEnum):
    """zoe_tier."""

    DEVICE = 0
    HOST = 1
    NVME = 2


class Access(enum.IntEnum):
    """zoe_access."""

    READ = 0
    WRITE = 1
    READ_WRITE = 2


class DType(enum.IntEnum):
    """zoe_dtype."""

    FLOAT32 = 0
    FLOAT16 = 1
    BFLOAT16 = 2
    INT8 = 3
    UINT8 = 4
    INT32 = 5
    INT64 = 6
    FLOAT64 = 7
    BOOL = 8
    FLOAT8_E4M3 = 9
    FLOAT8_E5M2 = 10


DTYPE_SIZES = {
    DType.FLOAT32: 4,
    DType.FLOAT16: 2,
    DType.BFLOAT16: 2,
    DType.INT8: 1,
    DType.UINT8: 1,
    DType.INT32: 4,
    DType.INT64: 8,
    DType.FLOAT64: 8,
    DType.BOOL: 1,
    DType.FLOAT8_E4M3: 1,
    DType.FLOAT8_E5M2: 1,
}


class StateSlot(enum.IntEnum):
    """zoe_state_slot."""

    MASTER = 0
    EXP_AVG = 1
    EXP_AVG_SQ = 2


# Enums travel as C ints.
zoe_status = c_int
zoe_tier = c_int
zoe_access = c_int
zoe_dtype = c_int
zoe_state_slot = c_int
zoe_tensor_id = c_uint32
zoe_group_id = c_uint32

# What an id out-parameter holds after a failure (ZOE_TENSOR_ID_INVALID, ZOE_GROUP_ID_INVALID).
TENSOR_ID_INVALID = 0xFFFFFFFF
GROUP_ID_INVALID = 0xFFFFFFFF

# --- structs -----------------------------------------------------------------------------------


class zoe_engine(Structure):
    """Opaque: only pointers to it exist."""


zoe_engine_p = POINTER(zoe_engine)


class SizedStructure(Structure):
    """A struct of zoe.h that starts with ``size_t struct_size`` (zoe.h, convention 8).

    The one place Python fills it: every instance starts with ``struct_size`` =
    ``ctypes.sizeof`` of its class, and positional arguments fill the members after it, so
    ``zoe_hyper_params(lr, beta1, ...)`` is ``ZOE_HYPER_PARAMS_INIT`` with those members set.
    Members not given are zero, not the INIT macro's defaults: give every input member."""

    def __init__(self, *args, **kwargs):
        super().__init__(ctypes.sizeof(type(self)), *args, **kwargs)


class zoe_tensor_desc(SizedStructure):
    """struct zoe_tensor_desc."""

    _fields_ = [
        ("struct_size", c_size_t),
        ("name", c_char_p),
        ("bytes", c_uint64),
        ("dtype", zoe_dtype),
        ("home", zoe_tier),
        ("group", c_char_p),
    ]


class zoe_buffer_view(Structure):
    """struct zoe_buffer_view: an array element, not sized (zoe.h, convention 8)."""

    _fields_ = [("data", c_void_p), ("dtype", zoe_dtype), ("count", c_uint64)]


class zoe_hyper_params(SizedStructure):
    """struct zoe_hyper_params: Python's one definition of the hyper-parameters
    (``zoe.HyperParams`` is made from its members and these defaults)."""

    _fields_ = [
        ("struct_size", c_size_t),
        ("lr", c_double),
        ("beta1", c_double),
        ("beta2", c_double),
        ("eps", c_double),
        ("weight_decay", c_double),
    ]
    # ZOE_HYPER_PARAMS_INIT's values (tests/test_capi_header.py checks them against zoe.h).
    DEFAULTS = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0}


class zoe_step_result(SizedStructure):
    """struct zoe_step_result."""

    _fields_ = [
        ("struct_size", c_size_t),
        ("skipped", c_int32),
        ("grad_norm", c_double),
        ("steps_taken", c_int64),
        ("bytes_read", c_uint64),
        ("bytes_written", c_uint64),
        ("seconds", c_double),
    ]


class zoe_speculation_stats(SizedStructure):
    """struct zoe_speculation_stats."""

    _fields_ = [
        ("struct_size", c_size_t),
        ("steps", c_uint64),
        ("chunks_speculative", c_uint64),
        ("chunks_committed", c_uint64),
        ("chunks_recomputed", c_uint64),
        ("chunks_discarded", c_uint64),
    ]


# --- functions ---------------------------------------------------------------------------------

DECLARATIONS = {}


class _Function:
    """A C function of libzoe, bound to the library on its first call."""

    def __init__(self, name, restype, argtypes):
        self.name = name
        self.restype = restype
        self.argtypes = list(argtypes)
        self._bound = None

    def _bind(self):
        library = _library.load()
        try:
            function = getattr(library, self.name)
        except AttributeError:
            raise OSError(
                f"zoe: the loaded libzoe.so ({library._name}) does not export {self.name}; "
                "it is older than this binding -- rebuild it"
            ) from None
        function.restype = self.restype
        function.argtypes = self.argtypes
        self._bound = function
        return function

    def __call__(self, *args):
        function = self._bound or self._bind()
        return function(*args)


def _declare(name, restype, *argtypes):
    function = _Function(name, restype, argtypes)
    DECLARATIONS[name] = function
    return function


# const char* zoe_version(void);
zoe_version = _declare("zoe_version", c_char_p)

# const char* zoe_status_string(zoe_status status);
zoe_status_string = _declare("zoe_status_string", c_char_p, zoe_status)

# const char* zoe_last_error(void);
zoe_last_error = _declare("zoe_last_error", c_char_p)

# void zoe_free(void* ptr);
zoe_free = _declare("zoe_free", None, c_void_p)

# zoe_status zoe_engine_create(const char* config_json, zoe_engine** out);
zoe_engine_create = _declare(
    "zoe_engine_create", zoe_status, c_char_p, POINTER(zoe_engine_p)
)

# zoe_status zoe_config_check(const char* config_json, char** out_warnings_json);
zoe_config_check = _declare("zoe_config_check", zoe_status, c_char_p, POINTER(c_void_p))
# zoe_status zoe_config_normalize(const char* config_json, char** out_json);
zoe_config_normalize = _declare("zoe_config_normalize", zoe_status, c_char_p, POINTER(c_void_p))

# void zoe_engine_destroy(zoe_engine* engine);
zoe_engine_destroy = _declare("zoe_engine_destroy", None, zoe_engine_p)

# zoe_status zoe_engine_async_error(zoe_engine* engine);
zoe_engine_async_error = _declare("zoe_engine_async_error", zoe_status, zoe_engine_p)

# zoe_status zoe_engine_flush(zoe_engine* engine);
zoe_engine_flush = _declare("zoe_engine_flush", zoe_status, zoe_engine_p)

# zoe_status zoe_engine_stats_json(zoe_engine* engine, char** out_json);
zoe_engine_stats_json = _declare(
    "zoe_engine_stats_json", zoe_status, zoe_engine_p, POINTER(c_void_p)
)

# zoe_status zoe_engine_config_json(zoe_engine* engine, char** out_json);
zoe_engine_config_json = _declare(
    "zoe_engine_config_json", zoe_status, zoe_engine_p, POINTER(c_void_p)
)

# zoe_status zoe_tensor_register(zoe_engine* engine, const zoe_tensor_desc* desc,
#                                zoe_tensor_id* out);
zoe_tensor_register = _declare(
    "zoe_tensor_register",
    zoe_status,
    zoe_engine_p,
    POINTER(zoe_tensor_desc),
    POINTER(zoe_tensor_id),
)

# zoe_status zoe_tensor_find(zoe_engine* engine, const char* name, zoe_tensor_id* out);
zoe_tensor_find = _declare(
    "zoe_tensor_find", zoe_status, zoe_engine_p, c_char_p, POINTER(zoe_tensor_id)
)

# zoe_status zoe_tensor_acquire(zoe_engine* engine, zoe_tensor_id tensor, zoe_tier tier,
#                               zoe_access access, void** out_ptr);
zoe_tensor_acquire = _declare(
    "zoe_tensor_acquire",
    zoe_status,
    zoe_engine_p,
    zoe_tensor_id,
    zoe_tier,
    zoe_access,
    POINTER(c_void_p),
)

# zoe_status zoe_tensor_release(zoe_engine* engine, zoe_tensor_id tensor);
zoe_tensor_release = _declare("zoe_tensor_release", zoe_status, zoe_engine_p, zoe_tensor_id)

# zoe_status zoe_tensor_prefetch(zoe_engine* engine, zoe_tensor_id tensor, zoe_tier tier);
zoe_tensor_prefetch = _declare(
    "zoe_tensor_prefetch", zoe_status, zoe_engine_p, zoe_tensor_id, zoe_tier
)

# zoe_status zoe_tensor_evict(zoe_engine* engine, zoe_tensor_id tensor);
zoe_tensor_evict = _declare("zoe_tensor_evict", zoe_status, zoe_engine_p, zoe_tensor_id)

# zoe_status zoe_trace_begin(zoe_engine* engine, const char* name);
zoe_trace_begin = _declare("zoe_trace_begin", zoe_status, zoe_engine_p, c_char_p)

# zoe_status zoe_trace_end(zoe_engine* engine);
zoe_trace_end = _declare("zoe_trace_end", zoe_status, zoe_engine_p)

# zoe_status zoe_trace_save(zoe_engine* engine, const char* name, const char* path);
zoe_trace_save = _declare("zoe_trace_save", zoe_status, zoe_engine_p, c_char_p, c_char_p)

# zoe_status zoe_trace_load(zoe_engine* engine, const char* path, char** out_name);
zoe_trace_load = _declare(
    "zoe_trace_load", zoe_status, zoe_engine_p, c_char_p, POINTER(c_void_p)
)

# zoe_status zoe_optim_group_create(zoe_engine* engine, const char* optim_json,
#                                   const zoe_buffer_view* params, size_t n,
#                                   zoe_group_id* out);
zoe_optim_group_create = _declare(
    "zoe_optim_group_create",
    zoe_status,
    zoe_engine_p,
    c_char_p,
    POINTER(zoe_buffer_view),
    c_size_t,
    POINTER(zoe_group_id),
)

# zoe_status zoe_optim_step(zoe_engine* engine, zoe_group_id group,
#                           const zoe_hyper_params* hyper, const zoe_buffer_view* grads,
#                           size_t n_grads, const zoe_buffer_view* params_out,
#                           size_t n_params, double loss_scale, zoe_step_result* out);
zoe_optim_step = _declare(
    "zoe_optim_step",
    zoe_status,
    zoe_engine_p,
    zoe_group_id,
    POINTER(zoe_hyper_params),
    POINTER(zoe_buffer_view),
    c_size_t,
    POINTER(zoe_buffer_view),
    c_size_t,
    c_double,
    POINTER(zoe_step_result),
)

# zoe_status zoe_optim_accumulate_grad(zoe_engine* engine, zoe_group_id group,
#                                      uint64_t offset, const zoe_buffer_view* grad);
zoe_optim_accumulate_grad = _declare(
    "zoe_optim_accumulate_grad",
    zoe_status,
    zoe_engine_p,
    zoe_group_id,
    c_uint64,
    POINTER(zoe_buffer_view),
)

# zoe_status zoe_optim_discard_grads(zoe_engine* engine, zoe_group_id group);
zoe_optim_discard_grads = _declare(
    "zoe_optim_discard_grads",
    zoe_status,
    zoe_engine_p,
    zoe_group_id,
)

# zoe_status zoe_optim_grad_sum_squares(zoe_engine* engine, zoe_group_id group, double* out);
zoe_optim_grad_sum_squares = _declare(
    "zoe_optim_grad_sum_squares",
    zoe_status,
    zoe_engine_p,
    zoe_group_id,
    POINTER(c_double),
)

# zoe_status zoe_optim_state_read(zoe_engine* engine, zoe_group_id group,
#                                 zoe_state_slot slot, uint64_t offset, uint64_t count,
#                                 float* out);
zoe_optim_state_read = _declare(
    "zoe_optim_state_read",
    zoe_status,
    zoe_engine_p,
    zoe_group_id,
    zoe_state_slot,
    c_uint64,
    c_uint64,
    c_void_p,
)

# zoe_status zoe_optim_state_write(zoe_engine* engine, zoe_group_id group,
#                                  zoe_state_slot slot, uint64_t offset, uint64_t count,
#                                  const float* values);
zoe_optim_state_write = _declare(
    "zoe_optim_state_write",
    zoe_status,
    zoe_engine_p,
    zoe_group_id,
    zoe_state_slot,
    c_uint64,
    c_uint64,
    c_void_p,
)

# zoe_status zoe_optim_group_steps(zoe_engine* engine, zoe_group_id group, int64_t* out);
zoe_optim_group_steps = _declare(
    "zoe_optim_group_steps", zoe_status, zoe_engine_p, zoe_group_id, POINTER(c_int64)
)

# zoe_status zoe_optim_group_set_steps(zoe_engine* engine, zoe_group_id group,
#                                      int64_t steps);
zoe_optim_group_set_steps = _declare(
    "zoe_optim_group_set_steps", zoe_status, zoe_engine_p, zoe_group_id, c_int64
)

# zoe_status zoe_optim_group_segment_steps(zoe_engine* engine, zoe_group_id group,
#                                          int64_t* out, size_t n);
zoe_optim_group_segment_steps = _declare(
    "zoe_optim_group_segment_steps", zoe_status, zoe_engine_p, zoe_group_id, POINTER(c_int64),
    c_size_t
)

# zoe_status zoe_optim_group_set_segment_steps(zoe_engine* engine, zoe_group_id group,
#                                              const int64_t* steps, size_t n);
zoe_optim_group_set_segment_steps = _declare(
    "zoe_optim_group_set_segment_steps", zoe_status, zoe_engine_p, zoe_group_id,
    POINTER(c_int64), c_size_t
)

# zoe_status zoe_optim_speculate(zoe_engine* engine, zoe_group_id group,
#                                const zoe_hyper_params* hyper,
#                                const zoe_buffer_view* params_out, size_t n_params,
#                                double loss_scale);
zoe_optim_speculate = _declare(
    "zoe_optim_speculate", zoe_status, zoe_engine_p, zoe_group_id, POINTER(zoe_hyper_params),
    POINTER(zoe_buffer_view), c_size_t, c_double
)

# zoe_status zoe_optim_group_speculation_stats(zoe_engine* engine, zoe_group_id group,
#                                              zoe_speculation_stats* out);
zoe_optim_group_speculation_stats = _declare(
    "zoe_optim_group_speculation_stats", zoe_status, zoe_engine_p, zoe_group_id,
    POINTER(zoe_speculation_stats)
)

# zoe_status zoe_checkpoint_save(zoe_engine* engine, const char* dir);
zoe_checkpoint_save = _declare("zoe_checkpoint_save", zoe_status, zoe_engine_p, c_char_p)

# zoe_status zoe_checkpoint_load(zoe_engine* engine, const char* dir);
zoe_checkpoint_load = _declare("zoe_checkpoint_load", zoe_status, zoe_engine_p, c_char_p)


# ---- sharded optimizer groups ----------------------------------------------------------------

# int (*all_reduce_sum)(void* context, double* values, size_t count);
all_reduce_sum_fn = ctypes.CFUNCTYPE(c_int, c_void_p, POINTER(c_double), c_size_t)
# int (*reduce_scatter_sum)(void* context, const float* send, float* recv, const uint64_t* counts);
reduce_scatter_sum_fn = ctypes.CFUNCTYPE(c_int, c_void_p, c_void_p, c_void_p, POINTER(c_uint64))
# int (*all_gather)(void* context, const float* send, float* recv, const uint64_t* counts);
all_gather_fn = ctypes.CFUNCTYPE(c_int, c_void_p, c_void_p, c_void_p, POINTER(c_uint64))
# int (*barrier)(void* context);
barrier_fn = ctypes.CFUNCTYPE(c_int, c_void_p)
# int (*broadcast)(void* context, const int32_t* roots, void* const* data, const uint64_t* bytes,
#                  size_t count);  (optional: NULL, an empty broadcast_fn())
broadcast_fn = ctypes.CFUNCTYPE(c_int, c_void_p, POINTER(c_int32), POINTER(c_void_p),
                                POINTER(c_uint64), c_size_t)


class zoe_collectives(SizedStructure):
    """struct zoe_collectives."""

    _fields_ = [
        ("struct_size", c_size_t),
        ("context", c_void_p),
        ("rank", c_int32),
        ("world_size", c_int32),
        ("all_reduce_sum", all_reduce_sum_fn),
        ("reduce_scatter_sum", reduce_scatter_sum_fn),
        ("all_gather", all_gather_fn),
        ("barrier", barrier_fn),
        ("broadcast", broadcast_fn),
    ]


zoe_sharded_group_p = c_void_p

# zoe_status zoe_sharded_group_create(zoe_engine* engine, const char* optim_json,
#                                     const zoe_buffer_view* params, size_t n,
#                                     const zoe_collectives* collectives,
#                                     zoe_sharded_group** out);
zoe_sharded_group_create = _declare(
    "zoe_sharded_group_create", zoe_status, zoe_engine_p, c_char_p, POINTER(zoe_buffer_view),
    c_size_t, POINTER(zoe_collectives), POINTER(zoe_sharded_group_p)
)

# void zoe_sharded_group_destroy(zoe_sharded_group* group);
zoe_sharded_group_destroy = _declare("zoe_sharded_group_destroy", None, zoe_sharded_group_p)

# zoe_status zoe_shard_range(uint64_t count, int32_t rank, int32_t world_size, uint64_t* begin,
#                            uint64_t* end);
zoe_shard_range = _declare(
    "zoe_shard_range", zoe_status, c_uint64, c_int32, c_int32, POINTER(c_uint64), POINTER(c_uint64)
)

# zoe_status zoe_sharded_group_local(zoe_sharded_group* group, zoe_group_id* out_id,
#                                    uint64_t* begin, uint64_t* end);
zoe_sharded_group_local = _declare(
    "zoe_sharded_group_local", zoe_status, zoe_sharded_group_p, POINTER(zoe_group_id),
    POINTER(c_uint64), POINTER(c_uint64)
)

# zoe_status zoe_sharded_step(zoe_engine* engine, zoe_sharded_group* group,
#                             const zoe_hyper_params* hyper, const zoe_buffer_view* grads,
#                             size_t n_grads, const zoe_buffer_view* params_out,
#                             size_t n_params, double loss_scale, zoe_step_result* out);
zoe_sharded_step = _declare(
    "zoe_sharded_step", zoe_status, zoe_engine_p, zoe_sharded_group_p, POINTER(zoe_hyper_params),
    POINTER(zoe_buffer_view), c_size_t, POINTER(zoe_buffer_view), c_size_t, c_double,
    POINTER(zoe_step_result)
)

# zoe_status zoe_nccl_collectives_create(void* nccl_comm, void* cuda_stream,
#                                        zoe_collectives* out);
zoe_nccl_collectives_create = _declare(
    "zoe_nccl_collectives_create", zoe_status, c_void_p, c_void_p, POINTER(zoe_collectives)
)

# void zoe_nccl_collectives_destroy(zoe_collectives* collectives);
zoe_nccl_collectives_destroy = _declare(
    "zoe_nccl_collectives_destroy", None, POINTER(zoe_collectives)
)


def take_string(pointer):
    """Decodes a char* that zoe returned as "free with zoe_free", then frees it."""
    if not pointer:
        return None
    try:
        return ctypes.string_at(pointer).decode("utf-8")
    finally:
        zoe_free(pointer)


