"""Top-k: every rank sends its own k largest entries; (index, value) pairs are allgathered.

The classic baseline (Aji & Heafield 2017; Lin et al., "Deep Gradient Compression",
ICLR 2018; Shi et al. 2019 call it "Top-k S-SGD"). Per iteration ``t`` on each rank:

1. select the ``k = floor(d N)`` largest ``|a_t[i]|`` of the whole flat vector
   (``torch.topk``: a sort-like pass over ``N``, the cost MiCRO avoids);
2. allgather the indices (with the status header of :mod:`horovod_micro.exchange`), then
   allgather the values (the counts are known from step 2, so no header);
3. sum the values per coordinate over ranks. The ranks choose independently, so the union
   holds between ``k`` and ``n k`` coordinates: the actual global density grows up to
   ``n d`` ("gradient build-up"), which :class:`~horovod_micro.stats.StepStats` shows.

Error feedback: a rank's value reaches the aggregate only at the coordinates *it* sent;
at coordinates only other ranks picked, its value is not transmitted. So each rank zeroes
its residual at its own selection, not at the union (unlike MiCRO, CLT-k and Random-k,
where every rank sends its value at every selected coordinate).

Traffic per rank (ring allgather, ``b_i`` bytes per index, ``b_v`` per value,
``k_r`` selected by rank ``r``): received ``sum_{s != r} ((k_s + 3) b_i + k_s b_v)``,
about ``(n - 1) k (b_i + b_v)``: O(k n).
"""

from __future__ import annotations

import torch

from ..exchange import Gathered, Traffic, allgather_values
from ..selection import index_bytes, index_dtype
from ..stats import ring_allgather_bytes
from .base import Aggregate, Compressor, ReduceOp, Selection
from .registry import register


def topk_indices(acc: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest ``|acc|`` (as ``index_dtype``, ascending)."""
    k = min(k, acc.numel())
    picked = torch.topk(acc.abs(), k, sorted=False).indices
    return picked.sort().values.to(index_dtype(acc.numel()))


def combine_pairs(compressor: Compressor, acc: torch.Tensor, selection: Selection,
                  gathered: Gathered, reduction: ReduceOp, traffic: Traffic) -> Aggregate:
    """Allgather every rank's values at its announced indices; sum them per coordinate.

    Shared by Top-k and hard-threshold: both let each rank choose its own coordinates.
    ``contributed`` is this rank's own selection (see the module docstring). Every rank
    receives the same values in the same order, so every rank's sum is bit-identical.
    The aggregate carries the selection's threshold (hard-threshold's; None for Top-k).
    """
    comm, threshold = compressor.comm, selection.threshold
    own = selection.indices.long()
    all_indices = torch.cat(gathered.per_rank).long()
    if all_indices.numel() == 0:  # nobody selected anything: every rank knows, skip values
        empty = torch.empty(0, dtype=acc.dtype, device=acc.device)
        return Aggregate(all_indices, empty, own, gathered, threshold)
    values = allgather_values(comm, compressor.wire(acc[own]), gathered.counts, traffic)
    union, inverse = torch.unique(all_indices, return_inverse=True)
    summed = torch.zeros(union.numel(), dtype=acc.dtype, device=acc.device)
    summed.index_add_(0, inverse, values.to(acc.dtype))
    return Aggregate(union, reduction.finish_sum(summed, comm.size), own, gathered, threshold)


def gathered_pairs_bytes(size: int, count: int, index_bytes: int, value_bytes: int) -> int:
    """Bytes a rank sends when every rank allgathers its ``count`` (index, value) pairs
    behind the 3-word status header (Top-k's and the hard threshold's exchange)."""
    indices = ring_allgather_bytes([index_bytes * (count + 3)] * size, 0)[0]
    values = ring_allgather_bytes([value_bytes * count] * size, 0)[0]
    return indices + values


@register
class TopkCompressor(Compressor):
    """Top-k sparsification (see the module docstring).

    Args:
        density: user-set density ``d``; each rank sends ``k = floor(d N)`` coordinates
            (the global density can reach ``n d``).
        error_feedback, fp16_values: see :class:`~horovod_micro.compressors.base.Compressor`.

    Example::

        opt = hvm.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=hvm.Compression.topk(density=0.001))
    """

    name = "topk"

    def __init__(self, density: float = 0.001, *, error_feedback: bool = True,
                 fp16_values: bool = False, momentum_masking: bool | None = None):
        super().__init__(density, error_feedback=error_feedback, fp16_values=fp16_values,
                         momentum_masking=momentum_masking)

    def modeled_bytes(self, size: int, numel: int) -> float:
        """Two allgathers: the status header and ``k`` indices per rank, then the ``k``
        values per rank: ``(n - 1) (b_i (k + 3) + b_v k)``, O(k n)."""
        return gathered_pairs_bytes(size, self.modeled_count(numel), index_bytes(numel),
                                    self.value_bytes())

    def select(self, acc: torch.Tensor, iteration: int) -> Selection:
        return Selection(topk_indices(acc, self.target_count))

    def combine(self, acc, selection, gathered, iteration, reduction: ReduceOp,
                traffic: Traffic) -> Aggregate:
        return combine_pairs(self, acc, selection, gathered, reduction, traffic)
