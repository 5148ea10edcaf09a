"""Exact variable-size exchange vs fixed-capacity padded buffers, on real Horovod ranks.

Why: MiCRO's per-rank selected count changes every step. Horovod's response cache (and
NCCL's allgather) prefer tensors whose shapes stay the same from step to step, so one
alternative design pads the indices to a fixed capacity and allreduces a fixed-size value
vector. This measures what each design costs on the machine's collectives.

Per step, exactly MiCRO's exchange pattern (2 ranks by default):

* ``variable``: allgather of an int32 block ``[3 header + k_r indices]`` with ``k_r`` drawn
  afresh each step (+-20 % around k/n), then allreduce of ``sum_r k_r`` float32 values;
* ``fixed``: the same with every block padded to a capacity of 1.5 k/n (fixed shapes; the
  largest draw never overflows it), then an allreduce of ``n * capacity`` values.

Both designs run interleaved step by step (separate tensor names, so each keeps its own
cache entries), after a tiny untimed allreduce that lines the ranks up. Reported: median
and mean latency of the gather+allreduce pair on rank 0, and bytes per rank (ring model of
``horovod_micro.stats``), for densities 0.01 and 0.001 of N = 11,173,962, over Gloo and MPI.

Results: ``bench/results/collective_shapes*.json``, read by the bytes model's time projection
(BENCHMARKS.md, "Bytes model"); MiCRO's exchange as it is now, in fixed slots: BENCHMARKS.md,
"Fixed-shape exchange".

    .venv/bin/python -m bench.collective_shapes [--steps 300] [--backends gloo mpi] [--np 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from bench.common import mean, median
from bench.launch import horovodrun_cmd, run_bounded

N = 11_173_962
DENSITIES = (0.01, 0.001)


def worker(steps: int, out: Path) -> None:
    import horovod.torch as hvd
    import torch

    from horovod_micro.stats import ring_allgather_bytes, ring_allreduce_bytes

    torch.set_num_threads(1)
    hvd.init()
    n, rank = hvd.size(), hvd.rank()
    results = {}
    for d in DENSITIES:
        per_rank = int(d * N) // n
        cap = int(1.5 * per_rank)
        gen = torch.Generator().manual_seed(1234)  # same draws on every rank
        lat = {"variable": [], "fixed": []}
        nbytes = {"variable": [], "fixed": []}
        for step in range(steps + 10):
            counts = torch.randint(int(0.8 * per_rank), int(1.2 * per_rank) + 1, (n,),
                                   generator=gen).tolist()
            for design in ("variable", "fixed") if step % 2 else ("fixed", "variable"):
                size = counts[rank] if design == "variable" else cap
                block = torch.randint(0, N, (3 + size,), dtype=torch.int32)
                block[1] = counts[rank]
                total = sum(counts) if design == "variable" else n * cap
                values = torch.randn(total)
                hvd.allreduce(torch.zeros(1), name="line-up")
                t0 = time.perf_counter()
                hvd.allgather(block, name=f"{design}.{d}.idx")
                hvd.allreduce_(values, name=f"{design}.{d}.val", op=hvd.Sum)
                dt = time.perf_counter() - t0
                if step >= 10:  # warm-up steps excluded
                    blocks = [4 * (3 + (c if design == "variable" else cap)) for c in counts]
                    sent = ring_allgather_bytes(blocks, rank)[0] + ring_allreduce_bytes(
                        4 * total, n)[0]
                    lat[design].append(dt)
                    nbytes[design].append(sent)
        results[str(d)] = {k: {"median_ms": median(v) * 1e3, "mean_ms": mean(v) * 1e3,
                               "bytes_sent": mean(nbytes[k])} for k, v in lat.items()}
    if rank == 0:
        out.write_text(json.dumps(results))
    hvd.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--backends", nargs="+", default=["gloo", "mpi"])
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.steps, args.worker)
        return
    table = {}
    for backend in args.backends:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "r.json"
            argv = [sys.executable, "-m", "bench.collective_shapes", "--steps", str(args.steps),
                    "--worker", str(out)]
            # Collective latency is what is measured: keep Open MPI's default busy polling.
            cmd = horovodrun_cmd(args.np, backend, argv, mpi_yield_when_idle=False)
            run_bounded(cmd, timeout=600,
                        env={"PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
            table[backend] = json.loads(out.read_text())
    print(f"# allgather(indices) + allreduce(values) per step, {args.np} ranks, "
          f"{args.steps} steps per design, rank 0, N = {N:,}\n")
    print("| backend | density | design | median ms | mean ms | bytes sent / rank |"
          " fixed/variable median | fixed/variable mean |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for backend, by_d in table.items():
        for d, res in by_d.items():
            v, f = res["variable"], res["fixed"]
            for name, r in (("variable (exact)", v), ("fixed (padded)", f)):
                ratio = (f"{f['median_ms'] / v['median_ms']:.2f} | "
                         f"{f['mean_ms'] / v['mean_ms']:.2f}") if r is f else " | "
                print(f"| {backend} | {d} | {name} | {r['median_ms']:.2f} | {r['mean_ms']:.2f}"
                      f" | {r['bytes_sent']:,.0f} | {ratio} |")
    if args.json:
        args.json.write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
