"""ZeRO stage 3 with param groups through zoe.torch.initialize: two groups (weights decayed,
biases not and at half the learning rate) with offload_param cpu and nvme, in one process and on
2 gloo ranks, gradient accumulation 2, clipping 1.0 by the norm of both groups, WarmupLR over
both, a save and a load into a fresh engine half-way, end with the parameters of the plain
torch loop (torch.optim.AdamW over the same groups); the stage 3 checkpoint consolidates into
torch's layout with both groups; a checkpoint's groups must be the loading optimizer's; groups
that miss or repeat a trainable parameter are refused naming the fix. The same script with a
fresh torch.optim.AdamW over the groups and a WarmupLR over it, given to initialize in place of
the config's sections (Hugging Face's Trainer's way), ends with the same parameters: zoe steps
the shards in the torch optimizer's own param group dicts."""

import copy
import os

import pytest
import torch

import zoe
import zoe.torch
from conftest import gloo_rank, spawn_ranks
from initialize_script import (LR, STEPS, WEIGHT_DECAY, assert_same_state, ds_config,
                               make_model, torch_steps, train_engine)
from zoe.torch.common import _invalid
from zoe.torch.lr_schedules import WarmupLR

JOIN_SECONDS = 120
WORLD = 2
OFFLOADS = ("cpu", "nvme")
BIAS_LR = LR / 2
MAX_LRS = [LR, BIAS_LR]  # WarmupLR's warmup_max_lr, per group


def param_groups(model):
    """As DeepSpeedExamples groups them: weights decayed, biases not (and a rate of their own)."""
    return [{"params": [p for p in model.parameters() if p.dim() > 1],
             "weight_decay": WEIGHT_DECAY},
            {"params": [p for p in model.parameters() if p.dim() <= 1], "weight_decay": 0.0,
             "lr": BIAS_LR}]


def grouped_config(offload, nvme_path, world):
    config = ds_config(3, offload, nvme_path, world, offload)
    config["scheduler"]["params"]["warmup_max_lr"] = list(MAX_LRS)
    return config


def torch_adamw(model):
    """The torch loop's optimizer and schedule over param_groups, the config's settings as
    their defaults."""
    optimizer = torch.optim.AdamW(param_groups(model), lr=LR, betas=(0.9, 0.999), eps=1e-8,
                                  weight_decay=WEIGHT_DECAY)
    return optimizer, WarmupLR(optimizer, warmup_min_lr=0.0, warmup_max_lr=list(MAX_LRS),
                               warmup_num_steps=4)


def grouped_engine(model, config, torch_optimizer):
    """(engine, optimizer) of initialize over param_groups: model_parameters= with the config's
    optimizer and schedule, or a torch AdamW and a WarmupLR over it given in their place."""
    if not torch_optimizer:
        engine, optimizer, _, _ = zoe.torch.initialize(model=model,
                                                       model_parameters=param_groups(model),
                                                       config=config)
        return engine, optimizer
    config = {key: value for key, value in config.items()
              if key not in ("optimizer", "scheduler")}
    given, schedule = torch_adamw(model)
    engine, optimizer, _, scheduler = zoe.torch.initialize(
        model=model, optimizer=given, lr_scheduler=schedule, config=config)
    assert isinstance(optimizer, zoe.torch.AdamW) and scheduler is schedule
    assert all(a is b for a, b in zip(optimizer.param_groups, given.param_groups))
    return engine, optimizer


def run_grouped(config, checkpoint_dir, rank, world, torch_optimizer=False):
    """The DeepSpeed-style script over param groups: half the steps, save, a fresh engine over
    the same groups loads and finishes; the final module_state_dict."""
    engine, optimizer = grouped_engine(make_model(), config, torch_optimizer)
    assert [group["weight_decay"] for group in optimizer.param_groups] == [WEIGHT_DECAY, 0.0]
    train_engine(engine, 0, STEPS // 2, rank, world)
    engine.save_checkpoint(checkpoint_dir)
    engine.close()
    engine, optimizer = grouped_engine(make_model(seed=1), config, torch_optimizer)
    engine.load_checkpoint(checkpoint_dir)
    train_engine(engine, STEPS // 2, STEPS, rank, world)
    assert [group["lr"] for group in optimizer.param_groups] == MAX_LRS
    state = {key: value.clone() for key, value in engine.module_state_dict().items()}
    engine.close()
    return state


def grouped_reference(world, steps=STEPS):
    """(model, optimizer) of the plain torch loop: AdamW over param_groups with the config's
    settings as defaults, clip_grad_norm_ over every parameter, the same WarmupLR."""
    model = make_model()
    optimizer, schedule = torch_adamw(model)
    torch_steps(model, optimizer, schedule, 0, steps, world)
    return model, optimizer


def run_refused_load(rank, out_dir, world):
    """A checkpoint of two groups loaded by an engine of one group: refused on every rank."""
    engine, _, _, _ = zoe.torch.initialize(model=make_model(),
                                           config=ds_config(3, "cpu", None, world, "cpu"))
    try:
        engine.load_checkpoint(os.path.join(out_dir, "ckpt-cpu"))
    except zoe.InvalidArgument as error:
        message = str(error)
    else:
        message = None
    engine.close()
    with open(os.path.join(out_dir, f"refused-rank{rank}.txt"), "w", encoding="utf-8") as file:
        file.write(repr(message))


def run_refused_full_state(rank, out_dir, world):
    """The 2-group save consolidated into one state dict of full parameters, given to a stage 3
    optimizer over ``world`` ranks (whose parameters are this rank's shards): refused, naming
    where such a state dict loads."""
    saved = os.path.join(out_dir, "ckpt-cpu", f"global_step{STEPS // 2}", "optimizer")
    consolidated = zoe.torch.consolidated_state_dict(saved)["optimizer"]
    model = make_model()
    engine, optimizer, _, _ = zoe.torch.initialize(
        model=model, model_parameters=param_groups(model),
        config=grouped_config("cpu", None, world))
    try:
        optimizer.load_state_dict(consolidated)
    except ValueError as error:
        message = str(error)
    else:
        message = None
    engine.close()
    with open(os.path.join(out_dir, f"full-state-rank{rank}.txt"), "w",
              encoding="utf-8") as file:
        file.write(repr(message))


def run_refused_empty_group(rank, out_dir, world):
    """A group whose only parameter (one element) leaves rank 0 no shard: refused on every
    rank before anything is built."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1))
    groups = [{"params": [p for p in model.parameters() if p is not model[1].bias]},
              {"params": [model[1].bias], "weight_decay": 0.0}]
    try:
        zoe.torch.initialize(model=model, model_parameters=groups,
                             config=ds_config(3, "cpu", None, world, "cpu"))
        message = None
    except zoe.InvalidArgument as error:
        message = str(error)
    with open(os.path.join(out_dir, f"empty-rank{rank}.txt"), "w", encoding="utf-8") as file:
        file.write(repr(message))


def run_empty_group(rank, out_dir, world):
    """A torch AdamW with an empty second group (Hugging Face's Trainer's no-decay group when
    nothing is excluded from weight decay): taken on every rank, the step as without it; once
    the engine is closed the torch optimizer holds the module's parameters again."""
    config = ds_config(3, "cpu", None, world, "cpu")
    del config["optimizer"], config["scheduler"]
    model = make_model()
    given = torch.optim.AdamW([{"params": list(model.parameters())}, {"params": []}], lr=LR)
    engine, optimizer, _, _ = zoe.torch.initialize(model=model, optimizer=given, config=config)
    train_engine(engine, 0, 1, rank, world)
    held = [len(group["params"]) for group in optimizer.param_groups]
    engine.close()
    back = [param for group in given.param_groups for param in group["params"]]
    module = list(model.parameters())
    with open(os.path.join(out_dir, f"empty-torch-rank{rank}.txt"), "w",
              encoding="utf-8") as file:
        file.write(repr((held, len(back) == len(module)
                         and all(a is b for a, b in zip(back, module)))))


def worker(rank, out_dir, world):
    with gloo_rank(rank, world, f"{out_dir}/init", out_dir):
        for offload in OFFLOADS:
            config = grouped_config(offload, os.path.join(out_dir, f"swap-{offload}"), world)
            state = run_grouped(config, os.path.join(out_dir, f"ckpt-{offload}"), rank, world)
            torch.save(state, os.path.join(out_dir, f"{offload}-rank{rank}.pt"))
        config = grouped_config("cpu", None, world)
        state = run_grouped(config, os.path.join(out_dir, "ckpt-torch"), rank, world,
                            torch_optimizer=True)
        torch.save(state, os.path.join(out_dir, f"torch-rank{rank}.pt"))
        run_refused_load(rank, out_dir, world)
        run_refused_full_state(rank, out_dir, world)
        run_refused_empty_group(rank, out_dir, world)
        run_empty_group(rank, out_dir, world)


@pytest.mark.parametrize("offload", OFFLOADS)
@pytest.mark.parametrize("torch_optimizer", [False, True], ids=["config", "torch_optimizer"])
def test_one_process_steps_param_groups_as_torch(nvme_dir, offload, torch_optimizer):
    config = grouped_config(offload, os.path.join(nvme_dir, "swap"), 1)
    found = run_grouped(config, os.path.join(nvme_dir, "ckpt"), 0, 1, torch_optimizer)
    assert_same_state(found, grouped_reference(1)[0].state_dict())


def check_consolidated(directory, world):
    """The half-way save consolidated: the reference's model, and its optimizer's state and
    param groups in torch's layout."""
    saved = os.path.join(directory, f"global_step{STEPS // 2}", "optimizer")
    consolidated = zoe.torch.consolidated_state_dict(saved)
    model, optimizer = grouped_reference(world, steps=STEPS // 2)
    assert_same_state(consolidated["model"], model.state_dict())
    expected = optimizer.state_dict()
    found = consolidated["optimizer"]
    assert len(found["param_groups"]) == 2
    for mine, theirs in zip(found["param_groups"], expected["param_groups"]):
        assert mine["params"] == theirs["params"]
        for key in ("lr", "weight_decay", "betas", "eps"):
            assert mine[key] == pytest.approx(theirs[key]), key
    assert sorted(found["state"]) == sorted(expected["state"])
    for index, entry in expected["state"].items():
        assert float(found["state"][index]["step"]) == float(entry["step"])
        assert_same_state({key: found["state"][index][key] for key in ("exp_avg", "exp_avg_sq")},
                          {key: entry[key] for key in ("exp_avg", "exp_avg_sq")}, atol=1e-5)


def test_ranks_step_param_groups_as_torch(nvme_dir):
    spawn_ranks(worker, (nvme_dir, WORLD), WORLD, nvme_dir, JOIN_SECONDS)
    expected = grouped_reference(WORLD)[0].state_dict()
    for saved in OFFLOADS + ("torch",):
        for rank in range(WORLD):
            found = torch.load(os.path.join(nvme_dir, f"{saved}-rank{rank}.pt"))
            assert_same_state(found, expected)
    for offload in OFFLOADS:
        check_consolidated(os.path.join(nvme_dir, f"ckpt-{offload}"), WORLD)
    out = os.path.join(nvme_dir, "consolidated.pt")
    assert zoe.torch.consolidate_checkpoint(
        os.path.join(nvme_dir, "ckpt-cpu", f"global_step{STEPS // 2}", "optimizer"), out) == 4
    assert len(torch.load(out)["optimizer"]["param_groups"]) == 2
    # as DeepSpeed's zero_to_fp32 takes a save: the engine's folder (its latest), or a tag's
    engine_dir = os.path.join(nvme_dir, "ckpt-cpu")
    tag = open(os.path.join(engine_dir, "latest"), encoding="utf-8").read()
    expected = zoe.torch.consolidated_state_dict(os.path.join(engine_dir, tag, "optimizer"))
    for given in (engine_dir, os.path.join(engine_dir, tag)):
        assert_same_state(zoe.torch.consolidated_state_dict(given)["model"], expected["model"],
                          atol=0)
    for rank in range(WORLD):
        with open(os.path.join(nvme_dir, f"refused-rank{rank}.txt"), encoding="utf-8") as file:
            message = file.read()
            assert "holds 2 param groups" in message and "same model_parameters=" in message
        with open(os.path.join(nvme_dir, f"full-state-rank{rank}.txt"),
                  encoding="utf-8") as file:
            message = file.read()
            assert f"this rank's shard of a ZeRO stage 3 parameter over {WORLD} ranks" in \
                message and "loads at stage 1 or 2 on any number of ranks" in message, message
        with open(os.path.join(nvme_dir, f"empty-rank{rank}.txt"), encoding="utf-8") as file:
            assert "param group 1 would hold no parameter shard on rank 0 " \
                "of 2" in file.read()
        with open(os.path.join(nvme_dir, f"empty-torch-rank{rank}.txt"),
                  encoding="utf-8") as file:
            # every parameter's shard (each has 2 or more); after close() the torch optimizer
            # holds the module's parameters again
            assert file.read() == "([4, 0], True)"


def test_groups_must_hold_every_trainable_parameter_once():
    config = ds_config(3, "cpu", offload_param="cpu")
    model = make_model()
    missing = [{"params": model[0].parameters()}, {"params": [model[2].weight]}]
    with pytest.raises(zoe.InvalidArgument, match="'2.bias' .* is in no param group.*add it "
                                                  "to a group, or freeze it"):
        zoe.torch.initialize(model=model, model_parameters=missing, config=config)
    repeated = [{"params": model.parameters()}, {"params": [model[2].bias], "lr": 0.1}]
    with pytest.raises(zoe.InvalidArgument, match="'2.bias' is in param groups 0 and 1 .*put "
                                                  "each parameter in one group"):
        zoe.torch.initialize(model=model, model_parameters=repeated, config=config)
    other = [{"params": model.parameters()}, {"params": make_model()[0].parameters()}]
    with pytest.raises(zoe.InvalidArgument, match="not the module's"):
        zoe.torch.initialize(model=model, model_parameters=other, config=config)
    model[0].bias.requires_grad_(False)  # frozen: may be left out of every group
    frozen_out = [{"params": [model[0].weight]}, {"params": model[2].parameters()}]
    engine, optimizer, _, _ = zoe.torch.initialize(model=model, model_parameters=frozen_out,
                                                   config=config)
    assert [len(group["params"]) for group in optimizer.param_groups] == [1, 2]  # no frozen
    engine.close()


def test_groups_given_keep_their_dicts():
    """initialize copies the groups: the caller's dicts still hold the module's parameters."""
    model = make_model()
    groups = param_groups(model)
    before = copy.copy(groups[0]["params"])
    engine, _, _, _ = zoe.torch.initialize(model=model, model_parameters=groups,
                                           config=ds_config(3, "cpu", offload_param="cpu"))
    assert len(groups[0]["params"]) == len(before)
    assert all(given is kept for given, kept in zip(groups[0]["params"], before))
    engine.close()


def test_a_non_finite_group_skips_every_group_without_clipping():
    """No clipping, an inf gradient in the weights' group only: the biases' group skips too
    (as under clipping, and as an fp16 engine taking the skip as an overflow expects)."""
    config = ds_config(3, "cpu", offload_param="cpu")
    config["gradient_clipping"] = 0.0
    del config["scheduler"]  # the config's lr from the first step
    model = make_model()
    engine, optimizer, _, _ = zoe.torch.initialize(model=model,
                                                   model_parameters=param_groups(model),
                                                   config=config)
    model[2].weight.register_hook(lambda grad: grad * float("inf"))
    before = {key: value.clone() for key, value in engine.module_state_dict().items()}
    train_engine(engine, 0, 1, 0, 1)
    assert [result.skipped for result in optimizer.last_step] == [True, True]
    assert_same_state(engine.module_state_dict(), before, atol=0)
    engine.close()


def test_stage_3_refuses_optimizers_it_cannot_step_in_place():
    config = ds_config(3, "cpu", offload_param="cpu")
    model = make_model()
    with pytest.raises(zoe.InvalidArgument, match="given both to initialize and in the config"):
        zoe.torch.initialize(model=model, optimizer=torch_adamw(model)[0], config=config)
    del config["optimizer"], config["scheduler"]
    with pytest.raises(zoe.InvalidArgument, match="steps torch.optim.AdamW, Adam and Adagrad "
                                                  "in their place"):
        zoe.torch.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             config=config)
    full = zoe.torch.AdamW(model.parameters())
    with pytest.raises(zoe.InvalidArgument, match="holds the full parameters: name it in the "
                                                  "config's 'optimizer' section"):
        zoe.torch.initialize(model=model, optimizer=full, config=config)
    full.close()
    partial = torch.optim.AdamW(model[0].parameters(), lr=LR)
    with pytest.raises(zoe.InvalidArgument, match="'2.weight' .* is in no param group of the "
                                                  "optimizer given"):
        zoe.torch.initialize(model=model, optimizer=partial, config=config)
    with pytest.raises(zoe.InvalidArgument, match="no optimizer: .*or pass a torch.optim.AdamW"):
        zoe.torch.initialize(model=model, config=config)


def test_a_failed_initialize_leaves_the_torch_optimizer_as_given():
    """Stage 3 puts the shards (in one process the paged parameters) in the torch optimizer's
    param groups; a schedule refused after that gives the caller back its
    optimizer and module as they were."""
    config = ds_config(3, "cpu", offload_param="cpu")
    del config["optimizer"], config["scheduler"]
    model = make_model()
    model[0].bias.requires_grad_(False)
    values = {key: value.clone() for key, value in model.state_dict().items()}
    given = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    before = [list(group["params"]) for group in given.param_groups]
    elsewhere = torch.optim.lr_scheduler.LambdaLR(torch_adamw(make_model())[0], lambda _: 1.0)
    with pytest.raises(zoe.InvalidArgument, match="lr_scheduler steps another optimizer"):
        zoe.torch.initialize(model=model, optimizer=given, lr_scheduler=elsewhere,
                             config=config)
    for group, params in zip(given.param_groups, before):
        assert len(group["params"]) == len(params)
        assert all(a is b for a, b in zip(group["params"], params))
    assert_same_state(model.state_dict(), values, atol=0)


@pytest.mark.parametrize("options", [{"amsgrad": True}, {"maximize": True}])
def test_group_options_zoe_would_refuse_leave_the_module_unpaged(options):
    """A torch optimizer (or model_parameters= group) asking for what zoe's step does not do is
    refused before the module is paged: its parameters and values are as given, and a second
    initialize takes it."""
    config = ds_config(3, "cpu", offload_param="cpu")
    model = make_model()
    values = {key: value.clone() for key, value in model.state_dict().items()}
    with pytest.raises(zoe.InvalidArgument, match=f"param group 1.*{next(iter(options))}"):
        zoe.torch.initialize(model=model, config=config, model_parameters=[
            {"params": model[0].parameters()}, dict(options, params=model[2].parameters())])
    del config["optimizer"], config["scheduler"]
    with pytest.raises(zoe.InvalidArgument, match=f"param group 0.*{next(iter(options))}"):
        zoe.torch.initialize(model=model, config=config,
                             optimizer=torch.optim.AdamW(model.parameters(), lr=LR, **options))
    assert not any(hasattr(param, "_zoe_pager") or hasattr(param, "_zoe_sharded_pager")
                   for param in model.parameters())
    assert_same_state(model.state_dict(), values, atol=0)
    engine, _, _, _ = zoe.torch.initialize(
        model=model, config=config, optimizer=torch.optim.AdamW(model.parameters(), lr=LR))
    engine.close()


def test_a_failure_after_paging_gives_the_module_back(monkeypatch):
    """zoe's optimizer failing once the module is paged (here its construction): the module's
    own parameters come back with their values."""
    config = ds_config(3, "cpu", offload_param="cpu")
    model = make_model()
    values = {key: value.clone() for key, value in model.state_dict().items()}

    def refuse(*args, **kwargs):
        raise _invalid("refused here")

    monkeypatch.setattr(zoe.torch.AdamW, "_check_speculative", refuse)
    with pytest.raises(zoe.InvalidArgument, match="refused here"):
        zoe.torch.initialize(model=model, config=config)
    monkeypatch.undo()
    assert not any(hasattr(param, "_zoe_pager") or hasattr(param, "_zoe_sharded_pager")
                   for param in model.parameters())
    assert_same_state(model.state_dict(), values, atol=0)
    engine, _, _, _ = zoe.torch.initialize(model=model, config=config)
    engine.close()


@pytest.mark.parametrize("stage", [2, 3])
def test_model_parameters_beside_an_optimizer_are_not_read_and_say_so(stage, caplog):
    """As DeepSpeed, model_parameters= is not read when optimizer= is given; when they differ,
    a warning says which one trains."""
    config = ds_config(stage, "cpu", offload_param="cpu" if stage == 3 else None)
    del config["optimizer"], config["scheduler"]
    model = make_model()
    given = torch.optim.AdamW(model.parameters(), lr=LR)
    engine, _, _, _ = zoe.torch.initialize(model=model, optimizer=given,
                                           model_parameters=model.parameters(), config=config)
    engine.close()
    assert "model_parameters= holds other parameters" not in caplog.text
    model = make_model()
    given = torch.optim.AdamW(model.parameters(), lr=LR)
    engine, _, _, _ = zoe.torch.initialize(model=model, optimizer=given,
                                           model_parameters=model[0].parameters(), config=config)
    engine.close()
    assert "is not read beside optimizer= (as in DeepSpeed): the optimizer's param groups " \
        "are trained" in caplog.text
