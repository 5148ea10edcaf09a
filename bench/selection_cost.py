"""Selection cost on one CPU thread: MiCRO's partitioned threshold vs Top-k vs full thresholds.

What is measured: the time one rank spends choosing the coordinates it
sends, on an 11,173,962-element float32 gradient (ResNet-18 for CIFAR; by default a real
gradient from one backward pass on random CIFAR-shaped data), at densities 0.01 and 0.001,
all methods side by side in one run, interleaved, repeated, medians reported:

* ``micro n=..``: ``ThresholdSelector`` (the native one-pass kernel MiCRO uses) over the
  rank's part, N/n elements, at the threshold that selects ``density`` of that part (what
  the density controller steers to); the part rotates with the repetition, as in training;
* ``micro drift n=..``: MiCRO's default judge (``DriftSelector``: the same pass over the
  part, reading each coordinate's 16-bit age stamp beside it, ``|a| sqrt(wait / age) >= t``), with
  ages drawn uniformly from 1 to 2/d (mean wait 1/d) and the threshold that selects
  ``density`` of the part by that score;
* ``read floor n=..``: ``torch.sum`` of the same part: one read pass, the physical floor;
* ``naive nonzero n=..``: ``torch.nonzero(part.abs() >= t)`` (what plain torch would do);
* ``topk``: ``torch.topk(|g|, k, sorted=False)`` over all N (Top-k, CLT-k's leader);
* ``threshold native`` / ``threshold torch``: a full-vector hard threshold (Sahu et al.)
  with the same native kernel and with ``nonzero(|g| >= t)``.

Before every timed call a buffer of twice the last-level cache (``--flush-mb``; at least
64 MB) is read so that each call starts from a cold cache, its data in DRAM, as after a
backward pass over a model larger than the cache (``--warm`` skips that; a smaller
``--flush-mb`` leaves the data in the last-level cache: on a machine with a large one,
the passes are then partly compute-bound). Within each repetition the methods run in an
order rotated by one place per repetition, so that no method always pays for coming first
after the flush.
``torch.set_num_threads(1)``: one core, as one rank would have.

Results, and the machine they were measured on (cache sizes included): BENCHMARKS.md,
"Selection cost" and "Machine and caveats".

    .venv/bin/python -m bench.selection_cost [--reps 12] [--quick] [--warm] [--flush-mb MB]
        [--json bench/results/selection_cost.json]

``--controllers`` measures instead each density controller's whole ``select`` (what the
``select`` phase of a step runs: the kernel, which also writes the selected values, the
slope probe or the ladder search, and the bounded controller's extra pass when it makes one)
over part 0 at n = 2 and 4, next to the read floor of that part, with the base threshold
at the exact one, 4 ladder steps (2^(4/64), 4.4 %) below it (the bounded controller's
usual case: its bias aims low, and the ladder search trims upward) and 50 % above it (the
count far too low: the extra pass). The cases marked "(before)" run the same controller
with the values gathered from the part after the kernel, as before the kernel wrote them:
before and after side by side in one run. The accounting: mean cost = cost without the
pass + share of iterations with the pass (bench/density_spread.py) x the pass.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
from pathlib import Path

import torch

from bench.common import median, real_gradient, timed
from horovod_micro.compressors.micro.drift import DriftSelector, drift_scores, stamps
from horovod_micro.compressors.micro.partition import part_bounds
from horovod_micro.selection import ThresholdSelector, native_available

PARTS = (2, 4, 8, 16)
DENSITIES = (0.01, 0.001)


def kth_magnitude(x: torch.Tensor, count: int) -> float:
    """The threshold that keeps ``count`` entries of ``x`` (its count-th largest |x|)."""
    return float(torch.topk(x.abs(), max(count, 1), sorted=False).values.min())


def last_level_cache_mb() -> int:
    """The largest cache of CPU 0, in MB (sysfs), or 32 where sysfs does not say."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip()
        scale = {"K": 1 / 1024, "M": 1, "G": 1024}.get(text[-1:], 1 / 1024 / 1024)
        sizes.append(float(text.rstrip("KMG")) * scale)
    return int(max(sizes, default=32))


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        if line.startswith("Model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=12,
                    help="repetitions (a multiple of 12 puts every method in every place)")
    ap.add_argument("--quick", action="store_true", help="3 repetitions, density 0.001 only")
    ap.add_argument("--warm", action="store_true", help="no cache flush between calls")
    ap.add_argument("--flush-mb", type=int, default=None,
                    help="MB read before every timed call (default: twice the last-level "
                         "cache, at least 64)")
    ap.add_argument("--synthetic", action="store_true",
                    help="a N(0,1) vector instead of a real ResNet-18 gradient")
    ap.add_argument("--json", type=Path, help="write the medians here")
    ap.add_argument("--controllers", action="store_true",
                    help="time each density controller's whole select")
    args = ap.parse_args()
    if args.controllers:
        controller_costs(args)
        return
    reps = 3 if args.quick else args.reps
    densities = (0.001,) if args.quick else DENSITIES
    torch.set_num_threads(1)

    if args.synthetic:
        torch.manual_seed(0)
        g, source = torch.randn(11_173_962), "N(0,1) synthetic"
    else:
        g, source = real_gradient()
    N = g.numel()
    flush_mb = args.flush_mb or max(64, 2 * last_level_cache_mb())
    flush_buf = torch.ones(flush_mb * 256 * 1024)

    def flush():
        if not args.warm:
            flush_buf.sum()

    selector = ThresholdSelector(capacity=N // 50)
    drift = DriftSelector(capacity=N // 50)
    now = 1 << 20
    # Thresholds: full vector and every part of every n, each giving exactly `density`.
    cases = {}
    for d in densities:
        k = int(d * N)
        gen = torch.Generator().manual_seed(1)
        last = stamps(now - torch.randint(1, int(2 / d) + 1, (N,), generator=gen))
        scores = drift_scores(g, last, now, 1.0 / d)
        cases[d] = {"k": k, "t_full": kth_magnitude(g, k), "parts": {}, "last": last,
                    "drift": {}}
        for n in PARTS:
            bounds = part_bounds(N, n)
            cases[d]["parts"][n] = [(s, e, kth_magnitude(g[s:e], int(d * (e - s))))
                                    for s, e in bounds]
            cases[d]["drift"][n] = [kth_magnitude(scores[s:e], int(d * (e - s)))
                                    for s, e in bounds]

    times: dict[tuple[float, str], list[float]] = {}
    counts: dict[tuple[float, str], int] = {}

    def run(d, label, fn):
        flush()
        result = {}
        times.setdefault((d, label), []).append(timed(lambda: result.setdefault("r", fn())))
        r = result["r"]
        if isinstance(r, torch.Tensor) and r.dim() >= 1 and label not in counts:
            counts[(d, label)] = r.numel() if r.dim() == 1 else r.shape[0]

    def rotated(calls, rep):
        """``calls`` in the order of repetition ``rep``: rotated one place per repetition,
        so every method runs in every position equally often (the first call after the
        flush pays more than the later ones; measured: the read floor timed 2x slower in
        first place than in last)."""
        shift = rep % len(calls)
        return calls[shift:] + calls[:shift]

    for rep in range(reps):
        for d in densities:
            c = cases[d]
            k, t = c["k"], c["t_full"]
            for label, fn in rotated([
                    ("topk (full N)", lambda k=k: torch.topk(g.abs(), k, sorted=False).indices),
                    ("threshold native (full N)", lambda t=t: selector(g, t, 0, N)),
                    ("threshold torch (full N)", lambda t=t: torch.nonzero(g.abs() >= t))],
                    rep):
                run(d, label, fn)
            for n in PARTS:
                s, e, tp = c["parts"][n][rep % n]
                part = g[s:e]
                td, ages = c["drift"][n][rep % n], c["last"][s:e]
                drift.bind(part, ages, now, 1.0 / d)
                for label, fn in rotated([
                        (f"micro n={n}", lambda p=part, t=tp, s=s: selector(p, t, s, N)),
                        (f"micro drift n={n}",
                         lambda p=part, t=td, s=s: drift.with_values(p, t, s, N)[0]),
                        (f"read floor n={n}", lambda p=part: torch.sum(p)),
                        (f"naive nonzero n={n}",
                         lambda p=part, t=tp: torch.nonzero(p.abs() >= t))], rep):
                    run(d, label, fn)

    med = {key: median(v) * 1e3 for key, v in times.items()}
    print(f"# Selection benchmark: N = {N:,} float32 ({source}), 1 thread, "
          f"{reps} repetitions, medians, "
          f"{'warm cache' if args.warm else f'{flush_mb} MB read before each call'}; "
          f"native kernel: {native_available()}; CPU: {cpu_model()}\n")
    header = "| method |" + "".join(
        f" d={d}: ms | d={d}: topk / this | d={d}: this / floor |" for d in densities)
    print(header)
    print("|---|" + "---:|" * (3 * len(densities)))
    labels = ["topk (full N)", "threshold native (full N)", "threshold torch (full N)"]
    for n in PARTS:
        labels += [f"micro n={n}", f"micro drift n={n}", f"read floor n={n}",
                   f"naive nonzero n={n}"]
    for label in labels:
        row = f"| {label} |"
        for d in densities:
            ms = med[(d, label)]
            floor = ""
            if label.startswith(("micro", "naive")):
                n = label.split("n=")[1]
                floor = f"{ms / med[(d, f'read floor n={n}')]:.2f}"
            row += f" {ms:.2f} | {med[(d, 'topk (full N)')] / ms:.1f} | {floor} |"
        print(row)
    print()
    bars = []
    for d in densities:
        for n in PARTS:
            for judge in ("micro", "micro drift"):
                m = med[(d, f"{judge} n={n}")]
                bars.append((d, n, judge, med[(d, "topk (full N)")] / m,
                             m / med[(d, f"read floor n={n}")]))
    print("| density | n | judge | speed-up over topk (bar >= 20) | / read floor (bar <= 2) |")
    print("|---:|---:|---|---:|---:|")
    for d, n, judge, up, fl in bars:
        name = "drift" if "drift" in judge else "magnitude"
        print(f"| {d} | {n} | {name} | {up:.0f}x {'ok' if up >= 20 else 'MISSED'} "
              f"| {fl:.2f}x {'ok' if fl <= 2 else 'MISSED'} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "numel": N, "source": source, "reps": reps, "warm": args.warm, "cpu": cpu_model(),
            "flush_mb": None if args.warm else flush_mb,
            "last_level_cache_mb": last_level_cache_mb(),
            "median_ms": {f"{d}|{label}": v for (d, label), v in med.items()},
            "selected": {f"{d}|{label}": v for (d, label), v in counts.items()},
        }, indent=1))



class GatheringSelector(ThresholdSelector):
    """The selection as it was before the kernel wrote the values (commit 43c8ec5): the
    indices from the kernel, then the values gathered from the part at those indices. Kept
    so that before and after are timed side by side in one run."""

    def with_values(self, segment, threshold, offset, numel):
        indices = self(segment, threshold, offset, numel)
        return indices, segment.index_select(0, indices - offset)


def controller_costs(args) -> None:
    """Each controller's whole ``select`` over part 0 vs the read floor (see the module
    docstring), cold cache unless ``--warm``."""
    import math

    from horovod_micro.compressors.micro.density_controller import DensityController
    from horovod_micro.compressors.micro.part_controller import PartController

    torch.set_num_threads(1)
    g, source = (torch.randn(11_173_962), "N(0,1)") if args.synthetic else real_gradient()
    N, reps = g.numel(), 3 if args.quick else args.reps
    scale = math.sqrt(float(torch.dot(g, g)) / N)
    flush_buf = torch.ones(16 * 1024 * 1024)
    print(f"# whole select() per controller: N = {N:,} ({source}), part 0, 1 thread, "
          f"{reps} repetitions, medians, {'warm' if args.warm else 'cold'} cache\n")
    print("| density | n | case | ms | read floor ms | this / floor | selected | extra pass |")
    print("|---:|---:|---|---:|---:|---:|---:|---|")
    results = {}
    for d in (0.001,) if args.quick else DENSITIES:
        for n in (2, 4):
            bounds = part_bounds(N, n)
            s, e = bounds[0]
            k = int(d * N)
            exact = kth_magnitude(g[s:e], int(k * (e - s) / N))
            usual, high = 2.0 ** (-4 / 64), 1.5
            cases = {"newton (kernel + probe)": ("newton", 1.0, ThresholdSelector),
                     "bounded, base at target": ("bounded", 1.0, ThresholdSelector),
                     "bounded, base 4 % low (usual: bias 4 steps)": ("bounded", usual,
                                                                     ThresholdSelector),
                     "bounded, usual, values gathered (before)": ("bounded", usual,
                                                                  GatheringSelector),
                     "bounded, base 50 % high (extra pass)": ("bounded", high,
                                                              ThresholdSelector),
                     "bounded, extra pass, values gathered (before)": ("bounded", high,
                                                                       GatheringSelector)}
            for label, (kind, factor, selector_class) in cases.items():
                times, floors, counts, passes = [], [], 0, 0
                # One selector per case, as one per optimizer in training: its buffer's
                # capacity grows once (a redone pass) and stays.
                selector = selector_class(capacity=2 * k // n + 64)
                for _ in range(reps):
                    if kind == "newton":
                        ctl = DensityController(k, threshold=exact)
                    else:
                        ctl = PartController(k, [b - a for a, b in bounds], d)
                        ctl.log_multipliers[0] = math.log(factor * exact / scale)
                    if not args.warm:
                        flush_buf.sum()
                    out = {}
                    times.append(timed(lambda ctl=ctl, sel=selector, out=out, s=s, e=e:
                                       out.setdefault("r", ctl.select(g, s, e, 0, sel,
                                                                      scale))))
                    counts = out["r"][0].numel()
                    passes = getattr(ctl, "extra_passes", 0)
                    if not args.warm:
                        flush_buf.sum()
                    floors.append(timed(lambda s=s, e=e: torch.sum(g[s:e])))
                ms, floor = median(times) * 1e3, median(floors) * 1e3
                results[f"{d}|{n}|{label}"] = {"ms": ms, "floor_ms": floor, "count": counts}
                print(f"| {d} | {n} | {label} | {ms:.2f} | {floor:.2f} | {ms / floor:.2f} | "
                      f"{counts:,} | {'yes' if passes else 'no'} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
