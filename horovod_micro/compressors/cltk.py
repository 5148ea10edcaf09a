"""CLT-k, cyclic local top-k: one leader per iteration chooses the coordinates for all.

Chen, Ko, Chuang, Lai, "ScaleCom: Scalable Sparsified Gradient Compression for
Communication-Efficient Distributed Training", NeurIPS 2020. At iteration ``t`` the
leader, rank ``t mod n`` (of the optimizer's process set), selects the ``k`` largest
``|a_t[i]|`` of its own error-compensated gradient; every rank then sends its own value
at those ``k`` coordinates and the values are summed by one allreduce. The rotation
lets every rank's view decide once per ``n`` iterations; with error feedback the ranks'
residuals stay similar (ScaleCom's argument), so one rank's top-k is a good proxy for the
global one. There is no build-up (exactly ``k`` coordinates) and only the leader sorts.

Exchange: the status allgather of :mod:`horovod_micro.exchange` doubles as the
broadcast of the leader's indices (the leader's block holds them, the others send only
the 3-int header), then one allreduce of ``k`` values. Every rank's value goes into the
aggregate at every chosen coordinate, so every rank zeroes its residual there.

Traffic per rank (ring model, ``b_i``/``b_v`` bytes per index/value): index allgather
about ``(k + 3 n) b_i`` (``k b_i`` once around the ring), value allreduce
``2 (n - 1) / n * k b_v`` sent and received: O(k), independent of ``n``.
"""

from __future__ import annotations

import torch

from ..exchange import Traffic, allreduce_values
from ..selection import index_bytes, index_dtype
from ..stats import ring_allgather_bytes, ring_allreduce_bytes
from .base import Aggregate, Compressor, ReduceOp, Selection
from .registry import register
from .topk import topk_indices


@register
class CltkCompressor(Compressor):
    """Cyclic local top-k (see the module docstring).

    Args:
        density: user-set density ``d``; the leader picks ``k = floor(d N)`` coordinates,
            which is also the global count.
        error_feedback, fp16_values: see :class:`~horovod_micro.compressors.base.Compressor`.

    Example::

        opt = hvm.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=hvm.Compression.cltk(density=0.001))
    """

    name = "cltk"

    def __init__(self, density: float = 0.001, *, error_feedback: bool = True,
                 fp16_values: bool = False, momentum_masking: bool | None = None):
        super().__init__(density, error_feedback=error_feedback, fp16_values=fp16_values,
                         momentum_masking=momentum_masking)

    def leader(self, iteration: int) -> int:
        """The rank (in the optimizer's process set) that selects at ``iteration``."""
        return iteration % self.comm.size

    def modeled_bytes(self, size: int, numel: int) -> float:
        """The status allgather with the leader's ``k`` indices in its block (the busiest
        sender forwards every block but a header-only one), then an allreduce of ``k``
        values: ``b_i (k + 3 (n - 1)) + 2 (n - 1) / n * k b_v``."""
        k, b_i = self.modeled_count(numel), index_bytes(numel)
        blocks = [b_i * (k + 3)] + [3 * b_i] * (size - 1)
        gather = max(ring_allgather_bytes(blocks, r)[0] for r in range(size))
        return gather + ring_allreduce_bytes(self.value_bytes() * k, size)[0]

    def select(self, acc: torch.Tensor, iteration: int) -> Selection:
        if self.comm.rank != self.leader(iteration):
            return Selection(torch.empty(0, dtype=index_dtype(self.numel), device=acc.device))
        return Selection(topk_indices(acc, self.target_count))

    def combine(self, acc, selection, gathered, iteration, reduction: ReduceOp,
                traffic: Traffic) -> Aggregate:
        chosen = gathered.per_rank[self.leader(iteration)].long()
        values = allreduce_values(self.comm, self.wire(acc[chosen]), traffic, reduction.op,
                                  reduction.prescale, reduction.postscale)
        return Aggregate(chosen, values.to(acc.dtype), chosen, gathered)
