"""A sparse method that lives outside horovod_micro: the registry's test fixture.

Cyclic block: at iteration ``t`` every rank sends its values at the ``k`` coordinates
``(t k + j) mod N``, ``j < k``, and one allreduce sums them (Random-k's exchange with a
deterministic, contiguous choice). Registered by importing this module, which
``HOROVOD_MICRO_PLUGINS=plugin_compressor`` makes every process do; nothing else in the
repository names it (tests/test_registry.py checks that it still runs through the
optimizer, the train CLI's parser and the job matrix).
"""

from __future__ import annotations

import torch

from horovod_micro.compressors import (
    Aggregate,
    Compressor,
    SelectedCounts,
    Selection,
    allreduce_values,
    index_dtype,
    register,
    ring_allreduce_bytes,
)


def block(numel: int, k: int, iteration: int) -> torch.Tensor:
    """The coordinates of ``iteration`` (int64, in order of the block)."""
    return (torch.arange(k) + iteration * k) % numel


@register
class CyclicBlockCompressor(Compressor):
    """Every rank's values at a block of ``k = floor(density N)`` coordinates that moves
    by ``k`` each iteration."""

    name = "cyclicblock"

    def select(self, acc: torch.Tensor, iteration: int) -> Selection:
        chosen = block(self.numel, self.target_count, iteration)
        # Every rank knows the block: only the header is gathered.
        return Selection(chosen.to(device=acc.device, dtype=index_dtype(self.numel)),
                         announced=False)

    def combine(self, acc, selection, gathered, iteration, reduction, traffic) -> Aggregate:
        chosen = selection.indices.long()
        values = allreduce_values(self.comm, self.wire(acc.index_select(0, chosen)), traffic,
                                  reduction.op, reduction.prescale, reduction.postscale)
        counts = SelectedCounts(gathered.per_rank, gathered.statuses, gathered.reports,
                                selected=[chosen.numel()] * self.comm.size)
        return Aggregate(chosen, values.to(acc.dtype), chosen, counts)

    def modeled_bytes(self, size: int, numel: int) -> float:
        # The 3-word header gathered, then one allreduce of k values (as Random-k).
        header = self.modeled_header_bytes(size, numel)
        values = self.value_bytes() * self.modeled_count(numel)
        return header + ring_allreduce_bytes(values, size)[0]
