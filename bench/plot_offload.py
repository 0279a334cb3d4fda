#!/usr/bin/python3
"""Plot the JSON of `zoe bench offload --output-format=json` as a PNG.

Left: per policy, the median iteration time split into the stall inside acquire and the rest,
against the total compute and the I/O-only time of the same bytes (the bound is the larger of
the two). Right: the bytes each policy read from NVMe and copied to the device per iteration.

Usage: /usr/bin/python3 bench/plot_offload.py RESULT.json OUTPUT.png
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

MIB = 1 << 20


def load(path):
    """Return the parsed benchmark result, checking its schema version."""
    with open(path, encoding="utf-8") as f:
        result = json.load(f)
    if result.get("schema_version") != 1:
        raise SystemExit(f"{path}: unsupported schema_version {result.get('schema_version')}")
    return result


def title(result):
    """Describe the run in one line: model, budgets and compute per layer."""
    c = result["config"]
    return (
        f"{c['layers']} layers x {c['layer_bytes'] / MIB:.0f} MiB, device {c['device_budget_layers']}"
        f" / host {c['host_budget_layers']} layers, {c['compute_ms']:g} ms compute per layer"
        f" ({c['compute']}), I/O {c['io_backend']}"
    )


def plot_times(ax, result):
    """Stacked bars of stall and other time per policy, with compute and I/O-only lines."""
    rows = result["results"]
    names = [r["policy"] for r in rows]
    stall = [r["stall_seconds"] for r in rows]
    other = [r["iteration_seconds"] - r["stall_seconds"] for r in rows]
    ax.bar(names, other, color="#4c72b0", label="iteration outside stalls")
    ax.bar(names, stall, bottom=other, color="#dd8452", label="stall in acquire")
    compute = result["compute_seconds"]
    ax.axhline(compute, color="black", linestyle="--", label=f"total compute {compute:.2f} s")
    io_only = max(r["io_only_seconds"] for r in rows)
    ax.axhline(io_only, color="#55a868", linestyle=":", label=f"I/O only {io_only:.2f} s")
    bound = max(compute, io_only)
    ax.axhline(1.1 * bound, color="grey", linestyle="-.", linewidth=0.8, label="1.1 x bound")
    for i, r in enumerate(rows):
        ax.text(i, r["iteration_seconds"], f"{r['iteration_seconds']:.2f} s", ha="center",
                va="bottom", fontsize=8)
    top = max(max(r["iteration_seconds"] for r in rows), 1.1 * bound)
    ax.set_ylim(0, 1.45 * top)  # room for the legend above the bars
    ax.set_ylabel("seconds per iteration (median)")
    ax.set_title("iteration time")
    ax.legend(fontsize=7, loc="upper right")


def plot_bytes(ax, result):
    """Grouped bars of NVMe reads and device copies per iteration, with the hit rate."""
    rows = result["results"]
    names = [r["policy"] for r in rows]
    x = range(len(rows))
    width = 0.38
    reads = [r["bytes_per_iteration"]["nvme_to_host"] / MIB for r in rows]
    copies = [r["bytes_per_iteration"]["host_to_device"] / MIB for r in rows]
    ax.bar([i - width / 2 for i in x], reads, width, label="NVMe -> host", color="#8172b3")
    ax.bar([i + width / 2 for i in x], copies, width, label="host -> device", color="#937860")
    for i, r in enumerate(rows):
        ax.text(i, max(reads[i], copies[i]), f"hits {100 * r['prefetch']['hit_rate']:.0f}%",
                ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, 1.3 * max(reads + copies))
    ax.set_xticks(list(x))
    ax.set_xticklabels(names)
    ax.set_ylabel("MiB per iteration")
    ax.set_title("traffic")
    ax.legend(fontsize=7, loc="upper right")


def main(argv):
    """Read the JSON named first and write the PNG named second."""
    if len(argv) != 3:
        raise SystemExit(__doc__)
    result = load(argv[1])
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    plot_times(left, result)
    plot_bytes(right, result)
    fig.suptitle(title(result), fontsize=9)
    fig.tight_layout()
    fig.savefig(argv[2], dpi=120)


if __name__ == "__main__":
    main(sys.argv)
