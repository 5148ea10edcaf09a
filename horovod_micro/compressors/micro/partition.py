"""Exclusive, rotating ownership of the flat gradient (MiCRO, Yoon & Oh, HiPC 2023, Sec. III).

The flat gradient ``[0, N)`` is cut into ``n`` contiguous parts whose sizes differ by
at most one element. At iteration ``t`` rank ``r`` owns part ``(t + r) mod n``: every
part has exactly one owner per iteration, so the ranks' selections are disjoint and
their union can never hold more than the sum of the per-rank counts (no "gradient
build-up"). Rotation gives every rank every part once per ``n`` iterations, so no
coordinate is permanently judged by one rank's local view.
"""

from __future__ import annotations


def part_bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ``[start, end)`` ranges covering ``[0, numel)``.

    The first ``numel % parts`` ranges are one element longer than the rest.
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    base, extra = divmod(numel, parts)
    bounds = []
    start = 0
    for p in range(parts):
        end = start + base + (1 if p < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def owned_part(rank: int, iteration: int, parts: int) -> int:
    """Index of the part that ``rank`` owns at ``iteration``."""
    return (iteration + rank) % parts
