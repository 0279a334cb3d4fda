#!/usr/bin/python3
"""Trains two small models N steps with zoe.torch.AdamW, once with fp32 moments and once with int8
moments (block-wise quantized, optim/quantize.h), from the same seed and batches, and prints both
losses: the demo's character-level GPT (examples/train_gpt.py) and a two-layer MLP fitting a
fixed random teacher network. The compared figure is the mean loss of the last 10 steps; the run
fails (exit 1) when int8's is above fp32's by more than --tolerance (relative; a lower loss is no
loss of quality).

Usage: int8_quality.py [--steps N] [--tolerance T] [--offload cpu|nvme]
Results and the stated tolerance: docs/int8-moments.md.
"""

import argparse
import importlib.util
import os
import pathlib
import sys
import tempfile

os.environ.setdefault("ZOE_LOG_LEVEL", "warn")
DEMO = pathlib.Path(__file__).resolve().parent.parent / "examples" / "train_gpt.py"
spec = importlib.util.spec_from_file_location("train_gpt", DEMO)
demo = importlib.util.module_from_spec(spec)
spec.loader.exec_module(demo)  # sets ATEN_CPU_CAPABILITY before torch is imported

import torch  # noqa: E402

import zoe.torch  # noqa: E402


def gpt_task(seed):
    """The demo's model and batches: (make_model, batches, loss)."""
    _, text = demo.load_text()
    vocabulary = sorted(set(text))
    index = {char: i for i, char in enumerate(vocabulary)}
    data = torch.tensor([index[char] for char in text], dtype=torch.long)

    def make_model():
        torch.manual_seed(seed)
        return demo.GPT(len(vocabulary), **demo.MODEL)

    return make_model, lambda steps: demo.batches(data, steps, seed), demo.loss_of


def mlp_task(seed):
    """A 64-256-10 MLP regressing a fixed random teacher (64-32-10, tanh) on Gaussian inputs."""
    generator = torch.Generator().manual_seed(seed + 1)
    teacher = [torch.randn(64, 32, generator=generator), torch.randn(32, 10, generator=generator)]

    def make_model():
        torch.manual_seed(seed)
        return torch.nn.Sequential(
            torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 10)
        )

    def batches(steps):
        batch_generator = torch.Generator().manual_seed(seed + 2)
        for _ in range(steps):
            x = torch.randn(128, 64, generator=batch_generator)
            yield x, torch.tanh(x @ teacher[0] / 8) @ teacher[1]

    def loss(model, x, y):
        return torch.nn.functional.mse_loss(model(x), y)

    return make_model, batches, loss


def train(task, steps, moment_dtype, offload, nvme_dir):
    make_model, batches, loss_of = task
    model = make_model()
    optimizer = zoe.torch.AdamW(
        model.parameters(), lr=demo.LR, betas=(0.9, 0.99), weight_decay=demo.WEIGHT_DECAY,
        offload=offload, nvme_path=nvme_dir if offload == "nvme" else None,
        moment_dtype=moment_dtype,
    )
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    losses = []
    for x, y in batches(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(model, x, y)
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
    optimizer.close()
    return losses


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tolerance", type=float, default=0.02,
                        help="largest relative excess of int8's final loss over fp32's")
    parser.add_argument("--offload", default="cpu", choices=["cpu", "nvme"])
    args = parser.parse_args()
    failed = False
    print(f"{'model':6} {'steps':>5} {'first loss':>10} {'fp32 final':>10} {'int8 final':>10} "
          f"{'difference':>10}")
    for name, task in (("gpt", gpt_task(args.seed)), ("mlp", mlp_task(args.seed))):
        final = {}
        for moment_dtype in ("fp32", "int8"):
            with tempfile.TemporaryDirectory(dir="/var/tmp") as nvme_dir:
                losses = train(task, args.steps, moment_dtype, args.offload, nvme_dir)
            final[moment_dtype] = sum(losses[-10:]) / len(losses[-10:])
        difference = final["int8"] / final["fp32"] - 1
        failed = failed or difference > args.tolerance
        print(f"{name:6} {args.steps:5d} {losses[0]:10.4f} {final['fp32']:10.4f} "
              f"{final['int8']:10.4f} {difference:+10.2%}")
    print(f"tolerance: int8's final loss at most {args.tolerance:.1%} above fp32's "
          "(mean of the last 10 steps)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
