#!/usr/bin/python3
"""Plots the iteration figures of `zoe bench step --backward-ms B --output-format json`.

Usage: bench/plot_iteration.py OUTPUT.png RESULT.json [RESULT.json ...]
(a file may also hold a JSON list of such reports, as docs/img/iteration-256M.json does)

One group of bars per result file (its label says the moment dtype, B and whether clipping was
asked): the iteration with the step after backward, overlapped with it, speculative, and the
bound max(B, step alone) as a line across the group.
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MODES = [("after", "after backward"), ("overlap", "reads overlapped"),
         ("speculative", "speculative")]


def runs(paths):
    """(label, iteration dict) of every result of every file."""
    for path in paths:
        with open(path) as file:
            loaded = json.load(file)
        for report in loaded if isinstance(loaded, list) else [loaded]:
            for result in report["results"]:
                iteration = result.get("iteration")
                if not iteration:
                    continue
                clip = report.get("max_grad_norm") or 0
                label = (f"{result['moment_dtype']}, B={report['backward_ms']:.0f} ms"
                         + (", clipped" if clip else ""))
                yield label, iteration


def main(argv):
    if len(argv) < 3:
        sys.exit(__doc__)
    data = list(runs(argv[2:]))
    if not data:
        sys.exit("no result has an 'iteration' section (run with --backward-ms)")
    width = 0.8 / len(MODES)
    figure, axes = plt.subplots(figsize=(max(6, 1.6 * len(data)) + 2.5, 4))
    for m, (key, name) in enumerate(MODES):
        xs = [i + (m - (len(MODES) - 1) / 2) * width for i in range(len(data))]
        axes.bar(xs, [it[key] for _, it in data], width, label=name)
    for i, (_, it) in enumerate(data):
        axes.hlines(it["bound"], i - 0.45, i + 0.45, colors="black", linestyles="dashed",
                    label="bound max(B, step alone)" if i == 0 else None)
    axes.set_xticks(range(len(data)))
    axes.set_xticklabels([label for label, _ in data], rotation=20, ha="right", fontsize=8)
    axes.set_ylabel("seconds per iteration (backward + step)")
    axes.set_title("zoe bench step --backward-ms: iteration time by mode")
    axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    figure.tight_layout()
    figure.savefig(argv[1], dpi=110)


if __name__ == "__main__":
    main(sys.argv)
