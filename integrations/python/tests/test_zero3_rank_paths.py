"""ZeRO stage 3 over 2 ranks (torch.multiprocessing, gloo) whose ranks run different modules of
the same shapes (an expert per rank, as data-dependent routing does): their gathers paired one
rank's shards of one expert with the other's of the other, and every rank went on with wrong
values, silently. Each gather's agreement now carries the parameter each rank gathered, so every
rank raises InvalidArgument naming what each gathered, before the values are used, and the ranks
stay paired: they close their engines without waiting for the transport's timeout."""

import os

import torch

import zoe
import zoe.torch
from conftest import gloo_rank, spawn_ranks
from initialize_script import ds_config

WORLD = 2
JOIN_SECONDS = 60


class Experts(torch.nn.Module):
    """Two experts of one shape; rank r's inputs go through expert r."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Linear(8, 16)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(WORLD))
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x, expert):
        return self.head(torch.tanh(self.experts[expert](torch.tanh(self.embed(x)))))


def run_rank(rank, world, init_file, out_dir):
    with gloo_rank(rank, world, init_file, out_dir):
        config = ds_config(3, "cpu", None, world, "cpu")
        engine, _, _, _ = zoe.torch.initialize(model=Experts(), config=config)
        try:
            engine(torch.ones(4, 8), rank)
            outcome = "no error"
        except zoe.InvalidArgument as error:
            outcome = str(error)
        engine.close()
        with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as file:
            file.write(outcome)


def test_ranks_running_different_modules_are_refused_not_paired(tmp_path):
    init_file = str(tmp_path / "init")
    spawn_ranks(run_rank, (WORLD, init_file, str(tmp_path)), WORLD, str(tmp_path), JOIN_SECONDS)
    for rank in range(WORLD):
        message = open(tmp_path / f"rank{rank}.txt").read()
        assert message.startswith("the ranks gathered different parameters at once (rank 0: "
                                  "'experts.0.weight'; rank 1: 'experts.1.weight'): at ZeRO "
                                  "stage 3 every rank must run the same modules"), message
        assert "run every module on every rank" in message
