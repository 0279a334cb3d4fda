#!/usr/bin/env python3
"""Seconds per iteration of ZeRO stage 3 through zoe.torch.initialize on the CPU twin of a GPU:
the model of bench/gpu_step.py (LAYERS x Linear(WIDTH, WIDTH) + ReLU, fp32) on the CPU, its
parameters paged into the engine's DEVICE tier on the host stand-in (as a CUDA model's are paged
into GPU memory), parameters and AdamW state on NVMe files under NVME_DIR. A small BATCH keeps
the CPU's compute out of the way, so the figures are zoe's paging, gradient streaming and step.

Prints one line per iteration (forward, backward, step, total seconds) after the first, and a
JSON object with the medians over ITERATIONS (default 4) iterations after the first (which
records the trace and creates the optimizer's state). Environment: LAYERS (8), WIDTH (4096),
BATCH (8), ITERATIONS (4), NVME_DIR (a temporary folder under /var/tmp).

  ZOE_LIBRARY=build/release/integrations/libzoe.so PYTHONPATH=integrations/python \\
    python3 bench/stage3_twin.py
"""
import functools
import json
import os
import shutil
import statistics
import tempfile
import time

import torch

import zoe
import zoe.torch as zt
import zoe.torch.ds_stage3 as ds_stage3
from gpu_step import LAYERS, WIDTH, make_model  # beside this file

BATCH = int(os.environ.get("BATCH", "8"))
ITERATIONS = int(os.environ.get("ITERATIONS", "4"))


def config(nvme_dir):
    nvme = {"device": "nvme", "nvme_path": nvme_dir}
    return {"train_micro_batch_size_per_gpu": BATCH,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": {"stage": 3, "offload_param": dict(nvme),
                                  "offload_optimizer": dict(nvme)},
            "zoe": {"device": "host", "log_level": "warn"}}


def main():
    # initialize pages a CPU model into HOST; the twin of a CUDA model pages into DEVICE
    ds_stage3.offload_parameters = functools.partial(ds_stage3.offload_parameters,
                                                     tier=zoe.Tier.DEVICE)
    nvme_dir = os.environ.get("NVME_DIR") or tempfile.mkdtemp(prefix="zoe-s3-twin-",
                                                              dir="/var/tmp")
    engine, _, _, _ = zt.initialize(model=make_model("cpu"), config=config(nvme_dir))
    x = torch.randn(BATCH, WIDTH)
    phases = {"forward": [], "backward": [], "step": [], "total": []}
    try:
        for iteration in range(ITERATIONS + 1):
            start = time.perf_counter()
            loss = engine(x).square().mean()
            forward = time.perf_counter()
            engine.backward(loss)
            backward = time.perf_counter()
            engine.step()
            end = time.perf_counter()
            if iteration == 0:
                continue
            for name, seconds in (("forward", forward - start), ("backward", backward - forward),
                                  ("step", end - backward), ("total", end - start)):
                phases[name].append(seconds)
            print(f"iteration {iteration}: forward {forward - start:.3f} backward "
                  f"{backward - forward:.3f} step {end - backward:.3f} total {end - start:.3f}",
                  flush=True)
    finally:
        engine.close()
        if "NVME_DIR" not in os.environ:
            shutil.rmtree(nvme_dir, ignore_errors=True)
    print(json.dumps({"params": LAYERS * (WIDTH * WIDTH + WIDTH), "batch": BATCH,
                      "iterations": ITERATIONS,
                      "median_seconds": {k: statistics.median(v) for k, v in phases.items()}}))


if __name__ == "__main__":
    main()
