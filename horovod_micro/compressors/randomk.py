"""Random-k: k coordinates drawn from a seed every rank shares; one allreduce of values.

Stich, Cordonnier, Jaggi, "Sparsified SGD with Memory", NeurIPS 2018 (rand-k with error
feedback); Wangni et al., NeurIPS 2018. Every rank derives the same generator seed from
``(seed, iteration)`` and draws the same ``k = floor(d N)`` distinct coordinates, so no
index travels: each rank sends its own values there and one allreduce sums them. No sort,
no scan of ``N``, no build-up; the price is that the coordinates ignore magnitudes, so
much more of the gradient stays in the residual than with Top-k or MiCRO.

Index generation costs O(k), not O(N): draw ``k`` (plus an expected-duplicates margin)
uniform integers, deduplicate, repeat until ``k`` distinct, then keep a uniformly random
``k`` of them. The procedure treats all coordinates alike, so every ``k``-subset is
equally likely. Above ``d = 0.5`` a permutation of ``N`` is as cheap and is used instead.

The status allgather carries only the 3-int header, with a checksum of the drawn indices
in ``report``: if the ranks ever disagree (different iteration counters, e.g. after loading
different checkpoints), every rank raises instead of summing unrelated coordinates.
Every rank's value goes into the aggregate at every drawn coordinate, so every rank zeroes
its residual there.

Traffic per rank (ring model): header allgather ``12 (n - 1)`` bytes received, value
allreduce ``2 (n - 1) / n * k b_v`` sent and received: O(k).
"""

from __future__ import annotations

import torch

from ..exchange import SelectedCounts, Traffic, allreduce_values
from ..selection import index_dtype
from ..stats import ring_allreduce_bytes
from ..status import CollectiveInputError
from .base import Aggregate, Compressor, ReduceOp, Selection, as_int
from .registry import register

_MIX_SEED = 0x9E3779B97F4A7C15
_MIX_ITERATION = 0xBF58476D1CE4E5B9


def shared_indices(numel: int, k: int, seed: int, iteration: int) -> torch.Tensor:
    """The ``k`` distinct coordinates (int64, ascending, CPU) of ``iteration``: identical
    on every rank for the same arguments."""
    gen = torch.Generator().manual_seed((seed * _MIX_SEED + (iteration + 1) * _MIX_ITERATION)
                                        % 2**63)
    k = min(k, numel)
    if 2 * k > numel:
        return torch.randperm(numel, generator=gen)[:k].sort().values
    margin = k * k // numel + 16  # expected duplicates among k draws: about k^2 / (2N)
    chosen = torch.empty(0, dtype=torch.int64)
    while chosen.numel() < k:
        draw = torch.randint(numel, (k - chosen.numel() + margin,), generator=gen)
        chosen = torch.unique(torch.cat([chosen, draw]))
    if chosen.numel() > k:
        chosen = chosen[torch.randperm(chosen.numel(), generator=gen)[:k]].sort().values
    return chosen


def _checksum(indices: torch.Tensor) -> int:
    return int(indices.sum()) % (2**31 - 1)


@register
class RandomkCompressor(Compressor):
    """Random-k with a shared seed (see the module docstring).

    Args:
        density: user-set density ``d``; exactly ``k = floor(d N)`` coordinates per
            iteration.
        seed: base of the shared seed (must be equal on every rank, which the optimizer
            checks at start-up); different seeds give different coordinate sequences.
        error_feedback, fp16_values: see :class:`~horovod_micro.compressors.base.Compressor`.

    Example::

        opt = hvm.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=hvm.Compression.randomk(density=0.001, seed=7))
    """

    name = "randomk"

    def __init__(self, density: float = 0.001, *, seed: int = 0, error_feedback: bool = True,
                 fp16_values: bool = False, momentum_masking: bool | None = None):
        super().__init__(density, error_feedback=error_feedback, fp16_values=fp16_values,
                         momentum_masking=momentum_masking)
        self.seed = as_int(seed)

    def config(self) -> dict:
        return {**super().config(), "seed": self.seed}

    def config_error(self) -> str | None:
        s = self.seed
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            return f"randomk: seed must be a non-negative integer, got {s!r}"
        return super().config_error()

    def modeled_bytes(self, size: int, numel: int) -> float:
        """The 3-word status header gathered, then an allreduce of ``k`` values (no index
        travels): ``3 b_i (n - 1) + 2 (n - 1) / n * k b_v``."""
        header = self.modeled_header_bytes(size, numel)
        values = self.value_bytes() * self.modeled_count(numel)
        return header + ring_allreduce_bytes(values, size)[0]

    def select(self, acc: torch.Tensor, iteration: int) -> Selection:
        chosen = shared_indices(self.numel, self.target_count, self.seed, iteration)
        return Selection(chosen.to(device=acc.device, dtype=index_dtype(self.numel)),
                         announced=False, report=_checksum(chosen))

    def combine(self, acc, selection, gathered, iteration, reduction: ReduceOp,
                traffic: Traffic) -> Aggregate:
        if len(set(gathered.reports)) > 1:
            raise CollectiveInputError(
                f"randomk: the ranks drew different coordinates at iteration {iteration} "
                f"(checksums {gathered.reports}); their iteration counters or seeds differ")
        chosen = selection.indices.long()
        values = allreduce_values(self.comm, self.wire(acc[chosen]), traffic, reduction.op,
                                  reduction.prescale, reduction.postscale)
        counts = SelectedCounts(gathered.per_rank, gathered.statuses, gathered.reports,
                                selected=[chosen.numel()] * self.comm.size)
        return Aggregate(chosen, values.to(acc.dtype), chosen, counts)
