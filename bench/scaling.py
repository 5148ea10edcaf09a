"""Accuracy (or validation loss) against the number of workers: every method at n = 2 ... 64,
equal epochs.

The question a user asks before switching a job of n workers from dense to a sparse
method: *at my n, does it reach dense's accuracy in the same epochs, and how many bytes
does each rank send per step?* A cluster of 64 workers is not needed to answer the first
half: the accuracy depends on what each worker computes and on the rule that merges the
workers' gradients, not on where the workers run. So one process trains one model:

* each step, the n workers' gradients on their own batches (``batch_size`` each, disjoint
  shards of one shuffled epoch, as ``DistributedSampler`` gives) are computed at once with
  ``torch.func.vmap``;
* a sparse method runs its *real* code: every worker has its own
  :class:`~horovod_micro.reducer.SparseReducer` (error-feedback residual, the method's
  selection and density controller) on a :class:`~horovod_micro.testing.loopback.LoopbackGroup`
  rank, whose collectives have Horovod's semantics in one process; the bytes per step are
  what each rank's exchange accounts (:class:`~horovod_micro.exchange.Traffic`, ring
  collectives);
* the wrapped optimizer steps on the aggregate (``--optimizer``: ``nesterov``, the default,
  is SGD with Nesterov momentum 0.9 and weight decay 1e-4; ``momentum`` the same without
  Nesterov; ``sgd`` without momentum; ``adam``; ``adamw`` with weight decay 0.01), at a peak
  lr scaled from ``--lr`` by ``--lr-scaling`` (``linear``: ``lr * n * batch / 128``, the
  trainer's rule and the SGD family's default; ``sqrt``: ``lr * sqrt(n * batch / 128)``,
  the Adam family's; ``none``), optionally capped by ``--lr-cap``, after the trainer's
  warm-up (``horovod_micro_train.schedule``); momentum masking
  (:mod:`horovod_micro.momentum`) follows the method's setting, as
  ``DistributedOptimizer.step`` does.

The task follows the dataset: image classification (``fashion-mnist`` with ``fmnist_mlp``
or ``fmnist_lenet``, ``digits``, ...) is scored by test accuracy; ``python-text`` (bytes of
the standard library's sources) with ``text_transformer`` is a causal language model,
trained on token-level cross entropy and scored by the validation loss (mean token cross
entropy on 2,000 held-out sequences).

Methods are the registered ones (``dense`` is the mean gradient), with keyword arguments
after a colon: ``micro:judge='magnitude',momentum_masking=False`` is MiCRO as published,
``gtopk:density=0.004`` runs gTop-k at its own density (for a comparison at equal bytes).
Per run the final metric (mean of the last three evaluations), the bytes each rank
sends per step, and a diagnosis of the sparse exchange: the norm of the workers' summed
residual, how long an applied coordinate had waited, the size of its update, and which
fraction of the applied coordinates lie in the top k of the workers' summed accumulation.

    .venv/bin/python -m bench.scaling --epochs 3      # n = 2 ... 8, 12, 16
    .venv/bin/python -m bench.scaling --workers 32 64 --epochs 12 --lr-cap 0.4 \\
        --json bench/results/scaling-large.json
    .venv/bin/python -m bench.scaling --model fmnist_lenet \\
        --json bench/results/scaling-lenet.json
    .venv/bin/python -m bench.scaling --model text_transformer --dataset python-text \\
        --optimizer adamw --json bench/results/scaling-text.json

``oracle`` and ``oracle:parts=True`` are references, not methods: the exact top k of the n
workers' *summed* accumulation (every worker keeps its residual; the chosen coordinates
carry the workers' mean and leave every residual; Adam's moments take the bursts by their
ages and the momentum is masked as MiCRO's defaults do), over the whole vector or per
part, each part's share of k from that part. No worker can see that sum without sending
its whole residual: they bound what any selection at this density could reach, and
``oracle:parts=True`` against ``micro`` measures what judging from one worker's accumulation
costs (:func:`oracle_choice`). No bytes are counted for them.

``late:delay=0``, ``late:delay=1`` and ``late:delay=2`` are references of the exchange's
timing: the owners' exact choice by magnitude in their own accumulation, with the values
applied at once, the other workers' a step late, or all of them later (:class:`LateValues`).

``prior`` (``prior:horizon=200.0``, ``prior:weight=0.5``) is an experiment on MiCRO's judge,
not a method of the plugin: the owner judges its estimate of the workers' mean accumulation
from the rates of the coordinates' last aggregates (:class:`PriorJudgedMicro`).
``verified`` (``verified:fp16_values=True``, ``verified:factor=2.0``) is one on the exchange:
the owners nominate ``factor`` times the coordinates and the largest sums among them are
applied (:class:`VerifiedMicro`).

``--age-power P`` is an experiment on Adam's rule (:mod:`horovod_micro.momentum`): an arrived
burst of age ``k`` enters Adam's second moment as its square over ``k ** P`` instead of the
plugin's :data:`~horovod_micro.momentum.AGE_POWER` (the runs record it).

``--partition random`` (or ``blocks:B``) is an experiment on the partition: the workers'
gradients reach the reducers permuted, so that every part MiCRO's contiguous split makes
is a sample of every layer (:func:`mixing_order`).

Writes ``--json`` (every run, with its curve; a run already there with the same method, n,
seed, density, epochs, optimizer, lr, lr scaling, model, partition and torch threads is
reused, not trained again; a record without its thread count matches any) and, with
``--figures DIR``, ``scaling-accuracy.png`` (``scaling-val-loss.png`` for a language model:
the final metric against n, one line per method) and ``scaling-bytes.png`` (bytes
per rank per step against n).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path

import horovod.torch as hvd
import torch
from torch.func import functional_call, grad, vmap
from torch.nn import functional as F  # noqa: N812

import horovod_micro as hvm
from horovod_micro import momentum as momentum_rules
from horovod_micro.compression import factory, takes_density
from horovod_micro.compressors.base import Aggregate, ReduceOp, config_of
from horovod_micro.compressors.micro.compressor import MicroCompressor
from horovod_micro.compressors.micro.drift import DriftAges, ages
from horovod_micro.compressors.micro.partition import part_bounds
from horovod_micro.layout import FlatLayout
from horovod_micro.momentum import Arrived, masking
from horovod_micro.reducer import SparseReducer
from horovod_micro.stats import ring_allreduce_bytes
from horovod_micro.testing.loopback import LoopbackGroup
from horovod_micro_train.data import build_datasets
from horovod_micro_train.models import build_model
from horovod_micro_train.schedule import lr_at, peak_lr

from .common import parse_method

MOMENTUM, WEIGHT_DECAY, ADAMW_WEIGHT_DECAY = 0.9, 1e-4, 0.01
DIAGNOSE_EVERY = 5
#: Optimizers by family: the base lr and lr scaling each family defaults to.
SGD_FAMILY, ADAM_FAMILY = ("nesterov", "momentum", "sgd"), ("adam", "adamw")
OPTIMIZERS = SGD_FAMILY + ADAM_FAMILY
LR_SCALINGS = ("linear", "sqrt", "none")
#: A language model's validation loss is measured on this many held-out sequences.
EVAL_SEQUENCES = 2_000
EVAL_CHUNK = 500


def as_tensors(dataset) -> tuple[torch.Tensor, torch.Tensor]:
    """A map-style dataset of (input, target) pairs as two stacked tensors (targets: class
    labels, or token sequences)."""
    if isinstance(dataset, torch.utils.data.TensorDataset) and len(dataset.tensors) == 2:
        return dataset.tensors[0], dataset.tensors[1].long()
    xs, ys = zip(*(dataset[i] for i in range(len(dataset))))
    if torch.is_tensor(ys[0]) and ys[0].dim():
        return torch.stack(xs), torch.stack(ys).long()
    return torch.stack(xs), torch.tensor([int(y) for y in ys])


@functools.cache
def load(dataset: str, data_dir: str | None, seed: int) -> tuple:
    """Train and test tensors and the class count, read once per process (every method
    of a run trains on the same data)."""
    data = build_datasets(dataset, data_dir, seed=seed)
    return (*as_tensors(data.train), *as_tensors(data.test), data.num_classes)


def metric_of(targets: torch.Tensor) -> str:
    """``accuracy`` for one class label per input, ``val_loss`` for a target per position
    (a language model)."""
    return "accuracy" if targets.dim() == 1 else "val_loss"


def token_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean"
               ) -> torch.Tensor:
    """Cross entropy over every position: logits ``(..., classes)``, targets ``(...)``
    (a classifier's (batch,), a language model's (batch, context))."""
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten(), reduction=reduction)


def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Test accuracy, or for a language model the mean token cross entropy on the first
    :data:`EVAL_SEQUENCES` held-out sequences (in chunks of :data:`EVAL_CHUNK`)."""
    model.eval()
    with torch.no_grad():
        if metric_of(y) == "accuracy":
            value = sum(int((model(x[i:i + 1000]).argmax(1) == y[i:i + 1000]).sum())
                        for i in range(0, len(x), 1000)) / len(x)
        else:
            x, y = x[:EVAL_SEQUENCES], y[:EVAL_SEQUENCES]
            value = float(sum(token_loss(model(x[i:i + EVAL_CHUNK]), y[i:i + EVAL_CHUNK],
                                         "sum") for i in range(0, len(x), EVAL_CHUNK))
                          / y.numel())
    model.train()
    return value


#: Each worker's batch (the scaling recipe's; ``make run``'s at batch 32).
BATCH_SIZE = 32


def scaled_lr(lr: float, batch_size: int, n: int, scaling: str,
              cap: float | None = None) -> float:
    """The peak lr for n workers of ``batch_size``: ``linear`` (the trainer's
    :func:`~horovod_micro_train.schedule.peak_lr`, ``lr * n * batch / 128``), ``sqrt``
    (``lr * sqrt(n * batch / 128)``) or ``none`` (``lr``), at most ``cap`` where given."""
    if scaling == "linear":
        peak = peak_lr(lr, batch_size, n)
    elif scaling == "sqrt":
        peak = lr * math.sqrt(batch_size * n / 128)
    elif scaling == "none":
        peak = lr
    else:
        raise ValueError(f"unknown lr scaling {scaling!r}; choose one of {LR_SCALINGS}")
    return min(peak, cap) if cap else peak


def make_optimizer(name: str, params: list[torch.nn.Parameter], lr: float
                   ) -> torch.optim.Optimizer:
    """``nesterov`` (SGD, Nesterov momentum 0.9, weight decay 1e-4), ``momentum`` (the same,
    heavy ball), ``sgd`` (no momentum, weight decay 1e-4), ``adam``, ``adamw`` (weight
    decay 0.01)."""
    if name in SGD_FAMILY:
        momentum = 0.0 if name == "sgd" else MOMENTUM
        return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=name == "nesterov",
                               weight_decay=WEIGHT_DECAY)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=ADAMW_WEIGHT_DECAY)
    raise ValueError(f"unknown optimizer {name!r}; choose one of {OPTIMIZERS}")


def optimizer_defaults(name: str, lr: float | None, scaling: str | None
                       ) -> tuple[float, str]:
    """``lr`` and ``scaling``, or the optimizer family's defaults where None: 0.1 and
    linear for the SGD family, 1e-3 and sqrt for the Adam family."""
    sgd = name in SGD_FAMILY
    return (lr if lr is not None else 0.1 if sgd else 1e-3,
            scaling or ("linear" if sgd else "sqrt"))


class Gradients:
    """The n workers' flat gradients of one step, computed together (``vmap``)."""

    def __init__(self, model: torch.nn.Module, layout: FlatLayout):
        self.model, self.layout = model, layout

        def loss(params, x, y):
            return token_loss(functional_call(model, params, (x,)), y)

        self._grads = vmap(grad(loss), in_dims=(None, 0, 0))

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        params = {name: p.detach() for name, p in zip(self.layout.names, self.layout.params)}
        grads = self._grads(params, x, y)
        n = x.shape[0]
        return torch.cat([grads[name].reshape(n, -1) for name in self.layout.names], 1)


class Diagnosis:
    """What the sparse exchange does to the workers' accumulated gradient (rank 0 holds
    every worker's reducer; read between steps, when no rank is exchanging)."""

    def __init__(self, numel: int, k: int):
        self.k = k
        self.last = torch.zeros(numel, dtype=torch.long)
        self.rows: list[dict] = []

    def record(self, t: int, summed: torch.Tensor | None, applied: torch.Tensor,
               aggregate: torch.Tensor, residual_norm: float) -> None:
        """Every step: the waits of ``applied``; steps with ``summed`` (the workers' summed
        ``a_t``, read every ``DIAGNOSE_EVERY`` steps) also add a row."""
        applied = applied.long()
        waited = (t + 1 - self.last[applied]).double()
        self.last[applied] = t + 1
        if summed is None:
            return
        best = torch.zeros(summed.numel(), dtype=torch.bool)
        best[summed.abs().topk(min(self.k, summed.numel())).indices] = True
        self.rows.append({
            "iteration": t,
            "summed_residual_norm": residual_norm,
            "mean_wait": float(waited.mean()) if applied.numel() else 0.0,
            "max_wait": int(waited.max()) if applied.numel() else 0,
            "mean_update": float(aggregate[applied].abs().mean()) if applied.numel() else 0.0,
            "in_summed_topk": float(best[applied].double().mean()) if applied.numel() else 0.0,
        })


def mixing_order(numel: int, n: int, partition: str) -> torch.Tensor | None:
    """The order in which the simulator hands each worker's flat gradient to its reducer,
    for ``partition`` (an experiment, not what the plugin does): None for ``contiguous``,
    the model's own order, in which MiCRO's parts are contiguous runs of the layers;
    ``random``, one fixed random permutation, so that every part is a random sample of
    every layer; ``blocks:B``, blocks of ``B`` coordinates dealt round-robin, part ``p``
    holding the blocks ``p, p + n, ...`` (each part samples every layer at ``B``'s grain).
    The aggregate goes back to the model's order before the optimizer applies it."""
    if partition == "contiguous":
        return None
    if partition == "random":
        return torch.randperm(numel, generator=torch.Generator().manual_seed(1234))
    kind, _, size = partition.partition(":")
    if kind != "blocks" or not size.isdigit() or int(size) < 1:
        raise ValueError(f"partition: contiguous, random or blocks:B, got {partition!r}")
    return torch.argsort(torch.arange(numel) // int(size) % n, stable=True)


def oracle_choice(summed: torch.Tensor, k: int, n: int, per_part: bool) -> torch.Tensor:
    """The reference choice (``oracle``, ``oracle:parts=True``): the ``k`` largest
    ``|summed|``, or in each of the ``n`` parts (MiCRO's contiguous split) its share of
    ``k``, ``round(k * size / N)``, at least 1. Ownership does not matter to a choice made
    from the sum."""
    if not per_part:
        return torch.topk(summed.abs(), k, sorted=False).indices
    return torch.cat([start + torch.topk(summed[start:end].abs(), share, sorted=False).indices
                      for start, end, share in part_shares(summed.numel(), n, k)])


class OracleChoice:
    """The reference exchange of ``oracle`` (``parts``: ``oracle:parts=True``): every worker
    keeps its residual, and each step the :func:`oracle_choice` of their sum carries the
    workers' mean and leaves every residual."""

    def __init__(self, numel: int, n: int, k: int, parts: bool):
        self.n, self.k, self.parts = n, k, parts
        self.residuals = torch.zeros(n, numel)
        self.last = torch.full((numel,), -1, dtype=torch.int64)

    def step(self, it: int, grads: torch.Tensor) -> tuple[torch.Tensor, Arrived]:
        """Add the workers' gradients ``(n, N)``; the mean to apply and where it arrived."""
        self.residuals += grads
        summed = self.residuals.sum(0)
        chosen = oracle_choice(summed, self.k, self.n, self.parts)
        merged = torch.zeros_like(summed)
        merged[chosen] = summed[chosen] / self.n
        self.residuals[:, chosen] = 0.0
        waited = (it - self.last[chosen]).to(torch.int32)  # iterations accumulated
        self.last[chosen] = it
        return merged, Arrived(chosen, waited)


def part_shares(numel: int, n: int, k: int) -> list[tuple[int, int, int]]:
    """MiCRO's ``n`` contiguous parts as ``(start, end, share)``: each part's share of ``k``
    is ``round(k * size / N)``, at least 1 and at most the part."""
    return [(start, end, min(end - start, max(1, round(k * (end - start) / numel))))
            for start, end in part_bounds(numel, n)]


class LateValues:
    """A reference exchange (``late:delay=D``), for this simulator only: what it costs in
    accuracy to apply the chosen coordinates' values ``D`` steps after the choice.

    Why. MiCRO's values can be summed only once the owners have chosen, after backward; a
    step whose one collective carried the values of coordinates chosen earlier would need
    nothing after backward, as dense Horovod's allreduce does. ``micro_ahead`` moves the
    choice a step earlier (its judgement is a gradient old); this moves the values later
    and keeps the choice fresh.

    What. Every worker keeps its residual; each step, each part's owner (MiCRO's rotation:
    rank ``r`` owns part ``(t + r) mod n``) takes its share of ``k``
    (:func:`part_shares`), the largest ``|a|`` of its *own* accumulation in the
    part, exactly. ``delay=0``: every worker's value there is applied at once (MiCRO's
    exchange with an exact count and the magnitude judge: the baseline of this
    experiment). ``delay=1``: the owner's own value is applied at once and the other
    workers' a step later (one collective after backward: the owners' positions and values
    beside the others' values at the positions of the step before). ``delay=2``: the
    owner's value a step later and the others' two steps later (one collective that
    backward can start, nothing after it). A worker's value leaves its residual when it is
    sent, so nothing is lost: the n workers' applied sum, their residuals and the values in
    flight always add up to their gradients. The momentum is masked by MiCRO's rule where
    anything arrives, each arrival's age counted from the coordinate's previous one. No
    bytes are counted. ``late`` alone is ``delay=1``."""

    def __init__(self, numel: int, n: int, k: int, delay: int):
        if delay not in (0, 1, 2):
            raise ValueError(f"late: delay must be 0, 1 or 2, got {delay!r}")
        self.n, self.delay = n, delay
        self.parts = part_shares(numel, n, k)
        self.residuals = torch.zeros(n, numel)
        self.last = torch.full((numel,), -1, dtype=torch.int64)
        self.pending = torch.zeros(0, dtype=torch.int64)  # the others' values go this step
        self.flight = (torch.zeros(0, dtype=torch.int64), torch.zeros(0))  # owners' (delay 2)

    def choose(self, it: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each owner's exact choice in its part: (coordinates, owner of each)."""
        picks, owners = [], []
        for part, (start, end, share) in enumerate(self.parts):
            owner = (part - it) % self.n
            top = start + torch.topk(self.residuals[owner, start:end].abs(), share,
                                     sorted=False).indices
            picks.append(top)
            owners.append(torch.full_like(top, owner))
        return torch.cat(picks), torch.cat(owners)

    def step(self, it: int, grads: torch.Tensor) -> tuple[torch.Tensor, Arrived]:
        """Add the workers' gradients ``(n, N)``; the mean to apply and where it arrived."""
        res = self.residuals
        res += grads
        sent = torch.zeros_like(res, dtype=torch.bool)
        sent[:, self.pending] = True  # every worker's value at the earlier choice
        if self.delay < 2:
            chosen, owners = self.choose(it)
            sent[owners, chosen] = True
            if self.delay == 0:
                sent[:, chosen] = True
        merged = torch.where(sent, res, 0.0).sum(0)
        res.masked_fill_(sent, 0.0)
        arrived = sent.any(0)
        flown, values = self.flight
        merged.index_add_(0, flown, values)
        arrived[flown] = True
        if self.delay == 1:
            self.pending = chosen
        elif self.delay == 2:  # chosen after this step's collective, sent with the next
            chosen, owners = self.choose(it)
            self.pending, self.flight = flown, (chosen, res[owners, chosen].clone())
            res[owners, chosen] = 0.0
        at = arrived.nonzero().view(-1)
        waited = (it - self.last[at]).to(torch.int32)
        self.last[at] = it
        return merged / self.n, Arrived(at, waited)


def estimate(acc: torch.Tensor, rates: torch.Tensor, age: torch.Tensor, others: float,
             horizon: float) -> torch.Tensor:
    """What the owner judges: ``(a + others * T * r) / (1 + others)`` where the rate ``r``
    is known (not NaN) and the age ``T`` (iterations since the last arrival, at least 1) is
    at most ``horizon``; ``a`` elsewhere."""
    age = age.to(acc.dtype).clamp(min=1)
    known = ~torch.isnan(rates) & (age <= horizon)
    return torch.where(known, (acc + others * age * rates) / (1.0 + others), acc)


class PriorJudgedMicro(MicroCompressor):
    """An experiment on MiCRO's judge (``--methods prior``), for this simulator only: the
    owner of a part judges its estimate of the workers' *mean* accumulation, not its own.

    Why. The owner chooses from its own accumulation ``a_i``, a sample of one worker's
    batches, while the coordinates it picks carry the n workers' sum; at 8 and 16 workers
    that view costs LeNet-5 and AdamW a point or more against the choice made from the sum
    (``--methods oracle:parts=True``). Every rank already holds, with no message, the
    aggregate of each coordinate's last arrival: the workers' mean accumulation over the
    ``w`` iterations it had waited, so ``r_i = value_i / w_i`` is the workers' mean rate at
    ``i`` as it was then, measured on n times the samples.

    What. Where coordinate ``i`` arrived at most ``horizon`` iterations ago (its age
    ``T_i``), the owner judges ``(a_i + (n - 1) T_i r_i) / n`` (:func:`estimate`): its own
    accumulation and, for the other workers, what they accumulated at ``i`` since, were
    their rate still ``r_i``; elsewhere ``a_i``. The rest is MiCRO's: the judge scores the
    estimate, the controller steers the count, every worker sends its own ``a_i``, the bytes
    are the same. In the plugin it would cost ``N`` rates (4 bytes a coordinate, shared
    state like the ages, so in checkpoints and elastic resets), ``k`` writes a step, and the
    estimate inside the threshold pass over the owned part.

    ``horizon``: iterations after its last arrival for which a coordinate's rate counts
    (``None``: ``1 / density``, the mean wait); ``weight``: the share of the other workers'
    estimate (1: the ``n - 1`` others; 0: MiCRO's own judge)."""

    name = "prior"

    def __init__(self, density: float = 0.001, *, horizon: float | None = None,
                 weight: float = 1.0, **settings):
        super().__init__(density, **settings)
        self.horizon = 1.0 / density if horizon is None else float(horizon)
        self.weight = float(weight)
        self.rates: torch.Tensor | None = None  # NaN: no arrival seen yet

    def config(self) -> dict:
        return {**super().config(), "horizon": self.horizon, "weight": self.weight}

    def bind(self, numel, comm) -> None:
        super().bind(numel, comm)
        if self.ages is None:  # the magnitude judge without Adam keeps none: the ages say T
            self.ages = DriftAges(numel, self.density)

    def select(self, acc: torch.Tensor, iteration: int):
        now = iteration + 1
        age = ages(self.ages.at(acc.device, now), now)
        if self.rates is None:
            self.rates = torch.full_like(acc, math.nan)
        judged = estimate(acc, self.rates, age, self.weight * (self.comm.size - 1),
                          self.horizon)
        own_scale = self.rms_scale  # the controller's scale follows what it thresholds
        self.rms_scale = float(judged.norm()) / math.sqrt(judged.numel())
        try:
            return super().select(judged, iteration)
        finally:
            self.rms_scale = own_scale

    def observe(self, reduced) -> None:
        if reduced.waited is not None and reduced.indices.numel():
            at = reduced.indices.long()
            self.rates[at] = (reduced.values.to(self.rates.dtype)
                              / reduced.waited.to(self.rates.dtype).clamp(min=1))
        super().observe(reduced)


#: ``bench.scaling``'s ``prior`` method: the constructor with the plugin's argument check.
prior = factory(PriorJudgedMicro)


class VerifiedMicro(MicroCompressor):
    """An experiment on MiCRO's exchange (``--methods verified``), for this simulator only:
    the owners nominate ``factor`` times the coordinates, and of those the ``k`` with the
    largest *summed* value are applied.

    Why. The choice from the workers' sum (``--methods oracle:parts=True``) closes most of
    what MiCRO loses at 16 workers with AdamW and on LeNet-5 at 8, but no worker sees that
    sum. After the value allreduce every rank does see it, at the coordinates that
    travelled: nominating more than ``k`` and keeping the largest sums lets the sum decide
    among the owner's candidates.

    What. MiCRO's own selection, controller and exchange at ``factor * density`` (the
    candidates); after the allreduce every rank keeps the ``floor(density * N)`` largest
    ``|sum|`` (the same on every rank: the same aggregate, the same ``topk``); only those
    are applied and leave the residuals, the other candidates stay where they were, in
    every rank's residual, and their ages run on. With ``fp16_values=True`` and
    ``factor=1.5`` it sends what MiCRO sends at ``density`` in float32 (8 bytes a
    candidate against 12 a coordinate).

    ``factor``: candidates per applied coordinate (>= 1; 1 is MiCRO)."""

    name = "verified"

    def __init__(self, density: float = 0.001, *, factor: float = 1.5, **settings):
        self.factor = float(factor)
        self.applied_density = density
        super().__init__(min(1.0, density * self.factor), **settings)

    def config(self) -> dict:
        return {**super().config(), "density": self.applied_density, "factor": self.factor}

    def config_error(self) -> str | None:
        if not (math.isfinite(self.factor) and self.factor >= 1.0):
            return f"verified: factor must be a finite number >= 1, got {self.factor!r}"
        return super().config_error()

    def combine(self, acc, selection, gathered, iteration, reduction, traffic):
        reduced = super().combine(acc, selection, gathered, iteration, reduction, traffic)
        k = math.floor(self.applied_density * self.numel)
        if reduced.indices.numel() <= k:
            return reduced
        keep = torch.topk(reduced.values.abs(), k, sorted=False).indices
        indices = reduced.indices.index_select(0, keep)
        waited = None if reduced.waited is None else reduced.waited.index_select(0, keep)
        return Aggregate(indices, reduced.values.index_select(0, keep), indices,
                         reduced.gathered, reduced.threshold, waited=waited)


#: ``bench.scaling``'s ``verified`` method.
verified = factory(VerifiedMicro)
EXPERIMENTS = {"prior": prior, "verified": verified}


def train(method: str, *, n: int, density: float, epochs: float, seed: int = 1,
          dataset: str = "fashion-mnist", model_name: str = "fmnist_mlp",
          batch_size: int = BATCH_SIZE, optimizer: str = "nesterov", lr: float | None = None,
          lr_scaling: str | None = None, lr_cap: float | None = None,
          warmup_epochs: float = 0.5, evaluations_per_epoch: int = 8,
          partition: str = "contiguous", report=print) -> dict:
    """One run of ``method`` (``name[:kwargs]``, or ``dense``) with n workers.
    ``optimizer`` is one of :data:`OPTIMIZERS`; ``lr`` and ``lr_scaling`` default by its
    family (:func:`optimizer_defaults`)."""
    x, y, test_x, test_y, num_classes = load(dataset, None, seed)
    metric = metric_of(test_y)
    optimizer_name = optimizer
    lr, lr_scaling = optimizer_defaults(optimizer_name, lr, lr_scaling)
    torch.manual_seed(seed)
    model = build_model(model_name, num_classes)
    layout = FlatLayout(list(model.named_parameters()))
    peak = scaled_lr(lr, batch_size, n, lr_scaling, lr_cap)
    optimizer = make_optimizer(optimizer_name, layout.params, peak)
    gradients = Gradients(model, layout)
    steps_per_epoch = len(x) // (batch_size * n)
    iters = max(1, round(epochs * steps_per_epoch))
    eval_every = max(1, steps_per_epoch // evaluations_per_epoch)
    order = torch.Generator().manual_seed(seed)
    name, kwargs = parse_method(method)
    oracle, late = name == "oracle", name == "late"
    sparse = name != "dense" and not oracle and not late
    make = (EXPERIMENTS.get(name) or getattr(hvm.Compression, name)) if sparse else None
    if sparse and takes_density(make):
        kwargs = {"density": density, **kwargs}
    compressors = [make(**kwargs) for _ in range(n)] if sparse else []
    for compressor in compressors:  # as DistributedOptimizer does (micro_ahead's guess)
        compressor.fit_optimizer(optimizer.param_groups)
    curve: list[tuple[int, float]] = []
    sent: list[int] = []
    cuts = [0]  # steps on which some rank's selection was cut to the capacity
    k = max(1, int(density * layout.numel))  # the count a method aims at
    diagnosis = Diagnosis(layout.numel, k)
    reducers: list[SparseReducer | None] = [None] * n
    start = time.perf_counter()

    def batches(it: int, perm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        step = it % steps_per_epoch
        idx = perm[step * n * batch_size:(step + 1) * n * batch_size]
        return (x[idx].view(n, batch_size, *x.shape[1:]),
                y[idx].view(n, batch_size, *y.shape[1:]))

    def apply(it: int, merged: torch.Tensor, arrived=None, compressor=None) -> None:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(it / steps_per_epoch, peak, n, warmup_epochs, (), 0.1)
        for p, view in zip(layout.params, layout.views(merged)):
            p.grad = view.clone()
        # Momentum masked (Adam's moments primed) where the burst arrived, as the optimizer.
        with masking(optimizer, compressor, layout, arrived, None):
            optimizer.step()
        if (it + 1) % eval_every == 0 or it + 1 == iters:
            curve.append((it + 1, evaluate(model, test_x, test_y)))
            report(f"{method} n={n}: iteration {it + 1}/{iters}, "
                   f"{'test accuracy' if metric == 'accuracy' else 'validation loss'} "
                   f"{curve[-1][1]:.4f} ({time.perf_counter() - start:.0f} s)")

    if oracle or late:  # a reference exchange on plain tensors (see their docstrings)
        reference = (OracleChoice(layout.numel, n, k, kwargs.get("parts", False)) if oracle
                     else LateValues(layout.numel, n, k, int(kwargs.get("delay", 1))))
        masks_like = hvm.Compression.micro(density=density)  # MiCRO's masking rule
        for it in range(iters):
            if it % steps_per_epoch == 0:
                perm = torch.randperm(len(x), generator=order)
            apply(it, *reference.step(it, gradients(*batches(it, perm))), masks_like)
            sent.append(0)
    elif not sparse:
        for it in range(iters):
            if it % steps_per_epoch == 0:
                perm = torch.randperm(len(x), generator=order)
            apply(it, gradients(*batches(it, perm)).mean(0))
            sent.append(ring_allreduce_bytes(layout.numel * 4, n)[0])
    else:
        group = LoopbackGroup(n, timeout=600.0)
        mixing = mixing_order(layout.numel, n, partition)
        back = None if mixing is None else torch.argsort(mixing)

        def rank_body(comm):
            rank = comm.rank
            # The model's own shapes (PowerSGD compresses each matrix), in its order: the
            # flat vector is the layout's.
            params = [torch.nn.Parameter(torch.zeros_like(p)) for p in layout.params]
            reducer = SparseReducer(FlatLayout(list(zip(layout.names, params))),
                                    compressors[rank], comm, ReduceOp(hvd.Average))
            reducers[rank] = reducer
            group.share(rank, None)  # every reducer exists before rank 0 reads them
            perm = None
            for it in range(iters):
                grads = summed = None
                residual_norm = 0.0
                if rank == 0:
                    if it % steps_per_epoch == 0:
                        perm = torch.randperm(len(x), generator=order)
                    grads = gradients(*batches(it, perm))
                    if it % DIAGNOSE_EVERY == 0:
                        summed = torch.stack([r.residual for r in reducers]).sum(0)
                        summed = summed if back is None else summed[back]
                        residual_norm = float(summed.norm())
                        summed += grads.sum(0)
                grads = group.share(rank, grads)[0]
                mine = grads[rank] if mixing is None else grads[rank][mixing]
                for p, view in zip(params, layout.views(mine)):
                    p.grad = view.clone()
                stats = reducer.reduce()
                aggregate, applied = reducer.output, reducer.applied
                if mixing is not None:  # back to the model's order
                    aggregate = aggregate[back]
                    applied = None if applied is None else Arrived(
                        mixing[applied.indices.long()], applied.waited)
                sizes = group.share(rank, stats.bytes_sent)
                if rank == 0:
                    sent.append(max(sizes))
                    # A rank's selection cut to the exchange's capacity (what it picked
                    # exceeds what travelled).
                    cuts[0] += sum(stats.rank_counts) > stats.global_count
                    if applied is not None:
                        diagnosis.record(it, summed, applied.indices, aggregate,
                                         residual_norm)
                    apply(it, aggregate, applied, reducer.compressor)
                group.share(rank, None)  # the weights are updated before the next step

        group.run(rank_body)
    final = curve[-3:]
    final_value = sum(a for _, a in final) / len(final)
    return {"method": method, "n": n, "density": density, "epochs": epochs, "seed": seed,
            # The compressor's whole configuration, defaults included (None: dense).
            "compression_config": config_of(compressors[0] if sparse else None),
            "dataset": dataset, "model": model_name, "optimizer": optimizer_name,
            "lr": lr, "lr_scaling": lr_scaling, "peak_lr": peak, "iterations": iters,
            **({} if partition == "contiguous" else {"partition": partition}),
            "metric": metric, "final_metric": final_value,
            **({"final_accuracy": final_value} if metric == "accuracy" else {}),
            "curve": curve,
            "bytes_per_step": sum(sent) / len(sent), "diagnosis": diagnosis.rows,
            "cut_steps": cuts[0],
            # Steps the device-side choice left to the host rule (HOROVOD_MICRO_SELECT=torch)
            "regathered_steps": getattr(compressors[0], "regathers", 0) if compressors else 0,
            "seconds": time.perf_counter() - start,
            "weights": torch.cat([p.detach().reshape(-1) for p in layout.params])}


def final_metric(run: dict) -> float:
    """A run's final metric (records older than ``final_metric`` hold accuracy only)."""
    return run["final_metric"] if "final_metric" in run else run["final_accuracy"]


def format_metric(value: float, metric: str) -> str:
    """Accuracy as a percentage, a loss to 3 decimals."""
    return f"{value:.2%}" if metric == "accuracy" else f"{value:.3f}"


def table(runs: Sequence[dict]) -> str:
    """Final metric (accuracy, or validation loss; mean over seeds) and bytes per rank per
    step, methods by n."""
    ns = sorted({r["n"] for r in runs})
    methods = list(dict.fromkeys(r["method"] for r in runs))
    lines = ["| method | " + " | ".join(f"n = {n}" for n in ns) + " |",
             "|---|" + "---:|" * len(ns)]
    for method in methods:
        cells = []
        for n in ns:
            rs = [r for r in runs if r["method"] == method and r["n"] == n]
            if not rs:
                cells.append("")
                continue
            value = sum(final_metric(r) for r in rs) / len(rs)
            kb = sum(r["bytes_per_step"] for r in rs) / len(rs) / 1e3
            cells.append(f"{format_metric(value, rs[0].get('metric', 'accuracy'))} "
                         f"({kb:,.0f} KB)")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def diagnosis_table(runs: Sequence[dict]) -> str:
    """The sparse runs' diagnosis, averaged over the last third of each run's records."""
    lines = ["| method | n | summed residual norm | mean wait (iterations) | max wait | "
             "mean applied |value| | applied in top k of the summed accumulation |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        rows = r["diagnosis"][-max(1, len(r["diagnosis"]) // 3):]
        if not r["diagnosis"]:
            continue

        def mean(key, rows=rows):
            return sum(row[key] for row in rows) / len(rows)

        lines.append(f"| {r['method']} | {r['n']} | {mean('summed_residual_norm'):.1f} | "
                     f"{mean('mean_wait'):.0f} | {max(row['max_wait'] for row in rows)} | "
                     f"{mean('mean_update'):.4f} | {mean('in_summed_topk'):.0%} |")
    return "\n".join(lines)


def figures(runs: Sequence[dict], out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    methods = list(dict.fromkeys(r["method"] for r in runs))
    loss = any(r.get("metric", "accuracy") != "accuracy" for r in runs)
    for key, name, label, log in ((final_metric, "scaling-val-loss.png" if loss else
                                   "scaling-accuracy.png", "final validation loss" if loss
                                   else "final test accuracy", False),
                                  (lambda r: r["bytes_per_step"], "scaling-bytes.png",
                                   "bytes sent per rank per step", True)):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for method in methods:
            ns = sorted({r["n"] for r in runs if r["method"] == method})
            ys = [sum(key(r) for r in runs if r["method"] == method and r["n"] == n)
                  / sum(1 for r in runs if r["method"] == method and r["n"] == n) for n in ns]
            ax.plot(ns, ys, marker="o", label=method)
        ax.set_xscale("log", base=2)
        if log:
            ax.set_yscale("log")
        ax.set_xlabel("workers n")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)


@contextlib.contextmanager
def adam_age_power(power: float | None):
    """Within it, Adam's second moment takes a burst of age ``k`` as its square over
    ``k ** power`` (None: the plugin's rule, unchanged)."""
    saved = momentum_rules.AGE_POWER
    if power is not None:
        momentum_rules.AGE_POWER = power
    try:
        yield
    finally:
        momentum_rules.AGE_POWER = saved


DEFAULT_METHODS = ["dense", "micro", "micro:momentum_masking=False", "topk", "gtopk",
                   "gtopk:momentum_masking=True"]


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", default=DEFAULT_METHODS,
                   help="dense, or a registered method with optional keyword arguments "
                        "(micro:momentum_masking=False)")
    p.add_argument("--workers", type=int, nargs="+", default=[2, 3, 4, 5, 6, 7, 8, 12, 16])
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--epochs", type=float, default=3.0)
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="nesterov",
                   help="nesterov (SGD, Nesterov momentum 0.9, weight decay 1e-4), momentum "
                        "(the same without Nesterov), sgd (no momentum), adam, adamw "
                        "(weight decay 0.01)")
    p.add_argument("--lr", type=float, default=None,
                   help="base lr, scaled by --lr-scaling (default: 0.1 for the SGD family, "
                        "1e-3 for adam and adamw)")
    p.add_argument("--lr-scaling", choices=LR_SCALINGS, default=None,
                   help="peak lr = lr * n * batch / 128 (linear; the SGD family's default), "
                        "lr * sqrt(n * batch / 128) (sqrt; the Adam family's), or lr (none)")
    p.add_argument("--lr-cap", type=float, default=None,
                   help="cap the scaled peak lr (large n)")
    p.add_argument("--seeds", type=int, nargs="+", default=[1])
    p.add_argument("--dataset", default="fashion-mnist")
    p.add_argument("--model", default="fmnist_mlp",
                   help="fmnist_mlp, fmnist_lenet, digits_cnn, ...; text_transformer with "
                        "--dataset python-text")
    p.add_argument("--partition", default="contiguous",
                   help="an experiment: the parts MiCRO's contiguous split meets; random (a "
                        "fixed permutation of the flat gradient) or blocks:B (blocks of B "
                        "dealt round-robin) make every part a sample of every layer")
    p.add_argument("--age-power", type=float, default=None,
                   help="an experiment: Adam's second moment takes a burst of age k as its "
                        "square over k ** P (default: the plugin's rule)")
    p.add_argument("--threads", type=int, default=2,
                   help="torch's threads (recorded with each run): the order of the float sums "
                        "follows it, so a run at another count ends elsewhere, by up to half a "
                        "point of accuracy")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--figures", type=Path, default=None)
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    lr, lr_scaling = optimizer_defaults(args.optimizer, args.lr, args.lr_scaling)
    torch.set_num_threads(args.threads)
    runs = []
    previous = json.loads(args.json.read_text())["runs"] if args.json and args.json.exists() \
        else []
    for seed in args.seeds:
        for n in args.workers:
            for method in args.methods:
                # Dense has no parts: its runs are the same under any --partition.
                partition = "contiguous" if method == "dense" else args.partition
                # Records older than the optimizer choice ran the default recipe; the
                # peak lr tells a capped run (--lr-cap) from an uncapped one.
                peak = scaled_lr(lr, BATCH_SIZE, n, lr_scaling, args.lr_cap)
                done = [r for r in previous if math.isclose(r.get("peak_lr", peak), peak)
                        and (r["method"], r["n"], r["seed"], r["density"], r["epochs"],
                             r.get("optimizer", "nesterov"), r.get("lr", 0.1),
                             r.get("lr_scaling", "linear"), r.get("partition", "contiguous"),
                             r.get("model", "fmnist_mlp"), r.get("age_power"),
                             r.get("threads", args.threads))  # older records: not kept
                        == (method, n, seed, args.density, args.epochs, args.optimizer,
                            lr, lr_scaling, partition, args.model, args.age_power,
                            args.threads)]
                if done:
                    run = done[0]
                else:
                    with adam_age_power(args.age_power):
                        run = train(
                            method, n=n, density=args.density, epochs=args.epochs,
                            seed=seed, dataset=args.dataset, model_name=args.model,
                            optimizer=args.optimizer, lr=lr, lr_scaling=lr_scaling,
                            lr_cap=args.lr_cap, partition=partition,
                            report=(lambda _: None) if args.quiet else print)
                    if args.age_power is not None:
                        run["age_power"] = args.age_power
                    run["threads"] = args.threads
                run.pop("weights", None)
                runs.append(run)
                print(f"{method} n={n} seed={seed}: final "
                      f"{format_metric(final_metric(run), run.get('metric', 'accuracy'))}, "
                      f"{run['bytes_per_step'] / 1e3:,.1f} KB/step/rank "
                      f"({run['seconds']:.0f} s)", flush=True)
                if args.json and not done:
                    previous.append(run)
                    args.json.write_text(json.dumps({"runs": previous}, indent=1) + "\n")
    print(table(runs))
    print()
    print(diagnosis_table(runs))
    if args.figures:
        figures(runs, args.figures)


if __name__ == "__main__":
    main()
