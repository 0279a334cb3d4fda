"""ZeRO stage 3 over 2 ranks (torch.multiprocessing, gloo) whose ranks run different modules of
the same shapes (an expert per rank, as data-dependent routing does): their gathers paired one
rank's shards of one expert with the other's of the other, and every rank went on with wrong
values, silently. Each gather's agreement now carries the parameter each rank gathered, so every
rank raises InvalidArgument naming what each gathered, before the values are used; the gathers
issued ahead are drained, so the ranks stay paired: they train on together and close their
engines without waiting for the transport's timeout. (Once the trace prefetches, or for modules
of other sizes, gloo aborts the process first: docs/zero3.md.)"""

import os
import re

import pytest
import torch

import zoe
import zoe.torch
from conftest import gloo_rank, spawn_ranks
from initialize_script import ds_config

WORLD = 2
JOIN_SECONDS = 60


class Experts(torch.nn.Module):
    """Two experts, of one shape or (``sizes``) of two; each input goes through the expert
    forward is told."""

    def __init__(self, sizes=(16, 16)):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Linear(8, 16)
        self.experts = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(16, size), torch.nn.Linear(size, 16))
            for size in sizes)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x, expert):
        return self.head(torch.tanh(self.experts[expert](torch.tanh(self.embed(x)))))


def run_rank(rank, world, init_file, out_dir, sizes, together):
    """``together`` iterations on one path (the trace then prefetches it), then one where
    each rank takes its own expert; a last one together again after the error."""
    with gloo_rank(rank, world, init_file, out_dir):
        config = ds_config(3, "cpu", None, world, "cpu")
        engine, _, _, _ = zoe.torch.initialize(model=Experts(sizes), config=config)
        for _ in range(together):
            engine.backward(engine(torch.ones(4, 8), 0).square().mean())
            engine.step()
        try:
            engine(torch.ones(4, 8), rank)
            outcome = "no error"
        except zoe.InvalidArgument as error:
            outcome = str(error)
        engine.zero_grad()
        engine.backward(engine(torch.ones(4, 8), 0).square().mean())  # paired again
        engine.close()
        with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as file:
            file.write(outcome)


@pytest.mark.parametrize("sizes, together", [((16, 16), 0)], ids=["same_shapes"])
def test_ranks_running_different_modules_are_refused_not_paired(tmp_path, sizes, together):
    init_file = str(tmp_path / "init")
    spawn_ranks(run_rank, (WORLD, init_file, str(tmp_path), sizes, together), WORLD,
                str(tmp_path), JOIN_SECONDS)
    for rank in range(WORLD):
        message = open(tmp_path / f"rank{rank}.txt").read()
        # rank 0 about to gather its expert's first weight, or (prefetched) one ahead of it
        assert re.match(r"the ranks gathered different parameters at once \(rank 0: "
                        r"'experts\.0\.[01]\.weight'; rank 1: 'experts\.1\.0\.weight'\): at "
                        "ZeRO stage 3 every rank must run the same modules", message), message
        assert "run every module on every rank" in message
