"""The engine zoe.torch.initialize returns, against DeepSpeed's engine API (deepspeed/runtime/
engine.py): an nn.Module over the model with its attributes falling through; accelerate's loop
(set_gradient_accumulation_boundary, step() on the boundary only) at every stage, and on 2 ranks
at stages 0, 2 and 3, steps as the plain torch loop (on the CPU twin: test_initialize.py);
was_step_applied; backward's arguments and result; the accessors scripts read and the
throughput timer; module_state_dict's arguments, exclude_frozen_parameters, custom_load_fn; the
training_data loader's order; and load_module_only and load_optimizer_states=False load the saved
parameters (at stage 3 the paged ones, in one process and on 2 ranks sharded) with the
optimizer's moments kept, as a torch loop that loads the model."""

import collections
import copy
import os

import pytest
import torch

import zoe.torch
from conftest import gloo_rank, spawn_ranks
from initialize_script import (ACCUMULATION, CLIP, LR, MICRO, STEPS, accelerate_steps,
                               assert_same_state, ds_config, make_model, module_values,
                               reference, torch_loop, torch_steps, train_engine)
from zoe.torch.throughput_timer import ThroughputTimer
from zoe.torch.ds_load import load_saved as _load_saved

STAGES = [(0, "none", None), (1, "cpu", None), (2, "cpu", None), (3, "cpu", "cpu")]
JOIN_SECONDS = 90


def config_at(stage, offload="cpu", offload_param=None, world=1):
    return ds_config(stage, offload if stage else "none", None, world,
                     offload_param if stage == 3 else None)


def start(stage=0, model=None, world=1, **kwargs):
    """(engine, scheduler) over ``model`` (make_model()) at ``stage``."""
    model = make_model() if model is None else model
    engine, _, _, scheduler = zoe.torch.initialize(
        model=model, config=config_at(stage, offload_param="cpu", world=world), **kwargs)
    return engine, scheduler


def assert_changed_where_it_should(changes):
    """accelerate_steps' record: the parameters changed at the boundaries with a learning rate
    (some), nowhere else."""
    assert [changed for changed, _ in changes] == [moves for _, moves in changes]
    assert any(moves for _, moves in changes)


# --- the engine is an nn.Module over the model ----------------------------------------------


class Wrapped(torch.nn.Module):
    """A model holding its network as ``.model`` (as Hugging Face's do), with an attribute
    and a method of its own."""

    def __init__(self):
        super().__init__()
        self.model = make_model()
        self.main_input_name = "x"

    def forward(self, x):
        return self.model(x)

    def generate(self):
        return "generated"


def test_the_engine_is_a_module_over_the_model_and_falls_through_to_it():
    model = Wrapped()
    engine, _ = start(model=model)
    assert isinstance(engine, torch.nn.Module) and engine.module is model
    assert [id(p) for p in engine.parameters()] == [id(p) for p in model.parameters()]
    assert [name for name, _ in engine.named_parameters()] == [
        "module." + name for name, _ in model.named_parameters()]
    assert [name for name, _ in engine.named_modules()][:3] == ["", "module", "module.model"]
    assert engine.state_dict().keys() == {"module." + key for key in model.state_dict()}
    # the model's attributes, as DeepSpeed's __getattr__ passes them through
    assert engine.model is model.model and engine.main_input_name == "x"
    assert engine.generate() == "generated"
    with pytest.raises(AttributeError, match="no attribute 'absent', nor has its module"):
        getattr(engine, "absent")
    # train() and eval() return None, as DeepSpeed's, and set the mode of both
    assert engine.eval() is None and not engine.training and not model.training
    assert engine.train() is None and engine.training and model.model.training
    x = torch.randn(MICRO, 8)
    seen = []
    engine.register_forward_hook(lambda module, inputs, output: seen.append(output))
    torch.testing.assert_close(engine(x), model(x), rtol=0, atol=0)
    assert len(seen) == 1  # engine(x) is nn.Module's call: hooks on the engine run
    engine.global_steps = 7  # the engine's own attributes stay its own
    assert engine.global_steps == 7 and "global_steps" not in engine._modules
    engine.close()


def test_load_state_dict_through_the_engine_takes_module_prefixed_keys():
    engine, _ = start()
    other = make_model(seed=1)
    engine.load_state_dict({"module." + key: value for key, value in other.state_dict().items()})
    assert_same_state(engine.module_state_dict(), other.state_dict(), atol=0)
    engine.close()


# --- set_gradient_accumulation_boundary: accelerate's loop ----------------------------------


@pytest.mark.parametrize("stage,offload,offload_param", STAGES)
def test_accelerates_loop_steps_at_its_boundaries_as_the_plain_torch_loop(stage, offload,
                                                                         offload_param):
    engine, _, _, _ = zoe.torch.initialize(model=make_model(),
                                           config=config_at(stage, offload, offload_param))
    assert_changed_where_it_should(accelerate_steps(engine, 0, STEPS))
    # step() ran once per accumulation: it counts micro_steps, as DeepSpeed's
    assert (engine.global_steps, engine.micro_steps) == (STEPS, STEPS)
    assert_same_state(engine.module_state_dict(), reference())
    engine.close()


def test_the_boundary_set_is_what_the_engine_reads_until_it_is_unset():
    engine, _ = start()
    assert not engine.is_gradient_accumulation_boundary()
    engine.set_gradient_accumulation_boundary(True)
    assert engine.is_gradient_accumulation_boundary()
    engine.backward(engine(torch.randn(MICRO, 8)).pow(2).mean())
    engine.step()
    assert engine.was_step_applied() and engine.global_steps == 1
    engine.set_gradient_accumulation_boundary(False)
    engine.backward(engine(torch.randn(MICRO, 8)).pow(2).mean())
    engine.step()  # a step() outside the boundary steps nothing
    assert not engine.was_step_applied() and engine.global_steps == 1
    engine.set_gradient_accumulation_boundary(None)  # counted again: micro_steps is 2
    assert not engine.is_gradient_accumulation_boundary()
    engine.close()


# --- step() and backward() ------------------------------------------------------------------


def test_was_step_applied_is_false_after_a_step_between_boundaries():
    engine, _ = start()
    applied = []
    for _ in range(2 * ACCUMULATION):
        engine.backward(engine(torch.randn(MICRO, 8)).pow(2).mean())
        engine.step()
        applied.append(engine.was_step_applied())
    assert applied == [False, True, False, True]
    engine.close()


def test_backward_returns_the_loss_divided_and_honours_its_arguments():
    engine, _ = start()
    model, x = engine.module, torch.randn(MICRO, 8)
    loss = model(x).pow(2).mean()
    divided = engine.backward(loss, retain_graph=True)
    assert divided.dtype == torch.float32 and divided.item() == loss.item() / ACCUMULATION
    halves = [param.grad.clone() for param in model.parameters()]
    engine.zero_grad()
    assert engine.backward(loss, scale_wrt_gas=False) is loss  # the graph was retained
    for half, param in zip(halves, model.parameters()):
        torch.testing.assert_close(param.grad, half * ACCUMULATION)
    engine.close()
    config = ds_config()
    config["gradient_accumulation_steps"], config["train_batch_size"] = 1, MICRO
    engine, _, _, _ = zoe.torch.initialize(model=make_model(), config=config)
    loss = engine(x).pow(2).mean()
    assert engine.backward(loss) is loss  # nothing divided: the loss as given
    engine.close()


# --- what scripts read ----------------------------------------------------------------------


def test_local_rank_comes_from_the_environment_as_deepspeeds(monkeypatch):
    for name in ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    engine, _ = start()
    assert engine.local_rank == 0
    engine.close()
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "2")
    engine, _ = start()
    assert engine.local_rank == 2
    engine.close()
    monkeypatch.setenv("LOCAL_RANK", "3")
    engine, _ = start()
    assert engine.local_rank == 3
    engine.close()


def test_settings_read_from_the_config_as_deepspeed_reads_them():
    engine, _ = start(2)
    assert engine.device == torch.device("cpu")
    assert (engine.dp_world_size, engine.mp_world_size, engine.global_rank) == (1, 1, 0)
    assert engine.get_batch_info() == (MICRO * ACCUMULATION, MICRO, ACCUMULATION)
    assert engine.optimizer_name() == "adamw"
    assert engine.get_mom() == [(0.9, 0.999)]
    assert engine.steps_per_print() is None and engine.wall_clock_breakdown() is False
    assert engine.zero_optimization() and engine.zero_optimization_partition_gradients()
    assert not engine.zero_optimization_partition_weights()
    assert engine.zero_cpu_offload() and engine.gradient_clipping() == CLIP
    assert engine.dataloader_drop_last() is False
    assert engine.zero_gather_16bit_weights_on_model_save() is False
    engine.close()
    config = config_at(3, offload_param="cpu")
    config.update(steps_per_print=10, wall_clock_breakdown=True)
    config["optimizer"]["type"] = "Adagrad"
    config["optimizer"]["params"] = {"lr": LR}
    for key in ("stage3_gather_16bit_weights_on_model_save",
                "stage3_gather_fp16_weights_on_model_save"):  # and DeepSpeed's older name
        config["zero_optimization"][key] = True
        engine, _, _, _ = zoe.torch.initialize(model=make_model(), config=config)
        assert engine.zero_gather_16bit_weights_on_model_save() is True
        assert engine.zero_optimization_partition_weights()
        assert (engine.steps_per_print(), engine.wall_clock_breakdown()) == (10, True)
        assert engine.optimizer_name() == "adagrad" and engine.get_mom() == [0.0]
        engine.close()
        del config["zero_optimization"][key]


def test_a_users_optimizer_is_named_by_its_class_and_its_momentum_read():
    config = ds_config()
    del config["optimizer"], config["scheduler"]
    model = make_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    engine, _, _, _ = zoe.torch.initialize(model=model, optimizer=sgd, config=config)
    assert engine.optimizer_name() == "SGD" and engine.get_mom() == [0.5]
    engine.close()


def test_destroy_closes_the_engine():
    engine, _ = start(3)
    train_engine(engine, 0, 1, 0, 1)
    values = module_values(engine)
    engine.destroy()  # the module's parameters are ordinary tensors again
    assert_same_state(engine.module.state_dict(), values, atol=0)
    engine.destroy()  # idempotent, as close()


def test_zero3_consolidated_16bit_state_dict_is_the_full_module_on_the_cpu():
    engine, _ = start(3)
    train_engine(engine, 0, 1, 0, 1)
    engine.module[2].bias.requires_grad_(False)
    consolidated = engine._zero3_consolidated_16bit_state_dict()
    assert all(value.device.type == "cpu" for value in consolidated.values())
    assert_same_state(consolidated, engine.module_state_dict(), atol=0)
    trainable = engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=True)
    assert sorted(trainable) == sorted(key for key in consolidated if key != "2.bias")
    engine.close()
    engine, _ = start(0)
    with pytest.raises(ValueError, match="needs zero_optimization.stage 3"):
        engine._zero3_consolidated_16bit_state_dict()
    engine.close()


def test_the_throughput_timer_counts_the_samples_of_the_steps_after_its_warm_up():
    engine, _ = start()
    timer = engine.tput_timer
    train_engine(engine, 0, 2, 0, 1)
    assert timer.avg_samples_per_sec() == float("-inf")  # 2 steps: the warm-up
    train_engine(engine, 2, 4, 0, 1)
    assert (timer.global_step_count, timer.micro_step_count) == (4, 4 * ACCUMULATION)
    assert timer.avg_samples_per_sec() > 0
    timer.update_epoch_count()
    assert (timer.epoch_count, timer.micro_step_count) == (1, 0)
    engine.close()
    # DeepSpeed's arithmetic, on a clock that advances 0.5 s a reading: after the warm-up
    # each micro-batch takes 0.5 s from start to stop, a step of two 1 s for 8 samples
    ticks = iter(range(100))
    timer = ThroughputTimer(8, clock=lambda: next(ticks) * 0.5)
    for step in range(5):
        for micro in range(ACCUMULATION):
            timer.start()
            timer.stop(global_step=micro == ACCUMULATION - 1)
    assert (timer.total_elapsed_time, timer.avg_samples_per_sec()) == (3.0, 8.0)
    config = ds_config()
    config["timers"] = {"throughput": {"enabled": False}}
    engine, _, _, _ = zoe.torch.initialize(model=make_model(), config=config)
    train_engine(engine, 0, 3, 0, 1)
    assert engine.tput_timer.global_step_count == 0
    engine.close()


# --- checkpoints and state dicts ------------------------------------------------------------


@pytest.mark.parametrize("stage", [0, 3])
def test_module_state_dict_takes_torchs_arguments(stage):
    engine, _ = start(stage)
    engine.module[0].bias.requires_grad_(False)
    full = module_values(engine)
    destination = collections.OrderedDict(kept=torch.zeros(1))
    state = engine.module_state_dict(destination=destination, prefix="m.")
    assert state is destination and list(state)[0] == "kept"
    assert_same_state({key[2:]: value for key, value in state.items() if key != "kept"}, full,
                      atol=0)
    trainable = engine.module_state_dict(exclude_frozen_parameters=True)
    assert sorted(trainable) == sorted(key for key in full if key != "0.bias")
    if stage == 0:  # at stage 3 the values are gathered copies: keep_vars does not apply
        assert isinstance(engine.module_state_dict(keep_vars=True)["0.weight"],
                          torch.nn.Parameter)
    engine.close()


def frozen_bias(model):
    model[2].bias.requires_grad_(False)
    return model


@pytest.mark.parametrize("stage,how", [(0, {}), (2, {}), (3, {"load_module_only": True})])
def test_exclude_frozen_parameters_leaves_them_out_of_the_checkpoint(stage, how, nvme_dir):
    """Saved without the frozen parameters, a checkpoint is refused by a strict load and a
    lax one keeps the module's own values of them. (At stage 3 a load with the optimizer
    restores them: its checkpoint holds every parameter's master weights.)"""
    ckpt = os.path.join(nvme_dir, "ckpt")
    saving, _ = start(stage, model=frozen_bias(make_model()))
    train_engine(saving, 0, 1, 0, 1)
    saved = module_values(saving)
    saving.save_checkpoint(ckpt, exclude_frozen_parameters=True)
    saving.close()
    assert "2.bias" not in _load_saved(os.path.join(ckpt, "global_step1",
                                                    "model_states.pt"))["module"]
    loading, _ = start(stage, model=frozen_bias(make_model(seed=1)))
    own_bias = loading.module_state_dict()["2.bias"].clone()
    with pytest.raises(RuntimeError, match='Missing key.*"2.bias"'):
        loading.load_checkpoint(ckpt, **how)
    loading.load_checkpoint(ckpt, load_module_strict=False, **how)
    loaded = loading.module_state_dict()
    torch.testing.assert_close(loaded.pop("2.bias"), own_bias, rtol=0, atol=0)
    assert_same_state(loaded, {key: value for key, value in saved.items() if key != "2.bias"},
                      atol=0)
    if stage == 3:
        loading.load_checkpoint(ckpt, load_module_strict=False)
        assert_same_state(loading.module_state_dict(), saved, atol=0)
    loading.close()


@pytest.mark.parametrize("stage", [0, 3])
def test_custom_load_fn_loads_the_module_instead_of_load_state_dict(stage, nvme_dir):
    ckpt = os.path.join(nvme_dir, "ckpt")
    saving, _ = start(stage)
    saving.save_checkpoint(ckpt)
    saved = module_values(saving)
    saving.close()
    loading, _ = start(stage, model=make_model(seed=1))
    before = module_values(loading)
    calls = []

    def load_first_layer_doubled(src, dst):
        calls.append(sorted(src))
        dst[0].weight.data.copy_(src["0.weight"] * 2)

    loading.load_checkpoint(ckpt, load_module_only=True, custom_load_fn=load_first_layer_doubled)
    assert calls == [sorted(saved)]
    loaded = loading.module_state_dict()
    torch.testing.assert_close(loaded.pop("0.weight"), saved["0.weight"] * 2)
    assert_same_state(loaded, {key: value for key, value in before.items() if key != "0.weight"},
                      atol=0)
    loading.close()


# --- load_module_only and load_optimizer_states=False ---------------------------------------


def warm_start_reference(saved, scheduler_state, steps_before, world=1):
    """The plain torch loop of a warm start: make_model(seed=1) steps ``steps_before`` steps,
    then loads ``saved`` (and the schedule's ``scheduler_state`` unless None) and steps to
    STEPS, its optimizer keeping its moments."""
    model = make_model(seed=1)
    optimizer, schedule = torch_loop(model)
    torch_steps(model, optimizer, schedule, 0, steps_before, world)
    model.load_state_dict(saved)
    if scheduler_state is not None:
        schedule.load_state_dict(scheduler_state)
    torch_steps(model, optimizer, schedule, steps_before, STEPS, world)
    return copy.deepcopy(model.state_dict())


def warm_start(stage, offload_param, how, steps_before, directory, rank=0, world=1):
    """A checkpoint (in ``directory``/ckpt) of STEPS // 2 steps from make_model(); an engine
    over make_model(seed=1) that steps ``steps_before`` steps, loads it as ``how`` says and
    trains on to STEPS. Returns (what the load gave the module, the final parameters, the
    saved parameters, the saved schedule's state)."""
    config = ds_config(stage, "cpu" if stage else "none", os.path.join(directory, "swap"),
                       world, offload_param)
    engine, _, _, scheduler = zoe.torch.initialize(model=make_model(), config=config)
    train_engine(engine, 0, STEPS // 2, rank, world)
    saved, scheduler_state = module_values(engine), scheduler.state_dict()
    engine.save_checkpoint(os.path.join(directory, "ckpt"))
    engine.close()
    engine, _, _, _ = zoe.torch.initialize(model=make_model(seed=1), config=config)
    train_engine(engine, 0, steps_before, rank, world)
    engine.load_checkpoint(os.path.join(directory, "ckpt"), **how)
    loaded = module_values(engine)
    train_engine(engine, steps_before, STEPS, rank, world)
    final = module_values(engine)
    engine.close()
    return loaded, final, saved, scheduler_state


HOWS = {"module-only": {"load_module_only": True},
        "no-optimizer": {"load_optimizer_states": False}}


@pytest.mark.parametrize("how", sorted(HOWS))
@pytest.mark.parametrize("steps_before", [0, 1], ids=["fresh", "stepped"])
@pytest.mark.parametrize("stage,offload_param", [(0, None), (2, None), (3, "cpu"), (3, "nvme")])
def test_a_warm_start_loads_the_saved_parameters_and_keeps_the_moments(
        stage, offload_param, steps_before, how, nvme_dir):
    """DeepSpeed's load_module_only / load_optimizer_states=False: the module takes the saved
    parameters (at stage 3 the paged ones), the optimizer's master weights follow, its moments
    stay: as a torch loop that loads the model's state dict and goes on."""
    loaded, final, saved, scheduler_state = warm_start(
        stage, offload_param, HOWS[how], steps_before, nvme_dir)
    assert_same_state(loaded, saved, atol=0)
    with_schedule = None if how == "module-only" else scheduler_state
    assert_same_state(final, warm_start_reference(saved, with_schedule, steps_before))


def test_a_bf16_warm_start_at_stage_3_loads_the_16bit_parameters(nvme_dir):
    """Under bf16 the checkpoint's module holds the 16-bit parameters, and the master weights
    follow them (as DeepSpeed restores its fp32 weights from the 16-bit ones)."""
    config = config_at(3, offload_param="cpu")
    config["bf16"] = {"enabled": True}
    ckpt = os.path.join(nvme_dir, "ckpt")
    engines = []
    for seed in (0, 1):
        engine, _, _, _ = zoe.torch.initialize(model=make_model(seed), config=config)
        for _ in range(ACCUMULATION):
            engine.backward(engine(torch.randn(MICRO, 8).bfloat16()).float().pow(2).mean())
            engine.step()
        engines.append(engine)
    engines[0].save_checkpoint(ckpt)
    saved = module_values(engines[0])
    engines[0].close()
    stepped = module_values(engines[1])
    engines[1].load_checkpoint(ckpt, load_module_only=True)
    assert_same_state(module_values(engines[1]), saved, atol=0)
    engines[1].set_gradient_accumulation_boundary(True)
    engines[1].backward(engines[1](torch.randn(MICRO, 8).bfloat16()).float().pow(2).mean())
    engines[1].step()
    after = module_values(engines[1])
    for key in saved:  # one small step from the loaded values, none from its own
        assert (after[key].float() - saved[key].float()).abs().max() < 0.05
        assert (after[key].float() - stepped[key].float()).abs().max() > 0.05
    engines[1].close()


# --- the training_data loader -----------------------------------------------------------------


def test_training_data_is_shuffled_as_deepspeeds_loader_shuffles_it():
    data = torch.utils.data.TensorDataset(torch.arange(20.0).unsqueeze(1))
    engine, _, loader, _ = zoe.torch.initialize(model=make_model(), config=ds_config(),
                                                training_data=data)
    assert engine.training_dataloader is loader
    # DeepSpeed's: a DistributedSampler (seed 0) over the data-parallel ranks, even one
    order = torch.randperm(20, generator=torch.Generator().manual_seed(0)).tolist()
    epoch = [int(x) for (batch,) in loader for x in batch.view(-1)]
    assert epoch == order != sorted(order)
    assert [len(batch) for (batch,) in loader] == [MICRO] * 5
    assert [int(x) for (batch,) in loader for x in batch.view(-1)] == order  # every epoch
    loader.data_sampler.set_epoch(1)
    assert [int(x) for (batch,) in loader for x in batch.view(-1)] != order
    engine.close()


# --- on 2 ranks ---------------------------------------------------------------------------------


def rank_worker(rank, out_dir, world):
    with gloo_rank(rank, world, f"{out_dir}/init", out_dir):
        results = {}
        for stage in (0, 2, 3):
            engine, _, _, _ = zoe.torch.initialize(
                model=make_model(), config=config_at(stage, "cpu", "cpu", world))
            results[f"accelerate{stage}"] = (accelerate_steps(engine, 0, STEPS, rank, world),
                                             engine.module_state_dict())
            assert engine.dp_world_size == world and engine.global_rank == rank
            results[f"consolidated{stage}"] = (
                engine._zero3_consolidated_16bit_state_dict() if stage == 3 else None)
            engine.close()
        results["warm"] = warm_start(3, "nvme", HOWS["module-only"], 1, out_dir, rank, world)
        data = torch.utils.data.TensorDataset(torch.arange(20.0).unsqueeze(1))
        engine, _, loader, _ = zoe.torch.initialize(
            model=make_model(), config=config_at(0, world=world), training_data=data)
        results["loader"] = [int(x) for (batch,) in loader for x in batch.view(-1)]
        engine.close()
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def test_on_two_ranks(nvme_dir):
    """accelerate's loop at stages 0, 2 (the stage 2 reductions held until its boundary) and 3
    equals the plain loop; a stage 3 warm start loads each rank's shards; the loader gives
    each rank its share of DeepSpeed's order; the consolidated state dict is rank 0's."""
    world = 2
    spawn_ranks(rank_worker, (nvme_dir, world), world, nvme_dir, JOIN_SECONDS)
    results = [torch.load(os.path.join(nvme_dir, f"rank{rank}.pt")) for rank in range(world)]
    expected = reference(world)
    for result in results:
        for stage in (0, 2, 3):
            changes, state = result[f"accelerate{stage}"]
            assert_changed_where_it_should(changes)
            assert_same_state(state, expected)
    assert_same_state(results[0]["consolidated3"], results[0]["accelerate3"][1], atol=0)
    assert results[1]["consolidated3"] is None
    loaded, final, saved, _ = results[0]["warm"]
    assert_same_state(loaded, saved, atol=0)
    assert_same_state(final, warm_start_reference(saved, None, 1, world))
    assert_same_state(results[1]["warm"][1], final, atol=0)
    order = torch.randperm(20, generator=torch.Generator().manual_seed(0)).tolist()
    assert [result["loader"] for result in results] == [order[0::2], order[1::2]]
