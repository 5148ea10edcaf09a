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

* **Newton steps in log-log space.** Near the tail of the magnitude distribution the count
  behaves like ``count(th) ~ C * th**(-alpha)``. With ``alpha`` estimated online from the last
  two (threshold, count) pairs (a secant, clamped to ``[alpha_min, alpha_max]`` and smoothed),
  one step ``log th += log(k_t / k*) / alpha`` lands close to the wanted count ``k*`` even
  from a cold start one or two orders of magnitude away. A step never moves the threshold by
  more than ``max_factor``.
* **A count budget.** Once the count is inside the +-``band`` of ``k`` the controller keeps the
  running sum of ``k - k_t`` and asks for ``k* = k + gain * deficit`` (clamped to
  +-``budget_clamp`` of ``k``) next time. Error feedback makes the distribution of
  ``|a_t|`` widen for hundreds of iterations, a steady drift that a plain proportional
  controller would follow with a constant lag; paying back the deficit removes that bias
  from the running mean.

Every rank feeds the same global counts through the same double-precision operations, so
every rank holds a bit-identical threshold without communicating it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


def initial_threshold(target_count: int) -> float:
    """The hard-threshold heuristic ``1 / (2 sqrt(k))`` (Sahu et al., NeurIPS 2021)."""
    return 1.0 / (2.0 * math.sqrt(target_count))


@dataclass
class DensityController:
    """Threshold controller for a target global count ``target_count`` (``k``).

    Attributes:
        target_count: wanted number of selected coordinates per iteration, ``floor(d N)``.
        threshold: the threshold to use at the next selection.
        alpha: current estimate of ``-d log(count) / d log(threshold)``.
        deficit: running sum of ``k - k_t`` since the count first entered the band.
        settled: whether the count has entered the +-``band`` of ``k`` at least once.
        max_factor: largest multiplicative change of the threshold in one iteration.
        band: relative band around ``k`` that counts as "settled".
        budget_gain: fraction of the deficit asked back per iteration.
        budget_clamp: the wanted count stays within ``k * (1 +- budget_clamp)``.
        alpha_min, alpha_max: clamps of the slope estimate (a too small slope overshoots).
    """

    target_count: int
    threshold: float = 0.0
    alpha: float = 4.0
    deficit: float = 0.0
    settled: bool = False
    last_log_threshold: float | None = None
    last_log_count: float | None = None
    max_factor: float = 4.0
    band: float = 0.1
    budget_gain: float = 0.2
    budget_clamp: float = 0.05
    alpha_min: float = 0.5
    alpha_max: float = 16.0

    def __post_init__(self) -> None:
        if self.target_count < 1:
            raise ValueError(f"target_count must be >= 1, got {self.target_count}")
        if self.threshold <= 0.0:
            self.threshold = initial_threshold(self.target_count)

    def update(self, count: int) -> float:
        """Record the global count selected with the current threshold; return the next one."""
        k = float(self.target_count)
        log_th = math.log(self.threshold)
        # Half an element stands in for an empty selection so the logarithm stays finite.
        log_count = math.log(max(float(count), 0.5))

        if self.last_log_threshold is not None:
            d_th = log_th - self.last_log_threshold
            if abs(d_th) > 1e-3:
                slope = -(log_count - self.last_log_count) / d_th
                if slope > 0.0 and count > 0 and self.last_log_count > math.log(0.5):
                    slope = min(max(slope, self.alpha_min), self.alpha_max)
                    # Geometric smoothing: one noisy pair moves the estimate only halfway.
                    self.alpha = math.sqrt(self.alpha * slope)

        if not self.settled and abs(count - k) <= self.band * k:
            self.settled = True
        wanted = k
        if self.settled:
            self.deficit += k - count
            correction = self.budget_gain * self.deficit
            limit = self.budget_clamp * k
            wanted = k + min(max(correction, -limit), limit)

        step = (log_count - math.log(wanted)) / self.alpha
        max_step = math.log(self.max_factor)
        step = min(max(step, -max_step), max_step)

        self.last_log_threshold = log_th
        self.last_log_count = log_count
        self.threshold = math.exp(log_th + step)
        return self.threshold

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)
