"""Hard threshold: every rank sends the entries with ``|a_t[i]| >= lambda``, lambda fixed.

Sahu, Dutta, Abdelmoniem, Banerjee, Canini, Kalnis, "Rethinking gradient sparsification
as total error minimization", NeurIPS 2021. With error feedback, a fixed threshold
minimises the *total* error over training for a given total communication budget (Top-k
minimises each iteration's error instead); the number of coordinates sent therefore
varies from iteration to iteration. Selection is one pass over ``N`` with no sort (the
same kernel as MiCRO's, :class:`~horovod_micro.selection.ThresholdSelector`), but over the
whole vector on every rank, and the ranks choose independently: the union grows with
``n`` (build-up) exactly as Top-k's does.

``lambda`` is either given (``value``) or derived from a density with the paper's
Top-k-equivalent heuristic ``lambda = 1 / (2 sqrt(k))``, ``k = floor(d N)``.

Exchange and error feedback are Top-k's (:func:`~horovod_micro.compressors.topk.combine_pairs`):
allgather of each rank's (index, value) pairs, per-coordinate sum; a rank zeroes its
residual only at the coordinates it sent itself. Traffic per rank: received
``sum_{s != r} ((k_s + 3) b_i + k_s b_v)`` with ``k_s`` this iteration's count of rank
``s``: O(n k_t).
"""

from __future__ import annotations

import math

import torch

from ..exchange import Traffic
from ..selection import ThresholdSelector, index_bytes, initial_threshold
from .base import Aggregate, Compressor, ReduceOp, Selection, as_float
from .registry import register
from .topk import combine_pairs, gathered_pairs_bytes


@register
class HardThresholdCompressor(Compressor):
    """Hard-threshold sparsification (see the module docstring).

    Args:
        value: the threshold ``lambda`` (> 0). Give either ``value`` or ``density``.
        density: derive ``lambda = 1 / (2 sqrt(floor(d N)))`` when the optimizer binds
            the compressor to the model; also the target reported in the statistics.
        error_feedback: on by default; Sahu et al. also report the method without it.
        fp16_values: see :class:`~horovod_micro.compressors.base.Compressor`.

    Example::

        opt = hvm.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=hvm.Compression.threshold(value=0.01))
    """

    name = "threshold"

    def __init__(self, value: float | None = None, density: float | None = None, *,
                 error_feedback: bool = True, fp16_values: bool = False,
                 momentum_masking: bool | None = None):
        super().__init__(density, error_feedback=error_feedback, fp16_values=fp16_values,
                         momentum_masking=momentum_masking)
        self.value = as_float(value)
        self.lam = self.value
        self.selector = ThresholdSelector()

    def config(self) -> dict:
        return {**super().config(), "value": self.value}

    def config_error(self) -> str | None:
        v = self.value
        if (v is None) == (self.density is None):
            return ("threshold: give exactly one of value (the threshold) or density "
                    f"(threshold 1/(2 sqrt(k))), got value={v!r}, density={self.density!r}")
        if v is not None:
            if (isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v)
                    or v <= 0):
                return f"threshold: value must be a positive finite number, got {v!r}"
            return self.flags_error()
        return super().config_error()

    @property
    def target_count(self) -> int:
        """``floor(d N)`` when set from a density; 0 for a fixed threshold (no target)."""
        return super().target_count if self.density is not None else 0

    def bind(self, numel, comm) -> None:
        super().bind(numel, comm)
        if self.value is None:
            self.lam = initial_threshold(self.target_count)
        self.selector = ThresholdSelector(capacity=2 * max(self.target_count, 1) + 64)

    def threshold(self) -> float:
        return float(self.lam)

    def rescale(self, ratio: float) -> None:
        self.lam = float(self.lam) * ratio

    def modeled_bytes(self, size: int, numel: int) -> float:
        """Top-k's exchange with each rank's count at its target ``floor(d N)`` (only
        defined when the threshold is set from a density: a fixed ``value`` selects
        whatever the gradient holds above it)."""
        if self.density is None:
            raise ValueError("threshold: the byte model needs density=, not a fixed value")
        return gathered_pairs_bytes(size, self.modeled_count(numel), index_bytes(numel),
                                    self.value_bytes())

    def select(self, acc: torch.Tensor, iteration: int) -> Selection:
        lam = float(self.lam)
        return Selection(self.selector(acc, lam, 0, self.numel), threshold=lam)

    def combine(self, acc, selection, gathered, iteration, reduction: ReduceOp,
                traffic: Traffic) -> Aggregate:
        return combine_pairs(self, acc, selection, gathered, reduction, traffic)
