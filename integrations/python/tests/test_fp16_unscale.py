"""fp16 under zoe.torch.initialize keeps the gradients scaled in .grad and divides them by the loss
scale in fp32 where zoe steps: true gradients too small for fp16 (1e-7 to 1e-8) reach the
moments and master weights intact at stages 0, 2 and 3 (one and two param groups, one process
and two gloo ranks), clipping and get_global_grad_norm() use the unscaled norm, and a torch
optimizer at stage 0 steps on gradients unscaled in place."""

import math
import os

import pytest
import torch

import zoe.torch
from conftest import gloo_rank, spawn_ranks
from zoe.torch.device import HostTwin

SCALE = 2.0 ** 16
LR = 1e-3
BETA1, BETA2, EPS = 0.9, 0.999, 1e-8
# dloss/dparam of TinyGradNet: representable in fp16 only once multiplied by SCALE (fp16's
# smallest subnormal is about 6e-8; unscaled in fp16 these come back 19% high or as 0)
TRUE_GRADS = [1.5e-7, 5e-8, 1.5e-8, 1e-8, -3e-8, 2e-7, 7e-8, -1.2e-7,
              4e-8, -9e-8, 1.1e-7, 2.5e-8]
SPLIT = 8  # w takes the first SPLIT gradients, b the rest
# gradient_clipping: none; above the true norm (about 3.6e-7) but below the scaled one (about
# 0.02), which must not clip; below the true norm, which clips
CLIPS = (0.0, 1e-3, 1e-7)
# (gradient_clipping, two param groups)
CASES = [(clip, grouped) for clip in CLIPS for grouped in (False, True)]
JOIN_SECONDS = 90
WORLD = 2


class TinyGradNet(torch.nn.Module):
    """loss = w . x[:SPLIT] + b . x[SPLIT:]: each parameter's gradient is its slice of the fp32
    input, computed in fp32 and rounded to fp16 only as it is stored in .grad."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(SPLIT))
        self.b = torch.nn.Parameter(torch.ones(len(TRUE_GRADS) - SPLIT))

    def forward(self, x):
        return (self.w * x[:SPLIT]).sum() + (self.b * x[SPLIT:]).sum()


def fp16_config(stage, clip, world=1):
    return {
        "train_batch_size": world,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": clip,
        "fp16": {"enabled": True, "initial_scale_power": 16},
        "optimizer": {"type": "AdamW", "params": {
            "lr": LR, "betas": [BETA1, BETA2], "eps": EPS, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage},
        "zoe": {"device": "host", "chunk_size": "64K", "host_budget": "64M",
                "tensor_swap_bytes": "1M", "log_level": "error"},
    }


def stored_grads():
    """The unscaled gradients zoe must step on: SCALE x the true ones rounded to fp16 (as
    backward stores them), divided by SCALE in float64 (exact, as zoe's fp32 division)."""
    scaled = (torch.tensor(TRUE_GRADS, dtype=torch.float64) * SCALE).half()
    return scaled.double() / SCALE


def clip_factor(grads, clip):
    """clip_grad_norm_'s factor over the unscaled gradients (1 without clipping)."""
    if not clip:
        return 1.0
    norm = torch.linalg.vector_norm(grads.float())
    return float(torch.clamp(clip / (norm + 1e-6), max=1.0))


def expected_state(clip):
    """AdamW's first step on the unscaled, clipped gradients, in float64: exp_avg, exp_avg_sq,
    the fp32 master weights (from 1.0) and the global norm."""
    grads = stored_grads()
    clipped = grads * clip_factor(grads, clip)
    exp_avg = (1 - BETA1) * clipped
    exp_avg_sq = (1 - BETA2) * clipped ** 2
    update = (exp_avg / (1 - BETA1)) / ((exp_avg_sq / (1 - BETA2)).sqrt() + EPS)
    return exp_avg, exp_avg_sq, 1.0 - LR * update, float(grads.norm())


def param_groups(model, grouped):
    if not grouped:
        return None
    return [{"params": [model.w]}, {"params": [model.b]}]


def train_one_step(stage, clip, grouped, world=1):
    """One fp16 step of TinyGradNet; (the optimizer's state per parameter as flat float64
    tensors: exp_avg, exp_avg_sq, master_param; the engine's global grad norm; whether the
    step was applied)."""
    model = TinyGradNet()
    engine, optimizer, _, _ = zoe.torch.initialize(
        model=model, model_parameters=param_groups(model, grouped),
        config=fp16_config(stage, clip, world))
    try:
        assert engine.loss_scaler.loss_scale == SCALE
        engine.backward(engine(torch.tensor(TRUE_GRADS, dtype=torch.float32)))
        engine.step()
        state = optimizer.state_dict()["state"]
        found = [torch.cat([state[index][key].double().reshape(-1) for index in sorted(state)])
                 for key in ("exp_avg", "exp_avg_sq", "master_param")]
        return found, engine.get_global_grad_norm(), engine.was_step_applied()
    finally:
        engine.close()


def check_step(found, norm, applied, clip):
    exp_avg, exp_avg_sq, master, expected_norm = expected_state(clip)
    assert applied
    torch.testing.assert_close(found[0], exp_avg, rtol=1e-5, atol=0)
    torch.testing.assert_close(found[1], exp_avg_sq, rtol=1e-5, atol=0)
    torch.testing.assert_close(found[2], master, rtol=0, atol=2e-7)
    assert math.isclose(norm, expected_norm, rel_tol=1e-5)


@pytest.mark.parametrize("clip,grouped", CASES)
@pytest.mark.parametrize("stage", (0, 2, 3))
def test_tiny_gradients_step_unscaled_in_fp32(stage, clip, grouped):
    check_step(*train_one_step(stage, clip, grouped), clip)


def test_grad_holds_the_scaled_gradients():
    engine, optimizer, _, _ = zoe.torch.initialize(model=TinyGradNet(),
                                                   config=fp16_config(0, 0.0))
    try:
        engine.backward(engine(torch.tensor(TRUE_GRADS, dtype=torch.float32)))
        scaled = (torch.tensor(TRUE_GRADS, dtype=torch.float64) * SCALE).half()
        assert torch.equal(engine.module.w.grad, scaled[:SPLIT])
        assert optimizer.grad_scale == SCALE
    finally:
        engine.close()


def test_grad_scale_is_checked():
    optimizer = zoe.torch.AdamW([torch.nn.Parameter(torch.ones(4))],
                                config={"zoe": {"log_level": "error"}})
    try:
        for bad in (0.0, -1.0, math.inf, math.nan):
            with pytest.raises(zoe.InvalidArgument, match="grad_scale"):
                optimizer.grad_scale = bad
        assert optimizer.grad_scale == 1.0
    finally:
        optimizer.close()


def test_speculative_device_group_speculates_with_the_loss_scale():
    """A zoe AdamW on the CPU twin that updates during the boundary backward: told the loss
    scale before that backward, its speculative updates are the step's (committed, none
    recomputed) and unscaled in fp32."""
    model = TinyGradNet().half()
    config = {key: value for key, value in fp16_config(0, 0.0).items() if key != "optimizer"}
    optimizer = zoe.torch.AdamW(model.parameters(), lr=LR, betas=(BETA1, BETA2), eps=EPS,
                                weight_decay=0.0, device_backend=HostTwin(adversarial=True),
                                speculative=True)
    engine, _, _, _ = zoe.torch.initialize(model=model, optimizer=optimizer, config=config)
    try:
        engine.backward(engine(torch.tensor(TRUE_GRADS, dtype=torch.float32)))
        engine.step()
        stats = optimizer._groups[0].zoe_group.speculation_stats()
        assert stats["chunks_committed"] > 0 and stats["chunks_recomputed"] == 0, stats
        state = optimizer.state_dict()["state"]
        found = [torch.cat([state[index][key].double().reshape(-1) for index in sorted(state)])
                 for key in ("exp_avg", "exp_avg_sq", "master_param")]
        check_step(found, engine.get_global_grad_norm(), engine.was_step_applied(), 0.0)
    finally:
        engine.close()
        optimizer.close()


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps the gradients each step saw."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self.seen = []

    def step(self, closure=None):
        self.seen.append([p.grad.clone() for g in self.param_groups for p in g["params"]])
        return super().step(closure)


@pytest.mark.parametrize("clip", (0.0, 0.5, 1e-2))
def test_torch_optimizer_steps_unscaled_gradients(clip):
    """Stage 0 with a torch optimizer (no fp32 masters): .grad unscaled in place right before
    clipping (by the unscaled norm) and the step, within fp16's precision."""
    model = TinyGradNet()
    config = {key: value for key, value in fp16_config(0, clip).items() if key != "optimizer"}
    given = RecordingSGD(model.parameters(), lr=0.1)
    engine, optimizer, _, _ = zoe.torch.initialize(model=model, optimizer=given, config=config)
    assert optimizer is given
    try:
        true = torch.linspace(-1e-3, 2e-3, len(TRUE_GRADS), dtype=torch.float64)
        engine.backward(engine(true.float()))
        engine.step()
        seen = torch.cat([grad.double() for grad in optimizer.seen[0]])
        expected = true * clip_factor(true, clip)
        torch.testing.assert_close(seen, expected, rtol=2e-3, atol=1e-9)
    finally:
        engine.close()


def rank_worker(rank, out_dir, world, stage):
    with gloo_rank(rank, world, f"{out_dir}/init", out_dir):
        results = {}
        for clip, grouped in CASES:
            results[(clip, grouped)] = train_one_step(stage, clip, grouped, world)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("stage", (0, 2))
def test_ranks_step_tiny_gradients_unscaled_in_fp32(nvme_dir, stage):
    """Every rank's loss gives the same gradients, so the averaged ones are TRUE_GRADS."""
    spawn_ranks(rank_worker, (nvme_dir, WORLD, stage), WORLD, nvme_dir, JOIN_SECONDS)
    for rank in range(WORLD):
        results = torch.load(os.path.join(nvme_dir, f"rank{rank}.pt"))
        for (clip, _), result in results.items():
            check_step(*result, clip)
