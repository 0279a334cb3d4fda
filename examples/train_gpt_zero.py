#!/usr/bin/python3
"""Trains the demo's character-level GPT (train_gpt.py) with ZeRO stage 3 on N ranks (default 2)
started with torch.multiprocessing on this machine and talking over gloo: each rank pages only its
shard of every parameter through its own zoe engine, with parameters and zoe.torch.AdamW's state
on NVMe under its own directory; a module's parameters are all-gathered around its forward and
backward (ahead of use by the recorded gather order) and gradients reduced to the owning shard.
Then trains the same model in one process with torch.optim.AdamW and prints the two loss curves
side by side.

Each rank takes BATCH / N rows of every batch; the loss printed for the sharded run is the mean
over the ranks, the same batch's loss as the one-process run's. Gradients are clipped to norm 1
in both runs (zoe's optimizer agrees the global norm across ranks).

Usage: train_gpt_zero.py [--steps N] [--ranks N] [--nvme-dir DIR] [--tolerance T]
"""

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_gpt  # noqa: E402  (sets ATEN_CPU_CAPABILITY before torch is imported)
from train_gpt import BATCH, LR, MODEL, WEIGHT_DECAY, GPT, batches, load_text, loss_of  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import zoe  # noqa: E402
import zoe.torch  # noqa: E402

MAX_NORM = 1.0


def rank_config(nvme_dir, rank):
    """The demo's ZeRO-Infinity configuration with this rank's own NVMe directory."""
    path = os.path.join(nvme_dir, f"rank{rank}")
    os.makedirs(path, exist_ok=True)
    return json.loads(json.dumps(train_gpt.DEFAULT_CONFIG).replace("NVME_DIR", path))


def corpus():
    _, text = load_text()
    vocabulary = sorted(set(text))
    index = {char: i for i, char in enumerate(vocabulary)}
    return len(vocabulary), torch.tensor([index[char] for char in text], dtype=torch.long)


def train_rank(rank, world_size, steps, seed, nvme_dir):
    """One rank of the stage 3 run; rank 0 writes the losses and every rank its statistics."""
    dist.init_process_group(
        "gloo", init_method="file://" + os.path.join(nvme_dir, "rendezvous"), rank=rank,
        world_size=world_size, timeout=datetime.timedelta(seconds=60),
    )
    vocabulary, data = corpus()
    torch.manual_seed(seed)
    model = GPT(vocabulary, **MODEL)  # the same initial values on every rank
    rows = slice(BATCH * rank // world_size, BATCH * (rank + 1) // world_size)
    losses = []
    with zoe.Engine(rank_config(nvme_dir, rank)) as engine:
        pager = zoe.torch.offload_parameters(model, engine, home=zoe.Tier.NVME,
                                             process_group=dist.group.WORLD)
        # Gradients stream out of backward into the optimizer, which clips them by the global
        # norm over every rank's shards and skips a non-finite step on every rank.
        optimizer = zoe.torch.AdamW(pager.shard_parameters(), lr=LR, betas=(0.9, 0.99),
                                    weight_decay=WEIGHT_DECAY, engine=engine,
                                    max_grad_norm=MAX_NORM)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
        start = time.perf_counter()
        for x, y in batches(data, steps, seed):
            optimizer.zero_grad(set_to_none=True)
            loss = loss_of(model, x[rows], y[rows])
            loss.backward()
            optimizer.step()
            schedule.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / world_size)
        seconds = time.perf_counter() - start
        stats = pager.stats()
        stats.pop("engine")
        stats.pop("per_iteration")
        stats["seconds"] = seconds
        torch.save(stats, os.path.join(nvme_dir, f"stats{rank}.pt"))
        if rank == 0:
            torch.save(losses, os.path.join(nvme_dir, "losses.pt"))
        pager.remove()  # a collective: gives the model its full parameters back
        optimizer.close()
    dist.destroy_process_group()


def train_one_process(steps, seed):
    vocabulary, data = corpus()
    torch.manual_seed(seed)
    model = GPT(vocabulary, **MODEL)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.99),
                                  weight_decay=WEIGHT_DECAY)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    losses = []
    for x, y in batches(data, steps, seed):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(model, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
    return losses, sum(p.numel() for p in model.parameters())


def print_ranks(nvme_dir, world_size):
    print(f"\nper rank (stage 3 over {world_size} ranks, parameters and optimizer state on NVMe)")
    for rank in range(world_size):
        stats = torch.load(os.path.join(nvme_dir, f"stats{rank}.pt"))
        gathers = stats["gathers"]
        print(f"  rank {rank}: shard {stats['shard_bytes']:,} B, peak gathered "
              f"{stats['peak_gathered_bytes']:,} B, gathers issued ahead {gathers['prefetched']}"
              f" / on demand {gathers['on_demand']}, {stats['seconds']:.1f} s")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--nvme-dir", help="where the ranks' swap files go (default: a temporary "
                        "dir)")
    parser.add_argument("--tolerance", type=float, default=1e-3,
                        help="largest allowed |loss difference| between the two runs")
    args = parser.parse_args()
    if BATCH % args.ranks:
        parser.error(f"--ranks must divide the batch of {BATCH} rows")

    nvme_dir = args.nvme_dir or tempfile.mkdtemp(prefix="zoe-zero3-", dir="/var/tmp")
    try:
        mp.spawn(train_rank, args=(args.ranks, args.steps, args.seed, nvme_dir),
                 nprocs=args.ranks, join=True)
        sharded = torch.load(os.path.join(nvme_dir, "losses.pt"))
        print_ranks(nvme_dir, args.ranks)
    finally:
        if not args.nvme_dir:
            shutil.rmtree(nvme_dir, ignore_errors=True)
    single, count = train_one_process(args.steps, args.seed)

    print(f"\nloss per step ({count:,} parameters): {args.ranks} ranks, zoe stage 3 | one process, "
          "torch AdamW")
    stride = max(1, args.steps // 10)
    for step in sorted({0, *range(stride - 1, args.steps, stride)}):
        print(f"  step {step + 1:>4}  {sharded[step]:.6f} | {single[step]:.6f}")
    difference = max(abs(a - b) for a, b in zip(sharded, single))
    verdict = "within" if difference <= args.tolerance else "OUTSIDE"
    print(f"max |loss difference| over {args.steps} steps: {difference:.3g} ({verdict} tolerance "
          f"{args.tolerance:g})")
    return 0 if difference <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
