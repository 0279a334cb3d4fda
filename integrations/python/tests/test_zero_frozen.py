"""A param group holding a frozen parameter (requires_grad False), as scripts build them from
model.parameters() for a torch optimizer or as decay / no-decay groups, at ZeRO stages 1 and 2
over 2 ranks (torch.multiprocessing, gloo), through zoe.torch.initialize: stage 2 used to fail at
initialize (no gradient hook can be put on a frozen parameter). The frozen weight is unfrozen
half-way, and the run ends on every rank with the parameters of one process running the plain
torch loop over the whole batch with the same freezing: a frozen parameter is skipped as torch
skips it, and once unfrozen its gradients are reduced (at step(): it was given no hook) and
stepped."""

import os

import pytest
import torch

import zoe.torch
from conftest import gloo_rank, spawn_ranks
from initialize_script import ACCUMULATION, LR, ds_config, make_model, micro_batch, rows

WORLD = 2
STEPS = 4
UNFROZEN_AT = 2  # the optimizer step before which the frozen weight is unfrozen
DECAY = 0.1
JOIN_SECONDS = 60


def decay_groups(model):
    """Weights with weight decay, biases without; the first layer's weight frozen (and listed)."""
    model[0].weight.requires_grad_(False)
    return [{"params": [p for p in model.parameters() if p.dim() == 2], "weight_decay": DECAY},
            {"params": [p for p in model.parameters() if p.dim() == 1], "weight_decay": 0.0}]


def config(stage):
    document = ds_config(stage, "cpu", None, WORLD)
    del document["scheduler"]
    document["gradient_clipping"] = 0.0
    return document


def train(engine_or_optimizer, model, rank, world):
    """STEPS optimizer steps of ACCUMULATION micro-batches; rank ``rank`` of ``world`` takes
    its rows (one process: world 1 over the whole batch). Unfreezes model[0].weight at
    UNFROZEN_AT."""
    engine = engine_or_optimizer if hasattr(engine_or_optimizer, "backward") else None
    for step in range(STEPS):
        if step == UNFROZEN_AT:
            model[0].weight.requires_grad_(True)
        for micro in range(ACCUMULATION):
            x, y = micro_batch(step, micro, WORLD)
            if engine is not None:
                loss = torch.nn.functional.mse_loss(engine(rows(x, rank, world)),
                                                    rows(y, rank, world))
                engine.backward(loss)
                engine.step()
            else:
                (torch.nn.functional.mse_loss(model(x), y) / ACCUMULATION).backward()
        if engine is None:
            engine_or_optimizer.step()
            engine_or_optimizer.zero_grad(set_to_none=True)


def run_rank(rank, world, init_file, out_dir, stage):
    with gloo_rank(rank, world, init_file, out_dir):
        model = make_model()
        engine, _, _, _ = zoe.torch.initialize(model=model, model_parameters=decay_groups(model),
                                               config=config(stage))
        train(engine, model, rank, world)
        torch.save(engine.module_state_dict(), os.path.join(out_dir, f"rank{rank}.pt"))
        engine.close()


def torch_reference():
    model = make_model()
    optimizer = torch.optim.AdamW(decay_groups(model), lr=LR, betas=(0.9, 0.999), eps=1e-8)
    train(optimizer, model, 0, 1)
    return model.state_dict()


@pytest.mark.parametrize("stage", [1, 2])
def test_a_group_holding_a_frozen_parameter_trains_as_torch_over_ranks(stage, tmp_path):
    init_file = str(tmp_path / "init")
    spawn_ranks(run_rank, (WORLD, init_file, str(tmp_path), stage), WORLD, str(tmp_path),
                JOIN_SECONDS)
    expected = torch_reference()
    first = make_model()[0].weight
    for rank in range(WORLD):
        found = torch.load(str(tmp_path / f"rank{rank}.pt"))
        assert set(found) == set(expected)
        for key, value in expected.items():
            torch.testing.assert_close(found[key], value, rtol=0, atol=2e-6, msg=key)
        assert not torch.equal(found["0.weight"], first)  # trained once unfrozen
