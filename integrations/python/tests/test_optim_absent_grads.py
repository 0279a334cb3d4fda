"""zoe.torch.AdamW / Adam with parameters whose .grad is None (an unused branch, heads used on
alternate steps) against torch.optim over 36 steps on DRAM and NVMe: skipped parameters keep
their state, step count and values, each parameter has its own step count (bias correction), and
state dicts with differing step counts move between zoe and torch both ways, through
checkpoints and on paged parameters. Comparisons demand
identical bits where conftest selected ATen's portable kernels (EXACT_TORCH; see test_optim.py)."""

import copy

import pytest
import torch

import zoe
import zoe.torch
from conftest import EXACT_TORCH, small_config
from test_offload_parameters import TinyGPT, loss_of, paging_engine  # noqa: F401 (a fixture)

STEPS = 36


class Heads(torch.nn.Module):
    """A trunk and three heads: head "a" on even steps, "b" on odd steps and those divisible by
    3, "unused" never; so per parameter the step counts differ and some parameters never get a
    gradient."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.trunk = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.GELU())
        self.a = torch.nn.Linear(32, 5)
        self.b = torch.nn.Linear(32, 5)
        self.unused = torch.nn.Linear(32, 5)

    def forward(self, x, step):
        h = self.trunk(x)
        out = torch.zeros(x.shape[0], 5)
        if step % 2 == 0:
            out = out + self.a(h)
        if step % 2 == 1 or step % 3 == 0:
            out = out + self.b(h)
        return out


def train_step(model, optimizer, step):
    optimizer.zero_grad(set_to_none=True)
    generator = torch.Generator().manual_seed(2000 + step)
    x = torch.randn(16, 12, generator=generator)
    y = torch.randn(16, 5, generator=generator)
    torch.nn.functional.mse_loss(model(x, step), y).backward()
    optimizer.step()


def expected_steps(steps):
    """torch's per-parameter step counts after `steps` steps, by parameter name."""
    a = sum(1 for step in range(steps) if step % 2 == 0)
    b = sum(1 for step in range(steps) if step % 2 == 1 or step % 3 == 0)
    return {"trunk": steps, "a": a, "b": b, "unused": 0}


def assert_same(a, b):
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        if EXACT_TORCH:
            assert torch.equal(pa, pb), name
        else:
            torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-7, msg=name)


def assert_same_state(zoe_state, torch_state):
    assert set(zoe_state["state"]) == set(torch_state["state"])
    for index, expected in torch_state["state"].items():
        actual = zoe_state["state"][index]
        assert float(actual["step"]) == float(expected["step"]), index
        for key in ("exp_avg", "exp_avg_sq"):
            if EXACT_TORCH:
                assert torch.equal(actual[key], expected[key]), (index, key)
            else:
                torch.testing.assert_close(actual[key], expected[key], rtol=1e-5, atol=1e-10)


@pytest.fixture(params=["cpu", "nvme"])
def offload(request, nvme_dir):
    """Engine options for the optimizer state in DRAM and on NVMe."""
    engine = zoe.Engine(small_config(nvme_dir, offload=request.param))
    yield dict(engine=engine)
    engine.close()


@pytest.mark.parametrize("torch_class,zoe_class", [(torch.optim.AdamW, zoe.torch.AdamW),
                                                   (torch.optim.Adam, zoe.torch.Adam)])
def test_parameters_without_gradients_are_skipped_as_torch_skips_them(
    torch_class, zoe_class, offload
):
    reference, model = Heads(), Heads()
    torch_opt = torch_class(reference.parameters(), lr=3e-3, weight_decay=0.1)
    zoe_opt = zoe_class(model.parameters(), lr=3e-3, weight_decay=0.1, **offload)
    unused_before = copy.deepcopy(model.unused.state_dict())
    for step in range(STEPS):
        b_before = copy.deepcopy(model.b.state_dict())
        train_step(reference, torch_opt, step)
        train_step(model, zoe_opt, step)
        assert_same(model, reference)
        if step % 2 == 0 and step % 3 != 0:  # no gradient for head b: untouched, no decay
            for key, value in model.b.state_dict().items():
                assert torch.equal(value, b_before[key]), (step, key)
    for key, value in model.unused.state_dict().items():
        assert torch.equal(value, unused_before[key]), key
    assert zoe_opt.last_step[0].steps_taken == STEPS
    assert zoe_opt.engine.stats()["groups"][0]["segments"] == len(list(model.parameters()))
    state = zoe_opt.state_dict()
    assert_same_state(state, torch_opt.state_dict())
    names = [name.split(".")[0] for name, _ in model.named_parameters()]
    counts = expected_steps(STEPS)
    for index, name in enumerate(names):
        if counts[name] == 0:
            assert index not in state["state"], name  # torch keeps no state for it either
        else:
            assert float(state["state"][index]["step"]) == counts[name], name


def test_the_gradient_norm_leaves_out_parameters_without_gradients():
    torch.manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(100)) for _ in range(3)]
    optimizer = zoe.torch.AdamW(params, lr=1e-2)
    params[0].grad = torch.full((100,), 3.0)
    params[2].grad = torch.full((100,), 4.0)
    optimizer.step()
    # sqrt(100 * 9 + 100 * 16) = 50.0 exactly
    assert optimizer.last_step[0].grad_norm == 50.0
    optimizer.close()


def test_torch_state_dict_with_differing_steps_loads_into_zoe_and_back(offload):
    reference = Heads()
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=3e-3, weight_decay=0.1)
    for step in range(10):
        train_step(reference, torch_opt, step)
    torch_state = torch_opt.state_dict()
    steps = {float(entry["step"]) for entry in torch_state["state"].values()}
    assert len(steps) == 3  # the trunk, head a and head b took different numbers of steps

    # torch -> zoe: zoe continues exactly like torch.
    model = copy.deepcopy(reference)
    zoe_opt = zoe.torch.AdamW(model.parameters(), lr=1.0, **offload)
    zoe_opt.load_state_dict(torch_state)
    assert_same_state(zoe_opt.state_dict(), torch_state)
    for step in range(10, 20):
        train_step(reference, torch_opt, step)
        train_step(model, zoe_opt, step)
        assert_same(model, reference)
    assert_same_state(zoe_opt.state_dict(), torch_opt.state_dict())

    # zoe -> torch: a fresh torch optimizer continues exactly like zoe.
    back = copy.deepcopy(model)
    back_opt = torch.optim.AdamW(back.parameters(), lr=1.0)
    back_opt.load_state_dict(zoe_opt.state_dict())
    for step in range(20, 30):
        train_step(back, back_opt, step)
        train_step(model, zoe_opt, step)
        assert_same(model, back)
    assert_same_state(zoe_opt.state_dict(), back_opt.state_dict())


def test_checkpoint_keeps_per_parameter_steps(nvme_dir):
    config = small_config(nvme_dir, offload="nvme")
    model = Heads()
    with zoe.Engine(config) as engine:
        optimizer = zoe.torch.AdamW(model.parameters(), lr=5e-3, engine=engine)
        for step in range(7):
            train_step(model, optimizer, step)
        optimizer.save_checkpoint(nvme_dir + "/ckpt")
        saved_state = optimizer.state_dict()
        for step in range(7, 14):
            train_step(model, optimizer, step)

    resumed = Heads(seed=5)
    with zoe.Engine(config) as engine:
        optimizer = zoe.torch.AdamW(resumed.parameters(), lr=1.0, engine=engine)
        optimizer.load_checkpoint(nvme_dir + "/ckpt")
        assert_same_state(optimizer.state_dict(), saved_state)
        for step in range(7, 14):
            train_step(resumed, optimizer, step)
        assert_same(resumed, model)


def test_paged_parameters_without_gradients_are_neither_written_nor_stepped(paging_engine):
    # The same zoe optimizer with and without paging, the second block left out of backward on
    # odd steps (its gradients stream out of backward when paged, so they are absent by not
    # being produced): the paged parameters agree bit for bit and the absent ones keep their
    # values.
    torch.manual_seed(1)
    reference = TinyGPT()
    model = copy.deepcopy(reference)
    pager = zoe.torch.offload_parameters(model, paging_engine)
    reference_opt = zoe.torch.AdamW(reference.parameters(), lr=1e-2, engine=paging_engine,
                                    name="reference")
    zoe_opt = zoe.torch.AdamW(model.parameters(), lr=1e-2, engine=paging_engine, name="paged")
    for step in range(4):
        for m, opt in ((reference, reference_opt), (model, zoe_opt)):
            opt.zero_grad(set_to_none=True)
            m.blocks[1].requires_grad_(step % 2 == 0)
            loss_of(m, step)[1].backward()
            m.blocks[1].requires_grad_(True)
        before = copy.deepcopy(reference.blocks[1].state_dict())
        reference_opt.step()
        zoe_opt.step()
        if step % 2 == 1:
            for key, value in reference.blocks[1].state_dict().items():
                assert torch.equal(value, before[key]), (step, key)
    for (name, p_ref), p in zip(reference.named_parameters(), model.parameters()):
        with pager.held(p) as values:
            assert torch.equal(values, p_ref), name
    names = [name for name, _ in reference.named_parameters()]
    state = zoe_opt.state_dict()["state"]
    for index, name in enumerate(names):
        assert float(state[index]["step"]) == (2 if name.startswith("blocks.1.") else 4), name
    pager.remove()
