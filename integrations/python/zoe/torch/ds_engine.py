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
  loss scale under fp16: ``.grad`` holds the scaled gradients, as DeepSpeed's, and a zoe
  optimizer, told the scale as its grad_scale, divides them by it in fp32 as it steps, before
  clipping) and runs backward; on the boundary micro-batch inside the optimizer's overlap()
  (_overlapped).
- ``step()`` is called after every micro-batch and steps only at the accumulation boundary
  (``is_gradient_accumulation_boundary()``: counted from ``micro_steps``, or as
  ``set_gradient_accumulation_boundary`` last set it, which backward's holding of stage 2's
  reductions and its overlap follow too): it averages the gradients over the ranks (stage 0;
  zoe's ZeRO optimizer reduces its own at stages 1 and 2, the pager at stage 3), steps the
  optimizer (zoe's clip to gradient_clipping and skip a non-finite step on every rank by
  themselves, which is the fp16 overflow; for a torch optimizer the engine agrees the overflow
  over the ranks, unscales the gradients in place and clips), steps the schedule unless the
  step overflowed, updates the loss scale and zeroes the gradients. ``global_steps`` counts
  boundaries (skipped ones too, as DeepSpeed's), ``micro_steps`` step() calls,
  ``skipped_steps`` overflows; was_step_applied() says whether the latest step() changed the
  parameters. ``tput_timer`` times forward to step().
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
import logging
import os
import types
import warnings

import torch
import torch.distributed as dist

from .. import _capi
from .._collective_ops import transport_failure_aborted
from ..errors import FailedPrecondition
from .activation_checkpoint import forget_engine
from .common import _timed
from .ds_engine_checkpoints import EngineCheckpoints
from .grad_accumulation import GradientAccumulation
from .grad_stream import clip_coefficient
from .optimizer import ZoeOptimizer
from .throughput_timer import ThroughputTimer

_ABSENT = object()
log = logging.getLogger("zoe.torch")


def local_rank_from_environment():
    """DeepSpeed's local_rank: LOCAL_RANK (set by launchers, torchrun and
    deepspeed.init_distributed), else OMPI_COMM_WORLD_LOCAL_RANK (Open MPI), else 0."""
    return int(os.environ.get("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", 0)))


class DeepSpeedEngine(EngineCheckpoints, torch.nn.Module):
    """See the module docstring. Built by zoe.torch.initialize (ds_initialize.py)."""

    def __init__(self, module, optimizer, lr_scheduler, training, process_group=None,
                 loss_scaler=None, owns_optimizer=True, stage3=None):
        super().__init__()
        self.module = module  # registered as the submodule "module"
        self._closed = False
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
        self._grad_scale = 1.0  # the loss scale of the latest backward (fp16)
        self._warned_untrained = False  # _warn_untrained_gradients logged
        self.tput_timer = self._throughput_timer()
        # where the micro-batches' gradients add up: zoe's optimizer's (grad_accumulation.py),
        # a torch optimizer's .grad
        self._accumulation = (optimizer.accumulation if isinstance(optimizer, ZoeOptimizer)
                              else GradientAccumulation())

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
        """The config's optimizer type as DeepSpeed keeps it (lower case: "adamw", "adam",
        "adagrad", "lion"), else the class name of the optimizer given to initialize (of zoe's
        in its place for a torch AdamW, Adam or Adagrad: the same name)."""
        section = self.config.get("optimizer")
        if self._owns_optimizer and isinstance(section, dict) and "type" in section:
            return str(section["type"]).lower()
        return type(self.optimizer).__name__

    def steps_per_print(self):
        """The config's steps_per_print (None when absent, as DeepSpeed's default); zoe prints
        nothing: stats() and tput_timer say how training goes."""
        return self.config.get("steps_per_print")

    def wall_clock_breakdown(self):
        """The config's wall_clock_breakdown (false when absent); zoe keeps its breakdown in
        stats() either way."""
        return bool(self.config.get("wall_clock_breakdown", False))

    # --- the training loop -----------------------------------------------------------------

    def _check_open(self, call):
        """FailedPrecondition naming ``call`` once close() (or destroy()) closed the engine:
        its optimizer's state and swap files are gone, and at stage 3 the module holds ordinary
        parameters that nothing would step."""
        if self._closed:
            raise FailedPrecondition(
                _capi.Status.FAILED_PRECONDITION,
                f"{call} after the engine was closed (close() or destroy()): its optimizer's "
                "state is gone; build a new engine with zoe.torch.initialize (and "
                "load_checkpoint to resume)")

    def forward(self, *inputs, **kwargs):
        """The module's forward (``engine(x)`` runs it through nn.Module's call)."""
        self._check_open("forward")
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
        self._check_open("backward")
        if scale_wrt_gas and self.gradient_accumulation_steps() > 1:
            loss = loss.float() / self.gradient_accumulation_steps()
        scaled = loss
        if self.loss_scaler is not None:
            self._mark_grad_scale()
            scaled = scaled * self._grad_scale
        boundary = self.is_gradient_accumulation_boundary()
        with self._reductions_held(not boundary), self._overlapped(boundary), \
                _timed(self._seconds, "backward"):
            scaled.backward(retain_graph=retain_graph)
        return loss

    def step(self, lr_kwargs=None):
        """Called after a micro-batch's backward; steps at the accumulation boundary.
        was_step_applied() is False after a step() that is not a boundary, as DeepSpeed's."""
        self._check_open("step()")
        self._step_applied = False
        boundary = self.is_gradient_accumulation_boundary()
        if boundary:
            with _timed(self._seconds, "step"):
                self._take_model_step(lr_kwargs or {})
        self.tput_timer.stop(global_step=boundary)
        self.micro_steps += 1

    def _take_model_step(self, lr_kwargs):
        """The boundary's step (see the module docstring)."""
        self._warn_untrained_gradients()
        if self._group is not None and not self._sharded():
            with _timed(self._seconds, "reductions"):
                self._average_gradients()
        if isinstance(self.optimizer, ZoeOptimizer):
            # zoe's optimizers clip, and skip a non-finite step on every rank, themselves
            self.optimizer.step()
            overflow = self._zoe_step_skipped()
            if overflow and self.loss_scaler is None and self.global_rank == 0:
                log.warning("step %d: the gradients hold inf or NaN; the optimizer skipped "
                            "the step (skipped_steps counts it), as DeepSpeed's ZeRO optimizer "
                            "does", self.global_steps + 1)
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
        """Whether the latest boundary's step changed the parameters (False after a zoe
        optimizer skipped it for inf or NaN gradients: an fp16 overflow, or a NaN loss)."""
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

    def _warn_untrained_gradients(self):
        """Logs once that parameters of the module have gradients and are in no param group of
        the optimizer: frozen at initialize and unfrozen since, or added to the model after it.
        Nothing steps them (as under DeepSpeed), and the step drops their gradients. At stage 3
        the optimizer holds the shards, whose gradients never stay in the module's ``.grad``:
        every module parameter with one there is untrained."""
        if self._warned_untrained:
            return
        held = set() if self._stage3 is not None else {id(param) for param in self._params()}
        untrained = [name for name, param in self.module.named_parameters()
                     if param.grad is not None and id(param) not in held]
        if untrained:
            self._warned_untrained = True
            names = ", ".join(repr(name) for name in untrained[:8])
            more = f" and {len(untrained) - 8} more" if len(untrained) > 8 else ""
            log.warning("the module's parameters %s%s have gradients but are in no param group "
                        "of the optimizer (frozen when initialize built it, or added to the "
                        "model after): they are not trained, as under DeepSpeed; to train "
                        "them, have them require gradients before initialize", names, more)

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
        a gradient on every rank stays without). The buffer is fp32: fp16 gradients, scaled by
        the loss scale, sum without overflowing and their mean fits fp16 again; an inf or NaN
        on one rank makes the mean non-finite on every rank, which skips the step (the
        overflow). The gradients are the optimizer's (grad_accumulation.py): with fp32
        accumulation the mean stays fp32."""
        params, accumulation = self._params(), self._accumulation
        grads = [accumulation.gradient(param) for param in params]
        present = torch.tensor([float(grad is not None) for grad in grads], dtype=torch.float64,
                               device=self._collective_device())
        flat = torch.cat([torch.zeros(p.numel(), device=p.device) if grad is None
                          else grad.detach().reshape(-1).float() for p, grad in zip(params, grads)])
        with transport_failure_aborted("all_reduce of the gradients (stage 0)"):
            dist.all_reduce(present, group=self._group)
            dist.all_reduce(flat, group=self._group)
        flat /= self.world_size
        offset = 0
        for param, shared in zip(params, present.tolist()):
            part = flat[offset: offset + param.numel()].view_as(param)
            offset += param.numel()
            if shared:
                accumulation.assign(param, part)

    def _agreed_overflow(self):
        """Whether some rank has an inf or NaN gradient (a torch optimizer's step; zoe's say
        it themselves: _zoe_step_skipped)."""
        local = any(param.grad is not None and not bool(torch.isfinite(param.grad).all())
                    for param in self.module.parameters())
        flag = torch.tensor([float(local)], device=self._collective_device())
        if self._group is not None:
            with transport_failure_aborted("all_reduce of the inf/NaN check"):
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flag.item() > 0)

    def _zoe_step_skipped(self):
        """Whether the zoe optimizer's latest step skipped for an inf/NaN gradient (the same on
        every rank: zoe agrees on it)."""
        return any(result is not None and result.skipped for result in self.optimizer.last_step)

    def _clip_torch_gradients(self):
        """gradient_clipping for a torch optimizer (zoe's clip inside their step); under fp16
        the gradients unscaled with it (_unscale_torch_gradients)."""
        if self.loss_scaler is not None:
            self._unscale_torch_gradients(self._training.gradient_clipping)
        elif self._training.gradient_clipping > 0:
            torch.nn.utils.clip_grad_norm_(self._params(), self._training.gradient_clipping)

    def _mark_grad_scale(self):
        """fp16, before a backward: the loss scale its gradients will carry in ``.grad``. A zoe
        optimizer takes it as its grad_scale (its step, and a speculative update during the
        backward, divide by it in fp32); a torch optimizer's gradients are unscaled before its
        step (_unscale_torch_gradients)."""
        self._grad_scale = self.loss_scaler.loss_scale
        if isinstance(self.optimizer, ZoeOptimizer):
            self.optimizer.grad_scale = self._grad_scale

    @torch.no_grad()
    def _unscale_torch_gradients(self, max_norm):
        """fp16 with a torch optimizer (stage 0), right before its step: each ``.grad``
        divided by the loss scale and multiplied by clip_grad_norm_'s factor for ``max_norm``
        (0: none) over the unscaled gradients, in fp32, and stored back in its own dtype.
        Without fp32 master weights this path keeps fp16's limits: an unscaled gradient below
        fp16's smallest subnormal (about 6e-8) becomes 0, and one near it loses precision."""
        grads = [param.grad for param in self._params() if param.grad is not None]
        if not grads:
            return
        factor = 1.0
        if max_norm > 0:
            norms = [torch.linalg.vector_norm(grad.float()) for grad in grads]
            norm = torch.linalg.vector_norm(torch.stack(norms)).cpu() / self._grad_scale
            factor = clip_coefficient(norm, max_norm)
        if factor == 1.0 and self._grad_scale == 1.0:
            return
        for grad in grads:
            grad.copy_(grad.float() * (factor / self._grad_scale))

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

    def close(self):
        """Closes the optimizer the engine created (its zoe engine and swap files); idempotent.
        DeepSpeed's ``destroy()`` is the same. Afterwards forward, backward, step() and the
        checkpoint calls raise FailedPrecondition."""
        self._closed = True
        zoe_engine = getattr(self._stage3, "engine", getattr(self.optimizer, "engine", None))
        if self._owns_optimizer and zoe_engine is not None:
            forget_engine(zoe_engine)
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
