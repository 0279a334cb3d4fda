"""zoe's NCCL collectives on a real GPU (run where torch sees one and libnccl.so.2 is in the
process, as torch's CUDA build loads it; skipped elsewhere): zoe_nccl_collectives_create over a
communicator made with ncclCommInitAll on device 0, and each callback moving real data through
device memory. One device gives a world of one rank (NCCL refuses two ranks on one GPU), so the
reductions return their input; what is tested is that libzoe finds NCCL at run time, stages the
buffers and waits for the stream."""

import ctypes
from ctypes import byref, c_double, c_float, c_int, c_uint64, c_void_p

import pytest
import torch

import zoe
from zoe import _capi
from zoe.errors import check

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device visible to torch"
)


@pytest.fixture
def communicator():
    torch.cuda.init()  # loads torch's libnccl.so.2 (a dependency of its CUDA library)
    nccl = ctypes.CDLL("libnccl.so.2")
    comm = c_void_p()
    devices = (c_int * 1)(0)
    assert nccl.ncclCommInitAll(byref(comm), 1, devices) == 0
    yield comm
    nccl.ncclCommDestroy(comm)


def test_nccl_collectives_move_data_through_the_device(communicator):
    collectives = _capi.zoe_collectives()
    status = _capi.zoe_nccl_collectives_create(communicator, None, byref(collectives))
    if status == _capi.Status.NOT_SUPPORTED:
        pytest.fail(f"libzoe.so has no NCCL collectives: {_capi.zoe_last_error().decode()}")
    check(status, "zoe_nccl_collectives_create")
    try:
        assert (collectives.rank, collectives.world_size) == (0, 1)
        context = collectives.context
        values = (c_double * 3)(1.5, -2.0, 1e300)
        assert collectives.all_reduce_sum(context, values, 3) == 0
        assert list(values) == [1.5, -2.0, 1e300]
        counts = (c_uint64 * 1)(1000)
        send = (c_float * 1000)(*[float(i) * 0.5 for i in range(1000)])
        recv = (c_float * 1000)()
        assert collectives.reduce_scatter_sum(context, send, recv, counts) == 0
        assert list(recv) == list(send)
        gathered = (c_float * 1000)()
        assert collectives.all_gather(context, send, gathered, counts) == 0
        assert list(gathered) == list(send)
        assert collectives.barrier(context) == 0
    finally:
        _capi.zoe_nccl_collectives_destroy(byref(collectives))
    assert zoe.version()
