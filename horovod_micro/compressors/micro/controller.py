"""What MiCRO asks of a density controller, and the check every controller's state passes.

MiCRO keeps its threshold policy behind one interface so that the compressor's step reads
the same whichever ``controller=`` the user picked: the per-part controllers
(:mod:`.part_controller`, the default) and the shared-threshold ones
(:mod:`.density_controller`). A new controller implements :class:`ThresholdController` and
is added to :data:`~.compressor.CONTROLLERS`.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ...selection import ThresholdSelector


class ThresholdController(Protocol):
    """A threshold policy: choose this rank's coordinates in its part, learn from the
    gathered counts, and keep what it learned across checkpoints.

    Every rank holds an identical controller and feeds it identical, gathered numbers, so
    thresholds stay equal on every rank without a message of their own."""

    #: The ``controller=`` value that builds it; written into its state.
    name: str

    def select(self, acc: torch.Tensor, start: int, end: int, part: int,
               selector: ThresholdSelector, scale: float) -> tuple[torch.Tensor, float, int]:
        """Indices of the chosen entries of ``acc[start:end]`` (part ``part``, global
        offsets), the threshold used, and an integer report that travels in the status
        header (what :meth:`observe` needs from every rank beside the counts)."""

    def observe(self, counts: list[int], reports: list[int], parts: list[int]) -> None:
        """Update from every rank's count, report and part (the same lists on every rank)."""

    def rescale(self, ratio: float) -> None:
        """The gradient's scale changed by ``ratio`` (e.g. a loss scaler's step)."""

    def state_dict(self) -> dict:
        """What it learned, with ``"controller"`` naming it."""

    def load_state_dict(self, state: dict) -> None:
        """Resume; a state written by another controller is refused (:func:`check_state`)."""


def check_state(state: dict, name: str, accept_unnamed: bool = False) -> None:
    """Refuse a controller state written by another controller, saying what to do."""
    saved = state.get("controller")
    if saved is None and accept_unnamed:
        return
    if saved != name:
        saved = saved or "newton"  # unnamed states predate the option: all were newton's
        raise ValueError(
            f"this density controller state was written by controller={saved!r}, but this "
            f"optimizer uses controller={name!r}; pass "
            f"hvm.Compression.micro(..., controller={saved!r}) to resume it")
