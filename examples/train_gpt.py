#!/usr/bin/python3
"""Trains a small character-level GPT with its parameters and optimizer state offloaded to NVMe
through zoe, then trains the same model with torch.optim.AdamW and no offload from the same seed
and compares the two loss curves. Then trains it as a model on a device would be (the CPU twin of
one: zoe.torch.HostTwin) with the optimizer state on NVMe, once with the step after backward and
once with the step overlapped with backward (optimizer.overlap(), speculative=True: zoe updates
each chunk as its gradients arrive and commits at step()), and prints how much of the
optimizer step was hidden behind backward.

The text is one that ships with Debian 12 (the GPL-3 in /usr/share/common-licenses, else Python's
own LICENSE). The NVMe tier lives in a temporary directory removed at the end. Prints a progress
bar (loss, tokens/s, bytes moved per tier), a summary (memory per tier, bytes moved, prefetch hit
rate, stall time) and writes a PNG plot of loss and I/O per step.

Usage: train_gpt.py [--steps N] [--plot PATH] [--nvme-dir DIR] [--config FILE]
"""

import argparse
import copy
import json
import math
import os
import shutil
import sys
import tempfile
import time

os.environ.setdefault("ZOE_LOG_LEVEL", "warn")  # zoe's start-up lines would break the bars
# ATen's portable CPU kernels, for both runs: torch's AVX2/AVX-512 kernels fuse some of the
# optimizer's multiply-adds (and only in their SIMD bodies), zoe's never do, and training
# amplifies such last-bit differences until the two loss curves visibly part. With the portable
# kernels torch's AdamW does the same IEEE arithmetic as zoe's, so the curves can be compared
# exactly. Matrix products go to BLAS either way. Must be set before torch is imported.
os.environ.setdefault("ATEN_CPU_CAPABILITY", "default")

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

import zoe  # noqa: E402
import zoe.torch  # noqa: E402

TEXTS = (
    "/usr/share/common-licenses/GPL-3",
    f"/usr/lib/python3.{sys.version_info.minor}/LICENSE.txt",
)

# The embedded default: a DeepSpeed ZeRO-Infinity configuration (optimizer state and parameters
# on NVMe) with zoe's own section. NVME_DIR is replaced by the temporary directory. The model is
# small, so the chunks are too (16 KiB), and the DRAM tier for parameters (256 KiB) holds about
# 40% of them: every step pages parameters in from NVMe, ahead of use by the recorded trace.
DEFAULT_CONFIG = {
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 3e-3, "betas": [0.9, 0.99], "weight_decay": 0.1},
    },
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "nvme", "nvme_path": "NVME_DIR", "buffer_count": 4},
        "offload_param": {"device": "nvme", "nvme_path": "NVME_DIR"},
    },
    "aio": {"block_size": 65536, "queue_depth": 32},
    "zoe": {
        "device": "host",
        "chunk_size": "16K",
        "host_budget": "64M",
        "tensor_host_budget": "256K",
        "tensor_swap_bytes": "64M",
        "log_level": "warn",
    },
}

MODEL = {"width": 64, "heads": 4, "layers": 3, "context": 48}
BATCH = 12
LR = 3e-3
WEIGHT_DECAY = 0.1


class Block(torch.nn.Module):
    """Pre-norm transformer block: causal self-attention and an MLP."""

    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width, bias=False)  # a key bias gets no gradient
        self.proj = torch.nn.Linear(width, width)
        self.norm2 = torch.nn.LayerNorm(width)
        self.fc = torch.nn.Linear(width, 4 * width)
        self.out = torch.nn.Linear(4 * width, width)

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        shape = (batch, length, self.heads, width // self.heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(width // self.heads)
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        weights = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        y = (weights @ v).transpose(1, 2).reshape(batch, length, width)
        x = x + self.proj(y)
        return x + self.out(torch.nn.functional.gelu(self.fc(self.norm2(x))))


class GPT(torch.nn.Module):
    """Token and learned position embeddings, transformer blocks, a head tied to the embedding."""

    def __init__(self, vocab, width, heads, layers, context):
        super().__init__()
        self.tokens = torch.nn.Embedding(vocab, width)
        self.positions = torch.nn.Embedding(context, width)
        self.blocks = torch.nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight
        self.apply(self._init)

    @staticmethod
    def _init(module):
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, torch.nn.Linear) and module.bias is not None:
            torch.nn.init.zeros_(module.bias)

    def forward(self, idx):
        positions = torch.arange(idx.shape[1])
        x = self.tokens(idx) + self.positions(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def load_text():
    for path in TEXTS:
        if os.path.exists(path):
            with open(path, encoding="utf-8") as file:
                return path, file.read()
    raise SystemExit(f"none of {TEXTS} exists; pass a Debian 12 machine")


def batches(data, steps, seed):
    """The same (input, target) batches for both runs."""
    generator = torch.Generator().manual_seed(seed)
    context = MODEL["context"]
    for _ in range(steps):
        starts = torch.randint(0, len(data) - context - 1, (BATCH,), generator=generator)
        chunk = torch.stack([data[s : s + context + 1] for s in starts.tolist()])
        yield chunk[:, :-1], chunk[:, 1:]


def loss_of(model, x, y):
    logits = model(x)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def human_bytes(count):
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if count < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024


def link_bytes(stats):
    links = stats["links"]
    return links["nvme_to_host"]["bytes"], links["host_to_nvme"]["bytes"]


def train_with_zoe(model, data, steps, seed, config):
    """Returns per-step losses and NVMe bytes read / written per step, and the final statistics."""
    losses, read, written = [], [], []
    tokens_per_step = BATCH * MODEL["context"]
    with zoe.Engine(config) as engine:
        pager = zoe.torch.offload_parameters(model, engine, home=zoe.Tier.NVME)
        optimizer = zoe.torch.AdamW(
            model.parameters(), lr=LR, betas=(0.9, 0.99), weight_decay=WEIGHT_DECAY, engine=engine
        )
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
        before = link_bytes(engine.stats())
        bar = tqdm(batches(data, steps, seed), total=steps, desc="zoe  ", unit="step")
        start = time.perf_counter()
        for step, (x, y) in enumerate(bar, 1):
            optimizer.zero_grad(set_to_none=True)
            loss = loss_of(model, x, y)
            loss.backward()
            optimizer.step()  # acquires each paged parameter in turn to write its new values
            schedule.step()
            now = link_bytes(engine.stats())
            step_io = optimizer.last_step[0]
            read.append(now[0] - before[0] + step_io.bytes_read)
            written.append(now[1] - before[1] + step_io.bytes_written)
            before = now
            losses.append(loss.item())
            rate = step * tokens_per_step / (time.perf_counter() - start)
            bar.set_postfix(
                loss=f"{losses[-1]:.3f}",
                tok_s=f"{rate:,.0f}",
                nvme_read=human_bytes(sum(read)),
                nvme_written=human_bytes(sum(written)),
            )
        seconds = time.perf_counter() - start
        stats = engine.stats()
        summary = {
            "seconds": seconds,
            "tokens_per_second": steps * tokens_per_step / seconds,
            "tiers": stats["tiers"],
            "links": stats["links"],
            "groups": stats.get("groups"),
            "host_budget": stats.get("host_budget"),
            "prefetch_hit_rate": pager.prefetch_hit_rate(),
            "stall_seconds": stats["stall"]["nanoseconds"] / 1e9,
            "stalls": stats["stall"]["count"],
        }
        pager.remove()  # the parameters become ordinary tensors again, before the engine closes
    return losses, read, written, summary


def train_with_torch(model, data, steps, seed):
    losses = []
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=LR, betas=(0.9, 0.99), weight_decay=WEIGHT_DECAY
    )
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    for x, y in tqdm(batches(data, steps, seed), total=steps, desc="torch", unit="step"):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(model, x, y)
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
    return losses


def train_on_device(model, data, steps, seed, config, overlapped):
    """The model on the CPU twin of a device, its optimizer state on NVMe through zoe, no
    parameter paging: gradients go to zoe as they become final in backward when ``overlapped``,
    else at step(). Returns per-step losses, backward and step() seconds, and hand-over counts."""
    config = json.loads(json.dumps(config))
    config.setdefault("zoe", {})["tensor_host_budget"] = "8M"  # pinned staging, both ways
    losses, backward_seconds, step_seconds = [], [], []
    label = "overlap" if overlapped else "after  "
    with zoe.Engine(config) as engine:
        optimizer = zoe.torch.AdamW(
            model.parameters(), lr=LR, betas=(0.9, 0.99), weight_decay=WEIGHT_DECAY,
            engine=engine, device_backend=zoe.torch.HostTwin(), speculative=overlapped,
        )
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
        for x, y in tqdm(batches(data, steps, seed), total=steps, desc=label, unit="step"):
            optimizer.zero_grad(set_to_none=True)
            loss = loss_of(model, x, y)
            started = time.perf_counter()
            if overlapped:
                with optimizer.overlap():
                    loss.backward()
            else:
                loss.backward()
            backward_done = time.perf_counter()
            optimizer.step()
            step_seconds.append(time.perf_counter() - backward_done)
            backward_seconds.append(backward_done - started)
            schedule.step()
            losses.append(loss.item())
        group = optimizer._groups[0]  # the first param group's zoe state (zoe.torch.param_group)
        handed = dict(group.device.stats)
        handed["speculation"] = group.zoe_group.speculation_stats()
        optimizer.close()
    return losses, backward_seconds, step_seconds, handed


def print_overlap(after, overlapped):
    """How much of the step the overlapped run hid behind backward: 1 - (time step() still took
    after backward, overlapped) / (time step() took after backward, not overlapped); medians,
    the first (recorded, cold) step left out."""
    def median(values):
        values = sorted(values[1:] or values)
        return values[len(values) // 2]

    step_after, step_left = median(after[2]), median(overlapped[2])
    backward_after, backward_overlapped = median(after[1]), median(overlapped[1])
    hidden = 1.0 - step_left / step_after if step_after > 0 else 0.0
    handed = overlapped[3]
    total = handed["handed_in_backward"] + handed["handed_at_step"]
    print("\nstep overlapped with backward (model on the CPU twin of a device, state on NVMe)")
    print(f"  step after backward       {step_after * 1e3:.2f} ms "
          f"(backward {backward_after * 1e3:.2f} ms)")
    print(f"  step left after backward  {step_left * 1e3:.2f} ms "
          f"(backward {backward_overlapped * 1e3:.2f} ms), overlapped")
    print(f"  hidden behind backward    {max(hidden, 0.0):.0%} of the step "
          f"(medians per step; on a CPU, backward and the step share the cores)")
    print(f"  gradients handed to zoe during backward: {handed['handed_in_backward']} of {total}")
    speculation = handed["speculation"]
    print(f"  chunks updated during backward (speculative): {speculation['chunks_speculative']}, "
          f"committed {speculation['chunks_committed']}, recomputed "
          f"{speculation['chunks_recomputed']}, discarded {speculation['chunks_discarded']}")


def print_summary(summary, read, written):
    print("\nzoe summary")
    print(
        f"  time                {summary['seconds']:.1f} s, "
        f"{summary['tokens_per_second']:,.0f} tokens/s"
    )
    print("  memory per tier     (current / peak)")
    for tier, counters in summary["tiers"].items():
        print(
            f"    {tier:<8}          {human_bytes(counters['occupancy_bytes'])} / "
            f"{human_bytes(counters['peak_occupancy_bytes'])}"
        )
    print("  bytes moved")
    for link, counters in summary["links"].items():
        moved = human_bytes(counters["bytes"])
        print(f"    {link:<16}  {moved} in {counters['transfers']} transfers")
    print(f"    NVMe in total     {human_bytes(sum(read))} read, {human_bytes(sum(written))} "
          "written (parameters and optimizer state)")
    hit_rate, stall_ms = summary["prefetch_hit_rate"], summary["stall_seconds"] * 1e3
    print(f"  prefetch hit rate   {hit_rate:.3f} (after the recorded first step)")
    print(f"  stall time          {stall_ms:.1f} ms in {summary['stalls']} stalls")


def plot(path, zoe_losses, torch_losses, read, written):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = range(1, len(zoe_losses) + 1)
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    top.plot(steps, torch_losses, label="torch.optim.AdamW, no offload", linewidth=3, alpha=0.5)
    top.plot(steps, zoe_losses, label="zoe.torch.AdamW, NVMe offload", linewidth=1)
    top.set_ylabel("loss")
    top.legend()
    bottom.plot(steps, [r / 2**20 for r in read], label="NVMe -> DRAM")
    bottom.plot(steps, [w / 2**20 for w in written], label="DRAM -> NVMe")
    bottom.set_xlabel("step")
    bottom.set_ylabel("MiB per step")
    bottom.legend()
    figure.suptitle("zoe demo: character-level GPT")
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default="zoe-demo.png", help="PNG to write")
    parser.add_argument("--nvme-dir", help="where the swap files go (default: a temporary dir)")
    parser.add_argument("--config", help="a JSON configuration instead of the embedded one")
    parser.add_argument("--tolerance", type=float, default=1e-3,
                        help="largest allowed |loss difference| between the two runs")
    args = parser.parse_args()

    path, text = load_text()
    vocabulary = sorted(set(text))
    index = {char: i for i, char in enumerate(vocabulary)}
    data = torch.tensor([index[char] for char in text], dtype=torch.long)
    torch.manual_seed(args.seed)
    model = GPT(len(vocabulary), **MODEL)
    reference = copy.deepcopy(model)
    count = sum(p.numel() for p in model.parameters())
    print(f"zoe {zoe.version()}: {count:,} parameters, {len(text):,} characters of {path}")

    nvme_dir = args.nvme_dir or tempfile.mkdtemp(prefix="zoe-demo-", dir="/var/tmp")
    try:
        if args.config:
            with open(args.config, encoding="utf-8") as file:
                config = json.load(file)
        else:
            config = json.loads(json.dumps(DEFAULT_CONFIG).replace("NVME_DIR", nvme_dir))
        zoe_losses, read, written, summary = train_with_zoe(
            model, data, args.steps, args.seed, config
        )
        device_runs = []
        for overlapped in (False, True):
            device_model = copy.deepcopy(reference)
            device_runs.append(
                train_on_device(device_model, data, args.steps, args.seed, config, overlapped)
            )
    finally:
        if not args.nvme_dir:
            shutil.rmtree(nvme_dir, ignore_errors=True)
    torch_losses = train_with_torch(reference, data, args.steps, args.seed)

    print_summary(summary, read, written)
    print("\nloss per step (zoe vs torch):")
    stride = max(1, args.steps // 10)
    for step in sorted({0, *range(stride - 1, args.steps, stride)}):
        print(f"  step {step + 1:>4}  zoe {zoe_losses[step]:.6f}  torch {torch_losses[step]:.6f}")
    print_overlap(*device_runs)
    difference = max(
        abs(a - b)
        for run in (zoe_losses, device_runs[0][0], device_runs[1][0])
        for a, b in zip(run, torch_losses)
    )
    verdict = "within" if difference <= args.tolerance else "OUTSIDE"
    print(f"max |loss difference| from torch over {args.steps} steps, paged, after and overlapped: "
          f"{difference:.3g} ({verdict} "
          f"tolerance {args.tolerance:g})")
    plot(args.plot, zoe_losses, torch_losses, read, written)
    print(f"plot: {os.path.abspath(args.plot)}")
    return 0 if difference <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
