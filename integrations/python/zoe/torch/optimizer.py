"""zoe.torch.AdamW and zoe.torch.Adam: torch.optim.Optimizer subclasses whose state (fp32 master
weights, exp_avg, exp_avg_sq) lives in a zoe engine, in pinned DRAM or on NVMe as the engine's
configuration says. Each param group is one zoe optimizer group: the group's parameters,
concatenated in order, are its elements, each parameter one segment of the group with its own step
count (torch's state[p]['step']), and a step hands zoe one buffer view per parameter (gradients
in, updated parameters out, in the parameters' own dtype). A parameter whose .grad is None is
skipped as torch skips it: a gradient view without data, which leaves its state, its step count
and the parameter untouched and keeps it out of the gradient norm.

Zero copy. A param group of fp32, contiguous CPU parameters whose state is in DRAM
(offload="cpu") keeps no separate master by default: the parameters' own storage is the master
(zoe group option master="params", as DeepSpeed's CPU Adam keeps it), updated in place by the
step's kernel pass, so the group saves 4 bytes per parameter and the write-back copy, with the same
bits as the copy form. The optimizer holds a reference to each parameter's storage for the group's
life; a step or checkpoint after a parameter's storage was replaced (param.data = ...) is refused
with FailedPrecondition naming it. ``zero_copy=False`` keeps a copy; ``zero_copy=True`` insists
(InvalidArgument naming the first parameter or setting that prevents it)."""

import contextlib
import json
import math
import os
import re
import tempfile

import torch

from .. import _capi
from .._collective_ops import agreed
from ..engine import BufferView, Engine, HyperParams, StepResult
from ..errors import FailedPrecondition, NotFound
from . import device
from .common import _DTYPES, _invalid, _pager_of, _view
from .config import _check_group_options, _check_type_agrees, _optimizer_engine_config
from .zero import sharded_class


def _current_values(param):
    """A parameter's values as a contiguous tensor (a copy for a paged parameter)."""
    pager = _pager_of(param)
    if pager is None:
        return param.detach().cpu()
    with pager.held(param, _capi.Access.READ) as view:
        return view.clone()


@contextlib.contextmanager
def _writable(param):
    """The tensor to write a parameter's new values into (acquired when paged)."""
    pager = _pager_of(param)
    if pager is None:
        yield param.detach()
        return
    with pager.held(param, _capi.Access.WRITE) as view:
        yield view


def _grad_view(grad, param):
    """The BufferView of a gradient, or for None one without data: no gradient for the
    parameter's elements in this step."""
    if grad is None:
        return BufferView(0, _DTYPES[param.dtype], param.numel())
    return _view(grad)


def _param_views(group_index, params):
    """BufferViews of a group's parameters, which must be contiguous when stepped."""
    for index, param in enumerate(params):
        if not param.is_contiguous():
            raise _invalid(
                f"parameter {index} of param group {group_index} is not contiguous; zoe "
                "optimizers step contiguous parameters"
            )
    return [_view(param) for param in params]


class _ZoeAdamBase(torch.optim.Optimizer):
    """The shared implementation of AdamW (decoupled weight decay) and Adam (L2)."""

    _ZOE_TYPE = None  # "AdamW" or "Adam"

    def __new__(cls, *args, process_group=None, zero_stage=None, **kwargs):
        """With ``process_group`` or ``zero_stage``: the optimizer sharded across the group's
        ranks (ZeRO stages 1 and 2, zoe/torch/zero.py)."""
        if (process_group is None and zero_stage is None) or getattr(cls, "_zoe_sharded", False):
            return super().__new__(cls)
        return super().__new__(sharded_class(cls))

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0.0,
        amsgrad=False,
        *,
        engine=None,
        config=None,
        offload=None,
        nvme_path=None,
        moment_dtype=None,
        max_grad_norm=None,
        name="zoe",
        maximize=False,
        foreach=None,
        capturable=False,
        device_backend=None,
        speculative=False,
        zero_copy=None,
    ):
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        for index, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"Invalid beta parameter at index {index}: {beta}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if max_grad_norm is not None and not 0.0 <= max_grad_norm:
            raise ValueError(f"Invalid max_grad_norm value: {max_grad_norm}")
        _check_group_options(dict(amsgrad=amsgrad, maximize=maximize, capturable=capturable),
                             "the optimizer", self._ZOE_TYPE)
        if zero_copy not in (None, True, False):
            raise _invalid(
                f"zero_copy = {zero_copy!r} is not allowed; allowed: None (auto), True, False"
            )
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise _invalid(f"optimizer name {name!r} must be letters, digits, '_', '.', '-'")
        self._name = name
        self._moment_dtype = moment_dtype
        # None: the engine configuration's gradient_clipping; 0.0: no clipping
        self._max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self._speculative = bool(speculative)
        self._zero_copy = zero_copy
        self._owns_engine = engine is None
        self._device_backend = device_backend
        if engine is not None and (config is not None or offload is not None or nvme_path):
            raise _invalid(
                "engine= comes with its own configuration; config, offload and nvme_path apply "
                "only to the engine an optimizer creates, so give either engine or those"
            )
        params, staging_swap = device.listed_params(params, device_backend)
        if engine is None:
            arguments = {
                "zoe.moment_dtype": (moment_dtype, "moment_dtype"),
                "gradient_clipping": (self._max_grad_norm, "max_grad_norm"),
                "optimizer.params.lr": (lr, "lr"),
                "optimizer.params.betas": (list(betas), "betas"),
                "optimizer.params.eps": (eps, "eps"),
                "optimizer.params.weight_decay": (weight_decay, "weight_decay"),
            }
            document = _optimizer_engine_config(config, offload, nvme_path, arguments, staging_swap)
        self._engine = engine or Engine(document)
        if engine is None:
            try:
                _check_type_agrees(document, self._engine, self._ZOE_TYPE)
            except BaseException:
                self._engine.close()
                raise
        self._device_groups = []  # per param group: device.DeviceGroup, None on the CPU
        self._zoe_groups = []  # per param group: zoe OptimizerGroup, created at its first use
        self._versions = []  # per param group: the parameters' version counters after our write
        self._pending = []  # per param group: a loaded state to apply when the group is created
        # per param group: under zero copy, the parameters' tensors whose storage is the master
        # (kept alive here), else None
        self._masters = []
        self.last_step = []  # per param group: the StepResult of the latest step (None: none)
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=False,
            foreach=foreach,
            maximize=False,
            capturable=False,
        )
        try:
            super().__init__(params, defaults)
            if self._speculative and all(group is None for group in self._device_groups):
                raise _invalid(
                    "speculative=True applies to param groups stepped on a device (CUDA "
                    "parameters, or device_backend=zoe.torch.HostTwin()); every group here is "
                    "stepped on the CPU, where gradients reach zoe only at step()"
                )
        except BaseException:
            self.close()
            raise

    # --- lifetime --------------------------------------------------------------------------

    @property
    def engine(self):
        """The zoe engine holding the state."""
        return self._engine

    def close(self):
        """Closes the engine when the optimizer created it (idempotent)."""
        for device_group in getattr(self, "_device_groups", []):
            if device_group is not None:
                device_group.close()
        if self._owns_engine:
            self._engine.close()

    def __getstate__(self):
        raise TypeError(
            "zoe optimizers hold state in a zoe engine and cannot be pickled; "
            "use state_dict() or save_checkpoint()"
        )

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
        _check_group_options(param_group, f"param group {group_index}", self._ZOE_TYPE)
        for index, param in enumerate(params):
            self._check_param(param, f"parameter {index} of param group {group_index}")
        backend = device.backend_for(group_index, params, self._device_backend)
        super().add_param_group(param_group)
        self._device_groups.append(
            None if backend is None else device.DeviceGroup(self, group_index, backend)
        )
        self._zoe_groups.append(None)
        self._masters.append(None)
        self._versions.append(None)
        self._pending.append(None)
        self.last_step.append(None)

    def _check_param(self, param, where):
        """InvalidArgument for a parameter this optimizer cannot step (checked before its param
        group is added): a dtype zoe does not take, or a stage 3 shard (ShardedParameterPager
        over several ranks) in an optimizer that would clip, by this rank's shard's norm alone."""
        if param.dtype not in _DTYPES:
            raise _invalid(
                f"{where} has dtype {param.dtype}; zoe optimizers take torch.float32, "
                "torch.bfloat16 or torch.float16"
            )
        world_size = getattr(_pager_of(param), "world_size", 1)
        if world_size <= 1:
            return
        clipping = self._max_grad_norm
        if clipping is None:
            clipping = self._engine.config.get("gradient_clipping", 0.0)
        if clipping:
            raise _invalid(
                f"{where} is a shard of a ShardedParameterPager over {world_size} ranks, and "
                f"this optimizer would clip at {clipping} by this rank's shard's norm alone; clip "
                "with pager.clip_grad_norm_(max_norm) (the global norm), and leave max_grad_norm "
                'unset with the engine\'s gradient_clipping 0 or "auto"'
            )

    def _group_name(self, group_index):
        return f"{self._name}.{group_index}"

    def _zoe_group(self, group_index):
        """The zoe group of a param group, created from the parameters' current values."""
        zoe_group = self._zoe_groups[group_index]
        if zoe_group is not None:
            return zoe_group
        group = self.param_groups[group_index]
        zero_copy = self._zero_copy_group(group_index)
        if zero_copy:
            params = [param.detach() for param in group["params"]]
        else:
            params = [_current_values(param) for param in group["params"]]
        zoe_group = self._engine.optimizer_group(
            self._group_name(group_index),
            _param_views(group_index, params),
            type=self._ZOE_TYPE,
            lr=float(group["lr"]),
            betas=list(group["betas"]),
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            max_grad_norm=self._max_grad_norm,
            moment_dtype=self._moment_dtype,
            segments=[param.numel() for param in group["params"]],
            speculative=True if self._speculative_group(group_index) else None,
            master="params" if zero_copy else None,
        )
        self._zoe_groups[group_index] = zoe_group
        self._masters[group_index] = params if zero_copy else None
        self._record_versions(group_index)
        pending, self._pending[group_index] = self._pending[group_index], None
        if pending is not None:
            self._apply_state(group_index, pending)
        return zoe_group

    def _zero_copy_group(self, group_index):
        """Whether a param group's parameters are its master (see "Zero copy")."""
        if self._zero_copy is False:
            return False
        obstacle = self._zero_copy_obstacle(group_index)
        if obstacle is not None and self._zero_copy:
            raise _invalid(f"zero_copy=True: {obstacle}")
        return obstacle is None

    def _zero_copy_obstacle(self, group_index):
        """Why a param group cannot step zero-copy, or None."""
        if self._device_groups[group_index] is not None:
            return f"param group {group_index} steps on a device; zero copy takes CPU parameters"
        section = self._engine.config["zero_optimization"]["offload_optimizer"]
        if section["device"] == "nvme" and section.get("ratio", 1.0) > 0:
            return "the optimizer state is on NVMe; zero copy needs it in DRAM (offload='cpu')"
        for index, param in enumerate(self.param_groups[group_index]["params"]):
            where = f"parameter {index} of param group {group_index}"
            if _pager_of(param) is not None:
                return f"{where} is paged; zero copy takes resident parameters"
            if param.dtype != torch.float32:
                return f"{where} is {param.dtype}; zero copy takes torch.float32 parameters"
            if param.device.type != "cpu" or not param.is_contiguous():
                return f"{where} is not a contiguous CPU tensor"
        return None

    def _check_masters(self, group_index):
        """FailedPrecondition when a zero-copy parameter's storage was replaced since the group
        was created (the group would keep updating the old storage)."""
        masters = self._masters[group_index]
        if masters is None:
            return
        params = self.param_groups[group_index]["params"]
        for index, (param, master) in enumerate(zip(params, masters)):
            if param.data_ptr() != master.data_ptr():
                raise FailedPrecondition(
                    _capi.Status.FAILED_PRECONDITION,
                    f"parameter {index} of param group {group_index} no longer uses the storage "
                    "that is its master (zero copy): its storage was replaced (param.data = ...?) "
                    "after the first step; write new values in place (param.copy_(...)) or create "
                    "the optimizer with zero_copy=False",
                )

    def _speculative_group(self, group_index):
        """Whether a param group's steps speculate: asked for, and the group takes the device
        path (only there do gradients reach zoe during backward)."""
        return self._speculative and self._device_groups[group_index] is not None

    def _record_versions(self, group_index):
        params = self.param_groups[group_index]["params"]
        self._versions[group_index] = [
            None if _pager_of(param) else param._version for param in params
        ]

    def _sync_external_writes(self, group_index):
        """Copies parameters written outside the optimizer (their version counter moved, e.g.
        by model.load_state_dict) into the master weights before the step."""
        params = self.param_groups[group_index]["params"]
        recorded = self._versions[group_index]
        if recorded is not None and len(recorded) != len(params):
            raise FailedPrecondition(
                _capi.Status.FAILED_PRECONDITION,
                f"param group {group_index} changed its parameter list after its first step",
            )
        if self._masters[group_index] is not None:
            return  # zero copy: a write into a parameter is a write into its master
        offset = 0
        for param, version in zip(params, recorded or []):
            if version is not None and param._version != version:
                values = param.detach().to("cpu", torch.float32).contiguous().view(-1)
                self._zoe_groups[group_index].write_state(
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
        if pager is not None and pager.any_gradient_nonfinite():
            for group_index in range(len(self.param_groups)):
                self.last_step[group_index] = self._agreed_skip(group_index)
            return loss
        if pager is None:
            self._step_groups()
            return loss
        agreed(f"the step of optimizer {self._name!r} (the ranks that did not fail took it; "
               "resume every rank from a checkpoint)", self._step_groups, pager.group)
        return loss

    def _step_groups(self):
        for group_index, group in enumerate(self.param_groups):
            self._step_group(group_index, group)

    def _sharded_pager(self):
        """The ShardedParameterPager over several ranks whose shards this optimizer steps (stage
        3), or None. Its ranks skip a step together when any rank's gradient is inf/NaN: each
        optimizer sees only its own shard's."""
        pagers = {}
        for group in self.param_groups:
            for param in group["params"]:
                pager = _pager_of(param)
                if getattr(pager, "world_size", 1) > 1:
                    pagers[id(pager)] = pager
        if len(pagers) > 1:
            raise _invalid("the optimizer steps shards of several ShardedParameterPagers; give "
                           "each pager's shards an optimizer of their own")
        return next(iter(pagers.values()), None)

    def _agreed_skip(self, group_index):
        """The StepResult of a step skipped because another rank's gradient was inf/NaN."""
        zoe_group = self._zoe_groups[group_index]
        return StepResult(skipped=True, grad_norm=math.inf,
                          steps_taken=0 if zoe_group is None else zoe_group.steps,
                          bytes_read=0, bytes_written=0, seconds=0.0)

    def _step_group(self, group_index, group):
        """One param group's step, on its device or on the host."""
        if self._device_groups[group_index] is not None:
            self._device_step(group_index, group)
            return
        self._step_host_group(group_index, group)

    def _step_host_group(self, group_index, group):
        """The step of a param group zoe steps from host gradients: none when no parameter has
        a gradient (last_step None), else the group's state created, parameters written
        outside the optimizer taken into the master, the zoe step and its StepResult in
        last_step. The sharded optimizer (zero.py) supplies its own _group_grads and
        _step_zoe."""
        grads = self._group_grads(group_index, group)
        if grads is None:
            self.last_step[group_index] = None
            return
        zoe_group = self._zoe_group(group_index)
        self._check_masters(group_index)
        self._sync_external_writes(group_index)
        self.last_step[group_index] = self._step_zoe(group_index, group, zoe_group, grads)
        self._record_versions(group_index)

    def _step_zoe(self, group_index, group, zoe_group, grads):
        """zoe's step of one group on ``grads`` (None for a parameter without a gradient)."""
        params = [param.detach() for param in group["params"]]
        paged = any(_pager_of(param) for param in group["params"])
        zero_copy = self._masters[group_index] is not None
        result = zoe_group.step(
            self._step_hyper(group_index),
            grads=[_grad_view(grad, param) for grad, param in zip(grads, params)],
            params_out=[] if paged or zero_copy else _param_views(group_index, params),
        )
        if paged and not result.skipped:
            self._write_back(group_index, present=[grad is not None for grad in grads])
        return result

    def _device_step(self, group_index, group):
        """The step of a param group on a device (see device.py)."""
        device_group = self._device_groups[group_index]
        if not device_group.has_grads():
            self.last_step[group_index] = None
            return
        self._zoe_group(group_index)
        self.last_step[group_index] = device_group.step(self._step_hyper(group_index))
        self._record_versions(group_index)

    def _step_hyper(self, group_index):
        """The hyper-parameters the next step of a param group takes (as set now)."""
        group = self.param_groups[group_index]
        _check_group_options(group, f"param group {group_index}", self._ZOE_TYPE)
        beta1, beta2 = group["betas"]
        return HyperParams(float(group["lr"]), beta1, beta2, group["eps"], group["weight_decay"])

    def overlap(self):
        """A context manager around the backward that ends a gradient accumulation: while it
        is open, each device parameter's gradient is copied to the host as soon as it is final
        and handed to zoe, which starts reading its state during backward. Without it, step()
        copies the gradients after backward. CPU param groups are not affected."""
        return device.overlap(self._device_groups)

    def _write_back(self, group_index, present=None):
        """Copies the master weights into the parameters one at a time (paged parameters are
        acquired for writing one by one, so the group never needs to fit in DRAM at once);
        ``present``: per parameter, whether to write it (None: all)."""
        zoe_group = self._zoe_groups[group_index]
        if self._masters[group_index] is not None:
            return  # zero copy: the parameters are the master
        params = self.param_groups[group_index]["params"]
        offset = 0
        for index, param in enumerate(params):
            n = param.numel()
            if present is not None and not present[index]:
                offset += n
                continue
            with _writable(param) as target:
                on_host = target.device.type == "cpu"
                if target.dtype == torch.float32 and target.is_contiguous() and on_host:
                    zoe_group.read_state(_capi.StateSlot.MASTER, offset, n, target.data_ptr())
                else:
                    values = torch.empty(n, dtype=torch.float32)
                    zoe_group.read_state(_capi.StateSlot.MASTER, offset, n, values.data_ptr())
                    target.copy_(values.view_as(target))
            offset += n

    @staticmethod
    def _group_grads(group_index, group):
        """The group's gradients as contiguous CPU tensors, None for a parameter without one
        (skipped, as torch skips it); None when no parameter has one."""
        params = group["params"]
        if all(param.grad is None for param in params):
            return None
        grads = []
        for index, param in enumerate(params):
            grad = param.grad
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

    # --- state dicts -----------------------------------------------------------------------

    def _read_slot(self, zoe_group, slot, count):
        values = torch.empty(count, dtype=torch.float32)
        zoe_group.read_state(slot, 0, count, values.data_ptr())
        return values

    def state_dict(self):
        """torch's layout: per parameter 'step' (a float32 scalar tensor), 'exp_avg' and
        'exp_avg_sq' (float32, the parameter's shape), plus 'master_param' for bfloat16 and
        float16 parameters (the fp32 master weights; torch's optimizers keep it untouched)."""
        packed_groups, state, next_index = [], {}, 0
        for group_index, group in enumerate(self.param_groups):
            params = group["params"]
            packed = {key: value for key, value in group.items() if key != "params"}
            packed["params"] = list(range(next_index, next_index + len(params)))
            packed_groups.append(packed)
            per_param = self._group_state(group_index)
            for offset, param_state in enumerate(per_param):
                if param_state is not None:
                    state[next_index + offset] = param_state
            next_index += len(params)
        return {"state": state, "param_groups": packed_groups}

    def _group_state(self, group_index):
        """[per-parameter state dict or None] of one group."""
        params = self.param_groups[group_index]["params"]
        if self._pending[group_index] is not None:
            return self._pending[group_index]
        zoe_group = self._zoe_groups[group_index]
        if zoe_group is None or zoe_group.steps == 0:
            return [None] * len(params)
        count = sum(param.numel() for param in params)
        slots = {
            "exp_avg": self._read_slot(zoe_group, _capi.StateSlot.EXP_AVG, count),
            "exp_avg_sq": self._read_slot(zoe_group, _capi.StateSlot.EXP_AVG_SQ, count),
        }
        master = None
        if any(param.dtype != torch.float32 for param in params):
            master = self._read_slot(zoe_group, _capi.StateSlot.MASTER, count)
        result, offset = [], 0
        for param, steps in zip(params, zoe_group.segment_steps):
            n = param.numel()
            if steps == 0:  # never stepped: torch keeps no state for it either
                result.append(None)
                offset += n
                continue
            entry = {"step": torch.tensor(float(steps))}
            for key, values in slots.items():
                entry[key] = values[offset : offset + n].view_as(param).clone()
            if param.dtype != torch.float32:
                entry["master_param"] = master[offset : offset + n].view_as(param).clone()
            result.append(entry)
            offset += n
        return result

    def load_state_dict(self, state_dict):
        """Loads a state dict of this optimizer or of torch's Adam/AdamW (same groups and
        parameter counts). The state is applied when the group's zoe state exists (at once, or
        at the group's first step, so parameters loaded afterwards still seed the master)."""
        groups = self.param_groups
        saved_groups = state_dict["param_groups"]
        if len(groups) != len(saved_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        for group, saved in zip(groups, saved_groups):
            if len(group["params"]) != len(saved["params"]):
                raise ValueError(
                    "loaded state dict contains a parameter group that doesn't match the size "
                    "of optimizer's group"
                )
        for group_index, saved in enumerate(saved_groups):
            _check_group_options(saved, f"param group {group_index} of the loaded state dict",
                                 self._ZOE_TYPE)
        saved_state = state_dict["state"]
        # Every parameter's state is checked before anything changes: a refused state dict
        # leaves the optimizer as it was.
        loaded = [
            [
                self._checked_param_state(group_index, index, param, saved_state.get(key))
                for index, (param, key) in enumerate(zip(group["params"], saved["params"]))
            ]
            for group_index, (group, saved) in enumerate(zip(groups, saved_groups))
        ]
        for group_index, (group, saved, per_param) in enumerate(
                zip(groups, saved_groups, loaded)):
            for key, value in saved.items():
                if key != "params":
                    group[key] = value
            group["betas"] = tuple(group["betas"])
            if self._zoe_groups[group_index] is None:
                self._pending[group_index] = per_param
            else:
                self._apply_state(group_index, per_param)

    @staticmethod
    def _checked_param_state(group_index, index, param, param_state):
        if not param_state:
            return None
        where = f"state of parameter {index} of param group {group_index}"
        for key in ("step", "exp_avg", "exp_avg_sq"):
            if key not in param_state:
                raise ValueError(f"{where} lacks {key!r}")
        if "max_exp_avg_sq" in param_state:
            raise _invalid(f"{where} holds max_exp_avg_sq (amsgrad), which zoe optimizers do "
                           "not keep")
        for key in ("exp_avg", "exp_avg_sq", "master_param"):
            if key in param_state and param_state[key].shape != param.shape:
                raise ValueError(
                    f"{where}: {key} has shape {tuple(param_state[key].shape)}, the parameter "
                    f"{tuple(param.shape)}"
                )
        # A copy, as torch's load_state_dict takes one: the state may be applied at the group's
        # first step, after the optimizer it came from has updated its tensors in place.
        return {
            key: value.detach().clone() if isinstance(value, torch.Tensor) else value
            for key, value in param_state.items()
        }

    def _apply_state(self, group_index, per_param):
        """Writes a loaded per-parameter state into the group's zoe state."""
        zoe_group = self._zoe_groups[group_index]
        params = self.param_groups[group_index]["params"]
        # One step count per parameter, as torch keeps them; a parameter without state (never
        # stepped) starts again from 0 with zero moments.
        steps = [0 if entry is None else int(float(entry["step"])) for entry in per_param]

        def master_of(param, entry):
            # The master is taken only while it still rounds to the parameter (else the
            # parameter was changed after the state was saved, and the parameter wins).
            master = entry.get("master_param")
            if master is None or param.dtype == torch.float32:
                return None
            master = master.to(torch.float32)
            return master if torch.equal(master.to(param.dtype), _current_values(param)) else None

        self._write_slots(zoe_group, params, master_of, per_param)
        zoe_group.segment_steps = steps

    def _write_slots(self, zoe_group, params, master_of, per_param):
        count = sum(param.numel() for param in params)
        exp_avg = torch.zeros(count, dtype=torch.float32)
        exp_avg_sq = torch.zeros(count, dtype=torch.float32)
        master = torch.empty(count, dtype=torch.float32)
        offset = 0
        for param, entry in zip(params, per_param):
            n = param.numel()
            if entry is not None:
                exp_avg[offset : offset + n] = entry["exp_avg"].reshape(-1).to(torch.float32)
                exp_avg_sq[offset : offset + n] = entry["exp_avg_sq"].reshape(-1).float()
            saved_master = master_of(param, entry) if entry is not None else None
            source = saved_master if saved_master is not None else _current_values(param)
            master[offset : offset + n] = source.reshape(-1).to(torch.float32)
            offset += n
        slots = [(_capi.StateSlot.EXP_AVG, exp_avg), (_capi.StateSlot.EXP_AVG_SQ, exp_avg_sq)]
        # Zero copy: the master is the parameters themselves, which hold it already.
        if not getattr(zoe_group, "master_in_params", False):
            slots.append((_capi.StateSlot.MASTER, master))
        for slot, values in slots:
            zoe_group.write_state(slot, 0, count, values.data_ptr())

    # --- streaming checkpoints -------------------------------------------------------------

    _META = "zoe_torch_param_groups.json"

    def save_checkpoint(self, directory):
        """Saves the whole optimizer state to ``directory`` without holding it in RAM: every
        group's master weights, moments and step count are streamed by the engine
        (zoe_checkpoint_save, crash-safe), the param groups' hyper-parameters go to a JSON file
        beside them. Creates the groups' state first where no step has been taken."""
        for group_index in range(len(self.param_groups)):
            self._zoe_group(group_index)
            self._check_masters(group_index)
        self._engine.save_checkpoint(directory)
        groups = [
            {key: value for key, value in group.items() if key != "params"}
            for group in self.param_groups
        ]
        descriptor, temporary = tempfile.mkstemp(dir=directory, prefix=".tmp-")
        with os.fdopen(descriptor, "w", encoding="utf-8") as file:
            json.dump({"name": self._name, "param_groups": groups}, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, os.path.join(directory, self._META))

    @torch.no_grad()
    def load_checkpoint(self, directory):
        """Loads a checkpoint written by save_checkpoint for the same param groups, and sets the
        parameters to the loaded master weights (cast to their dtype)."""
        meta_path = os.path.join(directory, self._META)
        if not os.path.exists(meta_path):
            raise NotFound(
                _capi.Status.NOT_FOUND, f"{directory!r} holds no zoe optimizer checkpoint"
            )
        with open(meta_path, encoding="utf-8") as file:
            meta = json.load(file)
        if len(meta["param_groups"]) != len(self.param_groups):
            raise ValueError("the checkpoint has a different number of parameter groups")
        for group_index in range(len(self.param_groups)):
            self._zoe_group(group_index)
            self._check_masters(group_index)
        self._engine.load_checkpoint(directory)
        for group, saved in zip(self.param_groups, meta["param_groups"]):
            group.update(saved)
            group["betas"] = tuple(group["betas"])
        for group_index in range(len(self.param_groups)):
            self._write_back(group_index)
            self._record_versions(group_index)


class AdamW(_ZoeAdamBase):
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
    same bits as without; HOST-placed state then needs a second pinned copy)."""

    _ZOE_TYPE = "AdamW"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, **options):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **options)


class Adam(_ZoeAdamBase):
    """torch.optim.Adam (L2 weight decay added to the gradient) with its state offloaded
    through zoe; arguments as AdamW's."""

    _ZOE_TYPE = "Adam"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, **options):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **options)
