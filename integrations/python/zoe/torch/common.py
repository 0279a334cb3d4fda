"""Shared by zoe.torch's optimizers and parameter paging: dtype tables and small helpers (a
parameter's values, paged or not; process groups held weakly; timing)."""

import contextlib
import hashlib
import operator
import os
import time
import weakref

import torch

from .. import _capi
from ..engine import BufferView
from ..errors import FailedPrecondition, InvalidArgument

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


def fsync_path(path):
    """fsync of one file or directory (a directory's entries are durable once it is synced)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def replace_atomically(path, write):
    """Replaces ``path`` by the file ``write(file)`` writes into a binary file object: a reader
    sees the old or the new whole, and a write that fails leaves the old file and no temporary
    one."""
    temporary = f"{path}.tmp"
    try:
        with open(temporary, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise
    fsync_path(os.path.dirname(os.path.abspath(path)))


class TorchFileWriter:
    """A binary file as torch.save writes it: a write or flush that fails (ENOSPC) is kept and
    every later one does nothing, so that torch's zip writer finishes (torch 1.13's aborts the
    process when a write raises: its C++ destructor throws), and save() raises it afterwards.
    Counts and hashes (sha256) what was written."""

    def __init__(self, file):
        self._file = file
        self.error = None
        self.written = 0
        self._hash = hashlib.sha256()

    def write(self, data):
        size = memoryview(data).nbytes
        if self.error is None:
            try:
                self._file.write(data)
            except BaseException as error:  # raised by save(), after torch's writer finished
                self.error = error
            else:
                self._hash.update(data)
                self.written += size
        return size

    def flush(self):
        if self.error is None:
            try:
                self._file.flush()
            except BaseException as error:
                self.error = error

    def save(self, value):
        """torch.save of ``value`` into the file; (bytes written, sha256 hex digest), or the
        first error of the file."""
        torch.save(value, self)
        if self.error is not None:
            raise self.error
        return self.written, self._hash.hexdigest()


def _invalid(message):
    return InvalidArgument(_capi.Status.INVALID_ARGUMENT, message)


def whole_count(value, name, meaning):
    """``value`` as an int >= 0: an integer of any kind (numpy's included) or a float with no
    fraction (DeepSpeed's configurations write sizes as 5e8); InvalidArgument naming ``name``
    otherwise, ``meaning`` saying what the count is."""
    if not isinstance(value, bool):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        try:
            count = operator.index(value)
        except TypeError:
            count = -1
        if count >= 0:
            return count
    raise _invalid(f"{name} = {value!r} is not allowed; allowed: an integer >= 0 ({meaning})")


def _view(tensor):
    """A BufferView of a contiguous CPU tensor (borrowed: keep the tensor alive)."""
    return BufferView(tensor.data_ptr(), _DTYPES[tensor.dtype], tensor.numel())


def check_nccl_device(device, subject, before):
    """InvalidArgument unless the CUDA ``device`` of ``subject`` is the current one, which NCCL
    works on (DeepSpeed sets it from LOCAL_RANK; zoe leaves it to the script); the message says
    to call torch.cuda.set_device ``before`` ("before creating the optimizer")."""
    current = torch.device("cuda", torch.cuda.current_device())
    if device != current:
        raise _invalid(
            f"{subject} is on {device} and NCCL works on the current CUDA device, {current}: "
            f"call torch.cuda.set_device({device.index}) (each rank's own GPU, e.g. "
            f"int(os.environ['LOCAL_RANK'])) {before}")


def _pager_of(param):
    """The ParameterPager paging a parameter, or None."""
    return getattr(param, "_zoe_pager", None)


def _weak_group(process_group):
    """A weak reference to a torch.distributed process group, how zoe objects hold one: they
    never keep it alive past destroy_process_group(). A gloo group kept alive into interpreter
    shutdown has worker threads that abort the process there ("terminate called without an
    active exception") when they release a finished collective's tensor, which takes the GIL."""
    return weakref.ref(process_group)


def _live_group(group_ref, user):
    """The group ``group_ref`` (_weak_group) refers to; FailedPrecondition naming ``user`` once
    destroy_process_group() ended it."""
    group = group_ref()
    if group is None:
        raise FailedPrecondition(
            _capi.Status.FAILED_PRECONDITION,
            f"the process group of {user} was destroyed (torch.distributed."
            "destroy_process_group); its collectives need a live group: create it again after "
            "init_process_group",
        )
    return group


@contextlib.contextmanager
def _timed(owner, seconds, calls=None):
    """Adds the wall time of the enclosed block to ``owner``'s attribute named ``seconds`` and,
    when ``calls`` names another, counts the block there; both also when the block raises."""
    start = time.perf_counter()
    try:
        yield
    finally:
        setattr(owner, seconds, getattr(owner, seconds) + time.perf_counter() - start)
        if calls is not None:
            setattr(owner, calls, getattr(owner, calls) + 1)


def _current_values(param):
    """A parameter's values as a contiguous CPU tensor (a copy, from host memory, for a paged
    parameter)."""
    pager = _pager_of(param)
    if pager is None:
        return param.detach().cpu()
    with pager.held_on_host(param, _capi.Access.READ) as view:
        return view.clone()


def _in_host_memory(param):
    """Whether zoe may read and write a parameter's memory itself, as a host buffer: a CPU
    parameter, or a paged one, through ``_writable`` (pager.held_on_host: its HOST copy, also
    when the pager's tier is DEVICE, whose memory is a GPU's or, on the CPU twin, the host
    stand-in's, which zoe refuses as a host buffer as it would a GPU's). A parameter left on a
    GPU is not."""
    return _pager_of(param) is not None or param.device.type == "cpu"


@contextlib.contextmanager
def _writable(param):
    """The tensor to write a parameter's new values into (a paged one's HOST copy, acquired
    for writing)."""
    pager = _pager_of(param)
    if pager is None:
        yield param.detach()
        return
    with pager.held_on_host(param, _capi.Access.WRITE) as view:
        yield view
