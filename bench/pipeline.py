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
* ``dense``: Horovod's own ``DistributedOptimizer``, its allreduces started by backward's
  hooks as each gradient is ready (overlapped with the rest of backward);
* ``ahead-floor``: what an exchange whose index set was agreed a step ahead would pay
  at least, bytes for bytes MiCRO's (no MiCRO in it): ``ef-floor``'s writes, the norm pass
  over N, a threshold pass over the next step's part (N / n), and MiCRO's two collectives
  with their fixed shapes: the values over every rank's slots start after backward, the
  int32 block of the next step's indices as soon as that part is chosen; neither waits for
  the other's result. The values are taken at a union fixed in advance. Against ``micro``
  it shows what one dependent round trip costs; against ``dense`` whether the design could
  match dense;
* ``ahead-one``: ``ahead-floor`` with one collective: the next step's indices travel in
  the value allreduce, each rank's in its own slots (zeros elsewhere, so the sum is the
  gather; part-relative indices as float32 are exact in parts below 2**24 coordinates), at
  twice the index bytes of a gather;
* ``ahead-overlap``: ``ahead-one`` cut per parameter and started from backward's
  post-accumulate hooks as each gradient is complete, each piece with its own
  sum-of-squares word; the last also chooses the next part and carries its indices. What
  remains after backward is the wait and the writes;
* ``buckets-B`` (``buckets-1``, ``buckets-2``, ``buckets-4``, ``buckets-8``): the
  exchange cut per bucket and started by backward, with the choice fresh: the flat vector
  in ``B`` contiguous buckets, each cut into ``n`` slices that rotate among the ranks
  (every rank owns one slice of every bucket). As backward completes a bucket, each rank
  squares it (the status word's pass, piece by piece), chooses in its own slice
  (MiCRO's native threshold pass, steered towards fixed slots of ``1.2 k_b / n``) and
  starts the bucket's index gather; the bucket's value allreduce, at the gathered
  coordinates, starts once that gather is back, at the next bucket's completion or
  after backward. ``buckets-1`` is MiCRO's own exchange with no overlap; more buckets
  leave less after backward: the last bucket's gather and values, in a smaller piece.
  It waits for its collectives as MiCRO does (:mod:`horovod_micro.waiting`). No MiCRO
  controller, judge or header in it: a floor of the per-bucket design;
* ``parts``: the same cut at MiCRO's own parts (``n`` buckets), each chosen whole by the
  rank that owns it this step (MiCRO's rotation) and its indices broadcast from that rank;
* ``micro``: the defaults;
* ``micro-exact``: the defaults with ``capacity="exact"``: variable-size blocks, which
  Horovod negotiates every step, against ``micro``'s fixed-shape slots;
* ``micro-copy``: ``zero_copy=False``, the out-of-place ``a_t`` (on float32 CPU tensors
  added and squared in one native pass, :mod:`horovod_micro.accumulate`);
* ``micro-phases``: the defaults with the device synchronised at every phase boundary
  (``HOROVOD_MICRO_SYNC_PHASES=1``), so that on a GPU each phase is charged its own kernels;
  that adds host syncs, so its total is not the step's cost (``micro``'s is);
* ``micro-ahead``: ``micro_ahead``, the shipped step-ahead exchange (one allreduce), whose
  floor ``ahead-one`` measures.

``--device cuda`` runs the model, the batches and so the reducer on the rank's GPU
(Horovod's collectives then run on NCCL where Horovod was built with it); every iteration
synchronises the device after backward and after the step, so the columns are the
kernels' time, not their launch.

``--rate`` runs the ranks inside ``bench/netns_run.sh`` (tbf-limited loopback, as root);
``--backend mpi`` runs them on Open MPI instead of Gloo.

Results, and the machine they were measured on: BENCHMARKS.md, "Iteration time on
rate-limited links" (where the communication-bound step goes) and "The GPU path".

    .venv/bin/python -m bench.pipeline --model wide_mlp --rate 1gbit --iters 20
"""

from __future__ import annotations

import argparse
import json
import math
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
#: Compression kwargs, "method" naming another method than micro])
VARIANTS = {
    "compute": None,
    "barrier": None,
    "ef-floor": None,
    "dense": None,
    "ahead-floor": None,
    "ahead-one": None,
    "ahead-overlap": None,
    "buckets-1": None,
    "buckets-2": None,
    "buckets-4": None,
    "buckets-8": None,
    "parts": None,
    "micro": ({}, {}),
    "micro-exact": ({}, {}, {"capacity": "exact"}),
    "micro-copy": ({"zero_copy": False}, {}),
    "micro-phases": ({}, {"HOROVOD_MICRO_SYNC_PHASES": "1"}),
    "micro-ahead": ({}, {}, {"method": "micro_ahead"}),
}
AHEAD = {"ahead-floor": "two", "ahead-one": "one", "ahead-overlap": "overlap"}
BUCKETS = {f"buckets-{b}": b for b in (1, 2, 4, 8)} | {"parts": None}  # None: MiCRO's parts
#: Variants that time their own exchange on two flat buffers (residual, output).
FLOORS = ("ef-floor", *AHEAD, *BUCKETS)
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
            options = options[0] if options else {}
            saved = {name: os.environ.get(name) for name in environment}
            os.environ.update(environment)  # read when the optimizer is built
            opt = hvm.DistributedOptimizer(
                base, named_parameters=model.named_parameters(),
                compression=getattr(hvm.Compression, options.get("method", "micro"))(
                    density=args.density, **{k: v for k, v in options.items() if k != "method"}),
                **kwargs)
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name)
                else:
                    os.environ[name] = value
        runs[label] = {"model": model, "opt": opt, "batches": batches, "rows": [], "t": 0}
        if label == "dense":
            opt = runs[label]["opt"] = hvd.DistributedOptimizer(
                base, named_parameters=model.named_parameters())
        if label in FLOORS:  # two flat buffers cut as the reducer cuts its own
            layout = FlatLayout(list(model.named_parameters()))
            flats = [torch.zeros(layout.numel, device=device) for _ in range(2)]
            runs[label]["grads"] = [layout.views(flat) for flat in flats]
            runs[label]["flats"] = flats
        if label in AHEAD:
            ahead = runs[label]["ahead"] = AheadFloor(layout, args.density, hvd.size(),
                                                      hvd.rank(), device, AHEAD[label])
            if AHEAD[label] == "overlap":
                ahead.install_hooks(layout.params, flats[0])
        if label in BUCKETS:
            runs[label]["ahead"] = BucketFloor(layout, args.density, hvd.size(), hvd.rank(),
                                               BUCKETS[label], flats[0])

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
        if sparse or label == "dense":
            opt.synchronize()
        elif label in AHEAD or label in BUCKETS:
            run["ahead"].exchange(*run["flats"], run["t"])
        elif label in ("barrier", "ef-floor"):  # what any synchronous step pays, bytes aside
            hvd.allreduce(torch.zeros(1), name="barrier")
        if "grads" in run:  # the step reads the (all-zero) output buffer
            for p, g in zip(model.parameters(), run["grads"][1]):
                p.grad = g
        t2 = time.perf_counter()
        if sparse or label == "dense":
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


class AheadFloor:
    """The ``ahead-*`` variants' exchange: MiCRO's shapes and local passes (see the
    module docstring). ``mode``: ``"two"`` (the next indices in their own gather),
    ``"one"`` (in the value allreduce) or ``"overlap"`` (``"one"`` cut per parameter and
    started by backward's hooks)."""

    def __init__(self, layout, density: float, size: int, rank: int, device, mode: str):
        import torch

        from horovod_micro.selection import ThresholdSelector

        self.mode = mode
        numel = layout.numel
        k = max(1, int(density * numel))
        self.size, self.rank = size, rank
        self.capacity = math.ceil(1.2 * k / size)
        # A union fixed in advance: every rank's slots full, spread over the vector.
        generator = torch.Generator().manual_seed(0)
        union = torch.randperm(numel, generator=generator)[:size * self.capacity]
        self.union = union.sort().values.to(device)
        self.block = torch.zeros(4 + self.capacity, dtype=torch.int32, device=device)
        self.threshold = None
        self.selector = ThresholdSelector(self.capacity)
        # Per parameter: its range of the flat vector and the union's entries in it.
        self.ranges = [(lo, hi, self.union[(self.union >= lo) & (self.union < hi)])
                       for lo, hi in layout.slices]
        self.handles: dict[int, object] = {}
        self.flat = None
        self.step = 0

    def select_next(self, residual, step: int) -> None:
        """The next part's choice: a threshold pass over N / n (MiCRO's native kernel), its
        part-relative indices into this rank's slots."""
        import torch

        n = residual.numel()
        part = (step + 1 + self.rank) % self.size
        start = part * n // self.size
        owned = residual[start:(part + 1) * n // self.size]
        if self.threshold is None:
            self.threshold = float(owned.abs().max()) / 2
        chosen = self.selector(owned, self.threshold, start, n)
        count = min(chosen.numel(), self.capacity)
        self.block[4:4 + count] = (chosen[:count] - start).to(torch.int32)
        self.block[1] = count
        # Steered towards the slots' capacity, as MiCRO's controller steers its count.
        self.threshold *= 1.1 if chosen.numel() > self.capacity else 0.95

    def slots(self, like):
        """This rank's slots of the next indices as values, zeros in the other ranks'."""
        import torch

        slots = torch.zeros(self.size * self.capacity, dtype=like.dtype, device=like.device)
        mine = slice(self.rank * self.capacity, (self.rank + 1) * self.capacity)
        slots[mine] = self.block[4:].to(like.dtype)
        return slots

    def install_hooks(self, params, flat) -> None:
        """``overlap``: each parameter's values start their allreduce as backward finishes
        it; the last one also selects the next part and carries its indices."""
        import horovod.torch as hvd
        import torch

        self.flat = flat
        for i, param in enumerate(params):
            def hook(_, i=i):
                lo, hi, inside = self.ranges[i]
                piece = self.flat[lo:hi]
                parts = [self.flat.index_select(0, inside), torch.dot(piece, piece).view(1)]
                if len(self.handles) == len(self.ranges) - 1:
                    self.select_next(self.flat, self.step)
                    parts.append(self.slots(piece))
                self.handles[i] = hvd.allreduce_async(torch.cat(parts), name=f"ahead.p{i}",
                                                      op=hvd.Sum)
            param.register_post_accumulate_grad_hook(hook)

    def exchange(self, residual, output, step: int) -> None:
        import horovod.torch as hvd
        import torch

        if self.mode == "overlap":
            for i, (_, _, inside) in enumerate(self.ranges):
                summed = hvd.synchronize(self.handles.pop(i))
                residual.index_fill_(0, inside, 0.0)
                output.index_fill_(0, inside, 0.0)
                output.index_copy_(0, inside, summed[:inside.numel()])
            self.step = step + 1
            return
        sq_norm = torch.dot(residual, residual)  # the status word's pass over N
        values = torch.cat([residual.index_select(0, self.union),
                            torch.stack([sq_norm, sq_norm]).to(residual.dtype)])
        if self.mode == "one":  # the next indices chosen first, then one collective
            self.select_next(residual, step)
            handles = [hvd.allreduce_async(torch.cat([values, self.slots(values)]),
                                           name="ahead.one", op=hvd.Sum)]
        else:  # the values travel while the next part is chosen, then its gather
            handles = [hvd.allreduce_async(values, name="ahead.values", op=hvd.Average)]
            self.select_next(residual, step)
            handles.append(hvd.allgather_async(self.block, name="ahead.indices"))
        summed = [hvd.synchronize(h) for h in handles][0][:self.union.numel()]
        residual.index_fill_(0, self.union, 0.0)
        output.index_fill_(0, self.union, 0.0)
        output.index_copy_(0, self.union, summed)


class BucketFloor:
    """The ``buckets-B`` variants' exchange (see the module docstring): per bucket, a fresh
    choice in this rank's rotating slice, its index gather started from backward's
    post-accumulate hooks, and its value allreduce at the gathered coordinates started as
    soon as that gather is back. ``buckets=None``: MiCRO's ``n`` parts, each chosen whole by
    its owner this step and broadcast from it."""

    def __init__(self, layout, density: float, size: int, rank: int, buckets: int | None,
                 flat):
        from horovod_micro.compressors.micro.partition import part_bounds
        from horovod_micro.selection import ThresholdSelector

        self.size, self.rank, self.flat, self.numel = size, rank, flat, layout.numel
        self.whole = buckets is None
        buckets = size if self.whole else buckets
        self.bounds = part_bounds(layout.numel, buckets)
        shares = 1 if self.whole else size  # who chooses in a bucket: its owner, or every rank
        self.slices = [[(lo + a, lo + b) for a, b in part_bounds(hi - lo, shares)]
                       for lo, hi in self.bounds]
        self.capacity = [math.ceil(1.2 * max(1, int(density * (hi - lo))) / shares)
                         for lo, hi in self.bounds]
        self.selector = [ThresholdSelector(c) for c in self.capacity]
        self.threshold: list[float | None] = [None] * buckets
        # Per parameter, the buckets it overlaps; per bucket, how many parameters it waits for.
        self.covers = [[b for b, (lo, hi) in enumerate(self.bounds) if p_lo < hi and lo < p_hi]
                       for p_lo, p_hi in layout.slices]
        self.needs = [sum(b in c for c in self.covers) for b in range(buckets)]
        self.step = 0
        self.written = None  # the output's coordinates the last step wrote
        self._reset()
        for i, param in enumerate(layout.params):
            param.register_post_accumulate_grad_hook(lambda _, i=i: self._arrived(i))

    def _reset(self) -> None:
        self.waiting = list(self.needs)
        self.gathers: dict[int, object] = {}  # bucket -> index gather in flight
        self.values: dict[int, tuple] = {}  # bucket -> (allreduce handle, slots, valid)
        self.order: list[int] = []  # buckets in the order backward completed them

    def _arrived(self, i: int) -> None:
        for b in self.covers[i]:
            self.waiting[b] -= 1
            if self.waiting[b] == 0:
                self._bucket_ready(b)

    def _bucket_ready(self, b: int) -> None:
        import horovod.torch as hvd
        import torch

        for done in [d for d, h in self.gathers.items() if hvd.poll(h)]:
            self._start_values(done)  # a gather back during backward: its values go now
        lo, hi = self.bounds[b]
        piece = self.flat[lo:hi]
        sq = torch.dot(piece, piece)  # the status word's pass over N, bucket by bucket
        owner = (b - self.step) % self.size  # MiCRO's rotation (parts)
        s_lo, s_hi = self.slices[b][0 if self.whole else (self.rank + self.step + b) % self.size]
        mine = self.flat[s_lo:s_hi] if not self.whole or self.rank == owner else self.flat[:0]
        capacity = self.capacity[b]
        block = torch.zeros(2 + capacity, dtype=torch.int32)
        block[1] = int(not torch.isfinite(sq))  # the status word's place
        if mine.numel():  # this rank chooses here (not in a part another rank owns)
            if self.threshold[b] is None:  # the first choice takes its share exactly
                share = min(mine.numel(), max(1, int(capacity / 1.2)))
                self.threshold[b] = float(mine.abs().topk(share).values[-1])
            chosen = self.selector[b](mine, self.threshold[b], s_lo, self.numel)
            count = min(chosen.numel(), capacity)
            block[0] = count
            block[2:2 + count] = chosen[:count].to(torch.int32)
            # Steered towards the slots, as MiCRO's controller steers its count.
            self.threshold[b] *= 1.1 if chosen.numel() > capacity else 0.95
        self.gathers[b] = (hvd.broadcast_async(block, owner, name=f"bucket.idx{b}")
                           if self.whole else
                           hvd.allgather_async(block.view(1, -1), name=f"bucket.idx{b}"))
        self.order.append(b)

    def _start_values(self, b: int) -> None:
        import horovod.torch as hvd
        import torch

        from horovod_micro.compressors.micro.compressor import values_in_slots
        from horovod_micro.waiting import wait

        if b in self.values:
            return
        blocks = wait(self.gathers.pop(b), self.flat, None).view(-1, 2 + self.capacity[b])
        slots = blocks[:, 2:].long()  # 0 past each rank's count (the blocks start zeroed)
        valid = torch.arange(slots.shape[1])[None, :] < blocks[:, :1].long()
        values = values_in_slots(self.flat, slots, valid, lambda v: v)  # MiCRO's own
        handle = hvd.allreduce_async(values, name=f"bucket.val{b}", op=hvd.Average)
        self.values[b] = (handle, slots.view(-1), valid.view(-1))

    def exchange(self, residual, output, step: int) -> None:
        import torch

        from horovod_micro.waiting import wait

        for b in self.order:
            self._start_values(b)
        if self.written is not None:
            output.index_fill_(0, self.written, 0.0)
        written = []
        for b in self.order:
            handle, slots, valid = self.values[b]
            summed = wait(handle, output, None)
            used = slots[valid]
            residual.index_fill_(0, used, 0.0)
            output.index_copy_(0, used, summed[valid])
            written.append(used)
        self.written = torch.cat(written)
        self.step = step + 1
        self._reset()


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
        for base in ("compute", "barrier", "dense"):
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
    ap.add_argument("--backend", choices=("gloo", "mpi"), default="gloo",
                    help="Horovod's CPU collectives (mpi: Open MPI, ranks yield when idle)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: the model and the reducer on each rank's GPU")
    ap.add_argument("--rate", default=None, help="tbf rate of bench/netns_run.sh (as root)")
    ap.add_argument("--burst", default=None,
                    help="tbf burst of bench/netns_run.sh (default 1mb: a message under about "
                         "1 MB after a quiet moment costs no wire time; 64kb charges it)")
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
        if args.burst is not None:
            env["HVM_TBF_BURST"] = args.burst
        timeline = Path(tmp) / "timeline.json"
        if args.timeline:
            env["HOROVOD_TIMELINE"] = str(timeline)
        cmd = horovodrun_cmd(args.np, args.backend, argv)
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
    where = ("GPU (NCCL collectives)" if args.device == "cuda"
             else {"gloo": "Gloo", "mpi": "MPI"}[args.backend])
    link = args.rate or "unlimited"
    if args.rate and args.burst:
        link += f" (tbf burst {args.burst})"
    print(f"# {args.model}, batch {args.batch}, d = {args.density}, {args.np} {where} ranks, link "
          f"{link}, Horovod cycle time {cycle} ms; medians of {iters} "
          "interleaved iterations, ms (total: slower rank; phases: rank 0)\n")
    cols = ("total", "compute", "backward", "sync", "step", *PHASES)
    print("| variant | " + " | ".join(cols) + " | x compute-only, paired "
          "| x barrier, paired | x dense, paired | global count | max rank count |")
    print("|---|" + "---:|" * (len(cols) + 5))
    for v, r in res.items():
        cells = [f"{r[c] * 1e3:.2f}" if c in r else "" for c in cols]
        print(f"| {v} | " + " | ".join(cells)
              + f" | {r.get('paired_x_compute', float('nan')):.3f} "
              f"| {r.get('paired_x_barrier', float('nan')):.3f} "
              f"| {r.get('paired_x_dense', float('nan')):.3f} "
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
