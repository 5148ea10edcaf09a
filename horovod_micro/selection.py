"""Local selection primitives shared by the compressors, and :class:`Selection`, what a
compressor's ``select`` returns: this rank's choice for one step.

:class:`ThresholdSelector` is the threshold methods' selection (MiCRO's and the hard
threshold's; MiCRO's drift judge builds on it): the indices of ``|x| >= threshold`` in one
pass, and on request the selected values with them (:meth:`ThresholdSelector.with_values`:
written by the same pass, so a caller that needs the values reads no second time, at
random, from a part larger than the cache).
On CPU float32 it calls the native kernel in ``_native/select.c`` (one read of the data);
elsewhere it uses torch ops, which on a GPU are bandwidth-bound anyway. Which path runs is
decided by the flat buffer's dtype (the rule is in :mod:`horovod_micro.reducer`): float32
buffers take the kernel; float64 buffers (a model with a float64 parameter) take torch
ops on purpose: the kernel compares in float, and narrowing a float64 value or threshold
could flip a comparison. A source tree where the kernel was not built also uses torch
(``native_available()`` says which; the tests require the kernel).
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .native import forced_torch, native_library

INT32_MAX = 2**31 - 1


def _load_native():
    """``(hvm_select_abs_ge, hvm_select_abs_ge_values)`` from the built kernel, or Nones."""
    lib = native_library()
    if lib is None:
        return None, None
    plain, with_values = lib.hvm_select_abs_ge, lib.hvm_select_abs_ge_values
    head = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int64, ctypes.c_void_p]
    plain.restype = with_values.restype = ctypes.c_int64
    plain.argtypes = head + [ctypes.c_int64]
    with_values.argtypes = head + [ctypes.c_void_p, ctypes.c_int64]
    return plain, with_values


_native_select, _native_select_values = _load_native()


def native_available() -> bool:
    """Whether the native CPU kernel was built and loaded."""
    return _native_select is not None


def index_dtype(numel: int) -> torch.dtype:
    """int32 indices while they fit (half the bytes on the wire), int64 beyond."""
    return torch.int32 if numel <= INT32_MAX else torch.int64


def index_bytes(numel: int) -> int:
    """Bytes of one index (and header word) on the wire: :func:`index_dtype`'s size."""
    return 4 if numel <= INT32_MAX else 8


def count_abs_ge(x: torch.Tensor, threshold: float) -> int:
    """How many entries of ``x`` have ``|x| >= threshold``, without writing any index: the
    native kernel with a zero-capacity buffer on contiguous CPU float32 (it compares in
    float, exactly as :class:`ThresholdSelector` does, so a count here equals the size of
    the selection there), torch ops elsewhere."""
    if (_native_select is not None and not forced_torch() and x.device.type == "cpu"
            and x.dtype == torch.float32 and x.is_contiguous()):
        return int(_native_select(x.data_ptr(), x.numel(), threshold, 0, None, 0))
    return int((x.abs() >= threshold).sum())


def reads_wait(x: torch.Tensor) -> bool:
    """Whether a host read of ``x``'s values would make the host wait for a device: on a
    GPU, and on the CPU when the device path is forced (``HOROVOD_MICRO_SELECT=torch``, how
    the tests run it there). Where it would, the step keeps scalars such as the squared
    norm, the scale and the thresholds as 0-dim tensors on the device, and reads several
    counts at once (:func:`counts_abs_ge_many`); elsewhere a read costs nothing, plain
    floats are simpler and one count at a time is cheaper (the batched comparison does
    every threshold's pass: 10x the time of a handful of counts on CPU float64, measured)."""
    return x.device.type != "cpu" or forced_torch()


#: Entries of the (thresholds x values) comparison that counts_abs_ge_many builds at once.
_MANY_CHUNK = 1 << 24


def counts_abs_ge_many(x: torch.Tensor, thresholds: list[float] | torch.Tensor,
                       chunk: int = _MANY_CHUNK) -> list[int]:
    """``[count_abs_ge(x, t) for t in thresholds]`` with one host read instead of one per
    threshold: on a GPU every count read is a host synchronisation. The thresholds travel
    as a tensor of ``x``'s dtype, as a Python threshold is compared in ``x``'s dtype, so
    each count equals :func:`count_abs_ge`'s. The host-to-device copy of the thresholds is
    asynchronous (no wait for the device); thresholds already on the device (a 1-D
    tensor, float64) are rounded to ``x``'s dtype there. ``chunk``: the most comparisons
    made at once."""
    if len(thresholds) == 0:
        return []
    if isinstance(thresholds, torch.Tensor):
        levels = thresholds.to(x.dtype)
    else:
        levels = torch.tensor(thresholds, dtype=x.dtype).to(x.device, non_blocking=True)
    a = x.abs().unsqueeze(0)
    rows = max(1, chunk // max(x.numel(), 1))
    counts = [(a >= levels[i : i + rows].unsqueeze(1)).sum(1)
              for i in range(0, len(thresholds), rows)]
    return torch.cat(counts).tolist()


@dataclass
class Selection:
    """This rank's choice for one step, as a compressor's ``select`` returns it.

    Attributes:
        indices: the coordinates this rank chose (int32 or int64, a tensor of its own).
        announced: whether they travel in the index gather. False for methods whose
            coordinates every rank knows already (Random-k's shared seed) or that travel
            another way (gTop-k's tree): only the header goes out.
        report: what this rank reports about its selection to every rank, one integer in
            the gather's header, for the method's own use: MiCRO's count above its probe
            threshold (its controller's update), Random-k's checksum of the coordinates it
            drew (every rank must have drawn the same).
        selected: how many coordinates the threshold picked before a capacity cut kept
            ``indices`` (None: no cut, ``len(indices)``).
        count: for a choice made on the device with no host read (fixed slots only):
            how many of ``indices``, which fill every slot, are in use, a 0-dim device
            tensor (``report`` and ``selected`` then are too). None: all of them.
        reselect: with ``count``, the host rule's selection, which this rank makes
            instead where its device-side choice could not decide (MiCRO's
            :data:`~horovod_micro.compressors.micro.device_choice.RESELECT`).
        threshold: the threshold this choice applied, for methods that have one (a float,
            or a 0-dim device tensor where it was decided with no host read); ``combine``
            passes it on in the ``Aggregate``.
    """

    indices: torch.Tensor
    announced: bool = True
    report: int | torch.Tensor = 0
    selected: int | torch.Tensor | None = None
    count: torch.Tensor | None = None
    reselect: Callable[[], Selection] | None = None
    threshold: float | torch.Tensor | None = None

    @property
    def sent(self) -> torch.Tensor:
        """What travels in the index gather: ``indices``, or none if not announced."""
        return self.indices if self.announced else self.indices[:0]


class ThresholdSelector:
    """Selects ``|x| >= threshold`` in a contiguous segment.

    The native kernel writes into an uninitialised buffer of ``capacity`` entries (an
    allocation, no pass over it); the capacity grows, and the selection is redone,
    whenever a selection needs more, so no index is ever dropped. Each call returns a
    tensor of its own.
    """

    def __init__(self, capacity: int = 1024, use_native: bool = True):
        self.capacity = max(int(capacity), 1)
        self.use_native = use_native and native_available() and not forced_torch()

    def __call__(self, segment: torch.Tensor, threshold: float, offset: int,
                 numel: int) -> torch.Tensor:
        """Indices (``offset``-based, dtype ``index_dtype(numel)``) of
        ``|segment| >= threshold``."""
        if self._takes_native(segment, numel):
            return self._native(segment, threshold, offset, False)[0]
        selected = torch.nonzero(segment.abs() >= threshold).view(-1)
        return (selected + offset).to(index_dtype(numel))

    def counted(self, segment: torch.Tensor, threshold: float, count: int) -> torch.Tensor:
        """Positions in ``segment`` of ``|segment| >= threshold`` when the caller already
        knows there are ``count`` of them (a count taken at the same threshold, in the
        same dtype): on the torch path ``nonzero_static``, whose size is known in advance,
        so a GPU's host does not wait for the device as it does for ``nonzero``."""
        if self._takes_native(segment, segment.numel()):
            return self(segment, threshold, 0, segment.numel())
        return torch.nonzero_static(segment.abs() >= threshold, size=count).view(-1)

    def scores(self, segment: torch.Tensor) -> torch.Tensor:
        """What the torch path compares with the threshold (in absolute value): the
        segment itself; a judge that scores coordinates otherwise overrides it."""
        return segment

    def slotted(self, segment: torch.Tensor, threshold: float | torch.Tensor, offset: int,
                numel: int, levels: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, list[int]] | None:
        """The device path's selection with one host read: ``(indices, |scores| there,
        [count, count at each of levels])``, the counts among the selected values as
        :func:`counts_abs_ge_many` takes them, read together with the selection's size.
        ``torch.nonzero_static`` writes the selection into ``capacity`` slots (no wait for
        its size); unused slots hold 0, which no positive level counts. None if more than
        ``capacity`` were selected (the capacity grows) or the segment is empty: the caller
        selects as usual. ``levels``: float64 thresholds on the segment's device."""
        if segment.numel() == 0:
            return None
        scores = self.scores(segment).abs()
        chosen = scores >= threshold
        positions = torch.nonzero_static(chosen, size=self.capacity, fill_value=0).view(-1)
        count = chosen.sum()
        used = torch.arange(self.capacity, device=segment.device) < count
        values = torch.where(used, scores.index_select(0, positions), 0)
        counts = (values.unsqueeze(0) >= levels.to(values.dtype).unsqueeze(1)).sum(1)
        read = torch.cat([count.view(1), counts]).tolist()  # the one host read
        if read[0] > self.capacity:
            self.capacity = int(read[0] * 1.5) + 1
            return None
        selected = positions[:read[0]]
        return (selected + offset).to(index_dtype(numel)), values[:read[0]], read

    def with_values(self, segment: torch.Tensor, threshold: float, offset: int,
                    numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(indices, segment[indices - offset])`` for ``|segment| >= threshold``: the
        native kernel writes each value next to its index in the same pass; the torch path
        gathers them (contiguous on a GPU's memory, where that gather is cheap)."""
        if self._takes_native(segment, numel):
            return self._native(segment, threshold, offset, True)
        selected = torch.nonzero(segment.abs() >= threshold).view(-1)
        return (selected + offset).to(index_dtype(numel)), segment.index_select(0, selected)

    def _takes_native(self, segment: torch.Tensor, numel: int) -> bool:
        return (self.use_native and segment.device.type == "cpu"
                and segment.dtype == torch.float32 and segment.is_contiguous()
                and numel <= INT32_MAX)

    def _native(self, segment: torch.Tensor, threshold: float, offset: int,
                values: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        n = segment.numel()
        if values:
            return self._into_buffers(lambda idx, out, cap: _native_select_values(
                segment.data_ptr(), n, threshold, offset, idx, out, cap))
        return self._into_buffers(lambda idx, _, cap: _native_select(
            segment.data_ptr(), n, threshold, offset, idx, cap), values=False)

    def _into_buffers(self, kernel, values: bool = True
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``kernel(index_ptr, value_ptr, capacity) -> count`` into buffers of
        ``capacity`` entries; a count beyond it grows the capacity and runs it again."""
        while True:
            buffer = torch.empty(self.capacity, dtype=torch.int32)
            out = torch.empty(self.capacity, dtype=torch.float32) if values else None
            count = kernel(buffer.data_ptr(), None if out is None else out.data_ptr(),
                           self.capacity)
            if count <= self.capacity:
                return buffer[:count], None if out is None else out[:count]
            self.capacity = int(count * 1.5) + 1


def initial_threshold(target_count: int) -> float:
    """The hard-threshold heuristic ``1 / (2 sqrt(k))`` (Sahu et al., NeurIPS 2021)."""
    return 1.0 / (2.0 * math.sqrt(target_count))
