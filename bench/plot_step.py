#!/usr/bin/python3
"""Plot the JSON of `zoe bench step --output-format=json` as a PNG.

For each moment dtype: the median step time next to the two things it overlaps (the I/O-only time
of the same bytes and the compute-only time) and, when the run had --baseline, the synchronous
DeepSpeed-style swapper at the same pinned budget on DeepSpeed-style and on zoe's pinned memory;
each bar is labelled with the GB/s of optimizer state it streams.

Usage: /usr/bin/python3 bench/plot_step.py RESULT.json OUTPUT.png
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)


def load(path):
    """Return the parsed benchmark result, checking its schema version."""
    with open(path, encoding="utf-8") as f:
        result = json.load(f)
    if result.get("schema_version") != 1:
        raise SystemExit(f"{path}: unsupported schema_version {result.get('schema_version')}")
    return result


def bars(row):
    """(label, seconds, GB/s of state streamed or None) for one moment dtype's row."""
    state = (row["bytes_read"] + row.get("bytes_reused", 0) + row["bytes_written"]) / 1e9
    out = [
        ("zoe step", row["step_seconds"], state / row["step_seconds"]),
        ("I/O only", row["io_only_seconds"], state / row["io_only_seconds"]),
        ("compute only", row["compute_only_seconds"], None),
    ]
    for key, label in (("baseline", "baseline,\nDeepSpeed memory"),
                       ("baseline_zoe_memory", "baseline,\nzoe memory")):
        base = row.get(key)
        if base:
            base_moved = (base["bytes_read"] + base["bytes_written"]) / 1e9
            out.append((label, base["seconds"], base_moved / base["seconds"]))
    return out


def main(argv):
    if len(argv) != 3:
        raise SystemExit(__doc__)
    result = load(argv[1])
    rows = result["results"]
    fig, axes = plt.subplots(1, len(rows), figsize=(7 * len(rows), 4.6), squeeze=False)
    for ax, row in zip(axes[0], rows):
        entries = bars(row)
        labels = [e[0] for e in entries]
        seconds = [e[1] for e in entries]
        drawn = ax.bar(labels, seconds, color=["tab:blue", "tab:gray", "tab:green", "tab:orange",
                                                 "tab:red"])
        for rect, (_, _, rate) in zip(drawn, entries):
            if rate is not None:
                ax.annotate(f"{rate:.2f} GB/s", (rect.get_x() + rect.get_width() / 2,
                                                 rect.get_height()), ha="center", va="bottom")
        ax.set_ylabel("seconds per step (median)")
        ax.set_title(f"{row['moment_dtype']} moments: overlap efficiency "
                     f"{row['overlap_efficiency']:.2f}")
    fig.suptitle(f"zoe bench step: {result['params'] / 2**20:.0f} Mi params, {result['offload']}, "
                 f"{result['buffer_count']} buffers, {result['results'][0]['backend']}")
    fig.tight_layout()
    fig.savefig(argv[2], dpi=110)


if __name__ == "__main__":
    main(sys.argv)
