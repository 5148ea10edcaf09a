"""A watch on MiCRO's capacity cut: the density sent, against the density selected.

With fixed index slots (``capacity``) a selection larger than the slots sends the highest
scores and keeps the rest in the residual. The density controller learns from what the
threshold picked, so it steers the selection to the target; but where the slots are too
few for the target every step, the density *sent* stays below it, and only the statistics
(``StepStats.rank_counts`` against ``selected_counts``) would show it. This watch warns
once, on the set's first rank, after :data:`STEPS` consecutive exchanges in which the cut
kept back more than a tenth of what the ranks selected.
"""

from __future__ import annotations

import warnings

#: Consecutive exchanges of heavy cuts before the warning.
STEPS = 10
#: A heavy cut: the ranks sent less than this share of what they selected.
SENT_SHARE = 0.9


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
