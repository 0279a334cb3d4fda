"""zoe.torch.Adagrad and zoe.torch.Lion: against torch.optim.Adagrad and a plain-torch Lion
(lion_reference.py) over 30 steps with the state in DRAM and on NVMe, weight decay, Adagrad's
lr_decay and an LR schedule; state dicts in torch's names, loaded both ways; streaming
checkpoints that resume bit for bit; what zoe fixes or does not do is refused. Tolerances as in
test_optim.py. ZeRO stages 1 and 2 with these kinds are in test_torch_zero.py, initialize from a
DeepSpeed config in test_initialize*.py."""

import json
import os

import pytest
import torch

import zoe
import zoe.torch
from conftest import small_config
from lion_reference import ReferenceLion
from test_optim import assert_params_close, batch, make_model, schedule, train_step
from zoe.torch import checkpoint
from zoe.torch.device import HostTwin

STEPS = 30

# (zoe class, reference class, hyper-parameters both take)
KINDS = {
    "Adagrad": (zoe.torch.Adagrad, torch.optim.Adagrad,
                dict(lr=0.05, lr_decay=0.01, weight_decay=0.1, eps=1e-10)),
    "Lion": (zoe.torch.Lion, ReferenceLion,
             dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)),
}
MOMENTS = {"Adagrad": ["sum"], "Lion": ["exp_avg"]}


@pytest.fixture(params=["cpu", "nvme"])
def engine(request, nvme_dir):
    with zoe.Engine(small_config(nvme_dir, offload=request.param)) as e:
        yield e


def assert_states_close(found, expected, moments):
    assert sorted(found) == sorted(expected)
    for index, entry in expected.items():
        assert sorted(found[index]) == sorted(["step"] + moments), found[index].keys()
        assert float(found[index]["step"]) == float(entry["step"])
        for key in moments:
            torch.testing.assert_close(found[index][key], entry[key], rtol=1e-5, atol=1e-7,
                                       msg=f"parameter {index} {key}")


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_matches_the_reference_over_30_steps(kind, engine):
    zoe_class, reference_class, hyper = KINDS[kind]
    reference, model = make_model(), make_model()
    torch_opt = reference_class(reference.parameters(), **hyper)
    zoe_opt = zoe_class(model.parameters(), engine=engine, **hyper)
    torch_sched, zoe_sched = schedule(torch_opt), schedule(zoe_opt)
    for step in range(STEPS):
        train_step(reference, torch_opt, step)
        train_step(model, zoe_opt, step)
        torch_sched.step()
        zoe_sched.step()
        assert_params_close(model, reference, rtol=1e-5, atol=1e-6)
    assert zoe_opt.last_step[0].steps_taken == STEPS
    assert_states_close(zoe_opt.state_dict()["state"], torch_opt.state_dict()["state"],
                        MOMENTS[kind])
    zoe_opt.close()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_state_dict_of_the_reference_loads_and_continues_alike(kind, engine):
    """Ten steps of the reference, its state dict into a fresh zoe optimizer, ten more steps of
    both: the same parameters (and zoe's state dict loads back into the reference)."""
    zoe_class, reference_class, hyper = KINDS[kind]
    reference, model = make_model(), make_model()
    torch_opt = reference_class(reference.parameters(), **hyper)
    for step in range(10):
        train_step(reference, torch_opt, step)
    model.load_state_dict(reference.state_dict())
    zoe_opt = zoe_class(model.parameters(), engine=engine, **hyper)
    zoe_opt.load_state_dict(torch_opt.state_dict())
    for step in range(10, 20):
        train_step(reference, torch_opt, step)
        train_step(model, zoe_opt, step)
    assert_params_close(model, reference, rtol=1e-5, atol=1e-6)
    back = reference_class(make_model().parameters(), **hyper)
    back.load_state_dict(zoe_opt.state_dict())
    assert_states_close(back.state_dict()["state"], zoe_opt.state_dict()["state"], MOMENTS[kind])
    zoe_opt.close()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_checkpoint_resume_equals_uninterrupted(kind, nvme_dir):
    zoe_class, _, hyper = KINDS[kind]
    config = small_config(nvme_dir, offload="nvme")
    model = make_model()
    with zoe.Engine(config) as engine:
        optimizer = zoe_class(model.parameters(), engine=engine, **hyper)
        for step in range(6):
            train_step(model, optimizer, step)
        optimizer.save_checkpoint(nvme_dir + "/ckpt")
        for step in range(6, 12):
            train_step(model, optimizer, step)
    resumed = make_model(seed=123)
    with zoe.Engine(config) as engine:
        optimizer = zoe_class(resumed.parameters(), engine=engine, **dict(hyper, lr=1.0))
        optimizer.load_checkpoint(nvme_dir + "/ckpt")
        assert optimizer.param_groups[0]["lr"] == hyper["lr"]
        for step in range(6, 12):
            train_step(resumed, optimizer, step)
        assert_params_close(resumed, model, rtol=0, atol=0)


def stepped_state_dict(kind, params, groups_of=None):
    """The state dict of one step of zoe.torch ``kind`` over copies of ``params``, its param
    groups replaced by those of ``groups_of`` (another optimizer's state dict) when given."""
    model = make_model()
    optimizer = getattr(zoe.torch, kind)(model.parameters())
    train_step(model, optimizer, 0)
    state = optimizer.state_dict()
    optimizer.close()
    if groups_of is not None:
        state["param_groups"] = groups_of["param_groups"]
    return state


def test_a_state_dict_of_another_kind_is_refused_naming_what_it_holds():
    """Another kind's param groups are refused for a setting this kind does not take, its
    per-parameter state for a moment it does not keep or lacks: never read as this kind's."""
    model = make_model()
    lion, adagrad = zoe.torch.Lion(model.parameters()), zoe.torch.Adagrad(model.parameters())
    adamw = torch.optim.AdamW(model.parameters())  # unstepped: param groups only
    cases = [
        (lion, adamw.state_dict(), "param group 0 of the loaded state dict sets 'eps', which "
                                   "zoe.torch.Lion does not take"),
        (adagrad, lion.state_dict(), "sets 'betas', which zoe.torch.Adagrad does not take"),
        (lion, stepped_state_dict("AdamW", model, lion.state_dict()),
         "holds 'exp_avg_sq', which zoe.torch.Lion does not keep"),
        (adagrad, stepped_state_dict("Lion", model, adagrad.state_dict()),
         "lacks 'sum'; a zoe.torch.Adagrad state holds step, sum"),
    ]
    for optimizer, state_dict, message in cases:
        with pytest.raises((zoe.InvalidArgument, ValueError), match=message):
            optimizer.load_state_dict(state_dict)
    for optimizer in (lion, adagrad):  # nothing changed: both step from their own state
        train_step(model, optimizer, 1)
        assert optimizer.last_step[0].steps_taken == 1
    lion.close()
    adagrad.close()


def test_adagrad_state_dict_steps_torch_adagrad_alike_stepped_or_not(engine):
    """torch's Adagrad keeps state for every parameter from construction: zoe's state dict gives
    a never-stepped parameter (and an optimizer never stepped) step 0 and a zero sum, so torch's
    Adagrad loads it and steps on as zoe does."""
    _, _, hyper = KINDS["Adagrad"]
    for steps in (0, 3):
        model = make_model()
        optimizer = zoe.torch.Adagrad(model.parameters(), engine=engine, name=f"a{steps}",
                                      **hyper)
        for step in range(steps):
            train_step(model, optimizer, step)
        reference = make_model()
        reference.load_state_dict(model.state_dict())
        torch_opt = torch.optim.Adagrad(reference.parameters(), **hyper)
        torch_opt.load_state_dict(optimizer.state_dict())
        assert len(optimizer.state_dict()["state"]) == len(list(model.parameters()))
        for step in range(steps, steps + 3):
            train_step(model, optimizer, step)
            train_step(reference, torch_opt, step)
        assert_params_close(model, reference, rtol=1e-5, atol=1e-6)
        optimizer.close()


def save_one_step(model, optimizer, directory):
    """One step of ``optimizer``, its checkpoint saved to ``directory``; closes it."""
    train_step(model, optimizer, 0)
    optimizer.save_checkpoint(directory)
    optimizer.close()


def test_a_checkpoint_loads_only_into_its_kind_with_its_fixed_values(nvme_dir):
    """A checkpoint of another kind, or of an Adagrad whose lr_decay differs from the one zoe
    fixed in this optimizer's state, is refused naming the fix, and the optimizer steps on."""
    model = make_model()
    directory = nvme_dir + "/ckpt"
    save_one_step(model, zoe.torch.Lion(model.parameters(), offload="nvme", nvme_path=nvme_dir),
                  directory)
    adamw = zoe.torch.AdamW(model.parameters())
    with pytest.raises(zoe.InvalidArgument, match="is of zoe.torch.Lion; this optimizer is "
                                                  "zoe.torch.AdamW"):
        adamw.load_checkpoint(directory)
    adamw.close()
    save_one_step(model, zoe.torch.Adagrad(model.parameters(), lr_decay=0.01), directory)
    plain = zoe.torch.Adagrad(model.parameters())
    with pytest.raises(zoe.InvalidArgument, match="has lr_decay = 0.01.*construct the optimizer "
                                                  "with lr_decay=0.01"):
        plain.load_checkpoint(directory)
    train_step(model, plain, 1)  # unchanged: steps as constructed
    assert plain.last_step[0].steps_taken == 1
    with pytest.raises(zoe.InvalidArgument, match="has lr_decay = 0.5.*this optimizer's is 0.0"):
        plain.load_state_dict(dict(plain.state_dict(), param_groups=[
            dict(plain.state_dict()["param_groups"][0], lr_decay=0.5)]))
    plain.close()
    matching = zoe.torch.Adagrad(model.parameters(), lr_decay=0.01)
    matching.load_checkpoint(directory)
    train_step(model, matching, 1)
    assert matching.last_step[0].steps_taken == 2
    matching.close()
    # a checkpoint written before the kind was kept beside it loads as before
    groups_file = os.path.join(directory, checkpoint.PARAM_GROUPS)
    with open(groups_file) as file:
        saved = json.load(file)
    del saved["optimizer"]
    with open(groups_file, "w") as file:
        json.dump(saved, file)
    older = zoe.torch.Adagrad(model.parameters(), lr_decay=0.01)
    older.load_checkpoint(directory)
    assert older.state_dict()["state"][0]["step"] == 1
    older.close()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_on_the_device_twin_matches_the_reference(kind, engine):
    """The device path (gradients copied as backward makes them final, parameters copied back)
    on the adversarial CPU twin steps these kinds as the CPU path does."""
    zoe_class, reference_class, hyper = KINDS[kind]
    reference, model = make_model(), make_model()
    torch_opt = reference_class(reference.parameters(), **hyper)
    zoe_opt = zoe_class(model.parameters(), engine=engine, **hyper,
                        device_backend=HostTwin(adversarial=True))
    for step in range(10):
        train_step(reference, torch_opt, step)
        zoe_opt.zero_grad(set_to_none=True)
        x, y = batch(step)
        with zoe_opt.overlap():
            torch.nn.functional.mse_loss(model(x), y).backward()
        zoe_opt.step()
    assert_params_close(model, reference, rtol=1e-5, atol=1e-6)
    assert zoe_opt._groups[0].device.stats["handed_in_backward"] > 0
    zoe_opt.close()


def test_what_zoe_does_not_do_is_refused_naming_it():
    model = make_model()
    with pytest.raises(zoe.InvalidArgument, match="initial_accumulator_value = 0.1.*leave it 0"):
        zoe.torch.Adagrad(model.parameters(), initial_accumulator_value=0.1)
    with pytest.raises(ValueError, match="Invalid lr_decay value: -1"):
        zoe.torch.Adagrad(model.parameters(), lr_decay=-1)
    with pytest.raises(ValueError, match="Invalid beta parameter at index 1: 1.0"):
        zoe.torch.Lion(model.parameters(), betas=(0.9, 1.0))
    with pytest.raises(TypeError):
        zoe.torch.Lion(model.parameters(), eps=1e-8)  # Lion has no epsilon
    with pytest.raises(zoe.InvalidArgument, match="differentiable = True; zoe optimizers "
                                                  "support none of"):
        zoe.torch.Adagrad(model.parameters(), differentiable=True)
    # torch 2.x's implementation switches are taken and ignored
    zoe.torch.AdamW(model.parameters(), fused=True, foreach=False, differentiable=False).close()
    loaded = zoe.torch.Adagrad(model.parameters())
    with pytest.raises(zoe.InvalidArgument, match="initial_accumulator_value = 0.5"):
        loaded.load_state_dict(torch.optim.Adagrad(model.parameters(),
                                                   initial_accumulator_value=0.5).state_dict())
    loaded.close()
    optimizer = zoe.torch.Adagrad(model.parameters(), lr_decay=0.01)
    train_step(model, optimizer, 0)
    optimizer.param_groups[0]["lr_decay"] = 0.5
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(zoe.InvalidArgument, match="changed lr_decay from 0.01 to 0.5 after zoe "
                                                  "created its state"):
        train_step(model, optimizer, 1)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    optimizer.param_groups[0]["lr_decay"] = 0.01
    train_step(model, optimizer, 1)  # back as created: it steps
    assert optimizer.last_step[0].steps_taken == 2
    optimizer.close()
