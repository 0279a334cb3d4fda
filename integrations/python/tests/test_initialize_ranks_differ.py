"""Ranks that differ where they must not. Ranks given different DeepSpeed configurations are
refused by initialize on every rank, before anything is built, naming each key that differs and
its value on each rank (a rank at another stage used to abort in gloo, or wait for the process
group's timeout; another learning rate stepped its shard otherwise, silently); the NVMe paths
may differ. A configuration that one rank cannot read (an NVMe directory it cannot create)
makes every rank raise naming it, at once instead of at the timeout. At stage 2 a parameter
with a gradient on one rank and none on another is refused at step() on every rank, before any
group steps (its bucket's reductions may have paired with the wrong ones), and the ranks train
on."""

import os
import re
import time

import pytest
import torch
import torch.distributed as dist

import zoe
import zoe.torch
from conftest import gloo_rank, spawn_ranks
from initialize_script import ds_config, make_model, train_engine

WORLD = 2
JOIN_SECONDS = 300
# Far below the process group's timeout (conftest.gloo_rank: 30 s), which a rank left waiting
# in a collective would reach.
PROMPT_SECONDS = 15


def changed(config, path, value):
    """``config`` with the dotted ``path`` set to ``value``."""
    *sections, key = path.split(".")
    holder = config
    for section in sections:
        holder = holder[section]
    holder[key] = value
    return config


# (the key, its value on each rank, what the message says)
DIFFERENCES = [
    ("zero_optimization.stage", (1, 2), "zero_optimization.stage: 1 on rank 0; 2 on rank 1"),
    ("optimizer.params.lr", (0.01, 0.02), "optimizer.params.lr: 0.01 on rank 0; 0.02 on rank 1"),
    ("gradient_clipping", (1.0, None), "gradient_clipping: 1.0 on rank 0; null on rank 1"),
]


def refused_differences(rank, out_dir):
    for path, values, message in DIFFERENCES:
        config = changed(ds_config(stage=1, offload="cpu", world=WORLD), path, values[rank])
        started = time.monotonic()
        with pytest.raises(zoe.InvalidArgument, match="the ranks were given different DeepSpeed "
                                                      "configurations: " + re.escape(message)):
            zoe.torch.initialize(model=make_model(), config=config)
        assert time.monotonic() - started < PROMPT_SECONDS, path


def nvme_paths_may_differ(rank, out_dir):
    config = ds_config(stage=2, offload="nvme", nvme_path=os.path.join(out_dir, f"disk{rank}"),
                       world=WORLD)
    engine, _, _, _ = zoe.torch.initialize(model=make_model(), config=config)
    train_engine(engine, 0, 1, rank, WORLD)
    assert engine.global_steps == 1
    engine.close()


def unreadable_on_one_rank(rank, out_dir):
    """Rank 1's NVMe directory would be below a file: rank 1 raises its error, rank 0 Aborted,
    both naming rank 1, promptly."""
    blocker = os.path.join(out_dir, "a-file")
    if rank == 0:
        open(blocker, "w").close()
    dist.barrier()
    path = os.path.join(blocker if rank == 1 else out_dir, "{rank}")
    config = ds_config(stage=2, offload="nvme", nvme_path=path, world=WORLD)
    started = time.monotonic()
    with pytest.raises(zoe.InvalidArgument if rank == 1 else zoe.Aborted,
                       match="initialize: reading the DeepSpeed configuration failed on rank 1"
                             ".*nvme_path .* is not a directory: a file stands in the way"):
        zoe.torch.initialize(model=make_model(), config=config)
    assert time.monotonic() - started < PROMPT_SECONDS


class Branches(torch.nn.Module):
    """A trunk and a head that the forward uses or not."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = torch.nn.Linear(8, 4)
        self.head = torch.nn.Linear(4, 4)

    def forward(self, x, use_head):
        h = self.trunk(x)
        return self.head(h) if use_head else h


def gradients_that_differ(rank, out_dir):
    engine, _, _, _ = zoe.torch.initialize(
        model=Branches(), config=ds_config(stage=2, offload="cpu", world=WORLD))
    before = [param.detach().clone() for param in engine.module.parameters()]
    for micro in range(2):  # the head unused on rank 1
        engine.backward(engine(torch.ones(4, 8), rank == 0).square().mean())
        if micro == 0:
            engine.step()
    with pytest.raises(zoe.InvalidArgument, match=r"parameter 2 of param group 0 \(shape \(4, 4\)"
                                                  r"\) has a gradient on some ranks and none on "
                                                  r"others \(2 such parameter\(s\)\): .*stage 1"):
        engine.step()
    assert all(torch.equal(param, old) for param, old in zip(engine.module.parameters(), before))
    engine.zero_grad()
    for _ in range(6):  # the ranks train on (WarmupLR: lr 0 for two steps)
        engine.backward(engine(torch.ones(4, 8), True).square().mean())
        engine.step()
    assert engine.global_steps == 3
    assert not all(torch.equal(param, old)
                   for param, old in zip(engine.module.parameters(), before))
    engine.close()


def worker(rank, out_dir):
    with gloo_rank(rank, WORLD, f"{out_dir}/init", out_dir):
        refused_differences(rank, out_dir)
        nvme_paths_may_differ(rank, out_dir)
        unreadable_on_one_rank(rank, out_dir)
        gradients_that_differ(rank, out_dir)


def test_on_two_ranks(tmp_path):
    spawn_ranks(worker, (str(tmp_path),), WORLD, str(tmp_path), JOIN_SECONDS)
