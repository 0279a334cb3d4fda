"""ZeRO stage 3 through zoe.torch.initialize with frozen parameters (the first Linear,
requires_grad=False), in one process and on 2 gloo ranks: the optimizer holds the trainable
parameters only (its param groups and its engine's state), by the config's optimizer, over
param groups with a group of frozen parameters only (taken empty), or in place of a torch AdamW
over every parameter (whose dicts get no frozen parameter); training matches the plain torch
loop; a save and a load into a fresh engine whose frozen values differ restores them (paged in
DRAM or on NVMe, and from a save with exclude_frozen_parameters too); the checkpoint
consolidates into torch's layout (the model with the frozen values, the optimizer over the
trainable parameters); a save written before the frozen values were kept is refused naming what
loads it, and a changed or cut frozen values file is refused as corrupt; a load whose frozen
values fail to be written (on one rank of two, or in one process) changes nothing, and a disk
too full for them is NoSpace."""

import errno
import json
import os
import shutil

import pytest
import torch

import zoe
import zoe.torch
import zoe.torch.frozen_values
from zoe import _capi
from conftest import gloo_rank, spawn_ranks
from initialize_script import (LR, STEPS, WARMUP, WEIGHT_DECAY, assert_same_state, ds_config,
                               make_model, torch_steps, train_engine)
from zoe.torch.checkpoint import MANIFEST
from zoe.torch.distributed import shard_counts
from zoe.torch.ds_checksums import record_checksums
from zoe.torch.frozen_values import INDEX, VALUES, read_index
from zoe.torch.lr_schedules import WarmupLR

JOIN_SECONDS = 180
WORLD = 2
HOWS = ("config", "groups", "torch_optimizer")
FROZEN = ("0.weight", "0.bias")


def frozen_model(seed=0):
    model = make_model(seed)
    model[0].requires_grad_(False)
    return model


def trainable_elements(rank, world):
    """The elements of this rank's shards of the trainable parameters (model[2])."""
    return sum(shard_counts(param.numel(), world)[rank] for param in make_model()[2].parameters())


def start(how, config, seed=0):
    """(engine, optimizer, the torch optimizer given or None) of initialize over a frozen model:
    the config's optimizer over every parameter (model_parameters=), over param groups whose
    second holds frozen parameters only, or a torch AdamW over every parameter given in its
    place."""
    model = frozen_model(seed)
    given = None
    if how == "config":
        engine, optimizer, _, _ = zoe.torch.initialize(
            model=model, model_parameters=model.parameters(), config=config)
    elif how == "groups":
        groups = [{"params": list(model[2].parameters())},
                  {"params": list(model[0].parameters()), "weight_decay": 0.0}]
        engine, optimizer, _, _ = zoe.torch.initialize(model=model, model_parameters=groups,
                                                       config=config)
    else:
        config = {key: value for key, value in config.items()
                  if key not in ("optimizer", "scheduler")}
        given = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        schedule = WarmupLR(given, **WARMUP)
        engine, optimizer, _, _ = zoe.torch.initialize(model=model, optimizer=given,
                                                       lr_scheduler=schedule, config=config)
    return engine, optimizer, given


def check_trainable_only(optimizer, given, rank, world):
    """The optimizer (and the torch optimizer given, whose dicts it shares) holds this rank's
    shards of the trainable parameters, and its engine keeps state (created by a step or a
    load) for those elements only."""
    held = [param for group in optimizer.param_groups for param in group["params"]]
    assert all(param.requires_grad for param in held)
    assert sum(param.numel() for param in held) == trainable_elements(rank, world)
    groups = optimizer.engine.stats()["groups"]
    assert sum(group["parameters"] for group in groups) == trainable_elements(rank, world)
    if given is not None:
        assert all(param.requires_grad for group in given.param_groups
                   for param in group["params"])
        assert all(a is b for a, b in zip(given.param_groups, optimizer.param_groups))


def frozen_values(engine):
    return {key: value.clone() for key, value in engine.module_state_dict().items()
            if key in FROZEN}


def run(how, config, checkpoint_dir, rank, world, exclude_frozen=False):
    """Half the steps, a save, a fresh engine (other values, the frozen ones too) loads it and
    finishes; the final module_state_dict."""
    engine, optimizer, given = start(how, config)
    if how == "groups":
        assert [len(group["params"]) for group in optimizer.param_groups][1] == 0
    saved_frozen = frozen_values(engine)
    train_engine(engine, 0, STEPS // 2, rank, world)
    check_trainable_only(optimizer, given, rank, world)
    assert_same_state(frozen_values(engine), saved_frozen, atol=0)
    engine.save_checkpoint(checkpoint_dir, exclude_frozen_parameters=exclude_frozen)
    engine.close()
    engine, optimizer, given = start(how, config, seed=1)
    engine.load_checkpoint(checkpoint_dir, load_module_strict=not exclude_frozen)
    check_trainable_only(optimizer, given, rank, world)
    assert_same_state(frozen_values(engine), saved_frozen, atol=0)
    train_engine(engine, STEPS // 2, STEPS, rank, world)
    state = {key: value.clone() for key, value in engine.module_state_dict().items()}
    engine.close()
    return state


def reference(world=1, steps=STEPS):
    """(model, optimizer) of the plain torch loop: AdamW over the trainable parameters with the
    config's settings, the same WarmupLR."""
    model = frozen_model()
    optimizer = torch.optim.AdamW(model[2].parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    torch_steps(model, optimizer, WarmupLR(optimizer, **WARMUP), 0, steps, world)
    return model, optimizer


def config_for(directory, world):
    return ds_config(3, "cpu", os.path.join(directory, "swap"), world, "cpu")


@pytest.mark.parametrize("how", HOWS)
def test_one_process_keeps_frozen_parameters_out_of_the_optimizer(nvme_dir, how):
    found = run(how, config_for(nvme_dir, 1), os.path.join(nvme_dir, "ckpt"), 0, 1)
    assert_same_state(found, reference()[0].state_dict())


def test_frozen_parameters_paged_on_nvme_are_restored(nvme_dir):
    config = ds_config(3, "nvme", os.path.join(nvme_dir, "swap"), 1, "nvme")
    found = run("config", config, os.path.join(nvme_dir, "ckpt"), 0, 1)
    assert_same_state(found, reference()[0].state_dict())


def test_a_load_with_the_optimizer_restores_frozen_parameters_saved_without(nvme_dir):
    found = run("config", config_for(nvme_dir, 1), os.path.join(nvme_dir, "ckpt"), 0, 1,
                exclude_frozen=True)
    assert_same_state(found, reference()[0].state_dict())


def optimizer_dir(checkpoint_dir):
    return os.path.join(checkpoint_dir, f"global_step{STEPS // 2}", "optimizer")


def test_one_process_refuses_an_old_or_changed_save(nvme_dir):
    """A save without the frozen values (written before they were kept) is refused naming
    load_optimizer_states=False, which loads it; a changed values file is refused as corrupt
    (by the save's checksum record, and by the values' own sha256)."""
    config = config_for(nvme_dir, 1)
    checkpoint_dir = os.path.join(nvme_dir, "ckpt")
    engine, _, _ = start("config", config)
    train_engine(engine, 0, STEPS // 2, 0, 1)
    saved_frozen = frozen_values(engine)
    engine.save_checkpoint(checkpoint_dir)
    engine.close()
    folder = optimizer_dir(checkpoint_dir)
    with open(os.path.join(folder, VALUES), "rb") as file:
        data = bytearray(file.read())
    data[0] ^= 1
    with open(os.path.join(folder, VALUES), "wb") as file:
        file.write(data)
    with pytest.raises(zoe.Corruption, match="does not match the sha256"):
        read_index(folder)
    engine, _, _ = start("config", config, seed=1)
    with pytest.raises(zoe.Corruption, match=VALUES):
        engine.load_checkpoint(checkpoint_dir)
    for name in (INDEX, VALUES):
        os.remove(os.path.join(folder, name))
    record_checksums(os.path.dirname(folder))  # as a save before the frozen values were kept
    with pytest.raises(zoe.FailedPrecondition, match="held the frozen parameters.*"
                                                     "load_optimizer_states=False"):
        engine.load_checkpoint(checkpoint_dir)
    engine.load_checkpoint(checkpoint_dir, load_optimizer_states=False)
    assert_same_state(frozen_values(engine), saved_frozen, atol=0)
    engine.close()


def run_old_manifest(rank, out_dir, world):
    """The ranks' save with the manifest as a zoe before the frozen values wrote it (no
    frozen_parameters): refused on every rank naming load_optimizer_states=False."""
    checkpoint_dir = os.path.join(out_dir, "ckpt-old")
    if rank == 0:
        shutil.copytree(os.path.join(out_dir, "ckpt-config"), checkpoint_dir)
        path = os.path.join(optimizer_dir(checkpoint_dir), MANIFEST)
        with open(path, encoding="utf-8") as file:
            manifest = json.load(file)
        del manifest["frozen_parameters"]
        with open(path, "w", encoding="utf-8") as file:
            json.dump(manifest, file)
        record_checksums(os.path.dirname(os.path.dirname(path)))
    torch.distributed.barrier()
    engine, _, _ = start("config", config_for(out_dir, world), seed=1)
    try:
        engine.load_checkpoint(checkpoint_dir)
        message = None
    except zoe.FailedPrecondition as error:
        message = str(error)
    engine.close()
    with open(os.path.join(out_dir, f"old-rank{rank}.txt"), "w", encoding="utf-8") as file:
        file.write(repr(message))


def optimizer_state(optimizer):
    """Copies of the optimizer's tensors (master weights, moments) by parameter and slot."""
    return {f"{index}.{slot}": value.clone() for index, entry in
            optimizer.state_dict()["state"].items() for slot, value in entry.items()
            if torch.is_tensor(value)}


def load_failing_on(rank_failing, rank, engine, optimizer, checkpoint_dir):
    """Loads ``checkpoint_dir`` with the frozen values' write (frozen_values.load_frozen)
    failing on ``rank_failing`` only, after that rank's optimizer loaded: (the error raised,
    whether the module and the optimizer are as they were)."""
    where = zoe.torch.frozen_values
    module, state = engine.module_state_dict(), optimizer_state(optimizer)
    writes = where.load_frozen

    def failing(*args, **kwargs):
        raise zoe.IoError(_capi.Status.IO, "the frozen values' pages cannot be written")

    if rank == rank_failing:
        where.load_frozen = failing
    try:
        engine.load_checkpoint(checkpoint_dir)
        error = None
    except zoe.Error as raised:
        error = raised
    finally:
        where.load_frozen = writes
    after = engine.module_state_dict()
    same = (all(torch.equal(value, after[key]) for key, value in module.items())
            and all(torch.equal(value, optimizer_state(optimizer)[key])
                    for key, value in state.items()))
    return error, same


def run_failed_load(rank, out_dir, world):
    """A fresh engine that stepped once loads the ranks' save, rank 1's frozen values failing
    to be written: every rank raises and keeps its module and optimizer as they were."""
    engine, optimizer, _ = start("config", config_for(out_dir, world), seed=1)
    train_engine(engine, 0, 1, rank, world)
    error, same = load_failing_on(1, rank, engine, optimizer,
                                  os.path.join(out_dir, "ckpt-config"))
    engine.close()
    with open(os.path.join(out_dir, f"failed-rank{rank}.txt"), "w", encoding="utf-8") as file:
        json.dump([type(error).__name__, same], file)


def worker(rank, out_dir, world):
    with gloo_rank(rank, world, f"{out_dir}/init", out_dir):
        for how in HOWS:
            state = run(how, config_for(out_dir, world), os.path.join(out_dir, f"ckpt-{how}"),
                        rank, world)
            torch.save(state, os.path.join(out_dir, f"{how}-rank{rank}.pt"))
        run_old_manifest(rank, out_dir, world)
        run_failed_load(rank, out_dir, world)


def check_consolidated(directory):
    """The half-way save consolidated: the reference's model (frozen values too), and its
    optimizer's state and param groups in torch's layout (the trainable parameters only)."""
    consolidated = zoe.torch.consolidated_state_dict(optimizer_dir(directory))
    model, optimizer = reference(WORLD, steps=STEPS // 2)
    assert_same_state(consolidated["model"], model.state_dict())
    expected, found = optimizer.state_dict(), consolidated["optimizer"]
    assert [group["params"] for group in found["param_groups"]] == [
        group["params"] for group in expected["param_groups"]]
    assert sorted(found["state"]) == sorted(expected["state"])
    for index, entry in expected["state"].items():
        assert float(found["state"][index]["step"]) == float(entry["step"])
        assert_same_state({key: found["state"][index][key] for key in ("exp_avg", "exp_avg_sq")},
                          {key: entry[key] for key in ("exp_avg", "exp_avg_sq")}, atol=1e-5)


def test_one_process_load_failing_on_the_frozen_values_changes_nothing(nvme_dir):
    config = config_for(nvme_dir, 1)
    checkpoint_dir = os.path.join(nvme_dir, "ckpt")
    engine, _, _ = start("config", config)
    train_engine(engine, 0, STEPS // 2, 0, 1)
    engine.save_checkpoint(checkpoint_dir)
    engine.close()
    engine, optimizer, _ = start("config", config, seed=1)
    train_engine(engine, 0, 1, 0, 1)
    error, same = load_failing_on(0, 0, engine, optimizer, checkpoint_dir)
    assert isinstance(error, zoe.IoError) and same
    engine.load_checkpoint(checkpoint_dir)  # the same load, not failing, loads
    assert not same_module(engine, seed=1)
    engine.close()


def same_module(engine, seed):
    """Whether the engine's frozen values are still those of frozen_model(seed)."""
    return all(torch.equal(value, frozen_model(seed).state_dict()[key])
               for key, value in frozen_values(engine).items())


def test_a_frozen_values_file_cut_short_is_corruption(tmp_path):
    from zoe.torch import frozen_values as values_module
    index = {"parameters": [{"index": 0, "name": "0.weight", "dtype": "float32", "numel": 4,
                             "bytes": 16}]}
    (tmp_path / VALUES).write_bytes(bytes(12))
    with pytest.raises(zoe.Corruption, match="ends 12 bytes into '0.weight', of 16 bytes"):
        list(values_module.read_values(str(tmp_path), index))


def test_a_disk_too_full_for_the_frozen_values_is_no_space(nvme_dir, monkeypatch):
    from zoe.torch import frozen_values as values_module
    engine, _, _ = start("config", config_for(nvme_dir, 1))
    monkeypatch.setattr(values_module, "available_bytes", lambda directory: 10)
    with pytest.raises(zoe.NoSpace, match="zoe_frozen_values.bin.* needs about \\d+ bytes"):
        engine.save_checkpoint(os.path.join(nvme_dir, "ckpt"))
    monkeypatch.undo()

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(values_module, "_bytes_of", full)
    with pytest.raises(zoe.NoSpace, match="out of space .* while writing"):
        engine.save_checkpoint(os.path.join(nvme_dir, "ckpt"))
    monkeypatch.undo()
    engine.save_checkpoint(os.path.join(nvme_dir, "ckpt"))
    engine.close()


def test_ranks_keep_frozen_parameters_out_of_the_optimizer(nvme_dir):
    spawn_ranks(worker, (nvme_dir, WORLD), WORLD, nvme_dir, JOIN_SECONDS)
    for rank in range(WORLD):
        with open(os.path.join(nvme_dir, f"failed-rank{rank}.txt"), encoding="utf-8") as file:
            name, same = json.load(file)
        assert name in ("IoError", "Aborted") and same, rank
    expected = reference(WORLD)[0].state_dict()
    for how in HOWS:
        for rank in range(WORLD):
            found = torch.load(os.path.join(nvme_dir, f"{how}-rank{rank}.pt"))
            assert_same_state(found, expected)
    for how in ("config", "torch_optimizer"):
        check_consolidated(os.path.join(nvme_dir, f"ckpt-{how}"))
    grouped = zoe.torch.consolidated_state_dict(optimizer_dir(os.path.join(nvme_dir,
                                                                           "ckpt-groups")))
    assert_same_state(grouped["model"], reference(WORLD, steps=STEPS // 2)[0].state_dict())
    assert [group["params"] for group in grouped["optimizer"]["param_groups"]] == [[0, 1], []]
    for rank in range(WORLD):
        with open(os.path.join(nvme_dir, f"old-rank{rank}.txt"), encoding="utf-8") as file:
            message = file.read()
        assert "held the frozen parameters" in message
        assert "load_optimizer_states=False" in message
