"""ZeRO's collectives and sharding: the shard formula (shard_bounds, the one place it is
written), zoe_collectives over a torch.distributed process group (TorchCollectives) and one
rank's part of a sharded zoe optimizer group (ShardedGroup)."""

import contextlib
import ctypes
import json
import weakref

import torch
import torch.distributed as dist

from .. import _capi
from .._collective_ops import (agreed, broadcast_pieces, gather_parts, reduce_parts,
                              transport_failure_aborted)
from ..engine import OptimizerGroup, StepResult, _c_hyper_params, _views, shard_range
from ..errors import check
from .common import _live_group, _timed, _weak_group

DEFAULT_BUCKET_ELEMENTS = 1 << 22
REDUCTIONS_IN_FLIGHT = 2  # gradient buckets being summed while backward goes on


class ReductionsInFlight:
    """Gradient reductions started in the background, oldest first, at most ``limit`` at once:
    starting one more finishes the oldest (backward goes on while the others run). Every rank
    starts and finishes the same ones in the same order, so their collectives stay paired."""

    def __init__(self, limit=REDUCTIONS_IN_FLIGHT):
        self.limit = limit
        self._items = []

    def __len__(self):
        return len(self._items)

    def add(self, item, finish):
        """Keeps ``item`` (a started reduction); ``finish(oldest)`` for those past the limit."""
        self._items.append(item)
        while len(self._items) > self.limit:
            finish(self._items.pop(0))

    def finish_oldest(self, finish):
        """``finish(oldest)`` (removed first); False when there is none."""
        if not self._items:
            return False
        finish(self._items.pop(0))
        return True

    def finish_all(self, finish):
        """``finish(item)`` for every one, oldest first (each removed before it is finished, so
        one that raises is not finished twice)."""
        while self._items:
            finish(self._items.pop(0))

    def take(self, wanted=lambda item: True):
        """Forgets those ``wanted(item)`` and returns them, oldest first (to wait on without
        finishing)."""
        taken = [item for item in self._items if wanted(item)]
        self._items = [item for item in self._items if not wanted(item)]
        return taken


def shard_bounds(numel, rank, world_size):
    """[begin, end) of rank's contiguous shard of ``numel`` elements cut into ``world_size``
    shards: shard r = [floor(r * numel / world_size), floor((r + 1) * numel / world_size)), as
    the library cuts (zoe.shard_range, zoe_shard_range: the formula is written once, in C++)."""
    return shard_range(numel, rank, world_size)


def shard_boundaries(numel, world_size):
    """The world_size + 1 boundaries of the shards of ``numel`` elements: shard r is
    [boundaries[r], boundaries[r + 1])."""
    return [shard_bounds(numel, rank, world_size)[0] for rank in range(world_size)] + [numel]


def shard_counts(numel, world_size):
    """Every rank's shard size of ``numel`` elements, in rank order (shard_bounds)."""
    return [end - begin for begin, end in
            (shard_bounds(numel, rank, world_size) for rank in range(world_size))]


def _floats(address, count, ctype=ctypes.c_float, dtype=torch.float32):
    """A tensor over ``count`` elements at ``address`` (no copy)."""
    if count == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer((ctype * count).from_address(address), dtype=dtype)


class TorchCollectives:
    """zoe_collectives over a torch.distributed process group. The callbacks run on the thread
    that steps (zoe calls them from zoe_sharded_*); an exception in one is kept in ``error`` and
    reported to zoe as a failure (zoe then fails the step on this rank). ``seconds`` and
    ``calls`` count the wall time spent inside its (blocking) collectives and how many ran.

    Lifetime: the process group is held weakly, so destroy_process_group() ends it even while an
    optimizer still exists (a collective afterwards raises FailedPrecondition). A group kept alive
    past it would keep its transport's threads running into interpreter shutdown, where a gloo
    worker that releases a finished collective's tensor needs the GIL and aborts the process
    ("terminate called without an active exception"). The C callbacks hold this object weakly
    too, so it forms no reference cycle and goes with its optimizer."""

    def __init__(self, process_group):
        self._group = _weak_group(process_group)
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        backend = dist.get_backend(process_group)
        self._device = torch.device("cuda") if backend == "nccl" else torch.device("cpu")
        self.error = None
        self.seconds = 0.0
        self.calls = 0
        self._scratch = {}  # (purpose, element count) -> a buffer reused by every call
        self._callbacks = (
            _capi.all_reduce_sum_fn(self._guarded(TorchCollectives._all_reduce_sum)),
            _capi.reduce_scatter_sum_fn(self._guarded(TorchCollectives._reduce_scatter_sum)),
            _capi.all_gather_fn(self._guarded(TorchCollectives._all_gather)),
            _capi.barrier_fn(self._guarded(TorchCollectives._barrier)),
            _capi.broadcast_fn(self._guarded(TorchCollectives._broadcast))
            if self._offers_broadcast() else _capi.broadcast_fn(),  # NULL: the all-gather
        )
        self.struct = _capi.zoe_collectives(None, self.rank, self.world_size, *self._callbacks)

    def _offers_broadcast(self):
        """Whether zoe may move the updated parameters by broadcast (zoe_collectives.broadcast):
        over a CPU backend, whose broadcasts take the parameters' own memory; over NCCL they
        are all-gathered, staged through the GPU."""
        return self._device.type == "cpu"

    @property
    def group(self):
        """The process group; FailedPrecondition once destroy_process_group() ended it."""
        return _live_group(self._group, "the zoe optimizer")

    def agreed(self, what, step):
        """``step()`` run on every rank, then agreed (_collective_ops.agreed): its result when
        it succeeded on every rank, else every rank raises zoe's error naming the failing ranks
        and ``what`` failed. ``step`` makes no collective call."""
        return agreed(what, step, self.group)

    def _guarded(self, function):
        """A C callback running ``function(self, *args)``; it holds ``self`` weakly (the
        callbacks are this object's own: a strong reference would be a cycle)."""
        owner = weakref.ref(self)

        def callback(_context, *args):
            collectives = owner()
            if collectives is None:  # zoe calls only while a group, which holds it, steps
                return 1
            try:
                function(collectives, *args)
                return 0
            except Exception as error:  # reported to zoe, which fails the step on this rank
                collectives.error = error
                return 1

        return callback

    @contextlib.contextmanager
    def _collective(self, what, counted=True):
        """Runs collectives of ``what``, timed in ``seconds`` (and, when ``counted``, counted in
        ``calls``); the transport's failure (a rank died, failed or timed out) raised as
        zoe.Aborted naming ``what`` (_collective_ops.transport_failure_aborted)."""
        with _timed(self, "seconds", calls="calls" if counted else None), \
                transport_failure_aborted(what):
            yield

    def all_reduce(self, tensor, what):
        """Sums ``tensor`` (``what``, for a failure's message) over the ranks, in place."""
        if self._device.type == "cpu":
            with self._collective(f"all_reduce of {what}"):
                dist.all_reduce(tensor, group=self.group)
            return
        moved = tensor.to(self._device)
        with self._collective(f"all_reduce of {what}"):
            dist.all_reduce(moved, group=self.group)
        tensor.copy_(moved)

    def _all_reduce_sum(self, values, count):
        self.all_reduce(_floats(ctypes.addressof(values.contents), count, ctypes.c_double,
                                torch.float64), "the sharded step's sums")

    @property
    def device(self):
        """Where the transport's collectives take their tensors: the current CUDA device over
        NCCL, else the CPU."""
        return self._device

    def _buffer(self, purpose, count, device=None):
        """``count`` float32 elements of the buffer kept for ``purpose`` on ``device`` (allocated
        zeroed, again only when a call wants more elements: its contents are the last user's)."""
        device = device or self._device
        key = (purpose, device.type)
        buffer = self._scratch.get(key)
        if buffer is None or buffer.numel() < count:
            buffer = torch.zeros(count, dtype=torch.float32, device=device)
            self._scratch[key] = buffer
        return buffer[:count]

    def reserve_gather(self, largest):
        """Allocates what gather() uses for shards of at most ``largest`` elements, so that it
        allocates nothing then (over NCCL; a CPU backend gathers in place)."""
        if self._device.type != "cpu" and largest > 0:
            self._buffer("gather_send", largest)
            self._buffer("gather_received", largest * self.world_size)

    def reduce_to_owners(self, tensor, bounds, what, async_op=False):
        """Sums ``tensor`` (``what``) over the ranks, each rank's part onto that rank: rank r's
        part is elements [bounds[r], bounds[r + 1]) of ``tensor``. Afterwards this rank's part
        holds the sum; the other parts hold unspecified values. With ``async_op`` (a CPU
        backend) returns a Pending to wait() on before reading the sum (None: done already)."""
        parts = [tensor[bounds[r] : bounds[r + 1]] for r in range(self.world_size)]
        if self._device.type == "cpu":
            with self._collective(f"reduction of {what}"):
                return reduce_parts(parts, self.group, async_op=async_op)
        self.all_reduce(tensor, what)
        return None

    def wait(self, pending, what):
        """Waits for a Pending of reduce_to_owners(async_op=True) of ``what``, timed as a
        collective."""
        if pending is not None:
            with self._collective(f"reduction of {what}", counted=False):
                pending.wait()

    def _reduce_scatter_sum(self, send, recv, counts):
        counts = [counts[r] for r in range(self.world_size)]
        bounds = [sum(counts[:r]) for r in range(self.world_size + 1)]
        whole = self._buffer("reduce_scatter", bounds[-1], torch.device("cpu"))
        whole.copy_(_floats(send, whole.numel()))  # send is the caller's: not reduced in place
        self.reduce_to_owners(whole, bounds, "the sharded step's values")
        mine = whole[bounds[self.rank] : bounds[self.rank + 1]]
        _floats(recv, counts[self.rank]).copy_(mine)

    def gather(self, shard, counts, what, out=None):
        """Every rank's ``shard`` (counts[r] fp32 elements on rank r; ``what``), concatenated in
        rank order, into ``out`` (a fresh CPU tensor when None), which is returned. A CPU backend
        broadcasts each rank's shard straight into its slice of ``out`` (_collective_ops);
        otherwise every rank all-gathers a reused buffer of the largest count (the padding's
        contents are never read)."""
        if out is None:
            out = torch.empty(sum(counts), dtype=torch.float32)
        largest = max(counts)
        if largest == 0:  # nothing to gather on any rank (gloo fails on empty tensors)
            return out
        if self._device.type == "cpu":
            parts = list(out.split(counts))
            if parts[self.rank].data_ptr() != shard.data_ptr():
                parts[self.rank].copy_(shard)
            with self._collective(f"gather of {what}"):
                gather_parts(parts, self.group)
            return out
        padded = self._buffer("gather_send", largest)
        padded[: counts[self.rank]] = shard
        received = self._buffer("gather_received", largest * len(counts))
        with self._collective(f"gather of {what}"):
            dist.all_gather(list(received.split(largest)), padded, group=self.group)
        begin = 0
        for rank, count in enumerate(counts):
            out[begin : begin + count].copy_(received[rank * largest : rank * largest + count])
            begin += count
        return out

    def _all_gather(self, send, recv, counts):
        counts = [counts[r] for r in range(self.world_size)]
        self.gather(_floats(send, counts[self.rank]), counts, "the sharded step's values",
                    out=_floats(recv, sum(counts)))

    def _broadcast(self, roots, data, sizes, count):
        """zoe_collectives.broadcast: each segment's bytes from its root into every other rank's
        own pointer, all issued at once (async) and then waited for."""
        pieces = [(roots[i], _floats(data[i], sizes[i], ctypes.c_uint8, torch.uint8))
                  for i in range(count)]
        with self._collective("broadcast of the updated parameters"):
            broadcast_pieces(pieces, self.group)

    def _barrier(self):
        with self._collective("barrier of the sharded step"):
            dist.barrier(group=self.group)


class ShardedGroup:
    """One rank's part of a sharded zoe optimizer group (zoe_sharded_group_*)."""

    def __init__(self, engine, name, params, collectives, **options):
        spec = {"name": name}
        spec.update({key: value for key, value in options.items() if value is not None})
        array, n = _views(params)
        handle = ctypes.c_void_p()
        self._collectives = collectives
        self._call(
            _capi.zoe_sharded_group_create(
                engine._h(), json.dumps(spec).encode("utf-8"), array, n,
                ctypes.byref(collectives.struct), ctypes.byref(handle),
            ),
            f"create sharded optimizer group {name!r}",
        )
        self._handle = handle
        self.engine = engine
        self.name = name
        local = _capi.zoe_group_id()
        begin, end = ctypes.c_uint64(), ctypes.c_uint64()
        check(_capi.zoe_sharded_group_local(handle, ctypes.byref(local), ctypes.byref(begin),
                                            ctypes.byref(end)))
        self.begin, self.end = begin.value, end.value
        segments = len(spec.get("segments", [0]))
        self.local = OptimizerGroup(engine, local.value, name, self.end - self.begin, segments)

    def _call(self, status, what):
        """check(), naming the failed collective's Python exception when there was one."""
        error, self._collectives.error = self._collectives.error, None
        if status != _capi.Status.OK and error is not None:
            what = f"{what} ({type(error).__name__} in a collective: {error})"
        check(status, what)

    def step(self, hyper, params_out, loss_scale=1.0):
        """One sharded step on the gradients accumulated in ``local``; every rank calls it."""
        c_hyper = _c_hyper_params(hyper)
        param_array, n_params = _views(params_out)
        out = _capi.zoe_step_result()
        self._call(
            _capi.zoe_sharded_step(
                self.engine._h(), self._handle, c_hyper, None, 0, param_array, n_params,
                float(loss_scale), ctypes.byref(out),
            ),
            f"sharded step of optimizer group {self.name!r}",
        )
        return StepResult(bool(out.skipped), out.grad_norm, out.steps_taken, out.bytes_read,
                          out.bytes_written, out.seconds)

    def close(self):
        if self._handle:
            _capi.zoe_sharded_group_destroy(self._handle)
            self._handle = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # at interpreter exit the library may already be gone
            pass

