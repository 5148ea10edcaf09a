"""Per-iteration density spread of MiCRO's density controllers on real training.

What is measured: real Horovod training (``horovodrun``, Gloo, one thread per rank) of
digits (the embedded CNN), Fashion-MNIST (a 784-256-10 MLP) and ResNet-18 on synthetic
CIFAR-shaped data, at d = 0.01 and 0.001, n = 2 and 4, for each controller
(``bounded``, ``scale``, ``newton``, ``paper``). From iteration ``--warmup`` on, per cell:

* p10/p50/p90/p99, min and max of actual/target density per iteration;
* the share of iterations within +-10 % and +-25 % of the target;
* the running mean's worst error (the mean from ``--warmup`` to T, for every T from
  ``warmup + 100`` on; the mean over all iterations is reported too);
* the load imbalance ``max_r k_r * n / sum_r k_r - 1`` (StepStats.load_imbalance), median;
* rank 0's selection phase (``StepStats.phases["select"]``), mean and median ms, and the
  share of iterations in which a rank made the bounded controller's extra pass (over
  every rank's iterations; cells measured before every rank was logged: rank 0's).

Why a rank body of its own instead of ``python -m horovod_micro_train``: the selection phase and the
extra-pass flag are not in the training records. The loop is the trainer's (same data,
models, SGD with Nesterov momentum and weight decay 1e-4, batch 32 per rank) at a fixed
lr of 0.05 and without evaluation.

    .venv/bin/python -m bench.density_spread [--datasets digits fashion-mnist resnet18]
        [--densities 0.01 0.001] [--ranks 2 4] [--controllers bounded scale newton paper]
        [--iterations 300] [--warmup 50] [--json bench/results/density_spread.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from hvm_testbed.launch import horovodrun_cmd, run_bounded

REPO = Path(__file__).resolve().parent.parent
CONTROLLERS = ("bounded", "scale", "newton", "paper")
#: dataset name -> (horovod_micro_train.data dataset, model, batch per rank)
SETUPS = {"digits": ("digits", "digits_cnn", 32),
          "fashion-mnist": ("fashion-mnist", "fmnist_mlp", 32),
          "resnet18": ("synthetic", "resnet18", 32)}


def rank_body(spec: dict) -> None:
    """One rank's training loop; rank 0 writes its per-iteration records to spec["out"]."""
    import horovod.torch as hvd
    import torch
    from torch.nn import functional as F  # noqa: N812

    import horovod_micro as hvm
    from horovod_micro_train.data import build_datasets
    from horovod_micro_train.models import build_model

    hvd.init()
    torch.set_num_threads(1)
    dataset, model_name, batch = SETUPS[spec["dataset"]]
    data = build_datasets(dataset, synthetic_size=2048)
    torch.manual_seed(0)
    model = build_model(model_name, data.num_classes)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    # A fixed lr (0.05: the trainer's 0.1 * 32 * 2 / 128 at n = 2) at every n: scaled to
    # 0.1 at n = 4 without the trainer's warm-up, digits at d = 0.001 diverged.
    base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True,
                           weight_decay=1e-4)
    compression = hvm.Compression.micro(density=spec["density"],
                                        controller=spec["controller"])
    opt = hvm.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                   compression=compression)
    x, y = data.train.tensors
    gen = torch.Generator().manual_seed(1 + hvd.rank())
    ctl, records, own = compression.controller, [], []
    for t in range(spec["iterations"]):
        idx = torch.randint(0, len(x), (batch,), generator=gen)
        opt.zero_grad()
        loss = F.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        passes = getattr(ctl, "extra_passes", 0)
        log_m = list(getattr(ctl, "log_multipliers", []))
        opt.step()
        s = opt.last_stats
        extra = getattr(ctl, "extra_passes", 0) > passes
        records.append({"t": t, "ratio": s.global_count / s.target_count,
                        "counts": s.rank_counts, "imbalance": s.load_imbalance,
                        "select_ms": 1e3 * s.phases.get("select", 0.0),
                        "extra_pass": extra, "log_multipliers": log_m,
                        "nonfinite": s.nonfinite, "loss": float(loss.detach())})
        # Every rank's own view of its selection, to tell which part fell short and why:
        # its threshold, the RMS its base threshold scaled (the scale-free controllers)
        # and whether it made the extra pass.
        own.append([s.threshold, getattr(compression, "rms_scale", None), extra])
    per_rank = hvd.allgather_object(own)
    if hvd.rank() == 0:
        Path(spec["out"]).write_text(json.dumps({"numel": s.numel, "k": s.target_count,
                                                 "records": records,
                                                 "per_rank": per_rank}))


def quantile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolation quantile of an ascending list."""
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def spread(records: list[dict], warmup: int, per_rank: list | None = None) -> dict:
    """The module docstring's measures over the records from iteration ``warmup`` on. The extra-pass
    share is over every rank's iterations when ``per_rank`` (each rank's
    ``[threshold, scale, extra_pass]`` per iteration) is given, else rank 0's."""
    rs = records[warmup:]
    if per_rank:
        passes = [row[2] for rank in per_rank for row in rank[warmup:]]
    else:
        passes = [r["extra_pass"] for r in rs]
    ratios = sorted(r["ratio"] for r in rs)
    running = [statistics.mean(r["ratio"] for r in rs[:end])
               for end in range(min(100, len(rs)), len(rs) + 1)]
    select = [r["select_ms"] for r in rs]
    return {
        "iterations": len(rs),
        **{f"p{int(q * 100)}": quantile(ratios, q) for q in (0.1, 0.5, 0.9, 0.99)},
        "within_10": sum(abs(v - 1) <= 0.10 for v in ratios) / len(ratios),
        "within_25": sum(abs(v - 1) <= 0.25 for v in ratios) / len(ratios),
        "mean": statistics.mean(ratios),
        "running_mean_worst": max(running, key=lambda m: abs(m - 1.0)),
        "min": ratios[0], "max": ratios[-1],
        "imbalance_median": statistics.median(r["imbalance"] for r in rs),
        "select_ms_mean": statistics.mean(select),
        "select_ms_median": statistics.median(select),
        "extra_pass_share": sum(passes) / len(passes),
        "extra_pass_ranks": "all" if per_rank else "rank 0",
        "nonfinite_steps": sum(bool(r.get("nonfinite")) for r in rs),
        "final_loss": rs[-1].get("loss"),
    }


def trace(run: dict) -> dict:
    """Per iteration and rank: its count, threshold, RMS scale, extra pass; per iteration:
    the per-part log multipliers before the step (what a diagnosis of the spread needs)."""
    records = run["records"]
    return {"counts": [r["counts"] for r in records],
            "log_multipliers": [r.get("log_multipliers", []) for r in records],
            "per_rank": run.get("per_rank", [])}


def run_cell(dataset: str, density: float, n: int, controller: str, iterations: int,
             timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        spec = {"dataset": dataset, "density": density, "controller": controller,
                "iterations": iterations, "out": str(Path(tmp) / "rank0.json")}
        argv = [sys.executable, "-m", "bench.density_spread", "--rank-body", json.dumps(spec)]
        run_bounded(horovodrun_cmd(n, "gloo", argv), timeout, cwd=REPO,
                    env={"PYTHONPATH": str(REPO)}, label=f"{dataset} d={density} n={n} "
                                                          f"{controller}")
        return json.loads(Path(spec["out"]).read_text())


def table(cells: list[dict]) -> str:
    head = ("| dataset | d | n | controller | p10 | p50 | p90 | p99 | min | max | ±10 % | "
            "±25 % | worst running mean | imbalance | select ms (mean) | extra passes |")
    lines = [head, "|---|---:|---:|---|" + "---:|" * 12]
    for c in cells:
        s = c["spread"]
        lines.append(
            f"| {c['dataset']} | {c['density']} | {c['n']} | {c['controller']} | "
            f"{s['p10']:.2f} | {s['p50']:.2f} | {s['p90']:.2f} | {s['p99']:.2f} | "
            f"{s['min']:.3f} | {s['max']:.2f} | {s['within_10']:.0%} | {s['within_25']:.0%} | "
            f"{s['running_mean_worst'] - 1:+.1%} | {s['imbalance_median']:.2f} | "
            f"{s['select_ms_mean']:.3f} | {s['extra_pass_share']:.0%} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank-body", help=argparse.SUPPRESS)
    ap.add_argument("--datasets", nargs="+", default=["digits", "fashion-mnist"],
                    choices=sorted(SETUPS))
    ap.add_argument("--densities", nargs="+", type=float, default=[0.01, 0.001])
    ap.add_argument("--ranks", nargs="+", type=int, default=[2, 4])
    ap.add_argument("--controllers", nargs="+", default=list(CONTROLLERS),
                    choices=CONTROLLERS)
    ap.add_argument("--iterations", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--json", type=Path, default=REPO / "bench/results/density_spread.json")
    ap.add_argument("--table", action="store_true", help="print the table of --json only")
    args = ap.parse_args()
    if args.rank_body:
        rank_body(json.loads(args.rank_body))
        return
    if args.table:
        order = {name: i for i, name in enumerate(list(SETUPS) + list(CONTROLLERS))}
        cells = sorted(json.loads(args.json.read_text()), key=lambda c: (
            order[c["dataset"]], -c["density"], c["n"], order[c["controller"]]))
        print(table(cells))
        return
    cells = json.loads(args.json.read_text()) if args.json.exists() else []
    for dataset in args.datasets:
        for density in args.densities:
            for n in args.ranks:
                for controller in args.controllers:
                    start = time.perf_counter()
                    run = run_cell(dataset, density, n, controller, args.iterations,
                                   args.timeout)
                    cell = {"dataset": dataset, "density": density, "n": n,
                            "controller": controller, "numel": run["numel"], "k": run["k"],
                            "spread": spread(run["records"], args.warmup,
                                             run.get("per_rank")),
                            "ratios": [r["ratio"] for r in run["records"]],
                            "trace": trace(run),
                            "seconds": time.perf_counter() - start}
                    cells = [c for c in cells if (c["dataset"], c["density"], c["n"],
                                                  c["controller"]) != (dataset, density, n,
                                                                       controller)]
                    cells.append(cell)
                    args.json.parent.mkdir(parents=True, exist_ok=True)
                    args.json.write_text(json.dumps(cells))
                    print(table([cell]).splitlines()[-1], flush=True)
    print(table(cells))


if __name__ == "__main__":
    main()
