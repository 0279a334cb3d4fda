#!/usr/bin/env python3
"""Seconds per training iteration of a model on a GPU, as a ZeRO-Offload user sees them.

The model is LAYERS x Linear(WIDTH, WIDTH) + ReLU in fp32 on CUDA device 0, fed BATCH rows; one
iteration is forward, backward and the optimizer step:

  torch_gpu         torch.optim.AdamW(fused=True) with its state in GPU memory: the speed of
                    keeping everything on the GPU, which offloading trades for memory
  compute_only      forward and backward alone: the floor an overlapped step can approach
  zoe_cpu_after     zoe.torch.AdamW(offload="cpu"): gradients copied to pinned DRAM after
                    backward, the step on the CPU, the parameters copied back
  zoe_cpu_overlap   the same inside `with optimizer.overlap():` (each gradient copied and its
                    chunks updated as backward produces it)
  zoe_nvme_overlap  zoe_cpu_overlap with the optimizer state on NVMe files under NVME_DIR
  zoe_s3_nvme       zoe.torch.initialize from a DeepSpeed configuration, ZeRO stage 3 with the
                    parameters and the optimizer state on NVMe files (sizes left to zoe):
                    engine(x), engine.backward(loss), engine.step()

Each round runs every variant in turn (reversed on odd rounds): WARMUP untimed iterations, then
STEPS timed ones (CUDA synchronised at both ends); a round's figure is the median of its steps,
the reported one the median over ROUNDS rounds. Also reported: the bytes of one step's state, the
device's peak memory per variant, and overlap_hidden = the part of zoe_cpu_after's extra time over
compute_only that zoe_cpu_overlap removes. One JSON object on stdout (and to OUTPUT if set); a
variant that raises is reported under "errors" (the others still run) and the exit status is 1.
Environment: LAYERS (8), WIDTH (4096), BATCH (4096), STEPS (5), WARMUP (2), ROUNDS (3),
IMPLS (comma list; default all), NVME_DIR (a temporary folder under /var/tmp or /tmp).

  ZOE_LIBRARY=build/release/integrations/libzoe.so PYTHONPATH=integrations/python \\
    python3 bench/gpu_step.py
"""
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

import zoe
import zoe.torch as zt

LAYERS = int(os.environ.get("LAYERS", "8"))
WIDTH = int(os.environ.get("WIDTH", "4096"))
BATCH = int(os.environ.get("BATCH", "4096"))
STEPS = int(os.environ.get("STEPS", "5"))
WARMUP = int(os.environ.get("WARMUP", "2"))
ROUNDS = int(os.environ.get("ROUNDS", "3"))
HYPER = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
IMPLS = ["torch_gpu", "compute_only", "zoe_cpu_after", "zoe_cpu_overlap", "zoe_nvme_overlap",
         "zoe_s3_nvme"]


def make_model(device="cuda"):
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers).to(device)


def engine_config(offload, nvme_dir):
    section = {"device": offload}
    if offload == "nvme":
        section["nvme_path"] = nvme_dir
    params = LAYERS * (WIDTH * WIDTH + WIDTH)
    state = 12 * params  # fp32 master + two fp32 moments
    return {"zero_optimization": {"stage": 3, "offload_optimizer": section},
            "zoe": {"device": os.environ.get("ZOE_DEVICE", "cuda"),
                    "host_budget": 3 * state + (2 << 30),
                    # the gradient staging of a device group is a zoe tensor: 4 bytes a param
                    "tensor_swap_bytes": 2 * 4 * params + (256 << 20),
                    "log_level": "warn"}}


def stage3_config(nvme_dir):
    nvme = {"device": "nvme", "nvme_path": nvme_dir}
    return {"train_micro_batch_size_per_gpu": BATCH,
            "optimizer": {"type": "AdamW", "params": dict(HYPER)},
            "zero_optimization": {"stage": 3, "offload_param": dict(nvme),
                                  "offload_optimizer": dict(nvme)},
            "zoe": {"log_level": "warn"}}


class Variant:
    """One way of training the model: build() once per round, iterate() per step, close()."""

    def __init__(self, name, nvme_dir):
        self.name, self.nvme_dir = name, nvme_dir
        self.engine = self.optimizer = None

    def build(self):
        self.model = make_model()
        if self.name == "zoe_s3_nvme":
            self.engine, _, _, _ = zt.initialize(model=self.model,
                                                 config=stage3_config(self.nvme_dir))
        elif self.name == "torch_gpu":
            self.optimizer = torch.optim.AdamW(self.model.parameters(), fused=True, **HYPER)
        elif self.name.startswith("zoe_"):
            offload = "nvme" if "nvme" in self.name else "cpu"
            self.engine = zoe.Engine(engine_config(offload, self.nvme_dir))
            self.optimizer = zt.AdamW(self.model.parameters(), engine=self.engine, **HYPER)
        self.x = torch.randn(BATCH, WIDTH, device="cuda", generator=None)

    def iterate(self):
        if self.name == "zoe_s3_nvme":
            loss = self.engine(self.x).square().mean()
            self.engine.backward(loss)
            self.engine.step()
            return loss
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        loss = self.model(self.x).square().mean()
        if self.name.endswith("_overlap"):
            with self.optimizer.overlap():
                loss.backward()
        else:
            loss.backward()
        if self.optimizer is not None:
            self.optimizer.step()
        else:
            for p in self.model.parameters():
                p.grad = None
        return loss

    def close(self):
        if hasattr(self.optimizer, "close"):
            self.optimizer.close()
        if self.engine is not None:
            self.engine.close()
        self.engine = self.optimizer = self.model = self.x = None
        torch.cuda.empty_cache()


def timed_round(variant):
    try:
        variant.build()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(WARMUP):
            variant.iterate()
        times, losses = [], []
        for _ in range(STEPS):
            torch.cuda.synchronize()
            start = time.perf_counter()
            loss = variant.iterate()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            losses.append(float(loss.detach()))
        peak = torch.cuda.max_memory_allocated()
    finally:
        variant.close()
    return statistics.median(times), peak, losses


def main():
    impls = os.environ.get("IMPLS", ",".join(IMPLS)).split(",")
    parent = "/var/tmp" if os.path.isdir("/var/tmp") else None
    nvme_dir = os.environ.get("NVME_DIR") or tempfile.mkdtemp(prefix="zoe-gpu-step-", dir=parent)
    figures = {name: [] for name in impls}
    peaks, losses, errors = {}, {}, {}
    try:
        for round_index in range(ROUNDS):
            order = impls if round_index % 2 == 0 else impls[::-1]
            for name in order:
                if name in errors:
                    continue
                try:
                    seconds, peak, round_losses = timed_round(Variant(name, nvme_dir))
                except Exception as error:  # reported below; the other variants still run
                    errors[name] = f"{type(error).__name__}: {error}"
                    print(f"round {round_index} {name}: {errors[name]}", file=sys.stderr)
                    torch.cuda.empty_cache()
                    continue
                figures[name].append(seconds)
                peaks[name] = peak
                losses[name] = round_losses
                print(f"round {round_index} {name}: {seconds:.4f} s", file=sys.stderr, flush=True)
    finally:
        if "NVME_DIR" not in os.environ:
            shutil.rmtree(nvme_dir, ignore_errors=True)
    params = LAYERS * (WIDTH * WIDTH + WIDTH)
    result = {
        "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
        "zoe": zoe.version(), "params": params, "state_bytes": 12 * params,
        "layers": LAYERS, "width": WIDTH, "batch": BATCH, "steps": STEPS, "rounds": ROUNDS,
        "seconds_per_iteration": {n: statistics.median(v) for n, v in figures.items() if v},
        "rounds_seconds": figures, "device_peak_bytes": peaks,
        "last_losses": {n: v[-1] for n, v in losses.items()}, "errors": errors,
    }
    s = result["seconds_per_iteration"]
    if {"compute_only", "zoe_cpu_after", "zoe_cpu_overlap"} <= s.keys():
        extra = s["zoe_cpu_after"] - s["compute_only"]
        result["overlap_hidden"] = (s["zoe_cpu_after"] - s["zoe_cpu_overlap"]) / extra if extra > 0 else None
    text = json.dumps(result, indent=1)
    print(text)
    if os.environ.get("OUTPUT"):
        with open(os.environ["OUTPUT"], "w") as f:
            f.write(text + "\n")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
