"""DeepSpeed's WarmupLR, WarmupDecayLR and WarmupCosineLR (zoe.torch.lr_schedules) against their
formulas (DeepSpeed 0.19.3 on) at several steps, log and linear warmup, their defaults and edges
(warmup_max_lr from the optimizer, the cosine held at its floor past total_num_steps,
warmup_num_steps checked), and stepped by the engine after each optimizer step when named in the
config, a torch.optim.lr_scheduler class included."""

import math

import pytest
import torch

import zoe
import zoe.torch
from initialize_script import assert_same_state, ds_config, make_model, module_values, \
    train_engine
from zoe.torch.lr_schedules import WarmupCosineLR, WarmupDecayLR, WarmupLR

LOW, HIGH, WARM, TOTAL = 0.001, 0.01, 10, 30


def optimizer(lr=0.02):
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr)


def rate_at(schedule, iteration):
    schedule.step(iteration)
    return schedule.optimizer.param_groups[0]["lr"]


def warmup(t, kind):
    return math.log(t + 1) / math.log(WARM) if kind == "log" else t / WARM


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_lr(kind):
    schedule = WarmupLR(optimizer(), LOW, HIGH, WARM, warmup_type=kind)
    # warmup_min_lr from construction, so the first optimizer step takes it (DeepSpeed's too)
    assert schedule.optimizer.param_groups[0]["lr"] == LOW
    assert schedule.get_lr() == [LOW]
    for t in (0, 1, 4, 9):
        assert rate_at(schedule, t) == pytest.approx(LOW + (HIGH - LOW) * warmup(t, kind))
    for t in (10, 25, 1000):
        assert rate_at(schedule, t) == pytest.approx(HIGH)


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_decay_lr(kind):
    schedule = WarmupDecayLR(optimizer(), TOTAL, LOW, HIGH, WARM, warmup_type=kind)
    assert schedule.optimizer.param_groups[0]["lr"] == LOW
    for t in (0, 3, 9):
        assert rate_at(schedule, t) == pytest.approx(LOW + (HIGH - LOW) * warmup(t, kind))
    for t in (10, 15, 29, 30, 45):
        decay = max(0.0, (TOTAL - t) / (TOTAL - WARM))
        assert rate_at(schedule, t) == pytest.approx(LOW + (HIGH - LOW) * decay)
    assert rate_at(schedule, 20) == pytest.approx(LOW + (HIGH - LOW) * 0.5)


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_cosine_lr(kind):
    base, start, end = 0.02, 0.1, 0.05
    schedule = WarmupCosineLR(optimizer(base), TOTAL, warmup_min_ratio=start,
                              warmup_num_steps=WARM, cos_min_ratio=end, warmup_type=kind)
    assert schedule.optimizer.param_groups[0]["lr"] == 0.0  # as DeepSpeed's, before step()
    for t in (0, 5, 9):
        ratio = start + (1 - start) * warmup(t, kind)
        assert rate_at(schedule, t) == pytest.approx(base * ratio)
    for t in (10, 17, 29):
        cosine = (1 + math.cos(math.pi * (t - WARM + 1) / (TOTAL - WARM))) / 2
        assert rate_at(schedule, t) == pytest.approx(base * (end + (1 - end) * cosine))
    assert rate_at(schedule, TOTAL - 1) == pytest.approx(base * end)
    for t in (TOTAL, TOTAL + 7, 3 * TOTAL):  # held at the floor, not up the cosine again
        assert rate_at(schedule, t) == pytest.approx(base * end)


@pytest.mark.parametrize("total", [WARM, WARM - 4, WARM + 1])
def test_warmup_cosine_lr_without_a_decay_window_holds_its_floor(total):
    base, end = 0.02, 0.05
    schedule = WarmupCosineLR(optimizer(base), total, warmup_num_steps=WARM, cos_min_ratio=end)
    for t in range(WARM, WARM + 6):
        expected = end if t >= total else None
        rate = rate_at(schedule, t)
        if expected is not None:
            assert rate == pytest.approx(base * end)
        assert base * end - 1e-12 <= rate <= base


def test_warmup_lr_rises_to_each_groups_lr_without_warmup_max_lr():
    groups = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": 0.02},
                              {"params": [torch.nn.Parameter(torch.zeros(2))], "lr": 0.005}],
                             lr=0.1)
    schedule = WarmupLR(groups, warmup_min_lr=LOW, warmup_num_steps=WARM)
    for t in (3, WARM, 40):
        schedule.step(t)
        gamma = min(1.0, warmup(t, "log"))
        assert schedule.get_last_lr() == pytest.approx(
            [LOW + (0.02 - LOW) * gamma, LOW + (0.005 - LOW) * gamma])
    decay = WarmupDecayLR(optimizer(0.02), TOTAL, warmup_num_steps=WARM)
    decay.step(WARM)
    assert decay.get_last_lr() == pytest.approx([0.001 * (TOTAL - WARM) / (TOTAL - WARM)])


@pytest.mark.parametrize("schedule", [
    lambda steps: WarmupLR(optimizer(), warmup_num_steps=steps),
    lambda steps: WarmupDecayLR(optimizer(), TOTAL, warmup_num_steps=steps),
    lambda steps: WarmupCosineLR(optimizer(), TOTAL, warmup_num_steps=steps)])
@pytest.mark.parametrize("steps", [0, -3, 2.5, 10.0, True, "10"])
def test_warmup_num_steps_must_be_a_positive_integer(schedule, steps):
    with pytest.raises(zoe.InvalidArgument, match="warmup_num_steps = .* allowed: a positive"):
        schedule(steps)


def test_a_fractional_total_is_used_as_given():
    schedule = WarmupDecayLR(optimizer(), 10.5, 0.0, HIGH, warmup_num_steps=2)
    assert rate_at(schedule, 7) == pytest.approx(HIGH * 3.5 / 8.5)


def test_one_warmup_step_counts_as_two_and_state_round_trips():
    schedule = WarmupLR(optimizer(), LOW, HIGH, warmup_num_steps=1)
    assert schedule.warmup_num_steps == 2
    schedule.step()
    schedule.step()
    other = WarmupLR(optimizer(), LOW, HIGH, warmup_num_steps=1)
    other.load_state_dict(schedule.state_dict())
    assert other.last_batch_iteration == 1


def test_engine_steps_the_config_schedule_after_each_optimizer_step():
    config = ds_config()
    config["scheduler"] = {"type": "WarmupDecayLR", "params": {
        "total_num_steps": TOTAL, "warmup_min_lr": LOW, "warmup_max_lr": HIGH,
        "warmup_num_steps": WARM, "warmup_type": "linear"}}
    engine, _, _, scheduler = zoe.torch.initialize(model=make_model(), config=config)
    assert isinstance(scheduler, WarmupDecayLR)
    train_engine(engine, 0, 3, 0, 1)  # 3 optimizer steps, 6 micro-batches
    assert scheduler.last_batch_iteration == 2
    assert engine.get_lr() == pytest.approx([LOW + (HIGH - LOW) * 2 / WARM])
    engine.close()


def test_scheduler_parameters_are_checked():
    config = ds_config()
    config["scheduler"] = {"type": "WarmupDecayLR", "params": {"warmup_max_lr": HIGH}}
    with pytest.raises(zoe.InvalidArgument, match="total_num_steps"):
        zoe.torch.initialize(model=make_model(), config=config)
    config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_type": "cubic"}}
    with pytest.raises(zoe.InvalidArgument, match="allowed: 'log', 'linear'"):
        zoe.torch.initialize(model=make_model(), config=config)
    config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}
    with pytest.raises(zoe.InvalidArgument, match="warmup_num_steps = 0 is not allowed"):
        zoe.torch.initialize(model=make_model(), config=config)
    config["scheduler"] = {"type": "ReduceLROnPlateau", "params": {}}
    with pytest.raises(zoe.InvalidArgument, match="torch.optim.lr_scheduler"):
        zoe.torch.initialize(model=make_model(), config=config)
    config["scheduler"] = {"type": "StepLR", "params": {"gamma": 0.5}}
    with pytest.raises(zoe.InvalidArgument, match="scheduler StepLR: .*step_size.*torch.optim"):
        zoe.torch.initialize(model=make_model(), config=config)
    config["scheduler"] = {"type": "LinearLR", "params": {"start_factor": 2.0}}
    with pytest.raises(zoe.InvalidArgument, match="scheduler LinearLR: Starting multiplicative"):
        zoe.torch.initialize(model=make_model(), config=config)
    config["scheduler"] = {"type": "StepLR", "params": {"step_size": "auto"}}
    with pytest.raises(zoe.InvalidArgument, match='step_size = "auto" is not allowed for '
                                                  "'StepLR'"):
        zoe.torch.initialize(model=make_model(), config=config)


def test_a_torch_schedule_named_in_the_config_is_stepped_after_each_optimizer_step():
    """As DeepSpeed builds one: getattr(torch.optim.lr_scheduler, type)(optimizer, **params)."""
    config = ds_config()
    config["scheduler"] = {"type": "StepLR", "params": {"step_size": 2, "gamma": 0.5}}
    engine, optimizer, _, scheduler = zoe.torch.initialize(model=make_model(), config=config)
    assert isinstance(scheduler, torch.optim.lr_scheduler.StepLR)
    lr = config["optimizer"]["params"]["lr"]
    train_engine(engine, 0, 3, 0, 1)  # 3 optimizer steps
    assert engine.get_lr() == pytest.approx([lr * 0.5])
    assert optimizer.param_groups[0]["lr"] == pytest.approx(lr * 0.5)
    train_engine(engine, 3, 4, 0, 1)
    assert engine.get_lr() == pytest.approx([lr * 0.25])
    engine.close()


@pytest.mark.parametrize("schedule", [
    {"type": "OneCycleLR", "params": {"max_lr": 0.02, "total_steps": 8, "cycle_momentum": False}},
    {"type": "CyclicLR", "params": {"base_lr": 0.001, "max_lr": 0.02, "step_size_up": 2,
                                    "cycle_momentum": False}}])
def test_a_torch_schedule_resumes_from_a_checkpoint_as_if_uninterrupted(schedule, tmp_path):
    """torch 1.13 keeps OneCycleLR's and CyclicLR's functions in their state dicts; the save
    leaves them out and the loading engine's schedule keeps its own."""
    config = dict(ds_config(), scheduler=schedule)
    engine, _, _, _ = zoe.torch.initialize(model=make_model(), config=config)
    train_engine(engine, 0, 2, 0, 1)
    engine.save_checkpoint(str(tmp_path))
    train_engine(engine, 2, 4, 0, 1)
    uninterrupted = (engine.get_lr(), module_values(engine))
    engine.close()
    engine, _, _, _ = zoe.torch.initialize(model=make_model(seed=1), config=config)
    engine.load_checkpoint(str(tmp_path))
    train_engine(engine, 2, 4, 0, 1)
    assert engine.get_lr() == uninterrupted[0]
    assert_same_state(module_values(engine), uninterrupted[1], atol=0)
    engine.close()
