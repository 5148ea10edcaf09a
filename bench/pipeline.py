"""Where a MiCRO step's time goes: the per-phase breakdown, on real ranks.

One iteration of a sparse run is::

    forward + backward -> synchronize() -> optimizer step

and ``synchronize()`` runs the reducer's phases (``horovod_micro/reducer.py``), which
the reducer itself times on every step (``StepStats.phases``):

    accumulate (a_t = e_t + g_t) -> status (norm, NaN/Inf) -> select (+ slope probe)
    -> indices (index allgather) -> values (value allreduce) -> exchange_local
    -> update (residual and output buffer) -> write_back

The collectives' phases include waiting for the other rank and Horovod's negotiation;
``--timeline`` also runs the steps under ``HOROVOD_TIMELINE`` and splits the
collectives' time into Horovod's own activities (negotiation, queue, the Gloo operation).

Models: ``wide_mlp`` (12.7M parameters, about 60 ms of compute per iteration on one
thread: the communication-bound regime), ``resnet18`` (11.2M, about 1.6 s: the
compute-bound regime) or ``fmnist_mlp`` (the main job's 0.2M: round trips only).
Variants of the optimizer run interleaved in one run (each round runs every variant
once), so their medians and paired ratios compare like with like:

* ``compute``: no exchange, the lower bound the other variants are compared with;
* ``barrier``: compute plus a one-element allreduce where ``synchronize()`` would be: what
  any synchronous data-parallel step pays on this machine with no bytes to move (the
  ranks' compute differs from step to step, and the faster one waits);
* ``ef-floor``: ``barrier`` plus the one pass that error feedback cannot avoid: backward
  adds ``g_t`` into ``.grad`` views of a persistent N-element buffer (the residual), as
  MiCRO's zero-copy path does, instead of handing over a fresh gradient tensor; the step
  then reads another, all-zero buffer (MiCRO's output is all but k zeros). No norm, no
  selection, no bytes: what any error-feedback compressor with a free selection and a free
  exchange would still pay here;
* ``micro``: the defaults;
* ``micro-exact``: the defaults with ``capacity="exact"``: variable-size blocks, which
  Horovod negotiates every step, against ``micro``'s fixed-shape slots;
* ``micro-copy``: ``zero_copy=False``, the out-of-place ``a_t`` (on float32 CPU tensors
  added and squared in one native pass, :mod:`horovod_micro.accumulate`);
* ``micro-phases``: the defaults with the device synchronised at every phase boundary
  (``HOROVOD_MICRO_SYNC_PHASES=1``), so that on a GPU each phase is charged its own kernels;
  that adds host syncs, so its total is not the step's cost (``micro``'s is).

``--device cuda`` runs the model, the batches and so the reducer on the rank's GPU
(Horovod's collectives then run on NCCL where Horovod was built with it); every iteration
synchronises the device after backward and after the step, so the columns are the
kernels' time, not their launch.

``--rate`` runs the ranks inside ``bench/netns_run.sh`` (tbf-limited loopback, as root).

Results, and the machine they were measured on: BENCHMARKS.md, "Iteration time on
rate-limited links" (where the communication-bound step goes) and "The GPU path".

    .venv/bin/python -m bench.pipeline --model wide_mlp --rate 1gbit --iters 20
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from bench.common import median, random_batches
from hvm_testbed.launch import horovodrun_cmd, run_bounded

REPO = Path(__file__).resolve().parent.parent
#: label -> None (no exchange) or (DistributedOptimizer kwargs, environment[,
#: Compression.micro kwargs])
VARIANTS = {
    "compute": None,
    "barrier": None,
    "ef-floor": None,
    "micro": ({}, {}),
    "micro-exact": ({}, {}, {"capacity": "exact"}),
    "micro-copy": ({"zero_copy": False}, {}),
    "micro-phases": ({}, {"HOROVOD_MICRO_SYNC_PHASES": "1"}),
}
SPARSE = [label for label, spec in VARIANTS.items() if spec is not None]
POOL = 64  # random batches cycled per iteration (bench.common.random_batches)
PHASES = ("accumulate", "status", "select", "indices", "values", "exchange_local", "update",
          "write_back")


def build_model(name: str):
    from horovod_micro_train.models import build_model as build

    return build(name, num_classes=10)


def worker(args) -> None:
    import horovod.torch as hvd
    import torch

    import horovod_micro as hvm
    from horovod_micro.compressors import config_of
    from horovod_micro.layout import FlatLayout

    torch.set_num_threads(1)
    hvd.init()
    device = torch.device("cpu")
    sync = None
    if args.device == "cuda":
        device = torch.device("cuda", hvd.local_rank())
        torch.cuda.set_device(device)
        sync = torch.cuda.synchronize
    torch.manual_seed(100 + hvd.rank())
    batches = [(x.to(device), y.to(device))
               for x, y in random_batches(args.model, args.batch, POOL)]
    runs = {}
    for label in args.variants:
        torch.manual_seed(0)
        model = build_model(args.model).to(device)
        base = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        opt = base
        if VARIANTS[label] is not None:
            kwargs, environment, *options = VARIANTS[label]
            saved = {name: os.environ.get(name) for name in environment}
            os.environ.update(environment)  # read when the optimizer is built
            opt = hvm.DistributedOptimizer(
                base, named_parameters=model.named_parameters(),
                compression=hvm.Compression.micro(density=args.density,
                                                  **(options[0] if options else {})),
                **kwargs)
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name)
                else:
                    os.environ[name] = value
        runs[label] = {"model": model, "opt": opt, "batches": batches, "rows": [], "t": 0}
        if label == "ef-floor":  # two flat buffers cut as the reducer cuts its own
            layout = FlatLayout(list(model.named_parameters()))
            runs[label]["grads"] = [layout.views(torch.zeros(layout.numel, device=device))
                                    for _ in range(2)]

    def iteration(run, label, keep):
        model, opt = run["model"], run["opt"]
        hvd.allreduce(torch.zeros(1), name="line-up")
        t0 = time.perf_counter()
        if "grads" in run:  # backward adds into the residual's views
            for p, g in zip(model.parameters(), run["grads"][0]):
                p.grad = g
        else:
            opt.zero_grad()
        x, y = run["batches"][run["t"] % POOL]
        run["t"] += 1
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if sync:
            sync()
        t1 = time.perf_counter()
        sparse = label in SPARSE
        if sparse:
            opt.synchronize()
        elif label in ("barrier", "ef-floor"):  # what any synchronous step pays, bytes aside
            hvd.allreduce(torch.zeros(1), name="barrier")
        if "grads" in run:  # the step reads the (all-zero) output buffer
            for p, g in zip(model.parameters(), run["grads"][1]):
                p.grad = g
        t2 = time.perf_counter()
        if sparse:
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
        if sync:
            sync()
        t3 = time.perf_counter()
        if keep:
            row = {"backward": t1 - t0, "sync": t2 - t1, "step": t3 - t2, "total": t3 - t0}
            if sparse:
                st = opt.last_stats
                row.update(st.phases, count=st.global_count, max_rank=max(st.rank_counts))
            run["rows"].append(row)

    for _ in range(args.warmup):
        for label, run in runs.items():
            iteration(run, label, keep=False)
    for _ in range(args.iters):
        for label, run in runs.items():
            iteration(run, label, keep=True)

    gathered = hvd.allgather_object({k: r["rows"] for k, r in runs.items()})
    if hvd.rank() == 0:
        # The compressor's whole configuration, defaults included (None: no exchange).
        configs = {label: config_of(getattr(run["opt"], "compression", None))
                   for label, run in runs.items()}
        Path(args.worker).write_text(json.dumps({"rows": gathered, "configs": configs}))
    hvd.shutdown()


# ---------------------------------------------------------------------------- timeline
def timeline_activities(path: Path) -> dict[str, float]:
    """Seconds per Horovod activity (summed over the run) for the optimizer's tensors
    (names starting ``hvm.``), from a ``HOROVOD_TIMELINE`` file."""
    text = path.read_text().strip().rstrip(",")
    if not text.endswith("]"):
        text += "]"
    events = json.loads(text)
    names, stacks, spent = {}, defaultdict(list), defaultdict(float)
    for ev in events:
        if ev.get("ph") == "M" and ev.get("name") == "process_name":
            names[ev["pid"]] = ev.get("args", {}).get("name", "")
    for ev in events:
        pid = ev.get("pid")
        if ".hvm." not in "." + str(names.get(pid, "")) or ".check." in names[pid]:
            continue
        if ev.get("ph") == "B":
            stacks[pid].append((ev["name"], ev["ts"]))
        elif ev.get("ph") == "E" and stacks[pid]:
            name, ts = stacks[pid].pop()
            spent[name] += (ev["ts"] - ts) * 1e-6
        elif ev.get("ph") == "X":
            spent[ev["name"]] += ev.get("dur", 0) * 1e-6
    return dict(spent)


# ---------------------------------------------------------------------------- launcher
def summarise(per_rank: list[dict], variants: list[str]) -> dict:
    """Per variant: medians over iterations of the slower rank's total and compute, and of
    rank 0's phases; paired ratios against ``compute`` (within an iteration)."""
    out = {}
    n_iter = len(per_rank[0][variants[0]])
    totals = {v: [max(r[v][i]["total"] for r in per_rank) for i in range(n_iter)]
              for v in variants}
    for v in variants:
        rows = per_rank[0][v]
        summary = {"total": median(totals[v]),
                   "compute": median([max(r[v][i]["backward"] + r[v][i]["step"]
                                          for r in per_rank) for i in range(n_iter)])}
        for key in ("backward", "sync", "step", *PHASES, "count", "max_rank"):
            if key in rows[0]:
                summary[key] = median([row.get(key, 0.0) for row in rows])
        for base in ("compute", "barrier"):
            if base in totals:
                summary[f"paired_x_{base}"] = median(
                    [a / b for a, b in zip(totals[v], totals[base])])
        out[v] = summary
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("wide_mlp", "fmnist_mlp", "resnet18"), default="wide_mlp")
    ap.add_argument("--density", type=float, default=0.001)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: the model and the reducer on each rank's GPU")
    ap.add_argument("--rate", default=None, help="tbf rate of bench/netns_run.sh (as root)")
    ap.add_argument("--cycle-time-ms", type=float, default=None,
                    help="HOROVOD_CYCLE_TIME for the ranks (Horovod 0.28.1 default: 1 ms)")
    ap.add_argument("--timeline", action="store_true",
                    help="also record HOROVOD_TIMELINE and split the collectives' time")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        argv = [sys.executable, "-m", "bench.pipeline", "--worker", str(out),
                "--model", args.model, "--density", str(args.density),
                "--iters", str(args.iters), "--warmup", str(args.warmup),
                "--batch", str(args.batch), "--device", args.device,
                "--variants", *args.variants]
        env = {"PYTHONPATH": str(REPO)}
        if args.cycle_time_ms is not None:
            env["HOROVOD_CYCLE_TIME"] = f"{args.cycle_time_ms:g}"
        timeline = Path(tmp) / "timeline.json"
        if args.timeline:
            env["HOROVOD_TIMELINE"] = str(timeline)
        cmd = horovodrun_cmd(args.np, "gloo", argv)
        if args.rate:
            cmd = [str(REPO / "bench/netns_run.sh"), args.rate, "1500", *cmd]
        run_bounded(cmd, timeout=1600, env=env)
        if args.timeline:
            (REPO / "bench/results").mkdir(exist_ok=True)
            (REPO / "bench/results/pipeline-timeline.json").write_text(timeline.read_text())
        recorded = json.loads(out.read_text())
        per_rank = recorded["rows"]
        activities = timeline_activities(timeline) if args.timeline else {}
    res = summarise(per_rank, args.variants)
    for v in res:
        res[v]["compression_config"] = recorded["configs"].get(v)
    iters = args.iters
    cycle = "1 (default)" if args.cycle_time_ms is None else f"{args.cycle_time_ms:g}"
    where = "GPU (NCCL collectives)" if args.device == "cuda" else "Gloo"
    print(f"# {args.model}, batch {args.batch}, d = {args.density}, {args.np} {where} ranks, link "
          f"{args.rate or 'unlimited'}, Horovod cycle time {cycle} ms; medians of {iters} "
          "interleaved iterations, ms (total: slower rank; phases: rank 0)\n")
    cols = ("total", "compute", "backward", "sync", "step", *PHASES)
    print("| variant | " + " | ".join(cols) + " | x compute-only, paired "
          "| x barrier, paired | global count | max rank count |")
    print("|---|" + "---:|" * (len(cols) + 4))
    for v, r in res.items():
        cells = [f"{r[c] * 1e3:.2f}" if c in r else "" for c in cols]
        print(f"| {v} | " + " | ".join(cells)
              + f" | {r.get('paired_x_compute', float('nan')):.3f} "
              f"| {r.get('paired_x_barrier', float('nan')):.3f} "
              f"| {r.get('count', float('nan')):.0f} | {r.get('max_rank', float('nan')):.0f} |")
    if activities:
        steps = (iters + args.warmup) * sum(1 for v in args.variants if v in SPARSE)
        print("\nHorovod timeline, the optimizer's collectives, all ranks' process, ms per "
              "step (mean over every step of every sparse variant):\n")
        for name, sec in sorted(activities.items(), key=lambda kv: -kv[1]):
            print(f"- {name}: {sec * 1e3 / steps:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         "summary": res, "timeline": activities}, indent=1))


if __name__ == "__main__":
    main()
