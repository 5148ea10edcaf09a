"""Zero-copy error feedback: each ``.grad`` a view of its slice of the residual ``e_t``.

``zero_grad()`` makes every parameter's ``.grad`` its slice of the flat residual, so the
next backward adds ``g_t`` into ``e_t`` in place (AccumulateGrad's add) and the reducer
finds ``a_t = e_t + g_t`` already built: no pass of its own. What this needs is
bookkeeping, kept here: which gradients are views, and whether anything but backward
wrote into them since (the residual's version counter against the accumulations the
hooks counted), in which case the step still runs, with a warning, and separate gradient
buffers are used from then on.
"""

from __future__ import annotations

import warnings

import torch

from .accumulate import add_and_square
from .layout import FlatLayout
from .status import GRAPH_GRADIENT, OK, SPARSE_GRADIENT


class ResidualViews:
    """Which ``.grad`` tensors are views of the residual, and whether they were touched."""

    def __init__(self, layout: FlatLayout, enabled: bool):
        self.layout = layout
        #: Off with ``zero_copy=False``, and for good once a view was written in place.
        self.enabled = enabled
        # The residual's version counter when the views were installed (None: not
        # installed), and backward's accumulations into them since.
        self._version: int | None = None
        self._accumulations = 0
        self._starts = {id(p): start for p, (start, _) in zip(layout.params, layout.slices)}
        #: Per parameter: did its gradient come dense at the last exchange? Only then does
        #: it get a view: backward would silently densify a sparse gradient (an
        #: nn.Embedding(sparse=True)) into a dense .grad, where the sparse one must be
        #: refused (SPARSE_GRADIENT). So the first step always takes the out-of-place path.
        self.dense_before = [False] * len(layout.params)

    def forget(self) -> None:
        """The residual is about to be overwritten as a whole (an elastic restore): its
        version counter no longer tells backward's adds apart, and the gradients it served
        are dropped; the next step starts out of place and installs views again."""
        self._version = None
        self._accumulations = 0

    def check(self, residual: torch.Tensor) -> bool:
        """Since the views were installed, only backward may have written into them (one
        in-place add per accumulation, counted by :meth:`count_accumulation`). Anything
        else (``GradScaler.unscale_`` or gradient clipping before ``synchronize()``,
        ``zero_grad(set_to_none=False)`` on the model) acted on ``a_t``, the residual
        included: warn, and use separate gradients from now on. Returns whether views
        had been installed for this step."""
        installed, self._version = self._version, None
        if installed is None:
            return False
        if residual._version == installed + self._accumulations:
            return True
        self.enabled = False
        warnings.warn(
            "horovod_micro: .grad was modified in place between backward and "
            "synchronize() (e.g. scaler.unscale_() or clip_grad_norm_() before "
            "synchronize(), or model.zero_grad(set_to_none=False)). The gradients were "
            "views of the error-feedback residual, so this step's residual was modified "
            "too. Switching to separate gradient buffers for the rest of the run (one more "
            "pass over the gradient per step). Call optimizer.synchronize() before such "
            "operations, or pass zero_copy=False, to silence this.", stacklevel=4)
        return True

    def count_accumulation(self, p: torch.nn.Parameter, residual: torch.Tensor) -> None:
        """Backward just accumulated into ``p.grad`` (a post-accumulate hook)."""
        start = self._starts.get(id(p))
        if (self._version is not None and start is not None
                and self.is_view(p.grad, start, residual)):
            self._accumulations += 1

    @staticmethod
    def is_view(grad: torch.Tensor, start: int, residual: torch.Tensor) -> bool:
        """Whether ``grad`` is the slice of ``residual`` that begins at ``start``."""
        # Pointer arithmetic, not a slice: this runs in a hook on every accumulation.
        return (grad.dtype == residual.dtype and grad.device == residual.device
                and grad.is_contiguous()
                and grad.data_ptr() == residual.data_ptr() + start * residual.element_size())

    def install(self, residual: torch.Tensor) -> None:
        """Make each parameter's ``.grad`` its slice of the residual ``e_t``, so that the
        next backward accumulates ``g_t`` straight into it (the reducer then spends no pass).
        Parameters whose dtype differs from the flat buffer's (float16 with a float32
        residual), and those whose gradient at the last step was missing or sparse (so
        always on the first step), keep ``.grad = None`` and take the out-of-place path. With
        ``zero_copy`` off (or switched off by :meth:`check`), every ``.grad`` becomes None
        instead."""
        for p, view, dense in zip(self.layout.params, self.layout.kept_views(residual),
                                  self.dense_before):
            if self.enabled and dense and p.dtype == residual.dtype and p.requires_grad:
                p.grad = view
            else:
                p.grad = None
        self._version = residual._version if self.enabled else None
        self._accumulations = 0

    def error_compensated(self, residual: torch.Tensor, output: torch.Tensor, watching: bool
                          ) -> tuple[torch.Tensor, int, bool, float | None]:
        """``a_t = e_t + g_t``: the buffer that holds it, the status this rank reports in
        the exchange, whether that buffer is the residual itself, and ``||a_t||^2`` when
        it was taken on the way (None: the caller takes it).

        Zero-copy error feedback. When every gradient is a view of the residual (installed
        by :meth:`install`, which the optimizer's ``zero_grad()`` calls),
        backward has already added ``g_t`` to ``e_t`` in place (AccumulateGrad's add, in the
        backward pass's time), and the reducer spends no pass at all. Otherwise (the first
        step, ``.grad`` set to None or assigned), ``a_t`` is
        written out of place into the output buffer, which the optimizer no longer needs,
        so a collective error leaves the residual untouched; a gradient that already is a
        residual view contributes its slice as it stands. The out-of-place pass reads and
        writes N; on contiguous float32 CPU tensors it also squares ``a_t`` on the way
        (:mod:`horovod_micro.accumulate`), so the norm needs no pass of its own."""
        status = OK
        grads = []
        in_place = True
        for i, (p, (start, _)) in enumerate(zip(self.layout.params, self.layout.slices)):
            grad = p.grad
            self.dense_before[i] = grad is not None and not grad.is_sparse
            if grad is not None and grad.is_sparse:
                status, grad = SPARSE_GRADIENT, None
            view = grad is not None and self.is_view(grad, start, residual)
            if not view and grad is not None and grad.requires_grad:
                if watching:
                    # backward(create_graph=True) replaced the view by view + g_t: a_t is
                    # in there, but so is e_t, and nothing tells the two cases apart.
                    status, grad = GRAPH_GRADIENT, None
                else:  # the exchange is not differentiable (nor is Horovod's allreduce)
                    grad = grad.detach()
            in_place = in_place and (view or grad is None)
            grads.append(None if view else grad)
        if in_place:
            return residual, status, True, None
        acc = output
        sq_norm: float | None = 0.0
        for grad, (start, end) in zip(grads, self.layout.slices):
            e, a = residual[start:end], acc[start:end]
            g = None if grad is None else grad.reshape(-1)
            squared = None if sq_norm is None else add_and_square(e, g, a)
            if squared is not None:
                sq_norm += squared
                continue
            sq_norm = None  # a slice the kernel cannot serve: torch adds, and squares later
            if g is None:
                a.copy_(e)
            else:
                torch.add(e, g, out=a)
        return acc, status, False, sq_norm
