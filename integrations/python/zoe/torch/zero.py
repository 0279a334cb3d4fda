"""ZeRO stages 1 and 2 for zoe.torch's optimizers across the ranks of a torch.distributed process
group (``process_group=``): each param group's elements, concatenated, are cut into N contiguous
shards, shard r = [floor(r * n / N), floor((r + 1) * n / N)), and rank r's zoe group holds shard
r only (master weights, moments and per-parameter step counts), in its own engine: a ``{rank}``
in ``nvme_path`` (or in the config's offload_optimizer.nvme_path) gives each rank its own
directory. A parameter may be split across ranks: each rank sees its slice as one segment.

The model is not wrapped in DistributedDataParallel: the optimizer reduces the gradients.

- Stage 1: at step(), which parameters have a gradient is agreed (one all-reduce: a parameter
  with a gradient on some rank counts zeros on the others, one with none anywhere is skipped as
  torch skips it), each bucket's gradients are summed onto the ranks that own them (a
  reduce-scatter, _collective_ops) and averaged, and each rank hands its shard's slice to zoe.
- Stage 2: during backward, a hook on each parameter's gradient accumulator counts the
  parameters of its bucket (consecutive parameters of a param group, ``bucket_elements`` at
  least); when a bucket's last gradient is final the bucket's reduction starts in the background
  (at most distributed.REDUCTIONS_IN_FLIGHT at once, the oldest finished first, the rest at
  step(), as DistributedDataParallel overlaps its all-reduces with backward) and, once summed,
  the shard's slice goes straight to the zoe group (zoe_optim_accumulate_grad: its state reads
  start during backward). Buckets whose gradients never all arrived are reduced at step(). Like
  DistributedDataParallel without find_unused_parameters, stage 2 needs every rank to produce
  gradients for the same parameters in an iteration, and one backward per step.

Steady-state steps allocate no whole-group buffer in Python: a CPU param group's flat fp32
gradient buffer (which the buckets' reductions write in place and whose shard slices zoe borrows)
is made once and again only when the group's element count changes, and the shards are gathered
straight into the buffer zoe passes; a device group reuses its bucket and gather buffers.

Collectives: gloo in torch 1.13 has no reduce-scatter and a slow all-gather, so both are built
from one reduce or broadcast per rank (_collective_ops); other backends all-reduce and all-gather
through reused buffers. At step() zoe agrees the inf/NaN skip and the global gradient norm
for ``max_grad_norm`` by one all-reduce (every rank skips or clips together), steps its shard and
all-gathers the updated parameters into every rank's parameters. A rank that fails (an I/O error)
makes every rank's step raise; the transport's timeout (init_process_group(timeout=...)) bounds
the wait for a rank that dies.

Checkpoints: save_checkpoint(dir) writes each rank's shard to dir/rank-<r>/save-<n> and, once every
rank succeeded, rank 0 replaces the manifest (world size, stage, shard layout, the parameters'
shapes, hyper-parameters, and each rank's save) atomically: ranks killed during a save all load the
previous checkpoint (checkpoint.save_sharded). load_checkpoint(dir) restores the save the manifest
names on the same world size and layout. Every step of both that one rank can fail is agreed
(TorchCollectives.agreed): every rank raises zoe's error naming the failing rank, the ranks stay
paired, a failed save keeps the previous checkpoint and a failed load changes no rank's state
(checkpoint.load_shard). state_dict() gathers every shard into torch's layout of the kind (the same
dict on every rank); consolidate.py does the same from the checkpoint without the ranks;
load_state_dict() takes such a dict, from any world size, each rank its slice: the way to move
training to another world size.

A step that fails on every rank (agreed), or a backward stopped in a bucket's reduction, drops the
iteration of every param group (ZeroPartition.abandon_iteration): reductions in flight waited for,
buckets reset, the gradients zoe was handed discarded, so none reaches the next iteration.

Parameters on the CPU or on a device (CUDA, or the CPU twin given as device_backend): a param
group's place (zero_places.py) says where its buckets are reduced and its parameters gathered --
for CPU parameters in DRAM, zoe reading the reduced gradients and writing the parameters in
place; for device parameters on the device, zoe's shard going through pinned staging.

Structure: the optimizer (optimizer.py) holds a ZeroPartition when sharded and calls it where
sharding changes what it does (creating a group, reducing gradients, the step, external writes,
state dicts and checkpoints); a param group's shard (its ShardedGroup, buckets and place) is the
GroupShard in its GroupState. The shard formula is distributed.shard_bounds.
"""

import contextlib
import dataclasses
import json
import math
import os
import weakref
from typing import Any, List, Optional, Set

import torch
import torch.distributed as dist

from .. import _capi
from .. import errors as zoe_errors
from ..engine import BufferView, _config_text
from .checkpoint import load_shard, read_manifest, save_sharded, shard_directory
from .common import _DTYPES, _invalid, _pager_of, _view, whole_count
from .distributed import (DEFAULT_BUCKET_ELEMENTS, ReductionsInFlight, ShardedGroup,
                          TorchCollectives, shard_boundaries, shard_bounds, shard_counts)
from .grad_hooks import buckets_of, on_gradient_accumulated
from .param_memory import check_contiguous, params_named
from .state_layout import param_entries
from .zero_places import DeviceBuffers, DevicePlace, HostPlace, check_transport


def _with_rank(path, rank):
    """``path`` with ``{rank}`` replaced, its directory created."""
    if path is None or "{rank}" not in str(path):
        return path
    resolved = os.fspath(path).replace("{rank}", str(rank))
    os.makedirs(resolved, exist_ok=True)
    return resolved


def _config_with_rank(config, rank):
    """The configuration document (dict, JSON text or path) with ``{rank}`` replaced in
    zero_optimization.offload_optimizer.nvme_path; None stays None."""
    if config is None:
        return None
    document = json.loads(_config_text(config) or "{}")
    section = document.get("zero_optimization", {}).get("offload_optimizer", {})
    paths = section.get("nvme_path")
    if isinstance(paths, list):
        section["nvme_path"] = [_with_rank(path, rank) for path in paths]
    elif paths is not None:
        section["nvme_path"] = _with_rank(paths, rank)
    return document


def _zero_section(config, engine):
    """zero_optimization of the configuration (dict, JSON text or path), else of the engine's,
    else None."""
    if config is not None:
        return json.loads(_config_text(config) or "{}").get("zero_optimization", {})
    if engine is not None:
        return engine.config.get("zero_optimization", {})
    return None


def _stage_of(zero_stage, zero):
    """The ZeRO stage: ``zero_stage``, else the configuration's zero_optimization.stage
    (``zero``: _zero_section); the optimizer's part of stage 3 is stage 2's. zero_stage, when
    given, is the optimizer's stage whatever the configuration says (its stage also describes
    how a ShardedParameterPager partitions the parameters)."""
    what = "zero_stage"
    if zero_stage is None:
        what = "zero_optimization.stage (from the configuration)"
        if zero is not None:
            zero_stage = zero.get("stage", 2)
        else:
            zero_stage, what = 2, "zero_stage"
    if zero_stage not in (1, 2, 3):
        raise _invalid(
            f"{what} = {zero_stage!r} is not allowed with a process_group; allowed: 1 "
            "(gradients all-reduced at step), 2 (reduced during backward), 3 (as 2 for the "
            "optimizer)"
        )
    return min(int(zero_stage), 2)


def _gather_round(zero, bucket_elements, world_size):
    """Elements each rank sends per round of a device param group's parameter gather: the
    configuration's zero_optimization.allgather_bucket_size (DeepSpeed's elements all-gathered
    at a time) shared by the ranks; absent or "auto", the buckets' size, at most
    DEFAULT_BUCKET_ELEMENTS (a DeepSpeed reduce_bucket_size of 5e8 would double the model on the
    GPU), and DEFAULT_BUCKET_ELEMENTS for buckets of one parameter each (0 or 1)."""
    given = (zero or {}).get("allgather_bucket_size")
    if given is None or given == "auto":
        if bucket_elements <= 1:
            return DEFAULT_BUCKET_ELEMENTS
        return min(bucket_elements, DEFAULT_BUCKET_ELEMENTS)
    total = whole_count(given, "zero_optimization.allgather_bucket_size",
                        "elements of parameters gathered at a time, over every rank")
    return max(1, total // world_size)


# Options of the unsharded optimizer that a sharded one does not take, with the value that
# means "not asked for".
_UNSHARDED_OPTIONS = {"zero_copy": (None, False), "speculative": (None, False)}


def _check_sharded_options(options):
    """InvalidArgument for an option the sharded optimizer would otherwise ignore."""
    for key, unset in _UNSHARDED_OPTIONS.items():
        if key in options and options[key] not in unset:
            raise _invalid(
                f"{key} = {options[key]!r} is not supported with a process_group: a sharded "
                "optimizer keeps its own master of its shard and does not speculate"
            )


class ShardSlice:
    """Passes the shard's part of whole-group state writes to the rank's group."""

    def __init__(self, sharded):
        self.sharded = sharded

    def write_state(self, slot, offset, count, address):
        begin, end = self.sharded.begin, self.sharded.end
        lo, hi = max(offset, begin), min(offset + count, end)
        if hi > lo:
            self.sharded.local.write_state(slot, lo - begin, hi - lo, address + 4 * (lo - offset))


@dataclasses.dataclass(eq=False)
class GroupShard:
    """A param group's ZeRO state on this rank (GroupState.shard)."""

    buckets: List[Any]  # grad_hooks.Bucket: the group's parameters in reduction order
    place: Any  # zero_places.HostPlace or DevicePlace: where gradients and parameters move
    sharded: Optional[ShardedGroup] = None  # created with the zoe group, by every rank together
    absent: Set[int] = dataclasses.field(default_factory=set)  # no gradient on any rank
    has_grads: bool = False  # some rank has a gradient in the group (reduce_for_step)
    hooks: List[Any] = dataclasses.field(default_factory=list)  # (handle, node) of stage 2


def _raise_if(error):
    if error is not None:
        raise error


def _bucket_hook(optimizer, bucket):
    """Stage 2's hook on a parameter of ``bucket``: the bucket is reduced once its last
    gradient is final. It holds the optimizer weakly: autograd keeps the hook, the optimizer
    keeps the parameter that holds it, and a strong reference would make a cycle that keeps an
    unreferenced optimizer (its engine and collectives) alive until a garbage collection."""
    owner = weakref.ref(optimizer)

    def ready():
        optimizer = owner()
        if optimizer is None:  # a gradient after the optimizer went: nothing to reduce
            return
        bucket.ready += 1
        if bucket.ready == len(bucket.indices) and not bucket.reduced:
            try:
                with torch.no_grad():
                    state = optimizer._groups[bucket.group_index]
                    optimizer._zero.reduce_bucket(optimizer, state, bucket)
            except BaseException:  # backward stops here: the next one starts afresh
                optimizer._zero.abandon_iteration(optimizer._groups)
                raise

    return ready


class ZeroPartition:
    """ZeRO stages 1 and 2 of one zoe optimizer (see the module docstring): the optimizer holds
    one when given a process_group and calls it where sharding changes what it does. It keeps
    the collectives and the stage; each param group's shard is in its GroupState.shard. Methods
    that create a zoe group or read the param groups take the optimizer as an argument: the
    partition holds no reference to it."""

    def __init__(self, process_group, zero_stage, bucket_elements, config, engine, accumulation):
        self.accumulation = accumulation  # the optimizer's gradients (grad_accumulation.py)
        if process_group is None:
            process_group = dist.group.WORLD
        self.comm = TorchCollectives(process_group)
        zero = _zero_section(config, engine)
        self.stage = _stage_of(zero_stage, zero)
        self.bucket_elements = bucket_elements
        self.gather_round = _gather_round(zero, bucket_elements, self.comm.world_size)
        # the reductions in flight of every param group, oldest first: (GroupState, Pending,
        # bucket, flat buffer, its first element, present) for _finish_reduction
        self.in_flight = ReductionsInFlight()
        self.device_buffers = DeviceBuffers()  # shared by the device param groups

    @classmethod
    def for_arguments(cls, process_group, zero_stage, bucket_elements, config, engine,
                      unsharded_options, accumulation):
        """The partition an optimizer's arguments ask for: None without process_group and
        zero_stage (bucket_elements is then refused, as an unknown argument is); the options
        of the unsharded optimizer that a sharded one would ignore are refused."""
        if process_group is None and zero_stage is None:
            if bucket_elements is not None:
                raise TypeError("bucket_elements applies to a sharded optimizer "
                                "(process_group= or zero_stage=)")
            return None
        _check_sharded_options(unsharded_options)
        if bucket_elements is None:
            bucket_elements = DEFAULT_BUCKET_ELEMENTS
        bucket_elements = whole_count(bucket_elements, "bucket_elements",
                                      "0 or 1: one parameter per bucket")
        return cls(process_group, zero_stage, bucket_elements, config, engine, accumulation)

    @property
    def rank(self):
        return self.comm.rank

    @property
    def world_size(self):
        return self.comm.world_size

    def config_with_rank(self, config):
        """The configuration (dict, JSON text or path) with ``{rank}`` replaced by this rank in
        its offload_optimizer.nvme_path; None stays None."""
        return _config_with_rank(config, self.rank)

    def path_with_rank(self, path):
        """``path`` with ``{rank}`` replaced by this rank, its directory created."""
        return _with_rank(path, self.rank)

    @staticmethod
    def check_param(param, where):
        """InvalidArgument for a parameter a sharded optimizer does not step: a paged one."""
        if _pager_of(param) is not None:
            raise _invalid(f"{where} is paged; sharded zoe optimizers take ordinary CPU or "
                           "CUDA parameters")

    def staging_bytes(self, params):
        """Bytes of HOST staging a param group of device parameters needs on this rank (its
        largest shard's, zero_places.DevicePlace)."""
        count = sum(param.numel() for param in params)
        return DevicePlace.staging_bytes(-(-count // self.world_size))

    def add_group(self, optimizer, state, backend):
        """Cuts a new param group into buckets and, in stage 2, hooks its trainable parameters;
        its place is the host's, or its device's when ``backend`` (device.backend_for) is not
        None."""
        place = HostPlace()
        if backend is not None:
            for param in state.params[:1]:  # one device per group (device.backend_for)
                check_transport(self.comm, param.device, state.index)
            place = DevicePlace(backend, optimizer.engine, optimizer._group_name(state.index),
                                state.index, self.gather_round, self.device_buffers)
        state.shard = GroupShard(buckets_of(state.index, state.params, self.bucket_elements),
                                 place)
        if self.stage != 2:
            return
        # A frozen parameter (no hook can be put on it) leaves its bucket to step(), which
        # reduces what backward did not: its gradient too, should it be unfrozen later.
        for bucket in state.shard.buckets:
            for index in bucket.indices:
                if state.params[index].requires_grad:
                    hook = _bucket_hook(optimizer, bucket)
                    state.shard.hooks.append(on_gradient_accumulated(state.params[index], hook))

    def create_group(self, engine, name, state, options):
        """This rank's part of a param group's sharded zoe group (every rank creates it
        together); returns its local zoe group."""
        params = [param.detach() for param in state.params]
        check_contiguous(params_named(state.index, params))
        sizes = sorted((sum(state.params[index].numel() for index in bucket.indices)
                        for bucket in state.shard.buckets), reverse=True)
        slots = self.in_flight.limit + 1  # the most reductions in flight at once
        self.comm.agreed(f"preparing param group {state.index}'s buffers",
                         lambda: state.shard.place.prepare(state, self.comm, sizes[:slots],
                                                           slots))
        views, _copies = self._creation_views(state, params)
        state.shard.sharded = ShardedGroup(engine, name, views, self.comm, **options)
        return state.shard.sharded.local

    def _creation_views(self, state, params):
        """Views of the group's parameters for the creation of its sharded group, which reads
        this rank's shard of them: the CPU parameters themselves; of device parameters, host
        copies of their parts in the shard only (returned too, to be kept alive) and views
        without data for the rest."""
        if all(param.device.type == "cpu" for param in params):
            return [_view(param) for param in params], []
        begin, end = shard_bounds(state.element_count(), self.rank, self.world_size)
        views, copies = [], []
        for param, offset in zip(params, state.offsets()):
            dtype, stop = _DTYPES[param.dtype], offset + param.numel()
            lo, hi = min(max(begin, offset), stop), max(min(end, stop), offset)
            part = param.detach().reshape(-1)[lo - offset : hi - offset]
            copies.append(part.to("cpu"))
            views += [BufferView(0, dtype, lo - offset), _view(copies[-1]),
                      BufferView(0, dtype, stop - hi)]
        return views, copies

    def sync_external_writes(self, state):
        """Parameters written outside the optimizer: their slice in the shard goes to the
        master weights (every rank holds the same full parameters)."""
        sharded = state.shard.sharded
        recorded = state.versions or []
        for param, version, offset in zip(state.params, recorded, state.offsets()):
            if version is None or param._version == version:
                continue
            lo, hi = max(offset, sharded.begin), min(offset + param.numel(), sharded.end)
            if hi <= lo:
                continue
            values = param.detach().reshape(-1)[lo - offset : hi - offset]
            values = values.to("cpu", torch.float32).contiguous()
            sharded.local.write_state(_capi.StateSlot.MASTER, lo - sharded.begin, hi - lo,
                                      values.data_ptr())

    def close(self, states):
        """Destroys the sharded groups of ``states`` (the optimizer's GroupStates)."""
        for state in states:
            if state.shard is not None:
                state.shard.place.close()
                if state.shard.sharded is not None:
                    state.shard.sharded.close()

    # --- gradients -------------------------------------------------------------------------

    def reduce_bucket(self, optimizer, state, bucket, present=None):
        """Sums a bucket's gradients (zeros where a parameter has none on this rank) onto the
        ranks that own them, averages this rank's part and hands its slice of each parameter to
        zoe -- without data for parameters that ``present`` (None: all) marks absent on every
        rank. The sum runs in the background (in_flight: at most its limit, of every group, while
        backward goes on); finish_reductions hands it to zoe."""
        optimizer._zoe_group(state)
        if not any(other.reduced for other in state.shard.buckets):
            # The iteration's first hand-over: parameters written from outside the optimizer
            # since its last step go to the master now, as zoe takes no write once gradients
            # wait for the step.
            optimizer._sync_external_writes(state)
            state.record_versions()
        offsets = state.offsets()
        first, last = bucket.indices[0], bucket.indices[-1]
        begin, end = offsets[first], offsets[last] + state.params[last].numel()
        flat = self._flat_bucket(state, bucket, offsets, begin, end)
        owners = [min(max(boundary, begin), end) - begin
                  for boundary in shard_boundaries(state.element_count(), self.world_size)]
        try:
            pending = self.comm.reduce_to_owners(flat, owners, bucket.gradients(), async_op=True)
        except BaseException:
            state.shard.place.release(flat)
            raise
        bucket.reduced = True
        self.in_flight.add((state, pending, bucket, flat, begin, present),
                           self._finish_reduction)

    def finish_reductions(self):
        """Waits for every pending reduction, oldest first, and hands its slices to zoe."""
        self.in_flight.finish_all(self._finish_reduction)

    def _finish_reduction(self, reduction):
        """A bucket's reduction once summed: this rank's part averaged and each parameter's
        slice handed to zoe (see reduce_bucket)."""
        state, pending, bucket, flat, begin, present = reduction
        try:
            self._hand_over_reduced(state, pending, bucket, flat, begin, present)
        finally:
            state.shard.place.release(flat)

    def _hand_over_reduced(self, state, pending, bucket, flat, begin, present):
        self.comm.wait(pending, bucket.gradients())
        local, sharded, place = state.zoe_group, state.shard.sharded, state.shard.place
        if present is not None:
            state.shard.absent.update(i for i in bucket.indices if not present[i])
        offsets = state.offsets()
        end = begin + flat.numel()
        lo, hi = max(begin, sharded.begin), min(end, sharded.end)
        if hi <= lo:
            return
        shard = flat[lo - begin : hi - begin]
        shard /= self.world_size
        host = place.to_host(shard, lo - sharded.begin, sharded)  # zoe reads it until the step
        for index in bucket.indices:
            p_lo = max(offsets[index], lo)
            p_hi = min(offsets[index] + state.params[index].numel(), hi)
            if p_hi <= p_lo:
                continue
            if present is None or present[index]:
                view = BufferView(host[p_lo - lo :].data_ptr(), _capi.DType.FLOAT32, p_hi - p_lo)
            else:
                view = BufferView(0, _capi.DType.FLOAT32, p_hi - p_lo)
            local.accumulate_grad(p_lo - sharded.begin, view)

    def _flat_bucket(self, state, bucket, offsets, begin, end):
        """The bucket's fp32 buffer (its place's, for elements [begin, end) of the group),
        holding this rank's gradients (zeros for a parameter without one)."""
        flat = state.shard.place.bucket_buffer(
            state, begin, end, lambda: self.in_flight.finish_oldest(self._finish_reduction))
        for index in bucket.indices:
            param = state.params[index]
            start = offsets[index] - begin
            target = flat[start : start + param.numel()]
            grad = self.accumulation.gradient(param)
            if grad is None:
                target.zero_()
            else:
                target.copy_(grad.detach().reshape(-1))
        return flat

    def _presence_counts(self, params):
        """Per parameter of ``params``, how many ranks have its gradient (one all-reduce)."""
        flags = torch.tensor([float(self.accumulation.present(param)) for param in params],
                             dtype=torch.float64)
        self.comm.all_reduce(flags, "the flags of which parameters have a gradient")
        return flags.tolist()

    def _agreed_presence(self, state):
        """Per parameter, whether some rank has its gradient (one all-reduce)."""
        return [count > 0 for count in self._presence_counts(state.params)]

    def reduce_for_step(self, optimizer, states):
        """Before any group steps: what backward did not reduce reduced, every reduction
        finished, each group's has_grads set (False when no rank has a gradient in it); then the
        gradients' copies to the host agreed over the ranks (a failure on one makes every rank
        raise, before any group changed)."""
        try:
            for state in states:
                state.shard.has_grads = self._reduce_rest(optimizer, state)
        finally:
            self.finish_reductions()
        if self.stage == 2:
            self._check_same_gradients(states)
        failures = [state.shard.place.take_failure() for state in states]
        failure = next((failure for failure in failures if failure is not None), None)
        self.comm.agreed("the copies of the reduced gradients to the host",
                         lambda: _raise_if(failure))

    def _check_same_gradients(self, states):
        """Stage 2, once every bucket is reduced: InvalidArgument on every rank when a parameter
        has a gradient on some ranks and none on others (one all-reduce of a flag per
        parameter). Its bucket was reduced during backward on the ranks that had all of its
        gradients and at step() on the others, so the reductions may have paired with the
        wrong ones: the iteration is dropped before any group steps."""
        params = [(state.index, index, param) for state in states
                  for index, param in enumerate(state.params)]
        counts = self._presence_counts([param for _, _, param in params])
        mixed = [where for where, count in zip(params, counts) if 0 < count < self.world_size]
        if not mixed:
            return
        group, index, param = mixed[0]
        raise _invalid(
            f"parameter {index} of param group {group} (shape {tuple(param.shape)}) has a "
            f"gradient on some ranks and none on others ({len(mixed)} such parameter(s)): ZeRO "
            "stage 2 reduces each bucket of gradients during backward and needs every rank to "
            "produce gradients for the same parameters, as DistributedDataParallel without "
            "find_unused_parameters; use stage 1, which reduces at step(), or let every rank use "
            "every parameter (an unused output times 0 gives it a zero gradient). The "
            "iteration's gradients are dropped")

    def _reduce_rest(self, optimizer, state):
        buckets = state.shard.buckets
        if self.stage == 1:
            present = self._agreed_presence(state)
            if not any(present):
                return False
            for bucket in buckets:
                self.reduce_bucket(optimizer, state, bucket, present)
            return True
        any_reduced = False
        for bucket in buckets:
            if bucket.reduced:
                any_reduced = True
                continue
            present = [self.accumulation.present(param) for param in state.params]
            if any(present[index] for index in bucket.indices):
                self.reduce_bucket(optimizer, state, bucket, present)
                any_reduced = True
        if any_reduced:
            for bucket in buckets:  # a bucket without any gradient: its slices are absent
                if not bucket.reduced:
                    self.reduce_bucket(optimizer, state, bucket, [False] * len(state.params))
        return any_reduced

    @contextlib.contextmanager
    def no_sync(self, states):
        """Backwards inside reduce no stage-2 bucket (DistributedDataParallel.no_sync): the
        micro-batches of a gradient accumulation before its last, whose gradients add up in
        ``.grad``. The next backward outside reduces the sums. Stage 1 reduces at step() and
        needs nothing held."""
        buckets = [bucket for state in states for bucket in state.shard.buckets]
        if self.stage != 2:
            buckets = []
        for bucket in buckets:
            bucket.reduced = True  # the hooks count, and reduce nothing
        try:
            yield
        finally:
            for bucket in buckets:
                bucket.reset()

    def end_iteration(self, state):
        """Drops the reduced slices and the buckets' counts after a step (taken or failed);
        reductions still pending (a step that failed first) are waited for, so that every rank
        stays paired for its next collective, and dropped."""
        self._drop_in_flight(lambda item: item[0] is state)
        state.shard.place.end_iteration()
        state.shard.absent = set()
        state.shard.has_grads = False
        for bucket in state.shard.buckets:
            bucket.reset()

    def abandon_iteration(self, states):
        """After a step or a backward that failed (every rank alike): every reduction in flight
        waited for and dropped, every group's bucket counts reset and the gradients zoe holds
        discarded (zoe_optim_discard_grads), so that the next backward, or step() again on the
        gradients still in ``.grad``, starts the iteration afresh."""
        with contextlib.suppress(Exception):  # the failure being raised says what went wrong
            self._drop_in_flight(lambda item: True)
        for state in states:
            if state.shard is None:
                continue
            state.shard.place.end_iteration()
            state.shard.absent = set()
            state.shard.has_grads = False
            for bucket in state.shard.buckets:
                bucket.reset()
            if state.zoe_group is not None:
                with contextlib.suppress(Exception):
                    state.zoe_group.discard_grads()

    def _drop_in_flight(self, wanted):
        """Waits for the reductions in flight that ``wanted(item)`` and drops them (their
        buckets' buffers released); a wait that fails does not stop the others."""
        failure = None
        for state, work, bucket, flat, *_ in self.in_flight.take(wanted):
            try:
                self.comm.wait(work, bucket.gradients())
            except Exception as error:  # every rank's reductions stay paired: wait for the rest
                failure = failure or error
            state.shard.place.release(flat)
        if failure is not None:
            raise failure

    # --- the step --------------------------------------------------------------------------

    def step(self, state, hyper, params, loss_scale=1.0):
        """The sharded step on the gradients accumulated in the rank's group: this rank's
        shard, then every rank's ``params`` (the group's, detached) gathered by its place."""
        return state.shard.place.step(state, hyper, params, self.comm, loss_scale)

    def grad_sum_squares(self, states):
        """The sum of squares of every group's reduced gradients over every rank's shard (one
        all-reduce; inf or NaN when one is not finite), after reduce_for_step: for clipping the
        groups by their global norm."""
        local = [state.zoe_group.grad_sum_squares() for state in states if state.shard.has_grads]
        total = torch.tensor([math.fsum(local)], dtype=torch.float64)
        self.comm.all_reduce(total, "the gradients' sums of squares (their norm)")
        return float(total)

    def discard(self, state):
        """Drops a group's step: zoe discards its reduced gradients (end_iteration follows)."""
        if state.shard.has_grads:
            state.zoe_group.discard_grads()

    # --- sharded checkpoints ---------------------------------------------------------------

    def _layout(self, optimizer):
        """Per param group: its zoe name, element count and every rank's shard range."""
        layout, world = [], self.world_size
        for state in optimizer._groups:
            count = state.element_count()
            shards = [list(shard_bounds(count, r, world)) for r in range(world)]
            layout.append({"name": optimizer._group_name(state.index), "count": count,
                           "shards": shards})
        return layout

    @staticmethod
    def _param_layout(optimizer):
        """Per param group, per parameter: its shape and dtype (what a consolidation without the
        ranks needs to build torch's layout)."""
        return [[{"shape": list(param.shape), "dtype": str(param.dtype).replace("torch.", "")}
                 for param in group["params"]] for group in optimizer.param_groups]

    def save_checkpoint(self, optimizer, directory):
        """Every rank saves its shard (the engine's streamed, crash-safe checkpoint) and rank 0
        the manifest naming them, the world size, the stage and the shard layout, as
        save_sharded() describes: a save killed on any rank leaves the previous checkpoint the
        one every rank loads. Every rank calls it, with every zoe group created."""
        manifest = {
            "zero_stage": self.stage,
            "groups": self._layout(optimizer),
            "params": self._param_layout(optimizer),
            "param_groups": optimizer._hyper_parameters(),
            "optimizer": optimizer.kind.name,
        }
        save_sharded(directory, self.comm, optimizer.engine.save_checkpoint, manifest)

    def load_checkpoint(self, optimizer, directory):
        """Loads the save the manifest names, written by save_checkpoint on the same world size
        and shard layout: each rank its shard (bit-identical), then every rank's parameters from
        the gathered master weights. Every rank calls it, with every zoe group created. Each
        step is agreed: a failure on one rank raises on every rank, naming it, and leaves every
        rank's optimizer as it was (load_shard: the load needs room for one more save of the
        shard beside it)."""
        where = f"the sharded checkpoint in {directory!r}"
        manifest, shard_dir = self.comm.agreed(
            f"reading the manifest of {where}", lambda: self._manifest_to_load(optimizer,
                                                                              directory))
        engine = optimizer.engine
        load_shard(self.comm, f"loading the shards of {where}", shard_dir,
                   engine.save_checkpoint, engine.load_checkpoint)
        optimizer._take_hyper_parameters(manifest["param_groups"])
        for state in optimizer._groups:
            self._gather_master(state)
            state.record_versions()

    def _manifest_to_load(self, optimizer, directory):
        """The manifest in ``directory`` and this rank's shard it names; FailedPrecondition
        when it is of another world size or layout, InvalidArgument when ``optimizer`` cannot
        take its param groups (ZoeOptimizer.check_loadable)."""
        manifest = read_manifest(directory)
        layout = self._layout(optimizer)
        if manifest["world_size"] != self.world_size or manifest["groups"] != layout:
            raise zoe_errors.FailedPrecondition(
                _capi.Status.FAILED_PRECONDITION,
                f"the checkpoint in {directory!r} is of {manifest['world_size']} ranks with "
                f"groups {[(g['name'], g['count']) for g in manifest['groups']]}; this optimizer "
                f"has {self.world_size} ranks and "
                f"{[(g['name'], g['count']) for g in layout]}: allowed: the same world "
                "size and parameters",
            )
        optimizer.check_loadable(manifest.get("param_groups", []),
                                 f"the checkpoint in {directory!r}", manifest.get("optimizer"),
                                 created_now=True)
        return manifest, shard_directory(directory, manifest, self.rank)

    def _gathered_slot(self, state, slot):
        """A slot of the whole param group, gathered from every rank's shard."""
        sharded = state.shard.sharded
        shard = torch.empty(sharded.end - sharded.begin, dtype=torch.float32)
        sharded.local.read_state(slot, 0, shard.numel(), shard.data_ptr())
        what = f"the {_capi.StateSlot(slot).name.lower()} state of param group {state.index}"
        return self.comm.gather(shard, shard_counts(state.element_count(), self.world_size), what)

    def _gather_master(self, state):
        """Every rank's parameters of a group from the shards' master weights."""
        whole = self._gathered_slot(state, _capi.StateSlot.MASTER)
        for param, offset in zip(state.params, state.offsets()):
            param.copy_(whole[offset : offset + param.numel()].view_as(param))

    # --- state dicts: torch's layout, consolidated ------------------------------------------

    def gathered_state(self, state, kind):
        """[per-parameter state or None] of a group of an optimizer of ``kind`` (optim_kinds.py),
        gathered from every rank's shard (every rank calls it); a parameter's step count comes
        from the rank holding its first element."""
        sharded = state.shard.sharded
        slots = {key: self._gathered_slot(state, slot)
                 for key, slot in kind.slots(with_master=True)}
        steps = torch.zeros(len(state.params), dtype=torch.float64)
        local_steps = sharded.local.segment_steps
        for index, (param, offset) in enumerate(zip(state.params, state.offsets())):
            if param.numel() > 0 and sharded.begin <= offset < sharded.end:
                steps[index] = local_steps[index]
        self.comm.all_reduce(steps, f"param group {state.index}'s step counts")
        return param_entries(kind, state.params, slots, steps.tolist())
