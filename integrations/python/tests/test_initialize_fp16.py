"""fp16 under zoe.torch.initialize: the module is cast to half, the loss is scaled and the
gradients unscaled, an overflowing step is skipped (parameters, optimizer step counts and the
schedule untouched) and the dynamic loss scale follows DeepSpeed's rule (hysteresis,
loss_scale_window, min_loss_scale) and, with hysteresis 1, torch's GradScaler."""

import random

import pytest
import torch

import zoe
import zoe.torch
from zoe.torch.loss_scaler import DynamicLossScaler, StaticLossScaler

OVERFLOW_STEPS = (2, 3, 5)
# DeepSpeed's DynamicLossScaler (its ZeRO stages 1 to 3) from 2**4 with loss_scale_window 2 and
# hysteresis 2, for OVERFLOW_STEPS: step 1 doubles (2 clean steps), 2 spends the hysteresis, 3
# halves, 5 halves (the hysteresis is not refilled until a window of clean steps), 7 doubles.
EXPECTED_SCALES = [16, 32, 32, 16, 16, 8, 8, 16]
# DeepSpeed's stage 0 fp16 optimizers from 2**4 with loss_scale_window 2 (no hysteresis; a
# doubling one step later): every overflow halves, and no window of clean steps is long enough.
STAGE_0_SCALES = [16, 16, 8, 4, 4, 2, 2, 2]


def expected_scales(stage):
    return STAGE_0_SCALES if stage == 0 else EXPECTED_SCALES


class HalfNet(torch.nn.Module):
    """Element-wise only, so that it runs in fp16 on the CPU."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(0.5, 1.5, 8))
        self.b = torch.nn.Parameter(torch.zeros(1))

    def forward(self, x):
        return (x * self.w).sum(-1) + self.b


def fp16_config(**fp16):
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "fp16": {"enabled": True, "initial_scale_power": 4, "loss_scale_window": 2, **fp16},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0}},
        "scheduler": {"type": "WarmupLR", "params": {
            "warmup_min_lr": 0.005, "warmup_max_lr": 0.01, "warmup_num_steps": 4}},
        "zero_optimization": {"stage": 0},
        "zoe": {"device": "host", "chunk_size": "64K", "host_budget": "64M",
                "tensor_swap_bytes": "1M", "log_level": "error"},
    }


def inputs(step, micro, overflow):
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + micro))
    if overflow and micro == 1:
        x[0, 0] = 60000.0  # its square overflows fp16 in the loss: an inf gradient
    return x.half()


def run_fp16_steps(engine, steps, overflows):
    """Trains ``steps`` optimizer steps; returns the scale after each and the parameters
    before and after each."""
    scales, before, after = [], [], []
    for step in range(steps):
        before.append([p.detach().clone() for p in engine.module.parameters()])
        for micro in range(engine.gradient_accumulation_steps()):
            out = engine(inputs(step, micro, step in overflows))
            engine.backward((out.float() ** 2).mean())
            engine.step()
        scales.append(engine.loss_scaler.loss_scale)
        after.append([p.detach().clone() for p in engine.module.parameters()])
    return scales, before, after


def test_overflowing_steps_are_skipped_and_the_scale_follows_deepspeed():
    engine, optimizer, _, scheduler = zoe.torch.initialize(model=HalfNet(),
                                                           config=fp16_config())
    assert engine.module.w.dtype == torch.float16 and engine.loss_scaler.loss_scale == 16
    scales, before, after = run_fp16_steps(engine, 8, OVERFLOW_STEPS)
    assert scales == STAGE_0_SCALES
    for step in range(8):
        same = all(torch.equal(a, b) for a, b in zip(before[step], after[step]))
        assert same == (step in OVERFLOW_STEPS), step
    assert engine.skipped_steps == len(OVERFLOW_STEPS) and engine.global_steps == 8
    assert scheduler.last_batch_iteration == 8 - len(OVERFLOW_STEPS) - 1
    assert float(optimizer.state_dict()["state"][0]["step"]) == 8 - len(OVERFLOW_STEPS)
    engine.close()


def test_gradients_stay_scaled_until_the_step():
    """.grad holds the gradient times the loss scale (fp16 keeps the small values); the step
    divides by the scale in fp32 (test_fp16_unscale.py)."""
    engine, optimizer, _, _ = zoe.torch.initialize(model=HalfNet(), config=fp16_config())
    x = inputs(0, 0, False)
    engine.backward((engine(x).float() ** 2).mean())
    reference = HalfNet().half()
    ((reference(x).float() ** 2).mean() / 2).backward()
    scale = engine.loss_scaler.loss_scale
    assert optimizer.grad_scale == scale
    torch.testing.assert_close(engine.module.w.grad.float() / scale, reference.w.grad.float(),
                               rtol=2e-3, atol=1e-4)
    engine.close()


def grad_scaler_sequence(pattern, interval):
    """torch's GradScaler update (growth 2, backoff 0.5) over an overflow pattern: its own
    operator where the build has a CPU kernel, else the same rule written out."""
    scale, tracker, scales = torch.tensor([16.0]), torch.tensor([0], dtype=torch.int32), []
    for overflow in pattern:
        found = torch.tensor([float(overflow)])
        try:
            torch._amp_update_scale_(scale, tracker, found, 2.0, 0.5, interval)
        except (RuntimeError, NotImplementedError):
            if overflow:
                scale, tracker = scale * 0.5, tracker * 0
            else:
                tracker = tracker + 1
                if int(tracker) == interval:
                    scale, tracker = scale * 2.0, tracker * 0
        scales.append(float(scale))
    return scales


def test_hysteresis_one_is_torch_grad_scaler():
    rng = random.Random(5)
    pattern = [rng.random() < 0.3 for _ in range(200)]
    scaler = DynamicLossScaler(initial_scale_power=4, loss_scale_window=3, hysteresis=1,
                               min_loss_scale=2.0 ** -30)
    scales = []
    for overflow in pattern:
        scaler.update(overflow)
        scales.append(scaler.loss_scale)
    assert scales == grad_scaler_sequence(pattern, 3)


def test_min_scale_consecutive_hysteresis_and_static_scale():
    scaler = DynamicLossScaler(initial_scale_power=1, hysteresis=1, min_loss_scale=1.0)
    for _ in range(3):
        scaler.update(True)
    assert scaler.loss_scale == 1.0
    scaler = DynamicLossScaler(initial_scale_power=4, hysteresis=2, consecutive_hysteresis=True)
    for overflow in (True, False, True):  # the clean step refills the hysteresis
        scaler.update(overflow)
    assert scaler.loss_scale == 16
    static = StaticLossScaler(128.0)
    static.update(True)
    assert static.loss_scale == 128.0


@pytest.mark.parametrize("stage,config_scale,expected", [
    (0, 0, (2.0 ** 16, 1, 1)),  # stage 0: 2^initial_scale_power, no hysteresis, doubles later
    (2, 0, (2.0 ** 16, 2, 0)),  # ZeRO 1-3: DynamicLossScaler with the documented defaults
    (2, 64, (64.0, None, None)),
])
def test_deepspeed_defaults(stage, config_scale, expected):
    config = fp16_config(loss_scale=config_scale)
    del config["fp16"]["initial_scale_power"], config["fp16"]["loss_scale_window"]
    config["zero_optimization"]["stage"] = stage
    engine, _, _, _ = zoe.torch.initialize(model=HalfNet(), config=config)
    scaler = engine.loss_scaler
    assert scaler.loss_scale == expected[0]
    if config_scale == 0:
        assert (scaler.scale_window, scaler.delayed_shift, scaler.growth_delay,
                scaler.min_scale) == (1000, expected[1], expected[2], 1.0)
    engine.close()


def deepspeed_stage_0_scales(pattern, scale, window, min_scale=1.0):
    """DeepSpeed's stage 0 fp16 optimizers' _update_scale (runtime/fp16/fused_optimizer.py and
    unfused_optimizer.py) written out: the scale after each step of an overflow pattern."""
    last_overflow, scales = -1, []
    for iteration, overflow in enumerate(pattern):
        if overflow:
            scale, last_overflow = max(scale / 2, min_scale), iteration
        else:
            stable = iteration - last_overflow - 1
            if stable > 0 and stable % window == 0:
                scale *= 2
        scales.append(scale)
    return scales


def test_growth_delay_one_is_deepspeeds_stage_0_rule():
    rng = random.Random(7)
    pattern = [rng.random() < 0.2 for _ in range(300)]
    scaler = DynamicLossScaler(initial_scale_power=10, loss_scale_window=4, hysteresis=1,
                               growth_delay=1)
    scales = []
    for overflow in pattern:
        scaler.update(overflow)
        scales.append(scaler.loss_scale)
    assert scales == deepspeed_stage_0_scales(pattern, 2.0 ** 10, 4)


def test_a_scaler_saved_before_the_stage_0_rule_resumes_with_the_configured_rule():
    """A stage 0 checkpoint of the time every stage had DynamicLossScaler's rule (hysteresis 2,
    no growth_delay saved): its scale and step counts are taken, the rule is the configured
    one (stage 0: hysteresis 1, growth_delay 1)."""
    old = DynamicLossScaler(initial_scale_power=6, loss_scale_window=3, hysteresis=2)
    for overflow in (False, True):
        old.update(overflow)
    saved = old.state_dict()
    del saved["growth_delay"]
    scaler = DynamicLossScaler(initial_scale_power=16, loss_scale_window=3, hysteresis=1,
                               growth_delay=1)
    scaler.load_state_dict(saved)
    assert (scaler.loss_scale, scaler.iteration, scaler.last_overflow) == (64, 2, 1)
    assert (scaler.delayed_shift, scaler.hysteresis_left, scaler.growth_delay) == (1, 1, 1)
    scaler.update(True)  # no hysteresis: the overflow halves at once
    assert scaler.loss_scale == 32
    again = DynamicLossScaler()
    again.load_state_dict(scaler.state_dict())  # saved now: the rule travels with it
    assert (again.delayed_shift, again.growth_delay, again.scale_window) == (1, 1, 3)


def fp16_run(stage, steps=len(EXPECTED_SCALES)):
    """(scales, parameters before and after each step, the engine's skipped steps) of the fp16
    script at ZeRO ``stage`` in one process (stage 3: paged parameters)."""
    config = fp16_config()
    config["zero_optimization"]["stage"] = stage
    engine, _, _, _ = zoe.torch.initialize(model=HalfNet(), config=config)
    try:
        if stage == 3:
            with engine._stage3.pager.materialized(zoe.Access.READ):
                assert engine.module.w.dtype == torch.float16
        scales, before, after = run_fp16_steps_read(engine, steps, OVERFLOW_STEPS)
        return scales, before, after, engine.skipped_steps
    finally:
        engine.close()


def module_values(engine):
    """The module's parameters (gathered or acquired when paged)."""
    state = engine.module_state_dict()
    return [state[name].clone() for name, _ in engine.module.named_parameters()]


def run_fp16_steps_read(engine, steps, overflows):
    """run_fp16_steps reading the parameters through the engine (paged ones included)."""
    scales, before, after = [], [], []
    for step in range(steps):
        before.append(module_values(engine))
        for micro in range(engine.gradient_accumulation_steps()):
            out = engine(inputs(step, micro, step in overflows))
            engine.backward((out.float() ** 2).mean())
            engine.step()
        scales.append(engine.loss_scaler.loss_scale)
        after.append(module_values(engine))
    return scales, before, after


def test_stage_3_skips_overflows_and_trains_as_stage_0():
    scales, before, after, skipped = fp16_run(3)
    assert scales == expected_scales(3) and skipped == len(OVERFLOW_STEPS)
    for step in range(len(EXPECTED_SCALES)):
        same = all(torch.equal(a, b) for a, b in zip(before[step], after[step]))
        assert same == (step in OVERFLOW_STEPS), step
    _, _, expected, _ = fp16_run(0)
    for found, wanted in zip(after[-1], expected[-1]):
        assert found.dtype == torch.float16
        torch.testing.assert_close(found, wanted, rtol=0, atol=0)
