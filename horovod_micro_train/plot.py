"""``python -m horovod_micro_train.plot RUN_DIR [RUN_DIR ...] --out DIR``: the paper's figures
as PNGs.

Runs are grouped by method (compressor and density; plus model, ranks or dataset where the
runs differ in them), and each method is one line in one colour throughout, so runs of
several seeds read as one method with its spread:

* ``accuracy_vs_time.png``: test accuracy against cumulative training wall time (slowest
  rank; evaluation and checkpoints excluded), the mean over a method's runs evaluation by
  evaluation (``evals.jsonl``: every ``--eval-every`` iterations and at each epoch's end;
  the epochs of older runs without it) with the runs' min-max band; ``--target`` draws the
  target accuracy;
* ``density.png``: actual density per iteration (a moving mean over 1 % of the run, the
  raw trace faint behind it), each method's user-set density dashed; dense methods (density
  1) are left out; elastic runs get a dotted vertical line at each change of the set of
  workers, here and in the threshold/residual figure;
* ``threshold_residual.png``: the selection threshold per iteration, and the residual norm
  scaled by the local gradient norm (``||e_t|| / ||g_t||``: how many gradients' worth of
  unsent error the ranks carry; mean over ranks), sparse methods only;
* ``time_breakdown.png``: mean time per iteration, stacked by phase, one bar per method.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .records import (  # noqa: E402
    EPOCHS_FILE,
    EVALS_FILE,
    ITERATIONS_FILE,
    MEMBERSHIP_FILE,
    method_label,
    read_jsonl,
)

PHASES = ("data", "forward", "backward", "selection", "communication", "sync_other", "update")
DENSE = ("none", "fp16")
#: Config keys appended to a method's label when the runs differ in them.
DISTINGUISHING = ("dataset", "model", "world_size")


class Run:
    """One recorded run directory."""

    def __init__(self, path: Path):
        self.path = Path(path)
        if not (self.path / ITERATIONS_FILE).exists():
            raise FileNotFoundError(f"{self.path} holds no {ITERATIONS_FILE}: not a run "
                                    "directory written by python -m horovod_micro_train")
        self.config = json.loads((self.path / "run.json").read_text())
        self.iterations = read_jsonl(self.path / ITERATIONS_FILE)
        self.epochs = read_jsonl(self.path / EPOCHS_FILE)
        evals = self.path / EVALS_FILE
        #: Test accuracy against training time (the epochs' rows for older runs).
        self.evals = read_jsonl(evals) if evals.exists() else self.epochs
        # Elastic runs (python -m horovod_micro_train --elastic): the iterations where the set of
        # workers changed, drawn as vertical lines.
        membership = self.path / MEMBERSHIP_FILE
        starts = read_jsonl(membership) if membership.exists() else []
        self.resets = [(m["iteration"], m["world_size"]) for m in starts[1:]]
        self.dense = self.config["compressor"] in DENSE
        self.label = method_label(self.config)


class Method:
    """The runs of one method (e.g. several seeds), drawn as one line in one colour."""

    def __init__(self, label: str, runs: list[Run], color):
        self.label, self.runs, self.color = label, runs, color
        self.dense = runs[0].dense


def group(runs: list[Run]) -> list[Method]:
    """Runs grouped by label (in first-seen order), each group with its own colour."""
    varying = [k for k in DISTINGUISHING if len({str(r.config.get(k)) for r in runs}) > 1]
    groups: dict[str, list[Run]] = {}
    for run in runs:
        extra = ", ".join(f"{'n' if k == 'world_size' else k}={run.config.get(k)}"
                          for k in varying)
        groups.setdefault(f"{run.label} ({extra})" if extra else run.label, []).append(run)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return [Method(label, members, colors[i % len(colors)])
            for i, (label, members) in enumerate(groups.items())]


def _mark_resets(ax, run: Run, color) -> None:
    """A dotted vertical line, labelled with the new world size, at each membership
    change of an elastic run."""
    for iteration, size in run.resets:
        ax.axvline(iteration, color=color, ls=":", lw=1)
        ax.annotate(f"n={size}", (iteration, 1.0), xycoords=("data", "axes fraction"),
                    fontsize=7, color=color, ha="left", va="top")


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _smooth(values: list[float]) -> tuple[np.ndarray, int]:
    """Moving mean over ~1 % of the values (at least 1); returns it and the window."""
    window = max(1, len(values) // 100)
    if window == 1:
        return np.asarray(values, dtype=float), 1
    return np.convolve(values, np.ones(window) / window, mode="valid"), window


def accuracy_vs_time(methods: list[Method], out: Path, target: float | None = None) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m in methods:
        points = min(len(r.evals) for r in m.runs)
        if points == 0:
            continue
        times = np.array([[r.evals[e]["train_time"] for e in range(points)] for r in m.runs])
        acc = 100 * np.array([[r.evals[e]["test_accuracy"] for e in range(points)]
                              for r in m.runs])
        label = m.label if len(m.runs) == 1 else f"{m.label} (mean of {len(m.runs)})"
        ax.plot(times.mean(0), acc.mean(0), marker="o", ms=3, color=m.color, label=label)
        if len(m.runs) > 1:
            ax.fill_between(times.mean(0), acc.min(0), acc.max(0), color=m.color, alpha=0.2)
    if target is not None:
        ax.axhline(100 * target, color="grey", ls=":", lw=1, label=f"target {target:.0%}")
        # The first evaluations (far below the target) would squeeze the part that matters.
        ax.set_ylim(bottom=max(ax.get_ylim()[0], 100 * target - 20))
    ax.set(xlabel="training wall time (s, slowest rank)", ylabel="test accuracy (%)",
           title="Test accuracy vs wall time")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, out / "accuracy_vs_time.png")


def density(methods: list[Method], out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    sparse = [m for m in methods if not m.dense]
    window = 1
    for m in sparse:
        for i, run in enumerate(m.runs):
            x = [r["iteration"] for r in run.iterations]
            y = [r["density"] for r in run.iterations]
            smooth, window = _smooth(y)
            ax.plot(x, y, color=m.color, lw=0.5, alpha=0.2)
            ax.plot(x[window - 1:], smooth, color=m.color, lw=1.5,
                    label=m.label if i == 0 else None)
            _mark_resets(ax, run, m.color)
        target = m.runs[0].iterations[0]["target_density"] if m.runs[0].iterations else None
        if target is not None:
            ax.axhline(target, color=m.color, ls="--", lw=1)
    title = "Actual (solid) vs user-set (dashed) density"
    if window > 1:
        title += f"\nmoving mean over {window} iterations; raw trace faint"
    if not sparse:
        ax.text(0.5, 0.5, "only dense runs (density 1)", ha="center", transform=ax.transAxes)
    else:
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    ax.set(xlabel="iteration", ylabel="actual density", title=title)
    ax.grid(alpha=0.3, which="both")
    return _save(fig, out / "density.png")


def threshold_residual(methods: list[Method], out: Path) -> Path:
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    drawn = False
    for m in methods:
        for i, run in enumerate(m.runs):
            label = m.label if i == 0 else None
            its = [r for r in run.iterations if r.get("threshold") is not None]
            if its:
                top.plot([r["iteration"] for r in its], [r["threshold"] for r in its],
                         color=m.color, label=label, lw=0.8)
                drawn = True
            scaled = [(r["iteration"], r["residual_norm"] / r["grad_norm"])
                      for r in run.iterations
                      if r.get("residual_norm") is not None and r.get("grad_norm")]
            if scaled:
                bottom.plot(*zip(*scaled), color=m.color, label=label, lw=0.8)
                _mark_resets(top, run, m.color)
                _mark_resets(bottom, run, m.color)
                drawn = True
    top.set(ylabel="threshold", yscale="log", title="Threshold and scaled residual norm")
    bottom.set(xlabel="iteration", ylabel="||residual|| / ||gradient||", yscale="log")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=8)
    if not drawn:
        top.text(0.5, 0.5, "no sparse run: no threshold or residual", ha="center",
                 transform=top.transAxes)
    return _save(fig, out / "threshold_residual.png")


def time_breakdown(methods: list[Method], out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(methods) + 3), 4.5))
    bottoms = np.zeros(len(methods))
    for phase in PHASES:
        means = np.array([1000 * np.mean([r[phase] for run in m.runs for r in run.iterations]
                                         or [0.0]) for m in methods])
        ax.bar(range(len(methods)), means, bottom=bottoms, label=phase)
        bottoms += means
    for i, total in enumerate(bottoms):
        ax.text(i, total, f"{total:.1f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(methods)), [m.label for m in methods], rotation=20, ha="right",
                  fontsize=8)
    ax.set(ylabel="ms per iteration (each phase: slowest rank)",
           title="Time breakdown per iteration")
    ax.set_ylim(top=1.1 * max(bottoms.max(), 1e-9))
    ax.legend(fontsize=8, bbox_to_anchor=(1.01, 1), loc="upper left")
    return _save(fig, out / "time_breakdown.png")


def make_figures(run_dirs: list[Path], out: Path, target: float | None = None) -> list[Path]:
    """Write the four figures for ``run_dirs`` into ``out``; returns their paths."""
    methods = group([Run(Path(p)) for p in run_dirs])
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    return [accuracy_vs_time(methods, out, target), density(methods, out),
            threshold_residual(methods, out), time_breakdown(methods, out)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m horovod_micro_train.plot", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (--out of train)")
    parser.add_argument("--out", type=Path, default=Path("figures"), help="where PNGs go")
    parser.add_argument("--target", type=float, default=None,
                        help="target test accuracy (a fraction, e.g. 0.85) to draw")
    args = parser.parse_args(argv)
    if args.target is not None and not 0 < args.target <= 1:
        parser.error(f"--target is a fraction in (0, 1], got {args.target}")
    try:
        paths = make_figures(args.runs, args.out, args.target)
    except FileNotFoundError as error:
        parser.error(str(error))
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
