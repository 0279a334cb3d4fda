"""ZeRO stages 1 and 2 for zoe.torch.AdamW / Adam across the ranks of a torch.distributed process
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
  least); when a bucket's last gradient is final the bucket is reduced and the shard's slice goes
  straight to the zoe group (zoe_optim_accumulate_grad: its state reads start during backward).
  Buckets whose gradients never all arrived are reduced at step(). Like DistributedDataParallel
  without find_unused_parameters, stage 2 needs every rank to produce gradients for the same
  parameters in an iteration, and one backward per step.

Steady-state steps allocate no whole-group buffer in Python: each param group's flat fp32
gradient buffer (which the buckets' reductions write in place and whose shard slices zoe borrows)
is made once and again only when the group's element count changes, and the shards are gathered
straight into the buffer zoe passes.

Collectives: gloo in torch 1.13 has no reduce-scatter and a slow all-gather, so both are built
from one reduce or broadcast per rank (_collective_ops); other backends all-reduce and all-gather
through reused buffers. At step() zoe agrees the inf/NaN skip and the global gradient norm
for ``max_grad_norm`` by one all-reduce (every rank skips or clips together), steps its shard and
all-gathers the updated parameters into every rank's parameters. A rank that fails (an I/O error)
makes every rank's step raise; the transport's timeout (init_process_group(timeout=...)) bounds
the wait for a rank that dies.

Checkpoints: save_checkpoint(dir) writes each rank's shard to dir/rank-<r>/save-<n> and, once
every rank succeeded, rank 0 replaces the manifest (world size, stage, shard layout, the
parameters' shapes, hyper-parameters, and each rank's save) atomically: ranks killed during a save
all load the previous checkpoint (save_sharded). load_checkpoint(dir) restores the save the
manifest names on the same world size and layout. Every step of both that one rank can fail is
agreed (TorchCollectives.agreed): every rank raises zoe's error naming the failing rank, the ranks
stay paired, a failed save keeps the previous checkpoint and a failed load changes no rank's state
(load_shard). state_dict() gathers every shard into torch's
AdamW layout (the same dict on every rank); zoe.consolidate does the same from the checkpoint
without the ranks; load_state_dict() takes such a dict, from any world size, each rank its slice:
the way to move training to another world size.
"""

import json
import operator
import os
import weakref

import torch
import torch.distributed as dist

from .. import _capi
from .. import errors as zoe_errors
from ..engine import BufferView, _config_text
from .checkpoint import load_shard, read_manifest, save_sharded, shard_directory
from .common import _invalid, _pager_of, _view
from .distributed import (DEFAULT_BUCKET_ELEMENTS, ShardedGroup, TorchCollectives, shard_bounds,
                          shard_counts)

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


def _stage_of(zero_stage, config, engine):
    """The ZeRO stage: ``zero_stage``, else the config's (or the engine's)
    zero_optimization.stage; the optimizer's part of stage 3 is stage 2's. zero_stage, when
    given, is the optimizer's stage whatever the configuration says (its stage also describes
    how a ShardedParameterPager partitions the parameters)."""
    what = "zero_stage"
    if zero_stage is None:
        what = "zero_optimization.stage (from the configuration)"
        if config is not None:
            document = json.loads(_config_text(config) or "{}")
            zero_stage = document.get("zero_optimization", {}).get("stage", 2)
        elif engine is not None:
            zero_stage = engine.config.get("zero_optimization", {}).get("stage", 2)
        else:
            zero_stage, what = 2, "zero_stage"
    if zero_stage not in (1, 2, 3):
        raise _invalid(
            f"{what} = {zero_stage!r} is not allowed with a process_group; allowed: 1 "
            "(gradients all-reduced at step), 2 (reduced during backward), 3 (as 2 for the "
            "optimizer)"
        )
    return min(int(zero_stage), 2)


def _whole_count(value, name):
    """``value`` as an int >= 0: an integer of any kind (numpy's included) or a float with no
    fraction (DeepSpeed's configurations write sizes as 5e8); InvalidArgument otherwise."""
    if not isinstance(value, bool):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        try:
            count = operator.index(value)
        except TypeError:
            count = -1
        if count >= 0:
            return count
    raise _invalid(f"{name} = {value!r} is not allowed; allowed: an integer >= 0 (0 or 1: one "
                   "parameter per bucket)")


# Options of the unsharded optimizer that a sharded one does not take, with the value that
# means "not asked for".
_UNSHARDED_OPTIONS = {"zero_copy": (None, False), "speculative": (False,),
                      "device_backend": (None,)}


def _check_sharded_options(options):
    """InvalidArgument for an option the sharded optimizer would otherwise ignore."""
    for key, unset in _UNSHARDED_OPTIONS.items():
        if key in options and options[key] not in unset:
            raise _invalid(
                f"{key} = {options[key]!r} is not supported with a process_group: a sharded "
                "optimizer steps CPU parameters, keeps its own master of its shard and does "
                "not speculate"
            )


class _ShardSlice:
    """Passes the shard's part of whole-group state writes to the rank's group."""

    def __init__(self, sharded):
        self.sharded = sharded

    def write_state(self, slot, offset, count, address):
        begin, end = self.sharded.begin, self.sharded.end
        lo, hi = max(offset, begin), min(offset + count, end)
        if hi > lo:
            self.sharded.local.write_state(slot, lo - begin, hi - lo, address + 4 * (lo - offset))


class _Bucket:
    """Consecutive parameters of a param group reduced together in stage 2."""

    def __init__(self, group_index, indices):
        self.group_index = group_index
        self.indices = indices
        self.ready = 0  # gradients final so far in this iteration
        self.reduced = False


class ZeroMixin:
    """Stages 1 and 2 on top of _ZoeAdamBase (see the module docstring)."""

    _zoe_sharded = True

    def __init__(self, params, *args, process_group=None, zero_stage=None,
                 bucket_elements=DEFAULT_BUCKET_ELEMENTS, config=None, nvme_path=None,
                 engine=None, **options):
        _check_sharded_options(options)
        bucket_elements = _whole_count(bucket_elements, "bucket_elements")
        if process_group is None:
            process_group = dist.group.WORLD
        self._comm = TorchCollectives(process_group)
        self._stage = _stage_of(zero_stage, config, engine)
        self._bucket_elements = bucket_elements
        self._sharded = []  # per param group: ShardedGroup, created at first use
        self._shard_grads = []  # per param group: the reduced slices zoe borrows until step
        self._grad_buffers = []  # per param group: the flat gradient buffer (_grad_buffer)
        self._buckets = []
        self._hooks = []
        rank = self._comm.rank
        super().__init__(params, *args, config=_config_with_rank(config, rank),
                         nvme_path=_with_rank(nvme_path, rank), engine=engine, **options)

    @property
    def zero_stage(self):
        return self._stage

    @property
    def rank(self):
        return self._comm.rank

    @property
    def world_size(self):
        return self._comm.world_size

    @property
    def collective_seconds(self):
        """Wall seconds this rank spent inside the optimizer's collectives (gradient
        reductions, the agreed norm and outcome, the parameters' all-gather) since creation."""
        return self._comm.seconds

    @property
    def collective_calls(self):
        """How many collectives the optimizer ran on this rank since creation."""
        return self._comm.calls

    def _check_param(self, param, where):
        """_ZoeAdamBase's checks, and a sharded optimizer's: ordinary (not paged) CPU
        parameters."""
        super()._check_param(param, where)
        if param.device.type != "cpu":
            raise _invalid(f"{where} is on {param.device}; sharded zoe optimizers take CPU "
                           "parameters")
        if _pager_of(param) is not None:
            raise _invalid(f"{where} is paged; sharded zoe optimizers take ordinary CPU "
                           "parameters")

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        group_index = len(self.param_groups) - 1
        self._sharded.append(None)
        self._shard_grads.append([])
        self._grad_buffers.append(None)
        params = self.param_groups[group_index]["params"]
        buckets, current, size = [], [], 0
        for index, param in enumerate(params):
            current.append(index)
            size += param.numel()
            if size >= self._bucket_elements:
                buckets.append(_Bucket(group_index, current))
                current, size = [], 0
        if current:
            buckets.append(_Bucket(group_index, current))
        self._buckets.append(buckets)
        if self._stage == 2:
            for bucket in buckets:
                for index in bucket.indices:
                    self._hook(params[index], bucket)

    # --- layout ----------------------------------------------------------------------------

    def _offsets(self, group_index):
        offsets, offset = [], 0
        for param in self.param_groups[group_index]["params"]:
            offsets.append(offset)
            offset += param.numel()
        return offsets

    def _zoe_group(self, group_index):
        """The rank's sharded group of a param group (created by every rank together)."""
        if self._sharded[group_index] is not None:
            return self._sharded[group_index].local
        group = self.param_groups[group_index]
        params = [param.detach() for param in group["params"]]
        for index, param in enumerate(params):
            if not param.is_contiguous():
                raise _invalid(
                    f"parameter {index} of param group {group_index} is not contiguous; zoe "
                    "optimizers step contiguous parameters"
                )
        sharded = ShardedGroup(
            self._engine,
            self._group_name(group_index),
            [_view(param) for param in params],
            self._comm,
            type=self._ZOE_TYPE,
            lr=float(group["lr"]),
            betas=list(group["betas"]),
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            max_grad_norm=self._max_grad_norm,
            moment_dtype=self._moment_dtype,
            segments=[param.numel() for param in params],
        )
        self._sharded[group_index] = sharded
        self._zoe_groups[group_index] = sharded.local
        self._record_versions(group_index)
        return sharded.local

    def _sync_external_writes(self, group_index):
        """Parameters written outside the optimizer: their slice in the shard goes to the
        master weights (every rank holds the same full parameters)."""
        sharded = self._sharded[group_index]
        params = self.param_groups[group_index]["params"]
        recorded = self._versions[group_index] or []
        for param, version, offset in zip(params, recorded, self._offsets(group_index)):
            if version is None or param._version == version:
                continue
            lo, hi = max(offset, sharded.begin), min(offset + param.numel(), sharded.end)
            if hi <= lo:
                continue
            values = param.detach().to(torch.float32).contiguous().view(-1)[lo - offset : hi - offset]
            sharded.local.write_state(_capi.StateSlot.MASTER, lo - sharded.begin, hi - lo,
                                      values.data_ptr())

    # --- gradients -------------------------------------------------------------------------

    def _hook(self, param, bucket):
        # The hook holds the optimizer weakly: autograd keeps the hook, the optimizer keeps the
        # node or parameter that holds it, and a strong reference would make a cycle that keeps
        # an unreferenced optimizer (its engine and collectives) alive until a garbage collection.
        owner = weakref.ref(self)

        def ready(*_unused):
            optimizer = owner()
            if optimizer is None:  # a gradient after the optimizer went: nothing to reduce
                return
            bucket.ready += 1
            if bucket.ready == len(bucket.indices) and not bucket.reduced:
                with torch.no_grad():
                    optimizer._reduce_bucket(bucket)

        if hasattr(param, "register_post_accumulate_grad_hook"):
            self._hooks.append(param.register_post_accumulate_grad_hook(ready))
            return
        # torch < 2.1: the hook of the parameter's AccumulateGrad node, which runs once the
        # gradient is accumulated into .grad (the node is kept alive with the hook).
        accumulator = param.expand_as(param).grad_fn.next_functions[0][0]
        self._hooks.append((accumulator, accumulator.register_hook(ready)))

    def _reduce_bucket(self, bucket, present=None):
        """Sums a bucket's gradients (zeros where a parameter has none on this rank) onto the
        ranks that own them, averages this rank's part and hands its slice of each parameter to zoe -- without data for
        parameters that ``present`` (None: all) marks absent on every rank."""
        group_index = bucket.group_index
        local = self._zoe_group(group_index)
        sharded = self._sharded[group_index]
        params = self.param_groups[group_index]["params"]
        offsets = self._offsets(group_index)
        first, last = bucket.indices[0], bucket.indices[-1]
        begin, end = offsets[first], offsets[last] + params[last].numel()
        total = offsets[-1] + params[-1].numel()
        flat = self._grad_buffer(group_index, total)[begin:end]
        for index in bucket.indices:
            grad = params[index].grad
            start = offsets[index] - begin
            target = flat[start : start + params[index].numel()]
            if grad is None:
                target.zero_()
            else:
                target.copy_(grad.detach().reshape(-1))
        owners = [min(max(shard_bounds(total, r, self.world_size)[0], begin), end) - begin
                  for r in range(self.world_size + 1)]
        self._comm.reduce_to_owners(flat, owners)
        bucket.reduced = True
        lo, hi = max(begin, sharded.begin), min(end, sharded.end)
        if hi <= lo:
            return
        shard = flat[lo - begin : hi - begin]  # no copy: not written again before the step
        shard /= self.world_size
        self._shard_grads[group_index].append(shard)  # borrowed by zoe until the step
        for index in bucket.indices:
            p_lo = max(offsets[index], lo)
            p_hi = min(offsets[index] + params[index].numel(), hi)
            if p_hi <= p_lo:
                continue
            if present is None or present[index]:
                view = BufferView(shard[p_lo - lo :].data_ptr(), _capi.DType.FLOAT32, p_hi - p_lo)
            else:
                view = BufferView(0, _capi.DType.FLOAT32, p_hi - p_lo)
            local.accumulate_grad(p_lo - sharded.begin, view)

    def _grad_buffer(self, group_index, count):
        """The param group's flat fp32 gradient buffer of ``count`` elements, which every
        bucket's reduction writes in place (its slice, laid out as the group's parameters) and
        zoe borrows slices of until the step: allocated once, again only when the group's
        element count changes."""
        buffer = self._grad_buffers[group_index]
        if buffer is None or buffer.numel() != count:
            buffer = torch.empty(count, dtype=torch.float32)
            self._grad_buffers[group_index] = buffer
        return buffer

    def _agreed_presence(self, group_index):
        """Per parameter, whether some rank has its gradient (one all-reduce)."""
        params = self.param_groups[group_index]["params"]
        flags = torch.tensor([float(param.grad is not None) for param in params],
                             dtype=torch.float64)
        self._comm.all_reduce(flags)
        return [bool(flag > 0) for flag in flags]

    def _reduce_for_step(self, group_index):
        """Reduces what backward did not; False when no rank has a gradient in the group."""
        buckets = self._buckets[group_index]
        if self._stage == 1:
            present = self._agreed_presence(group_index)
            if not any(present):
                return False
            for bucket in buckets:
                self._reduce_bucket(bucket, present)
            return True
        params = self.param_groups[group_index]["params"]
        any_reduced = False
        for bucket in buckets:
            if bucket.reduced:
                any_reduced = True
                continue
            present = [param.grad is not None for param in params]
            if any(present[index] for index in bucket.indices):
                self._reduce_bucket(bucket, present)
                any_reduced = True
        if any_reduced:
            for bucket in buckets:  # a bucket without any gradient: its slices are absent
                if not bucket.reduced:
                    self._reduce_bucket(bucket, [False] * len(params))
        return any_reduced

    # --- the step --------------------------------------------------------------------------

    # --- the step: _ZoeAdamBase.step's loop, with the gradients reduced and the shard stepped

    def _step_group(self, group_index, group):
        """One param group's step on every rank together (its gradients reduced first); the
        reduced slices and the buckets' counts are dropped whatever happens."""
        try:
            self._step_host_group(group_index, group)
        finally:
            self._shard_grads[group_index] = []
            for bucket in self._buckets[group_index]:
                bucket.ready, bucket.reduced = 0, False

    def _group_grads(self, group_index, group):
        """Reduces what backward did not: True, or None when no rank has a gradient in the
        group (the shard's slices are already with zoe)."""
        return True if self._reduce_for_step(group_index) else None

    def _step_zoe(self, group_index, group, zoe_group, grads):
        """The sharded step: this rank's shard, then every rank's parameters gathered."""
        params = [param.detach() for param in group["params"]]
        return self._sharded[group_index].step(self._step_hyper(group_index),
                                               [_view(param) for param in params])

    # --- sharded checkpoints ---------------------------------------------------------------

    def _layout(self):
        """Per param group: its zoe name, element count and every rank's shard range."""
        layout, world = [], self.world_size
        for index, group in enumerate(self.param_groups):
            count = sum(param.numel() for param in group["params"])
            shards = [list(shard_bounds(count, r, world)) for r in range(world)]
            layout.append({"name": self._group_name(index), "count": count, "shards": shards})
        return layout

    def _param_layout(self):
        """Per param group, per parameter: its shape and dtype (what a consolidation without the
        ranks needs to build torch's layout)."""
        return [[{"shape": list(param.shape), "dtype": str(param.dtype).replace("torch.", "")}
                 for param in group["params"]] for group in self.param_groups]

    def save_checkpoint(self, directory):
        """Every rank saves its shard (the engine's streamed, crash-safe checkpoint) and rank 0
        the manifest naming them, the world size, the stage and the shard layout, as
        save_sharded() describes: a save killed on any rank leaves the previous checkpoint the
        one every rank loads. Every rank calls it."""
        for group_index in range(len(self.param_groups)):
            self._zoe_group(group_index)
        manifest = {
            "zero_stage": self._stage,
            "groups": self._layout(),
            "params": self._param_layout(),
            "param_groups": [{key: value for key, value in group.items() if key != "params"}
                             for group in self.param_groups],
        }
        save_sharded(directory, self._comm, self._engine.save_checkpoint, manifest)

    @torch.no_grad()
    def load_checkpoint(self, directory):
        """Loads the save the manifest names, written by save_checkpoint on the same world size
        and shard layout: each rank its shard (bit-identical), then every rank's parameters from
        the gathered master weights. Every rank calls it. Each step is agreed: a failure on one
        rank raises on every rank, naming it, and leaves every rank's optimizer as it was
        (load_shard: the load needs room for one more save of the shard beside it)."""
        for group_index in range(len(self.param_groups)):
            self._zoe_group(group_index)
        where = f"the sharded checkpoint in {directory!r}"
        manifest, shard_dir = self._comm.agreed(f"reading the manifest of {where}",
                                                lambda: self._manifest_to_load(directory))
        load_shard(self._comm, f"loading the shards of {where}", shard_dir,
                   self._engine.save_checkpoint, self._engine.load_checkpoint)
        for group, saved in zip(self.param_groups, manifest["param_groups"]):
            group.update(saved)
            group["betas"] = tuple(group["betas"])
        for group_index in range(len(self.param_groups)):
            self._gather_master(group_index)
            self._record_versions(group_index)

    def _manifest_to_load(self, directory):
        """The manifest in ``directory`` and this rank's shard it names; FailedPrecondition
        when it is of another world size or layout."""
        manifest = read_manifest(directory)
        if manifest["world_size"] != self.world_size or manifest["groups"] != self._layout():
            raise zoe_errors.FailedPrecondition(
                _capi.Status.FAILED_PRECONDITION,
                f"the checkpoint in {directory!r} is of {manifest['world_size']} ranks with "
                f"groups {[(g['name'], g['count']) for g in manifest['groups']]}; this optimizer "
                f"has {self.world_size} ranks and "
                f"{[(g['name'], g['count']) for g in self._layout()]}: allowed: the same world "
                "size and parameters",
            )
        return manifest, shard_directory(directory, manifest, self.rank)

    def _gather_master(self, group_index):
        """Every rank's parameters of a group from the shards' master weights."""
        sharded = self._sharded[group_index]
        shard = torch.empty(sharded.end - sharded.begin, dtype=torch.float32)
        sharded.local.read_state(_capi.StateSlot.MASTER, 0, shard.numel(), shard.data_ptr())
        params = self.param_groups[group_index]["params"]
        count = sum(param.numel() for param in params)
        counts = shard_counts(count, self.world_size)
        whole = self._comm.gather(shard, counts)
        for param, offset in zip(params, self._offsets(group_index)):
            param.copy_(whole[offset : offset + param.numel()].view_as(param))

    # --- state dicts: torch's layout, consolidated ------------------------------------------

    def state_dict(self):
        """The whole optimizer's state in torch's layout (as an unsharded zoe optimizer's):
        every rank's shard gathered, so every rank returns the same dict. Every rank calls it.
        Memory: the whole state of one param group at a time."""
        for group_index in range(len(self.param_groups)):
            self._zoe_group(group_index)
        packed_groups, state, next_index = [], {}, 0
        for group_index, group in enumerate(self.param_groups):
            params = group["params"]
            packed = {key: value for key, value in group.items() if key != "params"}
            packed["params"] = list(range(next_index, next_index + len(params)))
            packed_groups.append(packed)
            for offset, entry in enumerate(self._gathered_state(group_index)):
                if entry is not None:
                    state[next_index + offset] = entry
            next_index += len(params)
        return {"state": state, "param_groups": packed_groups}

    def _gathered_state(self, group_index):
        """[per-parameter state or None] of a group, gathered from every rank's shard; a
        parameter's step count comes from the rank holding its first element."""
        sharded = self._sharded[group_index]
        params = self.param_groups[group_index]["params"]
        offsets = self._offsets(group_index)
        count = sum(param.numel() for param in params)
        counts = shard_counts(count, self.world_size)
        slots = {}
        for key, slot in (("exp_avg", _capi.StateSlot.EXP_AVG),
                          ("exp_avg_sq", _capi.StateSlot.EXP_AVG_SQ),
                          ("master_param", _capi.StateSlot.MASTER)):
            shard = torch.empty(sharded.end - sharded.begin, dtype=torch.float32)
            sharded.local.read_state(slot, 0, shard.numel(), shard.data_ptr())
            slots[key] = self._comm.gather(shard, counts)
        steps = torch.zeros(len(params), dtype=torch.float64)
        local_steps = sharded.local.segment_steps
        for index, (param, offset) in enumerate(zip(params, offsets)):
            if param.numel() > 0 and sharded.begin <= offset < sharded.end:
                steps[index] = local_steps[index]
        self._comm.all_reduce(steps)
        result = []
        for param, offset, step in zip(params, offsets, steps.tolist()):
            if step == 0:  # never stepped: torch keeps no state for it either
                result.append(None)
                continue
            entry = {"step": torch.tensor(float(step))}
            for key, values in slots.items():
                if key != "master_param" or param.dtype != torch.float32:
                    entry[key] = values[offset : offset + param.numel()].view_as(param).clone()
            result.append(entry)
        return result

    def load_state_dict(self, state_dict):
        """Loads a state dict in torch's layout (of torch's Adam/AdamW, an unsharded zoe
        optimizer or a sharded one of any world size): each rank takes its shard's slice. Every
        rank calls it."""
        for group_index in range(len(self.param_groups)):
            self._zoe_group(group_index)
        super().load_state_dict(state_dict)

    def _write_slots(self, zoe_group, params, master_of, per_param):
        """The whole group's state, as _ZoeAdamBase builds it, written to the shard only."""
        sharded = next(s for s in self._sharded if s is not None and s.local is zoe_group)
        super()._write_slots(_ShardSlice(sharded), params, master_of, per_param)

    def close(self):
        for sharded in self._sharded:
            if sharded is not None:
                sharded.close()
        super().close()


_CLASSES = {}


def sharded_class(base):
    """The sharded subclass of a zoe optimizer class (one per class)."""
    if base not in _CLASSES:
        _CLASSES[base] = type(base.__name__, (ZeroMixin, base), {"__module__": base.__module__,
                                                                  "__doc__": base.__doc__})
    return _CLASSES[base]

