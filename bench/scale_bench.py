#!/usr/bin/python3
"""Training beyond memory: a model of LAYERS x (Linear(WIDTH, WIDTH), ReLU) in fp32 trained by
zoe with its parameters and optimizer state on NVMe, inside a memory limit this benchmark sets up,
beside torch's AdamW on the same model under the same limit.

Each implementation runs in a child process that first moves itself into a memory cgroup made for
it (cgroup v2: memory.max, with memory.swap.max 0; v1: memory.limit_in_bytes, and
memory.memsw.limit_in_bytes where swap is accounted) and only then imports torch, so everything it
allocates counts. Making a cgroup needs root; without one, --limit 0 runs unlimited and the
figures say so. The peak is the cgroup's (v2 memory.peak where the kernel has it, v1
memory.max_usage_in_bytes), else the child's peak resident size.

zoe: `zoe.Engine` with `offload_param` and `offload_optimizer` on NVMe under --dir and no size key
(zoe sizes itself from the limit); the model built inside `zoe.torch.zero_init(engine)` when
zoe.torch has it, then `zoe.torch.offload_parameters(model, engine)` and
`zoe.torch.AdamW(model.parameters(), engine=engine)`. torch: the model built whole and
`torch.optim.AdamW`. Both: MSE against a random target, WARMUP untimed iterations, then STEPS
timed ones (forward, backward, step, zero_grad).

I/O bound: the NVMe bytes an iteration moves (the engine's tensor links nvme<->host and its
optimizer groups' bytes read and written) over the read and write rates `zoe bench io` measures
on --dir in the same run (1 MiB blocks, queue depth 32; the median of 3 alternating rounds each).
Where the time goes: per iteration and per phase (forward, backward, step), seconds, NVMe bytes
and the pager's stall time (acquires waiting for reads); per iteration the optimizer groups' I/O
wait and compute.

Output: JSON lines on stdout: one "io" line, then one "result" line per implementation, with
"killed" set when the limit killed it (its exit signal and the last iteration it finished).

  ZOE_LIBRARY=build/release/integrations/libzoe.so PYTHONPATH=integrations/python \\
    /usr/bin/python3 bench/scale_bench.py --layers 32 --width 4096 --limit 1G --steps 3
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "integrations", "python"))
from zoe.memory_limit import MemoryCgroup, parse_size  # noqa: E402  (no torch: the parent)


# ---- the disk's rates -----------------------------------------------------------------------


# Rounds of `zoe bench io` per direction, alternating: the disk (a shared one) is noisy, so the
# bound uses each direction's median.
DISK_ROUNDS = 3


def disk_rates(directory, size):
    """{"read": bytes/s, "write": bytes/s}: the medians of DISK_ROUNDS alternating runs of
    `zoe bench io` on ``directory``, with every round's figure under "samples"."""
    zoe_cli = os.path.join(ROOT, "build", "release", "bench", "zoe")
    samples = {"write": [], "read": []}
    for _ in range(DISK_ROUNDS):
        for rw in ("write", "read"):
            completed = subprocess.run(
                [zoe_cli, "bench", "io", "--rw", rw, "--bs", "1M", "--iodepth", "32", "--size",
                 str(size), "--path", directory, "--output-format=json"],
                capture_output=True, text=True, check=True)
            samples[rw].append(json.loads(completed.stdout)["jobs"][0]["bw_bytes"])
    rates = {rw: statistics.median(values) for rw, values in samples.items()}
    rates["samples"] = samples
    return rates


# ---- the child: one implementation inside the limit -------------------------------------------


def build_model(torch, layers, width):
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*blocks)


def zoe_setup(torch, args):
    """(model, optimizer, counters) for zoe: paged parameters and state on NVMe, no size key."""
    import zoe
    import zoe.torch

    engine = zoe.Engine({
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "nvme", "nvme_path": args.dir},
            "offload_param": {"device": "nvme", "nvme_path": args.dir},
        },
        "zoe": {"log_level": "warn", **({"slots": 1} if args.slots == 1 else {})},
    })
    zero_init = getattr(zoe.torch, "zero_init", None)
    if zero_init is not None:
        with zero_init(engine):
            model = build_model(torch, args.layers, args.width)
    else:
        model = build_model(torch, args.layers, args.width)
    pager = zoe.torch.offload_parameters(model, engine)
    optimizer = zoe.torch.AdamW(model.parameters(), lr=1e-4, engine=engine)
    return model, optimizer, lambda: zoe_counters(engine.stats()), {"zero_init": bool(zero_init),
                                                                    "pager": pager}


def zoe_counters(stats):
    """Cumulative NVMe bytes and seconds the engine reports."""
    links = stats["links"]
    groups = stats["groups"]
    return {
        "nvme_read_bytes": links["nvme_to_host"]["bytes"] + sum(g["bytes_read"] for g in groups),
        "nvme_write_bytes": links["host_to_nvme"]["bytes"] + sum(g["bytes_written"] for g in groups),
        "tensor_read_bytes": links["nvme_to_host"]["bytes"],
        "tensor_write_bytes": links["host_to_nvme"]["bytes"],
        "stall_s": stats["stall"]["nanoseconds"] / 1e9,
        "optimizer_io_wait_s": sum(g["io_wait_seconds"] for g in groups),
        "optimizer_compute_s": sum(g["compute_seconds"] for g in groups),
        "prefetch_hits": stats["prefetch"]["hits"],
        "prefetch_misses": stats["prefetch"]["misses"],
    }


def torch_setup(torch, args):
    model = build_model(torch, args.layers, args.width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, optimizer, dict, {}


def child(args):
    """Runs one implementation and prints its figures as one JSON line."""
    if args.cgroup:
        MemoryCgroup.join(args.cgroup)
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(os.cpu_count())
    setup = zoe_setup if args.child == "zoe" else torch_setup
    model, optimizer, counters, extra = setup(torch, args)
    x = torch.randn(args.batch, args.width)
    target = torch.randn(args.batch, args.width)
    iterations = []
    for index in range(args.warmup + args.steps):
        before = counters()
        start = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(x), target)
        forward_end, after_forward = time.perf_counter(), counters()
        loss.backward()
        backward_end, after_backward = time.perf_counter(), counters()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        end = time.perf_counter()
        after = counters()
        moved = {key: after[key] - before[key] for key in after}
        phases = {"forward": (before, after_forward), "backward": (after_forward, after_backward),
                  "step": (after_backward, after)}
        for phase, (first, last) in phases.items():
            for key in ("nvme_read_bytes", "nvme_write_bytes", "tensor_read_bytes",
                        "tensor_write_bytes", "stall_s"):
                if key in last:
                    moved[f"{phase}_{key}"] = last[key] - first[key]
        iterations.append({"seconds": end - start, "forward_s": forward_end - start,
                           "backward_s": backward_end - forward_end, "step_s": end - backward_end,
                           "loss": float(loss), **moved})
        print(json.dumps({"kind": "iteration", "index": index, **iterations[-1]}), flush=True)
    line = {"kind": "child", "iterations": iterations[args.warmup:],
            "all_losses": [it["loss"] for it in iterations],
            "ru_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    line.update({k: v for k, v in extra.items() if k != "pager"})
    if "pager" in extra:
        line["prefetch_hit_rate"] = extra["pager"].prefetch_hit_rate()
    print(json.dumps(line), flush=True)


# ---- the parent -----------------------------------------------------------------------------


def run_child(impl, args, rates):
    """Runs ``impl`` in a child inside its own cgroup; its "result" line."""
    cgroup = MemoryCgroup(args.limit, f"zoe-scale-{impl}-{os.getpid()}") if args.limit else None
    command = [sys.executable, os.path.abspath(__file__), "--child", impl, "--dir", args.dir,
               "--layers", str(args.layers), "--width", str(args.width), "--batch",
               str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--slots", str(args.slots)]
    if cgroup:
        command += ["--cgroup", cgroup.folder]
    started = time.perf_counter()
    completed = subprocess.run(command, capture_output=True, text=True)
    peak = cgroup.peak() if cgroup else None
    if cgroup:
        cgroup.remove()
    lines = [json.loads(l) for l in completed.stdout.splitlines() if l.startswith("{")]
    return summarize(impl, args, rates, lines, completed, peak, time.perf_counter() - started)


def summarize(impl, args, rates, lines, completed, peak, wall):
    params = args.layers * (args.width * args.width + args.width)
    result = {"kind": "result", "impl": impl, "params": params, "state_bytes": 16 * params,
              "limit_bytes": args.limit or None, "peak_bytes": peak, "wall_s": wall}
    final = next((l for l in lines if l["kind"] == "child"), None)
    if final is None:
        done = [l for l in lines if l["kind"] == "iteration"]
        result.update({"killed": True, "returncode": completed.returncode,
                       "iterations_finished": len(done),
                       "stderr_tail": completed.stderr[-800:]})
        return result
    timed = final.pop("iterations")
    final.pop("kind")
    result.update(final, killed=False)
    result["peak_bytes"] = peak or final["ru_maxrss_bytes"]
    result["state_over_peak"] = result["state_bytes"] / result["peak_bytes"]
    result["seconds_per_iteration"] = statistics.median(it["seconds"] for it in timed)
    if impl == "zoe":
        read = statistics.median(it["nvme_read_bytes"] for it in timed)
        written = statistics.median(it["nvme_write_bytes"] for it in timed)
        bound = read / rates["read"] + written / rates["write"]
        result.update(nvme_read_bytes=read, nvme_write_bytes=written, io_bound_s=bound,
                      over_io_bound=result["seconds_per_iteration"] / bound)
        phased = [f"{phase}_{key}" for phase in ("forward", "backward", "step")
                  for key in ("s", "nvme_read_bytes", "nvme_write_bytes", "tensor_read_bytes",
                              "tensor_write_bytes", "stall_s")]
        for key in phased + ["stall_s", "optimizer_io_wait_s", "optimizer_compute_s"]:
            result[key] = statistics.median(it[key] for it in timed)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--limit", type=parse_size, default=parse_size("1G"),
                        help="memory limit of each run (0: none)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--impls", default="zoe,torch")
    parser.add_argument("--dir", default=None, help="NVMe directory (default: under /var/tmp)")
    parser.add_argument("--io-size", type=parse_size, default=parse_size("2G"))
    parser.add_argument("--slots", type=int, choices=(1, 2), default=2,
                        help="zoe.slots: 1 halves the optimizer state's NVMe space (DeepSpeed's "
                             "layout; a failed step then needs a checkpoint load)")
    parser.add_argument("--child", choices=("zoe", "torch"), help=argparse.SUPPRESS)
    parser.add_argument("--cgroup", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    with tempfile.TemporaryDirectory(dir=args.dir or "/var/tmp", prefix="zoe-scale-") as work:
        args.dir = work
        rates = disk_rates(work, args.io_size)
        print(json.dumps({"kind": "io", "read_bytes_per_s": rates["read"],
                          "write_bytes_per_s": rates["write"], "samples": rates["samples"]}),
              flush=True)
        for impl in args.impls.split(","):
            print(json.dumps(run_child(impl, args, rates)), flush=True)


if __name__ == "__main__":
    main()
