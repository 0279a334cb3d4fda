"""ZeRO stage 3 over 2 ranks (torch.multiprocessing, gloo) with parameters read outside the forward
of their own module: a head tied by hand (the parent's forward multiplies by the embedding's
weight) and a gate's weight read inside another module's forward. Each read, while a forward runs,
gathers the parameter for the innermost forward (external_reads.py); training through
zoe.torch.initialize (gradient accumulation 2) ends on every rank with the parameters of one
process running the plain torch loop over the whole batch. The reads' gathers are recorded in the
trace like the modules' own: it holds from the first iteration on, and most gathers are
prefetched."""

import os

import torch

import zoe.torch
from conftest import gloo_rank, spawn_ranks
from initialize_script import ACCUMULATION, LR, MICRO, ds_config

WORLD = 2
STEPS = 3
JOIN_SECONDS = 60


class Gated(torch.nn.Module):
    """A layer scaled by another module's weight, read in this module's forward."""

    def __init__(self, gate):
        super().__init__()
        self.layer = torch.nn.Linear(8, 8)
        self.gate = [gate]  # a reference, not a submodule: the gate is the parent's

    def forward(self, h):
        return torch.tanh(self.layer(h)) * torch.sigmoid(self.gate[0].weight[0])


class TiedByHand(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Linear(6, 8, bias=False)
        self.gate = torch.nn.Linear(8, 1, bias=False)
        self.block = Gated(self.gate)

    def forward(self, x):
        return self.block(self.emb(x)) @ self.emb.weight  # the head: emb's weight, transposed


def batch(step, micro):
    generator = torch.Generator().manual_seed(100 * step + micro)
    return torch.randn(MICRO * WORLD, 6, generator=generator)


def config():
    document = ds_config(3, "cpu", None, WORLD, "cpu")
    del document["scheduler"]
    document["gradient_clipping"] = 0.0
    return document


def run_rank(rank, world, init_file, out_dir):
    with gloo_rank(rank, world, init_file, out_dir):
        engine, _, _, _ = zoe.torch.initialize(model=TiedByHand(), config=config())
        for step in range(STEPS):
            for micro in range(ACCUMULATION):
                x = batch(step, micro)[rank * MICRO:(rank + 1) * MICRO]
                engine.backward(engine(x).square().mean())
                engine.step()
        gathers = engine._stage3.pager.gathers
        torch.save({"state": engine.module_state_dict(), "gathers": dict(gathers)},
                   os.path.join(out_dir, f"rank{rank}.pt"))
        engine.close()


def torch_reference():
    model = TiedByHand()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8,
                                  weight_decay=0.01)
    for step in range(STEPS):
        for micro in range(ACCUMULATION):
            (model(batch(step, micro)).square().mean() / ACCUMULATION).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


def test_parameters_read_outside_their_modules_train_as_torch_over_ranks(tmp_path):
    init_file = str(tmp_path / "init")
    spawn_ranks(run_rank, (WORLD, init_file, str(tmp_path)), WORLD, str(tmp_path), JOIN_SECONDS)
    expected = torch_reference()
    for rank in range(WORLD):
        found = torch.load(str(tmp_path / f"rank{rank}.pt"))
        for key, value in expected.items():
            torch.testing.assert_close(found["state"][key], value, rtol=0, atol=2e-6, msg=key)
        gathers = found["gathers"]  # the reads' gathers are in the trace, which holds
        assert gathers["rerecorded"] == 0 and gathers["prefetched"] > gathers["on_demand"], \
            gathers
