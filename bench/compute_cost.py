"""Compute cost of one training step per model: forward + backward + SGD step on one CPU
thread, no communication.

This is the number that decides whether a model is compute-bound or communication-bound
behind a given link: a dense exchange moves about ``2 (n-1)/n * 4 * parameters`` bytes per
rank per step, and the step itself costs what this script measures. ``wide_mlp`` has about
ResNet-18's parameter count at a small fraction of its compute (the communication-bound
regime); ResNet-18 on CIFAR-sized inputs is compute-bound on a CPU.

    python -m bench.compute_cost                    # wide_mlp, fmnist_mlp, resnet18
    python -m bench.compute_cost --models wide_mlp --steps 30 --json out.json
    python -m bench.compute_cost --models wide_mlp --sgd-step     # the update alone

``--sgd-step`` times the SGD update alone, with the trainer's settings (Nesterov momentum 0.9,
weight decay 1e-4), in torch's three implementations: the per-parameter loop (CPU's default),
``foreach`` and ``fused`` (``python -m horovod_micro_train --fused-sgd``). The update is a few
memory-bound passes over the weights, so on a CPU it costs as much as a small model's forward
and backward.

Reports the median wall time and its 10th/90th percentiles over ``--steps`` timed steps
after ``--warmup`` untimed ones (random inputs of the model's dataset shape, fixed seed),
and the median CPU time of the process per step. On a shared machine the wall time grows
with the other processes' load; the CPU time much less (it still counts cache and memory
contention), so a CPU time well below the wall time says the machine was busy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch.nn import functional as F  # noqa: N812

from horovod_micro_train.models import build_model

#: Input shape per model (channels, height, width): the dataset each model is used with.
INPUT_SHAPES = {"wide_mlp": (1, 28, 28), "fmnist_mlp": (1, 28, 28), "digits_cnn": (1, 8, 8),
                "resnet18": (3, 32, 32), "googlenet": (3, 32, 32), "senet18": (3, 32, 32)}


def step_times(name: str, batch_size: int, steps: int, warmup: int
               ) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of each timed forward+backward+SGD step of model ``name``."""
    torch.manual_seed(0)
    model = build_model(name, num_classes=10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch_size, *INPUT_SHAPES[name])
    y = torch.randint(0, 10, (batch_size,))
    times = []
    for i in range(warmup + steps):
        start, cpu = time.perf_counter(), time.process_time()
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        if i >= warmup:
            times.append((time.perf_counter() - start, time.process_time() - cpu))
    return times


SGD_IMPLS = {"loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def sgd_step_ms(name: str, rounds: int, steps: int) -> dict[str, float]:
    """Median ms of one SGD update of model ``name``'s weights per implementation, the
    implementations taking turns for ``rounds`` rounds of ``steps`` updates each."""
    optimizers = {}
    for impl, flags in SGD_IMPLS.items():
        torch.manual_seed(0)
        model = build_model(name, num_classes=10)
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        optimizers[impl] = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9,
                                           nesterov=True, weight_decay=1e-4, **flags)
    times: dict[str, list[float]] = {impl: [] for impl in SGD_IMPLS}
    for _ in range(rounds):
        for impl, optimizer in optimizers.items():
            optimizer.step()  # untimed: warm
            for _ in range(steps):
                start = time.perf_counter()
                optimizer.step()
                times[impl].append(1000 * (time.perf_counter() - start))
    return {impl: statistics.median(t) for impl, t in times.items()}


def measure(name: str, batch_size: int, steps: int, warmup: int) -> dict:
    """Parameter count and step-time statistics (milliseconds) of model ``name``."""
    pairs = step_times(name, batch_size, steps, warmup)
    times = sorted(1000 * wall for wall, _ in pairs)
    params = sum(p.numel() for p in build_model(name, num_classes=10).parameters())
    deciles = (statistics.quantiles(times, n=10, method="inclusive") if len(times) > 1
               else times * 9)
    return {"model": name, "parameters": params, "batch_size": batch_size,
            "threads": torch.get_num_threads(), "steps": steps,
            "median_ms": statistics.median(times), "p10_ms": deciles[0],
            "p90_ms": deciles[-1],
            "median_cpu_ms": statistics.median(1000 * c for _, c in pairs),
            "dense_fp32_mb": 4 * params / 1e6}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["wide_mlp", "fmnist_mlp", "resnet18"],
                    choices=sorted(INPUT_SHAPES))
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per model")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--sgd-step", action="store_true",
                    help="time the SGD update alone, loop vs foreach vs fused")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1 or args.threads < 1:
        ap.error("--steps, --batch-size and --threads must be at least 1")
    torch.set_num_threads(args.threads)
    results = []
    if args.sgd_step:
        print(f"SGD update alone, median ms ({args.threads} thread(s)): "
              + " | ".join(SGD_IMPLS))
        for name in args.models:
            ms = sgd_step_ms(name, rounds=3, steps=args.steps)
            results.append({"model": name, "sgd_step_ms": ms})
            print(f"{name:<12} " + " | ".join(f"{ms[i]:.1f}" for i in SGD_IMPLS), flush=True)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1) + "\n")
        return 0
    print(f"{'model':<12} {'parameters':>12} {'fp32 MB':>8} {'median ms':>10} "
          f"{'p10':>8} {'p90':>8} {'CPU ms':>8}   (batch {args.batch_size}, "
          f"{args.threads} thread(s))")
    for name in args.models:
        r = measure(name, args.batch_size, args.steps, args.warmup)
        results.append(r)
        print(f"{name:<12} {r['parameters']:>12,} {r['dense_fp32_mb']:>8.1f} "
              f"{r['median_ms']:>10.1f} {r['p10_ms']:>8.1f} {r['p90_ms']:>8.1f} "
              f"{r['median_cpu_ms']:>8.1f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
