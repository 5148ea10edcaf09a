"""gTop-k: global top-k by a tree merge of the ranks' top-k sets, then a tree broadcast.

Shi, Wang, Chu, Li, "A Distributed Synchronous SGD Algorithm with Global Top-k
Sparsification for Low Bandwidth Networks", ICDCS 2019. Each rank selects its local
top-k of ``a_t``; instead of gathering all ``n k`` pairs (Top-k), sets are merged
pairwise along a binomial tree, each merge summing coincident coordinates and keeping
only the ``k`` largest sums, so no message ever holds more than ``k`` pairs:

* up, level ``l = 0 .. L-1`` (``L = ceil(log2 n)``): rank ``r`` with ``r mod 2^(l+1) ==
  2^l`` sends its set to ``r - 2^l`` and leaves; rank ``r`` with ``r mod 2^(l+1) == 0``
  merges the set from ``r + 2^l``, or keeps its own when that rank does not exist (this
  is how ``n`` that is not a power of two is handled: a binomial tree, no padding ranks);
* down, ``l = L-1 .. 0``: the same pairs in reverse carry rank 0's final set (``<= k``
  coordinates with their summed values) to everyone.

Horovod has no send/recv. Each round is one ``hvd.alltoall`` whose ``splits`` are zero
except toward that round's partner (Gloo's and MPI's alltoallv then move only those
bytes); every rank of the set joins every round, possibly with nothing to send.

Error feedback, exactly: a rank's value at coordinate ``i`` reaches the result only if
``i`` survived every merge on the rank's path to the root; a coordinate dropped in one
subtree can re-enter from another, and then the dropped ranks' values are *not* in the
aggregate. So the down messages also carry, as one bit per final coordinate, which final
coordinates still hold the parent-side values (``A_parent``); a rank computes
``A = A_parent & (coordinate was in my set at that level)`` for its levels and zeroes its
residual only there (``contributed``). Shi et al.'s residual rule (zero at local top-k ∩
global top-k) differs only in that re-entry case, where it would discard the value.

Traffic per rank (``b_i``/``b_v`` bytes per index/value, ``c <= k`` pairs per message,
8-byte count header per message): up, a non-root sends one set ``c (b_i + b_v) + 8`` and
each parent receives one per child; down, each non-root receives ``c (b_i + b_v) +
ceil(c / 8) + 8`` once and each parent sends that per child. Rank 0, the busiest, sends
and receives about ``ceil(log2 n) * k (b_i + b_v)``: O(k log n), against Top-k's O(k n).
On top: the status header allgather (``12 (n - 1)`` bytes received) and Horovod's split
exchange of each of the ``2 ceil(log2 n)`` alltoalls (``4 (n - 1)`` bytes each way).
Latency: ``2 ceil(log2 n)`` sequential rounds.
"""

from __future__ import annotations

import torch

from ..exchange import SelectedCounts, Traffic, alltoall_tensor
from ..selection import index_bytes, index_dtype
from .base import Aggregate, Compressor, ReduceOp, Selection
from .registry import register
from .topk import topk_indices


def merge_top(idx_a: torch.Tensor, val_a: torch.Tensor, idx_b: torch.Tensor,
              val_b: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum two sparse sets per coordinate and keep the ``k`` largest ``|sum|`` (ascending
    int64 indices)."""
    union, inverse = torch.unique(torch.cat([idx_a, idx_b]), return_inverse=True)
    summed = torch.zeros(union.numel(), dtype=val_a.dtype, device=val_a.device)
    summed.index_add_(0, inverse, torch.cat([val_a, val_b]))
    if union.numel() > k:
        keep = torch.topk(summed.abs(), k, sorted=False).indices.sort().values
        union, summed = union[keep], summed[keep]
    return union, summed


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _take(buf: torch.Tensor, start: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    size = torch.empty(0, dtype=dtype).element_size()
    return buf[start:start + count * size].clone().view(dtype), start + count * size


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    padded = torch.zeros((mask.numel() + 7) // 8 * 8, dtype=torch.uint8, device=mask.device)
    padded[:mask.numel()] = mask.to(torch.uint8)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8,
                           device=mask.device)
    return (padded.view(-1, 8) * weights).sum(1, dtype=torch.uint8)


def _unpack_bits(packed: torch.Tensor, count: int) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.view(-1, 1) >> shifts) & 1).view(-1)[:count].bool()


@register
class GtopkCompressor(Compressor):
    """gTop-k sparsification (see the module docstring).

    Args:
        density: user-set density ``d``; every rank selects ``k = floor(d N)`` locally
            and the result holds at most ``k`` coordinates (no build-up).
        error_feedback, fp16_values: see :class:`~horovod_micro.compressors.base.Compressor`.
            With ``fp16_values`` every message carries float16 values (merges sum in the
            residual's precision); the final values are rounded to float16 on rank 0 as
            well, so every rank applies the same gradient.

    Example::

        opt = hvm.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=hvm.Compression.gtopk(density=0.001))
    """

    name = "gtopk"

    def __init__(self, density: float = 0.001, *, error_feedback: bool = True,
                 fp16_values: bool = False, momentum_masking: bool | None = None):
        super().__init__(density, error_feedback=error_feedback, fp16_values=fp16_values,
                         momentum_masking=momentum_masking)

    def modeled_bytes(self, size: int, numel: int) -> float:
        """Rank 0, the busiest sender: the 3-word status header gathered, one down message
        per level (``8 + k (b_i + b_v) + ceil(k / 8)`` bytes, the final set of ``k``
        pairs with its mask bits) and Horovod's split exchange of every alltoall
        (``4 (n - 1)`` bytes each, ``2 ceil(log2 n)`` of them): O(k log n)."""
        if size < 2:
            return 0
        k, b_i, levels = self.modeled_count(numel), index_bytes(numel), (size - 1).bit_length()
        header = self.modeled_header_bytes(size, numel)
        down = 8 + k * (b_i + self.value_bytes()) + (k + 7) // 8
        return header + levels * down + 2 * levels * 4 * (size - 1)

    def select(self, acc: torch.Tensor, iteration: int) -> Selection:
        # Only the count is announced; the pairs travel up and down the tree in combine.
        indices = topk_indices(acc, self.target_count)
        return Selection(indices, announced=False)

    # ----- messages: [count int64][indices][values][mask bits] as one uint8 tensor -------
    def _pack(self, idx, val, mask=None) -> torch.Tensor:
        parts = [_bytes(torch.tensor([idx.numel()], dtype=torch.int64, device=idx.device)),
                 _bytes(idx.to(index_dtype(self.numel))), _bytes(self.wire(val))]
        if mask is not None:
            parts.append(_pack_bits(mask))
        return torch.cat(parts)

    def _unpack(self, buf, dtype, with_mask=False):
        count = int(buf[:8].clone().view(torch.int64)[0])
        idx, pos = _take(buf, 8, count, index_dtype(self.numel))
        val, pos = _take(buf, pos, count, torch.float16 if self.fp16_values else dtype)
        mask = _unpack_bits(buf[pos:], count) if with_mask else None
        return idx.long(), val.to(dtype), mask

    # ----- the exchange ------------------------------------------------------------------
    def combine(self, acc, selection, gathered, iteration, reduction: ReduceOp,
                traffic: Traffic) -> Aggregate:
        comm, k = self.comm, self.target_count
        n, r = comm.size, comm.rank
        indices = selection.indices
        empty = torch.empty(0, dtype=torch.uint8, device=acc.device)
        levels = (n - 1).bit_length()  # ceil(log2 n)

        cur_idx = indices.long()
        cur_val = acc[cur_idx]
        path = [cur_idx]  # path[l]: this rank's set entering level l (while it is active)
        for level in range(levels):
            step = 1 << level
            payload, splits = empty, [0] * n
            if r % (2 * step) == step:  # hand the set to the parent and leave
                payload = self._pack(cur_idx, cur_val)
                splits[r - step] = payload.numel()
            received, _ = alltoall_tensor(comm, payload, splits, traffic,
                                          role=f"gtopk-up{level}")
            if r % (2 * step) == 0:
                if r + step < n:
                    idx, val, _ = self._unpack(received, acc.dtype)
                    cur_idx, cur_val = merge_top(cur_idx, cur_val, idx, val, k)
                path.append(cur_idx)

        final_idx = final_val = alive = None
        if r == 0:  # the root: its set is the result; all of it reaches the result
            final_idx, final_val = cur_idx, self.wire(cur_val).to(acc.dtype)
            alive = torch.ones(final_idx.numel(), dtype=torch.bool, device=acc.device)
        for level in reversed(range(levels)):
            step = 1 << level
            payload, splits = empty, [0] * n
            if r % (2 * step) == 0 and r + step < n:
                payload = self._pack(final_idx, final_val, alive)  # alive = A(r, level + 1)
                splits[r + step] = payload.numel()
            received, _ = alltoall_tensor(comm, payload, splits, traffic,
                                          role=f"gtopk-down{level}")
            if r % (2 * step) == step:
                final_idx, final_val, alive = self._unpack(received, acc.dtype, True)
            if r % step == 0:  # active at this level: A(r, level) from A(r, level + 1)
                alive = alive & torch.isin(final_idx, path[level])

        # Every rank selects its top k (the same k everywhere).
        counts = SelectedCounts(gathered.per_rank, gathered.statuses, gathered.reports,
                                selected=[indices.numel()] * n)
        values = reduction.finish_sum(final_val.clone(), n)
        return Aggregate(final_idx, values, final_idx[alive], counts)
