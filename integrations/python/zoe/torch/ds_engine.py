"""The engine zoe.torch.initialize returns: DeepSpeed's training-loop API over a module, a torch
optimizer (a zoe.torch optimizer, or a plain torch optimizer at stage 0), a learning-rate
schedule and, under fp16, a loss scaler.

Contract, as DeepSpeed's engine:
- The engine is a ``torch.nn.Module`` whose one submodule, ``module``, is the model:
  ``parameters()``, ``named_modules()``, ``state_dict()`` (keys ``module.<name>``) and the rest
  of nn.Module's API see the model through it, and an attribute the engine does not have is the
  model's (DeepSpeed's ``__getattr__``). ``train()`` and ``eval()`` set the mode of both and
  return None, as DeepSpeed's.
- ``engine(*inputs)`` runs the module.
- ``backward(loss)`` divides the loss by gradient_accumulation_steps (and multiplies it by the
  loss scale under fp16; a hook on each parameter divides its incoming gradient by the scale,
  so ``.grad`` always holds unscaled gradients) and runs backward; on the boundary micro-batch
  inside the optimizer's overlap() (_overlapped).
- ``step()`` is called after every micro-batch and steps only at the accumulation boundary
  (``is_gradient_accumulation_boundary()``: counted from ``micro_steps``, or as
  ``set_gradient_accumulation_boundary`` last set it, which backward's holding of stage 2's
  reductions and its overlap follow too): it averages the gradients over the ranks (stage 0;
  zoe's ZeRO optimizer reduces its own at stages 1 and 2, the pager at stage 3), steps the
  optimizer (zoe's clip to gradient_clipping and skip a non-finite step on every rank by
  themselves, which is the fp16 overflow; for a torch optimizer the engine agrees the overflow
  over the ranks and clips), steps the schedule unless the step overflowed, updates the loss scale
  and zeroes the gradients. ``global_steps`` counts boundaries (skipped ones too, as
  DeepSpeed's), ``micro_steps`` step() calls, ``skipped_steps`` overflows; was_step_applied()
  says whether the latest step() changed the parameters. ``tput_timer`` times forward to step().
- ``save_checkpoint`` / ``load_checkpoint``: tagged, crash-safe folders (ds_checkpoint.py)
  holding the module, the optimizer (zoe's streaming checkpoint, sharded under ZeRO), the
  schedule, the loss scaler, the counters and the client state, and the checksums of the files
  zoe's optimizer does not checksum itself (ds_checksums.py). Every step of a save or a load is
  agreed over the ranks. A failed save removes what it wrote and keeps the saves before it; a
  load checks everything first (ds_load.py), then loads the optimizer (all or nothing), the
  module, the schedule, the loss scale and the counters: a failed load changes nothing. A load
  without the optimizer's state (load_module_only, load_optimizer_states=False) loads the
  module's parameters, at stage 3 into the pages (ds_stage3.py), and the optimizer's master
  weights follow them.
  ``save_16bit_model``: the module's full state dict, written atomically by rank 0.

ZeRO stage 2 with accumulation: zoe's stage 2 reduces a bucket as soon as its gradients are
final in a backward; the engine holds those reductions back during the backwards that do not end
an accumulation, so the one that does reduces the accumulated gradients."""

import contextlib
import os
import time
import types
import warnings

import torch
import torch.distributed as dist

from .._collective_ops import agreed
from . import ds_checkpoint, ds_checksums, ds_load
from .checkpoint import saved_param_groups
from .common import _invalid, _timed
from .ds_stage3 import check_module_state
from .optimizer import ZoeOptimizer

MODEL_STATES = ds_checkpoint.MODEL_STATES
OPTIMIZER_DIR = ds_load.OPTIMIZER_DIR
TORCH_OPTIMIZER = ds_load.TORCH_OPTIMIZER
_ABSENT = object()
log = ds_checkpoint.log


def local_rank_from_environment():
    """DeepSpeed's local_rank: LOCAL_RANK (set by launchers, torchrun and
    deepspeed.init_distributed), else OMPI_COMM_WORLD_LOCAL_RANK (Open MPI), else 0."""
    return int(os.environ.get("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", 0)))


def without_frozen(state, module, prefix=""):
    """``state`` (a state dict of ``module`` with keys ``prefix`` + name) without the
    parameters that do not require gradients, by the names named_parameters() gives them."""
    frozen = {prefix + name for name, param in module.named_parameters()
              if not param.requires_grad}
    for key in [key for key in state if key in frozen]:
        del state[key]
    return state


class ThroughputTimer:
    """DeepSpeed's ThroughputTimer (deepspeed/utils/timer.py), driven by the engine: ``start()``
    as a micro-batch's forward begins, ``stop(global_step)`` at the end of its ``step()``
    (``global_step``: the boundary's). Once ``start_step`` optimizer steps have passed
    (warm-up), the time from the latest start to each stop is summed; ``avg_samples_per_sec()``
    is the batch size over the mean of that time per optimizer step since (-inf until then).
    ``synchronize`` (a function, or None) runs before ``clock`` is read (DeepSpeed's
    ``timers.throughput.synchronized``). zoe logs nothing: a script reads the rate."""

    def __init__(self, batch_size, enabled=True, synchronize=None, start_step=2,
                 clock=time.perf_counter):
        self.batch_size = batch_size
        self.enabled = enabled
        self.start_step = start_step
        self._synchronize = synchronize
        self._clock = clock
        self.started = False
        self.start_time = None  # set by the first start() after the warm-up
        self.epoch_count = 0
        self.micro_step_count = 0
        self.global_step_count = 0
        self.total_elapsed_time = 0.0

    def update_epoch_count(self):
        """A script's call at the end of an epoch."""
        self.epoch_count += 1
        self.micro_step_count = 0

    def _now(self):
        if self._synchronize is not None:
            self._synchronize()
        return self._clock()

    def start(self):
        if not self.enabled:
            return
        self.started = True
        if self.global_step_count >= self.start_step:
            self.start_time = self._now()

    def stop(self, global_step=False):
        if not self.enabled or not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        self.global_step_count += int(bool(global_step))
        if self.start_time is not None:
            self.total_elapsed_time += self._now() - self.start_time

    def avg_samples_per_sec(self):
        """Samples per second over the optimizer steps after the warm-up; -inf before one."""
        timed_steps = self.global_step_count - self.start_step
        if timed_steps <= 0 or self.total_elapsed_time <= 0.0:
            return float("-inf")
        return self.batch_size / (self.total_elapsed_time / timed_steps)


class DeepSpeedEngine(torch.nn.Module):
    """See the module docstring. Built by zoe.torch.initialize (ds_initialize.py)."""

    def __init__(self, module, optimizer, lr_scheduler, training, process_group=None,
                 loss_scaler=None, owns_optimizer=True, stage3=None):
        super().__init__()
        self.module = module  # registered as the submodule "module"
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.config = training.document
        self._training = training
        self._group = process_group
        self.loss_scaler = loss_scaler
        self._owns_optimizer = owns_optimizer
        self._stage3 = stage3  # ds_stage3.Stage3 at ZeRO stage 3, else None
        self.local_rank = local_rank_from_environment()
        self.training_dataloader = None  # initialize's loader of training_data
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self._step_applied = False
        self._boundary = None  # set_gradient_accumulation_boundary's; None: counted
        self._seconds = types.SimpleNamespace(forward=0.0, backward=0.0, step=0.0,
                                              reductions=0.0)  # see stats()
        self._unscale_hooks = self._hook_unscaling() if loss_scaler is not None else []
        self.tput_timer = self._throughput_timer()

    def __getattr__(self, name):
        """nn.Module's parameters, buffers and submodules, then, as DeepSpeed's engine, an
        attribute of the model that the engine does not have."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        model = self.__dict__.get("_modules", {}).get("module")
        value = _ABSENT if model is None else getattr(model, name, _ABSENT)
        if value is _ABSENT:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}', "
                                 "nor has its module")
        return value

    def _throughput_timer(self):
        """tput_timer as the config's timers.throughput says (enabled and synchronized by
        default, as DeepSpeed's)."""
        section = self.config.get("timers", {}).get("throughput", {})
        synchronize = None
        if section.get("synchronized", True) and self.device.type == "cuda":
            synchronize = torch.cuda.synchronize
        return ThroughputTimer(self.train_batch_size(), bool(section.get("enabled", True)),
                               synchronize)

    # --- sizes, ranks and settings ---------------------------------------------------------

    @property
    def world_size(self):
        return 1 if self._group is None else dist.get_world_size(self._group)

    @property
    def dp_world_size(self):
        """The data-parallel ranks: every rank (zoe has no model parallelism)."""
        return self.world_size

    @property
    def mp_world_size(self):
        return 1

    @property
    def global_rank(self):
        return 0 if self._group is None else dist.get_rank(self._group)

    @property
    def device(self):
        """Where the model's parameters are (DeepSpeed: the device it moved the model to);
        the CPU for a model without parameters."""
        param = next(self.module.parameters(), None)
        return torch.device("cpu") if param is None else param.device

    def train_batch_size(self):
        return self._training.batch.train_batch_size

    def train_micro_batch_size_per_gpu(self):
        return self._training.batch.micro_batch_per_gpu

    def gradient_accumulation_steps(self):
        return self._training.batch.gradient_accumulation_steps

    def zero_optimization_stage(self):
        return self._training.zero_stage

    def fp16_enabled(self):
        return self._training.fp16 is not None

    def bfloat16_enabled(self):
        return self._training.bf16

    def get_batch_info(self):
        """(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps), the
        values DeepSpeed's docstring names (its code returns the three methods)."""
        return (self.train_batch_size(), self.train_micro_batch_size_per_gpu(),
                self.gradient_accumulation_steps())

    def zero_optimization(self):
        """Whether ZeRO is on (stage 1 or above)."""
        return self._training.zero_stage > 0

    def zero_optimization_partition_gradients(self):
        return self._training.zero_stage >= 2

    def zero_optimization_partition_weights(self):
        return self._training.zero_stage >= 3

    def zero_cpu_offload(self):
        """Whether zero_optimization.offload_optimizer.device is "cpu"."""
        return self._training.offload_optimizer == "cpu"

    def zero_gather_16bit_weights_on_model_save(self):
        """zero_optimization.stage3_gather_16bit_weights_on_model_save (its older name
        stage3_gather_fp16_weights_on_model_save too), false when absent or "auto"."""
        zero = self.config.get("zero_optimization", {})
        for key in ("stage3_gather_16bit_weights_on_model_save",
                    "gather_16bit_weights_on_model_save",
                    "stage3_gather_fp16_weights_on_model_save"):
            if zero.get(key) not in (None, "auto"):
                return bool(zero[key])
        return False

    def gradient_clipping(self):
        return self._training.gradient_clipping

    def dataloader_drop_last(self):
        return self._training.dataloader_drop_last

    def optimizer_name(self):
        """A user's optimizer's class name, else the config's optimizer type as DeepSpeed
        keeps it (lower case: "adamw", "adam", "adagrad", "lion")."""
        if not self._owns_optimizer:
            return type(self.optimizer).__name__
        return str(self.config["optimizer"]["type"]).lower()

    def steps_per_print(self):
        """The config's steps_per_print (None when absent, as DeepSpeed's default); zoe prints
        nothing: stats() and tput_timer say how training goes."""
        return self.config.get("steps_per_print")

    def wall_clock_breakdown(self):
        """The config's wall_clock_breakdown (false when absent); zoe keeps its breakdown in
        stats() either way."""
        return bool(self.config.get("wall_clock_breakdown", False))

    # --- the training loop -----------------------------------------------------------------

    def forward(self, *inputs, **kwargs):
        """The module's forward (``engine(x)`` runs it through nn.Module's call)."""
        self.tput_timer.start()
        with _timed(self._seconds, "forward"):
            return self.module(*inputs, **kwargs)

    def train(self, mode=True):
        """Sets the engine's and the module's training mode; returns None, as DeepSpeed's."""
        super().train(mode)

    def eval(self):
        """train(False); returns None, as DeepSpeed's."""
        self.train(False)

    def is_gradient_accumulation_boundary(self):
        """Whether the current micro-batch ends a gradient accumulation: its backward reduces
        (stage 2) and hands gradients to the optimizer early, its step() steps the optimizer.
        As set_gradient_accumulation_boundary last set it, else counted from micro_steps."""
        if self._boundary is not None:
            return self._boundary
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary):
        """DeepSpeed's: from now on is_gradient_accumulation_boundary() returns ``is_boundary``
        (None: counted again). Set before each micro-batch's backward, True for the last, and
        call step() after that one only (accelerate's loop) or after every one."""
        self._boundary = is_boundary

    def backward(self, loss, release_loss=False, retain_graph=False, scale_wrt_gas=True):
        """Backward of ``loss`` / gradient_accumulation_steps (not divided when
        ``scale_wrt_gas`` is false), times the loss scale under fp16. Returns what DeepSpeed's
        returns: the loss divided (as float32) when it was divided, else ``loss`` as given.
        On the boundary micro-batch a zoe optimizer's device param groups take each gradient
        as it becomes final (and a speculative one starts its update then:
        optimizer.overlap()); before it, stage 2 holds its reductions. ``release_loss`` is
        accepted and does nothing, as in DeepSpeed."""
        if scale_wrt_gas and self.gradient_accumulation_steps() > 1:
            loss = loss.float() / self.gradient_accumulation_steps()
        scaled = loss
        if self.loss_scaler is not None:
            scaled = scaled * self.loss_scaler.loss_scale
        boundary = self.is_gradient_accumulation_boundary()
        with self._reductions_held(not boundary), self._overlapped(boundary), \
                _timed(self._seconds, "backward"):
            scaled.backward(retain_graph=retain_graph)
        return loss

    def step(self, lr_kwargs=None):
        """Called after a micro-batch's backward; steps at the accumulation boundary.
        was_step_applied() is False after a step() that is not a boundary, as DeepSpeed's."""
        self._step_applied = False
        boundary = self.is_gradient_accumulation_boundary()
        if boundary:
            with _timed(self._seconds, "step"):
                self._take_model_step(lr_kwargs or {})
        self.tput_timer.stop(global_step=boundary)
        self.micro_steps += 1

    def _take_model_step(self, lr_kwargs):
        """The boundary's step (see the module docstring)."""
        if self._group is not None and not self._sharded():
            with _timed(self._seconds, "reductions"):
                self._average_gradients()
        if isinstance(self.optimizer, ZoeOptimizer):
            # zoe's optimizers clip, and skip a non-finite step on every rank, themselves
            self.optimizer.step()
            overflow = self.loss_scaler is not None and self._zoe_step_skipped()
        else:
            overflow = self._agreed_overflow() if self.loss_scaler is not None else False
            if not overflow:
                self._clip_torch_gradients()
                self.optimizer.step()
        self._step_applied = not overflow
        if overflow:
            self.skipped_steps += 1
        elif self.lr_scheduler is not None:
            with warnings.catch_warnings():
                # A schedule over a torch optimizer zoe steps in its place (ds_initialize) finds
                # that optimizer's step never called; the engine did step before it.
                warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
                self.lr_scheduler.step(**lr_kwargs)
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow)
        self.zero_grad()
        self.global_steps += 1
        self.global_samples += self.train_batch_size()

    def was_step_applied(self):
        """Whether the latest boundary's step changed the parameters (False after an fp16
        overflow)."""
        return self._step_applied

    def zero_grad(self):
        """Drops every gradient (set to None)."""
        self.optimizer.zero_grad(set_to_none=True)
        for param in self.module.parameters():
            param.grad = None

    def _optimizer_param(self, name):
        """Per param group, its value of ``name`` (0.0 where it has none, as DeepSpeed's)."""
        return [group.get(name, 0.0) for group in self.optimizer.param_groups]

    def get_lr(self):
        """Per param group, the learning rate the next step takes."""
        return self._optimizer_param("lr")

    def get_mom(self):
        """Per param group, its momentum for SGD and RMSprop, else its betas (0.0 where the
        optimizer has none, e.g. Adagrad), as DeepSpeed's."""
        momentum = self.optimizer_name() in ("SGD", "RMSprop")
        return self._optimizer_param("momentum" if momentum else "betas")

    def get_global_grad_norm(self):
        """The norm of every gradient of the latest step, all param groups and ranks together
        (zoe's optimizers), else None."""
        return getattr(self.optimizer, "last_grad_norm", None)

    def stats(self):
        """Where this rank's time went since the engine was built, in wall-clock seconds:
        ``forward`` (engine(x)), ``backward`` (engine.backward, with what runs in it: stage 2's
        and stage 3's gradient reductions, stage 3's gathers for backward) and ``step`` (the
        boundaries' step(): stage 0's gradient all-reduce, the fp16 overflow check, clipping,
        the optimizer's step and its parameter all-gather at stages 1 and 2), and inside them
        the time blocked in collectives: ``reductions`` (stage 0: the engine's all-reduce;
        stage 3: the gradient buckets), ``gathers`` (stage 3: parameter gathers, issuing and
        waiting) and ``optimizer_collectives`` (stages 1 and 2: the sharded optimizer's
        reductions, norm and parameter all-gather, which it does not split). Also
        ``micro_steps`` and ``global_steps``; at stage 3 ``pager``, the pager's stats()."""
        stats = dict(vars(self._seconds), gathers=0.0, optimizer_collectives=0.0,
                     micro_steps=self.micro_steps, global_steps=self.global_steps)
        if self._stage3 is not None:
            pager = self._stage3.pager
            stats["gathers"] = getattr(pager, "gather_seconds", 0.0)
            stats["reductions"] += getattr(pager, "reduction_seconds", 0.0)
            stats["pager"] = pager.stats()
        elif self._sharded():
            stats["optimizer_collectives"] = self.optimizer.collective_seconds
        return stats

    # --- gradients -------------------------------------------------------------------------

    def _params(self):
        return [param for group in self.optimizer.param_groups for param in group["params"]]

    def _collective_device(self):
        """Where the engine's own collectives hold their tensors: the parameters' device (a
        GPU's under NCCL, which takes no CPU tensors)."""
        params = self._params()
        return params[0].device if params else torch.device("cpu")

    def _sharded(self):
        """Whether the gradients are reduced without the engine (zoe's ZeRO stages 1 and 2 in
        the optimizer, stage 3 in the pager)."""
        if self._stage3 is not None:
            return self._stage3.sharded
        return getattr(self.optimizer, "_zero", None) is not None

    @torch.no_grad()
    def _average_gradients(self):
        """Stage 0 over several ranks: every gradient replaced by the ranks' mean, in one
        all-reduce of a flat buffer (a parameter without a gradient counts zeros; one without
        a gradient on every rank stays without)."""
        params = self._params()
        present = torch.tensor([float(p.grad is not None) for p in params], dtype=torch.float64,
                               device=self._collective_device())
        dist.all_reduce(present, group=self._group)
        flat = torch.cat([torch.zeros(p.numel(), device=p.device) if p.grad is None
                          else p.grad.detach().reshape(-1).float() for p in params])
        dist.all_reduce(flat, group=self._group)
        flat /= self.world_size
        offset = 0
        for param, shared in zip(params, present.tolist()):
            part = flat[offset: offset + param.numel()].view_as(param)
            offset += param.numel()
            if shared:
                param.grad = part.to(param.dtype).clone()

    def _agreed_overflow(self):
        """Whether some rank has an inf or NaN gradient (a torch optimizer's step; zoe's say
        it themselves: _zoe_step_skipped)."""
        local = any(param.grad is not None and not bool(torch.isfinite(param.grad).all())
                    for param in self.module.parameters())
        flag = torch.tensor([float(local)], device=self._collective_device())
        if self._group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flag.item() > 0)

    def _zoe_step_skipped(self):
        """Whether the zoe optimizer's latest step skipped for an inf/NaN gradient (the same on
        every rank: zoe agrees on it)."""
        return any(result is not None and result.skipped for result in self.optimizer.last_step)

    def _clip_torch_gradients(self):
        """gradient_clipping for a torch optimizer (zoe's clip inside their step)."""
        if self._training.gradient_clipping > 0:
            torch.nn.utils.clip_grad_norm_(self._params(), self._training.gradient_clipping)

    def _hook_unscaling(self):
        """fp16: a hook per parameter dividing its incoming gradient by the loss scale."""
        scaler = self.loss_scaler
        return [param.register_hook(lambda grad: grad * (1.0 / scaler.loss_scale))
                for param in self.module.parameters() if param.requires_grad]

    def _overlapped(self, boundary):
        """On the boundary micro-batch: a zoe optimizer's overlap() (its device groups' hooks
        armed; nothing for CPU groups or a torch optimizer) -- unless the engine averages the
        gradients after backward (stage 0 over several ranks): zoe must take the averages, not
        the gradients as backward leaves them."""
        overlap = getattr(self.optimizer, "overlap", None)
        averaged_later = self._group is not None and not self._sharded()
        if not boundary or overlap is None or averaged_later:
            return contextlib.nullcontext()
        return overlap()

    def _reductions_held(self, hold):
        """While ``hold`` (a micro-batch before the boundary): zoe's stage 2 reduces nothing."""
        no_sync = getattr(self.optimizer, "no_sync", None)
        return no_sync() if hold and no_sync is not None else contextlib.nullcontext()

    # --- checkpoints -----------------------------------------------------------------------

    def _agreed(self, what, step):
        """``step()`` on this rank; over ranks every rank's, and when one fails every rank
        raises together (_collective_ops.agreed), none left waiting."""
        if self._group is None:
            return step()
        return agreed(what, step, self._group)

    def _engine_state(self, client_state, exclude_frozen_parameters):
        module = self.module_state_dict()
        if exclude_frozen_parameters:
            without_frozen(module, self.module)
        return {
            "module": module,
            "lr_scheduler": None if self.lr_scheduler is None else self.lr_scheduler.state_dict(),
            "loss_scaler": None if self.loss_scaler is None else self.loss_scaler.state_dict(),
            "global_steps": self.global_steps, "global_samples": self.global_samples,
            "micro_steps": self.micro_steps, "skipped_steps": self.skipped_steps,
            "world_size": self.world_size, "zero_stage": self._training.zero_stage,
            "client_state": dict(client_state or {}),
        }

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True,
                        exclude_frozen_parameters=False):
        """Saves everything training needs to resume to ``<save_dir>/<tag>`` (default tag
        ``global_step<N>``), crash-safe, and points ``<save_dir>/latest`` at it (unless
        save_latest is false); with ``exclude_frozen_parameters`` the module's parameters that
        do not require gradients are left out (a strict load then refuses the checkpoint:
        load it with load_module_strict=False). Every rank calls it. Returns True, as
        DeepSpeed's. Each step (beginning, the module's state, the optimizer's, the commit)
        is agreed: when it fails on any rank, every rank raises together naming the failing
        ranks and the cause (one process: the error itself; a full disk zoe.NoSpace), what
        the save wrote is removed, the saves before it and ``latest`` are unchanged and
        training goes on. A bad tag is refused before anything is written (InvalidArgument).
        Saving between the micro-batches of an accumulation logs a warning: their gradients
        are not saved."""
        tag = f"global_step{self.global_steps}" if tag is None else tag
        where = f"the save of tag {str(tag)!r} in {save_dir!r}"
        self._warn_if_mid_accumulation(where)
        state = self._module_and_engine_state(where, client_state, exclude_frozen_parameters)
        try:
            partial = self._agreed(f"beginning {where}", lambda: ds_checkpoint.begin_save(
                save_dir, tag, self.global_rank))
            written = self._agreed(f"writing the module's state of {where}",
                                   lambda: self._write_model_states(partial, state))
            written.update(self._save_optimizer(partial, where))
            self._agreed(f"committing {where}",
                         lambda: self._commit_save(save_dir, str(tag), written, save_latest))
        except BaseException:
            if self.global_rank == 0:
                ds_checkpoint.abandon_save(save_dir, str(tag))
            raise
        return True

    def _module_and_engine_state(self, where, client_state, exclude_frozen_parameters):
        """What model_states.pt holds (_engine_state): at stage 3 gathered (a collective),
        else taken by every rank in an agreed step."""
        if self._stage3 is not None:
            return self._engine_state(client_state, exclude_frozen_parameters)
        return self._agreed(f"taking the module's state for {where}",
                            lambda: self._engine_state(client_state, exclude_frozen_parameters))

    def _warn_if_mid_accumulation(self, where):
        """Logs (rank 0) that a save between the micro-batches of a gradient accumulation
        keeps none of the gradients they accumulated, as DeepSpeed's keeps none."""
        gas = self.gradient_accumulation_steps()
        done = self.micro_steps % gas if self._boundary is None else None
        holding = any(param.grad is not None for param in self.module.parameters())
        if self.global_rank != 0 or not (done or (done is None and holding)):
            return
        after = (f"after micro-batch {done} of the {gas} of a gradient accumulation" if done
                 else "between the micro-batches of a gradient accumulation")
        log.warning("%s comes %s: the gradients accumulated so far are not saved (DeepSpeed "
                    "does not save them either), so a run resumed from it takes its next "
                    "optimizer step with the remaining micro-batches' gradients only; save "
                    "after the step() that ends an accumulation to resume exactly", where, after)

    def _write_model_states(self, partial, state):
        """Rank 0 writes model_states.pt (ds_checkpoint.write_torch_file: a full disk is
        NoSpace); returns {name: (size, sha256)} of what it wrote and hashed."""
        if self.global_rank != 0:
            return {}
        return {MODEL_STATES: ds_checkpoint.write_torch_file(partial, MODEL_STATES, state)}

    def _commit_save(self, save_dir, tag, written, save_latest):
        """Rank 0 records the checksums of the files zoe's optimizer does not checksum
        (``written``: those hashed as they were written) and commits the save."""
        if self.global_rank == 0:
            ds_checksums.record_checksums(ds_checkpoint.partial_directory(save_dir, tag),
                                          written)
            ds_checkpoint.commit_save(save_dir, tag, save_latest)

    def _save_optimizer(self, directory, where):
        """zoe's sharded optimizer: every rank its shard (each step agreed by save_sharded);
        otherwise the ranks' optimizers are identical and rank 0 saves its own (agreed).
        Returns {name: (size, sha256)} of a file hashed as it was written."""
        path = os.path.join(directory, OPTIMIZER_DIR)
        if self._sharded() and self._stage3 is not None:
            self._stage3.save(path, self.optimizer, self.global_rank)
            return {}
        if self._sharded():
            self.optimizer.save_checkpoint(path)
            return {}

        def save_whole():
            if self.global_rank != 0:
                return {}
            if isinstance(self.optimizer, ZoeOptimizer):
                self.optimizer.save_checkpoint(path)
                return {}
            return {TORCH_OPTIMIZER: ds_checkpoint.write_torch_file(
                directory, TORCH_OPTIMIZER, self.optimizer.state_dict())}

        return self._agreed(f"saving the optimizer's state of {where}", save_whole)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True,
                        load_optimizer_states=True, load_lr_scheduler_states=True,
                        load_module_only=False, custom_load_fn=None):
        """Loads the save ``tag`` (default: the one ``<load_dir>/latest`` names). Returns
        (its path, the client_state saved with it), or (None, None), with a logged warning,
        when ``load_dir`` has no ``latest`` and no tag is given. ``load_module_only`` loads
        the module alone; ``load_optimizer_states=False`` all but the optimizer. Then, as
        DeepSpeed's, the optimizer's master weights follow the loaded parameters and its
        moments stay. ``custom_load_fn(src=saved module state, dst=engine.module)`` loads the
        module instead of load_state_dict (at stage 3 inside the pager's materialized(): the
        whole model held at once).

        Everything is checked before anything changes (ds_load.py): the files against their
        checksums, the optimizer's kind and layout (the world size and stage it was saved
        at), its param groups, the module's keys and shapes, the schedule and loss scale. The
        optimizer loads first, all or nothing on every rank, then the module, the schedule,
        the loss scale and the counters, which cannot fail once checked: a failed load leaves
        the engine as it was (only a custom_load_fn that raises leaves what it did, after the
        optimizer loaded). Every step is agreed over the ranks."""
        path = self._agreed(f"finding the checkpoint in {load_dir!r}",
                            lambda: ds_checkpoint.find_save(load_dir, tag))
        if path is None:
            if self.global_rank == 0:
                log.warning("load_checkpoint(%r): no 'latest' file there and no tag given: "
                            "nothing loaded (%s)", load_dir, ds_checkpoint.listing(load_dir))
            return None, None
        plan = ds_load.LoadPlan(load_module_strict, load_optimizer_states and not load_module_only,
                                not load_module_only, load_lr_scheduler_states, custom_load_fn)
        checked = self._agreed(f"checking the checkpoint {path!r}",
                               lambda: self._checked_load(path, plan))
        if plan.optimizer:
            self._load_optimizer(path, checked.torch_optimizer)
        self._load_module(checked.state["module"], plan)
        if plan.rest:
            self._load_rest(checked.state, plan)
        return path, checked.state["client_state"]

    def _checked_load(self, path, plan):
        """ds_load's checks of the save in ``path`` for ``plan`` (this rank; changes nothing);
        returns the ds_load.Checked to load."""
        verified = ds_checksums.verify_checksums(
            path, lambda name: plan.optimizer or name == MODEL_STATES)
        if not verified and self.global_rank == 0:
            log.warning("%r has no checksum record (%s; a save of a zoe before it kept one): "
                        "its files load unverified", path, ds_checksums.RECORD)
        checked = ds_load.Checked(ds_load.read_model_states(path))
        if plan.optimizer:
            checked.torch_optimizer = self._check_optimizer(path, checked.state)
        if plan.custom_load_fn is None:
            self._check_module_state(checked.state["module"], plan.strict)
        if plan.rest:
            self._check_schedule_and_scale(path, checked.state, plan)
        return checked

    def _check_optimizer(self, path, state):
        """The optimizer's saved state checked for this optimizer (ds_load: its kind, the
        layout it was saved in, and a zoe optimizer's param groups); returns a torch
        optimizer's state dict, None for zoe's."""
        kind, sharding = ds_load.saved_sharding(path)
        is_zoe = isinstance(self.optimizer, ZoeOptimizer)
        ds_load.check_kind(path, kind, self.optimizer, is_zoe)
        if not is_zoe:
            return ds_load.torch_optimizer_state(path, self.optimizer)
        mine = None
        if self._sharded():
            mine = (3 if self._stage3 is not None else 1, self.world_size)
        ds_load.check_sharding(path, state, sharding,
                               (self._training.zero_stage, self.world_size, mine))
        directory = os.path.join(path, OPTIMIZER_DIR)
        groups, kind_name = saved_param_groups(directory, self._sharded())
        self.optimizer.check_loadable(groups, f"the checkpoint in {directory!r}", kind_name,
                                      created_now=True)
        return None

    def _check_module_state(self, module_state, strict):
        """The saved module state's keys (when ``strict``) and shapes checked against the
        module's, as load_state_dict would, before anything loads (RuntimeError as torch's)."""
        if self._stage3 is not None:
            check_module_state(self.module, module_state, strict)
            return
        expected = {key: tuple(value.shape) if torch.is_tensor(value) else None
                    for key, value in self.module.state_dict(keep_vars=True).items()}
        check_module_state(self.module, module_state, strict, expected)

    def _check_schedule_and_scale(self, path, state, plan):
        """The schedule (when loaded) and the loss scaler take their saved states (tried and
        put back: ds_load.check_loadable). A schedule this engine has and the save has not is
        refused; a loss scale the save has not leaves this engine's (a warning)."""
        if plan.schedule and self.lr_scheduler is not None:
            if state.get("lr_scheduler") is None:
                schedule = type(self.lr_scheduler).__name__
                raise _invalid(f"the checkpoint {path!r} was saved without a learning-rate "
                               f"schedule and this engine has one ({schedule}): load it with "
                               "load_lr_scheduler_states=False to keep this engine's schedule "
                               "as it is")
            ds_load.check_loadable(self.lr_scheduler, state["lr_scheduler"],
                                   "this engine's learning-rate schedule",
                                   "load it with load_lr_scheduler_states=False")
        if self.loss_scaler is None:
            return
        if state.get("loss_scaler") is None:
            if self.global_rank == 0:
                log.warning("the checkpoint %r was saved without fp16 loss scaling: the loss "
                            "scale stays this engine's (%s)", path, self.loss_scaler.loss_scale)
            return
        ds_load.check_loadable(self.loss_scaler, state["loss_scaler"],
                               "this engine's fp16 loss scaler",
                               "save and load with the same fp16 loss_scale setting")

    def _load_optimizer(self, path, torch_state):
        """The optimizer's saved state, all or nothing on every rank: zoe's sharded load is
        agreed and puts back every rank's state when one fails (checkpoint.load_shard), an
        unsharded one loads transactionally on each rank (agreed)."""
        directory = os.path.join(path, OPTIMIZER_DIR)
        if self._sharded() and self._stage3 is not None:
            self._stage3.load(directory, self.optimizer)
        elif self._sharded():
            self.optimizer.load_checkpoint(directory)
        elif torch_state is not None:
            self._agreed(f"loading the optimizer's state of {path!r}",
                         lambda: self.optimizer.load_state_dict(torch_state))
        else:
            self._agreed(f"loading the optimizer's state of {path!r}",
                         lambda: self.optimizer.load_checkpoint(directory))

    def _load_module(self, state, plan):
        """The module's saved ``state`` (through ``custom_load_fn`` when given). The optimizer
        loaded before, when it did, and set the parameters it steps to its master weights:
        only the rest loads (a custom_load_fn's writes to them are replaced by the masters, as
        the optimizer's load replaced them before). Without the optimizer's state its master
        weights follow the loaded parameters (at stage 3 ds_stage3 writes the pages)."""
        zoe_optimizer = isinstance(self.optimizer, ZoeOptimizer)
        if self._stage3 is not None:
            self._stage3.load_module(state, self.optimizer, plan.strict, plan.custom_load_fn,
                                     plan.optimizer)
            return
        if plan.custom_load_fn is not None:
            load = lambda: plan.custom_load_fn(src=state, dst=self.module)  # noqa: E731
        elif plan.optimizer and zoe_optimizer:
            load = lambda: self.module.load_state_dict(  # noqa: E731
                self._without_optimizer_parameters(state), strict=False)
        else:
            load = lambda: self.module.load_state_dict(state, strict=plan.strict)  # noqa: E731
        self._agreed("loading the module's state", load)
        if zoe_optimizer and plan.optimizer and plan.custom_load_fn is not None:
            self.optimizer.write_back_masters()
        elif zoe_optimizer and not plan.optimizer:
            self.optimizer.take_external_writes()

    def _without_optimizer_parameters(self, state):
        """``state`` without the parameters the optimizer steps (its load set them)."""
        stepped = {id(param) for group in self.optimizer.param_groups for param in group["params"]}
        owned = {key for key, value in self.module.state_dict(keep_vars=True).items()
                 if id(value) in stepped}
        return type(state)((key, value) for key, value in state.items() if key not in owned)

    def _load_rest(self, state, plan):
        """The schedule, the loss scale and the counters (checked loadable already)."""
        if plan.schedule and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        if self.loss_scaler is not None and state.get("loss_scaler") is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        for key in ds_load.COUNTERS:
            setattr(self, key, state[key])

    def module_state_dict(self, destination=None, prefix="", keep_vars=False,
                          exclude_frozen_parameters=False):
        """The module's state dict, as module.state_dict(destination, prefix, keep_vars), with
        its parameters' current values: at stage 3 copies of the full values, gathered (a
        collective over the ranks; keep_vars does not apply). Without the parameters that do
        not require gradients when ``exclude_frozen_parameters``."""
        if self._stage3 is None:
            state = self.module.state_dict(destination=destination, prefix=prefix,
                                           keep_vars=keep_vars)
        else:
            state = self._stage3.module_state(destination, prefix)
        if exclude_frozen_parameters:
            without_frozen(state, self.module, prefix)
        return state

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters=False):
        """DeepSpeed's, for accelerate and Hugging Face's save at stage 3: the module's full
        state dict (module_state_dict(), on the CPU) on rank 0, None on the other ranks. Every
        rank calls it; InvalidArgument (a ValueError, as DeepSpeed's) below stage 3."""
        if self._stage3 is None:
            raise _invalid("_zero3_consolidated_16bit_state_dict needs zero_optimization.stage 3"
                           "; call module_state_dict() at the other stages")
        state = self.module_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)
        if self.global_rank != 0:
            return None
        return type(state)((key, value.cpu()) for key, value in state.items())

    def save_16bit_model(self, save_dir, save_filename="pytorch_model.bin",
                         exclude_frozen_parameters=False):
        """DeepSpeed's: the module's state dict (module_state_dict(): the full parameters at
        every stage, in the module's dtype, 16-bit under fp16 or bf16), without the parameters
        that do not require gradients when ``exclude_frozen_parameters``, written by rank 0 to
        ``<save_dir>/<save_filename>`` with torch.save, atomically (a save that fails keeps the
        previous file; a full disk is zoe.NoSpace). Every rank calls it (stage 3 gathers).
        Returns True."""
        state = self.module_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)
        path = os.path.join(save_dir, save_filename)

        def save():
            if self.global_rank == 0:
                os.makedirs(save_dir, exist_ok=True)
                ds_checkpoint.replace_torch_file(path, state)

        self._agreed(f"saving the model to {path!r}", save)
        return True

    def close(self):
        """Removes the engine's hooks and closes the optimizer it created (its zoe engine and
        swap files); idempotent. DeepSpeed's ``destroy()`` is the same."""
        for handle in self._unscale_hooks:
            handle.remove()
        self._unscale_hooks = []
        if self._stage3 is not None:
            stage3, self._stage3 = self._stage3, None
            stage3.close(self.optimizer)
        elif self._owns_optimizer and hasattr(self.optimizer, "close"):
            self.optimizer.close()

    def destroy(self):
        self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
