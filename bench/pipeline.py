"""Where MiCRO's exchange time goes: the sparse pipeline's phases on real ranks.

``synchronize()`` of a sparse optimizer runs (``horovod_micro/reducer.py``)::

    flatten + add residual -> norm -> select -> exchange -> zero output, scatter,
    zero residual at the union -> write-back

This wraps (on the instance, for measurement only; the package is not changed) the
reducer's ``_accumulate`` and ``_write_back`` and the compressor's ``select`` and
``exchange`` with timers; the rest of ``reduce()`` is the norm plus the post-exchange
scatter/zeroing. ResNet-18 for CIFAR, batch 32, 2 Gloo ranks, rank 0 reported, medians;
the threshold starts calibrated on a first gradient (the global count is printed).

Results, and the machine they were measured on: BENCHMARKS.md, section 4.

    .venv/bin/python -m bench.pipeline [--iters 8] [--np 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from bench.common import median
from bench.launch import horovodrun_cmd, run_bounded

PHASES = ("accumulate", "select", "exchange", "write_back")


def worker(iters: int, out: Path) -> None:
    import horovod.torch as hvd
    import torch

    import horovod_micro as hvm
    from bench.common import resnet18

    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(hvd.rank())
    x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
    result = {}
    for d in (0.01, 0.001):
        torch.manual_seed(0)
        model, _ = resnet18()
        # Start at the threshold that keeps k = d N of a first gradient (as bandwidth.py),
        # so the few iterations measured run near the target density.
        torch.nn.functional.cross_entropy(model(x), y).backward()
        g = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        t0 = torch.topk(g.abs(), int(d * g.numel()), sorted=False).values.min().reshape(1)
        t0 = float(hvd.broadcast(t0, root_rank=0, name=f"calib.{d}"))
        model.zero_grad()
        opt = hvm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                       named_parameters=model.named_parameters(),
                                       compression=hvm.Compression.micro(
                                           density=d, initial_threshold=t0))
        reducer, comp = opt._reducer, opt.compression
        spent = {p: 0.0 for p in PHASES}

        def wrap(obj, attr, phase, spent=spent):
            fn = getattr(obj, attr)

            def timed(*a, **kw):
                t = time.perf_counter()
                try:
                    return fn(*a, **kw)
                finally:
                    spent[phase] += time.perf_counter() - t
            setattr(obj, attr, timed)

        wrap(reducer, "_accumulate", "accumulate")
        wrap(reducer, "_write_back", "write_back")
        wrap(comp, "select", "select")
        wrap(comp, "exchange", "exchange")
        rows = []
        for it in range(iters + 2):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            hvd.allreduce(torch.zeros(1), name="line-up")
            for p in PHASES:
                spent[p] = 0.0
            t = time.perf_counter()
            opt.synchronize()
            total = time.perf_counter() - t
            with opt.skip_synchronize():
                opt.step()
            st = opt.last_stats
            if it >= 2:
                rows.append({**spent, "total": total, "comm": st.comm_time,
                             "rest": total - sum(spent.values()), "count": st.global_count})
        result[str(d)] = {k: median([r[k] for r in rows]) for k in rows[0]}
    if hvd.rank() == 0:
        out.write_text(json.dumps(result))
    hvd.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.iters, args.worker)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        argv = [sys.executable, "-m", "bench.pipeline", "--iters", str(args.iters),
                "--worker", str(out)]
        run_bounded(horovodrun_cmd(args.np, "gloo", argv), timeout=900,
                    env={"PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
        res = json.loads(out.read_text())
    print(f"# MiCRO synchronize() phases, ResNet-18 (N = 11,173,962), {args.np} Gloo ranks, "
          f"rank 0, medians of {args.iters} iterations, ms\n")
    cols = ("accumulate", "rest", "select", "exchange", "comm", "write_back", "total")
    print("| density | flatten + add residual | norm + scatter/zero (rest) | select "
          "(+ slope probe) | exchange | of which collectives | write-back | total "
          "| global count |")
    print("|---:|" + "---:|" * 8)
    for d, r in res.items():
        print(f"| {d} | " + " | ".join(f"{r[c] * 1e3:.2f}" for c in cols)
              + f" | {r['count']:.0f} |")


if __name__ == "__main__":
    main()
