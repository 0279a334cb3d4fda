"""zoe: a ZeRO-Infinity-style offload engine (ctypes binding of libzoe.so).

``zoe.Engine`` drives the C API; ``zoe.torch`` (imported on demand, it needs torch) provides
optimizers and parameter paging for PyTorch.
"""

from ._capi import Access, DType, StateSlot, Tier
from .engine import (
    BufferView,
    Engine,
    HyperParams,
    OptimizerGroup,
    StepResult,
    Tensor,
    check_config,
    shard_range,
    version,
)
from .errors import (
    Aborted,
    Busy,
    Corruption,
    Error,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    IoError,
    NoSpace,
    NotFound,
    NotSupported,
    OutOfMemory,
    PermissionDenied,
)

__all__ = [
    "Aborted", "Access", "BufferView", "Busy", "Corruption", "DType", "Engine", "Error",
    "FailedPrecondition", "HyperParams", "Internal", "InvalidArgument", "IoError", "NoSpace",
    "NotFound", "NotSupported", "OptimizerGroup", "OutOfMemory", "PermissionDenied",
    "StateSlot", "StepResult", "Tensor", "Tier", "check_config", "shard_range", "version",
]
