"""The engine zoe.torch.initialize returns, against DeepSpeed's engine API (deepspeed/runtime/
engine.py): an nn.Module over the model with its attributes falling through to it, and the
accessors scripts read."""

import pytest
import torch

import zoe.torch
from initialize_script import (ACCUMULATION, CLIP, LR, MICRO, assert_same_state, ds_config,
                               make_model, module_values, train_engine)

def config_at(stage, offload="cpu", offload_param=None, world=1):
    return ds_config(stage, offload if stage else "none", None, world,
                     offload_param if stage == 3 else None)


def start(stage=0, model=None, world=1, **kwargs):
    """(engine, scheduler) over ``model`` (make_model()) at ``stage``."""
    model = make_model() if model is None else model
    engine, _, _, scheduler = zoe.torch.initialize(
        model=model, config=config_at(stage, offload_param="cpu", world=world), **kwargs)
    return engine, scheduler


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
    assert engine.get_mom() == [(0.9, 0.999)] and engine.get_lr() == [LR]
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
