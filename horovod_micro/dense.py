"""Horovod's dense exchange inside ``hvm.DistributedOptimizer`` (``Compression.none``/``fp16``).

The behaviour of ``hvd.DistributedOptimizer``: a hook per parameter starts
``hvd.allreduce_async_`` as soon as its gradient is final, overlapping communication with
the rest of the backward pass, optionally fused into groups (``groups``/``num_groups``);
a sparse gradient goes through Horovod's sparse allreduce, or densified with
``sparse_as_dense``. ``synchronize()`` waits for the handles, starts what backward never
reached (every rank joins the same collectives) and records a :class:`StepStats`, so
dense runs report bytes like sparse ones.

The methods of :class:`DenseExchange` are merged into the optimizer's run-time class (see
:func:`horovod_micro.DistributedOptimizer`); they read its fields.
"""

from __future__ import annotations

import time

import horovod.torch as hvd
import torch

from .layout import FlatLayout
from .stats import StepStats, ring_allreduce_bytes


class DenseExchange:
    """The dense path's methods, merged into ``hvm.DistributedOptimizer``'s class."""

    def _scale_factors(self) -> tuple[float, float]:
        """Horovod's prescale and postscale factors for ``op`` and
        ``gradient_predivide_factor`` (the sparse path passes them to its ReduceOp)."""
        if self.op == hvd.Average:
            return 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        return 1.0, 1.0

    def _start_dense(self, p) -> None:
        group = self._groups.get(p) if self._groups else None
        if group is None:
            self._handles[p] = self._allreduce_async(p)
            return
        done = [q for q in group if self._passes.get(q, 0) >= self.backward_passes_per_step]
        if len(done) == len(group) and group not in self._handles:
            self._handles[group] = self._grouped_allreduce_async(group)

    def _allreduce_async(self, p):
        """Start the dense exchange of ``p.grad``: Horovod's allreduce, or for a sparse
        gradient Horovod's sparse allreduce (allgather of indices and values), or with
        ``sparse_as_dense`` a dense allreduce whose result goes back to sparse."""
        _take_part(p)
        name = f"{self._comm.prefix}.{self._parameter_names[p]}"
        if p.grad.is_sparse and not self.sparse_as_dense:
            handle = hvd.sparse_allreduce_async(p.grad, name=name, op=self.op,
                                                process_set=self.process_set)
            return handle, None, None
        grad = p.grad.to_dense() if p.grad.is_sparse else p.grad
        compressed, ctx = self._compression.compress(grad)
        pre, post = self._scale_factors()
        handle = hvd.allreduce_async_(compressed, name=name, op=self.op, prescale_factor=pre,
                                      postscale_factor=post, process_set=self.process_set)
        return handle, ctx, compressed

    def _grouped_allreduce_async(self, group):
        for p in group:
            _take_part(p)
            if p.grad.is_sparse:
                p.grad = p.grad.to_dense()
        pairs = [self._compression.compress(p.grad) for p in group]
        tensors = [t for t, _ in pairs]
        pre, post = self._scale_factors()
        handle = hvd.grouped_allreduce_async_(
            tensors, name=f"{self._comm.prefix}.group.{self._parameter_names[group[0]]}",
            op=self.op, prescale_factor=pre, postscale_factor=post,
            process_set=self.process_set)
        return handle, [c for _, c in pairs], tensors

    def _synchronize_dense(self) -> None:
        start = time.perf_counter()
        covered = set()
        for key in self._handles:
            covered.update(key if isinstance(key, tuple) else (key,))
        for p in self._layout.params:
            if p in covered:
                continue
            group = self._groups.get(p) if self._groups else None
            if group is None:
                self._handles[p] = self._allreduce_async(p)
            elif group not in self._handles:
                self._handles[group] = self._grouped_allreduce_async(group)
            covered.update(group or (p,))
        nbytes = 0
        for key, (handle, ctx, sent) in self._handles.items():
            if sent is None:  # Horovod's sparse allreduce: the handle returns the result
                _install_sparse(key, handle())
                nbytes += _sparse_bytes(key.grad)
                continue
            outputs = hvd.synchronize(handle)
            params = key if isinstance(key, tuple) else (key,)
            outputs = outputs if isinstance(key, tuple) else [outputs]
            ctxs = ctx if isinstance(key, tuple) else [ctx]
            tensors = sent if isinstance(key, tuple) else [sent]
            for p, out, c, t in zip(params, outputs, ctxs, tensors):
                result = self._compression.decompress(out, c)
                if p.grad.is_sparse:  # sparse_as_dense: back to sparse for the optimizer
                    _install_sparse(p, result.to_sparse())
                else:
                    p.grad.set_(result)
                nbytes += t.numel() * t.element_size()
        for p in self._layout.params:
            if not p.requires_grad:
                # Frozen after wrapping: it took part (every rank runs the same
                # collectives), but the wrapped optimizer must not update it.
                p.grad = None
        numel = self._layout.numel
        sent, received = ring_allreduce_bytes(nbytes, self.process_set.size())
        self._record(StepStats(
            iteration=self.last_stats.iteration + 1 if self.last_stats else 0,
            method=getattr(self._compression, "name", type(self._compression).__name__),
            numel=numel, target_count=numel, threshold=None,
            rank_counts=[numel] * self.process_set.size(), global_count=numel, density=1.0,
            target_density=1.0, bytes_sent=sent, bytes_received=received,
            comm_time=time.perf_counter() - start))


def _take_part(p) -> None:
    """Give ``p`` a zero gradient if backward gave it none: another rank may have one (a
    dynamic graph), and every rank must join the same collectives."""
    if p.grad is None:
        p.grad = torch.zeros_like(p)


def _install_sparse(p, aggregated: torch.Tensor) -> None:
    """Put a sparse aggregate into ``p.grad`` (sparse tensors support no ``set_``)."""
    p.grad.zero_().add_(aggregated)


def _sparse_bytes(grad: torch.Tensor) -> int:
    grad = grad.coalesce()
    return (grad.indices().numel() * grad.indices().element_size()
            + grad.values().numel() * grad.values().element_size())


def resolve_groups(groups, layout: FlatLayout):
    """Map each parameter to its fusion group (a tuple), as Horovod's ``groups`` argument."""
    if groups is None or groups == 0:
        return None
    params = layout.params
    if isinstance(groups, int):
        size = -(-len(params) // groups)
        chunks = [tuple(params[i:i + size]) for i in range(0, len(params), size)]
    else:
        chunks = [tuple(g) for g in groups]
    return {p: chunk for chunk in chunks for p in chunk}
