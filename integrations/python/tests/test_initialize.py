"""zoe.torch.initialize in one process: a DeepSpeed-style script (accumulation 2, clipping, AdamW
-- or Adagrad or Lion -- and WarmupLR from the config, a checkpoint loaded into a fresh engine
half-way) at ZeRO stages 0-2 with the optimizer state in DRAM or on NVMe, and 3 with the parameters
paged too, ends with the parameters of the plain torch loop; engine.backward hands a device model's
gradients over as they become final; the latest checkpoint is the default, a save that fails or is
killed half-way keeps the previous one; bf16, "auto" values, a user's torch or zoe optimizer and
scheduler, the data loader; batch settings are derived and checked as DeepSpeed does; unsupported
optimizers, schedulers, settings given twice and model_parameters stage 3 would not honour are
refused naming the fix."""

import json
import os

import pytest
import torch

import zoe
import zoe.torch
from initialize_script import (ACCUMULATION, CLIP, LR, MICRO, STEPS, WEIGHT_DECAY, ds_config,
                               grouped_torch_adamw, torch_steps,
                               make_model, reference, run_script, assert_same_state,
                               train_engine, accelerate_steps)
from test_zero3 import world_of_one  # noqa: F401 (a fixture)
from zoe.torch.device import HostTwin
from zoe.torch.ds_config import batch_sizes


@pytest.mark.parametrize("stage,offload,offload_param", [
    (stage, offload, offload if stage == 3 else None)
    for stage in range(4) for offload in ("none", "cpu", "nvme")])
def test_script_equals_plain_torch_loop(stage, offload, offload_param, nvme_dir):
    config = ds_config(stage, offload, os.path.join(nvme_dir, "swap"),
                       offload_param=offload_param)
    found = run_script(config, os.path.join(nvme_dir, "ckpt"))
    assert_same_state(found, reference())


@pytest.mark.parametrize("optimizer", ["Adagrad", "Lion"])
@pytest.mark.parametrize("stage,offload,offload_param", [
    (0, "cpu", None), (1, "nvme", None), (3, "nvme", "nvme")])
def test_script_with_adagrad_or_lion_equals_plain_torch_loop(optimizer, stage, offload,
                                                             offload_param, nvme_dir):
    config = ds_config(stage, offload, os.path.join(nvme_dir, "swap"),
                       offload_param=offload_param, optimizer=optimizer)
    found = run_script(config, os.path.join(nvme_dir, "ckpt"))
    assert_same_state(found, reference(optimizer=optimizer))


@pytest.mark.parametrize("stage,offload_param", [(0, None), (3, "cpu")])
def test_a_checkpoint_of_another_optimizer_is_refused_before_the_module_changes(
        stage, offload_param, nvme_dir):
    ckpt = os.path.join(nvme_dir, "ckpt")
    offload = "cpu" if stage else "none"
    engine, _, _, _ = zoe.torch.initialize(
        model=make_model(), config=ds_config(stage, offload, offload_param=offload_param,
                                             optimizer="Lion"))
    train_engine(engine, 0, 1, 0, 1)
    engine.save_checkpoint(ckpt)
    engine.close()
    engine, _, _, _ = zoe.torch.initialize(
        model=make_model(seed=1), config=ds_config(stage, offload, offload_param=offload_param))
    before = {key: value.clone() for key, value in engine.module_state_dict().items()}
    with pytest.raises(zoe.InvalidArgument, match="is of zoe.torch.Lion; this optimizer is "
                                                  "zoe.torch.AdamW"):
        engine.load_checkpoint(ckpt)
    assert_same_state(engine.module_state_dict(), before, atol=0)
    assert engine.global_steps == 0
    path, _ = engine.load_checkpoint(ckpt, load_module_only=True)  # the module alone loads
    assert path.endswith("global_step1")
    engine.close()


def test_engine_counters_boundaries_and_learning_rate(nvme_dir):
    model = make_model()
    engine, optimizer, _, scheduler = zoe.torch.initialize(model=model, config=ds_config())
    assert isinstance(optimizer, zoe.torch.AdamW)
    assert engine.train_batch_size() == MICRO * ACCUMULATION
    assert engine.gradient_accumulation_steps() == ACCUMULATION
    assert engine.get_lr() == [0.0]  # WarmupLR's warmup_min_lr from construction, as DeepSpeed's
    boundaries = []
    for _ in range(2 * ACCUMULATION):
        boundaries.append(engine.is_gradient_accumulation_boundary())
        loss = engine(torch.randn(MICRO, 8)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    assert boundaries == [False, True, False, True]
    assert (engine.global_steps, engine.micro_steps) == (2, 4)
    assert engine.get_lr() == scheduler.get_last_lr() == [scheduler.get_lr()[0]]
    assert all(p.grad is None for p in model.parameters())
    engine.close()


def test_latest_tag_by_default_and_a_crash_mid_save_keeps_it(nvme_dir):
    ckpt = os.path.join(nvme_dir, "ckpt")
    model = make_model()
    engine, _, _, _ = zoe.torch.initialize(model=model, config=ds_config())
    train_engine(engine, 0, 1, 0, 1)
    engine.save_checkpoint(ckpt, tag="first", client_state={"n": 1})
    train_engine(engine, 1, 2, 0, 1)
    engine.save_checkpoint(ckpt, client_state={"n": 2})
    assert open(os.path.join(ckpt, "latest")).read() == "global_step2"
    os.makedirs(os.path.join(ckpt, ".global_step3.partial"))  # a save killed half-way
    path, client = engine.load_checkpoint(ckpt)
    assert path == os.path.join(ckpt, "global_step2") and client == {"n": 2}
    path, client = engine.load_checkpoint(ckpt, tag="first")
    assert client == {"n": 1} and engine.global_steps == 1
    with pytest.raises(zoe.NotFound, match="'.*none' does not exist"):
        engine.load_checkpoint(os.path.join(nvme_dir, "none"))  # a directory mistyped
    os.makedirs(os.path.join(nvme_dir, "empty"))
    assert engine.load_checkpoint(os.path.join(nvme_dir, "empty")) == (None, None)
    engine.close()


@pytest.mark.parametrize("given,world,expected", [
    (dict(train_batch_size=32, train_micro_batch_size_per_gpu=4), 2, (32, 4, 4)),
    (dict(train_batch_size=32, gradient_accumulation_steps=2), 2, (32, 8, 2)),
    (dict(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=3), 2, (24, 4, 3)),
    (dict(train_batch_size=16), 4, (16, 4, 1)),
    (dict(train_micro_batch_size_per_gpu=4, train_batch_size="auto"), 2, (8, 4, 1)),
])
def test_batch_settings_are_derived_as_deepspeed_derives_them(given, world, expected):
    sizes = batch_sizes(given, world)
    assert (sizes.train_batch_size, sizes.micro_batch_per_gpu,
            sizes.gradient_accumulation_steps) == expected


def test_inconsistent_batch_settings_are_refused_naming_the_fix():
    config = ds_config()
    config["gradient_accumulation_steps"] = 3
    with pytest.raises(zoe.InvalidArgument, match="set train_batch_size to 12"):
        zoe.torch.initialize(model=make_model(), config=config)
    with pytest.raises(zoe.InvalidArgument, match="give train_batch_size or"):
        batch_sizes({}, 1)


@pytest.mark.parametrize("kind,params,fix", [
    ("OneBitAdam", {}, "zoe.torch steps Adam, AdamW, Adagrad, Lion"),
    ("Lamb", {}, "pass a torch optimizer to initialize"),
    ("Lion", {"lr": 1e-3, "eps": 1e-8}, "optimizer.params.eps is not a setting of Lion; "
                                         "allowed: lr, betas, weight_decay"),
    ("AdamW", {"bias_correction": False}, "bias_correction = false is not supported"),
    ("Adagrad", {"initial_accumulator_value": 0.0}, "initial_accumulator_value is not a "
                                                    "setting of Adagrad; allowed: lr, eps"),
    ("Adam", {"amsgrad": True}, "support none of amsgrad"),
])
def test_unsupported_optimizer_or_setting_is_refused_with_the_reason(kind, params, fix):
    config = ds_config()
    config["optimizer"] = {"type": kind, "params": params}
    with pytest.raises(zoe.InvalidArgument, match=fix):
        zoe.torch.initialize(model=make_model(), config=config)


def test_unknown_scheduler_is_refused_naming_the_supported_ones():
    config = ds_config()
    config["scheduler"] = {"type": "OneCycle", "params": {}}
    with pytest.raises(zoe.InvalidArgument, match="supported: WarmupLR, WarmupDecayLR, "
                                                   "WarmupCosineLR.*lr_scheduler="):
        zoe.torch.initialize(model=make_model(), config=config)


def test_settings_given_twice_are_refused():
    model = make_model()
    user = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(zoe.InvalidArgument, match="remove one of them"):
        zoe.torch.initialize(model=model, optimizer=user, config=ds_config())
    config = ds_config()
    del config["optimizer"]
    config["zero_optimization"]["stage"] = 2
    with pytest.raises(zoe.InvalidArgument, match="give zero_optimization.stage 0"):
        zoe.torch.initialize(model=model, optimizer=user, config=config)


def test_user_torch_optimizer_and_scheduler_are_honoured(nvme_dir):
    """Stage 0 with a torch optimizer and a torch scheduler: the engine clips, steps both."""
    config = ds_config()
    del config["optimizer"], config["scheduler"]
    config["zero_optimization"] = {"stage": 0}
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, returned, _, scheduler = zoe.torch.initialize(
        model=model, optimizer=optimizer, config=json.dumps(config),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5))
    assert returned is optimizer
    train_engine(engine, 0, 2, 0, 1)
    assert engine.get_lr() == pytest.approx([0.025])
    engine.save_checkpoint(os.path.join(nvme_dir, "ckpt"))
    assert engine.load_checkpoint(os.path.join(nvme_dir, "ckpt"))[0] is not None
    engine.close()


def test_a_config_no_engine_reads_is_still_checked():
    """Stage 0 with a torch optimizer, or with a zoe optimizer on an engine of its own: no
    engine of initialize's reads the config, whose unknown keys and bad values are still
    refused naming them, before anything is built."""
    config = ds_config()
    del config["optimizer"], config["scheduler"]
    config["zero_optimization"] = {"stage": 0}
    config["zoe"]["chunk_sise"] = "64K"
    model = make_model()
    with pytest.raises(zoe.InvalidArgument, match="did you mean 'chunk_size'"):
        zoe.torch.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             config=config)
    del config["zoe"]["chunk_sise"]
    config["zero_optimisation"] = config.pop("zero_optimization")
    own = zoe.torch.AdamW(model.parameters(), lr=LR, max_grad_norm=CLIP,
                          config={"zoe": {"log_level": "error"}})
    with pytest.raises(zoe.InvalidArgument, match="did you mean 'zero_optimization'"):
        zoe.torch.initialize(model=model, optimizer=own, config=config)
    own.close()


@pytest.mark.parametrize("stage,offload", [(0, "cpu"), (2, "nvme")])
def test_a_torch_adamw_is_stepped_by_zoe_where_zoe_offloads(nvme_dir, stage, offload):
    """A torch AdamW of two param groups and a schedule over it, as Hugging Face's Trainer
    passes them, with offload_optimizer: zoe's AdamW steps the same param group dicts (the
    schedule's rates reach it) and ends with the plain torch loop's parameters."""
    config = ds_config(stage, offload, nvme_dir)
    del config["optimizer"], config["scheduler"]
    model = make_model()
    optimizer, schedule = grouped_torch_adamw(model)
    engine, returned, _, scheduler = zoe.torch.initialize(
        model=model, optimizer=optimizer, lr_scheduler=schedule, config=config)
    assert isinstance(returned, zoe.torch.AdamW) and scheduler is schedule
    assert all(a is b for a, b in zip(returned.param_groups, optimizer.param_groups))
    assert engine.optimizer_name() == "AdamW"  # the client optimizer's, as DeepSpeed's
    assert engine.get_mom() == [(0.9, 0.999)] * 2
    train_engine(engine, 0, STEPS, 0, 1)
    assert engine.get_lr() == [LR, LR]
    expected = make_model()
    torch_steps(expected, *grouped_torch_adamw(expected), 0, STEPS)
    assert_same_state(engine.module_state_dict(), expected.state_dict())
    engine.close()


def test_torch_optimizers_zoe_cannot_step_in_place_are_refused():
    config = ds_config(2, "cpu")
    del config["optimizer"]
    model = make_model()
    with pytest.raises(zoe.InvalidArgument, match="steps torch.optim.AdamW, Adam and Adagrad "
                                                  "in their place"):
        zoe.torch.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                             config=config)
    stepped = torch.optim.AdamW(model.parameters(), lr=LR)
    model(torch.randn(2, 8)).sum().backward()
    stepped.step()
    with pytest.raises(zoe.InvalidArgument, match="has state.*pass a fresh one"):
        zoe.torch.initialize(model=model, optimizer=stepped, config=config)
    # torch's Adagrad has state from its construction on: fresh until it steps
    engine, returned, _, _ = zoe.torch.initialize(
        model=model, optimizer=torch.optim.Adagrad(model.parameters(), lr=LR), config=config)
    assert isinstance(returned, zoe.torch.Adagrad)
    engine.close()


def test_user_zoe_optimizer_must_clip_as_the_config_says(nvme_dir):
    config = ds_config()
    del config["optimizer"]
    model = make_model()
    unclipped = zoe.torch.AdamW(model.parameters(), lr=LR)
    with pytest.raises(zoe.InvalidArgument, match="max_grad_norm=1.0"):
        zoe.torch.initialize(model=model, optimizer=unclipped, config=config)
    unclipped.close()
    clipped = zoe.torch.AdamW(model.parameters(), lr=LR, max_grad_norm=1.0)
    engine, returned, _, _ = zoe.torch.initialize(model=model, optimizer=clipped, config=config)
    assert returned is clipped
    train_engine(engine, 0, 1, 0, 1)
    engine.close()
    clipped.close()  # the caller's: the engine does not close it


@pytest.mark.parametrize("loop", ["deepspeed", "accelerate"])
@pytest.mark.parametrize("speculative", [False, True], ids=["overlap", "speculate"])
def test_boundary_backward_hands_device_gradients_over_as_they_become_final(speculative, loop):
    """A model on the (adversarial) CPU twin with a user's zoe AdamW: engine.backward arms the
    optimizer's overlap on the boundary micro-batch only, so the boundary's gradients reach zoe
    during backward (and a speculative optimizer updates then), and the script still ends with
    the plain torch loop's parameters -- in DeepSpeed's loop (step() after every micro-batch,
    the boundary counted) and in accelerate's (set_gradient_accumulation_boundary before each
    backward, step() after the boundary's only)."""
    config = ds_config()
    del config["optimizer"]
    model = make_model()
    optimizer = zoe.torch.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY,
                                max_grad_norm=CLIP, device_backend=HostTwin(adversarial=True),
                                speculative=speculative)
    engine, _, _, _ = zoe.torch.initialize(model=model, optimizer=optimizer, config=config)
    if loop == "deepspeed":
        train_engine(engine, 0, STEPS, 0, 1)
    else:
        accelerate_steps(engine, 0, STEPS)
    assert_same_state(engine.module_state_dict(), reference())
    handed = optimizer._groups[0].device.stats
    params = len(list(model.parameters()))
    # the first micro-batch's gradients are not final: only the boundary's go early
    assert handed["handed_in_backward"] + handed["handed_at_step"] == STEPS * params
    assert handed["handed_in_backward"] > 0
    speculated = optimizer._groups[0].zoe_group.speculation_stats()["chunks_speculative"]
    assert (speculated > 0) == speculative
    engine.close()
    optimizer.close()


@pytest.mark.parametrize("stage", [1, 2])
def test_a_model_neither_on_the_cpu_nor_on_cuda_at_stage_1_or_2_is_refused(stage, world_of_one):
    model = torch.nn.Linear(8, 4, device="meta")
    groups = [{"params": (p for p in model.parameters())}]  # a generator, as users pass them
    with pytest.raises(zoe.InvalidArgument, match="param group 0 is on meta; zoe optimizers "
                                                  "take CPU or CUDA tensors"):
        zoe.torch.initialize(model=model, model_parameters=groups,
                             config=ds_config(stage, "cpu"))


def test_a_user_optimizer_must_speculate_as_the_config_says():
    config = ds_config()
    del config["optimizer"]
    config["zoe"]["speculative"] = True
    model = make_model()
    plain = zoe.torch.AdamW(model.parameters(), lr=LR, max_grad_norm=CLIP,
                            device_backend=HostTwin())
    with pytest.raises(zoe.InvalidArgument, match="does not speculate but the config's "
                                                  "zoe.speculative is true; construct it with "
                                                  "speculative=True"):
        zoe.torch.initialize(model=model, optimizer=plain, config=config)
    plain.close()
    speculating = zoe.torch.AdamW(model.parameters(), lr=LR, max_grad_norm=CLIP,
                                  device_backend=HostTwin(), speculative=True)
    engine, _, _, _ = zoe.torch.initialize(model=model, optimizer=speculating, config=config)
    engine.close()
    speculating.close()
    on_cpu = zoe.torch.AdamW(model.parameters(), lr=LR, max_grad_norm=CLIP)  # never speculates
    engine, _, _, _ = zoe.torch.initialize(model=model, optimizer=on_cpu, config=config)
    engine.close()
    on_cpu.close()


@pytest.mark.parametrize("stage,offload_param,bf16", [(0, None, True), (3, "cpu", False)])
def test_save_16bit_model_writes_the_full_module_atomically(stage, offload_param, bf16,
                                                            nvme_dir, monkeypatch):
    config = ds_config(stage, "cpu" if stage else "none", offload_param=offload_param)
    if bf16:
        config["bf16"] = {"enabled": True}
    model = make_model()
    model[2].bias.requires_grad_(False)
    engine, _, _, _ = zoe.torch.initialize(model=model, config=config)
    for _ in range(ACCUMULATION):
        x = torch.randn(MICRO, 8).to(next(engine.module.parameters()).dtype)
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
    want = {key: value.clone() for key, value in engine.module_state_dict().items()}
    assert engine.save_16bit_model(nvme_dir) is True
    saved = torch.load(os.path.join(nvme_dir, "pytorch_model.bin"))
    assert_same_state(saved, want, atol=0)
    assert all(value.dtype == (torch.bfloat16 if bf16 else torch.float32)
               for value in saved.values())
    engine.save_16bit_model(nvme_dir, "trainable.bin", exclude_frozen_parameters=True)
    assert sorted(torch.load(os.path.join(nvme_dir, "trainable.bin"))) == sorted(
        key for key in want if key != "2.bias")

    def failing_save(obj, file):
        file.write(b"half a model")
        raise OSError("disk full")
    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        engine.save_16bit_model(nvme_dir)
    monkeypatch.undo()
    assert_same_state(torch.load(os.path.join(nvme_dir, "pytorch_model.bin")), want, atol=0)
    assert sorted(os.listdir(nvme_dir)) == ["pytorch_model.bin", "trainable.bin"]
    engine.close()


def test_training_data_gives_micro_batches():
    data = torch.utils.data.TensorDataset(torch.randn(20, 8), torch.randn(20, 4))
    engine, _, loader, _ = zoe.torch.initialize(model=make_model(), config=ds_config(),
                                                training_data=data)
    assert [len(x) for x, _ in loader] == [MICRO] * 5
    engine.close()


def test_bf16_casts_the_module_and_trains(nvme_dir):
    config = ds_config()
    config["bf16"] = {"enabled": True}
    engine, _, _, _ = zoe.torch.initialize(model=make_model(), config=config)
    assert all(p.dtype == torch.bfloat16 for p in engine.module.parameters())
    before = [p.detach().clone() for p in engine.module.parameters()]
    for _ in range(3 * ACCUMULATION):  # the log warmup's first two steps are at warmup_min_lr 0
        x = torch.randn(MICRO, 8).bfloat16()
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
    assert not all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))
    engine.save_checkpoint(os.path.join(nvme_dir, "ckpt"), tag="same")
    engine.save_checkpoint(os.path.join(nvme_dir, "ckpt"), tag="same")  # replaces it
    assert sorted(os.listdir(os.path.join(nvme_dir, "ckpt"))) == ["latest", "same"]
    engine.close()


def test_auto_values_as_hugging_face_writes_them():
    config = ds_config()
    config.update(train_batch_size="auto", gradient_accumulation_steps="auto",
                  gradient_clipping="auto", fp16={"enabled": "auto"}, bf16={"enabled": "auto"})
    config["optimizer"]["params"].update(lr="auto", weight_decay="auto")
    config["scheduler"]["params"]["warmup_max_lr"] = "auto"
    model = make_model()
    engine, _, _, scheduler = zoe.torch.initialize(model=model, config=config)
    assert (engine.train_batch_size(), engine.gradient_accumulation_steps()) == (MICRO, 1)
    assert engine.get_lr() == [0.0] and scheduler.max_lrs == [1e-3]  # DeepSpeed's defaults
    assert not engine.fp16_enabled() and not engine.bfloat16_enabled()
    assert next(model.parameters()).dtype == torch.float32
    engine.backward(engine(torch.randn(MICRO, 8)).pow(2).mean())
    engine.step()
    assert engine.was_step_applied() and engine.global_steps == 1
    engine.close()


def test_a_save_that_fails_half_way_keeps_the_previous_one(nvme_dir, monkeypatch):
    ckpt = os.path.join(nvme_dir, "ckpt")
    engine, _, _, _ = zoe.torch.initialize(model=make_model(), config=ds_config())
    train_engine(engine, 0, 1, 0, 1)
    engine.save_checkpoint(ckpt)
    saved = {k: v.clone() for k, v in engine.module_state_dict().items()}
    train_engine(engine, 1, 2, 0, 1)

    def failing_module_state():
        raise OSError("disk full")
    monkeypatch.setattr(engine, "module_state_dict", failing_module_state)
    with pytest.raises(OSError, match="disk full"):
        engine.save_checkpoint(ckpt)  # the optimizer written, the rest not
    monkeypatch.undo()
    assert open(os.path.join(ckpt, "latest")).read() == "global_step1"
    path, _ = engine.load_checkpoint(ckpt)
    assert path.endswith("global_step1") and engine.global_steps == 1
    assert_same_state(engine.module_state_dict(), saved, atol=0)
    engine.save_checkpoint(ckpt)  # a later save of the same tag starts afresh
    assert sorted(os.listdir(ckpt)) == ["global_step1", "latest"]
    engine.close()


def test_stage_3_refuses_model_parameters_it_would_not_honour():
    config = ds_config(3, "cpu", offload_param="cpu")
    model = make_model()  # param groups: test_zero3_groups.py
    with pytest.raises(zoe.InvalidArgument, match="freeze a parameter with requires_grad=False"):
        zoe.torch.initialize(model=model, model_parameters=model[0].parameters(), config=config)
    model[0].bias.requires_grad_(False)  # frozen: may be left out, or given
    for given in ([p for p in model.parameters() if p.requires_grad], model.parameters()):
        engine, _, _, _ = zoe.torch.initialize(model=model, model_parameters=given,
                                               config=config)
        engine.close()


@pytest.mark.parametrize("stage,offload_param", [(0, None), (3, "cpu")])
def test_stats_say_where_the_time_went(stage, offload_param):
    engine, _, _, _ = zoe.torch.initialize(model=make_model(),
                                           config=ds_config(stage, "cpu" if stage else "none",
                                                            offload_param=offload_param))
    before = engine.stats()
    assert before["forward"] == before["backward"] == before["step"] == 0.0
    train_engine(engine, 0, 2, 0, 1)
    stats = engine.stats()
    engine.close()
    assert (stats["micro_steps"], stats["global_steps"]) == (2 * ACCUMULATION, 2)
    for key in ("forward", "backward", "step"):
        assert stats[key] > 0.0, key
    # one process: no collectives; stage 3 adds the pager's statistics
    assert stats["reductions"] == stats["gathers"] == stats["optimizer_collectives"] == 0.0
    assert ("pager" in stats) == (stage == 3)
    if stage == 3:
        assert stats["pager"]["iterations"] == 2 * ACCUMULATION


def test_a_cpu_model_over_nccl_is_refused_naming_the_fix():
    from zoe.torch.ds_initialize import check_model_device

    with pytest.raises(zoe.InvalidArgument, match="the model has parameters on cpu and the "
                                                  "process group is NCCL's, which reduces GPU "
                                                  "tensors: move the model to this rank's GPU, "
                                                  "or use a gloo process group"):
        check_model_device(make_model().parameters(), "nccl")
    check_model_device([{"params": list(make_model().parameters())}], "gloo")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_reduce_bucket_size_sizes_the_gradient_buckets(stage, world_of_one):
    """zero_optimization.reduce_bucket_size, in elements (DeepSpeed's 5e8 spelling too), sizes
    the buckets the gradients are reduced in over a process group; absent or "auto", zoe's
    default (4 Mi); anything else is refused naming the key."""
    from zoe.torch.distributed import DEFAULT_BUCKET_ELEMENTS

    def buckets(engine, optimizer):
        if stage == 3:
            return engine._stage3.pager.bucket_elements
        return optimizer._zero.bucket_elements

    for given, expected in ((5e2, 500), (0, 0), ("auto", DEFAULT_BUCKET_ELEMENTS),
                            (None, DEFAULT_BUCKET_ELEMENTS)):
        config = ds_config(stage, "cpu", offload_param="cpu" if stage == 3 else None)
        if given is not None:
            config["zero_optimization"]["reduce_bucket_size"] = given
        engine, optimizer, _, _ = zoe.torch.initialize(model=make_model(), config=config)
        assert buckets(engine, optimizer) == expected, given
        engine.close()
    config = ds_config(stage, "cpu", offload_param="cpu" if stage == 3 else None)
    config["zero_optimization"]["reduce_bucket_size"] = -3
    with pytest.raises(zoe.InvalidArgument, match="zero_optimization.reduce_bucket_size"):
        zoe.torch.initialize(model=make_model(), config=config)


def test_a_user_optimizer_must_reduce_in_the_configs_buckets(world_of_one):
    config = ds_config(2, "cpu")
    del config["optimizer"]
    config["zero_optimization"]["reduce_bucket_size"] = 1000
    model = make_model()
    optimizer = zoe.torch.AdamW(model.parameters(), lr=LR, max_grad_norm=CLIP,
                                process_group=world_of_one, zero_stage=2, bucket_elements=64)
    with pytest.raises(zoe.InvalidArgument, match="reduces buckets of 64 elements but the "
                                                  "config's zero_optimization.reduce_bucket_size "
                                                  "is 1000; construct it with "
                                                  "bucket_elements=1000"):
        zoe.torch.initialize(model=model, optimizer=optimizer, config=config)
    optimizer.close()


def test_an_engine_never_closed_leaves_no_swap_directory(tmp_path):
    """A script that never closes its engine, as DeepSpeed scripts never do, leaves no swap
    directory in TMPDIR at stage 3 (the pager's engine swaps the parameters into one of its
    own): the engines still open are closed when the interpreter exits."""
    import subprocess
    import sys

    code = ("import glob, os, torch, zoe.torch\n"
            "model = torch.nn.Linear(4, 4)\n"
            "config = {'train_micro_batch_size_per_gpu': 2, 'optimizer': {'type': 'AdamW'},\n"
            "          'zero_optimization': {'stage': 3}, 'zoe': {'log_level': 'warn'}}\n"
            "engine, *_ = zoe.torch.initialize(model=model, config=config)\n"
            "print(len(glob.glob(os.path.join(os.environ['TMPDIR'], 'zoe-engine-*'))))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=dict(os.environ, TMPDIR=str(tmp_path)), timeout=120)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.strip()) >= 1  # the engine swapped into a directory of its own
    assert list(tmp_path.iterdir()) == []
