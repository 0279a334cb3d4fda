"""DeepSpeed's learning-rate schedules WarmupLR, WarmupDecayLR and WarmupCosineLR, with DeepSpeed's
formulas (deepspeed/runtime/lr_schedules.py, as of 0.19.3), over any torch optimizer (zoe's
included). As in DeepSpeed, ``step()`` advances ``last_batch_iteration`` (from -1) and sets every
param group's ``lr``; the engine steps the schedule after each optimizer step that was taken.

warmup_num_steps must be a positive integer (DeepSpeed refuses others from 0.19.3 on). With
t = last_batch_iteration and W = max(2, warmup_num_steps), the warmup factor is
``log(t + 1) / log(W)`` ("log", the default) or ``t / W`` ("linear") for t < W, else 1:

- WarmupLR: lr = warmup_min_lr + (warmup_max_lr - warmup_min_lr) * factor; without
  warmup_max_lr, each group's lr at construction (DeepSpeed from 0.17.2 on; 0.001 before).
- WarmupDecayLR: as WarmupLR during warmup (warmup_max_lr 0.001 when not given), then the factor
  is max(0, (total_num_steps - t) / max(1, total_num_steps - W)).
- WarmupCosineLR: a ratio of each group's lr at construction: during warmup
  warmup_min_ratio + (1 - warmup_min_ratio) * factor, then
  max(0, cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * p)) / 2) with
  p = min(1, (t - W + 1) / max(1, total_num_steps - W)): it stays at cos_min_ratio from
  total_num_steps on (DeepSpeed from 0.19.3 on; before, it rose again, and total_num_steps equal
  to W divided by zero). Like DeepSpeed's, it sets the rate to 0 at construction (t = -1).

WarmupLR and WarmupDecayLR set every group's rate to warmup_min_lr at construction (t = -1), so
the first optimizer step takes it, as DeepSpeed's do (since 0.15.3). ``schedule_from_config``
builds one from a configuration's ``scheduler`` section, or, as DeepSpeed does, a class of
torch.optim.lr_scheduler named there; DeepSpeed's OneCycle and LRRangeTest are refused naming the
alternative."""

import inspect
import math
import numbers
import weakref

import torch

from .common import _invalid

WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"


def _per_group(optimizer, value, name):
    """One value per param group: a list of the right length, or one value for all."""
    if isinstance(value, (list, tuple)):
        if len(value) != len(optimizer.param_groups):
            raise _invalid(f"{name} has {len(value)} values for "
                           f"{len(optimizer.param_groups)} param groups")
        return list(value)
    return [value] * len(optimizer.param_groups)


def _warmup_factor(iteration, warmup_num_steps, warmup_type):
    """The warmup's fraction of the way at ``iteration`` (< warmup_num_steps)."""
    if warmup_type == WARMUP_LINEAR_RATE:
        return iteration / warmup_num_steps
    return math.log(iteration + 1) / math.log(warmup_num_steps)


def _check_warmup_steps(warmup_num_steps):
    """warmup_num_steps as DeepSpeed's schedules check it: a positive integer."""
    if (isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, numbers.Integral)
            or warmup_num_steps <= 0):
        raise _invalid(f"warmup_num_steps = {warmup_num_steps!r} is not allowed; allowed: a "
                       "positive integer (the optimizer steps the warmup takes)")
    return max(2, int(warmup_num_steps))


def _check_warmup_type(warmup_type):
    if warmup_type not in (WARMUP_LOG_RATE, WARMUP_LINEAR_RATE):
        raise _invalid(f"warmup_type = {warmup_type!r} is not allowed; allowed: 'log', "
                       "'linear'")
    return warmup_type


class _Schedule:
    """The part every schedule shares: the iteration count, step(), the state dict."""

    def __init__(self, optimizer, last_batch_iteration):
        self.optimizer = optimizer
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = None

    def get_lr(self):
        """Per param group, the rate at last_batch_iteration (0 before the first step)."""
        if self.last_batch_iteration < 0:
            return [0.0] * len(self.optimizer.param_groups)
        return self._rates()

    def get_last_lr(self):
        """The rates the latest step() set."""
        if self._last_lr is None:
            raise RuntimeError("the schedule has not been stepped yet: call step() first")
        return self._last_lr

    def step(self, last_batch_iteration=None):
        """Advances to ``last_batch_iteration`` (default: the next) and sets each group's lr."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._apply(self.get_lr())

    def _apply(self, rates):
        for group, rate in zip(self.optimizer.param_groups, rates):
            group["lr"] = rate
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self):
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state):
        self.last_batch_iteration = state["last_batch_iteration"]


class WarmupLR(_Schedule):
    """From warmup_min_lr to warmup_max_lr (default: each group's lr) over warmup_num_steps
    steps, then constant."""

    def __init__(self, optimizer, warmup_min_lr=0.0, warmup_max_lr=None, warmup_num_steps=1000,
                 warmup_type=WARMUP_LOG_RATE, last_batch_iteration=-1):
        super().__init__(optimizer, last_batch_iteration)
        if warmup_max_lr is None:
            warmup_max_lr = [group["lr"] for group in optimizer.param_groups]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.warmup_num_steps = _check_warmup_steps(warmup_num_steps)
        self.warmup_type = _check_warmup_type(warmup_type)
        if last_batch_iteration == -1:
            self._apply(self.get_lr())

    def get_lr(self):
        """Per param group, the rate at last_batch_iteration (warmup_min_lr before the first
        step)."""
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        return self._rates()

    def _gamma(self):
        if self.last_batch_iteration < self.warmup_num_steps:
            return _warmup_factor(self.last_batch_iteration, self.warmup_num_steps,
                                  self.warmup_type)
        return 1.0

    def _rates(self):
        gamma = self._gamma()
        return [low + (high - low) * gamma for low, high in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR's warmup, then a linear decay to 0 at total_num_steps."""

    def __init__(self, optimizer, total_num_steps, warmup_min_lr=0.0, warmup_max_lr=0.001,
                 warmup_num_steps=1000, warmup_type=WARMUP_LOG_RATE, last_batch_iteration=-1):
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)
        self.total_num_steps = total_num_steps

    def _gamma(self):
        if self.last_batch_iteration < self.warmup_num_steps:
            return super()._gamma()
        remaining = self.total_num_steps - self.last_batch_iteration
        return max(0.0, remaining / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_Schedule):
    """A ratio of each group's initial lr: warmup from warmup_min_ratio to 1, then a cosine
    decay to cos_min_ratio at total_num_steps."""

    def __init__(self, optimizer, total_num_steps, warmup_min_ratio=0.0, warmup_num_steps=1000,
                 cos_min_ratio=0.0001, warmup_type=WARMUP_LOG_RATE, last_batch_iteration=-1):
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = _check_warmup_steps(warmup_num_steps)
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = _check_warmup_type(warmup_type)
        self.org_lrs = [group["lr"] for group in optimizer.param_groups]
        if last_batch_iteration == -1:
            self._apply(self.get_lr())

    def lr_ratio(self):
        """The fraction of the initial rates at last_batch_iteration."""
        t = self.last_batch_iteration
        if t < self.warmup_num_steps:
            factor = _warmup_factor(t, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * factor
        decay_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, (t - self.warmup_num_steps + 1) / decay_steps)
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def _rates(self):
        ratio = self.lr_ratio()
        return [rate * ratio for rate in self.org_lrs]


SCHEDULES = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR,
             "WarmupCosineLR": WarmupCosineLR}


def required_parameters(kind):
    """The parameters schedule ``kind`` (a type name) has no default for, such as
    total_num_steps; none for a type zoe does not have."""
    schedule = SCHEDULES.get(kind) if isinstance(kind, str) else None
    if schedule is None:
        return ()
    parameters = list(inspect.signature(schedule).parameters.values())[1:]  # after optimizer
    return tuple(p.name for p in parameters if p.default is inspect.Parameter.empty)


def schedule_from_config(spec, optimizer):
    """The schedule a configuration's ``scheduler`` section ({"type", "params"}) names, over
    ``optimizer``: one of SCHEDULES or, as DeepSpeed takes it, a class of
    torch.optim.lr_scheduler; InvalidArgument naming the supported types or the parameter at
    fault."""
    kind = spec.get("type")
    schedule = SCHEDULES.get(kind) or torch_schedule(kind)
    if schedule is None:
        raise _invalid(
            f"scheduler.type = {kind!r} is not supported; supported: {', '.join(SCHEDULES)} and "
            "the classes of torch.optim.lr_scheduler (such as StepLR). For another schedule "
            "leave the config's scheduler out and pass lr_scheduler=<a torch LR scheduler over "
            "the engine's optimizer> (or a function of the optimizer returning one) to "
            "initialize")
    try:
        return schedule(optimizer, **spec.get("params", {}))
    except (TypeError, ValueError) as error:
        where = ("DeepSpeed's documentation (zoe.torch.lr_schedules)" if kind in SCHEDULES
                 else "torch.optim.lr_scheduler's documentation")
        raise _invalid(f"scheduler {kind}: {error}; see its parameters in {where}") from None


def schedule_state(schedule):
    """``schedule.state_dict()`` without what a checkpoint cannot hold: torch 1.13's OneCycleLR
    and CyclicLR keep their annealing and scale functions there (a bound method, a weak
    reference), which later torch releases leave out; a schedule that loads the state keeps its
    own."""
    return {key: value for key, value in schedule.state_dict().items()
            if not (callable(value) or isinstance(value, weakref.ref))}


def torch_schedule(kind):
    """The class of torch.optim.lr_scheduler named ``kind``, or None."""
    if not isinstance(kind, str) or kind.startswith("_"):
        return None
    schedule = getattr(torch.optim.lr_scheduler, kind, None)
    base = getattr(torch.optim.lr_scheduler, "LRScheduler", None) or \
        torch.optim.lr_scheduler._LRScheduler
    # The engine steps a schedule without arguments; ReduceLROnPlateau's step needs a metric.
    is_schedule = (inspect.isclass(schedule) and issubclass(schedule, base)
                   and schedule is not torch.optim.lr_scheduler.ReduceLROnPlateau)
    return schedule if is_schedule else None
