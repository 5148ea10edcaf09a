"""Density control: steer a magnitude threshold so the global selected count tracks ``k``.

MiCRO (Yoon & Oh, HiPC 2023, Sec. III-C) selects ``|a_i| >= threshold`` instead of
sorting, and adjusts the threshold every iteration from the previous global count so that
the "compression ratio error" ``|k - k_t|`` stays small. The reference controller scales
the threshold by fixed factors (at most 0.5 % per iteration); it needs hundreds of
iterations to move the threshold by 10x and, because its band logic only ever raises the
threshold inside the band, it settles near ``0.91 k``.

This controller keeps the same inputs (only the global count, which every rank learns
from the index exchange, so no extra message is needed) and replaces the rule with two
loops:

* **Damped Newton steps in log-log space.** Near the tail of the magnitude distribution the
  count behaves like ``count(th) ~ C * th**(-alpha)``. The slope ``alpha`` is *measured*
  each iteration: the selecting ranks also count how many of their selected entries exceed
  ``probe * th`` (a pass over the k selected values, not over N) and send that number in
  the header of the index exchange, so ``alpha = log(k_t / k_t(probe th)) / log(probe)``.
  A step ``log th += gain * log(k_t / k*) / alpha`` then lands near the wanted count ``k*``
  even from a cold start orders of magnitude away. (A secant between consecutive
  iterations, tried first, oscillated: the count at a fixed threshold is noisy from step
  to step, and gradients' tails are light, ``alpha`` ~ 10 at density 0.001, so an
  underestimate overshoots.) A step never moves the threshold by more than ``max_factor``.
* **A count budget.** Once the count is inside the +-``band`` of ``k`` the controller keeps the
  running sum of ``k - k_t`` and asks for ``k* = k + gain * deficit`` (clamped to
  +-``budget_clamp`` of ``k``) next time. Error feedback makes the distribution of
  ``|a_t|`` widen for hundreds of iterations, a steady drift that a plain proportional
  controller would follow with a constant lag; paying back the deficit removes that bias
  from the running mean.

Every rank feeds the same global counts through the same double-precision operations, so
every rank holds a bit-identical threshold without communicating it.

This module holds the controllers that steer one threshold shared by all ranks: this one
(``controller="newton"``) and the authors' rule as written (``controller="paper"``,
:class:`PaperController`). The scale-free, per-part controllers (``"bounded"``, the
default, and ``"scale"``) are in :mod:`horovod_micro.part_controller`. Every controller
offers the same three calls to :class:`~horovod_micro.compressors.micro.MicroCompressor`:
``select`` (this rank's choice in the part it owns, and the integer it reports in the index
exchange's header), ``observe`` (the update from the gathered counts and reports, the same
on every rank) and ``state_dict``/``load_state_dict``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...selection import ThresholdSelector, initial_threshold
from .controller import check_state

STATE_VERSION = 1
# What the controller learns while it runs; everything else (gains, clamps) is code and
# comes from the class, not from a checkpoint, so a fixed gain reaches resumed runs too.
STATE_FIELDS = ("threshold", "alpha", "excess", "engaged")


@dataclass
class DensityController:
    """Threshold controller for a target global count ``target_count`` (``k``).

    Attributes:
        target_count: wanted number of selected coordinates per iteration, ``floor(d N)``.
        threshold: the threshold to use at the next selection.
        alpha: current estimate of the tail slope ``-d log(count) / d log(threshold)``.
        excess: integral term: running sum of ``k_t / k - 1`` since ``engaged``.
        engaged: whether a count has come within a factor ``windup`` of ``k`` (the
            integral starts then, so a cold start far from ``k`` does not wind it up).
        probe: the slope is measured between ``threshold`` and ``probe * threshold``.
        gain: fraction of the Newton step taken on the current log error once engaged
            (< 1 damps the reservoir effect of error feedback: a lower threshold releases
            residual mass that is then gone for the next iterations).
        cold_gain, cold_max_factor: step fraction and largest factor before the count has
            first come near ``k``. The mandated start ``1/(2 sqrt(k))`` can be orders of
            magnitude off (ResNet-18 at density 0.001: 37 % of the gradient passes it), so
            the controller then takes larger steps, of up to ``cold_max_factor``.
        integral_gain: weight of ``excess`` in the step.
        windup: how close (as a factor) a count must come to ``k`` to engage the integral.
        alpha_smoothing: weight of a new slope measurement in the running estimate.
        max_factor: largest multiplicative change of the threshold in one iteration.
        alpha_min, alpha_max: clamps of the slope estimate.
    """

    target_count: int
    threshold: float = 0.0
    alpha: float = 4.0
    excess: float = 0.0
    engaged: bool = False
    probe: float = 1.25
    gain: float = 0.5
    cold_gain: float = 0.5
    cold_max_factor: float = 32.0
    integral_gain: float = 0.3
    windup: float = 2.0
    alpha_smoothing: float = 0.3
    max_factor: float = 4.0
    alpha_min: float = 0.5
    alpha_max: float = 30.0

    def __post_init__(self) -> None:
        if self.target_count < 1:
            raise ValueError(f"target_count must be >= 1, got {self.target_count}")
        if self.threshold <= 0.0:
            self.threshold = initial_threshold(self.target_count)

    @property
    def probe_threshold(self) -> float:
        """The second threshold at which the selecting ranks also count (for the slope)."""
        return self.threshold * self.probe

    def update(self, count: int, count_above_probe: int | None = None) -> float:
        """Record the global count selected with the current threshold (and, if known, the
        global count at ``probe_threshold``); return the threshold for the next iteration.
        """
        k = float(self.target_count)
        if count_above_probe is not None and count >= 8:
            # Both counts come from the same distribution at the same moment, so their
            # ratio measures the local slope without the iteration-to-iteration noise a
            # secant between iterations would carry.
            measured = math.log(count / max(float(count_above_probe), 0.5)) / math.log(
                self.probe)
            measured = min(max(measured, self.alpha_min), self.alpha_max)
            w = self.alpha_smoothing
            self.alpha = math.exp((1.0 - w) * math.log(self.alpha) + w * math.log(measured))

        # Half an element stands in for an empty selection so the logarithm stays finite.
        error = math.log(max(float(count), 0.5) / k)
        if not self.engaged and abs(error) < math.log(self.windup):
            self.engaged = True
        if self.engaged:
            # Integral on the *count* (not its logarithm), every iteration once engaged:
            # the per-iteration count scatters by tens of percent, and it is the arithmetic
            # mean that must meet the target, so no sample may be left out.
            self.excess += count / k - 1.0
        if self.engaged:
            step = (self.gain * error + self.integral_gain * self.excess) / self.alpha
            max_step = math.log(self.max_factor)
        else:
            step = self.cold_gain * error / self.alpha
            max_step = math.log(self.cold_max_factor)
        step = min(max(step, -max_step), max_step)
        self.threshold = math.exp(math.log(self.threshold) + step)
        return self.threshold

    # ----- the interface MicroCompressor uses (see the module docstring) -----------------
    name = "newton"

    def select(self, acc: torch.Tensor, start: int, end: int, part: int,
               selector: ThresholdSelector, scale: float) -> tuple[torch.Tensor, float, int]:
        """``|a| >= threshold`` in ``acc[start:end]``; reports how many selected entries
        also pass ``probe_threshold`` (the slope probe: a pass over the selected values
        only). Returns (indices, threshold used, report)."""
        del part, scale
        indices = selector(acc[start:end], self.threshold, start, acc.numel())
        above = int((acc.index_select(0, indices).abs() >= self.probe_threshold).sum())
        return indices, self.threshold, above

    def observe(self, counts: list[int], reports: list[int], parts: list[int]) -> None:
        """The update from the gathered per-rank counts and reports (identical everywhere)."""
        del parts
        self.update(sum(counts), sum(reports))

    def rescale(self, ratio: float) -> None:
        self.threshold *= ratio

    def state_dict(self) -> dict:
        return {"version": STATE_VERSION, **{f: getattr(self, f) for f in STATE_FIELDS}}

    def load_state_dict(self, state: dict) -> None:
        """Restore the learned state. Versions 0 and 1 are this controller's (written before
        the ``controller`` option existed); a state that names another controller is
        refused."""
        version = state.get("version", 0)
        check_state(state, self.name, accept_unnamed=True)
        if version > STATE_VERSION:
            raise ValueError(f"density controller state version {version} is newer than this "
                             f"horovod_micro understands ({STATE_VERSION})")
        for f in STATE_FIELDS:
            setattr(self, f, state[f])


@dataclass
class PaperController:
    """The authors' rule as written (notes, MiCRO item 5), for faithful reproduction.

    From the previous global count ``k_{t-1}``: ``ratio = k_{t-1} / k``; ``ratio > 1.1``
    multiplies the threshold by 1.005, ``0.909 < ratio <= 1.1`` by 1.00125, anything
    else by 0.995. Start: ``1 / (2 sqrt(k))``. (Inside the band the threshold only rises,
    so the density drifts to about 0.91 k; steps are at most 0.5 % per iteration.)
    """

    target_count: int
    threshold: float = 0.0
    name = "paper"

    def __post_init__(self) -> None:
        if self.threshold <= 0.0:
            self.threshold = initial_threshold(self.target_count)

    def update(self, count: int) -> float:
        ratio = count / self.target_count
        if ratio > 1.1:
            self.threshold *= 1.005
        elif ratio > 0.909:
            self.threshold *= 1.00125
        else:
            self.threshold *= 0.995
        return self.threshold

    def select(self, acc: torch.Tensor, start: int, end: int, part: int,
               selector: ThresholdSelector, scale: float) -> tuple[torch.Tensor, float, int]:
        del part, scale
        return selector(acc[start:end], self.threshold, start, acc.numel()), self.threshold, 0

    def observe(self, counts: list[int], reports: list[int], parts: list[int]) -> None:
        del reports, parts
        self.update(sum(counts))

    def rescale(self, ratio: float) -> None:
        self.threshold *= ratio

    def state_dict(self) -> dict:
        return {"version": 2, "controller": self.name, "threshold": self.threshold}

    def load_state_dict(self, state: dict) -> None:
        check_state(state, self.name)
        self.threshold = state["threshold"]
