#!/usr/bin/python3
"""Reference trajectories from torch.optim for tests/optim/torch_reference_test.cc.

Usage: torch_reference.py OUTPUT_DIR

Writes OUTPUT_DIR/manifest.json listing the cases and, per case, raw little-endian files:
  <name>.init.f32      initial parameters (n)
  <name>.grads.f32     gradients of every step (steps x n), already rounded to the case's dtype
  <name>.lrs.f64       learning rate of every step (a warm-up then cosine schedule)
  <name>.expected.f32  parameters after the last step
Exits 77 when torch cannot be imported (the test decides whether that is a skip or a failure).
"""
import json
import math
import os
import sys

try:
    import torch
except ImportError as error:  # pragma: no cover - depends on the machine
    print(f"torch is not importable: {error}", file=sys.stderr)
    sys.exit(77)

CASES = [
    dict(name="adamw_fp32", kind="adamw", grad_dtype="fp32", weight_decay=0.01),
    dict(name="adam_fp32", kind="adam", grad_dtype="fp32", weight_decay=0.01),
    dict(name="adagrad_fp32", kind="adagrad", grad_dtype="fp32", weight_decay=0.01, lr_decay=0.01),
    dict(name="adamw_bf16_grads", kind="adamw", grad_dtype="bf16", weight_decay=0.1),
]
N = 4099
STEPS = 100
BASE_LR = 1e-3


def schedule(step):
    """Ten steps of linear warm-up, then cosine decay to a tenth."""
    if step < 10:
        return BASE_LR * (step + 1) / 10
    progress = (step - 10) / (STEPS - 10)
    return BASE_LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(case, param):
    kind = case["kind"]
    if kind == "adamw":
        return torch.optim.AdamW([param], lr=BASE_LR, betas=(0.9, 0.999), eps=1e-8,
                                 weight_decay=case["weight_decay"], foreach=False)
    if kind == "adam":
        return torch.optim.Adam([param], lr=BASE_LR, betas=(0.9, 0.999), eps=1e-8,
                                weight_decay=case["weight_decay"], foreach=False)
    return torch.optim.Adagrad([param], lr=BASE_LR, lr_decay=case["lr_decay"], eps=1e-10,
                               weight_decay=case["weight_decay"], foreach=False)


def run_case(case, out_dir, seed):
    generator = torch.Generator().manual_seed(seed)
    init = torch.randn(N, generator=generator, dtype=torch.float32)
    grads = torch.randn(STEPS, N, generator=generator, dtype=torch.float32) * 0.1
    if case["grad_dtype"] == "bf16":
        grads = grads.to(torch.bfloat16).to(torch.float32)
    lrs = [schedule(step) for step in range(STEPS)]
    param = torch.nn.Parameter(init.clone())
    optimizer = make_optimizer(case, param)
    for step in range(STEPS):
        for group in optimizer.param_groups:
            group["lr"] = lrs[step]
        param.grad = grads[step].clone()
        optimizer.step()
    name = case["name"]
    init.numpy().tofile(os.path.join(out_dir, name + ".init.f32"))
    grads.numpy().tofile(os.path.join(out_dir, name + ".grads.f32"))
    torch.tensor(lrs, dtype=torch.float64).numpy().tofile(os.path.join(out_dir, name + ".lrs.f64"))
    param.detach().numpy().tofile(os.path.join(out_dir, name + ".expected.f32"))


def main():
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    out_dir = sys.argv[1]
    torch.set_num_threads(1)
    manifest = []
    for seed, case in enumerate(CASES):
        run_case(case, out_dir, seed)
        manifest.append(dict(case, n=N, steps=STEPS, beta1=0.9, beta2=0.999,
                             eps=1e-10 if case["kind"] == "adagrad" else 1e-8,
                             lr_decay=case.get("lr_decay", 0.0), torch=torch.__version__))
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
