"""Real DeepSpeed configurations through zoe.torch.initialize: accelerate's steps_per_print
float("inf") and DeepSpeed-Chat's stage 2 offload config are accepted as DeepSpeed accepts them;
switches of DeepSpeed features zoe does not implement are refused when on and accepted when off;
the engine's "ignored" line names no key zoe honours; torch_adam takes torch's defaults;
sub_group_size larger than any group is one sub-group; offload_param below stage 3 is a warning;
"auto" where nothing can fill it, strings and non-finite numbers where a number is needed are
refused naming the key."""

import json
import math

import pytest
import torch

import zoe
import zoe.torch
from initialize_script import ACCUMULATION, MICRO, ds_config, make_model, train_engine
from zoe.torch.ds_config import training_config
from zoe.torch.loss_scaler import loss_scaler_for


def initialize(config, model=None):
    engine, optimizer, _, scheduler = zoe.torch.initialize(model=model or make_model(),
                                                           config=config)
    return engine, optimizer, scheduler


def refused(config, match):
    with pytest.raises(zoe.InvalidArgument, match=match):
        engine, _, _ = initialize(config)
        engine.close()


def parameters(engine):
    """The module's full values (at stage 3 gathered: its parameters are placeholders)."""
    return [value.clone() for value in engine.module_state_dict().values()]


# accelerate's DeepSpeedPlugin writes steps_per_print float("inf") into every configuration.
@pytest.mark.parametrize("as_text", [False, True])
def test_accelerates_infinite_steps_per_print_is_accepted(as_text):
    config = ds_config(stage=1, offload="cpu")
    config["steps_per_print"] = float("inf")
    if as_text:  # json.dumps writes Infinity, as a file written by Python holds it
        config = json.dumps(config)
        assert "Infinity" in config
    engine, _, _ = initialize(config)
    train_engine(engine, 0, 1, 0, 1)
    assert engine.global_steps == 1
    engine.close()


# accelerate's DeepSpeedPlugin writes the offload sections with an Optional path as null, and
# DeepSpeed's models take "auto" anywhere in their sections as the key's default.
def test_accelerates_null_paths_and_auto_in_offload_sections_are_defaults():
    config = ds_config(stage=2, offload="cpu")
    config["zero_optimization"]["offload_optimizer"].update(nvme_path=None, pin_memory="auto")
    config["zero_optimization"]["offload_param"] = {"device": "none", "nvme_path": None}
    engine, _, _ = initialize(config)
    train_engine(engine, 0, 1, 0, 1)
    assert engine.global_steps == 1
    engine.close()


@pytest.mark.parametrize("path,value,match", [
    ("gradient_clipping", math.inf, "gradient_clipping = inf is not allowed; allowed: a finite "
                                    "number"),
    ("optimizer.params.lr", math.nan, "optimizer.params.lr = nan is not allowed"),
    ("scheduler.params.warmup_max_lr", math.inf, "scheduler.params.warmup_max_lr = inf"),
    ("train_batch_size", math.inf, "train_batch_size = inf is not allowed"),
    ("zero_optimization.reduce_bucket_size", math.inf, "zero_optimization.reduce_bucket_size"),
])
def test_a_non_finite_number_where_zoe_needs_one_is_refused_naming_the_key(path, value, match):
    config = ds_config(stage=1, offload="cpu")
    section = config
    *sections, key = path.split(".")
    for name in sections:
        section = section[name]
    section[key] = value
    refused(config, match)


def test_fp16_settings_must_be_finite_numbers():
    config = ds_config()
    config["fp16"] = {"enabled": True, "initial_scale_power": math.inf}
    refused(config, "fp16.initial_scale_power = inf is not allowed")
    config["fp16"] = {"enabled": True, "loss_scale_window": "1e3"}  # pydantic's int takes "1000"
    refused(config, 'fp16.loss_scale_window = "1e3" is not allowed; allowed: an integer')


@pytest.mark.parametrize("section,match", [
    ({"amp": {"enabled": True, "opt_level": "O1"}},
     "amp.enabled = true: with it DeepSpeed trains with NVIDIA Apex's automatic mixed precision"),
    ({"elasticity": {"enabled": True, "max_train_batch_size": 64}},
     "set elasticity.enabled to false"),
    ({"curriculum_learning": {"enabled": True, "curriculum_type": "seqlen"}},
     "curriculum_learning.enabled = true: with it DeepSpeed passes the model's forward a "
     "curriculum_seqlen"),
    ({"data_efficiency": {"enabled": True}}, "random-LTD"),
    ({"compression_training": {"weight_quantization": {"shared_parameters": {"enabled": True}}}},
     "compression_training.weight_quantization.shared_parameters.enabled = true"),
    ({"progressive_layer_drop": {"enabled": True, "theta": 0.5, "gamma": 0.001}},
     "remove 'progressive_layer_drop' or set progressive_layer_drop.enabled to false"),
    ({"quantize_training": {"enabled": True}}, "MoQ"),
    ({"hybrid_engine": {"enabled": True}}, "generate with engine.module"),
    ({"fp16": {"enabled": True, "auto_cast": True}},
     "fp16.auto_cast = true: with it DeepSpeed casts the floating-point inputs"),
    ({"zero_optimization": {"stage": 1, "zero_quantized_gradients": True}}, "ZeRO\\+\\+ qgZ"),
])
def test_a_deepspeed_feature_zoe_does_not_implement_is_refused_when_on(section, match):
    config = ds_config()
    config.update(section)
    refused(config, match)


# DeepSpeed-Chat's get_train_ds_config(offload=True, dtype="bf16", stage=2): offload_param at
# stage 2 (DeepSpeed reads it only at stage 3), hybrid_engine and tensorboard switched off.
def deepspeed_chat_stage2_config():
    config = ds_config(stage=2, offload="cpu")
    config["zero_optimization"].update(
        offload_param={"device": "cpu"}, stage3_param_persistence_threshold=1e4,
        stage3_max_live_parameters=3e7, stage3_prefetch_bucket_size=3e7,
        memory_efficient_linear=False)
    config.update(
        steps_per_print=10, prescale_gradients=False, wall_clock_breakdown=False,
        hybrid_engine={"enabled": False, "max_out_tokens": 512, "inference_tp_size": 1,
                       "release_inference_cache": False, "pin_parameters": True,
                       "tp_gather_partition_size": 8},
        tensorboard={"enabled": False, "output_path": "/ds_tensorboard_logs/",
                     "job_name": "_tensorboard"})
    config["zoe"]["log_level"] = "info"
    return config


def test_deepspeed_chats_stage_2_offload_config_trains_as_without_offload_param(capfd):
    engine, _, _ = initialize(deepspeed_chat_stage2_config())
    train_engine(engine, 0, 2, 0, 1)
    found = parameters(engine)
    engine.close()
    log = capfd.readouterr().err
    assert "zero_optimization.offload_param.device = 'cpu' has no effect at " \
           "zero_optimization.stage 2" in log
    ignored = next(line for line in log.splitlines() if "ignored DeepSpeed keys:" in line)
    for key in ("hybrid_engine", "tensorboard", "steps_per_print",
                "zero_optimization.memory_efficient_linear"):
        assert key in ignored
    # The keys zoe.torch.initialize honours are not called ignored.
    for key in ("scheduler", "train_batch_size", "train_micro_batch_size_per_gpu",
                "stage3_max_live_parameters"):
        assert key not in ignored

    engine, _, _ = initialize(ds_config(stage=2, offload="cpu"))
    train_engine(engine, 0, 2, 0, 1)
    for a, b in zip(found, parameters(engine)):
        assert torch.equal(a, b)
    engine.close()


def test_deepspeed_keys_without_effect_are_accepted_and_typos_are_not():
    config = ds_config(stage=1, offload="cpu")
    config.update(vocabulary_size=50304, graph_harvesting=False, comet={"enabled": False},
                  eigenvalue={"enabled": True}, use_data_before_expert_parallelism=False,
                  seq_parallel_comm_data_type="fp32", nebula={"enabled": False},
                  bf16={"enabled": False, "immediate_grad_update": True})
    config["zero_optimization"]["zero_quantized_nontrainable_weights"] = False
    engine, _, _ = initialize(config)
    engine.close()
    config = ds_config()
    config["seq_parallel_communication_data_type"] = "fp32"
    refused(config, "unknown key 'seq_parallel_communication_data_type'; did you mean "
                    "'seq_parallel_comm_data_type'")


# Hugging Face's tests write sub_group_size 1e14: above the model's size, one sub-group.
@pytest.mark.parametrize("stage", [1, 3])
def test_a_sub_group_size_larger_than_the_model_is_one_sub_group(stage):
    config = ds_config(stage=stage, offload="cpu", offload_param="cpu" if stage == 3 else None)
    config["zero_optimization"]["sub_group_size"] = 1e14
    engine, _, _ = initialize(config)
    train_engine(engine, 0, 1, 0, 1)
    found = parameters(engine)
    engine.close()
    config["zero_optimization"]["sub_group_size"] = 1000  # the model's 212 parameters at once
    engine, _, _ = initialize(config)
    train_engine(engine, 0, 1, 0, 1)
    for a, b in zip(found, parameters(engine)):
        assert torch.equal(a, b)
    engine.close()


@pytest.mark.parametrize("kind,adam_w_mode,weight_decay", [
    ("AdamW", True, 0.01), ("Adam", True, 0.01), ("Adam", False, 0.0)])
def test_torch_adam_takes_torchs_defaults(kind, adam_w_mode, weight_decay):
    """DeepSpeed builds torch.optim.AdamW (weight_decay 0.01) or Adam (0) with torch_adam."""
    config = ds_config()
    del config["scheduler"]
    config["gradient_clipping"] = 0.0
    config["optimizer"] = {"type": kind, "params": {"torch_adam": True,
                                                    "adam_w_mode": adam_w_mode}}
    model = make_model()
    reference = make_model()
    torch_class = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    torch_optimizer = torch_class(reference.parameters())  # torch's defaults
    engine, optimizer, _ = initialize(config, model)
    assert optimizer.param_groups[0]["weight_decay"] == weight_decay
    # the engine's own configuration says the same (a C API group created without it takes it)
    assert optimizer.engine.config["optimizer"]["params"]["weight_decay"] == weight_decay
    for step in range(3):
        torch.manual_seed(step)
        x, y = torch.randn(MICRO, 8), torch.randn(MICRO, 4)
        for _ in range(ACCUMULATION):
            engine.backward(torch.nn.functional.mse_loss(engine(x), y))
            engine.step()
        loss = torch.nn.functional.mse_loss(reference(x), y)
        loss.backward()
        torch_optimizer.step()
        torch_optimizer.zero_grad()
    for a, b in zip(engine.module.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    engine.close()


def test_torch_adam_keeps_the_params_given():
    config = ds_config()
    config["optimizer"]["params"].update(torch_adam=True, weight_decay=0.0)
    engine, optimizer, _ = initialize(config)
    assert optimizer.param_groups[0]["weight_decay"] == 0.0
    engine.close()


@pytest.mark.parametrize("kind", ["WarmupDecayLR", "WarmupCosineLR"])
def test_total_num_steps_auto_or_missing_is_refused_naming_the_key(kind):
    config = ds_config()
    config["scheduler"] = {"type": kind, "params": {"total_num_steps": "auto",
                                                    "warmup_num_steps": "auto"}}
    refused(config, f'scheduler.params.total_num_steps = "auto": {kind} needs it, and "auto" is '
                    "Hugging Face's Trainer's to fill in")
    del config["scheduler"]["params"]["total_num_steps"]
    refused(config, f"scheduler.params.total_num_steps is missing; {kind} needs it")
    config["scheduler"]["params"]["total_num_steps"] = 100  # with a number it is accepted
    engine, _, scheduler = initialize(config)
    assert scheduler.total_num_steps == 100
    engine.close()


@pytest.mark.parametrize("stage,match", [
    ("auto", 'zero_optimization.stage = \'auto\' is not allowed; allowed: 0, 1, 2 or 3 \\("auto" '
             "is not a stage"),
    (True, "zero_optimization.stage = True is not allowed"),
    (4, "zero_optimization.stage = 4 is not allowed"),
])
def test_a_zero_stage_other_than_0_to_3_is_refused(stage, match):
    config = ds_config()
    config["zero_optimization"]["stage"] = stage
    refused(config, match)


@pytest.mark.parametrize("key,value,match", [
    ("lr", "1e-3", "optimizer.params.lr = '1e-3' is a string; allowed: a finite number, written "
                   "without quotes"),
    ("weight_decay", None, "optimizer.params.weight_decay = None is not allowed; allowed: a "
                           "finite number"),
    ("betas", ["0.9", 0.99], "optimizer.params.betas\\[0\\] = '0.9' is a string"),
    ("betas", 0.9, "optimizer.params.betas = 0.9 is not allowed; allowed: two finite numbers"),
    ("adam_w_mode", "false", "optimizer.params.adam_w_mode = 'false' is not allowed; allowed: "
                             "true or false"),
    ("torch_adam", 1, "optimizer.params.torch_adam = 1 is not allowed; allowed: true or false"),
])
def test_optimizer_params_of_the_wrong_type_are_refused_naming_the_key(key, value, match):
    config = ds_config()
    config["optimizer"]["params"][key] = value
    refused(config, match)


def test_schedule_params_of_the_wrong_type_are_refused_naming_the_key():
    config = ds_config()
    config["scheduler"]["params"]["warmup_num_steps"] = "100"
    refused(config, "scheduler.params.warmup_num_steps = '100' is a string")
    config = ds_config()
    config["scheduler"]["params"]["warmup_type"] = 1
    refused(config, "scheduler.params.warmup_type = 1 is not allowed; allowed: 'log' or 'linear'")


def test_another_schedules_params_are_not_checked_before_its_type_is_refused():
    config = ds_config()
    config["scheduler"] = {"type": "OneCycle", "params": {"cycle_momentum": True,
                                                          "cycle_min_lr": "auto"}}
    refused(config, "scheduler.type = 'OneCycle' is not supported")


def test_a_zoe_optimizer_refuses_a_hyper_parameter_that_is_no_number():
    params = make_model().parameters()
    with pytest.raises(zoe.InvalidArgument, match="lr = '1e-3' is a string"):
        zoe.torch.AdamW(params, lr="1e-3")
    with pytest.raises(zoe.InvalidArgument, match="betas\\[1\\] = inf is not allowed"):
        zoe.torch.AdamW(make_model().parameters(), betas=(0.9, math.inf))


# The table of docs/deepspeed-migration.md: the scale before each of 8 steps with overflows at
# x x x . . x . (DeepSpeed's sequences from runtime/fp16/loss_scaler.py and fused_optimizer.py,
# 0.17.1 on), which zoe follows at each stage.
@pytest.mark.parametrize("stage,keys,powers", [
    (2, {}, [16, 16, 15, 14, 14, 14, 13, 13]),  # ZeRO 1-3: the documented defaults
    (2, {"hysteresis": 1}, [16, 15, 14, 13, 13, 13, 12, 12]),
    (2, {"initial_scale_power": 32, "hysteresis": 1}, [32, 31, 30, 29, 29, 29, 28, 28]),
    (0, {}, [16, 15, 14, 13, 13, 13, 12, 12]),  # stage 0: no hysteresis
    (0, {"hysteresis": 2}, [16, 15, 14, 13, 13, 13, 12, 12]),  # not read at stage 0
])
def test_fp16_scale_sequences_are_deepspeeds_at_each_stage(stage, keys, powers):
    fp16 = training_config({"train_batch_size": 1, "zero_optimization": {"stage": stage},
                            "fp16": dict(enabled=True, **keys)}, 1).fp16
    scaler = loss_scaler_for(fp16)
    scales = [scaler.loss_scale]
    for overflow in (True, True, True, False, False, True, False):
        scaler.update(overflow)
        scales.append(scaler.loss_scale)
    assert scales == [2.0 ** power for power in powers]
