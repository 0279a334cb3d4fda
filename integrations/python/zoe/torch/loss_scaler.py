"""fp16 loss scaling as DeepSpeed does it: a static scale, or a dynamic one that starts at
2**initial_scale_power, halves after ``hysteresis`` overflowing steps (never below min_loss_scale)
and doubles after ``loss_scale_window`` overflow-free steps (``growth_delay`` steps later).

The dynamic rule, per step i (from 0) with last_overflow starting at -1:
- overflow: when the hysteresis left is 1 the scale becomes max(scale / 2, min_loss_scale),
  otherwise the hysteresis left drops by one; last_overflow = i.
- no overflow: with consecutive_hysteresis the hysteresis is refilled; with
  stable = i - last_overflow - growth_delay, when stable > 0 and stable % loss_scale_window == 0
  the hysteresis is refilled (if not already) and the scale doubles.

growth_delay 0 is DeepSpeed's DynamicLossScaler (runtime/fp16/loss_scaler.py, its ZeRO stages
1 to 3), 1 its stage 0 optimizers' own rule (runtime/fp16/fused_optimizer.py _update_scale,
which has no hysteresis: 1). ds_config resolves which one a configuration gets. With hysteresis 1
and growth_delay 0 this is torch's GradScaler with growth_factor 2, backoff_factor 0.5 and
growth_interval loss_scale_window. Unlike DeepSpeed, an overflow at min_loss_scale keeps the
scale rather than ending the run."""


class StaticLossScaler:
    """A fixed scale (fp16.loss_scale > 0); update() changes nothing."""

    def __init__(self, scale):
        self.loss_scale = float(scale)

    def update(self, overflow):
        pass

    def state_dict(self):
        return {"loss_scale": self.loss_scale}

    def load_state_dict(self, state):
        self.loss_scale = float(state["loss_scale"])


class DynamicLossScaler:
    """DeepSpeed's dynamic loss scaler (see the module docstring)."""

    def __init__(self, initial_scale_power=16, loss_scale_window=1000, hysteresis=2,
                 consecutive_hysteresis=False, min_loss_scale=1.0, growth_delay=0):
        self.loss_scale = float(2 ** initial_scale_power)
        self.growth_delay = int(growth_delay)
        self.scale_window = int(loss_scale_window)
        self.delayed_shift = int(hysteresis)
        self.hysteresis_left = int(hysteresis)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.min_scale = float(min_loss_scale)
        self.iteration = 0
        self.last_overflow = -1

    def update(self, overflow):
        """Takes one step's outcome: ``overflow`` when some gradient was inf or NaN."""
        if overflow:
            if self.delayed_shift == 1 or self.hysteresis_left == 1:
                self.loss_scale = max(self.loss_scale / 2.0, self.min_scale)
            else:
                self.hysteresis_left -= 1
            self.last_overflow = self.iteration
        else:
            if self.consecutive_hysteresis:
                self.hysteresis_left = self.delayed_shift
            stable = self.iteration - self.last_overflow - self.growth_delay
            if stable > 0 and stable % self.scale_window == 0:
                self.hysteresis_left = self.delayed_shift
                self.loss_scale *= 2.0
        self.iteration += 1

    def state_dict(self):
        return {key: getattr(self, key) for key in _RUNNING_STATE + _RULE}

    def load_state_dict(self, state):
        """The saved scaler. A state saved before growth_delay was kept holds the rule this
        scaler was then built with at any stage; only its running state is taken (the scale,
        the hysteresis left, within this rule's, and the step counts), the rule staying this
        scaler's, the configuration's."""
        if "growth_delay" not in state:
            for key in _RUNNING_STATE:
                setattr(self, key, state[key])
            self.hysteresis_left = min(self.hysteresis_left, self.delayed_shift)
            return
        for key in _RUNNING_STATE + _RULE:
            setattr(self, key, state[key])


# What a step changes, and the rule the scaler follows (set from the configuration).
_RUNNING_STATE = ("loss_scale", "hysteresis_left", "iteration", "last_overflow")
_RULE = ("scale_window", "delayed_shift", "consecutive_hysteresis", "min_scale", "growth_delay")


def loss_scaler_for(fp16):
    """The scaler of DeepSpeed's fp16 settings (ds_config's, FP16_DEFAULTS filled in and
    growth_delay set): static when loss_scale > 0, else dynamic."""
    if fp16["loss_scale"] > 0:
        return StaticLossScaler(fp16["loss_scale"])
    return DynamicLossScaler(fp16["initial_scale_power"], fp16["loss_scale_window"],
                             fp16["hysteresis"], fp16["consecutive_hysteresis"],
                             fp16["min_loss_scale"], fp16["growth_delay"])
