"""MiCRO's index slots: how many per rank, the bytes they cost, and a watch on the cut.

Fixed slots keep the collectives in one shape (:func:`slots_for`, :func:`slot_bytes`).
With fixed index slots (``capacity``) a selection larger than the slots sends the highest
scores and keeps the rest in the residual. The density controller learns from what the
threshold picked, so it steers the selection to the target; but where the slots are too
few for the target every step, the density *sent* stays below it, and only the statistics
(``StepStats.rank_counts`` against ``selected_counts``) would show it. This watch warns
once, on the set's first rank, after :data:`STEPS` consecutive exchanges in which the cut
kept back more than a tenth of what the ranks selected.
"""

from __future__ import annotations

import math
import warnings

from ...stats import ring_allgather_bytes, ring_allreduce_bytes

#: The default capacity per rank, as a multiple of a part's share of ``k``: the bounded
#: controller holds each owner's count within about 10 % of its part's target, so 1.2
#: leaves room and keeps the bytes within 1.2x those of exact sizes.
CAPACITY_FACTOR = 1.2

#: Consecutive exchanges of heavy cuts before the warning.
STEPS = 10
#: A heavy cut: the ranks sent less than this share of what they selected.
SENT_SHARE = 0.9


def slots_for(capacity, controller: str, size: int, k: int, largest: int) -> int | None:
    """Index slots per rank for ``size`` ranks and ``k`` wanted (MiCRO's ``capacity``: an
    integer, ``"exact"``, or None for ``ceil(CAPACITY_FACTOR k / n)`` with the bounded
    controller), at most a part of ``largest`` elements; None: exact sizes."""
    if isinstance(capacity, int):
        return min(capacity, largest)
    if capacity == "exact" or controller != "bounded":
        return None
    share = max(k / size, 1.0)  # the parts' targets are at least 1
    return min(math.ceil(CAPACITY_FACTOR * share), largest)


def slot_bytes(size: int, k: int, index_bytes: int, value_bytes: int, slots: int | None
               ) -> float:
    """Bytes a rank sends per step. With slots (``C`` per rank): the allgather of every
    rank's block of a 4-word header and ``C`` indices, then one allreduce of the ``n C``
    slot values: ``b_i (n - 1) (C + 4) + 2 (n - 1) C b_v``, about ``12 * 1.2 k`` at 4-byte
    words, independent of ``n``. With exact sizes (``slots`` None) each rank's block holds
    ``k / n`` indices behind a 3-word header, and the union of ``k`` values is allreduced."""
    if slots is None:
        gather = (size - 1) / size * index_bytes * (k + 3 * size)
        return gather + ring_allreduce_bytes(value_bytes * k, size)[0]
    gather = ring_allgather_bytes([index_bytes * (slots + 4)] * size, 0)[0]
    return gather + ring_allreduce_bytes(value_bytes * size * slots, size)[0]


class CutWatch:
    """Counts consecutive exchanges whose capacity cut kept back over 10 % of the
    selection, and warns once when they reach :data:`STEPS`."""

    def __init__(self):
        self.run = 0
        self.warned = False

    def observe(self, gathered, first: bool, slots: int | None) -> None:
        """``gathered``: the exchange's :class:`~horovod_micro.exchange.Gathered`;
        ``first``: whether this is the set's first rank (which warns)."""
        selected, sent = sum(gathered.counts), sum(gathered.sent_counts)
        self.run = self.run + 1 if sent < SENT_SHARE * selected else 0
        if self.run >= STEPS and not self.warned:
            self.warned = True
            if first:
                warnings.warn(
                    f"horovod_micro: micro's capacity ({slots} index slots per rank) cut "
                    f"the selection in each of the last {STEPS} exchanges, sending "
                    f"{sent} of {selected} selected coordinates: the density sent stays "
                    "below the target. Raise capacity (or leave it at its default), or "
                    "compare StepStats.rank_counts with selected_counts", stacklevel=2)
