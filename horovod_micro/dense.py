"""Horovod's dense exchange inside ``hvm.DistributedOptimizer`` (``Compression.none``/``fp16``).

The behaviour of ``hvd.DistributedOptimizer``: a hook per parameter starts
``hvd.allreduce_async_`` as soon as its gradient is final, overlapping communication with
the rest of the backward pass, optionally fused into groups (``groups``/``num_groups``);
a sparse gradient goes through Horovod's sparse allreduce, or densified with
``sparse_as_dense``. ``synchronize()`` waits for the handles (asleep for CPU tensors on
Gloo, :mod:`horovod_micro.waiting`), starts what backward never
reached (every rank joins the same collectives) and records a :class:`StepStats`, so
dense runs report bytes like sparse ones.

:class:`DensePath` is the dense half of :func:`horovod_micro.DistributedOptimizer`, which
holds one when its compressor is dense.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import horovod.torch as hvd
import torch

from .layout import FlatLayout
from .stats import StepStats, ring_allreduce_bytes
from .waiting import wait, wait_mode


def scale_factors(op, gradient_predivide_factor: float) -> tuple[float, float]:
    """Horovod's prescale and postscale factors for ``op`` and ``gradient_predivide_factor``
    (the sparse path passes them to its ReduceOp)."""
    if op == hvd.Average:
        return 1.0 / gradient_predivide_factor, gradient_predivide_factor
    return 1.0, 1.0


class DensePath:
    """Horovod's per-parameter allreduces, started from backward and awaited at
    :meth:`synchronize`.

    Built from the optimizer's arguments; ``backward`` (the
    :class:`~horovod_micro.hooks.BackwardHooks`) tells which parameters of a fusion group
    are final, ``names`` names each parameter's collective, and ``record`` receives each
    step's :class:`StepStats`.
    """

    def __init__(self, layout: FlatLayout, names: dict, compression, op,
                 gradient_predivide_factor: float, sparse_as_dense: bool,
                 process_set: hvd.ProcessSet, prefix: str, groups, backward,
                 record: Callable[[StepStats], None]):
        self.layout = layout
        self.names = names
        self.compression = compression
        self.op = op
        self.factors = scale_factors(op, gradient_predivide_factor)
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self.prefix = prefix
        self.groups = resolve_groups(groups, layout)
        self.backward = backward
        self.record = record
        self.handles: dict = {}  # parameter or group -> (handle, ctx, tensors sent)
        self.iteration = 0
        self.wait = wait_mode()  # how synchronize() waits (horovod_micro.waiting)

    def start(self, p) -> None:
        """``p``'s gradient is final: start its allreduce, or its group's once every
        member of the group is final."""
        group = self.groups.get(p) if self.groups else None
        if group is None:
            self.handles[p] = self._allreduce_async(p)
            return
        if all(self.backward.final(q) for q in group) and group not in self.handles:
            self.handles[group] = self._grouped_allreduce_async(group)

    def _allreduce_async(self, p):
        """Start the dense exchange of ``p.grad``: Horovod's allreduce, or for a sparse
        gradient Horovod's sparse allreduce (allgather of indices and values), or with
        ``sparse_as_dense`` a dense allreduce whose result goes back to sparse."""
        _take_part(p)
        name = f"{self.prefix}.{self.names[p]}"
        if p.grad.is_sparse and not self.sparse_as_dense:
            handle = hvd.sparse_allreduce_async(p.grad, name=name, op=self.op,
                                                process_set=self.process_set)
            return handle, None, None
        grad = p.grad.to_dense() if p.grad.is_sparse else p.grad
        compressed, ctx = self.compression.compress(grad)
        pre, post = self.factors
        handle = hvd.allreduce_async_(compressed, name=name, op=self.op, prescale_factor=pre,
                                      postscale_factor=post, process_set=self.process_set)
        return handle, ctx, compressed

    def _grouped_allreduce_async(self, group):
        for p in group:
            _take_part(p)
            if p.grad.is_sparse:
                p.grad = p.grad.to_dense()
        pairs = [self.compression.compress(p.grad) for p in group]
        tensors = [t for t, _ in pairs]
        pre, post = self.factors
        handle = hvd.grouped_allreduce_async_(
            tensors, name=f"{self.prefix}.group.{self.names[group[0]]}",
            op=self.op, prescale_factor=pre, postscale_factor=post,
            process_set=self.process_set)
        return handle, [c for _, c in pairs], tensors

    def synchronize(self) -> None:
        """Start what backward never reached, wait for every handle and install the
        averages as ``.grad``; then record the step's bytes."""
        start = time.perf_counter()
        covered = set()
        for key in self.handles:
            covered.update(key if isinstance(key, tuple) else (key,))
        for p in self.layout.params:
            if p in covered:
                continue
            group = self.groups.get(p) if self.groups else None
            if group is None:
                self.handles[p] = self._allreduce_async(p)
            elif group not in self.handles:
                self.handles[group] = self._grouped_allreduce_async(group)
            covered.update(group or (p,))
        nbytes = 0
        for key, (handle, ctx, sent) in self.handles.items():
            if sent is None:  # Horovod's sparse allreduce: the handle returns the result
                _install_sparse(key, handle())
                nbytes += _sparse_bytes(key.grad)
                continue
            params = key if isinstance(key, tuple) else (key,)
            outputs = wait(handle, sent[0] if isinstance(key, tuple) else sent, self.wait)
            outputs = outputs if isinstance(key, tuple) else [outputs]
            ctxs = ctx if isinstance(key, tuple) else [ctx]
            tensors = sent if isinstance(key, tuple) else [sent]
            for p, out, c, t in zip(params, outputs, ctxs, tensors):
                result = self.compression.decompress(out, c)
                if p.grad.is_sparse:  # sparse_as_dense: back to sparse for the optimizer
                    _install_sparse(p, result.to_sparse())
                else:
                    p.grad.set_(result)
                nbytes += t.numel() * t.element_size()
        for p in self.layout.params:
            if not p.requires_grad:
                # Frozen after wrapping: it took part (every rank runs the same
                # collectives), but the wrapped optimizer must not update it.
                p.grad = None
        numel = self.layout.numel
        sent, received = ring_allreduce_bytes(nbytes, self.process_set.size())
        self.record(StepStats(
            iteration=self.iteration,
            method=getattr(self.compression, "name", type(self.compression).__name__),
            numel=numel, target_count=numel, threshold=None,
            rank_counts=[numel] * self.process_set.size(), global_count=numel, density=1.0,
            target_density=1.0, bytes_sent=sent, bytes_received=received,
            comm_time=time.perf_counter() - start))
        self.iteration += 1


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
