"""Shared by zoe.torch's optimizers and parameter paging: dtype tables and small helpers."""

import torch

from . import _capi
from .engine import BufferView
from .errors import InvalidArgument

_DTYPES = {
    torch.float32: _capi.DType.FLOAT32,
    torch.bfloat16: _capi.DType.BFLOAT16,
    torch.float16: _capi.DType.FLOAT16,
}

_PAGED_DTYPES = {
    **_DTYPES,
    torch.float64: _capi.DType.FLOAT64,
    torch.int64: _capi.DType.INT64,
    torch.int32: _capi.DType.INT32,
    torch.int8: _capi.DType.INT8,
    torch.uint8: _capi.DType.UINT8,
    torch.bool: _capi.DType.BOOL,
}


def _invalid(message):
    return InvalidArgument(_capi.Status.INVALID_ARGUMENT, message)


def _view(tensor):
    """A BufferView of a contiguous CPU tensor (borrowed: keep the tensor alive)."""
    return BufferView(tensor.data_ptr(), _DTYPES[tensor.dtype], tensor.numel())


def _pager_of(param):
    """The ParameterPager paging a parameter, or None."""
    return getattr(param, "_zoe_pager", None)
