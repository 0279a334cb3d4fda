"""zoe.torch.AdamW, Adam, Adagrad and Lion: torch.optim.Optimizer subclasses whose state (fp32
master weights and the kind's moments: optim_kinds.py) lives in a zoe engine, in pinned DRAM or on
NVMe as the engine's configuration says. One class steps every kind; each subclass only names its
kind and takes its torch counterpart's arguments. Each param group is one zoe optimizer group: the
group's parameters, concatenated in order, are its elements, each parameter one segment of the
group with its own step count (torch's state[p]['step']), and a step hands zoe one buffer view per
parameter (gradients in, updated parameters out, in the parameters' own dtype). A parameter whose
.grad is None is skipped as torch skips it: a gradient view without data, which leaves its state,
its step count and the parameter untouched and keeps it out of the gradient norm.

Zero copy. A param group of fp32, contiguous CPU parameters whose state is in DRAM
(offload="cpu") keeps no separate master by default: the parameters' own storage is the master
(zoe group option master="params", as DeepSpeed's CPU Adam keeps it), updated in place by the
step's kernel pass, so the group saves 4 bytes per parameter and the write-back copy, with the same
bits as the copy form. The optimizer holds a reference to each parameter's storage for the group's
life; a step or checkpoint after a parameter's storage was replaced (param.data = ...) is refused
with FailedPrecondition naming it. ``zero_copy=False`` keeps a copy; ``zero_copy=True`` insists
(InvalidArgument naming the first parameter or setting that prevents it).

ZeRO stages 1 and 2. With ``process_group`` (or ``zero_stage``) the optimizer holds a
zero.ZeroPartition, which shards each param group across the group's ranks: it reduces the
gradients, steps this rank's shard and gathers the parameters, and it saves and loads the
sharded state (zero.py). Everything else is this class's, for both.

Per param group the optimizer keeps one GroupState (param_group.py), in ``self._groups``."""

import contextlib
import math
import re

import torch

from .. import _capi
from .._collective_ops import agreed
from ..engine import BufferView, Engine
from ..errors import FailedPrecondition
from . import device
from .checkpoint import load_param_groups, save_param_groups
from .common import (_DTYPES, _current_values, _in_host_memory, _invalid, _pager_of, _view,
                     _writable)
from .config import _check_group_options, _check_type_agrees, _optimizer_engine_config
from .grad_accumulation import GradientAccumulation
from .global_clip import GlobalClip, grads_sum_squares
from .grad_stream import GradStream, clip_coefficient, combined_result, is_finite
from .param_group import GroupState
from .param_memory import (check_contiguous, check_no_shared_memory, group_params_named,
                           params_named)
from .stage3_checks import check_optimizer_parameter
from .optim_kinds import ADAGRAD, ADAM, ADAMW, LION
from .state_layout import (check_group_counts, checked_param_state, loaded_steps,
                           packed_state_dict, param_entries, read_slot, unstepped_entry,
                           write_slots)
from .zero import ShardSlice, ZeroPartition


def _grad_view(grad, param):
    """The BufferView of a gradient, or for None one without data: no gradient for the
    parameter's elements in this step."""
    if grad is None:
        return _absent_view(param)
    return _view(grad)


def _absent_view(param):
    """A BufferView without data covering a parameter's elements."""
    return BufferView(0, _DTYPES[param.dtype], param.numel())


def _param_views(group_index, params):
    """BufferViews of a group's parameters (a BufferView given is taken as it is), which must be
    contiguous when stepped."""
    check_contiguous(named for named in params_named(group_index, params)
                     if not isinstance(named[1], BufferView))
    return [param if isinstance(param, BufferView) else _view(param) for param in params]


def _stage3_shards(params):
    """``params`` (tensors or param-group dicts, read once) with every parameter of a model a
    ShardedParameterPager shards replaced by this rank's shard of it (dropped when empty), and
    that pager's process group (None when there is none)."""
    if isinstance(params, torch.Tensor):
        return params, None
    params = list(params)
    groups = params if params and isinstance(params[0], dict) else [{"params": params}]
    pagers = {}
    for group in groups:
        inner = group["params"]
        inner = [inner] if isinstance(inner, torch.Tensor) else list(inner)
        shards = []
        for param in inner:
            pager = getattr(param, "_zoe_sharded_pager", None)
            if pager is None:
                shards.append(param)
                continue
            pagers[id(pager)] = pager
            shard = pager.shard_of(param)
            if shard is not None:
                shards.append(shard)
        group["params"] = shards
    if not pagers:
        return params, None
    if len(pagers) > 1:
        raise _invalid("the parameters belong to models of several ShardedParameterPagers; give "
                       "each pager's model an optimizer of its own")
    return (params if isinstance(params[0], dict) else groups[0]["params"],
            next(iter(pagers.values())).group)


def _checked_stage3_group(process_group, zero_stage, pager_group):
    """None (the pager shards; the optimizer steps its shards) when ``process_group`` is None
    or the pager's and ``zero_stage`` is None or 3; else InvalidArgument naming the fix."""
    if process_group is not None and process_group is not pager_group:
        raise _invalid("the parameters are sharded by a ShardedParameterPager over another "
                       "process group; give process_group=None or the pager's")
    if zero_stage not in (None, 3):
        raise _invalid(f"zero_stage={zero_stage!r}: the parameters are sharded by a "
                       "ShardedParameterPager (ZeRO stage 3), whose optimizer steps this rank's "
                       "shards; leave zero_stage unset")
    return None


def _check_zoe_arguments(zero_copy, name):
    """InvalidArgument for a zero_copy or optimizer name zoe does not take."""
    if zero_copy not in (None, True, False):
        raise _invalid(
            f"zero_copy = {zero_copy!r} is not allowed; allowed: None (auto), True, False"
        )
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise _invalid(f"optimizer name {name!r} must be letters, digits, '_', '.', '-'")


def _host_grads(group_index, params, accumulation):
    """A param group's gradients (``accumulation``'s: grad_accumulation.py) as contiguous CPU
    tensors, None for a parameter without one (skipped, as torch skips it); None when no
    parameter has one."""
    if not any(accumulation.present(param) for param in params):
        return None
    grads = []
    for index, param in enumerate(params):
        grad = accumulation.gradient(param)
        if grad is None:
            grads.append(None)
            continue
        if grad.is_sparse:
            raise _invalid(f"parameter {index} of param group {group_index}: sparse gradient")
        if grad.dtype not in _DTYPES or grad.device.type != "cpu":
            raise _invalid(
                f"gradient of parameter {index} of param group {group_index} is "
                f"{grad.dtype} on {grad.device}; expected a CPU float tensor"
            )
        grads.append(grad.contiguous())
    return grads


def _accumulation_for(grad_accum_dtype, stage3_group):
    """The optimizer's GradientAccumulation; over stage 3's shards (``stage3_group`` not None)
    a grad_accum_dtype is refused: their gradients add up in fp32 stores already."""
    if stage3_group is not None and grad_accum_dtype is not None:
        raise _invalid("grad_accum_dtype applies to ordinary parameters (ZeRO stages 0 to 2): "
                       "the gradients of a ShardedParameterPager's shards (stage 3) add up in "
                       "the optimizer's fp32 gradient stores already; leave it out")
    return GradientAccumulation(grad_accum_dtype)


class ZoeOptimizer(torch.optim.Optimizer):
    """The implementation of every zoe.torch optimizer; a subclass names its kind (_KIND, an
    optim_kinds.OptimizerKind) and maps its torch counterpart's arguments onto ``hyper`` (the
    kind's hyper_keys) and ``flags`` (torch's switches zoe's step does not do, refused when
    set)."""

    _KIND = None

    def __init__(self, params, hyper, flags, *, engine=None, config=None, offload=None,
                 nvme_path=None, moment_dtype=None, max_grad_norm=None, name="zoe",
                 foreach=None, fused=None, device_backend=None, speculative=None,
                 zero_copy=None, process_group=None, zero_stage=None, bucket_elements=None,
                 grad_accum_dtype=None):
        """Arguments as documented on AdamW; ``process_group``, ``zero_stage`` and
        ``bucket_elements`` (None: 4 Mi elements) shard it (zero.ZeroPartition);
        ``grad_accum_dtype``: where micro-batches add up (grad_accumulation.py). The parameters
        of a model a ShardedParameterPager shards stand for this rank's shards of them (ZeRO
        stage 3: the pager shards them; ``process_group``, when given, must be the pager's)."""
        params, stage3_group = _stage3_shards(params)
        if stage3_group is not None:
            process_group = _checked_stage3_group(process_group, zero_stage, stage3_group)
        self._accumulation = _accumulation_for(grad_accum_dtype, stage3_group)
        self._zero = ZeroPartition.for_arguments(
            process_group, zero_stage, bucket_elements, config, engine,
            dict(zero_copy=zero_copy, speculative=speculative, device_backend=device_backend),
            self._accumulation)
        if self._zero is not None:
            config = self._zero.config_with_rank(config)
            nvme_path = self._zero.path_with_rank(nvme_path)
        self._KIND.check(hyper)
        if max_grad_norm is not None and not 0.0 <= max_grad_norm:
            raise ValueError(f"Invalid max_grad_norm value: {max_grad_norm}")
        _check_group_options(flags, "the optimizer", self._KIND)
        _check_zoe_arguments(zero_copy, name)
        self._name = name
        self._moment_dtype = moment_dtype
        # None: the engine configuration's gradient_clipping; 0.0: no clipping
        self._max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self._last_grad_norm = None  # the latest step's, all groups together (last_grad_norm)
        self._grad_scale = 1.0  # the factor the gradients carry (grad_scale)
        self._speculative_asked = speculative  # None: the engine configuration decides
        self._zero_copy = zero_copy
        self._owns_engine = engine is None
        self._device_backend = device_backend
        if engine is not None and (config is not None or offload is not None or nvme_path):
            raise _invalid(
                "engine= comes with its own configuration; config, offload and nvme_path apply "
                "only to the engine an optimizer creates, so give either engine or those"
            )
        staging = (self._zero.staging_bytes if self._zero is not None else
                   lambda group: device.staging_bytes(group, self._accumulation))
        params, staging_swap = device.listed_params(params, device_backend, staging)
        if engine is None:
            engine = self._created_engine(config, offload, nvme_path, hyper, staging_swap)
        self._engine = engine
        # whether device param groups speculate: the argument, else the configuration's
        self._speculative = bool(engine.config["zoe"].get("speculative", False)
                                 if speculative is None else speculative)
        self._groups = []  # per param group: its GroupState
        defaults = dict(self._KIND.normalized(dict(hyper)), foreach=foreach, **flags)
        if fused is not None:  # torch 2.x: its fused kernels; zoe steps with its own
            defaults["fused"] = fused
        try:
            super().__init__(params, defaults)
            self._check_speculative()
        except BaseException:
            self.close()
            raise

    @classmethod
    def check_param_groups(cls, param_groups):
        """InvalidArgument for a param group (a dict; None: none) that this optimizer would
        refuse (an option zoe's step does not do), checked before anything is built over it."""
        for index, param_group in enumerate(param_groups or []):
            _check_group_options(param_group, f"param group {index}", cls._KIND)

    def _created_engine(self, config, offload, nvme_path, hyper, staging_swap):
        """The engine this optimizer creates and owns (see _optimizer_engine_config), checked
        to step the kind this class is."""
        arguments = {
            "zoe.moment_dtype": (self._moment_dtype, "moment_dtype"),
            "gradient_clipping": (self._max_grad_norm, "max_grad_norm"),
        }
        for key, value in hyper.items():
            given = list(value) if isinstance(value, tuple) else value
            arguments[f"optimizer.params.{key}"] = (given, key)
        document = _optimizer_engine_config(config, offload, nvme_path, arguments, staging_swap)
        engine = Engine(document)
        try:
            _check_type_agrees(document, engine, self._KIND.name)
        except BaseException:
            engine.close()
            raise
        return engine

    def _check_speculative(self):
        """InvalidArgument for speculative=True when no param group takes the device path."""
        if self._speculative_asked and all(state.device is None for state in self._groups):
            raise _invalid(
                "speculative=True applies to param groups stepped on a device (CUDA "
                "parameters, or device_backend=zoe.torch.HostTwin()); every group here is "
                "stepped on the CPU, where gradients reach zoe only at step()"
            )

    # --- lifetime --------------------------------------------------------------------------

    @property
    def engine(self):
        """The zoe engine holding the state."""
        return self._engine

    @property
    def kind(self):
        """The optimizer this is (optim_kinds.OptimizerKind)."""
        return self._KIND

    @property
    def last_step(self):
        """Per param group: the StepResult of its latest step (None: no gradient, or no step)."""
        return [state.last_step for state in self._groups]

    @property
    def last_grad_norm(self):
        """The norm of every gradient the latest step took, all param groups (and ranks)
        together, before clipping and divided by grad_scale, as clip_grad_norm_ returns it; inf
        or NaN for a skipped step; None before the first step with gradients."""
        return self._last_grad_norm

    @property
    def grad_scale(self):
        """The factor the gradients in ``.grad`` carry, 1.0 unless set: fp16 loss scaling's
        scale of the backward that produced them (zoe.torch.initialize's engine sets it in
        backward). Every step divides the gradients by it in fp32 (zoe's loss_scale) together
        with the clip factor, so clipping, ``last_grad_norm`` and the update see the unscaled
        gradients while ``.grad`` keeps the scaled ones, as DeepSpeed's fp16 optimizers."""
        return self._grad_scale

    @grad_scale.setter
    def grad_scale(self, value):
        value = float(value)
        if not (value > 0.0 and math.isfinite(value)):
            raise _invalid(f"grad_scale {value} is out of range; allowed: (0, inf)")
        self._grad_scale = value

    def close(self):
        """Closes the engine when the optimizer created it (idempotent)."""
        groups = getattr(self, "_groups", [])
        if self._zero is not None:
            self._zero.close(groups)
        for state in groups:
            if state.device is not None:
                state.device.close()
            if state.stream is not None:
                state.stream.close()
        if self._owns_engine:
            self._engine.close()

    def __getstate__(self):
        raise TypeError(
            "zoe optimizers hold state in a zoe engine and cannot be pickled; "
            "use state_dict() or save_checkpoint()"
        )

    # --- ZeRO stages 1 and 2 (only with a process_group) ------------------------------------

    def _partition(self, attribute):
        """The ZeroPartition; AttributeError naming ``attribute`` when the optimizer is not
        sharded (as for any attribute an object lacks)."""
        if self._zero is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute "
                                 f"{attribute!r} (it is a sharded optimizer's: process_group=)")
        return self._zero

    @property
    def zero_stage(self):
        """The ZeRO stage: 1 or 2 (stage 3's optimizer is stage 2's)."""
        return self._partition("zero_stage").stage

    @property
    def rank(self):
        return self._partition("rank").rank

    @property
    def world_size(self):
        return self._partition("world_size").world_size

    @property
    def collective_seconds(self):
        """Wall seconds this rank spent inside the optimizer's collectives (gradient
        reductions, the agreed norm and outcome, the parameters' all-gather) since creation."""
        return self._partition("collective_seconds").comm.seconds

    @property
    def collective_calls(self):
        """How many collectives the optimizer ran on this rank since creation."""
        return self._partition("collective_calls").comm.calls

    # --- param groups ----------------------------------------------------------------------

    def add_param_group(self, param_group):
        """As torch's; parameters must be contiguous float32/bfloat16/float16 tensors, on the
        CPU or on one CUDA device per group (or on the CPU twin given as device_backend). A
        group that asks for what zoe's step does not do (amsgrad, maximize, capturable, a
        moment dtype or clipping of its own) is refused rather than stepped without it."""
        group_index = len(self.param_groups)
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        param_group["params"] = params  # a generator is read once, here
        _check_group_options(param_group, f"param group {group_index}", self._KIND)
        for index, param in enumerate(params):
            self._check_param(param, f"parameter {index} of param group {group_index}")
        check_no_shared_memory(group_params_named(
            [group["params"] for group in self.param_groups] + [params]))
        backend = device.backend_for(group_index, params, self._device_backend)
        super().add_param_group(param_group)
        state = GroupState(group_index, self.param_groups[group_index])
        if backend is not None and self._zero is None:
            state.device = device.DeviceGroup(self, group_index, backend)
        self._groups.append(state)
        if self._zero is not None:
            self._zero.add_group(self, state, backend)
        elif GradStream.wanted(params):
            state.stream = GradStream(params, self._group_name(group_index))

    def _check_param(self, param, where):
        """InvalidArgument for a parameter this optimizer cannot step (checked before its param
        group is added): a dtype zoe does not take, a stage 3 parameter or shard under ZeRO
        stage 1 or 2 (stage3_checks), and what ZeroPartition.check_param refuses."""
        if param.dtype not in _DTYPES:
            raise _invalid(
                f"{where} has dtype {param.dtype}; zoe optimizers take torch.float32, "
                "torch.bfloat16 or torch.float16"
            )
        check_optimizer_parameter(param, where, getattr(self._zero, "stage", None))
        if self._zero is not None:
            self._zero.check_param(param, where)

    def _group_name(self, group_index):
        return f"{self._name}.{group_index}"

    def _group_options(self, state):
        """The zoe group options of a param group, as its hyper-parameters are now."""
        group = state.group
        # zoe clips a lone group itself; a streamed one, and each of several (by their global
        # norm: _global_clip), by the factor its step gives zoe
        lone = len(self.param_groups) == 1 and state.stream is None
        clipping = self._max_grad_norm if lone else 0.0
        return dict(self._KIND.group_options(group), max_grad_norm=clipping,
                    moment_dtype=self._moment_dtype,
                    segments=[param.numel() for param in state.params])

    def _zoe_group(self, state):
        """The zoe group of a param group, created from the parameters' current values at its
        first use (under ZeRO, this rank's part, created by every rank together)."""
        if state.zoe_group is not None:
            return state.zoe_group
        name, options = self._group_name(state.index), self._group_options(state)
        if self._zero is not None:
            state.zoe_group = self._zero.create_group(self._engine, name, state, options)
        else:
            self._create_local_group(state, name, options)
        state.record_versions()
        state.creation_values = self._KIND.creation_values(state.group)
        pending, state.pending = state.pending, None
        if pending is not None:
            self._apply_state(state, pending)
        return state.zoe_group

    def _create_local_group(self, state, name, options):
        """Creates the (unsharded) zoe group of a param group, zero copy where it can. Paged
        parameters are left out of the creation (their master weights start at zero) and
        written one at a time afterwards, so the group never needs them all in memory."""
        zero_copy = self._zero_copy_group(state)
        if zero_copy:
            params = [param.detach() for param in state.params]
        else:
            params = [None if _pager_of(param) else _current_values(param)
                      for param in state.params]
        views = [_absent_view(param) if values is None else values
                 for param, values in zip(state.params, params)]
        state.zoe_group = self._engine.optimizer_group(
            name, _param_views(state.index, views), **options,
            speculative=True if self._speculative_group(state) else None,
            master="params" if zero_copy else None,
        )
        state.masters = params if zero_copy else None
        self._write_paged_masters(state)

    def _write_paged_masters(self, state):
        """Writes each paged parameter's values into the group's master weights, one parameter
        at a time, from its HOST copy (pager.held_on_host) converted to fp32."""
        for param, offset in zip(state.params, state.offsets()):
            pager = _pager_of(param)
            if pager is None:
                continue
            flat = torch.empty(param.numel(), dtype=torch.float32)
            with pager.held_on_host(param, _capi.Access.READ) as values:
                flat.copy_(values.reshape(-1))
            state.zoe_group.write_state(_capi.StateSlot.MASTER, offset, flat.numel(),
                                        flat.data_ptr())

    def _zero_copy_group(self, state):
        """Whether a param group's parameters are its master (see "Zero copy")."""
        if self._zero_copy is False:
            return False
        obstacle = self._zero_copy_obstacle(state)
        if obstacle is not None and self._zero_copy:
            raise _invalid(f"zero_copy=True: {obstacle}")
        return obstacle is None

    def _zero_copy_obstacle(self, state):
        """Why a param group cannot step zero-copy, or None."""
        if state.device is not None:
            return f"param group {state.index} steps on a device; zero copy takes CPU parameters"
        section = self._engine.config["zero_optimization"]["offload_optimizer"]
        if section["device"] == "nvme" and section.get("ratio", 1.0) > 0:
            return "the optimizer state is on NVMe; zero copy needs it in DRAM (offload='cpu')"
        for index, param in enumerate(state.params):
            where = f"parameter {index} of param group {state.index}"
            if _pager_of(param) is not None:
                return f"{where} is paged; zero copy takes resident parameters"
            if param.dtype != torch.float32:
                return f"{where} is {param.dtype}; zero copy takes torch.float32 parameters"
            if param.device.type != "cpu" or not param.is_contiguous():
                return f"{where} is not a contiguous CPU tensor"
        return None

    def _check_masters(self, state):
        """FailedPrecondition when a zero-copy parameter's storage was replaced since the group
        was created (the group would keep updating the old storage)."""
        if not state.zero_copy:
            return
        for index, (param, master) in enumerate(zip(state.params, state.masters)):
            if param.data_ptr() != master.data_ptr():
                raise FailedPrecondition(
                    _capi.Status.FAILED_PRECONDITION,
                    f"parameter {index} of param group {state.index} no longer uses the storage "
                    "that is its master (zero copy): its storage was replaced (param.data = ...?) "
                    "after the first step; write new values in place (param.copy_(...)) or create "
                    "the optimizer with zero_copy=False",
                )

    def _speculative_group(self, state):
        """Whether a param group's steps speculate: asked for (speculative=True, or left None
        under the engine configuration's zoe.speculative: true), and the group takes the device
        path (only there do gradients reach zoe during backward)."""
        return self._speculative and state.device is not None

    def _sync_external_writes(self, state):
        """Copies parameters written outside the optimizer (their version counter moved, e.g.
        by model.load_state_dict) into the master weights before the step (under ZeRO, their
        slices in this rank's shard)."""
        if self._zero is not None:
            self._zero.sync_external_writes(state)
            return
        recorded = state.versions
        if recorded is not None and len(recorded) != len(state.params):
            raise FailedPrecondition(
                _capi.Status.FAILED_PRECONDITION,
                f"param group {state.index} changed its parameter list after its first step",
            )
        if state.zero_copy:
            return  # zero copy: a write into a parameter is a write into its master
        offset = 0
        for param, version in zip(state.params, recorded or []):
            if version is not None and param._version != version:
                values = param.detach().to("cpu", torch.float32).contiguous().view(-1)
                state.zoe_group.write_state(
                    _capi.StateSlot.MASTER, offset, values.numel(), values.data_ptr()
                )
            offset += param.numel()

    # --- the step --------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        """One step of every param group that has gradients; returns the closure's loss. Over
        the shards of a ShardedParameterPager (stage 3) the ranks agree on the step's outcome:
        when it fails on some rank (zoe's step, or writing the updated shard), every rank raises,
        naming the failing ranks (that rank its own error as zoe's, the others zoe.Aborted), and
        the ranks stay paired for their next collective. The ranks that did not fail have taken
        the step."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        pager = self._sharded_pager()
        self._take_stream_norms()
        if pager is None:
            self._step_groups()
            return loss
        agreed(f"the step of optimizer {self._name!r} (the ranks that did not fail took it; "
               "resume every rank from a checkpoint)", self._step_groups, pager.group)
        return loss

    def _step_groups(self):
        """Every group's step; when one fails, every group drops the iteration before raising
        (a device group what it handed to zoe, a sharded optimizer through
        ZeroPartition.abandon_iteration): none keeps gradients that the next iteration would
        take or add to, and step() again gathers them anew from .grad."""
        try:
            if self._zero is not None:
                self._zero.reduce_for_step(self, self._groups)
            clip = self._global_clip()
            for state in self._groups:
                self._step_group(state, clip)
                if clip is not None and state.last_step is not None and state.stream is None:
                    # zoe saw the gradients clipped (a streamed group reports its own norm)
                    state.last_step = clip.unscaled(state.last_step)
            self._last_grad_norm = self._grad_norm_taken(clip)
        except BaseException:
            for state in self._groups:
                if state.device is not None:
                    with contextlib.suppress(Exception):  # the failure raised says what failed
                        state.device.discard()
            if self._zero is not None:
                self._zero.abandon_iteration(self._groups)
            raise

    def _take_stream_norms(self):
        """Each streamed group's global gradient norm, before any group steps: over a sharded
        pager's ranks these are collectives, which every rank makes in the same order whatever
        its step then does."""
        for state in self._groups:
            if state.stream is not None:
                state.stream_norm = state.stream.global_norm(state.params)

    def _sharded_pager(self):
        """The ShardedParameterPager over several ranks whose shards this optimizer steps (stage
        3), or None. Its ranks skip a step together when any rank's gradient is inf/NaN: each
        optimizer sees only its own shard's."""
        pagers = {}
        for state in self._groups:
            for param in state.params:
                pager = _pager_of(param)
                if getattr(pager, "world_size", 1) > 1:
                    pagers[id(pager)] = pager
        if len(pagers) > 1:
            raise _invalid("the optimizer steps shards of several ShardedParameterPagers; give "
                           "each pager's shards an optimizer of their own")
        return next(iter(pagers.values()), None)

    def _global_clip(self):
        """With several param groups, their step by the norm of every gradient (over the ranks
        too): clipped by it when clipping, as clip_grad_norm_ over all the parameters and
        DeepSpeed's gradient_clipping, and skipped as a whole when it is inf or NaN, so that no
        group steps while another skips (an engine taking the skip as an fp16 overflow finds
        none stepped) -- global_clip.py; None for a lone group, which clips and skips itself in
        zoe's step, reading its gradients once."""
        if len(self._groups) < 2:
            return None
        return GlobalClip.of(self._groups_sum_squares(), self._clip_norm(), self._grad_scale)

    def _groups_sum_squares(self):
        """The sum of squares of every group's gradients as they are (times grad_scale): zoe's
        scan of those handed to it, torch's norms of the rest; a sharded optimizer's over every
        rank (one all-reduce), a streamed group's (stage 3) over its pager's ranks already."""
        if self._zero is not None:
            return self._zero.grad_sum_squares(self._groups)
        total = 0.0
        for state in self._groups:
            if state.device is not None:
                total += state.device.grad_sum_squares()
            elif state.stream is not None:
                total += float(state.stream_norm) ** 2
            else:
                grads = _host_grads(state.index, state.params, self._accumulation)
                total += grads_sum_squares(grads or [])
        return total

    def _grad_norm_taken(self, clip):
        """The global norm of the step just taken: the clip's, else that of the groups' norms
        (each over the ranks already); None when no group had a gradient."""
        if clip is not None:
            return clip.norm
        norms = [state.last_step.grad_norm for state in self._groups
                 if state.last_step is not None]
        return math.sqrt(math.fsum(norm * norm for norm in norms)) if norms else None

    def _step_group(self, state, clip=None):
        """One param group's step: on its device, sharded across the ranks (every rank
        together; the reduced gradients and the buckets' counts are dropped whatever happens),
        or on the host; under ``clip`` (a GlobalClip, or None), scaled by it or dropped. zoe
        divides the gradients by grad_scale times the clip's loss_scale."""
        if clip is not None and clip.skip:
            self._drop_group_step(state, clip.norm)
            return
        loss_scale = self._grad_scale * (1.0 if clip is None else clip.loss_scale)
        if state.device is not None:
            self._device_step(state, loss_scale)
            return
        if state.stream is not None:
            self._step_streamed(state, clip)
            return
        if self._zero is None:
            self._step_host_group(state, loss_scale)
            return
        try:
            self._step_host_group(state, loss_scale)
        finally:
            self._zero.end_iteration(state)

    def _drop_group_step(self, state, norm):
        """A group's part of a step skipped as a whole (the global norm is inf or NaN): the
        gradients handed to zoe are dropped, the group's state stays as it was."""
        if state.device is not None:
            state.device.discard()
        elif state.stream is not None:
            state.stream.clear()
        elif self._zero is not None:
            try:
                self._zero.discard(state)
            finally:
                self._zero.end_iteration(state)
        steps = state.zoe_group.steps if state.zoe_group is not None else 0
        state.last_step = combined_result([], norm, True, steps)

    def _step_host_group(self, state, loss_scale=1.0):
        """The step of a param group zoe steps from host gradients: none when no parameter has
        a gradient (last_step None), else the group's state created, parameters written
        outside the optimizer taken into the master, the zoe step and its StepResult in
        last_step. Under ZeRO the gradients are the ranks' reduced ones, already with zoe."""
        if self._zero is not None:  # reduced for every group before any steps (_step_groups)
            grads = [] if state.shard.has_grads else None
        else:
            grads = _host_grads(state.index, state.params, self._accumulation)
        if grads is None:
            state.last_step = None
            return
        zoe_group = self._zoe_group(state)
        self._check_masters(state)
        self._sync_external_writes(state)
        state.last_step = self._step_zoe(state, zoe_group, grads, loss_scale)
        state.record_versions()

    def _step_streamed(self, state, clip=None):
        """The step of a param group whose paged parameters' gradients were streamed out of
        backward (grad_stream.py): skipped when the global norm is inf/NaN (every rank of a
        sharded pager together), else stepped window by window, unscaled by grad_scale and
        clipped by the global norm of the unscaled gradients."""
        stream, params = state.stream, state.params
        stream.check_usable()
        norm, state.stream_norm = state.stream_norm / self._grad_scale, None
        if not stream.any_present(params):
            state.last_step = None
            return
        zoe_group = self._zoe_group(state)
        self._sync_external_writes(state)
        steps = max(zoe_group.segment_steps, default=0)
        if not is_finite(norm):
            stream.clear()
            state.last_step = combined_result([], norm, True, steps)
            return
        loss_scale = self._grad_scale * (1.0 / clip_coefficient(norm, self._clip_norm())
                                         if clip is None else clip.loss_scale)
        results = stream.step(params, zoe_group, self._step_hyper(state), loss_scale,
                              lambda present: self._write_back(state, present))
        state.last_step = combined_result(results, norm, False,
                                          max(zoe_group.segment_steps, default=0))
        state.record_versions()

    def _clip_norm(self):
        """The max_grad_norm this optimizer clips to (0.0: none): its own, else the engine
        configuration's gradient_clipping."""
        if self._max_grad_norm is not None:
            return self._max_grad_norm
        clipping = self._engine.config.get("gradient_clipping", 0.0)
        return clipping if isinstance(clipping, (int, float)) else 0.0

    def holds_streamed_gradients(self):
        """Whether gradients streamed out of backward (paged parameters: stage 3) wait for a
        step."""
        return any(state.stream is not None and state.stream.any_present(state.params)
                   for state in self._groups)

    def drop_streamed_gradients(self):
        """Drops the gradients streamed out of backward that wait for a step."""
        for state in self._groups:
            if state.stream is not None:
                state.stream.clear()

    def zero_grad(self, *args, **kwargs):
        """As torch's; streamed gradients (paged parameters) and fp32 sums of micro-batches
        (grad_accum_dtype) are dropped too."""
        super().zero_grad(*args, **kwargs)
        self.drop_streamed_gradients()
        self._accumulation.clear()

    @property
    def accumulation(self):
        """Where the micro-batches' gradients add up (grad_accumulation.GradientAccumulation):
        every reader of the gradients of this optimizer's parameters reads them there."""
        return self._accumulation

    def _step_zoe(self, state, zoe_group, grads, loss_scale):
        """zoe's step of one group on ``grads`` (None for a parameter without a gradient),
        divided by ``loss_scale``; under ZeRO this rank's shard, then every rank's parameters
        gathered."""
        params = [param.detach() for param in state.params]
        if self._zero is not None:
            return self._zero.step(state, self._step_hyper(state), params, loss_scale)
        paged = any(_pager_of(param) for param in state.params)
        result = zoe_group.step(
            self._step_hyper(state),
            grads=[_grad_view(grad, param) for grad, param in zip(grads, params)],
            params_out=[] if paged or state.zero_copy else _param_views(state.index, params),
            loss_scale=loss_scale,
        )
        if paged and not result.skipped:
            self._write_back(state, present=[grad is not None for grad in grads])
        return result

    def _device_step(self, state, loss_scale=1.0):
        """The step of a param group on a device (see device.py)."""
        if not state.device.has_grads():
            state.last_step = None
            return
        self._zoe_group(state)
        state.last_step = state.device.step(self._step_hyper(state), loss_scale)
        state.record_versions()

    def _step_hyper(self, state):
        """The hyper-parameters the next step of a param group takes (as set now);
        InvalidArgument when a value zoe fixed at the group's creation changed since."""
        group = state.group
        _check_group_options(group, f"param group {state.index}", self._KIND)
        changed = self._KIND.changed_creation_values(state.creation_values or (), group)
        if changed:
            listed = ", ".join(f"{key} from {before!r} to {after!r}"
                               for key, before, after in changed)
            raise _invalid(f"param group {state.index} changed {listed} after zoe created its "
                           "state, which fixes it: create a new optimizer (and load this one's "
                           "state_dict into it) to change it")
        return self._KIND.hyper(group)

    def overlap(self):
        """A context manager around the backward that ends a gradient accumulation: while it
        is open, each device parameter's gradient is copied to the host as soon as it is final
        and handed to zoe, which starts reading its state during backward. Without it, step()
        copies the gradients after backward. CPU param groups are not affected."""
        return device.overlap([state.device for state in self._groups])

    @contextlib.contextmanager
    def no_sync(self):
        """A context manager around the backwards of a gradient accumulation's micro-batches
        before its last, as DistributedDataParallel.no_sync: with ZeRO stage 2 their gradients
        add up instead of being reduced bucket by bucket, and the last backward, outside,
        reduces the sums (stage 1 reduces at step()). They add up in ``.grad``, or with
        grad_accum_dtype=torch.float32 in fp32 sums, into which each closing no_sync() moves
        ``.grad``."""
        held = contextlib.nullcontext() if self._zero is None else self._zero.no_sync(self._groups)
        with held:
            yield
        self._accumulation.fold(param for state in self._groups for param in state.params)

    def _write_back(self, state, present=None):
        """Copies the master weights into the parameters one at a time (paged parameters are
        acquired for writing one by one, so the group never needs to fit in DRAM at once);
        ``present``: per parameter, whether to write it (None: all)."""
        if state.zero_copy:
            return  # zero copy: the parameters are the master
        offset = 0
        for index, param in enumerate(state.params):
            n = param.numel()
            if present is None or present[index]:
                with _writable(param) as target:
                    self._read_master(state.zoe_group, offset, target, _in_host_memory(param))
            offset += n

    @staticmethod
    def _read_master(zoe_group, offset, target, in_host_memory):
        """Reads ``target.numel()`` master weights from element ``offset`` into ``target``:
        straight into it when it is fp32 and contiguous in host memory (_in_host_memory),
        else through a host copy."""
        n = target.numel()
        if target.dtype == torch.float32 and target.is_contiguous() and in_host_memory:
            zoe_group.read_state(_capi.StateSlot.MASTER, offset, n, target.data_ptr())
            return
        values = torch.empty(n, dtype=torch.float32)
        zoe_group.read_state(_capi.StateSlot.MASTER, offset, n, values.data_ptr())
        target.copy_(values.view_as(target))

    # --- state dicts -----------------------------------------------------------------------

    def state_dict(self):
        """torch's layout (state_layout.py): per parameter 'step' and the kind's moments ('exp_avg'
        and 'exp_avg_sq' for Adam/AdamW), plus 'master_param' for bfloat16 and float16 parameters
        (the fp32 master weights; torch's optimizers keep it untouched). Under ZeRO every rank's
        shard is gathered, so every rank returns the same dict (every rank calls it; memory: the
        whole state of one param group at a time)."""
        if self._zero is not None:
            self._create_groups()
            entries = (self._zero.gathered_state(state, self._KIND) for state in self._groups)
        else:
            entries = (self._group_state(state) for state in self._groups)
        return packed_state_dict(self.param_groups, entries)

    def _create_groups(self):
        """Creates every param group's zoe group that does not exist yet (_held_groups)."""
        for state in self._held_groups():
            self._zoe_group(state)

    def _held_groups(self):
        """The param groups that hold parameters: a group of none (Hugging Face's no-decay
        group when nothing is left out of weight decay; at stage 3 a group of frozen
        parameters only) has no zoe group, and checkpoints and state dicts keep nothing of it
        but its hyper-parameters."""
        return [state for state in self._groups if state.params]

    def _group_state(self, state):
        """[per-parameter state dict or None] of one (unsharded) group."""
        if state.pending is not None:
            return state.pending
        zoe_group = state.zoe_group
        if zoe_group is None or zoe_group.steps == 0:
            return [unstepped_entry(self._KIND, param.shape) for param in state.params]
        count = state.element_count()
        wanted = self._KIND.slots(
            with_master=any(param.dtype != torch.float32 for param in state.params))
        slots = {key: read_slot(zoe_group, slot, count) for key, slot in wanted}
        return param_entries(self._KIND, state.params, slots, zoe_group.segment_steps)

    def load_state_dict(self, state_dict):
        """Loads a state dict of this optimizer or of its torch counterpart (same groups and
        parameter counts). The state is applied when the group's zoe state exists (at once, or
        at the group's first step, so parameters loaded afterwards still seed the master).
        Under ZeRO (every rank calls it) the dict may come from any world size, or from an
        unsharded optimizer: each rank takes its shard's slice."""
        if self._zero is not None:
            self._create_groups()
        saved_groups = state_dict["param_groups"]
        check_group_counts(self.param_groups, saved_groups)
        self.check_loadable(saved_groups, "the loaded state dict")
        saved_state = state_dict["state"]
        # Every parameter's state is checked before anything changes: a refused state dict
        # leaves the optimizer as it was.
        loaded = [
            [checked_param_state(self._KIND, state.index, index, param, saved_state.get(key))
             for index, (param, key) in enumerate(zip(state.params, saved["params"]))]
            for state, saved in zip(self._groups, saved_groups)
        ]
        for state, saved, per_param in zip(self._groups, saved_groups, loaded):
            for key, value in saved.items():
                if key != "params":
                    state.group[key] = value
            self._KIND.normalized(state.group)
            if state.zoe_group is None:
                state.pending = per_param
            else:
                self._apply_state(state, per_param)
        self.loaded_whole_state()

    def _apply_state(self, state, per_param):
        """Writes a loaded per-parameter state into the group's zoe state (under ZeRO, the
        rank's shard of it)."""
        target = state.zoe_group if self._zero is None else ShardSlice(state.shard.sharded)
        write_slots(self._KIND, target, state.params, per_param)
        state.zoe_group.segment_steps = loaded_steps(per_param)

    # --- streaming checkpoints -------------------------------------------------------------

    def save_checkpoint(self, directory):
        """Saves the whole optimizer state to ``directory`` without holding it in RAM: every
        group's master weights, moments and step count are streamed by the engine
        (zoe_checkpoint_save, crash-safe), the param groups' hyper-parameters go to a JSON file
        beside them. Creates the groups' state first where no step has been taken. Under ZeRO
        every rank saves its shard and rank 0 the manifest (ZeroPartition.save_checkpoint)."""
        if self._zero is not None:
            self._create_groups()
            self._zero.save_checkpoint(self, directory)
            return
        for state in self._held_groups():
            self._zoe_group(state)
            self._check_masters(state)
        self._engine.save_checkpoint(directory)
        save_param_groups(directory, self._name, self._hyper_parameters(), self._KIND.name)

    def _hyper_parameters(self):
        """Per param group, everything but its parameters (what a checkpoint keeps of it)."""
        return [{key: value for key, value in group.items() if key != "params"}
                for group in self.param_groups]

    def check_loadable(self, saved_groups, where, kind_name=None, created_now=False):
        """InvalidArgument, before anything changes, for saved param groups (a state dict's or a
        checkpoint's, ``where``) this optimizer cannot take: another kind's (``kind_name``, the
        kind a checkpoint names; None: not named), a group that asks for what zoe's step does
        not do or holds another kind's hyper-parameter, or a value zoe fixes when it creates a
        group's state (Adagrad's lr_decay) other than the one the group is created with
        (``created_now``: a checkpoint load, which creates the groups not created yet from the
        param groups as they are)."""
        if kind_name is not None and kind_name != self._KIND.name:
            raise _invalid(f"{where} is of zoe.torch.{kind_name}; this optimizer is "
                           f"zoe.torch.{self._KIND.name}: load it into a zoe.torch.{kind_name}")
        for state, saved in zip(self._groups, saved_groups):
            label = f"param group {state.index} of {where}"
            _check_group_options(saved, label, self._KIND)
            fixed = state.creation_values
            if fixed is None and created_now:
                fixed = self._KIND.creation_values(state.group)
            changed = self._KIND.changed_creation_values(fixed or (), saved)
            if changed:
                key, value, saved_value = changed[0]
                raise _invalid(f"{label} has {key} = {saved_value!r}, and zoe fixes it when it "
                               f"creates the state: this optimizer's is {value!r}; construct the "
                               f"optimizer with {key}={saved_value!r} to load it")

    def _take_hyper_parameters(self, saved_groups):
        """Sets the param groups' hyper-parameters to a checkpoint's (_hyper_parameters)."""
        for group, saved in zip(self.param_groups, saved_groups):
            group.update(saved)
            self._KIND.normalized(group)

    @torch.no_grad()
    def load_checkpoint(self, directory):
        """Loads a checkpoint written by save_checkpoint for the same param groups, and sets the
        parameters to the loaded master weights (cast to their dtype). Under ZeRO every rank
        loads its shard of the save the manifest names (ZeroPartition.load_checkpoint)."""
        if self._zero is not None:
            self._create_groups()
            self._zero.load_checkpoint(self, directory)
            return
        saved_groups, kind_name = load_param_groups(directory)
        if len(saved_groups) != len(self.param_groups):
            raise ValueError("the checkpoint has a different number of parameter groups")
        self.check_loadable(saved_groups, f"the checkpoint in {directory!r}", kind_name,
                            created_now=True)
        for state in self._held_groups():
            self._zoe_group(state)
            self._check_masters(state)
        self._engine.load_checkpoint(directory)
        self._take_hyper_parameters(saved_groups)
        for state in self._groups:
            self._write_back(state)
            state.record_versions()
        self.loaded_whole_state()

    @torch.no_grad()
    def write_back_masters(self):
        """Sets every stepped parameter to its master weights again (after a load wrote the
        parameters once the optimizer's checkpoint had set them); under ZeRO every rank
        gathers the master weights (a collective: every rank calls it)."""
        for state in self._groups:
            if state.zoe_group is None:
                continue
            if self._zero is not None:
                self._zero._gather_master(state)
            else:
                self._write_back(state)
            state.record_versions()

    def loaded_whole_state(self):
        """Called once every param group's state was loaded (a checkpoint): a streamed group
        that a failed step left partly stepped steps again, and gradients held are dropped."""
        for state in self._groups:
            if state.stream is not None:
                state.stream.broken = None
                state.stream.clear()


class AdamW(ZoeOptimizer):
    """torch.optim.AdamW with its state offloaded through zoe (decoupled weight decay).

    Arguments as torch's, plus keyword-only ``engine`` (a zoe.Engine; else one is created from
    ``config``, a DeepSpeed-shaped configuration such as Hugging Face's ds_config_zero3.json whose
    "auto" values take this optimizer's arguments, or from ``offload`` = "cpu" | "nvme" and
    ``nvme_path``), ``moment_dtype`` ("fp32" | "bf16" | "int8": block-wise quantized, state_dict
    still holds fp32 moments; None, the default: the engine configuration's zoe.moment_dtype, fp32
    unless set there; with ``engine`` a value given is this optimizer's own, with ``config`` one
    that contradicts the config's is refused),
    ``max_grad_norm`` (None, the default: the engine configuration's gradient_clipping, none
    unless set; 0: no clipping), ``name`` (unique per engine; names the zoe groups in
    checkpoints) and ``device_backend`` (a zoe.torch.HostTwin: CPU parameters take the device
    path on the CPU twin; parameters on CUDA take it without one, see ``overlap()``) and
    ``speculative`` (device param groups: inside ``overlap()`` zoe updates each chunk as soon as
    its gradients arrive and the step commits, recomputes or discards those updates, with the
    same bits as without; HOST-placed state then needs a second pinned copy; None, the default,
    takes the engine configuration's ``zoe.speculative``, false unless set there) and
    ``grad_accum_dtype`` (None, the default: a gradient accumulation's micro-batches add up in
    ``.grad``, in the parameters' dtype, as torch's; torch.float32: each ``no_sync()`` closing
    moves ``.grad`` into an fp32 sum, so bf16 or fp16 micro-batches add up in fp32, as
    DeepSpeed's ``data_types.grad_accum_dtype``). torch's
    ``foreach`` and ``fused`` (its implementations of the step) are taken and ignored; its
    ``amsgrad``, ``maximize``, ``capturable`` and ``differentiable`` are refused when true."""

    _KIND = ADAMW

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, capturable=False, differentiable=False,
                 **options):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay),
                         dict(amsgrad=amsgrad, maximize=maximize, capturable=capturable,
                              differentiable=differentiable), **options)


class Adam(ZoeOptimizer):
    """torch.optim.Adam (L2 weight decay added to the gradient) with its state offloaded
    through zoe; arguments as AdamW's."""

    _KIND = ADAM

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, *, maximize=False, capturable=False, differentiable=False,
                 **options):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay),
                         dict(amsgrad=amsgrad, maximize=maximize, capturable=capturable,
                              differentiable=differentiable), **options)


class Adagrad(ZoeOptimizer):
    """torch.optim.Adagrad (L2 weight decay added to the gradient, the rate lr / (1 + (step - 1)
    lr_decay)) with its state, the sum of squared gradients ('sum'), offloaded through zoe;
    arguments as torch's, and the keyword-only ones of AdamW. The sums start at 0:
    ``initial_accumulator_value`` other than 0 is refused (as DeepSpeed's CPU Adagrad has
    none), and ``lr_decay`` is fixed once the first step created the state."""

    _KIND = ADAGRAD

    def __init__(self, params, lr=1e-2, lr_decay=0.0, weight_decay=0.0,
                 initial_accumulator_value=0.0, eps=1e-10, foreach=None, *, maximize=False,
                 differentiable=False, **options):
        super().__init__(params, dict(lr=lr, lr_decay=lr_decay, eps=eps,
                                      weight_decay=weight_decay),
                         dict(initial_accumulator_value=initial_accumulator_value,
                              maximize=maximize, differentiable=differentiable),
                         foreach=foreach, **options)


class Lion(ZoeOptimizer):
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms") with its state,
    the momentum ('exp_avg'), offloaded through zoe: the update is the sign of beta1 m +
    (1 - beta1) g, weight decay decoupled (p <- p (1 - lr wd) - lr sign(...)), then m <- beta2 m
    + (1 - beta2) g. Defaults as the lion-pytorch package's (lr 1e-4, betas (0.9, 0.99));
    keyword-only arguments as AdamW's."""

    _KIND = LION

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, **options):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay), {},
                         **options)


# The zoe.torch optimizer classes by their kind's name.
OPTIMIZERS = {cls._KIND.name: cls for cls in (AdamW, Adam, Adagrad, Lion)}
