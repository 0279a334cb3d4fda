"""zoe.arithmetic through zoe.torch: "fast" (a reciprocal of Adam's bias correction) reaches the
kernels and stays within the bound optim/chunk.h states of "exact" (the default, torch's bits);
fp32 parameters written by the update's own pass hold the master's bits."""

import numpy as np
import pytest
import torch

import zoe
import zoe.torch
from conftest import small_config

MASTER_ULPS = 2  # optim::kFastMasterUlps
UPDATE_ULPS = 3  # optim::kFastUpdateUlps


def make_model(zero_weights=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 33))
    if zero_weights:
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
    return model


def set_grads(model, step):
    generator = torch.Generator().manual_seed(100 + step)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=generator) * 1e-2


def ulp_distance(a, b):
    """Units in the last place between fp32 tensors of the same signs."""
    x = a.detach().numpy().view(np.int32).astype(np.int64)
    y = b.detach().numpy().view(np.int32).astype(np.int64)
    return np.abs(x - y)


def run(arithmetic, steps=1, zero_weights=False):
    model = make_model(zero_weights)
    config = small_config(arithmetic=arithmetic) if arithmetic else small_config()
    with zoe.Engine(config) as engine:
        weight_decay = 0.0 if zero_weights else 1e-2
        optimizer = zoe.torch.AdamW(
            model.parameters(), lr=1e-3, weight_decay=weight_decay, engine=engine
        )
        for step in range(steps):
            set_grads(model, step)
            optimizer.step()
        saved = optimizer.state_dict()["state"]
        state = [{k: saved[i][k].clone() for k in ("exp_avg", "exp_avg_sq")} for i in sorted(saved)]
        optimizer.close()
    return [p.detach().clone() for p in model.parameters()], state


def test_exact_is_the_default():
    default_params, default_state = run(None, steps=3)
    exact_params, exact_state = run("exact", steps=3)
    for a, b in zip(default_params, exact_params):
        assert torch.equal(a, b)
    for a, b in zip(default_state, exact_state):
        assert torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])


def test_fast_arithmetic_stays_within_the_stated_ulps_of_exact():
    exact_params, exact_state = run("exact")
    fast_params, fast_state = run("fast")
    for exact, fast, before in zip(exact_params, fast_params, make_model().parameters()):
        # The bound holds where the step changed a weight by at most a quarter of its magnitude.
        small_step = (exact - before).abs() <= before.abs() / 4
        assert small_step.float().mean() > 0.5
        assert ulp_distance(exact, fast)[small_step.numpy()].max() <= MASTER_ULPS
    for exact, fast in zip(exact_state, fast_state):
        assert torch.equal(exact["exp_avg"], fast["exp_avg"])
        assert torch.equal(exact["exp_avg_sq"], fast["exp_avg_sq"])


def test_fast_update_term_is_within_the_stated_ulps_and_really_fast():
    # Weights 0 and no decay: after one step a weight is the update term itself.
    exact_params, _ = run("exact", zero_weights=True)
    fast_params, _ = run("fast", zero_weights=True)
    differing = 0
    for exact, fast in zip(exact_params, fast_params):
        distance = ulp_distance(exact, fast)
        assert distance.max() <= UPDATE_ULPS
        differing += int((distance != 0).sum())
    assert differing > 0, "fast arithmetic did not reach the kernels"


def test_unknown_arithmetic_is_refused_naming_the_allowed_values():
    with pytest.raises(zoe.InvalidArgument, match="allowed: exact, fast"):
        zoe.Engine(small_config(arithmetic="approximate"))
