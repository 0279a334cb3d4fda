#!/usr/bin/env python3
"""What offloading activations costs and saves: eight nn.TransformerEncoderLayer(128, 4, 512,
dropout=0, batch_first=True) in fp32 on the CPU, one forward + backward per iteration, with the
saved activations kept (torch), moved to NVMe (``offload_activations(device="nvme")``), or, for
the CPU twin of a GPU model, moved to pinned DRAM (``device="cpu"``, HostTwin).

Each (mode, sequence length, measure) runs in a child process of its own: it builds the model,
the input (TOKENS tokens: batch = TOKENS / sequence length) and the engine, runs one warm-up
iteration (which registers the activation slots and allocates the pinned buffers), then
ITERATIONS measured ones (a time child) or one (a memory child, run with
MALLOC_MMAP_THRESHOLD_=131072 so that glibc returns freed tensors at once and VmRSS follows the
memory in use). Before each, VmHWM is reset (``/proc/self/clear_refs`` 5) and VmRSS read; the
iteration's peak memory growth is VmHWM after it minus that VmRSS. ``growth_with_pool`` also
counts what the warm-up allocated for zoe (its pinned buffers): VmHWM minus VmRSS before the
engine existed. Rounds alternate the modes (the order reversed on odd rounds); a figure is the
median over the rounds of each child's median; the time ratio is the median over the rounds of
the ratio to the keep child of the same round, and "best" the fastest iteration of all rounds.
Gradients are compared by SHA-256 across modes. With --interleaved N, instead one process per
sequence length alternates keeping and each offloading mode iteration by iteration, N timed
iterations each: times only, none of the children's differences.
Prints a JSON line per child and a table:

    /usr/bin/python3 bench/activation_bench.py --seq 512,1024,2048,4096 --rounds 3

(ZOE_LIBRARY and PYTHONPATH as for the tests; --nvme-dir picks the swap directory.)
"""

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

TOKENS = 4096
MiB = 1 << 20
BUCKET = 8 * MiB  # offload_activations(bucket_bytes=)


def _status(field):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak():
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def _offload(zoe, engine, mode):
    """The ActivationOffload of ``mode`` (None keeps the activations): 8 MiB buckets and
    offload_activations' own pinned and prefetch budgets (they follow the largest bucket,
    here the attention weights: batch x 4 heads x seq x seq fp32)."""
    if mode == "keep":
        return None
    if mode == "nvme":
        return zoe.torch.offload_activations(engine, device="nvme", min_bytes=MiB,
                                             bucket_bytes=BUCKET)
    twin = zoe.torch.HostTwin(adversarial=False)
    return zoe.torch.offload_activations(engine, device="cpu", min_bytes=MiB,
                                         device_backend=twin, bucket_bytes=BUCKET)


def _iteration(torch, model, x, offload):
    model.zero_grad(set_to_none=True)
    if offload is None:
        loss = model(x).square().mean()
    else:
        with offload:
            loss = model(x).square().mean()
    loss.backward()


def _model_and_input(torch, seq):
    torch.manual_seed(0)
    layers = [torch.nn.TransformerEncoderLayer(128, 4, 512, dropout=0, batch_first=True)
              for _ in range(8)]
    return torch.nn.Sequential(*layers), torch.randn(TOKENS // seq, seq, 128)


def interleaved_child(spec):
    """Keeping and each offloading mode of ``spec["modes"]`` in this one process, iteration by
    iteration in turn (``spec["iterations"]`` each after a warm-up of each): the median seconds
    per mode, and each mode's ratio to keeping. One process, so what differs between children
    (where the allocator and the page cache start) does not enter the comparison."""
    import torch
    import zoe
    import zoe.torch

    model, x = _model_and_input(torch, spec["seq"])
    engine = zoe.Engine({"zoe": {"device": "host", "chunk_size": "8M", "log_level": "warn",
                                 "nvme_paths": [spec["nvme_dir"]]}})
    offloads = {mode: _offload(zoe, engine, mode) for mode in ["keep"] + spec["modes"]}
    seconds = {mode: [] for mode in offloads}
    for turn in range(spec["iterations"] + 1):
        for mode, offload in offloads.items():
            started = time.perf_counter()
            _iteration(torch, model, x, offload)
            if turn > 0:  # the first turn warms up
                seconds[mode].append(time.perf_counter() - started)
    engine.close()
    medians = {mode: statistics.median(values) for mode, values in seconds.items()}
    return {"measure": "interleaved", "seq": spec["seq"], "iterations": spec["iterations"],
            "seconds": medians,
            "ratio": {mode: medians[mode] / medians["keep"] for mode in spec["modes"]}}


def child(spec):
    """One (mode, seq) measurement in this process; returns its figures."""
    if spec["measure"] == "interleaved":
        return interleaved_child(spec)
    import torch
    import zoe
    import zoe.torch

    model, x = _model_and_input(torch, spec["seq"])
    rss_before_engine = _status("VmRSS")
    engine = zoe.Engine({"zoe": {"device": "host", "chunk_size": "8M", "log_level": "warn",
                                 "nvme_paths": [spec["nvme_dir"]]}})
    offload = _offload(zoe, engine, spec["mode"])
    _iteration(torch, model, x, offload)  # warm-up
    seconds, growth, with_pool = [], [], []
    for _ in range(spec["iterations"] if spec["measure"] == "time" else 1):
        _reset_peak()
        base = _status("VmRSS")
        started = time.perf_counter()
        _iteration(torch, model, x, offload)
        seconds.append(time.perf_counter() - started)
        peak = _status("VmHWM")
        growth.append(peak - base)
        with_pool.append(peak - rss_before_engine)
    digest = hashlib.sha256()
    for param in model.parameters():
        digest.update(param.grad.numpy().tobytes())
    last = offload.stats()["per_iteration"][-1] if offload is not None else {}
    engine.close()
    return {"mode": spec["mode"], "seq": spec["seq"], "batch": TOKENS // spec["seq"],
            "seconds": statistics.median(seconds), "best_seconds": min(seconds),
            "growth": statistics.median(growth),
            "growth_with_pool": statistics.median(with_pool), "grad_sha256": digest.hexdigest(),
            "iterations": spec["iterations"], "offload": last}


def _spawn(spec):
    """Runs child(spec) in a fresh process. A memory child runs with a fixed mmap threshold:
    glibc then returns every freed block of 128 KiB or more to the system at once, so VmRSS
    follows the memory in use rather than what malloc keeps; a time child runs with glibc's
    defaults, as training does."""
    env = dict(os.environ)
    if spec["measure"] == "memory":
        env["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    out = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)],
                         check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(seqs, modes, rounds, iterations, nvme_dir):
    """Every (seq, mode) child ``rounds`` times, modes alternating; the figures per child."""
    results = []
    for seq in seqs:
        for round_index in range(rounds):
            order = modes if round_index % 2 == 0 else list(reversed(modes))
            for mode in order:
                for measure in ("time", "memory"):
                    spec = {"mode": mode, "seq": seq, "iterations": iterations,
                            "nvme_dir": nvme_dir, "measure": measure}
                    result = _spawn(spec)
                    result["round"], result["measure"] = round_index, measure
                    print(json.dumps(result), flush=True)
                    results.append(result)
    return results


def _of(results, seq, mode, measure):
    return [r for r in results if r["seq"] == seq and r["mode"] == mode and r["measure"] == measure]


def _time_ratio(results, seq, mode):
    """The median over the rounds of (mode's median seconds / keep's, in the same round): a
    ratio of neighbours, so that load on the machine that drifts between rounds cancels."""
    keep = {r["round"]: r["seconds"] for r in _of(results, seq, "keep", "time")}
    return statistics.median(r["seconds"] / keep[r["round"]]
                             for r in _of(results, seq, mode, "time") if r["round"] in keep)


def _row(results, seq, mode, keep_growth, keep_hash):
    """One table row: medians over the rounds (time from time children, memory from memory
    children), the best time of all, ratios to keeping the activations."""
    timed, measured = _of(results, seq, mode, "time"), _of(results, seq, mode, "memory")
    seconds = statistics.median(r["seconds"] for r in timed)
    best = min(r["best_seconds"] for r in timed)
    keep_best = min(r["best_seconds"] for r in _of(results, seq, "keep", "time"))
    growth = statistics.median(r["growth"] for r in measured)
    pool = statistics.median(r["growth_with_pool"] for r in measured)
    last = measured[-1]["offload"]
    same = {r["grad_sha256"] for r in timed + measured} == keep_hash and len(keep_hash) == 1
    rounds = len({r["round"] for r in timed})
    return (f"| {seq} x {TOKENS // seq} | {mode} | {rounds} | {seconds:.3f} | "
            f"{_time_ratio(results, seq, mode):.2f} | {best:.3f} | {best / keep_best:.2f} | "
            f"{growth / MiB:.0f} | {growth / keep_growth:.2f} | {pool / MiB:.0f} | "
            f"{last.get('bytes_to_nvme', 0) / MiB:.0f} | "
            f"{last.get('prefetch_hits', 0)}/{last.get('prefetch_misses', 0)} | "
            f"{last.get('stall_seconds', 0.0):.3f} | {'identical' if same else 'DIFFER'} |")


def table(results, seqs, modes):
    """The Markdown table of ``results`` (the JSON lines of the children)."""
    lines = ["| seq x batch | mode | rounds | median s | ratio | best s | ratio | "
             "peak growth MiB | ratio | growth with zoe's pool MiB | to NVMe MiB | "
             "prefetch hits/misses | stall s | grads |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for seq in seqs:
        keep_growth = statistics.median(r["growth"] for r in _of(results, seq, "keep", "memory"))
        keep_hash = {r["grad_sha256"] for r in results if r["seq"] == seq and r["mode"] == "keep"}
        lines.extend(_row(results, seq, mode, keep_growth, keep_hash) for mode in modes)
    lines.append("\nModes alternate within a round; per round and mode one time child and one "
                 "memory child.")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", default="512,1024,2048,4096")
    parser.add_argument("--modes", default="keep,nvme,twin-cpu")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--nvme-dir", default=None)
    parser.add_argument("--interleaved", type=int, default=0, metavar="N",
                        help="instead: per sequence length one process alternating keep and "
                             "each offloading mode, N timed iterations each")
    parser.add_argument("--from-json", default=None,
                        help="only print the table of the JSON lines a run printed to this file")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(json.loads(args.child))))
        return
    seqs = [int(seq) for seq in args.seq.split(",")]
    modes = args.modes.split(",")
    if args.from_json is not None:
        with open(args.from_json) as lines:
            results = [json.loads(line) for line in lines if line.startswith("{")]
        print(table(results, sorted({r["seq"] for r in results}), modes))
        return
    nvme_dir = args.nvme_dir or tempfile.mkdtemp(prefix="zoe-activation-bench-", dir="/var/tmp")
    os.makedirs(nvme_dir, exist_ok=True)
    if args.interleaved:
        for seq in seqs:
            spec = {"measure": "interleaved", "seq": seq, "iterations": args.interleaved,
                    "modes": [mode for mode in modes if mode != "keep"], "nvme_dir": nvme_dir}
            print(json.dumps(_spawn(spec)), flush=True)
        return
    results = run(seqs, modes, args.rounds, args.iterations, nvme_dir)
    print(table(results, seqs, modes))


if __name__ == "__main__":
    main()
