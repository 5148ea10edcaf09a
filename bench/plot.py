"""Figures for BENCHMARKS.md from the JSON summaries in bench/results/.

* ``bench/figures/bandwidth.png``: per link, each method's iteration time split into the
  slower rank's compute and what the exchange adds, with the compute-only bound as a line.
* ``bench/figures/selection_cost.png``: selection time per method and density (log scale).

    .venv/bin/python -m bench.plot
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RESULTS, FIGURES = REPO / "bench/results", REPO / "bench/figures"


def bandwidth() -> None:
    data = json.loads((RESULTS / "bandwidth.json").read_text())
    fig, axes = plt.subplots(1, len(data), figsize=(4.6 * len(data), 3.8), sharey=True)
    axes = axes if len(data) > 1 else [axes]
    for ax, (rate, res) in zip(axes, data.items()):
        cfgs = res["configs"]
        comp_only = next(c["total"] for c in cfgs if c["label"] == "compute")
        labels = [c["label"].replace(" d=", "\n") for c in cfgs]
        compute = [c["compute"] for c in cfgs]
        extra = [c["total"] - c["compute"] for c in cfgs]
        ax.bar(labels, compute, label="compute (slower rank)", color="#8da0cb")
        ax.bar(labels, extra, bottom=compute, label="exchange adds", color="#fc8d62")
        ax.axhline(comp_only, color="k", lw=0.8, ls="--", label="compute-only bound")
        ax.set_title(f"link: {rate}")
        ax.tick_params(axis="x", labelsize=7, rotation=60)
    axes[0].set_ylabel("iteration time (s), median")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(FIGURES / "bandwidth.png", dpi=120)


def selection() -> None:
    data = json.loads((RESULTS / "selection_cost.json").read_text())["median_ms"]
    densities = sorted({k.split("|")[0] for k in data}, reverse=True)
    labels = [k.split("|")[1] for k in data if k.startswith(densities[0] + "|")]
    fig, ax = plt.subplots(figsize=(9, 3.8))
    width = 0.8 / len(densities)
    for i, d in enumerate(densities):
        ax.bar([j + i * width for j in range(len(labels))],
               [data[f"{d}|{label}"] for label in labels], width, label=f"density {d}")
    ax.set_xticks([j + width / 2 for j in range(len(labels))], labels, rotation=60,
                  fontsize=7, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel("ms per selection, median, 1 thread")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(FIGURES / "selection_cost.png", dpi=120)


if __name__ == "__main__":
    FIGURES.mkdir(parents=True, exist_ok=True)
    selection()
    if (RESULTS / "bandwidth.json").exists():
        bandwidth()
