"""``python -m train.plot RUN_DIR [RUN_DIR ...] --out DIR``: the paper's figures as PNGs.

* ``accuracy_vs_time.png``: test accuracy against cumulative training wall time (slowest
  rank; evaluation and checkpoints excluded), one line per run/method;
* ``density.png``: actual density per iteration, with each run's user-set density dashed
  (elastic runs: a dotted vertical line at each change of the set of workers, here and in
  the threshold/residual figure);
* ``threshold_residual.png``: the selection threshold per iteration, and the residual norm
  scaled by the local gradient norm (``||e_t|| / ||g_t||``: how many gradients' worth of
  unsent error the ranks carry; mean over ranks), sparse methods only;
* ``time_breakdown.png``: mean time per iteration, stacked by phase, one bar per run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .records import EPOCHS_FILE, ITERATIONS_FILE, MEMBERSHIP_FILE, read_jsonl  # noqa: E402

PHASES = ("data", "forward", "backward", "selection", "communication", "sync_other", "update")


class Run:
    """One recorded run directory."""

    def __init__(self, path: Path):
        self.path = Path(path)
        if not (self.path / ITERATIONS_FILE).exists():
            raise FileNotFoundError(f"{self.path} holds no {ITERATIONS_FILE}: not a run "
                                    "directory written by python -m train")
        self.config = json.loads((self.path / "run.json").read_text())
        self.iterations = read_jsonl(self.path / ITERATIONS_FILE)
        self.epochs = read_jsonl(self.path / EPOCHS_FILE)
        # Elastic runs (python -m train --elastic): the iterations where the set of
        # workers changed, drawn as vertical lines.
        membership = self.path / MEMBERSHIP_FILE
        starts = read_jsonl(membership) if membership.exists() else []
        self.resets = [(m["iteration"], m["world_size"]) for m in starts[1:]]
        method = self.config["compressor"]
        dense = method in ("none", "fp16")
        self.label = method if dense else f"{method} d={self.config['density']:g}"


def _labels(runs: list[Run]) -> None:
    seen: dict[str, int] = {}
    for run in runs:
        seen[run.label] = seen.get(run.label, 0) + 1
    for run in runs:
        if seen[run.label] > 1:
            run.label = f"{run.label} ({run.path.name})"


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


def accuracy_vs_time(runs: list[Run], out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    for run in runs:
        ax.plot([e["train_time"] for e in run.epochs],
                [100 * e["test_accuracy"] for e in run.epochs], marker="o", label=run.label)
    ax.set(xlabel="training wall time (s, slowest rank)", ylabel="test accuracy (%)",
           title="Test accuracy vs wall time")
    ax.legend()
    ax.grid(alpha=0.3)
    return _save(fig, out / "accuracy_vs_time.png")


def density(runs: list[Run], out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    for run in runs:
        (line,) = ax.plot([r["iteration"] for r in run.iterations],
                          [r["density"] for r in run.iterations], label=run.label, lw=0.8)
        _mark_resets(ax, run, line.get_color())
        target = run.iterations[0]["target_density"] if run.iterations else None
        if target is not None:
            ax.axhline(target, color=line.get_color(), ls="--", lw=1,
                       label=f"user-set {target:g}")
    ax.set(xlabel="iteration", ylabel="actual density", title="Actual vs user-set density",
           yscale="log")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, out / "density.png")


def threshold_residual(runs: list[Run], out: Path) -> Path:
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6, 6), sharex=True)
    drawn = False
    for run in runs:
        its = [r for r in run.iterations if r.get("threshold") is not None]
        if its:
            top.plot([r["iteration"] for r in its], [r["threshold"] for r in its],
                     label=run.label, lw=0.8)
            drawn = True
        scaled = [(r["iteration"], r["residual_norm"] / r["grad_norm"])
                  for r in run.iterations
                  if r.get("residual_norm") is not None and r.get("grad_norm")]
        if scaled:
            (line,) = bottom.plot(*zip(*scaled), label=run.label, lw=0.8)
            _mark_resets(top, run, line.get_color())
            _mark_resets(bottom, run, line.get_color())
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


def time_breakdown(runs: list[Run], out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(max(4, 1.5 * len(runs) + 2), 4))
    bottoms = [0.0] * len(runs)
    for phase in PHASES:
        means = [1000 * sum(r[phase] for r in run.iterations) / max(len(run.iterations), 1)
                 for run in runs]
        ax.bar(range(len(runs)), means, bottom=bottoms, label=phase)
        bottoms = [b + m for b, m in zip(bottoms, means)]
    ax.set_xticks(range(len(runs)), [run.label for run in runs], rotation=20, fontsize=8)
    ax.set(ylabel="ms per iteration (slowest rank)", title="Time breakdown per iteration")
    ax.legend(fontsize=8)
    return _save(fig, out / "time_breakdown.png")


def make_figures(run_dirs: list[Path], out: Path) -> list[Path]:
    """Write the four figures for ``run_dirs`` into ``out``; returns their paths."""
    runs = [Run(Path(p)) for p in run_dirs]
    _labels(runs)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    return [accuracy_vs_time(runs, out), density(runs, out), threshold_residual(runs, out),
            time_breakdown(runs, out)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.plot", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (--out of train)")
    parser.add_argument("--out", type=Path, default=Path("figures"), help="where PNGs go")
    args = parser.parse_args(argv)
    try:
        paths = make_figures(args.runs, args.out)
    except FileNotFoundError as error:
        parser.error(str(error))
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
