"""Time to accuracy of every method on an emulated cluster: the MiCRO paper's convergence
experiment at small scale (communication-bound model, Fashion-MNIST, one rank per host).

    python -m bench.time_to_accuracy --quick                   # about 10 minutes
    python -m bench.time_to_accuracy --cells headline          # n=4 at 1 Gbit/s, every method
    python -m bench.time_to_accuracy --cells scaling slow      # n=2/8 and 100 Mbit/s, reduced
    python -m bench.time_to_accuracy --hosts 2 --methods none micro   # one cell of your own
    python -m bench.time_to_accuracy --hosts 4 --methods micro powersgd:rank=2
    python -m bench.time_to_accuracy --hosts 4 --rate 100mbit --burst 64kb  # wire time charged
    python -m bench.time_to_accuracy --report-only             # tables and figures again

Each cell is H hosts of ``hvm_testbed.cluster`` (network namespaces, one veth
per host with a tbf in both directions at the cell's rate, sshd in each; tbf's bucket is 1 MB,
under which a sparse method's messages pass free after a quiet moment, unless ``--burst``
sets a smaller one), and each run is one
``horovodrun -np H -H hvm1:1,...,hvmH:1 --gloo python -m horovod_micro_train`` started in host hvm1,
with the same seed and recipe for every method: ``wide_mlp`` (12.7M parameters, the
communication-bound model), batch 32 per rank, SGD with Nesterov momentum, and a test
evaluation every ``--eval-every`` iterations (not counted in the training time).

Why a runner of ``python -m horovod_micro_train`` rather than a loop of its own: the curves are
then what a user of the training entrypoint gets, measured by the same per-phase timers.

Runs are resumable: a run whose directory holds ``summary.json`` is not run again, so the
matrix can be stopped and restarted across a session. The report (``report.md`` and
``results.json`` in ``--out``, figures in ``--out``/figures) covers whatever runs exist:

* time to the target accuracy (the training time of the first evaluation at or above it)
  per method, with its ratio to dense (``none``) and to MiCRO at the same density;
* final accuracy at equal epochs, as the mean and the min-max over seeds;
* mean actual density and the 10th/90th percentiles of actual/target per iteration;
* bytes sent per rank per iteration (slowest rank), and the time breakdown;
* figures: accuracy against training time per method, the time breakdown, and the
  iteration time against n (cells at the same rate).

Caveat: the hosts share this machine's cores. With more ranks than cores every rank's
compute runs slower than on a host of its own, so the larger cells drift toward the
compute-bound regime (the report states ranks per core).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import parse_method
from bench.density_spread import quantile
from horovod_micro.compression import takes_density
from horovod_micro_train.records import (
    EPOCHS_FILE,
    EVALS_FILE,
    ITERATIONS_FILE,
    TIME_FIELDS,
    method_label,
    method_settings,
    read_jsonl,
)

REPO = Path(__file__).resolve().parents[1]
DENSE = ("none", "fp16")
PHASES = tuple(f for f in TIME_FIELDS if f != "total")


@dataclass(frozen=True)
class Cell:
    """H hosts at one link rate, with tbf's bucket of ``burst`` bytes (None: the cluster's
    default of 1 MB, which lets a message under about 1 MB pass free after a quiet moment)."""

    hosts: int
    rate: str
    burst: str | None = None

    @property
    def name(self) -> str:
        return f"n{self.hosts}-{self.rate}" + (f"-burst{self.burst}" if self.burst else "")


@dataclass(frozen=True)
class Job:
    """One training run of one method in one cell."""

    cell: Cell
    method: str
    density: float | None  # None for dense methods
    seed: int

    @property
    def name(self) -> str:
        d = "" if self.density is None else f"-d{self.density:g}"
        name, kwargs = parse_method(self.method)
        options = "".join(f"-{k}{v}" for k, v in kwargs.items())
        return f"{name}{options}{d}-s{self.seed}"


def without_density(name: str) -> bool:
    """A sparse method that takes no density (PowerSGD takes a rank): one run per seed,
    not one per density."""
    import horovod_micro as hvm

    return name not in DENSE and not takes_density(getattr(hvm.Compression, name))


def method_argv(method: str) -> list[str]:
    """``name[:key=value,...]`` as ``python -m horovod_micro_train`` flags:
    ``powersgd:rank=2`` runs ``--compressor powersgd --compressor-option rank=2``."""
    name, kwargs = parse_method(method)
    argv = ["--compressor", name]
    for key, value in kwargs.items():
        argv += ["--compressor-option", f"{key}={value!r}"]
    return argv


def jobs_for(cell: Cell, methods: list[str], densities: list[float], seeds: list[int]
             ) -> list[Job]:
    """Seed by seed (a stopped matrix then has whole seeds), dense first, then each
    density's sparse methods in the order given."""
    out = []
    for seed in seeds:
        out += [Job(cell, m, None, seed) for m in methods
                if m in DENSE or without_density(parse_method(m)[0])]
        for d in densities:
            out += [Job(cell, m, d, seed) for m in methods
                    if m not in DENSE and not without_density(parse_method(m)[0])]
    return out


def matrix(cells: list[str], args: argparse.Namespace) -> list[Job]:
    """The jobs of the named cells (``--methods`` etc. override)."""
    headline = Cell(4, "1gbit")
    plan: list[Job] = []
    if args.hosts:  # one cell of the caller's choosing
        return jobs_for(Cell(args.hosts, args.rate, args.burst), args.methods or ["none", "micro"],
                        args.densities or [0.001], args.seeds or [1])
    for name in cells:
        if name == "quick":
            plan += jobs_for(headline, ["none", "micro", "topk"], [0.001], [1])
        elif name == "headline":
            plan += jobs_for(headline, args.methods or ["none", "micro", "topk", "randomk",
                                                        "threshold", "cltk", "gtopk", "fp16",
                                                        "powersgd:rank=1"],
                             args.densities or [0.001, 0.01], args.seeds or [1, 2])
        elif name == "scaling":
            for hosts in (2, 8):
                plan += jobs_for(Cell(hosts, "1gbit"),
                                 args.methods or ["none", "micro", "topk", "powersgd:rank=1"],
                                 args.densities or [0.001], args.seeds or [1])
        elif name == "slow":
            plan += jobs_for(Cell(4, "100mbit"),
                             args.methods or ["none", "micro", "topk", "powersgd:rank=1"],
                             args.densities or [0.001], args.seeds or [1])
        else:
            raise SystemExit(f"unknown cell {name!r} (quick, headline, scaling, slow)")
    return plan


def train_argv(job: Job, args: argparse.Namespace, out: Path) -> list[str]:
    argv = [sys.executable, "-m", "horovod_micro_train",
            "--dataset", "fashion-mnist", "--model", args.model,
            *method_argv(job.method), "--seed", str(job.seed), "--epochs", str(args.epochs),
            "--batch-size", str(args.batch_size), "--eval-every", str(args.eval_every),
            "--out", str(out), "--no-plots", "--progress", "none"]
    if job.density is not None:
        argv += ["--density", str(job.density)]
    if args.iters:
        argv += ["--max-iters-per-epoch", str(args.iters)]
    if args.fused_sgd:
        argv += ["--fused-sgd"]
    if args.data_dir:
        argv += ["--data-dir", args.data_dir]
    return argv


def run_jobs(plan: list[Job], args: argparse.Namespace) -> None:
    """Run every job of ``plan`` that has no summary yet, one cluster per cell."""
    from hvm_testbed.cluster import DEFAULT_BURST, Cluster
    from hvm_testbed.launch import LaunchError, horovodrun

    by_cell: dict[Cell, list[Job]] = {}
    for job in plan:
        by_cell.setdefault(job.cell, []).append(job)
    for cell, jobs in by_cell.items():
        todo = [j for j in jobs if not (run_dir(args.out, j) / "summary.json").exists()]
        if not todo:
            continue
        with Cluster.up(cell.hosts, rate=cell.rate,
                        burst=cell.burst or DEFAULT_BURST) as cluster:
            for job in todo:
                out = run_dir(args.out, job)
                cmd = [horovodrun(), "-np", str(cell.hosts), "-H", cluster.slots(), "--gloo",
                       *train_argv(job, args, out)]
                began = time.time()
                print(f"[{time.strftime('%H:%M:%S')}] {cell.name} {job.name} ...", flush=True)
                try:
                    cluster.run("hvm1", cmd, args.run_timeout, cwd=REPO)
                except LaunchError as error:  # record it and go on with the matrix
                    out.mkdir(parents=True, exist_ok=True)
                    (out / "failed.txt").write_text(str(error))
                    print(f"    FAILED: {str(error).splitlines()[0]}", flush=True)
                    continue
                print(f"    done in {time.time() - began:.0f} s", flush=True)


def run_dir(root: Path, job: Job) -> Path:
    return Path(root) / job.cell.name / job.name


# -- analysis ------------------------------------------------------------------------------
def time_to(evals: list[dict], target: float, key: str = "train_time") -> float | None:
    """Training time (or ``key``) of the first evaluation at or above ``target`` (None:
    never)."""
    return next((e[key] for e in evals if e["test_accuracy"] >= target), None)


def analyse_run(path: Path, targets: list[float]) -> dict:
    config = json.loads((path / "run.json").read_text())
    its = read_jsonl(path / ITERATIONS_FILE)
    evals = read_jsonl(path / EVALS_FILE)
    epochs = read_jsonl(path / EPOCHS_FILE)
    dense = config["compressor"] in DENSE or without_density(config["compressor"])
    ratios = [] if dense else sorted(r["density"] / r["target_density"] for r in its)
    density = None if dense else config["density"]
    label = method_label(config)
    return {
        "dir": str(path), "label": label,
        "method": config["compressor"], "density": density,
        "settings": method_settings(config),
        # The compressor's whole configuration as the ranks held it (None: dense), or
        # "not recorded" for a run.json older than the record.
        "compression_config": config.get("compression_config", "not recorded"),
        "optimizer": {
            k: config.get(k) for k in ("lr", "momentum", "no_nesterov", "weight_decay",
                                       "fused_sgd", "batch_size", "epochs")},
        "seed": config["seed"], "world_size": config["world_size"],
        "iterations": len(its), "epochs": len(epochs),
        "time_to": {f"{t:g}": time_to(evals, t) for t in targets},
        "iterations_to": {f"{t:g}": time_to(evals, t, "iteration") for t in targets},
        "final_accuracy": evals[-1]["test_accuracy"] if evals else None,
        "epoch_accuracy": [e["test_accuracy"] for e in epochs],
        "iteration_time_median": statistics.median(r["total"] for r in its),
        # What the time to accuracy follows: the training time over the iterations.
        "iteration_time_mean": evals[-1]["train_time"] / len(its) if evals and its else None,
        "phases": {p: statistics.fmean(r[p] for r in its) for p in PHASES},
        "bytes_sent": statistics.fmean(r["bytes_sent"] for r in its),
        "mean_density": statistics.fmean(r["density"] for r in its),
        "density_p10": quantile(ratios, 0.1) if ratios else None,
        "density_p90": quantile(ratios, 0.9) if ratios else None,
        "mean_density_ratio": statistics.fmean(ratios) if ratios else None,
    }


def _spread(values: list[float | None]) -> dict:
    got = [v for v in values if v is not None]
    return {"mean": statistics.fmean(got) if got else None, "min": min(got, default=None),
            "max": max(got, default=None), "runs": len(values), "reached": len(got)}


def analyse(root: Path, targets: list[float]) -> dict:
    """Every finished run under ``root``, grouped by cell and method (seeds together)."""
    cells: dict[str, dict[str, list[dict]]] = {}
    for summary in sorted(Path(root).glob("*/*/summary.json")):
        run = analyse_run(summary.parent, targets)
        cells.setdefault(summary.parent.parent.name, {}).setdefault(run["label"], []).append(run)
    report: dict[str, dict] = {}
    for cell, methods in cells.items():
        rows = {}
        # Accuracy at equal epochs: after the last epoch that every run of the cell has.
        common = min(len(r["epoch_accuracy"]) for runs in methods.values() for r in runs)
        for label, runs in methods.items():
            rows[label] = {
                "seeds": sorted(r["seed"] for r in runs),
                "world_size": runs[0]["world_size"], "density": runs[0]["density"],
                "method": runs[0]["method"], "settings": _one(runs, "settings"),
                "optimizer": _one(runs, "optimizer"),
                "time_to": {t: _spread([r["time_to"][t] for r in runs])
                            for t in runs[0]["time_to"]},
                # Each seed's own times: runs of one seed see the same data order, so
                # "first on every seed" compares seed by seed.
                "seed_times": {str(r["seed"]): r["time_to"] for r in runs},
                "iterations_to": {t: _spread([r["iterations_to"][t] for r in runs])
                                  for t in runs[0]["iterations_to"]},
                "final_accuracy": _spread([r["final_accuracy"] for r in runs]),
                "finals": sorted((r["seed"], r["epochs"], r["final_accuracy"]) for r in runs),
                "equal_epochs": common,
                "accuracy_at_equal_epochs": _spread([r["epoch_accuracy"][common - 1]
                                                     for r in runs] if common else [None]),
                "epochs": runs[0]["epochs"], "iterations": runs[0]["iterations"],
                "iteration_time_median": statistics.fmean(r["iteration_time_median"]
                                                          for r in runs),
                "iteration_time_mean": _mean_or_none([r["iteration_time_mean"] for r in runs]),
                "phases": {p: statistics.fmean(r["phases"][p] for r in runs) for p in PHASES},
                "bytes_sent": statistics.fmean(r["bytes_sent"] for r in runs),
                "mean_density": statistics.fmean(r["mean_density"] for r in runs),
                "mean_density_ratio": _mean_or_none([r["mean_density_ratio"] for r in runs]),
                "density_p10": _mean_or_none([r["density_p10"] for r in runs]),
                "density_p90": _mean_or_none([r["density_p90"] for r in runs]),
                "dirs": [r["dir"] for r in runs],
                "compression_configs": [r["compression_config"] for r in runs],
            }
        report[cell] = rows
    return report


def _one(runs: list[dict], key: str):
    """``key`` of the runs grouped under one label, which must agree (the label names a
    method's settings; runs with other settings are another row)."""
    values = [r[key] for r in runs]
    if any(v != values[0] for v in values):
        raise ValueError(f"runs under one label differ in {key}: "
                         + ", ".join(f"{r['dir']}: {r[key]}" for r in runs))
    return values[0]


def _mean_or_none(values: list[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.fmean(got) if got else None


def _fmt_spread(spread: dict, scale: float = 1.0, digits: int = 0,
                missing: str = "not reached") -> str:
    """``mean (min-max)`` over seeds; when not every seed got a value, over those that did,
    saying how many: ``319 (1 of 2 seeds)``, ``300 (280-320, 2 of 3 seeds)``."""
    if spread["mean"] is None:
        return missing
    text = f"{scale * spread['mean']:.{digits}f}"
    within = [f"{scale * spread['min']:.{digits}f}-{scale * spread['max']:.{digits}f}"
              ] if spread["reached"] > 1 else []
    if spread["reached"] < spread["runs"]:
        within.append(f"{spread['reached']} of {spread['runs']} seeds")
    return f"{text} ({', '.join(within)})" if within else text


def _ratio(a: dict, b: dict) -> str:
    """``a / b`` of two times' means, only when every seed of both reached the target (a
    mean over the seeds that did would favour the method that reached it less often)."""
    if any(x["mean"] is None or x["reached"] < x["runs"] for x in (a, b)):
        return "-"
    return f"{a['mean'] / b['mean']:.2f}x"


def markdown(report: dict, targets: list[float]) -> str:
    lines = []
    for cell, rows in report.items():
        hosts = next(iter(rows.values()))["world_size"]
        cores = os.cpu_count() or 1
        lines += [f"### Cell {cell}: {hosts} ranks on {cores} cores "
                  f"({hosts / cores:g} ranks per core)", ""]
        for t in targets:
            key = f"{t:g}"
            dense = rows.get("none", {}).get("time_to", {}).get(key)
            lines += [f"Time to {t:.0%} test accuracy (s of training, mean (min-max) over "
                      "seeds):", "",
                      "| method | seeds | time to target | dense / method | method / MiCRO | "
                      "iterations to target |", "|---|---|---:|---:|---:|---:|"]
            for label, row in rows.items():
                micro = _micro_row(rows, row)
                spread = row["time_to"][key]
                lines.append(
                    f"| {label} | {','.join(map(str, row['seeds']))} | {_fmt_spread(spread)} | "
                    f"{_ratio(dense, spread) if dense else '-'} | "
                    f"{_ratio(spread, micro['time_to'][key]) if micro else '-'} | "
                    f"{_fmt_spread(row['iterations_to'][key])} |")
            lines.append("")
        common = next(iter(rows.values()))["equal_epochs"]
        lines += [f"| method | accuracy % after {common} epoch(s) (min-max) | final accuracy % "
                  "per seed | mean density (x target) | p10 / p90 actual/target | bytes sent "
                  "per rank per iteration | ms per iteration (median / mean) |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for label, row in rows.items():
            acc_text = _fmt_spread(row["accuracy_at_equal_epochs"], 100, 2, "-")
            final_text = ", ".join(f"{100 * acc:.2f} (seed {seed}, {epochs} ep)"
                                   for seed, epochs, acc in row["finals"])
            if without_density(row["method"]):
                dens, spread = "1 (low rank)", "-"
            elif row["density"] is None:
                dens, spread = "1 (dense)", "-"
            else:
                dens = f"{row['mean_density']:.3g} ({row['mean_density_ratio']:.3f}x)"
                spread = f"{row['density_p10']:.2f} / {row['density_p90']:.2f}"
            lines.append(f"| {label} | {acc_text} | {final_text} | {dens} | "
                         f"{spread} | "
                         f"{row['bytes_sent'] / 1e3:,.1f} KB | "
                         f"{1000 * row['iteration_time_median']:.0f} / "
                         f"{1000 * (row['iteration_time_mean'] or 0):.0f} |")
        lines += ["", "Density: the coordinates applied per iteration (the union of the ranks' "
                  "selections) over N; Top-k-family methods select k per rank, so their union "
                  "is up to n times the target (gradient build-up), MiCRO's parts are disjoint. "
                  "Bytes: the slowest rank's, per iteration.",
                  "", "Time breakdown (ms per iteration, mean; each phase the slowest rank's):",
                  "", "| method | " + " | ".join(PHASES) + " |",
                  "|---|" + "---:|" * len(PHASES)]
        for label, row in rows.items():
            lines.append(f"| {label} | " + " | ".join(f"{1000 * row['phases'][p]:.1f}"
                                                       for p in PHASES) + " |")
        lines.append("")
    return "\n".join(lines)


def _micro_row(rows: dict, row: dict) -> dict | None:
    density = row["density"] if row["density"] is not None else 0.001
    return rows.get(f"micro d={density:g}")


def figures(report: dict, root: Path, target: float) -> list[Path]:
    """Accuracy against time and the breakdown per cell; iteration time against n."""
    import matplotlib.pyplot as plt

    from horovod_micro_train.plot import Run, accuracy_vs_time, group, time_breakdown

    out = Path(root) / "figures"
    made = []
    for cell, rows in report.items():
        dirs = [Path(d) for row in rows.values() for d in row["dirs"]]
        methods = group([Run(d) for d in dirs])
        cell_out = out / cell
        cell_out.mkdir(parents=True, exist_ok=True)
        made += [accuracy_vs_time(methods, cell_out, target), time_breakdown(methods, cell_out)]
    by_rate: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for cell, rows in report.items():
        rate = cell.split("-", 1)[1]
        for label, row in rows.items():
            by_rate.setdefault(rate, {}).setdefault(label, []).append(
                (row["world_size"], 1000 * row["iteration_time_median"]))
    for rate, methods in by_rate.items():
        if max(len(points) for points in methods.values()) < 2:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, points in methods.items():
            points.sort()
            ax.plot(*zip(*points), marker="o", label=label)
        cores = os.cpu_count() or 1
        ax.set(xlabel=f"ranks (one per emulated host; this machine has {cores} cores, so "
                      f"n > {cores} shares them)", ylabel="ms per iteration (median)",
               yscale="log", title=f"Iteration time against n at {rate} per host")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / f"iteration_time_vs_n-{rate}.png"
        out.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        made.append(path)
    return made


def write_report(root: Path, targets: list[float]) -> str:
    report = analyse(root, targets)
    (Path(root) / "results.json").write_text(json.dumps(report, indent=1))
    text = markdown(report, targets)
    (Path(root) / "report.md").write_text(text + "\n")
    figures(report, root, targets[-1])
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.time_to_accuracy",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="n=4 at 1 Gbit/s, dense, MiCRO and Top-k at d=0.001, one seed, "
                        "100 iterations (about 10 minutes)")
    p.add_argument("--cells", nargs="*", default=None,
                   help="headline (n=4, 1gbit, every method, seeds 1 2), scaling (n=2 and "
                        "n=8), slow (n=4, 100mbit)")
    p.add_argument("--hosts", type=int, default=None,
                   help="instead of --cells: one cell of this many hosts at --rate")
    p.add_argument("--rate", default="1gbit", help="with --hosts: each host's link rate")
    p.add_argument("--burst", default=None,
                   help="with --hosts: tbf's bucket on every link (default 1mb, under which "
                   "a message after a quiet moment costs no wire time; 64kb charges it); "
                   "the cell is then named nH-RATE-burstB")
    p.add_argument("--methods", nargs="*", default=None)
    p.add_argument("--densities", nargs="*", type=float, default=None)
    p.add_argument("--seeds", nargs="*", type=int, default=None)
    p.add_argument("--model", default="wide_mlp")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--iters", type=int, default=None, help="iterations per epoch (cut short)")
    p.add_argument("--eval-every", type=int, default=25, help="iterations between evaluations")
    p.add_argument("--targets", nargs="*", type=float, default=[0.8, 0.85],
                   help="target test accuracies; the last is drawn in the figures")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--fused-sgd", action="store_true",
                   help="train with torch's fused SGD (python -m horovod_micro_train --fused-sgd)")
    p.add_argument("--run-timeout", type=float, default=3600.0, help="seconds per run")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "time_to_accuracy")
    p.add_argument("--report-only", action="store_true")
    args = p.parse_args(argv)
    if args.burst and not args.hosts:
        p.error("--burst applies to one cell of your own: give --hosts (and --rate)")
    if args.quick:
        args.cells = ["quick"]
        args.iters = args.iters or 100
        args.eval_every = min(args.eval_every, 20)
        if args.out == p.get_default("out"):
            args.out = REPO / "runs" / "time_to_accuracy_quick"
    if not args.report_only:
        plan = matrix(args.cells or ["headline"], args)
        run_jobs(plan, args)
    print(write_report(args.out, args.targets))
    print(f"\nreport: {args.out / 'report.md'}; figures: {args.out / 'figures'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
