"""MiCRO: partitioned exclusive selection with a steered threshold.

Yoon & Oh, "MiCRO: Near-Zero Cost Gradient Sparsification for Scaling and Accelerating
Distributed DNN Training", HiPC 2023 (arXiv:2310.00967).

Per iteration ``t`` on rank ``r`` of ``n``:

1. ``r`` owns part ``(t + r) mod n`` of the flat error-compensated gradient ``a_t``
   (:mod:`horovod_micro.partition`) and selects ``|a_t[i]| >= threshold`` there only: one
   pass over ``N / n`` elements, no sort.
2. The ranks allgather their indices; parts are disjoint, so the union has exactly
   ``sum_r k_r`` coordinates (no build-up).
3. Each rank takes its *own* ``a_t`` at the union and the ranks allreduce those values:
   every selected coordinate carries the full n-rank sum, chosen by its part's owner.
   Traffic per rank is O(k), independent of ``n``.
4. Every rank zeroes its residual at the union (it sent its value there; with
   ``fp16_values`` it keeps the rounding error, :meth:`Sparsifier.wire_error`).
5. The threshold is steered from the global count
   (:mod:`horovod_micro.density_controller`), which
   every rank knows after step 2, so all thresholds stay identical with no extra message.
"""

from __future__ import annotations

import torch

from ..density_controller import DensityController
from ..exchange import Traffic, allreduce_values
from ..partition import owned_part, part_bounds
from ..selection import ThresholdSelector
from .base import Reduced, Reduction, Selection, Sparsifier
from .registry import register


@register
class MicroCompressor(Sparsifier):
    """MiCRO sparsification (see the module docstring).

    Args:
        density: user-set density ``d``; the controller steers the global count toward
            ``k = floor(d N)``.
        initial_threshold: starting threshold (default ``1 / (2 sqrt(k))``).
        error_feedback, fp16_values: see :class:`~horovod_micro.sparsifiers.base.Sparsifier`.
    """

    name = "micro"

    def __init__(self, density: float = 0.001, *, initial_threshold: float | None = None,
                 error_feedback: bool = True, fp16_values: bool = False):
        super().__init__(density, error_feedback=error_feedback, fp16_values=fp16_values)
        self.initial_threshold = initial_threshold
        self.controller: DensityController | None = None
        self.bounds: list[tuple[int, int]] = []
        self._selector = ThresholdSelector()

    def config(self) -> dict:
        return {**super().config(), "initial_threshold": self.initial_threshold}

    def config_error(self) -> str | None:
        t = self.initial_threshold
        if t is not None and not (isinstance(t, int | float) and t > 0):
            return f"micro: initial_threshold must be a positive number, got {t!r}"
        return super().config_error()

    def bind(self, numel, comm) -> None:
        super().bind(numel, comm)
        self.bounds = part_bounds(numel, comm.size)
        self.controller = DensityController(self.target_count,
                                            threshold=self.initial_threshold or 0.0)
        self._selector = ThresholdSelector(capacity=2 * self.target_count // comm.size + 64)

    def threshold(self) -> float:
        return self.controller.threshold

    def rescale(self, ratio: float) -> None:
        self.controller.threshold *= ratio

    def select(self, acc: torch.Tensor, iteration: int) -> Selection:
        start, end = self.bounds[owned_part(self.comm.rank, iteration, self.comm.size)]
        indices = self._selector(acc[start:end], self.controller.threshold, start, self.numel)
        # The controller's slope probe, sent in the header: how many selected entries also
        # pass a slightly higher threshold (a pass over the k selected values only).
        probe = self.controller.probe_threshold
        above_probe = int((acc.index_select(0, indices).abs() >= probe).sum())
        return Selection(indices, aux=above_probe)

    def combine(self, acc, selection, gathered, iteration, reduction: Reduction,
                traffic: Traffic) -> Reduced:
        # Parts are disjoint: concatenation is already the union, without duplicates.
        union = torch.cat(gathered.per_rank)
        values = self.wire(acc.index_select(0, union))
        values = allreduce_values(self.comm, values, traffic, reduction.op,
                                  reduction.prescale, reduction.postscale)
        return Reduced(union, values.to(acc.dtype), union, gathered,
                       self.controller.threshold)

    def observe(self, reduced: Reduced) -> None:
        self.controller.update(int(reduced.indices.numel()), sum(reduced.gathered.aux))

    def state_dict(self) -> dict:
        return {"controller": self.controller.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.controller.load_state_dict(state["controller"])
