"""End-to-end iteration time on a rate-limited link: every method vs the compute-only bound.

What is measured: ResNet-18 for CIFAR
(11,173,962 parameters; on a CPU the *compute-bound* regime) or
``horovod_micro_train.models.wide_mlp``
(12,660,234 parameters at about 60 ms of compute: the *communication-bound* regime a GPU
cluster is in), synthetic data,
batch 32 per rank, SGD (Nesterov 0.9, weight decay 1e-4), 2 ranks over Gloo in a network
namespace whose loopback is limited by tc tbf (``bench/netns_run.sh``) to 100 Mbit/s,
1 Gbit/s, or unlimited. tbf's bucket is 1 MB unless ``--burst`` sets it: with 1 MB a
message under about 1 MB that follows a quiet moment passes without its wire time (most of
a sparse method's messages); ``--burst 64kb`` charges it. In ONE run per link, interleaved
round by round (so the noise of a shared 2-core machine falls on all of them alike):

* ``compute``: the same loop with the plain optimizer, no exchange (the lower bound);
* ``none`` / ``fp16``: Horovod's dense allreduce (overlapped with backward by hooks);
* ``micro`` and the sparse baselines that exist (``topk``, ``threshold``, ``cltk``,
  ``randomk``, ``gtopk``) at each density;
* ``powersgd:rank=1`` and ``powersgd:rank=4`` (no density: a low-rank exchange; any
  method may carry keyword arguments after a colon).

Per iteration, after an untimed tiny allreduce that lines the ranks up, each rank times
forward+backward and the optimizer step (``compute``) and ``synchronize()`` (the exchange
incl. the compressor's local work); the iteration time is the slower rank's total, and
``exchange = iteration - slower rank's compute`` (what the exchange adds). Bytes: the
optimizer's ring-model count (``last_stats.bytes_sent``) and, as a check, the bytes that
really crossed the namespace's loopback during the iteration (all ranks, TCP payload and
headers, Horovod's negotiation and the two line-up allreduces included). The hard
threshold starts from a calibrated lambda (the k-th largest |g| of a first gradient);
MiCRO's default controller needs no calibration (it corrects within the step). The actual
density is reported.

Results, and the machine they were measured on: BENCHMARKS.md, "Iteration time on
rate-limited links".

    .venv/bin/python -m bench.bandwidth [--quick] [--rates 100mbit 1gbit none]   (as root)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench.common import mean, median, parse_method, random_batches
from horovod_micro.compression import takes_density
from hvm_testbed.launch import horovodrun_cmd, run_bounded

REPO = Path(__file__).resolve().parent.parent
#: Without --methods: compute only, Horovod's dense exchanges, and every registered method
#: (each with its defaults; ``name:key=value`` sets an option).
BASELINES = ("compute", "none", "fp16")


# --------------------------------------------------------------------------------- ranks
def make_compressor(hvm, method: str, density: float | None, threshold: float | None):
    """``method`` (``name[:key=value,...]``) at ``density`` (None: a method that takes
    none, PowerSGD)."""
    name, kwargs = parse_method(method)
    factory = getattr(hvm.Compression, name)
    if density is not None:
        kwargs = {"density": density, **kwargs}
    # MiCRO's default controller scales its threshold with each step's gradient and
    # corrects within the step: it needs no calibrated start.
    if name == "threshold":  # a fixed lambda: the calibrated one, not 1/(2 sqrt(k))
        kwargs = {"value": threshold}
    return factory(**kwargs)


def worker(args) -> None:
    import horovod.torch as hvd
    import torch

    import horovod_micro as hvm
    from bench.common import resnet18

    torch.set_num_threads(1)
    hvd.init()
    rank = hvd.rank()
    torch.manual_seed(100 + rank)
    pool = random_batches(args.model, args.batch, 32)  # cycled, one per iteration
    x, y = pool[0]

    def calibration_threshold(model, density):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        g = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        k = max(1, int(density * g.numel()))
        t = torch.tensor([float(torch.topk(g.abs(), k, sorted=False).values.min())])
        model.zero_grad()
        return float(hvd.broadcast(t, root_rank=0, name=f"calib.{density}"))

    from horovod_micro.compressors.registry import names

    configs, skipped = [], []
    for method in args.methods:
        name = parse_method(method)[0]
        sparse = name in names()
        densities = (args.densities if sparse and takes_density(getattr(hvm.Compression, name))
                     else [None])
        if not sparse and method not in ("compute", "none", "fp16"):
            skipped.append(method)
            continue
        for d in densities:
            torch.manual_seed(0)
            if args.model == "wide_mlp":
                from horovod_micro_train.models import wide_mlp

                model = wide_mlp()
                source = "horovod_micro_train.models.wide_mlp (communication-bound)"
            else:
                model, source = resnet18()
            base = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True,
                                   weight_decay=1e-4, fused=True if args.fused_sgd else None)
            label = method if d is None else f"{method} d={d}"
            if method == "compute":
                opt = base
            else:
                compression = (getattr(hvm.Compression, method) if not sparse else
                               make_compressor(hvm, method, d,
                                               calibration_threshold(model, d)
                                               if name == "threshold" else None))
                opt = hvm.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                               compression=compression)
            configs.append({"label": label, "method": method, "density": d, "model": model,
                            "opt": opt, "iters": []})

    lo_tx = Path("/sys/class/net/lo/statistics/tx_bytes")

    def iteration(cfg):
        model, opt = cfg["model"], cfg["opt"]
        cfg.setdefault("t", 0)
        hvd.allreduce(torch.zeros(1), name="line-up")
        wire0 = int(lo_tx.read_text())
        t0 = time.perf_counter()
        opt.zero_grad()
        bx, by = pool[cfg["t"] % len(pool)]
        cfg["t"] = cfg.get("t", 0) + 1
        torch.nn.functional.cross_entropy(model(bx), by).backward()
        t1 = time.perf_counter()
        if cfg["method"] != "compute":
            opt.synchronize()
        t2 = time.perf_counter()
        if cfg["method"] != "compute":
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
        t3 = time.perf_counter()
        hvd.allreduce(torch.zeros(1), name="line-up-end")
        rec = {"compute": (t1 - t0) + (t3 - t2), "sync": t2 - t1, "total": t3 - t0,
               "wire": int(lo_tx.read_text()) - wire0}
        st = getattr(opt, "last_stats", None)
        if st is not None:
            rec.update(select=st.select_time, comm=st.comm_time, sent=st.bytes_sent,
                       received=st.bytes_received, density=st.density,
                       counts=sum(st.rank_counts), max_count=max(st.rank_counts))
        return rec

    for cfg in configs:  # warm-up: untimed; sparse methods longer, to let density settle
        cfg["warm_density"] = []
        for _ in range(args.sparse_warmup if cfg["density"] else args.warmup):
            rec = iteration(cfg)
            if cfg["density"]:
                cfg["warm_density"].append(rec["density"])
    for _ in range(args.rounds):
        for cfg in configs:
            for _ in range(args.per_round):
                cfg["iters"].append(iteration(cfg))

    per_rank = hvd.allgather_object({c["label"]: c["iters"] for c in configs})
    if rank == 0:
        out = {"source": source, "skipped": skipped, "size": hvd.size(),
               "sgd": "fused" if args.fused_sgd else "default", "configs": []}
        for c in configs:
            runs = [r[c["label"]] for r in per_rank]  # [rank][iter]
            its = list(zip(*runs))
            total = [max(r["total"] for r in it) for it in its]
            compute = [max(r["compute"] for r in it) for it in its]
            summary = {"label": c["label"], "method": c["method"], "density": c["density"],
                       "iters": len(its),
                       "total": median(total), "total_mean": mean(total),
                       "compute": median(compute),
                       "exchange": median([t - cp for t, cp in zip(total, compute)]),
                       "round_totals": [mean(total[i:i + args.per_round])
                                        for i in range(0, len(total), args.per_round)]}
            r0 = runs[0]
            for key in ("select", "comm", "sent", "received", "density", "wire", "counts",
                        "max_count"):
                if key in r0[0]:
                    summary[f"{key}_r0"] = median([r[key] for r in r0])
            if "density" in r0[0]:
                summary["density_mean"] = mean([r["density"] for r in r0])
                summary["density_trajectory"] = c["warm_density"] + [r["density"] for r in r0]
            out["configs"].append(summary)
        # Paired ratios: each round ran every method back to back, so a ratio within a
        # round cancels load that other processes put on the machine for that round.
        by = {c["label"]: c["round_totals"] for c in out["configs"]}
        for c in out["configs"]:
            own = c["round_totals"]
            c["paired_x_compute"] = median([a / b for a, b in zip(own, by["compute"])])
            if "none" in by:
                c["paired_dense_over"] = median([b / a for a, b in zip(own, by["none"])])
            micro = by.get(f"micro d={c['density']}")
            if micro is not None:  # the bar's "Top-k / MiCRO" at the same density
                c["paired_over_micro"] = median([a / b for a, b in zip(own, micro)])
        Path(args.worker).write_text(json.dumps(out, indent=1))
    hvd.shutdown()


# ---------------------------------------------------------------------------- launcher
def table(rate: str, res: dict) -> str:
    nan = float("nan")
    rows = {c["label"]: c for c in res["configs"]}
    comp = rows["compute"]["total"]
    dense = rows.get("none", {}).get("total")
    lines = [f"### link: {rate} ({res['configs'][0]['iters']} timed iterations per method, "
             f"medians, model: {res['source']}, SGD: {res.get('sgd', 'default')})", "",
             "| method | iteration s | compute s | sync wait s | over compute-only s "
             "| x compute-only | dense / this | x compute-only, paired | dense / this, paired "
             "| this / MiCRO, paired | 1 + sync wait / compute-only |"
             " select+local s | collectives s | MB sent/rank | MB on lo (all ranks) "
             "| actual density |",
             "|---|" + "---:|" * 15]
    for c in res["configs"]:
        def fmt(k, s="{:.3f}", c=c):
            return s.format(c[k]) if k in c else ""

        lines.append(
            f"| {c['label']} | {c['total']:.3f} | {c['compute']:.3f} | {c['exchange']:.3f} "
            f"| {c['total'] - comp:+.3f} "
            f"| {c['total'] / comp:.2f} | {dense / c['total'] if dense else float('nan'):.2f} "
            f"| {c.get('paired_x_compute', nan):.2f} | {c.get('paired_dense_over', nan):.2f} "
            f"| {c.get('paired_over_micro', nan):.2f} "
            f"| {1 + c['exchange'] / comp:.3f} "
            f"| {fmt('select_r0')} | {fmt('comm_r0')} "
            f"| {c['sent_r0'] / 1e6 if 'sent_r0' in c else float('nan'):.3f} "
            f"| {c['wire_r0'] / 1e6:.3f} "
            f"| {fmt('density_mean', '{:.5f}')} |")
    if res["skipped"]:
        lines.append(f"\nNot available when run: {', '.join(res['skipped'])}.")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", nargs="+", default=["100mbit", "1gbit", "none"])
    ap.add_argument("--methods", nargs="+", default=None,
                    help="name[:key=value,...] (default: compute, none, fp16 and every "
                         "registered method)")
    ap.add_argument("--densities", nargs="+", type=float, default=[0.01, 0.001])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--model", choices=("resnet18", "wide_mlp"), default="resnet18",
                    help="resnet18: the compute-bound regime on a CPU; wide_mlp "
                    "(12.7M parameters, ~60 ms of compute): the communication-bound one")
    ap.add_argument("--fused-sgd", action="store_true",
                    help="torch's fused SGD kernel (fused=True) for every method, compute-only "
                    "included: the same update in one pass")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--sparse-warmup", type=int, default=5,
                    help="untimed iterations of sparse methods (threshold settling)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--per-round", type=int, default=1)
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--quick", action="store_true",
                    help="1 round of 1 iteration, 2 sparse warm-ups, density 0.001 only, batch 8")
    ap.add_argument("--burst", default=None,
                    help="tbf burst of bench/netns_run.sh (default 1mb: a message under about "
                         "1 MB after a quiet moment costs no wire time; 64kb charges it)")
    ap.add_argument("--json", type=Path, default=None,
                    help="default: bench/results/bandwidth.json (resnet18), "
                    "bench/results/bandwidth-wide_mlp.json (wide_mlp); with --burst, "
                    "-burstB before .json")
    ap.add_argument("--table-only", action="store_true",
                    help="print the tables of an earlier run's --json file")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.methods is None:
        from horovod_micro.compressors import registry

        args.methods = [*BASELINES, *registry.names()]
    if args.quick:
        args.rounds, args.per_round, args.densities, args.batch = 1, 1, [0.001], 8
        args.sparse_warmup = 2
    if args.json is None:
        suffix = "" if args.model == "resnet18" else f"-{args.model}"
        suffix += f"-burst{args.burst}" if args.burst else ""
        args.json = REPO / f"bench/results/bandwidth{suffix}.json"
    if args.worker:
        worker(args)
        return
    if args.table_only:
        for rate, res in json.loads(args.json.read_text()).items():
            print(table(rate, res) + "\n")
        return
    results = {}
    for rate in args.rates:
        out = REPO / f"bench/results/bandwidth-{args.model}-{rate}.part.json"
        out.unlink(missing_ok=True)
        argv = [sys.executable, "-m", "bench.bandwidth", "--worker", str(out),
                "--methods", *args.methods, "--densities", *map(str, args.densities),
                "--batch", str(args.batch), "--model", args.model, "--warmup", str(args.warmup),
                "--sparse-warmup", str(args.sparse_warmup),
                "--rounds", str(args.rounds), "--per-round", str(args.per_round),
                *(["--fused-sgd"] if args.fused_sgd else [])]
        cmd = [str(REPO / "bench/netns_run.sh"), rate, "1500",
               *horovodrun_cmd(args.np, "gloo", argv)]
        started = time.time()
        env = {"PYTHONPATH": str(REPO)}
        if args.burst:
            env["HVM_TBF_BURST"] = args.burst
        log = run_bounded(cmd, timeout=1600, env=env).stdout
        (REPO / f"bench/results/bandwidth-{args.model}-{rate}.log").write_text(log)
        results[rate] = json.loads(out.read_text())
        if args.burst:
            results[rate]["burst"] = args.burst
        out.unlink()
        print(table(rate, results[rate]), f"\n\n(wall {time.time() - started:.0f} s)\n",
              flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
