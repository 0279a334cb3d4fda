"""Clipping by the norm of every param group (global_clip.py): zoe's optimizers with two param
groups, on the CPU, on the adversarial device twin and sharded over 2 ranks (ZeRO stages 1 and 2),
end with the parameters of torch's AdamW after clip_grad_norm_ over all the parameters -- not
those of each group clipped by its own norm -- and report that norm (last_grad_norm, and
get_global_grad_norm through initialize). A gradient that is inf in one group only skips the step
of both groups, on every rank, as the global norm is inf, with clipping and without; training
then goes on exactly."""

import contextlib
import math
import os

import pytest
import torch
import torch.distributed as dist

import zoe
import zoe.torch
from conftest import gloo_rank, small_config, spawn_ranks
from zoe.torch.device import HostTwin

STEPS = 8
INF_STEP = 3  # the second group's first gradient element is inf (on rank 0 over ranks)
MAX_NORM = 0.05
LR, WEIGHT_DECAY = 0.02, 0.01
JOIN_SECONDS = 120


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l1 = torch.nn.Linear(13, 29)
        self.l2 = torch.nn.Linear(29, 5)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x)))


def groups_of(model):
    """Weights in one group, biases in the other (as Hugging Face's decay / no-decay)."""
    return [{"params": [model.l1.weight, model.l2.weight]},
            {"params": [model.l1.bias, model.l2.bias], "weight_decay": 0.0}]


def batch(step):
    generator = torch.Generator().manual_seed(500 + step)
    return torch.randn(8, 13, generator=generator), torch.randn(8, 5, generator=generator)


def backward(model, step, rows=slice(None), poison=True):
    """The loss's backward; at INF_STEP (when ``poison``) l2.bias's gradient has an inf, put in
    by a tensor hook, before a ZeRO stage 2 optimizer's hooks reduce it."""
    x, y = batch(step)
    hook = None
    if step == INF_STEP and poison:
        hook = model.l2.bias.register_hook(lambda grad: grad.index_fill(0, torch.tensor([0]),
                                                                        float("inf")))
    torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
    if hook is not None:
        hook.remove()


def reference(steps=STEPS, max_norm=MAX_NORM):
    """torch's AdamW after clip_grad_norm_ over every parameter (to ``max_norm``; 0: the norm
    taken, nothing clipped), the step skipped when that norm is not finite; the parameters and
    the norm of each step."""
    model = Net()
    optimizer = torch.optim.AdamW(groups_of(model), lr=LR, weight_decay=WEIGHT_DECAY)
    norms = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        backward(model, step)
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                    max_norm or float("inf")))
        norms.append(norm)
        if math.isfinite(norm):
            optimizer.step()
    return [p.detach().clone() for p in model.parameters()], norms


def per_group_reference():
    """Each group clipped by its own norm: what the global clip must not equal."""
    model = Net()
    optimizer = torch.optim.AdamW(groups_of(model), lr=LR, weight_decay=WEIGHT_DECAY)
    for step in range(INF_STEP):
        optimizer.zero_grad(set_to_none=True)
        backward(model, step)
        for group in optimizer.param_groups:
            torch.nn.utils.clip_grad_norm_(group["params"], MAX_NORM)
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def assert_params_close(actual, expected):
    for a, b in zip(actual, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("max_norm", [MAX_NORM, 0.0], ids=["clipped", "unclipped"])
@pytest.mark.parametrize("place", ["cpu", "twin", "nvme"])
def test_two_groups_are_clipped_by_the_norm_of_both(nvme_dir, place, max_norm):
    """Clipped by the norm of both groups; clipped or not, the inf in one group skips both."""
    expected, norms = reference(max_norm=max_norm)
    model = Net()
    optimizer = zoe.torch.AdamW(
        groups_of(model), lr=LR, weight_decay=WEIGHT_DECAY, max_grad_norm=max_norm,
        config=small_config(nvme_dir, offload="nvme" if place == "nvme" else "cpu"),
        device_backend=HostTwin(adversarial=True) if place == "twin" else None)
    with contextlib.closing(optimizer):
        for step in range(STEPS):
            optimizer.zero_grad(set_to_none=True)
            backward(model, step)
            before = [p.detach().clone() for p in model.parameters()]
            optimizer.step()
            if step == INF_STEP:  # both groups skipped, though the first group's norm is finite
                assert math.isinf(optimizer.last_grad_norm)
                assert all(result.skipped for result in optimizer.last_step)
                assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
            else:
                assert optimizer.last_grad_norm == pytest.approx(norms[step], rel=1e-5)
                group_norms = [result.grad_norm for result in optimizer.last_step]
                assert math.hypot(*group_norms) == pytest.approx(norms[step], rel=1e-5)
        assert_params_close(list(model.parameters()), expected)
        assert [result.steps_taken for result in optimizer.last_step] == [STEPS - 1] * 2


@pytest.mark.parametrize("place", ["cpu", "twin"])
def test_a_tight_clip_is_applied_once(place):
    """max_grad_norm far below the norm: the first moments after one step are those of torch's
    clip_grad_norm_ over both groups, once (each group clipping again by its own norm would
    shrink them by 1e-6 / max_grad_norm, here 10%)."""
    tight = 1e-5
    model = Net()
    reference_optimizer = torch.optim.AdamW(groups_of(model), lr=LR, weight_decay=WEIGHT_DECAY)
    backward(model, 0)
    torch.nn.utils.clip_grad_norm_(model.parameters(), tight)
    reference_optimizer.step()
    expected = [reference_optimizer.state[p]["exp_avg"] for p in model.parameters()]
    model = Net()
    optimizer = zoe.torch.AdamW(
        groups_of(model), lr=LR, weight_decay=WEIGHT_DECAY, max_grad_norm=tight,
        config=small_config(), device_backend=HostTwin(adversarial=True) if place == "twin"
        else None)
    with contextlib.closing(optimizer):
        backward(model, 0)
        optimizer.step()
        state = optimizer.state_dict()["state"]
        order = [p for group in groups_of(model) for p in group["params"]]
        found = {id(p): state[i]["exp_avg"] for i, p in enumerate(order)}
        for param, wanted in zip(model.parameters(), expected):
            torch.testing.assert_close(found[id(param)].reshape(wanted.shape), wanted,
                                       rtol=1e-4, atol=1e-12)


def test_paged_groups_streamed_out_of_backward_report_their_own_norms(nvme_dir):
    """A paged model (stage 3 in one process): its gradients stream into the optimizer, which
    clips both groups by the norm of both; each group's StepResult has its own norm."""
    expected, norms = reference(max_norm=MAX_NORM)
    model = Net()
    engine = zoe.Engine(small_config(nvme_dir))
    with contextlib.closing(engine):
        pager = zoe.torch.offload_parameters(model, engine)
        optimizer = zoe.torch.AdamW(groups_of(model), lr=LR, weight_decay=WEIGHT_DECAY,
                                    max_grad_norm=MAX_NORM, engine=engine)
        with contextlib.closing(optimizer):
            for step in range(STEPS):
                optimizer.zero_grad(set_to_none=True)
                backward(model, step)
                optimizer.step()
                if step != INF_STEP:
                    assert optimizer.last_grad_norm == pytest.approx(norms[step], rel=1e-5)
                    group_norms = [result.grad_norm for result in optimizer.last_step]
                    assert math.hypot(*group_norms) == pytest.approx(norms[step], rel=1e-5)
            with pager.materialized():
                assert_params_close([p.detach().clone() for p in model.parameters()], expected)
        pager.remove()


@pytest.mark.parametrize("place", ["cpu", "twin"])
def test_a_step_failing_in_one_group_leaves_no_group_gradients_for_the_next(place):
    """The second group's gradient is refused (sparse) after the first group's were handed to
    zoe: the step raises, and the next iteration steps both groups on its own gradients only,
    as torch's AdamW on that batch."""
    model = Net()
    optimizer = zoe.torch.AdamW(
        groups_of(model), lr=LR, weight_decay=WEIGHT_DECAY, max_grad_norm=0.0,
        config=small_config(),
        device_backend=HostTwin(adversarial=True) if place == "twin" else None)
    with contextlib.closing(optimizer):
        backward(model, 0)
        model.l2.bias.grad = model.l2.bias.grad.to_sparse()
        with pytest.raises(zoe.InvalidArgument, match="sparse gradient"):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        backward(model, 1)
        optimizer.step()
    expected = Net()
    torch_optimizer = torch.optim.AdamW(groups_of(expected), lr=LR, weight_decay=WEIGHT_DECAY)
    backward(expected, 1)
    torch_optimizer.step()
    assert_params_close(list(model.parameters()), list(expected.parameters()))


def test_the_global_clip_differs_from_clipping_each_group():
    """The case above is one where clipping each group by its own norm gives other values."""
    model = Net()
    optimizer = zoe.torch.AdamW(groups_of(model), lr=LR, weight_decay=WEIGHT_DECAY,
                                max_grad_norm=MAX_NORM, config=small_config())
    with contextlib.closing(optimizer):
        for step in range(INF_STEP):
            optimizer.zero_grad(set_to_none=True)
            backward(model, step)
            optimizer.step()
    expected, _ = reference(INF_STEP)
    assert_params_close(list(model.parameters()), expected)
    apart = max(float((a - b).abs().max())
                for a, b in zip(model.parameters(), per_group_reference()))
    assert apart > 1e-4


def test_initialize_reports_and_clips_by_the_global_norm():
    """DeepSpeed's gradient_clipping through initialize: the engine's step and its
    get_global_grad_norm() are those of every param group together."""
    expected, norms = reference(INF_STEP)
    model = Net()
    config = small_config()
    config["zero_optimization"]["stage"] = 0
    config.update(train_batch_size=8, gradient_clipping=MAX_NORM,
                  optimizer={"type": "AdamW", "params": {"lr": LR,
                                                         "weight_decay": WEIGHT_DECAY}})
    engine, *_ = zoe.torch.initialize(model=model, model_parameters=groups_of(model),
                                      config=config)
    with engine:
        for step in range(INF_STEP):
            x, y = batch(step)
            engine.backward(torch.nn.functional.mse_loss(engine(x), y))
            engine.step()
            assert engine.get_global_grad_norm() == pytest.approx(norms[step], rel=1e-5)
    assert_params_close(list(model.parameters()), expected)


def rank_training(rank, out_dir, stage, twin):
    """STEPS steps of two groups sharded over the world (each rank half of every batch); the
    inf gradient on rank 0 only."""
    model = Net()
    optimizer = zoe.torch.AdamW(
        groups_of(model), lr=LR, weight_decay=WEIGHT_DECAY, max_grad_norm=MAX_NORM,
        config=small_config(), process_group=dist.group.WORLD, zero_stage=stage,
        bucket_elements=100, device_backend=HostTwin(adversarial=True) if twin else None)
    world = dist.get_world_size()
    rows = slice(rank * 8 // world, (rank + 1) * 8 // world)
    norms, skipped = [], []
    with contextlib.closing(optimizer):
        for step in range(STEPS):
            optimizer.zero_grad(set_to_none=True)
            backward(model, step, rows, poison=rank == 0)
            optimizer.step()
            norms.append(optimizer.last_grad_norm)
            skipped.append([result.skipped for result in optimizer.last_step])
    torch.save({"params": [p.detach().clone() for p in model.parameters()], "norms": norms,
                "skipped": skipped}, os.path.join(out_dir, f"s{stage}-{twin}-rank{rank}.pt"))


def worker(rank, init_file, out_dir, runs):
    with gloo_rank(rank, 2, init_file, out_dir):
        for stage, twin in runs:
            rank_training(rank, out_dir, stage, twin)


RUNS = [(2, False), (1, True)]


def test_sharded_groups_are_clipped_by_the_norm_over_every_rank(tmp_path):
    out_dir = str(tmp_path)
    spawn_ranks(worker, (os.path.join(out_dir, "init"), out_dir, RUNS), 2, out_dir,
                JOIN_SECONDS)
    expected, norms = reference()
    for stage, twin in RUNS:
        for rank in range(2):
            result = torch.load(os.path.join(out_dir, f"s{stage}-{twin}-rank{rank}.pt"))
            assert_params_close(result["params"], expected)
            assert result["skipped"][INF_STEP] == [True, True]
            assert not any(any(step) for step in result["skipped"][:INF_STEP])
            assert math.isinf(result["norms"][INF_STEP])
            for step in range(STEPS):
                if step != INF_STEP:
                    assert result["norms"][step] == pytest.approx(norms[step], rel=1e-5)
