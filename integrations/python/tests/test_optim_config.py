"""Where a zoe.torch optimizer's settings come from: the engine configuration's zoe.moment_dtype
reaches the groups unless the optimizer names its own; an optimizer argument that contradicts a
value its config sets is refused, naming both; engine= excludes config, offload and nvme_path;
the statistics say which moment dtype and master each group has."""

import json

import pytest
import torch

import zoe
import zoe.torch
from conftest import small_config


def model():
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 8)
    for param in layer.parameters():
        param.grad = torch.randn_like(param)
    return layer


def group_stats(optimizer):
    return optimizer.engine.stats()["groups"][0]


@pytest.mark.parametrize("moment_dtype", ["bf16", "int8"])
def test_the_configs_moment_dtype_reaches_the_group(moment_dtype):
    optimizer = zoe.torch.AdamW(model().parameters(),
                                config=small_config(moment_dtype=moment_dtype))
    optimizer.step()
    assert group_stats(optimizer)["moment_dtype"] == moment_dtype
    optimizer.close()


def test_an_engines_moment_dtype_is_the_default_and_an_argument_is_the_groups_own():
    with zoe.Engine(small_config(moment_dtype="int8")) as engine:
        configured = zoe.torch.AdamW(model().parameters(), engine=engine, name="configured")
        own = zoe.torch.AdamW(model().parameters(), engine=engine, name="own",
                              moment_dtype="bf16")
        configured.step()
        own.step()
        dtypes = {group["name"]: group["moment_dtype"] for group in engine.stats()["groups"]}
        assert dtypes == {"configured.0": "int8", "own.0": "bf16"}


def test_no_moment_dtype_anywhere_is_fp32():
    optimizer = zoe.torch.AdamW(model().parameters())
    optimizer.step()
    assert group_stats(optimizer)["moment_dtype"] == "fp32"
    optimizer.close()


def test_a_moment_dtype_that_contradicts_the_config_is_refused():
    with pytest.raises(zoe.InvalidArgument,
                       match="moment_dtype = 'bf16' contradicts the config's zoe.moment_dtype = "
                             "'int8'"):
        zoe.torch.AdamW(model().parameters(), config=small_config(moment_dtype="int8"),
                        moment_dtype="bf16")
    agreeing = zoe.torch.AdamW(model().parameters(), config=small_config(moment_dtype="int8"),
                               moment_dtype="int8")
    agreeing.step()
    assert group_stats(agreeing)["moment_dtype"] == "int8"
    agreeing.close()


def config_with(**top_level):
    document = small_config()
    document.update(top_level)
    return document


def test_clipping_that_contradicts_the_config_is_refused_and_auto_takes_the_argument():
    with pytest.raises(zoe.InvalidArgument,
                       match="max_grad_norm = 0.5 contradicts the config's gradient_clipping = "
                             "1.0"):
        zoe.torch.AdamW(model().parameters(), config=config_with(gradient_clipping=1.0),
                        max_grad_norm=0.5)
    unclipped = first_moment(zoe.torch.AdamW(model().parameters()))
    for clipping in (1e-3, "auto"):  # agreeing, and "auto": both clip at the argument's 1e-3
        clipped = first_moment(zoe.torch.AdamW(model().parameters(),
                                               config=config_with(gradient_clipping=clipping),
                                               max_grad_norm=1e-3))
        assert clipped.abs().max() < unclipped.abs().max() / 100


def test_clipping_set_only_in_the_config_clips():
    # Gradients of norm far above 1e-3: a clipped step moves every parameter by about lr, as
    # Adam does, whatever the scale; what shows the clipping is the reported norm and the state.
    layer = model()
    optimizer = zoe.torch.AdamW(layer.parameters(), config=config_with(gradient_clipping=1e-3))
    optimizer.step()
    clipped = optimizer.state_dict()["state"][0]["exp_avg"].clone()
    optimizer.close()
    layer = model()
    unclipped_optimizer = zoe.torch.AdamW(layer.parameters())
    unclipped_optimizer.step()
    unclipped = unclipped_optimizer.state_dict()["state"][0]["exp_avg"]
    unclipped_optimizer.close()
    norm = torch.cat([p.grad.flatten() for p in model().parameters()]).norm().item()
    assert torch.allclose(clipped, unclipped * (1e-3 / norm), rtol=1e-4, atol=0)


def test_hyper_parameters_set_in_the_config_must_match_the_optimizers():
    document = small_config()
    document["optimizer"] = {"type": "AdamW", "params": {"lr": 5e-5, "betas": [0.9, 0.95]}}
    with pytest.raises(zoe.InvalidArgument,
                       match=r"lr = 0.001 \(passed, or the optimizer's default\) contradicts the "
                             r"config's optimizer.params.lr = 5e-05"):
        zoe.torch.AdamW(model().parameters(), config=document, betas=(0.9, 0.95))
    with pytest.raises(zoe.InvalidArgument, match="optimizer.params.betas"):
        zoe.torch.AdamW(model().parameters(), config=document, lr=5e-5)
    optimizer = zoe.torch.AdamW(model().parameters(), config=document, lr=5e-5,
                                betas=(0.9, 0.95))
    optimizer.step()
    assert group_stats(optimizer)["hyper"]["lr"] == 5e-5
    optimizer.close()


@pytest.mark.parametrize("extra", [{"config": small_config()}, {"offload": "nvme"},
                                   {"nvme_path": "/var/tmp"}])
def test_engine_excludes_config_offload_and_nvme_path(extra):
    with zoe.Engine(small_config()) as engine:
        with pytest.raises(zoe.InvalidArgument, match="engine= comes with its own configuration"):
            zoe.torch.AdamW(model().parameters(), engine=engine, **extra)


def test_config_and_offload_together_are_refused():
    with pytest.raises(zoe.InvalidArgument, match="either config"):
        zoe.torch.AdamW(model().parameters(), config=json.dumps(small_config()), offload="cpu")


def test_the_statistics_name_the_master():
    zero_copy = zoe.torch.AdamW(model().parameters())
    copy = zoe.torch.AdamW(model().parameters(), zero_copy=False)
    for optimizer in (zero_copy, copy):
        optimizer.step()
    assert group_stats(zero_copy)["master"] == "params"
    assert group_stats(copy)["master"] == "zoe"
    zero_copy.close()
    copy.close()


# ---- more arguments that would otherwise be dropped or overridden ------------------------------

def test_an_nvme_path_implies_nvme_and_refuses_cpu(nvme_dir):
    optimizer = zoe.torch.AdamW(model().parameters(), nvme_path=nvme_dir)
    optimizer.step()
    assert group_stats(optimizer)["placement"] == "nvme"
    optimizer.close()
    with pytest.raises(zoe.InvalidArgument, match="nvme_path = .* with offload='cpu'"):
        zoe.torch.AdamW(model().parameters(), offload="cpu", nvme_path=nvme_dir)
    with pytest.raises(zoe.InvalidArgument, match="with offload='cpu'"):
        zoe.torch.engine_config("cpu", nvme_path=nvme_dir)


def first_moment(optimizer):
    optimizer.step()
    moment = optimizer.state_dict()["state"][0]["exp_avg"].clone()
    optimizer.close()
    return moment


def test_max_grad_norm_zero_is_no_clipping_not_the_engines():
    unclipped = first_moment(zoe.torch.AdamW(model().parameters()))
    with zoe.Engine(config_with(gradient_clipping=1e-3)) as engine:
        clipped = first_moment(zoe.torch.AdamW(model().parameters(), engine=engine, name="a"))
        explicit = first_moment(zoe.torch.AdamW(model().parameters(), engine=engine, name="b",
                                                max_grad_norm=0.0))
    assert torch.equal(explicit, unclipped)
    assert clipped.abs().max() < unclipped.abs().max() / 100
    with pytest.raises(zoe.InvalidArgument, match="max_grad_norm = 0.0 contradicts"):
        zoe.torch.AdamW(model().parameters(), config=config_with(gradient_clipping=1e-3),
                        max_grad_norm=0.0)
    with pytest.raises(ValueError, match="max_grad_norm"):
        zoe.torch.AdamW(model().parameters(), max_grad_norm=-1.0)


@pytest.mark.parametrize("zoe_class, optimizer_section", [
    (zoe.torch.AdamW, {"type": "Adagrad"}),
    (zoe.torch.AdamW, {"type": "Adam", "params": {"adam_w_mode": False}}),
    (zoe.torch.Adam, {"type": "Adam"}),  # DeepSpeed's "Adam" is AdamW unless adam_w_mode: false
])
def test_an_optimizer_type_that_contradicts_the_config_is_refused(zoe_class, optimizer_section):
    document = small_config()
    document["optimizer"] = optimizer_section
    with pytest.raises(zoe.InvalidArgument, match=f"zoe.torch.{zoe_class.__name__} contradicts "
                                                  "the config's optimizer.type"):
        zoe_class(model().parameters(), config=document, weight_decay=0.0)


@pytest.mark.parametrize("zoe_class, type_name", [(zoe.torch.AdamW, "AdamW"),
                                                  (zoe.torch.AdamW, "Adam"),
                                                  (zoe.torch.Adam, "adam_l2")])
def test_a_matching_optimizer_type_is_accepted(zoe_class, type_name):
    document = small_config()
    document["optimizer"] = {"type": type_name}
    if type_name == "adam_l2":
        document["optimizer"] = {"type": "Adam", "params": {"adam_w_mode": False}}
    optimizer = zoe_class(model().parameters(), config=document)
    optimizer.step()
    assert group_stats(optimizer)["type"] == zoe_class.__name__.lower()
    optimizer.close()


@pytest.mark.parametrize("extra", [{"amsgrad": True}, {"maximize": True},
                                   {"differentiable": True}, {"moment_dtype": "bf16"},
                                   {"max_grad_norm": 1.0}])
def test_a_param_group_asking_for_what_the_step_does_not_do_is_refused(extra):
    layer = model()
    optimizer = zoe.torch.AdamW([layer.weight])
    with pytest.raises(zoe.InvalidArgument, match=f"param group 1 sets .*{next(iter(extra))}"):
        optimizer.add_param_group({"params": [layer.bias], **extra})
    assert len(optimizer.param_groups) == 1
    optimizer.close()


@pytest.mark.parametrize("flags", [{"maximize": True}, {"amsgrad": True}])
def test_a_state_dict_asking_for_what_the_step_does_not_do_is_refused_and_changes_nothing(flags):
    layer = model()
    torch_opt = torch.optim.AdamW(layer.parameters(), lr=0.5, **flags)
    torch_opt.step()
    optimizer = zoe.torch.AdamW(model().parameters())
    with pytest.raises(zoe.InvalidArgument, match=f"sets {next(iter(flags))} = True"):
        optimizer.load_state_dict(torch_opt.state_dict())
    state = torch_opt.state_dict()
    state["param_groups"][0].update(amsgrad=False, maximize=False)
    if "amsgrad" in flags:
        with pytest.raises(zoe.InvalidArgument, match="max_exp_avg_sq"):
            optimizer.load_state_dict(state)
    assert optimizer.param_groups[0]["lr"] == 1e-3  # the refused state dicts changed nothing
    assert not optimizer.param_groups[0]["maximize"]
    optimizer.close()


def test_a_flag_set_on_a_param_group_after_construction_is_refused_at_step():
    optimizer = zoe.torch.AdamW(model().parameters())
    optimizer.param_groups[0]["maximize"] = True
    with pytest.raises(zoe.InvalidArgument, match="param group 0 sets maximize = True"):
        optimizer.step()
    optimizer.close()


@pytest.mark.parametrize("zoe_class, decoupled", [(zoe.torch.Adam, True),
                                                  (zoe.torch.AdamW, False)])
def test_a_decoupled_weight_decay_naming_the_other_class_is_refused(zoe_class, decoupled):
    layer = model()
    optimizer = zoe_class([layer.weight])
    with pytest.raises(zoe.InvalidArgument, match="decoupled_weight_decay"):
        optimizer.add_param_group({"params": [layer.bias], "decoupled_weight_decay": decoupled})
    optimizer.add_param_group({"params": [layer.bias],
                               "decoupled_weight_decay": not decoupled})
    optimizer.close()


def test_numbers_agree_with_the_config_to_rounding():
    import numpy

    document = small_config()
    document["optimizer"] = {"type": "AdamW", "params": {"lr": 3e-5, "weight_decay": 0.01}}
    optimizer = zoe.torch.AdamW(model().parameters(), config=document, lr=numpy.float32(3e-5))
    optimizer.close()
    with pytest.raises(zoe.InvalidArgument, match="lr = 0.0003"):
        zoe.torch.AdamW(model().parameters(), config=document, lr=3e-4)


@pytest.mark.parametrize("extra", [{"zero_copy": True}, {"speculative": True},
                                   {"bucket_elements": -5}])
def test_the_sharded_optimizer_refuses_options_it_would_ignore(extra):
    with pytest.raises(zoe.InvalidArgument, match=next(iter(extra))):
        zoe.torch.AdamW(model().parameters(), zero_stage=1, **extra)


def test_speculation_without_a_device_group_is_refused():
    with pytest.raises(zoe.InvalidArgument, match="speculative=True applies to param groups "
                                                  "stepped on a device"):
        zoe.torch.AdamW(model().parameters(), speculative=True)
    twin = zoe.torch.AdamW(model().parameters(), speculative=True,
                           device_backend=zoe.torch.HostTwin())
    twin.close()


@pytest.mark.parametrize("extra", [{"prefetch_depth": 3}, {"bucket_elements": 1024},
                                   {"max_live_parameters": 10**6},
                                   {"max_reuse_distance": 10**6}])
def test_stage_3_options_without_a_process_group_are_refused(extra):
    with zoe.Engine(small_config()) as engine:
        with pytest.raises(zoe.InvalidArgument, match=f"{next(iter(extra))} = .* applies to ZeRO "
                                                      "stage 3"):
            zoe.torch.offload_parameters(torch.nn.Linear(4, 4), engine, **extra)


def test_a_swap_size_the_config_sets_is_kept_beside_device_groups():
    document = small_config()
    document["zoe"]["tensor_swap_bytes"] = "96M"
    optimizer = zoe.torch.AdamW(model().parameters(), config=document,
                                device_backend=zoe.torch.HostTwin())
    assert optimizer.engine.config["zoe"]["tensor_swap_bytes"] == 96 << 20
    optimizer.close()
    document["zoe"]["tensor_swap_bytes"] = "4K"  # too small for the staging: said so, with sizes
    layer = torch.nn.Linear(256, 256)
    small = zoe.torch.AdamW(layer.parameters(), config=document,
                            device_backend=zoe.torch.HostTwin())
    for param in layer.parameters():
        param.grad = torch.randn_like(param)
    with pytest.raises(zoe.NoSpace, match="needs 589824 bytes of NVMe swap space.*"
                                          "zoe.tensor_swap_bytes"):
        small.step()
    small.close()


@pytest.mark.parametrize("flag", ["amsgrad", "maximize", "capturable"])
def test_the_constructor_refuses_what_the_step_does_not_do(flag):
    with pytest.raises(zoe.InvalidArgument, match=f"the optimizer sets {flag} = True"):
        zoe.torch.AdamW(model().parameters(), **{flag: True})
