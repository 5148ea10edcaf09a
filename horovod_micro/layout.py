"""The flat gradient vector: where each parameter's gradient lives in it, and its dtype.

A sparse method sees the whole model's gradient as one vector of ``N`` elements, the
parameters in name order (as Horovod sorts them, so every rank builds the same layout).
:class:`FlatLayout` maps each parameter to its slice, gives views of any flat buffer
shaped like the parameters, and knows which aggregates a narrower parameter (float16 in
a float32 buffer) cannot hold.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import contextmanager

import torch


def flat_dtype(dtypes) -> torch.dtype:
    """The flat buffers' dtype: all parameters' dtypes promoted together, float32 at least
    (a float16 model's residual keeps what float16 would round away; a float64 parameter
    makes the whole buffer float64)."""
    result = torch.float32
    for dtype in dtypes:
        result = torch.promote_types(result, dtype)
    return result


class FlatLayout:
    """Where each parameter's gradient lives in the flat vector (parameters in name order)."""

    def __init__(self, named_params: Sequence[tuple[str, torch.nn.Parameter]]):
        self.names = [name for name, _ in named_params]
        self.params = [p for _, p in named_params]
        self.slices: list[tuple[int, int]] = []
        offset = 0
        for p in self.params:
            self.slices.append((offset, offset + p.numel()))
            offset += p.numel()
        self.numel = offset
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.dtype = flat_dtype(p.dtype for p in self.params)
        # Parameters narrower than the flat buffer (float16 in a float32 buffer): the
        # largest value their gradient can hold, per run of the flat vector
        # (see :meth:`unrepresentable`); None when every parameter has the buffer's range.
        self._narrow: tuple[torch.Tensor, torch.Tensor] | None = None
        self._kept: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
        limits = [torch.finfo(p.dtype).max if p.dtype.is_floating_point else math.inf
                  for p in self.params]
        if any(limit < torch.finfo(self.dtype).max for limit in limits):
            starts = torch.tensor([start for start, _ in self.slices], device=self.device)
            self._narrow = (starts, torch.tensor(limits, dtype=self.dtype, device=self.device))

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's slice of the N-sized ``flat``, shaped like the parameter (views,
        no copy: writes through one land in ``flat``)."""
        return [flat[start:end].view_as(p) for p, (start, end) in zip(self.params, self.slices)]

    def kept_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """:meth:`views` of a buffer that lives across steps (the residual, the output),
        built once and handed out again while each still is its parameter's slice of
        ``flat``, so that a step's Python does not grow with the number of parameters by
        slicing every one of them anew. A view whose shape, place or layout changed (an
        in-place ``t_()``, ``resize_()`` or ``.data =`` on a ``.grad``) has all of them
        rebuilt. The views of the last two buffers asked for are kept."""
        for i, (buffer, views) in enumerate(self._kept):
            if buffer is flat:
                if self._still_views(flat, views):
                    return views
                del self._kept[i]
                break
        views = self.views(flat)
        self._kept = [(flat, views), *self._kept[:1]]
        return views

    def _still_views(self, flat: torch.Tensor, views: list[torch.Tensor]) -> bool:
        base, size = flat.data_ptr(), flat.element_size()
        return all(v.data_ptr() == base + start * size and v.shape == p.shape
                   and v.dtype == flat.dtype and v.is_contiguous()
                   for v, p, (start, _) in zip(views, self.params, self.slices))

    def unrepresentable(self, indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Which of ``values`` (at flat ``indices``) no parameter's ``.grad`` can hold:
        NaN, Inf, or beyond the range of a narrower parameter's dtype (a float32
        aggregate of 80000 would be written into a float16 ``.grad`` as Inf)."""
        bad = ~torch.isfinite(values)
        if self._narrow is not None and values.numel():
            starts, limits = self._narrow
            owner = torch.searchsorted(starts, indices.to(starts.dtype), right=True) - 1
            bad |= values.abs() > limits[owner]
        return bad

    @property
    def narrow(self) -> bool:
        """Whether some parameter's dtype has a smaller range than the flat buffer's."""
        return self._narrow is not None

    def any_unrepresentable(self, indices: torch.Tensor, values: torch.Tensor) -> bool:
        """Whether any of ``values`` is :meth:`unrepresentable`. Without narrower
        parameters, a finite sum proves every value finite (one fast reduction: the
        element-wise check costs several times more over a whole model's aggregate); only
        a non-finite sum, which finite values can also give, is checked value by value."""
        if self._narrow is None and bool(torch.isfinite(values.sum())):
            return False
        return bool(self.unrepresentable(indices, values).any())

    def signature(self) -> list[tuple[str, tuple[int, ...], str]]:
        """Names, shapes and dtypes; must be identical on every rank."""
        return [(n, tuple(p.shape), str(p.dtype)) for n, p in zip(self.names, self.params)]


class FrozenSlices:
    """The residual of parameters frozen after wrapping, set aside during an exchange.

    A parameter frozen after wrapping (``requires_grad=False`` on every rank, which the
    status word checks) gets no gradient and is skipped by the wrapped optimizer, but its
    slice of the residual still holds what it had not sent. Left in ``a_t`` it would be
    selected, sent (taking slots, bytes and density), cleared, and its aggregate dropped,
    so unfreezing it later would not bring it back. :meth:`set_aside` zeroes those slices
    of ``a_t`` before the selection (no rank selects there) and :meth:`restore` puts them
    back into the residual after the exchange: the residual waits for the unfreezing.
    Costs nothing while every parameter requires a gradient."""

    def __init__(self, layout: FlatLayout, acc: torch.Tensor):
        self._slices = [s for p, s in zip(layout.params, layout.slices) if not p.requires_grad]
        self._saved = [acc[start:end].clone() for start, end in self._slices]
        for start, end in self._slices:
            acc[start:end].zero_()

    def __bool__(self) -> bool:
        return bool(self._slices)

    def squared_norm(self) -> torch.Tensor | float:
        """Their contribution to ``||a_t||^2``, removed from the norm the selection sees."""
        return sum((torch.dot(s.double(), s.double()) for s in self._saved), 0.0)

    def restore(self, residual: torch.Tensor) -> None:
        for (start, end), saved in zip(self._slices, self._saved):
            residual[start:end].copy_(saved)

    @contextmanager
    def restored_on_error(self, acc: torch.Tensor):
        """Put the slices back into ``acc`` if the exchange inside raises."""
        try:
            yield
        except BaseException:
            self.restore(acc)
            raise
