"""Figures for BENCHMARKS.md from the JSON summaries in bench/results/.

* ``bench/figures/bandwidth.png``: per link, each method's iteration time split into the
  slower rank's compute and what the exchange adds, with the compute-only bound as a line.
* ``bench/figures/selection_cost.png``: selection time per method and density (log scale).
* ``bench/figures/density_spread.png``: actual/target density per iteration, each
  controller, per dataset and density at n = 2 (bench/density_spread.py).

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


def density_spread() -> None:
    cells = json.loads((RESULTS / "density_spread.json").read_text())
    panels = sorted({(c["dataset"], c["density"]) for c in cells if c["n"] == 2},
                    key=lambda p: (p[0], -p[1]))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), sharey=True)
    axes = axes if len(panels) > 1 else [axes]
    colors = {"bounded": "#1b9e77", "scale": "#7570b3", "newton": "#d95f02",
              "paper": "#e7298a"}
    for ax, (dataset, density) in zip(axes, panels):
        for name in ("paper", "newton", "scale", "bounded"):  # the default drawn on top
            for c in cells:
                if (c["dataset"], c["density"], c["n"], c["controller"]) == (
                        dataset, density, 2, name):
                    ax.plot([max(r, 1e-3) for r in c["ratios"]],
                            lw=1.2 if name == "bounded" else 0.6, color=colors[name],
                            label=name)
        ax.axhspan(0.75, 1.25, color="0.85", zorder=0)
        ax.axvline(50, color="k", lw=0.6, ls=":")
        ax.set_yscale("log")
        ax.set_title(f"{dataset}, d={density}, n=2", fontsize=9)
        ax.set_xlabel("iteration")
    axes[0].set_ylabel("actual / target density (band: +-25 %)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(FIGURES / "density_spread.png", dpi=120)


if __name__ == "__main__":
    FIGURES.mkdir(parents=True, exist_ok=True)
    selection()
    if (RESULTS / "bandwidth.json").exists():
        bandwidth()
    if (RESULTS / "density_spread.json").exists():
        density_spread()
