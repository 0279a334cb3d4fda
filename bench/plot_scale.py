#!/usr/bin/python3
"""Plot the JSON lines of bench/scale_bench.py (several runs concatenated) as a PNG.

Left: per model, its training state beside the memory limit it ran under and each
implementation's peak memory (a cross where the limit killed it). Right: zoe's seconds per
iteration beside the I/O bound measured in the same run.

Usage: /usr/bin/python3 bench/plot_scale.py RESULTS.jsonl OUTPUT.png
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

GIB = 1 << 30


def results(path):
    """The "result" lines of the file, by model (parameters), in the order they first appear."""
    by_model = {}
    with open(path, encoding="utf-8") as lines:
        for line in lines:
            record = json.loads(line)
            if record.get("kind") == "result":
                by_model.setdefault(record["params"], {})[record["impl"]] = record
    return by_model


def label(params):
    return f"{params / 1e9:.2f} B" if params >= 1e9 else f"{params / 1e6:.0f} M"


def plot_memory(axis, by_model):
    """Bars of state, limit and peaks per model, on a log scale."""
    names = [label(params) for params in by_model]
    width = 0.2
    for column, (what, colour) in enumerate((("state", "tab:gray"), ("limit", "black"),
                                             ("zoe", "tab:blue"), ("torch", "tab:orange"))):
        for row, runs in enumerate(by_model.values()):
            any_run = next(iter(runs.values()))
            if what == "state":
                value = any_run["state_bytes"]
            elif what == "limit":
                value = any_run["limit_bytes"] or 0
            else:
                value = runs.get(what, {}).get("peak_bytes") or 0
            x = row + (column - 1.5) * width
            axis.bar(x, value / GIB, width, color=colour, label=what if row == 0 else None)
            if what in runs and runs[what].get("killed"):
                axis.plot(x, value / GIB, "x", color="red", markersize=10)
    axis.set_xticks(range(len(names)), [f"{name} parameters" for name in names])
    axis.set_yscale("log")
    axis.set_ylabel("GiB")
    axis.set_title("training state, limit and peak memory (x: killed)")
    axis.legend()


def plot_time(axis, by_model):
    """zoe's seconds per iteration against the I/O bound of the same run."""
    names, seconds, bounds = [], [], []
    for params, runs in by_model.items():
        zoe = runs.get("zoe")
        if zoe is None or zoe.get("killed"):
            continue
        names.append(label(params))
        seconds.append(zoe["seconds_per_iteration"])
        bounds.append(zoe["io_bound_s"])
    positions = range(len(names))
    axis.bar([p - 0.2 for p in positions], seconds, 0.4, label="zoe, s / iteration")
    axis.bar([p + 0.2 for p in positions], bounds, 0.4, label="I/O bound (s)", color="tab:gray")
    for p, (s, b) in enumerate(zip(seconds, bounds)):
        axis.annotate(f"{s / b:.2f}x", (p - 0.2, s), ha="center", va="bottom")
    axis.set_xticks(list(positions), [f"{name} parameters" for name in names])
    axis.set_ylabel("seconds")
    axis.set_title("zoe's iteration against the disk's bound")
    axis.legend()


def main():
    if len(sys.argv) != 3:
        raise SystemExit(__doc__.strip().splitlines()[-1])
    by_model = results(sys.argv[1])
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    plot_memory(left, by_model)
    plot_time(right, by_model)
    figure.tight_layout()
    figure.savefig(sys.argv[2], dpi=100)


if __name__ == "__main__":
    main()
