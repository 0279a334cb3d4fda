"""zoe.torch.Adagrad and zoe.torch.Lion: against torch.optim.Adagrad and a plain-torch Lion
(lion_reference.py) over 30 steps with the state in DRAM and on NVMe, weight decay, Adagrad's
lr_decay and an LR schedule; state dicts in torch's names, loaded both ways; streaming
checkpoints that resume bit for bit; what zoe fixes or does not do is refused. Tolerances as in
test_optim.py. ZeRO stages 1 and 2 with these kinds are in test_torch_zero.py, initialize from a
DeepSpeed config in test_initialize*.py."""

import pytest
import torch

import zoe
import zoe.torch
from conftest import small_config
from lion_reference import ReferenceLion
from test_optim import assert_params_close, make_model, schedule, train_step

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


def test_a_state_dict_of_another_kind_is_refused_naming_what_it_holds():
    """An AdamW state dict holds Lion's 'exp_avg' too: it is refused for its 'exp_avg_sq', not
    taken as Lion's momentum; one without a moment the kind keeps is refused for the lack."""
    model = make_model()
    adamw = torch.optim.AdamW(model.parameters())
    train_step(model, adamw, 0)
    lion, adagrad = zoe.torch.Lion(model.parameters()), zoe.torch.Adagrad(model.parameters())
    with pytest.raises(zoe.InvalidArgument, match="holds 'exp_avg_sq', which zoe.torch.Lion "
                                                  "does not keep"):
        lion.load_state_dict(adamw.state_dict())
    with pytest.raises(ValueError, match="lacks 'sum'; a zoe.torch.Adagrad state holds step, "
                                         "sum"):
        adagrad.load_state_dict(adamw.state_dict())
    lion.close()
    adagrad.close()


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
