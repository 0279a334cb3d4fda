"""DeepSpeed's optimizer.params.torch_adam through zoe.torch.initialize: the params left out take
torch's defaults, as DeepSpeed then builds torch.optim.AdamW or Adam."""

import pytest
import torch

import zoe.torch
from initialize_script import ACCUMULATION, MICRO, ds_config, make_model


def initialize(config, model=None):
    engine, optimizer, _, scheduler = zoe.torch.initialize(model=model or make_model(),
                                                           config=config)
    return engine, optimizer, scheduler


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
