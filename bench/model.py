"""Scaling model: per-iteration time and bytes per rank for n = 2 ... 256 ranks.

Inputs are measured (``bench/selection_cost.py`` -> selection cost, ``bench/bandwidth.py``
-> compute time, local sparse-pipeline cost, fixed per-exchange latency, bytes per rank);
only the link bandwidth ``B`` and, for the cluster projection, the per-step latency are
assumed.

Bytes the busiest rank sends per iteration: the dense ring allreduce for ``none`` and
``fp16`` (``2 (n-1)/n * b N``), and each sparse method's own byte model,
``Compressor.modeled_bytes`` (its docstring gives the formula; the tests hold it against
real ranks). MiCRO's, with its fixed slots of ``C = ceil(1.2 k / n)`` per rank, is about
``4 (n-1) (C + 4) + 8 (n-1) C``: independent of n (the ideal: ``12k (n-1)/n``).

Iteration time, no overlap of computation and communication:

    T(n) = T_compute + T_select(n) + T_local + S(n) * f / B + T_lat(n)

* ``T_select``: micro: the native threshold pass over N/n (measured at n = 2, 4, 8, 16,
  ~ 1/n beyond); topk and cltk: ``torch.topk`` over N; threshold: the native pass over N;
  dense: 0.
* ``T_local``: the sparse pipeline's O(N) work besides selection (flatten + residual,
  norm, zero/scatter the output, write-back), measured in ``bandwidth.py`` as micro's
  ``select_time`` minus its selection; independent of n.
* ``f``: on this machine's emulation every rank's traffic goes through ONE tbf queue on
  the namespace's loopback, so a ring step moves n * S bytes through the bottleneck
  (f = n); on a cluster with one full-duplex link per node, f = 1.
* ``T_lat``: per exchange on this machine, the measured collective time on the unlimited
  link (Horovod negotiation + Gloo); on a cluster, alpha * (ring steps), with alpha
  assumed (default 50 us): allreduce 2(n-1) steps, allgather (n-1), broadcast n-1.
* dense: Horovod overlaps its allreduce with backward, so the real time lies between
  ``max(T_compute, wire)`` and the no-overlap sum; the table shows the no-overlap sum.

First the model is checked against every measured configuration (n = 2, and n = 3, 4
when ``--check`` files are given); then it projects n = 2 ... 256.

Results, and the machine they were measured on: BENCHMARKS.md, "Bytes model".

    .venv/bin/python -m bench.model [--bandwidth bench/results/bandwidth.json]
        [--check bench/results/bandwidth-n3.json bench/results/bandwidth-n4.json]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import horovod_micro as hvm
from horovod_micro.compression import takes_density
from horovod_micro.compressors import registry

REPO = Path(__file__).resolve().parent.parent
N = 11_173_962
H = 3
RATES = {"100mbit": 100e6 / 8, "1gbit": 1e9 / 8, "10gbit": 10e9 / 8, "none": math.inf}
#: Bytes per element of the dense exchanges.
DENSE = {"none": 4, "fp16": 2}


def sent_bytes(method: str, n: int, k: float) -> float:
    """Bytes the busiest rank sends per iteration: the dense ring allreduce for ``none``
    and ``fp16``, else the method's own byte model (``Compressor.modeled_bytes``) at
    density ``k / N``."""
    if n < 2:
        return 0.0
    if method in DENSE:
        return 2 * (n - 1) / n * DENSE[method] * N
    return getattr(hvm.Compression, method)(density=k / N).modeled_bytes(n, N)


def ideal_bytes(n: int, k: float) -> float:
    """Gather k int32 indices and allreduce k float32 values, ring: 12k (n-1)/n."""
    return 12 * k * (n - 1) / n


def ring_steps(method: str, n: int) -> int:
    # micro_ahead: one allreduce (values and next positions), no gather.
    return {"none": 2 * (n - 1), "fp16": 2 * (n - 1), "micro": 3 * (n - 1),
            "micro_ahead": 2 * (n - 1),
            "topk": 2 * (n - 1), "threshold": 2 * (n - 1), "cltk": 3 * (n - 1),
            "randomk": 2 * (n - 1), "gtopk": 2 * math.ceil(math.log2(n)) + n - 1}[method]


class Inputs:
    """Measured inputs: selection costs, local pipeline cost, fixed exchange latency."""

    def __init__(self, select: dict, bandwidth: dict, shapes: dict[str, dict]):
        med = select["median_ms"]
        self.sel = {}
        for d in (0.01, 0.001):
            for label, method in (("topk (full N)", "topk"), ("topk (full N)", "cltk"),
                                  ("threshold native (full N)", "threshold")):
                self.sel[(method, d)] = med[f"{d}|{label}"] / 1e3
            self.sel[("micro", d)] = {n: med[f"{d}|micro n={n}"] / 1e3 for n in (2, 4, 8, 16)}
        base = bandwidth.get("none") or next(iter(bandwidth.values()))
        rows = {c["label"]: c for c in base["configs"]}
        self.compute = rows["compute"]["total"]
        # The sparse pipeline's O(N) local work besides selection, from micro's select_time.
        self.local = {}
        for d in (0.01, 0.001):
            c = rows.get(f"micro d={d}")
            if c is not None:
                self.local[d] = max(c["select_r0"] - self.select("micro", 2, d), 0.0)
        # Fixed cost of one sparse exchange (gather + allreduce, negotiation included) per
        # link, measured on 2 Gloo ranks with exact sizes (bench/results/collective_shapes*.json)
        # minus its wire time.
        self.lat = {}
        for rate, res in shapes.items():
            for d, r in res["gloo"].items():
                v = r["variable"]
                wire = 2 * v["bytes_sent"] / RATES[rate]
                self.lat[(rate, float(d))] = max(v["mean_ms"] / 1e3 - wire, 0.0)

    def select(self, method: str, n: int, d: float) -> float:
        if method in ("micro", "micro_ahead"):  # the same threshold pass over N / n
            table = self.sel[("micro", d)]
            if n in table:
                return table[n]
            return table[16] * 16 / n if n > 16 else table[2] * 2 / n
        if method == "gtopk":
            return self.sel[("topk", d)]
        if method in ("none", "fp16", "randomk"):
            return 0.0
        return self.sel[(method, d)]

    def local_cost(self, method: str, d: float) -> float:
        return 0.0 if method in ("none", "fp16") else self.local.get(d, 0.0)

    def latency(self, method: str, rate: str, d: float) -> float:
        if method in ("none", "fp16"):
            return 0.0
        return self.lat.get((rate, d), self.lat.get(("none", d), 0.0))


def exchange_time(inp: Inputs, method: str, n: int, d: float | None, rate: str,
                  bandwidth: float, shared_link: bool, alpha: float | None,
                  k: float | None = None) -> float:
    """Predicted time the exchange adds to an iteration (s), no overlap.

    ``alpha=None``: this machine's measured fixed cost per exchange for ``rate``; else
    the cluster form ``c0 + alpha * ring steps`` with c0 the unlimited-link fixed cost.
    """
    d = d or 0.001
    k = d * N if k is None else k
    wire = sent_bytes(method, n, k) * (n if shared_link else 1) / bandwidth
    if alpha is None:
        lat = inp.latency(method, rate, d)
    else:
        lat = inp.latency(method, "none", d) + alpha * ring_steps(method, n)
    return inp.select(method, n, d) + inp.local_cost(method, d) + wire + lat


def label_parts(label: str) -> tuple[str, float | None]:
    if " d=" in label:
        m, d = label.split(" d=")
        return m, float(d)
    return label, None


def check(inp: Inputs, runs: dict[int, dict]) -> list[str]:
    """Model vs measurement for every measured configuration (emulated shared link).

    Time: the model's exchange time vs what the exchange measurably adds, i.e. for sparse
    methods the within-iteration ``iteration - compute`` (robust to load between
    iterations) and for dense methods ``(paired x compute-only - 1) * compute-only``
    (their allreduce overlaps backward, so it shows up as slower compute).
    Bytes: the model's bytes at the measured counts vs the optimizer's count, and
    n * bytes + idle traffic vs the bytes that crossed the loopback.
    """
    out = ["| n | link | method | exchange adds, measured s | model s | model / measured "
           "| bytes/rank (stats) | model at measured count | on lo (all ranks) "
           "| model n*bytes + idle | lo / model |",
           "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n, res in sorted(runs.items()):
        for rate, r in res.items():
            rows = {c["label"]: c for c in r["configs"]}
            comp = rows["compute"]
            idle_rate = comp["wire_r0"] / comp["total"]
            for c in r["configs"]:
                m, d = label_parts(c["label"])
                if m == "compute":
                    continue
                if m in ("none", "fp16"):
                    measured = (c.get("paired_x_compute", c["total"] / comp["total"]) - 1) * (
                        comp["total"])
                    k = None
                else:
                    measured = c["exchange"]
                    k = c.get("counts_r0", c.get("density_r0", d) * N)
                model = exchange_time(inp, m, n, d, rate, RATES[rate], True, None, k)
                b_mod = sent_bytes(m, n, k if k is not None else N)
                lo_mod = n * b_mod + idle_rate * c["total"]
                out.append(
                    f"| {n} | {rate} | {c['label']} | {measured:.3f} | {model:.3f} | "
                    f"{model / measured if measured > 0.005 else float('nan'):.2f} | "
                    f"{c['sent_r0']:,.0f} | {b_mod:,.0f} | {c['wire_r0']:,.0f} | "
                    f"{lo_mod:,.0f} | {c['wire_r0'] / lo_mod:.2f} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--select", type=Path, default=REPO / "bench/results/selection_cost.json",
                    help="selection_cost.py --json output")
    ap.add_argument("--bandwidth", type=Path, default=REPO / "bench/results/bandwidth.json")
    ap.add_argument("--check", type=Path, nargs="*", default=[],
                    help="bandwidth.py results with --np 3/4 (file name ...-n3/-n4.json)")
    ap.add_argument("--alpha", type=float, default=50e-6, help="cluster latency per ring step")
    ap.add_argument("--gpu-compute", type=float, default=0.030,
                    help="assumed per-iteration compute of a GPU-class rank (s)")
    ap.add_argument("--figure", type=Path, default=REPO / "bench/figures/scaling.png")
    ap.add_argument("--json", type=Path, default=REPO / "runs/model.json")
    args = ap.parse_args()
    shapes = {"none": REPO / "bench/results/collective_shapes.json",
              "1gbit": REPO / "bench/results/collective_shapes-1gbit.json",
              "100mbit": REPO / "bench/results/collective_shapes-100mbit.json"}
    inp = Inputs(json.loads(args.select.read_text()), json.loads(args.bandwidth.read_text()),
                 {r: json.loads(p.read_text()) for r, p in shapes.items() if p.exists()})
    runs = {2: json.loads(args.bandwidth.read_text())}
    for path in args.check:
        runs[int(path.stem.rsplit("-n", 1)[1])] = json.loads(path.read_text())

    print("## Model check against measurements (shared-queue loopback emulation)\n")
    print("\n".join(check(inp, runs)))

    # Every registered method that takes a density (PowerSGD's bytes depend on the
    # model's shapes, not on k: bench.bandwidth measures it).
    methods = [*DENSE, *(m for m in registry.names()
                         if takes_density(getattr(hvm.Compression, m)))]
    ns = [2, 4, 8, 16, 32, 64, 128, 256]
    print("\n## Bytes sent per rank per iteration (model), d = 0.001 and 0.01, N = "
          f"{N:,}\n")
    for d in (0.001, 0.01):
        k = d * N
        print(f"| method (d={d}) | " + " | ".join(f"n={n}" for n in ns) + " |")
        print("|---|" + "---:|" * len(ns))
        for m in methods:
            print(f"| {m} | " + " | ".join(f"{sent_bytes(m, n, k) / 1e6:.3f} MB" for n in ns)
                  + " |")
        print("| ideal 12k(n-1)/n | " + " | ".join(f"{ideal_bytes(n, k) / 1e6:.3f} MB"
                                                   for n in ns) + " |")
        print("| micro / ideal | " + " | ".join(
            f"{sent_bytes('micro', n, k) / ideal_bytes(n, k):.3f}" for n in ns) + " |\n")

    projection = {}
    print("## Projected iteration time, cluster links (one full-duplex link per node), "
          f"alpha = {args.alpha * 1e6:.0f} us per ring step, d = 0.001\n")
    for scen, comp in (("this CPU's compute", inp.compute),
                       (f"GPU-class compute {args.gpu_compute * 1e3:.0f} ms", args.gpu_compute)):
        for rate in ("1gbit", "10gbit"):
            print(f"### {scen} ({comp:.3f} s), {rate}: seconds (x compute-only, dense / this)\n")
            print("| method | " + " | ".join(f"n={n}" for n in ns) + " |")
            print("|---|" + "---:|" * len(ns))
            times = {m: [comp + exchange_time(inp, m, n, 0.001, rate, RATES[rate], False,
                                              args.alpha) for n in ns] for m in methods}
            for m in methods:
                print(f"| {m} | " + " | ".join(
                    f"{t:.3f} ({t / comp:.2f}, {times['none'][i] / t:.1f})"
                    for i, t in enumerate(times[m])) + " |")
            print()
            projection[f"{scen}|{rate}"] = times
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"ns": ns, "projection": projection,
                                     "compute": inp.compute, "local": inp.local,
                                     "latency": {f"{rate}|{d}": v for (rate, d), v
                                                 in inp.lat.items()}}, indent=1))
    try:
        plot(projection, ns, args.figure)
        print(f"figure: {args.figure}")
    except ImportError:
        pass


def plot(projection: dict, ns: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(projection), figsize=(4.2 * len(projection), 3.6),
                             sharey=False)
    for ax, (title, times) in zip(axes, projection.items()):
        for m, ts in times.items():
            ax.plot(ns, ts, marker="o", ms=3, label=m)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks n")
        ax.set_title(title.replace("|", "\n"), fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("iteration time (s), model")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
