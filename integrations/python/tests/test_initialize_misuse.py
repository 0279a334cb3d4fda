"""An engine used as a new user uses it by mistake, each refused with what to do and nothing lost:
calls after close() (at stage 3 they used to train on silently, stepping nothing); a NaN loss
without fp16, whose skipped step is now reported (was_step_applied, skipped_steps, a warning)
instead of passing for a step taken; a client_state that torch.save cannot pickle, refused
before anything is written; a model with nothing to train; a parameter that is not contiguous,
refused at initialize naming it instead of at the first step; two parameters over one memory
(which zoe's master copies would update apart) and one parameter listed twice; a parameter added
after a stage 3 initialize, named at save instead of a KeyError; a stage 3 parameter read
outside its module's forward (acquired for the forward that reads it); and a
checkpoint of other shapes, whose message no longer suggests load_module_strict=False."""

import logging
import os
import re
import threading

import pytest
import torch

import zoe
import zoe.torch
from initialize_script import ds_config, make_model, module_values, train_engine


def start(stage, model=None):
    config = ds_config(stage, "cpu" if stage else "none", None, 1, "cpu" if stage == 3 else None)
    engine, _, _, _ = zoe.torch.initialize(model=make_model() if model is None else model,
                                           config=config)
    return engine


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_calls_after_close_are_refused(stage, tmp_path):
    engine = start(stage)
    train_engine(engine, 0, 1, 0, 1)
    engine.save_checkpoint(str(tmp_path))
    engine.close()
    calls = {"forward": lambda: engine(torch.ones(4, 8)),
             "backward": lambda: engine.backward(engine.module(torch.ones(4, 8)).sum()),
             "step()": engine.step,
             "save_checkpoint": lambda: engine.save_checkpoint(str(tmp_path / "again")),
             "load_checkpoint": lambda: engine.load_checkpoint(str(tmp_path))}
    for name, call in calls.items():
        with pytest.raises(zoe.FailedPrecondition, match=re.escape(name) + " after the engine "
                                                         "was closed.*zoe.torch.initialize"):
            call()
    assert engine.global_steps == 1
    assert not os.path.exists(tmp_path / "again")
    engine.close()  # idempotent


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_a_nan_loss_without_fp16_is_a_skipped_step(stage, caplog):
    engine = start(stage)
    train_engine(engine, 0, 2, 0, 1)
    before, lr = module_values(engine), engine.get_lr()
    with caplog.at_level(logging.WARNING, logger="zoe.torch"):
        for _ in range(2):  # one accumulation
            engine.backward(engine(torch.ones(4, 8)).sum() * float("nan"))
            engine.step()
    assert not engine.was_step_applied()
    assert engine.skipped_steps == 1 and engine.global_steps == 3
    assert engine.get_lr() == lr  # the schedule steps with the optimizer, as DeepSpeed's
    assert all(torch.equal(module_values(engine)[key], value) for key, value in before.items())
    assert "the gradients hold inf or NaN; the optimizer skipped the step" in caplog.text
    train_engine(engine, 3, 4, 0, 1)
    assert engine.was_step_applied() and engine.skipped_steps == 1
    engine.close()


@pytest.mark.parametrize("client_state,match", [
    ({"lock": threading.Lock()}, r"client_state\['lock'\] cannot be saved \(TypeError: cannot "
                                 r"pickle '_thread.lock' object\)"),
    ({"f": lambda: 0}, r"client_state\['f'\] cannot be saved"),
    ([("a", 1)], "client_state is a list; save_checkpoint takes a dict"),
])
def test_a_client_state_that_cannot_be_saved_is_refused_before_anything_is_written(
        client_state, match, tmp_path):
    engine = start(2)
    train_engine(engine, 0, 1, 0, 1)
    with pytest.raises(zoe.InvalidArgument, match=match):
        engine.save_checkpoint(str(tmp_path / "ckpt"), client_state=client_state)
    assert not os.path.exists(tmp_path / "ckpt")
    engine.save_checkpoint(str(tmp_path / "ckpt"), client_state={"epoch": 3})
    assert engine.load_checkpoint(str(tmp_path / "ckpt"))[1] == {"epoch": 3}
    engine.close()


def test_a_model_with_nothing_to_train_is_refused():
    with pytest.raises(zoe.InvalidArgument, match="nothing to train: the model holds no "
                                                  "parameter that requires a gradient \\(it has "
                                                  "no parameters\\)"):
        start(1, torch.nn.Tanh())
    frozen = make_model().requires_grad_(False)
    with pytest.raises(zoe.InvalidArgument, match="its 4 parameters are all frozen"):
        start(2, frozen)


@pytest.mark.parametrize("stage", [0, 2])
def test_a_parameter_that_is_not_contiguous_is_refused_at_initialize(stage):
    model = make_model()
    with torch.no_grad():
        model[2].weight = torch.nn.Parameter(model[2].weight.detach().t().contiguous().t())
    with pytest.raises(zoe.InvalidArgument, match="parameter '2.weight' is not contiguous .*"
                                                  "param.data = param.data.contiguous\\(\\)"):
        start(stage, model)


def test_a_checkpoint_of_other_shapes_names_no_switch_that_would_not_load_it(tmp_path):
    engine = start(1)
    engine.save_checkpoint(str(tmp_path))
    engine.close()
    wider = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    engine = start(1, wider)
    with pytest.raises(RuntimeError, match="(?s)size mismatch for 0.weight.*\\n\\(the "
                                           "checkpoint holds a model of other shapes") as error:
        engine.load_checkpoint(str(tmp_path), load_module_strict=False)
    assert "load_module_strict=False" not in str(error.value)
    engine.close()


class TiedOutside(torch.nn.Module):
    """An output projection by the embedding's weight, read in the parent's forward, not by a
    call of the embedding (a tied head written by hand)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Linear(4, 8, bias=False)
        self.mix = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.mix(x) @ self.emb.weight.t()


def test_a_stage3_parameter_read_outside_its_modules_forward_is_gathered_for_that_forward():
    """Stage 3 pages the embedding's weight for the forward of its own module; read in the
    parent's forward it is acquired for that forward (it read its NaN placeholder before), so
    training equals torch's. Outside every forward a read still gets the placeholder (NaN)."""
    config = ds_config(3, "cpu", None, 1, "cpu")
    del config["scheduler"]
    config["gradient_clipping"] = 0.0
    engine, _, _, _ = zoe.torch.initialize(model=TiedOutside(), config=config)
    plain = TiedOutside()
    reference = torch.optim.AdamW(plain.parameters(), lr=0.01, weight_decay=0.01)
    for step in range(3):
        for micro in range(2):
            x = torch.randn(4, 4, generator=torch.Generator().manual_seed(10 * step + micro))
            out, expected = engine(x), plain(x)
            assert torch.equal(out, expected), (step, micro)
            engine.backward(out.square().mean())
            engine.step()
            (expected.square().mean() / 2).backward()
        reference.step()
        reference.zero_grad()
    found = engine.module_state_dict()
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(found[key], value, rtol=0, atol=1e-6, msg=key)
    assert torch.isnan(engine.module.emb.weight).all()  # outside a forward: the placeholder
    engine.close()


def test_a_parameter_added_after_a_stage3_initialize_is_named_at_save(tmp_path):
    engine = start(3)
    train_engine(engine, 0, 1, 0, 1)
    engine.module.extra = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(zoe.InvalidArgument, match=r"a tensor of shape \(3,\) is not paged: a "
                                                  "parameter added to the model after it was "
                                                  "paged"):
        engine.save_checkpoint(str(tmp_path / "ckpt"))
    assert not os.path.exists(tmp_path / "ckpt" / "latest")
    del engine.module.extra
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    engine.close()


class TwoViews(torch.nn.Module):
    """Two parameters over one memory: halves of one tensor, each a Parameter of its own."""

    def __init__(self):
        super().__init__()
        whole = torch.randn(2, 4, 8)
        self.first = torch.nn.Parameter(whole[0])
        self.second = torch.nn.Parameter(whole[0, 2:])

    def forward(self, x):
        return x @ self.first.t() + (x[:, :4] * self.second[0, :4]).sum(1, keepdim=True)


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_parameters_sharing_memory_are_refused_at_initialize(stage):
    with pytest.raises(zoe.InvalidArgument, match="parameter 'first' and parameter 'second' "
                                                  "share memory .* tie them as one "
                                                  "nn.Parameter"):
        start(stage, TwoViews())


def test_parameters_sharing_memory_are_refused_by_the_optimizer():
    model = TwoViews()
    with pytest.raises(zoe.InvalidArgument, match="parameter 0 of param group 0 and parameter "
                                                  "1 of param group 0 share memory"):
        zoe.torch.AdamW(model.parameters(), lr=0.1)
    optimizer = zoe.torch.AdamW([model.first], lr=0.1)
    with pytest.raises(zoe.InvalidArgument, match="parameter 0 of param group 0 and parameter "
                                                  "0 of param group 1 share memory"):
        optimizer.add_param_group({"params": [model.second]})
    assert len(optimizer.param_groups) == 1
    optimizer.close()
    with pytest.raises(zoe.InvalidArgument, match="parameter 0 of param group 0 and parameter "
                                                  "1 of param group 0 are one parameter"):
        zoe.torch.AdamW([model.first, model.first], lr=0.1)  # torch warns, and steps it twice
    tied = torch.nn.Linear(8, 8)
    apart = torch.nn.Parameter(tied.weight.detach().clone())
    optimizer = zoe.torch.AdamW([tied.weight, tied.bias, apart], lr=0.1)  # own memory each
    optimizer.close()


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_gradients_of_parameters_outside_the_optimizer_are_named_once(stage, caplog):
    model = make_model()
    model[0].weight.requires_grad_(False)  # left out of the optimizer (as DeepSpeed leaves it)
    engine = start(stage, model)
    model[0].weight.requires_grad_(True)  # unfrozen after initialize: not trained
    model.extra = torch.nn.Linear(4, 4)  # added after initialize: not trained
    before = engine.module_state_dict()["0.weight"].clone()
    with caplog.at_level(logging.WARNING, logger="zoe.torch"):
        for step in range(2):
            for micro in range(2):
                x = torch.randn(4, 8)
                engine.backward(model.extra(engine(x)).square().mean())
                engine.step()
    warnings = [record.getMessage() for record in caplog.records
                if "in no param group of the optimizer" in record.getMessage()]
    assert warnings == ["the module's parameters '0.weight', 'extra.weight', 'extra.bias' have "
                        "gradients but are in no param group of the optimizer (frozen when "
                        "initialize built it, or added to the model after): they are not "
                        "trained, as under DeepSpeed; to train them, have them require "
                        "gradients before initialize"]
    assert torch.equal(engine.module_state_dict()["0.weight"], before)
    assert engine.global_steps == 2
    engine.close()


def test_an_nvme_path_a_file_stands_in_is_refused_naming_the_key(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("kept")
    for path in (a_file, a_file / "below"):
        config = ds_config(2, "nvme", str(path), 1)
        with pytest.raises(zoe.InvalidArgument, match="zero_optimization.offload_optimizer."
                                                      f"nvme_path '{path}' is not a directory: "
                                                      "a file stands in the way"):
            zoe.torch.initialize(model=make_model(), config=config)
    assert a_file.read_text() == "kept"
