"""Time per iteration of the main job on real ranks: dense against MiCRO, side by side.

The question it answers: on n Gloo (or MPI) ranks of ``python -m horovod_micro_train``
(Fashion-MNIST, ``fmnist_mlp``, ``make run``'s recipe), is MiCRO's iteration faster than
dense's, and what does each part of it cost? Every variant runs the same number of
iterations, the variants interleaved in rounds (the machine's drift falls on all of them
alike); per run the median over the iterations after the first ten (each iteration's time
is its slowest rank's).

    .venv/bin/python -m bench.iteration_ranks [--ranks 8] [--rounds 2] [--iters 60]
        [--backend gloo|mpi] [--cycle-time-ms MS] [--json runs/iteration-ranks8.json]

Variants: ``dense`` (``--compressor none``), ``micro`` (the defaults: fixed-shape slots),
``micro-exact`` (``--capacity exact``: variable-size blocks, negotiated every step),
``micro-ahead`` (``micro_ahead``: the coordinates agreed a step ahead, one allreduce).
Each also with ``-spin``: ``HOROVOD_MICRO_WAIT=spin``, the ranks waiting for a collective
by Horovod's own spinning ``synchronize`` (``hvd.DistributedOptimizer``'s wait) instead of
asleep (``horovod_micro.waiting``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from hvm_testbed.launch import horovodrun_cmd, run_bounded

REPO = Path(__file__).resolve().parent.parent
VARIANTS = {"dense": ["--compressor", "none"], "micro": ["--compressor", "micro"],
            "micro-exact": ["--compressor", "micro", "--capacity", "exact"],
            "micro-ahead": ["--compressor", "micro_ahead"]}
VARIANTS.update({f"{name}-spin": argv for name, argv in list(VARIANTS.items())})
SPIN = {"HOROVOD_MICRO_WAIT": "spin"}
FIELDS = ("total", "communication", "selection", "sync_other")
SKIP = 10  # first iterations left out (negotiation, allocation, the first exchange's checks)


def one_run(ranks: int, iters: int, extra: list[str], out: Path,
            env: dict[str, str] | None = None, backend: str = "gloo") -> dict:
    argv = [sys.executable, "-m", "horovod_micro_train",
            "--dataset", "fashion-mnist", "--epochs", "1",
            "--max-iters-per-epoch", str(iters), "--out", str(out)] + extra
    # One thread per rank, as ``make run`` launches the job (run_bounded sets
    # OMP_NUM_THREADS=1): torch's default of one thread per core puts 2n threads on the
    # cores, and the ranks then time each other's spinning, not the step.
    run_bounded(horovodrun_cmd(ranks, backend, argv), timeout=1800, cwd=REPO, env=env)
    rows = [json.loads(line) for line in (out / "iterations.jsonl").read_text().splitlines()]
    kept = rows[SKIP:]
    result = {f: statistics.median(r[f] for r in kept) for f in FIELDS}
    result["bytes_sent"] = statistics.mean(r["bytes_sent"] for r in kept)
    # What the run's optimizer held (None for dense): the figures say which settings.
    result["compression_config"] = json.loads(
        (out / "run.json").read_text()).get("compression_config")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--iters", type=int, default=60)
    ap.add_argument("--variants", nargs="+", default=["dense", "micro", "micro-exact",
                                                      "micro-ahead"], choices=list(VARIANTS))
    ap.add_argument("--cycle-time-ms", type=float, default=None,
                    help="HOROVOD_CYCLE_TIME for the ranks (Horovod 0.28.1 default: 1 ms)")
    ap.add_argument("--backend", choices=("gloo", "mpi"), default="gloo")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {v: [] for v in args.variants}
    env = (None if args.cycle_time_ms is None
           else {"HOROVOD_CYCLE_TIME": f"{args.cycle_time_ms:g}"})
    with tempfile.TemporaryDirectory(prefix="hvm-iteration-") as tmp:
        for r in range(args.rounds):
            for name in args.variants:
                run_env = {**(env or {}), **(SPIN if name.endswith("-spin") else {})}
                row = one_run(args.ranks, args.iters, VARIANTS[name], Path(tmp) / f"{name}-{r}",
                              run_env or None, args.backend)
                runs[name].append(row)
                print(f"round {r} {name}: " + ", ".join(
                    f"{f} {row[f] * 1e3:.1f} ms" for f in FIELDS)
                    + f", {row['bytes_sent'] / 1e3:.1f} KB sent", flush=True)
    print(f"\n| {args.ranks} {args.backend} ranks | " + " | ".join(f"{f}, ms" for f in FIELDS)
          + " | x dense (total) |")
    print("|---|" + "---:|" * (len(FIELDS) + 1))
    dense = statistics.median(x["total"] for x in runs.get("dense", [])) if "dense" in runs \
        else None
    for name, rows in runs.items():
        cells = [statistics.median(x[f] for x in rows) * 1e3 for f in FIELDS]
        ratio = f"{cells[0] / (dense * 1e3):.3f}" if dense else ""
        print(f"| {name} | " + " | ".join(f"{c:.1f}" for c in cells) + f" | {ratio} |")
    if args.json:
        args.json.write_text(json.dumps({"ranks": args.ranks, "iters": args.iters,
                                         "backend": args.backend,
                                         "cycle_time_ms": args.cycle_time_ms,
                                         "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
