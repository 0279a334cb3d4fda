#!/usr/bin/python3
"""Trains a GPT whose training state (fp32 parameters, gradients and AdamW's two moments: 16 bytes
per parameter) is several times the memory the process is allowed: its parameters are created
paged (zoe.torch.zero_init), its gradients stream out of backward, and parameters and optimizer
state live on NVMe files, with no size key in zoe's configuration (zoe sizes itself from the
limit). Prints the loss of each step, the peak memory, the state over the limit and the bytes
moved per tier.

As root (or with write access to the memory cgroup hierarchy) the training runs in a child
process inside a memory cgroup of --limit bytes that it joins before importing torch, so
everything it allocates counts and going over the limit kills it. Elsewhere it runs without a
limit and says so, with zoe's host budget set to what such a cgroup would have given it (3/8 of
the limit); the figures are then its peak resident size.

Usage: train_beyond_memory.py [--limit 512M] [--width 1024] [--layers 11] [--steps 3]
                              [--nvme-dir DIR]
"""

import argparse
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "integrations", "python"))
from zoe.memory_limit import MemoryCgroup, parse_size  # noqa: E402  (no torch before the cgroup)

CONTEXT = 64
BATCH = 4


def gpt_parameters(vocab, width, layers):
    """Parameters of train_gpt.GPT: 12 width^2 + 13 width per block, embeddings, final norm."""
    return layers * (12 * width * width + 13 * width) + (vocab + CONTEXT + 2) * width


def train(args):
    """The child: builds the model paged and trains it; prints one JSON line per step and a
    summary line."""
    if args.cgroup:
        MemoryCgroup.join(args.cgroup)
    import torch

    import zoe
    import zoe.torch
    from train_gpt import GPT, load_text

    _, text = load_text()
    vocabulary = sorted(set(text))
    index = {char: i for i, char in enumerate(vocabulary)}
    data = torch.tensor([index[char] for char in text], dtype=torch.long)
    engine = zoe.Engine({
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "nvme", "nvme_path": args.nvme_dir},
            "offload_param": {"device": "nvme", "nvme_path": args.nvme_dir},
        },
        # no size key; without a cgroup, the host budget a cgroup of --limit would have given
        "zoe": {"log_level": "warn", **({"host_budget": args.host_budget}
                                        if args.host_budget else {})},
    })
    torch.manual_seed(0)
    with zoe.torch.zero_init(engine):  # each module's parameters paged as it is built
        model = GPT(len(vocabulary), args.width, max(1, args.width // 128), args.layers, CONTEXT)
    pager = zoe.torch.offload_parameters(model, engine)
    optimizer = zoe.torch.AdamW(model.parameters(), lr=3e-5, engine=engine, max_grad_norm=1.0)
    generator = torch.Generator().manual_seed(0)
    starts = torch.randint(0, len(data) - CONTEXT - 1, (BATCH,), generator=generator)
    x = torch.stack([data[s: s + CONTEXT] for s in starts])
    y = torch.stack([data[s + 1: s + CONTEXT + 1] for s in starts])
    for step in range(args.steps):
        started = time.perf_counter()
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(json.dumps({"step": step, "loss": float(loss),
                          "seconds": time.perf_counter() - started}), flush=True)
    stats = engine.stats()
    links = stats["links"]
    groups = stats["groups"]
    print(json.dumps({
        "summary": True,
        "parameters": sum(p.numel() for p in model.parameters()),
        "nvme_read": links["nvme_to_host"]["bytes"] + sum(g["bytes_read"] for g in groups),
        "nvme_written": links["host_to_nvme"]["bytes"] + sum(g["bytes_written"] for g in groups),
        "host_budget": stats["host_budget"]["total"],
        "prefetch_hit_rate": pager.prefetch_hit_rate(),
        "max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }), flush=True)
    optimizer.close()
    engine.close()


def gib(count):
    return f"{count / (1 << 30):.2f} GiB"


def report(lines, limit, peak, limited, returncode):
    """Prints the steps and the summary; returns the exit status."""
    steps = [line for line in lines if "step" in line]
    summary = next((line for line in lines if line.get("summary")), None)
    for line in steps:
        print(f"  step {line['step'] + 1}  loss {line['loss']:.4f}  ({line['seconds']:.1f} s)")
    if summary is None:
        killed = limited and returncode == -signal.SIGKILL
        print(f"the training did not finish ({len(steps)} steps); "
              + ("the memory limit killed it" if killed else "see its error above"))
        return 1
    state = 16 * summary["parameters"]
    peak = peak or summary["max_rss"]
    allowed = limit if limited else peak
    print(f"{summary['parameters']:,} parameters: {gib(state)} of training state; "
          + (f"memory limit {gib(limit)} (a memory cgroup)" if limited
             else "no memory cgroup could be made here (that needs root and a writable cgroup "
                  "hierarchy), so zoe's host budget was set as under one; figures are the peak "
                  "resident size")
          + f", peak {gib(peak)}: the state is {state / allowed:.1f}x the memory "
          + ("allowed" if limited else "used"))
    print(f"zoe's pinned host budget {gib(summary['host_budget'])}; moved "
          f"{gib(summary['nvme_read'])} from NVMe and {gib(summary['nvme_written'])} to it; "
          f"prefetch hit rate {summary['prefetch_hit_rate']:.2f}")
    falling = len(steps) > 1 and steps[-1]["loss"] < steps[0]["loss"]
    print("loss " + ("falls" if falling else "does not fall") + " over the steps")
    return 0 if falling else 1


def child_env():
    """The child's environment: this folder on its path (train_gpt's model), and glibc's malloc
    told to map every block of 128 KiB or more on its own (MALLOC_MMAP_THRESHOLD_), so that the
    large buffers freed as each module is paged, and each layer's gradients, go back to the
    system at once. Without it glibc raises its threshold after the first such free, serves the
    next ones from its heap and keeps freed heap memory: hundreds of MiB, under a limit that
    leaves no room for them."""
    return dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072",
                PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=parse_size, default=parse_size("512M"))
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=11)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--nvme-dir", help="where the swap files go (default: a temporary dir)")
    parser.add_argument("--no-cgroup", action="store_true",
                        help="no memory cgroup even where one can be made: zoe's host budget is "
                             "set as under the limit, and the peak is the resident size")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cgroup", help=argparse.SUPPRESS)
    parser.add_argument("--host-budget", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        train(args)
        return 0
    nvme_dir = args.nvme_dir or tempfile.mkdtemp(prefix="zoe-beyond-", dir="/var/tmp")
    limited = MemoryCgroup.possible() and not args.no_cgroup
    cgroup = MemoryCgroup(args.limit, f"zoe-beyond-{os.getpid()}") if limited else None
    command = [sys.executable, os.path.abspath(__file__), "--child", "--nvme-dir", nvme_dir,
               "--width", str(args.width), "--layers", str(args.layers),
               "--steps", str(args.steps)] + (["--cgroup", cgroup.folder] if cgroup else
                                              ["--host-budget", str(args.limit * 3 // 8)])
    print(f"training a GPT of {gpt_parameters(100, args.width, args.layers):,} parameters with "
          "zoe" + (f" inside {gib(args.limit)} of memory" if limited else ""), flush=True)
    try:
        completed = subprocess.run(command, stdout=subprocess.PIPE, text=True, env=child_env())
    finally:
        peak = cgroup.peak() if cgroup else None
        if cgroup:
            cgroup.remove()
        if not args.nvme_dir:
            shutil.rmtree(nvme_dir, ignore_errors=True)
    lines = [json.loads(line) for line in completed.stdout.splitlines() if line.startswith("{")]
    return report(lines, args.limit, peak, limited, completed.returncode)


if __name__ == "__main__":
    sys.exit(main())
