"""zoe.torch.zero_init from a DeepSpeed configuration, then zoe.torch.initialize with it, as
DeepSpeed's ``with deepspeed.zero.Init(config_dict_or_path=ds_config): model = build()`` and
``deepspeed.initialize(model=model, config=ds_config)``: the model is built paged into the
engine initialize then takes (never whole in DRAM), in the configuration's dtype and, over
ranks, sharded; it trains exactly as the same model built normally. What cannot compose is
refused naming the fix (initialize used to refuse every zero_init model: it paged into an
engine initialize could not take)."""

import json
import os

import pytest
import torch

import zoe
import zoe.torch
from conftest import gloo_rank, spawn_ranks

WORLD = 2
JOIN_SECONDS = 180


class Net(torch.nn.Module):
    """Initialised at the end of its constructor by Module.apply, as Hugging Face's models."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        self.norm = torch.nn.LayerNorm(8)
        self.apply(self._init)

    @staticmethod
    def _init(module):
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=0.2)
            torch.nn.init.zeros_(module.bias)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.norm(x)


def config(nvme_dir, precision=None, stage=3, world=1):
    document = {
        "train_batch_size": 4 * world,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage,
                              "offload_param": {"device": "nvme", "nvme_path": nvme_dir},
                              "offload_optimizer": {"device": "cpu"}},
        "zoe": {"device": "host", "chunk_size": "64K", "host_budget": "64M",
                "tensor_swap_bytes": "4M", "log_level": "error"},
    }
    if precision is not None:
        document[precision] = {"enabled": True}
    return document


def train(engine, rank=0, steps=3):
    dtype = next(iter(engine.module_state_dict().values())).dtype
    generator = torch.Generator().manual_seed(7)
    for _ in range(steps * 2):
        x = torch.randn(2 * WORLD, 8, generator=generator)[2 * rank:2 * rank + 2]
        engine.backward(engine(x.to(dtype)).float().square().mean())
        engine.step()
    return {key: value.clone() for key, value in engine.module_state_dict().items()}


def built_normally(document):
    torch.manual_seed(0)
    engine, _, _, _ = zoe.torch.initialize(model=Net(), config=document)
    try:
        return train(engine)
    finally:
        engine.close()


@pytest.mark.parametrize("precision", [None, "bf16"])
def test_a_model_built_paged_trains_as_one_built_whole(nvme_dir, precision):
    document = config(nvme_dir, precision)
    path = os.path.join(nvme_dir, "ds_config.json")
    with open(path, "w") as file:
        json.dump(document, file)
    torch.manual_seed(0)
    with zoe.torch.zero_init(config_dict_or_path=path) as construction:
        model = Net()
    assert construction.parameters == 8 and construction.registered == 8
    dtype = torch.bfloat16 if precision else torch.float32
    # paged in the configuration's dtype, as placeholders: never whole in DRAM
    assert all(param.dtype == dtype and param.stride() == (0,) * param.dim()
               for param in model.parameters())
    engine, _, _, _ = zoe.torch.initialize(model=model, config=path)
    try:
        assert engine._stage3.engine is construction.engine  # taken, with the model
        found = train(engine)
    finally:
        engine.close()
    expected = built_normally(document)
    assert found.keys() == expected.keys()
    for key in expected:
        assert torch.equal(found[key], expected[key]), key


def ranks_build_paged(rank, out_dir):
    with gloo_rank(rank, WORLD, f"{out_dir}/init", out_dir):
        document = config(os.path.join(out_dir, "nvme"), world=WORLD)
        torch.manual_seed(0)
        with zoe.torch.zero_init(document) as construction:  # a config in place of the engine
            model = Net()
        assert construction.sharding.world_size == WORLD
        engine, _, _, _ = zoe.torch.initialize(model=model, config=document)
        found = train(engine, rank)
        engine.close()
        torch.manual_seed(0)
        engine, _, _, _ = zoe.torch.initialize(model=Net(), config=document)
        expected = train(engine, rank)
        engine.close()
        for key in expected:
            assert torch.equal(found[key], expected[key]), key


def test_ranks_build_their_shards_paged_and_train_as_built_whole(tmp_path):
    spawn_ranks(ranks_build_paged, (str(tmp_path),), WORLD, str(tmp_path), JOIN_SECONDS)


def test_what_cannot_compose_is_refused(nvme_dir):
    document = config(nvme_dir)
    with pytest.raises(zoe.InvalidArgument, match="zero_init.config=.... builds a model paged for "
                                                  "ZeRO stage 3; the configuration's "
                                                  "zero_optimization.stage is 2"):
        with zoe.torch.zero_init(config=config(nvme_dir, stage=2)):
            pass
    with pytest.raises(zoe.InvalidArgument, match="takes one of: a zoe.Engine, or a DeepSpeed "
                                                  "configuration"):
        with zoe.torch.zero_init():
            pass
    with zoe.torch.zero_init(config=document):
        model = Net()
    other = dict(document, gradient_clipping=0.5)
    with pytest.raises(zoe.InvalidArgument, match="with another DeepSpeed configuration than "
                                                  "initialize's: give both the same one"):
        zoe.torch.initialize(model=model, config=other)
    with pytest.raises(zoe.InvalidArgument, match="built inside zoe.torch.zero_init, which pages "
                                                  "its parameters for ZeRO stage 3, and the "
                                                  "configuration's zero_optimization.stage is 1"):
        zoe.torch.initialize(model=model, config=config(nvme_dir, stage=1))
    engine, _, _, _ = zoe.torch.initialize(model=model, config=document)  # the right one
    engine.close()
    with zoe.Engine(document) as own:
        with zoe.torch.zero_init(own):
            model = Net()
        with pytest.raises(zoe.InvalidArgument, match="into an engine of your own.* build the "
                                                      "model inside "
                                                      r"zoe.torch.zero_init\(config="):
            zoe.torch.initialize(model=model, config=document)
