"""zoe.torch with int8 moments (moment_dtype="int8"): state_dict exports dequantized fp32 moments in
torch's layout that torch.optim.AdamW loads, loading one requantizes within the code's error, and
training tracks fp32 moments; in DRAM and on NVMe."""

import copy

import pytest
import torch

import zoe
import zoe.torch
from conftest import small_config
from test_optim import assert_params_close, make_model, train_step

# Half the widest gap of the signed dynamic code (optim/quantize.h): 0.9 / 64 / 2.
SIGNED_CODE_ERROR = 0.9 / 64 / 2
# exp_avg_sq is stored as its square root in the unsigned code (twice as fine: e = 0.9 / 64 / 4
# of sqrt(absmax)); squared back, its error is at most (2e + e^2) x absmax (docs/int8-moments.md).
UNSIGNED_ROOT_ERROR = 0.9 / 64 / 4
SQ_ERROR = 2 * UNSIGNED_ROOT_ERROR + UNSIGNED_ROOT_ERROR**2
# The stated errors are of exact arithmetic; dequantizing (code value x block scale, in fp32) adds
# rounding of a few ulp.
ROUNDING_SLACK = 1.0001


@pytest.fixture(params=["cpu", "nvme"])
def int8_engine(request, nvme_dir):
    return zoe.Engine(small_config(nvme_dir, offload=request.param, moment_dtype="int8"))


def test_state_dict_round_trip_through_torch_adamw(int8_engine):
    model = make_model()
    zoe_opt = zoe.torch.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05, engine=int8_engine)
    for step in range(5):
        train_step(model, zoe_opt, step)
    assert int8_engine.stats()["groups"][0]["moment_dtype"] == "int8"  # the engine's, not fp32
    state = zoe_opt.state_dict()
    for index, param in enumerate(model.parameters()):
        entry = state["state"][index]
        assert set(entry) == {"step", "exp_avg", "exp_avg_sq"}
        for key in ("exp_avg", "exp_avg_sq"):
            assert entry[key].dtype == torch.float32 and entry[key].shape == param.shape
        assert entry["exp_avg_sq"].min() >= 0 and entry["exp_avg_sq"].max() > 0

    torch_model = copy.deepcopy(model)
    torch_opt = torch.optim.AdamW(torch_model.parameters(), lr=0.5)
    torch_opt.load_state_dict(state)
    for step in range(5, 10):
        train_step(torch_model, torch_opt, step)

    back_model = copy.deepcopy(torch_model)
    back_opt = zoe.torch.AdamW(back_model.parameters(), lr=0.5, engine=int8_engine, name="back")
    back_opt.load_state_dict(torch_opt.state_dict())
    loaded = back_opt.state_dict()["state"]
    for index, expected in torch_opt.state_dict()["state"].items():
        assert int(loaded[index]["step"]) == 10
        for key in ("exp_avg", "exp_avg_sq"):
            # Each element within the code's error of its block's absmax (<= the tensor's).
            bound = SIGNED_CODE_ERROR * expected[key].abs().max().item() * 1.01
            error = (loaded[index][key] - expected[key]).abs().max().item()
            assert error <= bound, (index, key, error, bound)
    # The requantized state keeps training like torch's fp32 state.
    for step in range(10, 15):
        loss_zoe = train_step(back_model, back_opt, step)
        loss_torch = train_step(torch_model, torch_opt, step)
        assert loss_zoe == pytest.approx(loss_torch, rel=0.05)
    zoe_opt.close()
    back_opt.close()


def test_training_tracks_fp32_moments(int8_engine):
    reference, model = make_model(), make_model()
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=3e-3, weight_decay=0.1)
    zoe_opt = zoe.torch.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, engine=int8_engine)
    first = None
    for step in range(50):
        loss_ref = train_step(reference, torch_opt, step)
        loss = train_step(model, zoe_opt, step)
        first = first or loss_ref
    assert loss_ref < 0.9 * first  # it trains
    assert loss == pytest.approx(loss_ref, rel=0.03)
    assert int8_engine.stats()["groups"][0]["moment_dtype"] == "int8"
    zoe_opt.close()


def test_each_step_matches_fp32_moments_from_the_same_state(int8_engine):
    """Step by step against torch.optim.AdamW (fp32 moments) started from zoe's own state: the
    int8 kernel runs fp32 arithmetic on the dequantized moments, so the parameters it writes are
    those of the fp32 step (identical bits under EXACT_TORCH), and the moments it keeps are the
    fp32 step's within the code's stated error of the tensor's absmax (>= each block's)."""
    model = make_model()
    hyper = {"lr": 3e-3, "weight_decay": 0.1}
    zoe_opt = zoe.torch.AdamW(model.parameters(), engine=int8_engine, **hyper)
    for step in range(20):
        reference = copy.deepcopy(model)
        torch_opt = torch.optim.AdamW(reference.parameters(), **hyper)
        if step > 0:  # the fp32 reference starts from zoe's dequantized moments
            torch_opt.load_state_dict(zoe_opt.state_dict())
        train_step(model, zoe_opt, step)
        train_step(reference, torch_opt, step)
        assert_params_close(model, reference)
        got, want = zoe_opt.state_dict()["state"], torch_opt.state_dict()["state"]
        for index, expected in want.items():
            assert int(got[index]["step"]) == step + 1
            for key, code_error in (("exp_avg", SIGNED_CODE_ERROR), ("exp_avg_sq", SQ_ERROR)):
                bound = code_error * expected[key].abs().max().item() * ROUNDING_SLACK
                error = (got[index][key] - expected[key]).abs().max().item()
                assert error <= bound, (step, index, key, error, bound)
    assert int8_engine.stats()["groups"][0]["moment_dtype"] == "int8"
    zoe_opt.close()


def test_an_unknown_moment_dtype_names_the_allowed_ones(nvme_dir):
    with pytest.raises(zoe.InvalidArgument) as error:
        zoe.Engine(small_config(nvme_dir, moment_dtype="int4"))
    assert "fp32, bf16, int8" in str(error.value)
