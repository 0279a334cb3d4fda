#!/usr/bin/python3
"""ZeRO across data-parallel ranks: zoe's stages 1, 2 and 3 beside torch's own
ZeroRedundancyOptimizer(torch.optim.AdamW) and FullyShardedDataParallel with CPU offload, on the
same model, the same synthetic batches and the same ranks in one run.

N ranks are spawned with torch.multiprocessing and talk over gloo on this machine (a file
rendezvous in a temporary directory). The model is LAYERS x (Linear(WIDTH, WIDTH), ReLU) in fp32
(24 x 2048: 100.7 M parameters); every rank builds it from the same seed and takes its BATCH / N
rows of each global batch (the loss is the MSE against a random target). Implementations:

  zoe_s1_dram, zoe_s1_nvme   zoe.torch.AdamW(process_group=WORLD, zero_stage=1), state in DRAM
                             (offload="cpu") or on NVMe under the temporary directory, per rank
  zoe_s2_dram, zoe_s2_nvme   the same with zero_stage=2 (gradients reduced during backward)
  zoe_s3_dram, zoe_s3_nvme   zoe.torch.offload_parameters(model, engine, process_group=WORLD)
                             with zoe.torch.AdamW over the rank's shards; parameters and state
                             in DRAM, or both homed on NVMe (a small DRAM budget for parameters)
  torch_zero_adamw           DistributedDataParallel + ZeroRedundancyOptimizer(AdamW)
  fsdp_cpu_offload           FullyShardedDataParallel(cpu_offload=CPUOffload(offload_params=True));
                             torch 1.13 under Python 3.11 on a CPU-only build cannot run it: the
                             line says exactly what failed (see fsdp_attempt and fsdp_probe)

  ds_s1_dram ... ds_s3_nvme   the zoe implementation of the same stage and offload built by
                             zoe.torch.initialize from the DeepSpeed configuration (the same zoe
                             section; zero_optimization.offload_param at stage 3) and trained as
                             a DeepSpeed script does: engine(x), engine.backward(loss),
                             engine.step(); --initialize runs every zoe_* named as its ds_*

Each round runs every implementation in turn (in the opposite order on odd rounds): it builds the
model and optimizer, takes WARMUP untimed iterations (state creation, the trace) and STEPS timed
ones. Per iteration it measures the forward + backward and the optimizer step (their sum is the
iteration); per rank the optimizer state bytes, the bytes moved per tier per step and the time
in collectives:

  zoe stage 1 and 2   the optimizer's collective_seconds: wall time inside its (blocking)
                      collectives: gradient reductions, the agreed norm, the all-gather
  zoe stage 3         the pager's collective_seconds: wall time blocked issuing or waiting for
                      its all-gathers and gradient reductions (those finishing in the background
                      are not counted)
  torch ZeRO          the ZeroRedundancyOptimizer's parameter broadcasts (blocking, timed around
                      its _sync_params) plus DDP's gradient all-reduces, timed from issue to
                      completion by a communication hook equal to DDP's default (they run in the
                      background of backward, so this part overlaps compute)

State bytes: zoe, the rank's optimizer groups' fp32 master weights and moments (12 bytes per
element of its shard; where they live: pinned DRAM or NVMe, whose swap holds two slots per chunk);
torch ZeRO, the bytes of the local optimizer's state tensors (8 bytes per parameter it owns: it
needs no master copy for an fp32 model). Stage 3 also reports the rank's parameter shard bytes.

Memory per rank: the resident size when the implementation starts (rss_start_bytes: what the
ones before it left), at the end of its timed iterations (rss_bytes), and its peak in between
(peak_rss_bytes: the kernel's peak, started over for each implementation; the model it builds
and every iteration included). Linux keeps these counts per CPU and reports their sum without
the CPUs' pending deltas, so each reading is within nr_cpus x max(32, 2 x nr_cpus) pages of the
exact count either way (percpu_counter): a start read right after the peak was started over can
exceed the peak by twice that.

Breakdown per iteration (breakdown_*_s, the slowest rank per round, median over rounds): ds_*,
forward, backward and step (engine.stats(): the step includes the optimizer's parameter
all-gather at stages 1 and 2) and, inside them, the time blocked in reductions (stage 3's
gradient buckets), gathers (stage 3's parameter gathers) and optimizer_collectives (stages 1 and
2: the sharded optimizer's reductions, norm and all-gather, not split); zoe_*, stage 3 the
pager's gathers and reductions, stages 1 and 2 the optimizer's collectives;
torch ZeRO its DDP all-reduces (issue to completion, overlapping backward) as reductions and
its parameter broadcasts as gathers.

Output: JSON lines on stdout: one "fsdp" line, one "result" line per (ranks, implementation) with
medians over ROUNDS (of the slowest rank's per-round median: a step is as slow as its slowest
rank) and per-rank figures, one "targets" line per rank count; --samples adds every per-rank,
per-round sample. --small: a 263 K-parameter model, one round, for tests (< 60 s).

  ZOE_LIBRARY=build/release/integrations/libzoe.so PYTHONPATH=integrations/python \\
    /usr/bin/python3 bench/zero_bench.py --ranks 1,2,3 --rounds 3
"""

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ZOE_IMPLS = ["zoe_s1_dram", "zoe_s1_nvme", "zoe_s2_dram", "zoe_s2_nvme", "zoe_s3_dram",
             "zoe_s3_nvme"]
TORCH_IMPLS = ["torch_zero_adamw", "fsdp_cpu_offload"]
ALL_IMPLS = ZOE_IMPLS + TORCH_IMPLS
# zoe's implementations built through zoe.torch.initialize (--initialize makes zoe_* these).
INITIALIZE_IMPLS = ["ds" + impl[3:] for impl in ZOE_IMPLS]
HYPER = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
STATE_BYTES_PER_ELEMENT = 12  # zoe: fp32 master, exp_avg and exp_avg_sq
# Seconds per iteration by part (see breakdown() of each runner); a runner reports those it has.
BREAKDOWN = ("forward", "backward", "step", "reductions", "gathers", "optimizer_collectives")

LARGE = dict(width=2048, layers=24, batch=24, steps=3, warmup=1, rounds=3, chunk_size="16M",
             host_budget="6G", tensor_host_budget="2G", nvme_tensor_host_budget="64M",
             tensor_swap_bytes="1G")
SMALL = dict(width=256, layers=4, batch=12, steps=2, warmup=1, rounds=1, chunk_size="64K",
             host_budget="256M", tensor_host_budget="64M", nvme_tensor_host_budget="256K",
             tensor_swap_bytes="16M")


# --- the model and its batches ------------------------------------------------------------


def make_model(width, layers):
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*blocks)


def parameter_count(width, layers):
    return layers * (width * width + width)


def rank_batch(iteration, rank, world, width, batch):
    """This rank's rows of the global batch of ``iteration`` (the same on every run)."""
    generator = torch.Generator().manual_seed(1000 + iteration)
    x = torch.randn(batch, width, generator=generator)
    y = torch.randn(batch, width, generator=generator)
    rows = slice(batch * rank // world, batch * (rank + 1) // world)
    return x[rows], y[rows]


def status_bytes(field):
    """A size from /proc/self/status: "VmRSS" (resident now) or "VmHWM" (its peak)."""
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak_rss():
    """Starts the peak RSS (VmHWM) over from the resident size now (Linux: clear_refs 5), so each
    implementation's peak is its own; False where the kernel refuses it."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


# --- zoe ----------------------------------------------------------------------------------


def zoe_config(opts, stage, device, nvme_path, params_device=None, tensor_host_budget=None):
    section = {"device": device}
    if device == "nvme":
        section["nvme_path"] = nvme_path
        if opts.get("buffer_count"):
            section["buffer_count"] = opts["buffer_count"]
    zero = {"stage": stage, "offload_optimizer": section}
    if params_device is not None:
        zero["offload_param"] = {"device": params_device}
        if params_device == "nvme":
            zero["offload_param"]["nvme_path"] = nvme_path
    zoe_section = {"chunk_size": opts["chunk_size"], "host_budget": opts["host_budget"],
                   "log_level": "warn"}
    if params_device is None:
        zoe_section["tensor_swap_bytes"] = "1M"
    else:
        zoe_section["tensor_host_budget"] = tensor_host_budget
        zoe_section["tensor_swap_bytes"] = opts["tensor_swap_bytes"]
    return {"zero_optimization": zero, "zoe": zoe_section}


def pager_figures(pager):
    """A stage 3 pager's stats(): its shard bytes, peak gathered bytes and gathers (cumulative:
    those issued, and the uses that found a parameter kept for backward instead)."""
    gathers = pager["gathers"]
    return {"param_shard_bytes": pager["shard_bytes"],
            "peak_gathered_bytes": pager["peak_gathered_bytes"],
            "gathers_issued": gathers["prefetched"] + gathers["on_demand"],
            "gathers_kept": gathers["kept"]}


def engine_figures(stats):
    """Optimizer state bytes by where they live, the optimizer's NVMe traffic, and the tiers'
    link bytes (cumulative counters of zoe.Engine.stats())."""
    groups = stats.get("groups", [])
    figures = {
        "state_elements": sum(group["parameters"] for group in groups),
        "state_pinned_bytes": sum(group["pinned_bytes"] for group in groups),
        "state_nvme_bytes": sum(group["nvme_bytes"] for group in groups),
        "optimizer_nvme_read": sum(group["bytes_read"] for group in groups),
        # state the step found in its pipeline's buffers (cached) instead of reading it again
        "optimizer_nvme_reused": sum(group["bytes_reused"] for group in groups),
        "optimizer_nvme_written": sum(group["bytes_written"] for group in groups),
    }
    for link, counters in stats.get("links", {}).items():
        figures["link_" + link] = counters["bytes"]
    return figures


class ZoeStage12:
    """zoe.torch.AdamW sharded across the ranks (stage 1 or 2)."""

    def __init__(self, model, stage, device, directory, rank, opts):
        import zoe.torch

        path = os.path.join(directory, "nvme-{rank}")
        self.optimizer = zoe.torch.AdamW(
            model.parameters(), **HYPER, process_group=dist.group.WORLD, zero_stage=stage,
            config=zoe_config(opts, stage, device, path),
        )

    def zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)

    def step(self):
        self.optimizer.step()

    def collective_seconds(self):
        return self.optimizer.collective_seconds

    def breakdown(self):
        return {"optimizer_collectives": self.optimizer.collective_seconds}

    def counters(self):
        return engine_figures(self.optimizer.engine.stats())

    def close(self):
        self.optimizer.close()


class ZoeStage3:
    """zoe.torch.offload_parameters(process_group=WORLD) and zoe.torch.AdamW over the shards."""

    def __init__(self, model, device, directory, rank, opts):
        import zoe
        import zoe.torch

        path = os.path.join(directory, f"nvme-{rank}")
        os.makedirs(path, exist_ok=True)
        budget = opts["tensor_host_budget"] if device == "cpu" else opts[
            "nvme_tensor_host_budget"]
        self.engine = zoe.Engine(zoe_config(opts, 3, device, path, params_device=device,
                                            tensor_host_budget=budget))
        home = zoe.Tier.HOST if device == "cpu" else zoe.Tier.NVME
        self.pager = zoe.torch.offload_parameters(model, self.engine, home=home,
                                                  process_group=dist.group.WORLD)
        self.optimizer = zoe.torch.AdamW(self.pager.shard_parameters(), **HYPER,
                                         engine=self.engine)

    def zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)

    def step(self):
        self.optimizer.step()

    def collective_seconds(self):
        return self.pager.collective_seconds

    def breakdown(self):
        return {"gathers": self.pager.gather_seconds, "reductions": self.pager.reduction_seconds}

    def counters(self):
        figures = engine_figures(self.engine.stats())
        figures.update(pager_figures(self.pager.stats()))
        return figures

    def close(self):
        self.pager.remove()
        self.optimizer.close()
        self.engine.close()


class ZoeInitialize:
    """zoe.torch.initialize with the DeepSpeed configuration of the implementation's stage and
    offload (the same zoe section as ZoeStage12 / ZoeStage3); the loop is DeepSpeed's:
    engine(x), engine.backward(loss), engine.step()."""

    def __init__(self, model, stage, device, directory, rank, world, opts):
        import zoe.torch

        path = os.path.join(directory, "nvme-{rank}")
        if stage == 3:
            budget = opts["tensor_host_budget"] if device == "cpu" else opts[
                "nvme_tensor_host_budget"]
            config = zoe_config(opts, 3, device, path, params_device=device,
                                tensor_host_budget=budget)
        else:
            config = zoe_config(opts, stage, device, path)
        config.update(train_batch_size=opts["batch"], train_micro_batch_size_per_gpu=opts[
            "batch"] // world, optimizer={"type": "AdamW", "params": dict(
                HYPER, betas=list(HYPER["betas"]))})
        self.engine, self.optimizer, _, _ = zoe.torch.initialize(
            model=model, config=config, process_group=dist.group.WORLD)

    def zero_grad(self):
        pass  # engine.step() zeroes the gradients

    def forward_backward(self, x, y):
        self.engine.backward(torch.nn.functional.mse_loss(self.engine(x), y))

    def step(self):
        self.engine.step()

    def collective_seconds(self):
        stats = self.engine.stats()
        return stats["reductions"] + stats["gathers"] + stats["optimizer_collectives"]

    def breakdown(self):
        """The engine's stats(): seconds per part of the loop and in collectives."""
        stats = self.engine.stats()
        return {key: stats[key] for key in BREAKDOWN}

    def counters(self):
        figures = engine_figures(self.optimizer.engine.stats())
        pager = self.engine.stats().get("pager")
        if pager is not None:
            figures.update(pager_figures(pager))
        return figures

    def close(self):
        self.engine.close()


# --- torch --------------------------------------------------------------------------------


class TorchZero:
    """DistributedDataParallel + ZeroRedundancyOptimizer(torch.optim.AdamW)."""

    def __init__(self, model, world):
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        self.world = world
        self.reduce_seconds = 0.0
        self.broadcast_seconds = 0.0
        self.model = DistributedDataParallel(model)
        self.model.register_comm_hook(None, self._timed_all_reduce)
        self.optimizer = ZeroRedundancyOptimizer(model.parameters(),
                                                 optimizer_class=torch.optim.AdamW, **HYPER)
        sync = self.optimizer._sync_params

        def timed_sync(*args, **kwargs):  # issues every rank's broadcasts and waits for them
            start = time.perf_counter()
            try:
                return sync(*args, **kwargs)
            finally:
                self.broadcast_seconds += time.perf_counter() - start

        self.optimizer._sync_params = timed_sync

    def _timed_all_reduce(self, _state, bucket):
        """DDP's default hook (divide by N, all-reduce), timed from issue to completion."""
        start = time.perf_counter()
        tensor = bucket.buffer().div_(self.world)
        future = dist.all_reduce(tensor, async_op=True).get_future()

        def finished(done):
            self.reduce_seconds += time.perf_counter() - start
            return done.value()[0]

        return future.then(finished)

    def zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)

    def step(self):
        self.optimizer.step()

    def collective_seconds(self):
        return self.reduce_seconds + self.broadcast_seconds

    def breakdown(self):
        """DDP's all-reduces (issue to completion, overlapping backward) as reductions, the
        ZeroRedundancyOptimizer's parameter broadcasts as gathers."""
        return {"reductions": self.reduce_seconds, "gathers": self.broadcast_seconds}

    def counters(self):
        state = self.optimizer.optim.state
        bytes_ = sum(value.numel() * value.element_size() for entry in state.values()
                     for value in entry.values() if torch.is_tensor(value))
        return {"state_bytes": bytes_, "ddp_reduce_seconds": self.reduce_seconds,
                "zero_broadcast_seconds": self.broadcast_seconds}

    def close(self):
        pass


def fsdp_attempt():
    """What happens when this rank builds FSDP with CPU offload: the exception, as text."""
    try:
        from torch.distributed.fsdp import CPUOffload
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        model = make_model(8, 1)
        wrapped = FSDP(model, cpu_offload=CPUOffload(offload_params=True))
        wrapped(torch.randn(2, 8)).sum().backward()
        return None
    except Exception as error:  # reported, never hidden
        return f"{type(error).__name__}: {error}"


FSDP_PROBE = r"""
# Past the import failure (a dataclass default that Python 3.11 rejects), what does FSDP do?
import dataclasses, os, sys
original = dataclasses._get_field
def lenient(cls, name, kind, *rest):
    value = cls.__dict__.get(name, dataclasses.MISSING)
    if (isinstance(value, dataclasses.Field) and value.default is not dataclasses.MISSING
            and type(value.default).__hash__ is None):
        default, value.default = value.default, dataclasses.MISSING
        value.default_factory = lambda: default
    return original(cls, name, kind, *rest)
dataclasses._get_field = lenient
import torch, torch.distributed as dist
from torch.distributed.fsdp import CPUOffload, FullyShardedDataParallel as FSDP
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
model = torch.nn.Sequential(torch.nn.Linear(8, 8))
try:
    wrapped = FSDP(model, cpu_offload=CPUOffload(offload_params=True))
except Exception as error:
    print(f"constructor: {type(error).__name__}: {error}")
    wrapped = None
if wrapped is not None:
    try:
        wrapped(torch.randn(2, 8)).sum().backward()
        print("ran")
    except Exception as error:
        print(f"forward: {type(error).__name__}: {error}")
"""


def fsdp_probe(directory):
    """FSDP run past its import failure in a separate interpreter: what fails next."""
    result = subprocess.run([sys.executable, "-c", FSDP_PROBE,
                             os.path.join(directory, "fsdp-probe-rendezvous")],
                            capture_output=True, text=True, timeout=120)
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    if lines:
        return lines[-1]
    return "probe failed: " + (result.stderr.strip().splitlines() or ["no output"])[-1]


# --- one implementation on one rank -------------------------------------------------------


def build(impl, model, world, rank, directory, opts):
    if impl.startswith(("zoe_s", "ds_s")):
        stage = int(impl.split("_")[1][1])
        device = "cpu" if impl.endswith("dram") else "nvme"
        if impl.startswith("ds_"):
            return ZoeInitialize(model, stage, device, directory, rank, world, opts)
        if stage == 3:
            return ZoeStage3(model, device, directory, rank, opts)
        return ZoeStage12(model, stage, device, directory, rank, opts)
    if impl == "torch_zero_adamw":
        return TorchZero(model, world)
    raise ValueError(f"unknown implementation {impl!r}")


def iterate(runner, model, iteration, rank, world, opts):
    """One iteration; returns (forward + backward seconds, step seconds)."""
    x, y = rank_batch(iteration, rank, world, opts["width"], opts["batch"])
    start = time.perf_counter()
    runner.zero_grad()
    if isinstance(runner, ZoeInitialize):
        runner.forward_backward(x, y)
    else:
        forward = runner.model if isinstance(runner, TorchZero) else model
        torch.nn.functional.mse_loss(forward(x), y).backward()
    middle = time.perf_counter()
    runner.step()
    return middle - start, time.perf_counter() - middle


def run_impl(impl, world, rank, directory, opts):
    """Builds, warms up and times ``impl`` on this rank; returns its sample."""
    workdir = os.path.join(directory, impl)
    os.makedirs(workdir, exist_ok=True)
    peak_reset = reset_peak_rss()
    rss_start = status_bytes("VmRSS")
    model = make_model(opts["width"], opts["layers"])
    runner = build(impl, model, world, rank, workdir, opts)
    try:
        for iteration in range(opts["warmup"]):
            iterate(runner, model, iteration, rank, world, opts)
        dist.barrier()
        before_counters, before_collectives = runner.counters(), runner.collective_seconds()
        before_breakdown = runner.breakdown()
        forward_backward, steps = [], []
        for iteration in range(opts["warmup"], opts["warmup"] + opts["steps"]):
            fb, step = iterate(runner, model, iteration, rank, world, opts)
            forward_backward.append(fb)
            steps.append(step)
        after = runner.counters()
        collectives = runner.collective_seconds() - before_collectives
        sample = {"impl": impl, "world": world, "rank": rank, "forward_backward_s":
                  forward_backward, "step_s": steps,
                  "iteration_s": [a + b for a, b in zip(forward_backward, steps)],
                  "collective_s_per_iteration": collectives / opts["steps"],
                  "rss_bytes": status_bytes("VmRSS"), "rss_start_bytes": rss_start,
                  "peak_rss_bytes": status_bytes("VmHWM") if peak_reset else None}
        sample.update(per_step_figures(before_counters, after, opts["steps"]))
        for key, value in runner.breakdown().items():
            sample["breakdown_" + key] = (value - before_breakdown[key]) / opts["steps"]
        return sample
    finally:
        runner.close()
        dist.barrier()
        shutil.rmtree(workdir, ignore_errors=True)


def per_step_figures(before, after, steps):
    """Static figures as they are; the cumulative byte and gather counters per step."""
    out = {}
    for key, value in after.items():
        if key.startswith(("optimizer_nvme_", "link_", "gathers_")):
            out[key + "_per_step"] = (value - before.get(key, 0)) / steps
        elif not key.endswith("_seconds"):
            out[key] = value
    if "state_elements" in out:
        out["state_bytes"] = out["state_elements"] * STATE_BYTES_PER_ELEMENT
    return out


def rank_main(rank, world, impls, opts, directory):
    dist.init_process_group("gloo", init_method="file://" + os.path.join(directory, "rendezvous"),
                            rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    torch.set_num_threads(max(1, opts["threads"] // world))
    out_path = os.path.join(directory, f"samples-{world}-{rank}.jsonl")
    with open(out_path, "w", encoding="utf-8") as out:
        runnable = [impl for impl in impls if impl != "fsdp_cpu_offload"]
        for round_ in range(opts["rounds"]):
            order = runnable if round_ % 2 == 0 else list(reversed(runnable))
            for impl in order:
                sample = run_impl(impl, world, rank, directory, opts)
                sample["round"] = round_
                out.write(json.dumps(sample) + "\n")
                out.flush()
        if "fsdp_cpu_offload" in impls:  # last: a failed import leaves modules half-loaded
            out.write(json.dumps({"impl": "fsdp_cpu_offload", "world": world, "rank": rank,
                                  "error": fsdp_attempt()}) + "\n")
    dist.barrier()  # no rank leaves while a peer still talks to it
    dist.destroy_process_group()


# --- the parent: spawn, then summarize ----------------------------------------------------


def median_of_slowest(samples, key):
    """Per round the slowest rank's median of ``key``; the median over rounds."""
    rounds = {}
    for sample in samples:
        value = statistics.median(sample[key]) if isinstance(sample[key], list) else sample[key]
        rounds[sample["round"]] = max(rounds.get(sample["round"], 0.0), value)
    return statistics.median(rounds.values())


def summarize(world, impl, samples, opts):
    last_round = max(sample["round"] for sample in samples)
    last = sorted((s for s in samples if s["round"] == last_round), key=lambda s: s["rank"])
    result = {"kind": "result", "world": world, "impl": impl, "rounds": last_round + 1,
              "steps_per_round": opts["steps"], "parameters": opts["parameters"]}
    for key in ("iteration_s", "forward_backward_s", "step_s", "collective_s_per_iteration"):
        result[key] = median_of_slowest(samples, key)
    for key in sorted(k for k in last[0] if k.startswith("breakdown_")):
        result[key + "_s"] = median_of_slowest(samples, key)
    result["state_bytes_per_rank"] = [s["state_bytes"] for s in last]
    for key in sorted(last[0]):
        if key.endswith("_per_step") or key in ("state_pinned_bytes", "state_nvme_bytes",
                                                 "param_shard_bytes", "peak_gathered_bytes",
                                                 "rss_bytes", "rss_start_bytes",
                                                 "peak_rss_bytes"):
            result[key + ("" if key.endswith("_per_step") else "_per_rank")] = [
                s.get(key) for s in last]
    if impl.startswith(("zoe_", "ds_")):
        total = opts["parameters"] * STATE_BYTES_PER_ELEMENT
        chunk = opts["chunk_bytes"] // 4 * STATE_BYTES_PER_ELEMENT  # one sub-group's state
        result["state_bytes_total"] = total
        result["one_chunk_state_bytes"] = chunk
        result["state_target_met"] = all(b <= total / world + chunk
                                         for b in result["state_bytes_per_rank"])
    return result


def read_samples(directory, world):
    """Every sample the ranks wrote (complete lines only)."""
    samples = []
    for rank in range(world):
        path = os.path.join(directory, f"samples-{world}-{rank}.jsonl")
        if os.path.exists(path):
            with open(path, encoding="utf-8") as lines:
                samples += [json.loads(line) for line in lines if line.endswith("\n")]
    return samples


def run_world(world, impls, opts, emit, samples_too):
    """Runs every implementation on ``world`` ranks; returns the result lines by name, or None
    when a rank died (its "error" line and the samples taken before are printed)."""
    directory = tempfile.mkdtemp(prefix=f"zoe-zero-bench-{world}-", dir=opts["dir"])
    try:
        mp.start_processes(rank_main, args=(world, impls, opts, directory), nprocs=world,
                           join=True, start_method="spawn")
        failure = None
    except Exception as error:  # a rank killed (out of memory) or raising: say so, keep going
        failure = f"{type(error).__name__}: {error}"
    finally:
        samples = read_samples(directory, world)
        shutil.rmtree(directory, ignore_errors=True)
    if samples_too or failure:
        for sample in samples:
            emit(dict(kind="sample", **sample))
    if failure:
        emit({"kind": "error", "world": world, "error": failure,
              "samples_before": len(samples)})
        return None
    results = {}
    for impl in impls:
        mine = [s for s in samples if s["impl"] == impl]
        if impl == "fsdp_cpu_offload":
            ran = bool(mine) and all(s["error"] is None for s in mine)
            results[impl] = {"kind": "fsdp", "world": world, "impl": impl, "ran": ran,
                             "fsdp_attempt": sorted({s["error"] or "ran" for s in mine}),
                             "fsdp_probe": opts.get("fsdp_probe")}
        else:
            results[impl] = summarize(world, impl, mine, opts)
        emit(results[impl])
    return results


def targets(world, results):
    zoe_results = [r for r in results.values() if r["impl"].startswith(("zoe_", "ds_"))]
    line = {"kind": "targets", "world": world,
            "state_bytes_within_one_chunk_of_1_over_n": {
                r["impl"]: r["state_target_met"] for r in zoe_results}}
    fsdp = results.get("fsdp_cpu_offload")
    if fsdp is not None and not fsdp["ran"]:
        line["step_time_vs_fsdp"] = "not measured: FSDP with CPU offload did not run here"
    torch_zero = results.get("torch_zero_adamw")
    if torch_zero is not None:
        line["iteration_s_ratio_to_torch_zero"] = {
            r["impl"]: r["iteration_s"] / torch_zero["iteration_s"] for r in zoe_results}
    return line


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="1,2,3", help="comma list of rank counts")
    parser.add_argument("--impls", default=",".join(ALL_IMPLS), help="comma list of: " +
                        ", ".join(ALL_IMPLS + INITIALIZE_IMPLS) + " (ds_*: zoe's through "
                        "zoe.torch.initialize)")
    parser.add_argument("--small", action="store_true", help="a 263 K-parameter model, one "
                        "round (for tests)")
    for key in ("width", "layers", "batch", "steps", "warmup", "rounds"):
        parser.add_argument("--" + key, type=int)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="CPU threads shared by the ranks (each gets threads / N)")
    parser.add_argument("--dir", default="/var/tmp", help="where the temporary directories "
                        "(rendezvous, NVMe state) go")
    parser.add_argument("--samples", action="store_true", help="also print every sample")
    parser.add_argument("--buffer-count", type=int, default=None,
                        help="offload_optimizer.buffer_count of the NVMe implementations "
                             "(DeepSpeed's key: pipeline buffers, which also bound the chunks "
                             "read ahead while gradients arrive; default: automatic)")
    parser.add_argument("--initialize", action="store_true", help="run zoe's implementations "
                        "zoe_* as ds_*: built through zoe.torch.initialize (the DeepSpeed "
                        "configuration of their stage and offload) and trained with engine(x), "
                        "engine.backward(loss), engine.step()")
    args = parser.parse_args()
    opts = dict(SMALL if args.small else LARGE)
    for key in ("width", "layers", "batch", "steps", "warmup", "rounds"):
        if getattr(args, key) is not None:
            opts[key] = getattr(args, key)
    worlds = [int(n) for n in args.ranks.split(",")]
    impls = args.impls.split(",")
    unknown = sorted(set(impls) - set(ALL_IMPLS) - set(INITIALIZE_IMPLS))
    if unknown:
        parser.error(f"unknown implementations {unknown}; allowed: {ALL_IMPLS + INITIALIZE_IMPLS}")
    if args.initialize:
        impls = ["ds" + impl[3:] if impl in ZOE_IMPLS else impl for impl in impls]
    if any(n < 1 for n in worlds) or any(opts["batch"] % n for n in worlds):
        parser.error(f"--ranks must be positive and divide the batch of {opts['batch']}")
    if opts["steps"] < 1 or opts["rounds"] < 1:
        parser.error("--steps and --rounds must be at least 1")
    opts.update(threads=args.threads, dir=args.dir, buffer_count=args.buffer_count,
                parameters=parameter_count(opts["width"], opts["layers"]),
                chunk_bytes=_size(opts["chunk_size"]))
    return args, worlds, impls, opts


def _size(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def main():
    args, worlds, impls, opts = parse_args()

    def emit(line):
        print(json.dumps(line), flush=True)

    emit({"kind": "config", "parameters": opts["parameters"], "width": opts["width"],
          "layers": opts["layers"], "batch": opts["batch"], "steps": opts["steps"],
          "warmup": opts["warmup"], "rounds": opts["rounds"], "threads": opts["threads"],
          "chunk_size": opts["chunk_size"], "buffer_count": opts["buffer_count"],
          "ranks": worlds, "impls": impls,
          "torch": torch.__version__, "python": sys.version.split()[0],
          "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")})
    if "fsdp_cpu_offload" in impls:
        probe_dir = tempfile.mkdtemp(prefix="zoe-fsdp-probe-", dir=opts["dir"])
        try:
            opts["fsdp_probe"] = fsdp_probe(probe_dir)
        except Exception:  # the probe is informative only; say what went wrong
            opts["fsdp_probe"] = "probe failed: " + traceback.format_exc().splitlines()[-1]
        finally:
            shutil.rmtree(probe_dir, ignore_errors=True)
    failed = False
    for world in worlds:
        results = run_world(world, impls, opts, emit, args.samples)
        if results is None:
            failed = True
            continue
        emit(targets(world, results))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
