"""Accuracy against the number of workers on real ranks: ``python -m horovod_micro_train`` under
horovodrun.

The in-process benchmark (:mod:`bench.scaling`) answers the question for many n at once;
this one confirms it with the training entrypoint itself: real Horovod ranks on Gloo, the
real ``DistributedOptimizer`` (momentum masking included), the trainer's data sharding and
schedule. It runs ``make run``'s recipe (Fashion-MNIST, ``fmnist_mlp``, 3 epochs, batch 64
per rank, density 0.01, lr scaled by the ranks), or with ``--dataset`` another dataset's
recipe (``digits``: ``digits_cnn``, 12 epochs, batch 32), for each method, rank count and seed, and
reports the final test accuracy and the bytes the busiest rank sent per iteration, both read
back from each run's records (``epochs.jsonl``, ``iterations.jsonl``).

    .venv/bin/python -m bench.scaling_ranks --ranks 8 --seeds 1 2 \\
        --methods none micro "micro --judge magnitude --momentum-masking off" \\
        --json bench/results/scaling-ranks.json

    .venv/bin/python -m bench.scaling_ranks --dataset digits --ranks 2 --seeds 1 2 \\
        --methods none micro "micro --momentum-masking on"

A method is ``--compressor`` and any further ``train`` flags. Finished runs found in
``--json`` are reused. On a machine with fewer cores than ranks the ranks share them: the
accuracy at equal epochs is what this measures, not time.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from horovod_micro_train.cli import RECIPES
from horovod_micro_train.records import read_jsonl
from hvm_testbed.launch import horovodrun_cmd, run_bounded

REPO = Path(__file__).resolve().parent.parent
#: ``make run``'s dataset; rows recorded before ``--dataset`` existed ran it
DATASET = "fashion-mnist"


def run(method: str, ranks: int, seed: int, epochs: int, timeout: float,
        dataset: str = DATASET) -> dict:
    """One ``python -m horovod_micro_train`` run of ``dataset``'s recipe; its final accuracy
    and bytes per iteration."""
    compressor, *flags = shlex.split(method)
    with tempfile.TemporaryDirectory(prefix="hvm-scaling-") as out:
        argv = [sys.executable, "-m", "horovod_micro_train",
                "--dataset", dataset, "--compressor",
                compressor, *flags, "--epochs", str(epochs), "--seed", str(seed),
                "--no-plots", "--progress", "none", "--out", out]
        run_bounded(horovodrun_cmd(ranks, "gloo", argv), timeout, cwd=REPO,
                    env={"OMP_NUM_THREADS": "1"}, label=f"{method} on {ranks} ranks")
        epochs_rec = read_jsonl(Path(out) / "epochs.jsonl")
        iterations = read_jsonl(Path(out) / "iterations.jsonl")
        config = json.loads((Path(out) / "run.json").read_text())
    sent = [it.get("bytes_sent_max", it.get("bytes_sent", 0)) for it in iterations]
    density = [it["density"] for it in iterations if "density" in it]
    return {"method": method, "dataset": dataset, "ranks": ranks, "seed": seed, "epochs": epochs,
            # The compressor's whole configuration as the ranks held it (None: dense).
            "compression_config": config.get("compression_config"),
            "final_accuracy": epochs_rec[-1]["test_accuracy"],
            "accuracy_by_epoch": [e["test_accuracy"] for e in epochs_rec],
            "bytes_per_iteration": sum(sent) / max(len(sent), 1),
            "mean_density": sum(density) / len(density) if density else 1.0}


def table(runs: Sequence[dict]) -> str:
    lines = ["| method | ranks | seeds | final accuracy (each seed) | mean | bytes/iteration, "
             "busiest rank | mean density |", "|---|---:|---|---|---:|---:|---:|"]
    keys = list(dict.fromkeys((r["method"], r["ranks"]) for r in runs))
    for method, ranks in keys:
        rs = [r for r in runs if (r["method"], r["ranks"]) == (method, ranks)]
        accs = [r["final_accuracy"] for r in rs]
        lines.append(
            f"| `{method}` | {ranks} | {', '.join(str(r['seed']) for r in rs)} | "
            f"{', '.join(f'{a:.2%}' for a in accs)} | {sum(accs) / len(accs):.2%} | "
            f"{sum(r['bytes_per_iteration'] for r in rs) / len(rs) / 1e3:,.1f} KB | "
            f"{sum(r['mean_density'] for r in rs) / len(rs):.4f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", default=["none", "micro"])
    p.add_argument("--ranks", type=int, nargs="+", default=[8])
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--dataset", default=DATASET, choices=sorted(RECIPES))
    p.add_argument("--epochs", type=int, default=None, help="default: the dataset's recipe")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    epochs = args.epochs or RECIPES[args.dataset]["epochs"]
    previous = (json.loads(args.json.read_text())["runs"]
                if args.json and args.json.exists() else [])
    runs = []
    for ranks in args.ranks:
        for seed in args.seeds:
            for method in args.methods:
                done = [r for r in previous if (r["method"], r.get("dataset", DATASET),
                                                r["ranks"], r["seed"], r["epochs"]) ==
                        (method, args.dataset, ranks, seed, epochs)]
                result = done[0] if done else run(method, ranks, seed, epochs,
                                                  args.timeout, args.dataset)
                runs.append(result)
                print(f"{method} ranks={ranks} seed={seed}: "
                      f"{result['final_accuracy']:.2%}", flush=True)
                if args.json and not done:
                    previous.append(result)
                    args.json.write_text(json.dumps({"runs": previous}, indent=1) + "\n")
    print(table(runs))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
