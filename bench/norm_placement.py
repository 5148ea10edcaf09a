"""Does the norm/NaN pass get cheaper if it runs in backward's hooks, right after each
gradient's add into the residual, while the data may still be in cache?

MiCRO's reducer reads the whole error-compensated gradient ``a_t`` once for its norm and
NaN/Inf check (``reducer.py``, the ``check`` phase), after backward. The alternative is a
dot per parameter in the post-accumulate hook, just after backward's in-place add wrote
that slice. This times both placements on the model's weight shapes, one CPU thread:

* ``hot``: per slice, ``e += g`` then at once ``e . e``;
* ``cold``: all adds, then a sweep over ``--evict-mb`` of other memory (the optimizer step
  and the next forward touch at least that much), then the dots.

Only the dots are timed; the two placements alternate for ``--rounds`` rounds.

    .venv/bin/python -m bench.norm_placement --model wide_mlp
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from horovod_micro_train.models import build_model


def dot_ms(slices, grads, evict, hot: bool) -> float:
    spent = 0.0
    for e, g in zip(slices, grads):
        e.add_(g)
        if hot:
            start = time.perf_counter()
            float(torch.dot(e, e))
            spent += time.perf_counter() - start
    if not hot:
        evict.mul_(1.0)
        for e in slices:
            start = time.perf_counter()
            float(torch.dot(e, e))
            spent += time.perf_counter() - start
    return 1000 * spent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="wide_mlp")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--evict-mb", type=float, default=240.0)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    shapes = [p.shape for p in build_model(args.model, num_classes=10).parameters()]
    slices = [torch.randn(s).reshape(-1) for s in shapes]
    grads = [torch.randn(s).reshape(-1) * 1e-3 for s in shapes]
    evict = torch.randn(int(args.evict_mb * 1e6 / 4))
    times = {"hot": [], "cold": []}
    for _ in range(args.rounds):
        for label in times:
            times[label].append(dot_ms(slices, grads, evict, label == "hot"))
    numel = sum(e.numel() for e in slices)
    print(f"{args.model}: {numel:,} elements, dots per step, median of {args.rounds} "
          f"rounds: hot {statistics.median(times['hot']):.2f} ms, "
          f"cold {statistics.median(times['cold']):.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
