"""MiCRO's drift judge: ages of the residual's coordinates in 16-bit stamps, and the
selector that ranks a coordinate by ``|a_i| * sqrt(wait / age_i)``.

Kept apart from the shared threshold selection (:mod:`horovod_micro.selection`) because
only MiCRO judges this way; the native kernel (``_native/select.c``) serves both.
"""

from __future__ import annotations

import ctypes

import torch

from ...native import native_library
from ...selection import ThresholdSelector, index_dtype

#: The drift judge's ages live in 16-bit stamps (mod 2^16): 2 bytes per coordinate beside
#: its 4-byte value. MiCRO caps true ages at AGE_CAP and re-caps them every AGE_RECAP
#: iterations, so no age reaches 2^16 and the difference of stamps is the age.
AGE_CAP = 1 << 15
AGE_RECAP = 1 << 14


def _load_drift():
    """``hvm_select_drift16_values`` from the built kernel, or None."""
    lib = native_library()
    if lib is None or not hasattr(lib, "hvm_select_drift16_values"):
        return None
    fn = lib.hvm_select_drift16_values
    fn.restype = ctypes.c_int64
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_float,
                   ctypes.c_int64, ctypes.c_float, ctypes.c_int64, ctypes.c_void_p,
                   ctypes.c_void_p, ctypes.c_int64]
    return fn


_native_drift = _load_drift()


def stamp(iteration: int) -> int:
    """The 16-bit stamp of ``iteration`` (``iteration mod 2^16`` as an int16 value)."""
    low = iteration & 0xFFFF
    return low - 0x10000 if low >= 0x8000 else low


def stamps(iterations: torch.Tensor) -> torch.Tensor:
    """:func:`stamp` of every entry, as an int16 tensor (any integer dtype in; a stamp
    tensor comes back unchanged)."""
    low = iterations.to(torch.int32) & 0xFFFF
    return (low - ((low & 0x8000) << 1)).to(torch.int16)


def ages(last: torch.Tensor, now: int) -> torch.Tensor:
    """``now - last`` from 16-bit stamps (int32): the true age while it is below 2^16."""
    return (now - last.to(torch.int32)) & 0xFFFF


def drift_scores(segment: torch.Tensor, last: torch.Tensor, now: int,
                 wait: float) -> torch.Tensor:
    """``segment * sqrt(wait / age)`` (signed; ``age`` from the 16-bit stamps ``last``,
    :func:`ages`), in ``segment``'s dtype: the score :class:`DriftSelector` judges,
    computed as the native kernel does (``wait / age``, its square root, times
    ``segment``), which computes it for its candidates only."""
    age = ages(last, now).to(segment.dtype)
    # A 0-d tensor filled on the device (no host-to-device copy): ``wait / age`` is then a
    # true division in the segment's dtype, as the kernel's. The square root is taken in
    # float64 and rounded once (correctly rounded, as the kernel's sqrtf; torch's
    # vectorised float32 sqrt is not always).
    w = torch.full((), wait, dtype=segment.dtype, device=segment.device)
    return segment * torch.sqrt((w / age).double()).to(segment.dtype)


class DriftAges:
    """Per coordinate, the 16-bit stamp of the iteration after which its residual last
    started from zero (the same on every rank, since every rank applies the same
    coordinates). Made at the first selection, on the gradient's device.

    ``density`` sets the mean wait ``1 / d`` that scores are relative to."""

    def __init__(self, numel: int, density: float):
        self.numel, self.density = numel, density
        self.last: torch.Tensor | None = None
        self._capped_window: int | None = None  # the window of the last cap
        self._loaded = False  # loaded since the last selection

    def at(self, device: torch.device, now: int) -> torch.Tensor:
        """The stamps, on ``device``, with ages capped for iteration ``now``. Made at the
        first selection with every coordinate at the mean wait (a score of plain ``|a|``;
        at the first iteration, stamps of 0); loaded ones are moved, never remade."""
        if self.last is None:
            fresh = stamp(now - max(1, min(round(self.wait(now)), AGE_CAP)))
            self.last = torch.full((self.numel,), fresh, dtype=torch.int16, device=device)
        elif self.last.device != device:  # loaded on the host, used on a GPU: moved, kept
            self.last = self.last.to(device)
        self.cap(now)
        return self.last

    def wait(self, now: int) -> float:
        """The mean wait at iteration ``now``: ``1 / d``, or the iterations so far while
        fewer."""
        return min(1.0 / self.density, float(now))

    def cap(self, now: int) -> None:
        """Ages above AGE_CAP become AGE_CAP: one pass over N at the first selection of
        every window of AGE_RECAP iterations (``now`` = 1, 1 + AGE_RECAP, ...) and at the
        first selection after the stamps were made, so that no age reaches 2^16 and the
        16-bit stamps stay exact. A coordinate left that long scores as if it had waited
        AGE_CAP iterations, which changes its score by less than the noise it judges.

        The windows depend on ``now`` alone, so a run resumed from a checkpoint (or a
        newcomer given the survivors' state) caps when the uninterrupted run does and
        judges as it does. At the first selection after a load within a window, only the
        ages that no uninterrupted run has are capped: 0, and those that would reach 2^16
        before the window ends (from an older state, or a damaged one)."""
        window, into = divmod(now - 1, AGE_RECAP)
        if self._loaded and into:
            age = ages(self.last, now)
            old = (age == 0) | (age >= 0x10000 - (AGE_RECAP - into))
        elif self._loaded or window != self._capped_window:
            age = ages(self.last, now)
            # An age of 0 is a full wrap of the stamps (a coordinate restarts at the step's
            # now, and is judged from the next one on, at an age of 1 at least): stamps
            # loaded at a multiple of 2^16 iterations. Overdue; 0 would divide by 0.
            old = (age > AGE_CAP) | (age == 0)
        else:
            return
        self.last.masked_fill_(old, stamp(now - AGE_CAP))
        self._capped_window, self._loaded = window, False

    def scores(self, values: torch.Tensor, indices: torch.Tensor, now: int) -> torch.Tensor:
        """The drift scores of ``values``, at flat ``indices``."""
        return drift_scores(values, self.last.index_select(0, indices), now, self.wait(now))

    def waited(self, indices: torch.Tensor, now: int) -> torch.Tensor:
        """The ages at flat ``indices`` at iteration ``now`` (int32): how many iterations
        of gradient their residual holds (before :meth:`restart`)."""
        return ages(self.last.index_select(0, indices.long()), now)

    def restart(self, indices: torch.Tensor, now: int) -> None:
        """The coordinates at ``indices`` received an aggregate: they start afresh."""
        if self.last is not None:
            self.last.index_fill_(0, indices, stamp(now))

    def state_dict(self) -> torch.Tensor:
        return (self.last.cpu().clone() if self.last is not None
                else torch.zeros(self.numel, dtype=torch.int16))

    def check_state(self, last) -> None:
        if not isinstance(last, torch.Tensor) or last.numel() != self.numel:
            raise ValueError("micro: this state holds no ages of the drift judge "
                             "(written with judge='magnitude'?)")

    def load_state_dict(self, last: torch.Tensor) -> None:
        self.check_state(last)
        device = self.last.device if self.last is not None else "cpu"
        # Stamps; a state that holds whole iterations (int32) is taken mod 2^16.
        self.last = stamps(last).to(device=device)
        self._loaded = True


class DriftSelector(ThresholdSelector):
    """MiCRO's default judge: in the owned part, ``|a_i| * sqrt(wait / age_i) >= t``.

    ``age_i`` counts the iterations coordinate i has been accumulating in the residual
    since it was last applied (``now - last[i]`` from 16-bit stamps, :func:`ages`; the same
    on every rank), ``wait`` is the
    mean wait at the target density (``1 / d``, or the iterations so far while fewer), so a
    coordinate of average age scores its plain ``|a_i|``. A residual that grows because
    the gradient keeps its sign grows like its age, a random walk of noise only like the
    square root of it: the score ranks the first above the second, which one worker's
    ``|a_i|`` alone cannot (its noise is that of one worker's batches, while the value
    applied is the sum over all workers).

    :meth:`bind` names this step's part (a view of ``a_t``) with its ages; passes over that
    view judge the score and return it as the selected values, so the density controller's
    ladder (counts among the selected values) works unchanged. Any other tensor, such as
    those values, is selected on ``|x|`` as :class:`ThresholdSelector` does.
    """

    def __init__(self, capacity: int = 1024, use_native: bool = True):
        super().__init__(capacity, use_native)
        self._part: tuple[int, int, torch.Tensor, int, float] | None = None

    def bind(self, part: torch.Tensor, last: torch.Tensor, now: int, wait: float) -> None:
        self._part = (part.data_ptr(), part.numel(), last, now, wait)

    def _judged(self, segment: torch.Tensor) -> bool:
        p = self._part
        return p is not None and segment.data_ptr() == p[0] and segment.numel() == p[1]

    def __call__(self, segment, threshold, offset, numel):
        if self._judged(segment):
            return self.with_values(segment, threshold, offset, numel)[0]
        return super().__call__(segment, threshold, offset, numel)

    def scores(self, segment):
        if not self._judged(segment):
            return segment
        _, _, last, now, wait = self._part
        return drift_scores(segment, last, now, wait)

    def with_values(self, segment, threshold, offset, numel):
        if not self._judged(segment):
            return super().with_values(segment, threshold, offset, numel)
        _, _, last, now, wait = self._part
        if self._takes_native(segment, numel) and _native_drift is not None \
                and last.is_contiguous():
            return self._native_drift(segment, last, now, wait, threshold, offset)
        scores = drift_scores(segment, last, now, wait)
        selected = torch.nonzero(scores.abs() >= threshold).view(-1)
        return (selected + offset).to(index_dtype(numel)), scores.index_select(0, selected)

    def _native_drift(self, segment, last, now, wait, threshold, offset):
        n = segment.numel()
        return self._into_buffers(lambda idx, out, cap: _native_drift(
            segment.data_ptr(), last.data_ptr(), now, wait, n, threshold, offset, idx, out,
            cap))
