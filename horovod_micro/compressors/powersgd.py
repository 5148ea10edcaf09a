"""PowerSGD: a rank-``r`` approximation of each matrix-shaped gradient, by one step of
power iteration, exchanged as two small allreduces.

Vogels, Karimireddy, Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization", NeurIPS 2019 (Algorithm 1, with error feedback and a warm
start). It is not a sparsifier: every coordinate receives an aggregate, but the aggregate
of an ``m x c`` gradient has rank ``r``, so only ``r (m + c)`` numbers per matrix travel.
Its traffic does not grow with the number of ranks ``n``, and all ranks combine the same
factors, so it has no "gradient build-up" and no local judgement to go wrong at large n.

Per step, every rank ``w`` with error-compensated gradient ``a_t`` (gradient plus
residual, as for every method of this package), each parameter viewed as a matrix ``M_w``
of ``m = shape[0]`` rows and ``c = numel / m`` columns:

1. ``P_w = M_w Q`` with the ``c x r`` matrix ``Q`` every rank holds alike (warm start: the
   previous step's averaged ``Q``, orthonormalised, and drawn again from ``seed`` where a
   column of it is zero or not finite; at the first step drawn from ``seed``);
2. one allreduce sums the ``P_w`` of every matrix at once, together with the tensors that
   go uncompressed (below); ``P`` is orthonormalised (Gram-Schmidt over its ``r``
   columns, on the device, no host read);
3. ``Q_w = M_w^T P``; a second allreduce sums the ``Q_w`` of every matrix;
4. the aggregate is ``P (sum_w Q_w)^T``, averaged like Horovod's ``op``; this rank's share
   of it is ``P Q_w^T``, and the residual keeps what that share misses,
   ``M_w - P Q_w^T`` (the local projection's error; summed over ranks the residuals lose
   exactly ``n`` times the aggregate, as with every method of this package);
5. the averaged ``Q`` is the next step's warm start, so that the power iteration runs on
   across steps and tracks the gradient's dominant subspace.

Which tensors are compressed: a parameter of two or more dimensions whose ``m c`` entries
exceed ``min_compression`` times ``r (m + c)``. Vectors (biases, norms) and small matrices
go uncompressed, summed in the first allreduce; the residual keeps nothing of them. The
default, 16, is higher than PyTorch's hook's 2 on purpose: it leaves a classifier's
``classes x width`` weight whole (a 10-class layer saves under 10x at rank 1), whose
gradient has the rank of the classes and whose rank-1 approximation, amplified by error
feedback at the linearly scaled learning rate of many workers, diverges; the large
matrices, which hold nearly all the traffic, save hundreds of times and stay compressed.

Collectives per step, whatever the number of parameters: the status header's allgather
(every method's collective error check) and two allreduces, each of one fixed shape, so
Horovod negotiates them once. Traffic per rank (ring model, ``b`` bytes per value):
``2 (n - 1) / n * b * (sum over matrices of r (m + c) + uncompressed entries)``, plus the
header.

Tuning: ``rank`` is the main knob. Rank 1 sends least; rank 2 or 4 approximate the
gradient better per step at 2x or 4x the (small) traffic; large learning rates (the
linearly scaled rate of many workers) need the better approximations more. Start at rank
2 and raise it while the accuracy falls short of dense training. ``min_compression``: lower
it (PyTorch's 2) to compress small matrices too, at the risk above. ``start_iteration=K``
exchanges the plain average for the first K steps, as PyTorch's hook does by default;
``warm_start=False`` draws a new ``Q`` every step (worse approximations, as the paper
shows; for comparison only).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import horovod.torch as hvd
import torch

from ..exchange import SelectedCounts, Traffic, allreduce_values
from ..selection import index_dtype
from ..stats import ring_allreduce_bytes
from .base import Aggregate, Compressor, ReduceOp, Selection, as_bool, as_float, as_int
from .registry import register


def orthonormalize_(matrix: torch.Tensor) -> torch.Tensor:
    """Gram-Schmidt over the columns of ``matrix`` (rows x r), in place. A column with no
    component left (a zero gradient) stays zero rather than dividing by zero."""
    tiny = torch.finfo(matrix.dtype).tiny
    for i in range(matrix.shape[1]):
        column = matrix[:, i:i + 1]
        if i:
            done = matrix[:, :i]
            column -= done @ (done.T @ column)
        column /= torch.linalg.vector_norm(column).clamp_min(tiny)
    return matrix


class _Matrix:
    """Where one compressed parameter lies: in the flat vector, in ``P`` and in ``Q``."""

    __slots__ = ("start", "rows", "cols", "p_start", "q_start")

    def __init__(self, start: int, rows: int, cols: int, p_start: int, q_start: int):
        self.start, self.rows, self.cols = start, rows, cols
        self.p_start, self.q_start = p_start, q_start

    @property
    def end(self) -> int:
        return self.start + self.rows * self.cols


@register
class PowerSGDCompressor(Compressor):
    """PowerSGD with error feedback and warm start (see the module docstring).

    Args:
        rank: the rank ``r`` of each matrix's approximation (1, 2, 4 are usual).
        min_compression: compress a matrix only if its entries exceed this many times the
            ``r (m + c)`` numbers its factors hold (smaller ones, a classifier's weight
            among them, go uncompressed; see the module docstring).
        warm_start: start each step's power iteration from the previous step's ``Q``.
        start_iteration: exchange the plain average (one dense allreduce) before this
            iteration, then the low-rank factors.
        seed: seed of the first ``Q`` (equal on every rank, which the optimizer checks).
        error_feedback, fp16_values: see :class:`~horovod_micro.compressors.base.Compressor`
            (with ``fp16_values`` the factors travel as float16).

    Example::

        opt = hvm.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=hvm.Compression.powersgd(rank=2))
    """

    name = "powersgd"

    def __init__(self, rank: int = 1, *, min_compression: float = 16.0,
                 warm_start: bool = True, start_iteration: int = 0, seed: int = 0,
                 error_feedback: bool = True, fp16_values: bool = False):
        super().__init__(1.0, error_feedback=error_feedback, fp16_values=fp16_values)
        self.rank = as_int(rank)
        self.min_compression = as_float(min_compression)
        self.warm_start = as_bool(warm_start)
        self.start_iteration = as_int(start_iteration)
        self.seed = as_int(seed)
        self.shapes: list[tuple[int, ...]] = []
        self.matrices: list[_Matrix] = []
        self.p_numel = self.q_numel = 0
        self.q: torch.Tensor | None = None  # every matrix's Q, one flat buffer
        self._uncompressed: torch.Tensor | None = None  # flat indices sent as they are
        self._all: torch.Tensor | None = None  # arange(N): the aggregate covers everything
        self._out: tuple[torch.Tensor, torch.Tensor] | None = None  # see _buffers
        self._first: torch.Tensor | None = None  # the first Q, where a matrix restarts

    # ----- configuration -------------------------------------------------------------
    def config(self) -> dict:
        config = {k: v for k, v in super().config().items() if k != "density"}
        return {**config, "rank": self.rank, "min_compression": self.min_compression,
                "warm_start": self.warm_start, "start_iteration": self.start_iteration,
                "seed": self.seed}

    def config_error(self) -> str | None:
        r, c, s = self.rank, self.min_compression, self.seed
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            return f"powersgd: rank must be a positive integer, got {r!r}"
        if (isinstance(c, bool) or not isinstance(c, int | float) or not math.isfinite(c)
                or c < 1.0):
            return f"powersgd: min_compression must be a number >= 1, got {c!r}"
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            return f"powersgd: seed must be a non-negative integer, got {s!r}"
        st = self.start_iteration
        if isinstance(st, bool) or not isinstance(st, int) or st < 0:
            return f"powersgd: start_iteration must be a non-negative integer, got {st!r}"
        if not isinstance(self.warm_start, bool):
            return f"powersgd: warm_start must be True or False, got {self.warm_start!r}"
        return self.flags_error()

    def bind_shapes(self, shapes: Sequence[tuple[int, ...]]) -> None:
        self.shapes = [tuple(int(d) for d in shape) for shape in shapes]

    def plan(self, numel: int) -> tuple[list[_Matrix], list[tuple[int, int]]]:
        """The compressed matrices and the (start, end) ranges sent uncompressed, from the
        parameters' shapes (one vector of ``numel`` when none were bound)."""
        matrices, uncompressed = [], []
        start = p_numel = q_numel = 0
        for shape in self.shapes or [(numel,)]:
            size = math.prod(shape)
            rows = shape[0] if len(shape) >= 2 else size
            cols = size // rows if rows else 0
            if len(shape) >= 2 and size > self.min_compression * self.rank * (rows + cols):
                matrices.append(_Matrix(start, rows, cols, p_numel, q_numel))
                p_numel += rows * self.rank
                q_numel += cols * self.rank
            else:
                uncompressed.append((start, start + size))
            start += size
        if start != numel:
            raise ValueError(f"powersgd: the parameters' shapes hold {start} elements, the "
                             f"flat gradient {numel}")
        return matrices, uncompressed

    def bind(self, numel: int, comm) -> None:
        super().bind(numel, comm)
        self.matrices, uncompressed = self.plan(numel)
        self.p_numel = sum(m.rows * self.rank for m in self.matrices)
        self.q_numel = sum(m.cols * self.rank for m in self.matrices)
        self._uncompressed = (torch.cat([torch.arange(a, b) for a, b in uncompressed])
                              if uncompressed else torch.empty(0, dtype=torch.int64))

    def modeled_bytes(self, size: int, numel: int) -> float:
        """The 3-word status header gathered, then two allreduces: every matrix's ``P``
        (``r m`` numbers) with the uncompressed entries, and every ``Q`` (``r c``):
        ``2 (n - 1) / n`` times ``r (m + c)`` per matrix plus the rest, independent of
        ``n``. Needs the parameters' shapes (:meth:`bind_shapes`) to tell the matrices."""
        matrices, uncompressed = self.plan(numel)
        first = sum(m.rows for m in matrices) * self.rank + sum(b - a for a, b in uncompressed)
        second = sum(m.cols for m in matrices) * self.rank
        header = self.modeled_header_bytes(size, numel)
        return header + sum(ring_allreduce_bytes(self.value_bytes() * count, size)[0]
                            for count in (first, second))

    def sent_numbers(self) -> int:
        """The numbers this rank contributes per step: every matrix's ``r (m + c)``
        factors plus the uncompressed entries."""
        return self.p_numel + self.q_numel + int(self._uncompressed.numel())

    # ----- the pipeline --------------------------------------------------------------
    def _initial_q(self, iteration: int, like: torch.Tensor) -> torch.Tensor:
        seed = self.seed if self.warm_start else self.seed * 1_000_003 + iteration + 1
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(self.q_numel, generator=gen, dtype=torch.float64).to(
            dtype=like.dtype, device=like.device)

    def _usable(self, q: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
        """The warm start's ``Q``, made fit for ``P = M Q``, matrix by matrix, in place:

        * orthonormal: the kept ``Q`` is the ranks' mean ``M^T P``, of the gradient's
          scale, so ``P = M Q`` would grow with its square (float16 factors overflow on
          entries of about 16). ``P`` spans the same columns either way, so the
          approximation is unchanged; only its scale on the wire is;
        * restarted from the first ``Q`` where a column is zero or not finite: a step whose
          gradient was exactly zero for a matrix (a zero-initialised layer, one frozen for a
          while) leaves ``Q = 0``, and then ``P = M Q = 0`` for ever.

        ``Q`` is the same on every rank, so every rank decides alike; on the device, with no
        host read."""
        if self._first is None or self._first.device != acc.device \
                or self._first.dtype != acc.dtype:
            self._first = self._initial_q(0, acc)
        for m in self.matrices:
            block = self._q_of(q, m)
            fit = torch.isfinite(block).all() & (torch.linalg.vector_norm(block, dim=0) > 0).all()
            block.copy_(torch.where(fit, block, self._q_of(self._first, m)))
            orthonormalize_(block)
        return q

    def select(self, acc: torch.Tensor, iteration: int) -> Selection:
        # Nothing to choose: every coordinate gets an aggregate. Only the status header
        # travels in the shared index gather (no indices announced).
        return Selection(self._everything_on(acc.device), announced=False)

    def _uncompressed_on(self, device: torch.device) -> torch.Tensor:
        """The flat indices sent as they are, on ``device``."""
        self._everything_on(device)
        return self._uncompressed

    def _everything_on(self, device: torch.device) -> torch.Tensor:
        """``arange(N)`` on ``device`` (made once per device, with the uncompressed
        entries' indices moved there too): the aggregate covers every coordinate."""
        if self._all is None or self._all.device != device:
            self._all = torch.arange(self.numel, dtype=index_dtype(self.numel), device=device)
            self._uncompressed = self._uncompressed.to(device)
        return self._all

    def _q_of(self, buffer: torch.Tensor, m: _Matrix) -> torch.Tensor:
        return buffer[m.q_start:m.q_start + m.cols * self.rank].view(m.cols, self.rank)

    def _p_of(self, buffer: torch.Tensor, m: _Matrix) -> torch.Tensor:
        return buffer[m.p_start:m.p_start + m.rows * self.rank].view(m.rows, self.rank)

    def combine(self, acc, selection, gathered, iteration, reduction: ReduceOp,
                traffic: Traffic) -> Aggregate:
        n, everything = self.comm.size, selection.indices  # _everything_on(acc.device)
        counts = SelectedCounts(gathered.per_rank, gathered.statuses, gathered.reports,
                                gathered.checks, selected=[self.numel] * n)
        if gathered.nonfinite():  # every rank knows from the header: nothing travels
            empty = acc[:0]
            return Aggregate(everything[:0], empty, everything[:0], counts)
        if iteration < self.start_iteration:  # dense warm-up: one allreduce of everything
            values = allreduce_values(self.comm, self.wire(acc).clone(), traffic, hvd.Sum,
                                      1.0, 1.0, role="powersgd-dense").to(acc.dtype)
            return Aggregate(everything, reduction.finish_sum(values, n), everything, counts,
                           kept=self.wire_error(acc))
        if self.q is None or not self.warm_start:
            q = self._initial_q(iteration, acc)
        else:
            q = self._usable(self.q.to(device=acc.device, dtype=acc.dtype, copy=True), acc)
        dense = self._uncompressed_on(acc.device)
        # First allreduce: every matrix's P = M Q, then the uncompressed entries.
        first = torch.empty(self.p_numel + dense.numel(), dtype=acc.dtype, device=acc.device)
        for m in self.matrices:
            torch.mm(acc[m.start:m.end].view(m.rows, m.cols), self._q_of(q, m),
                     out=self._p_of(first, m))
        torch.index_select(acc, 0, dense, out=first[self.p_numel:])
        # What the residual keeps of the uncompressed entries (the wire's rounding), taken
        # before the allreduce sums over them in place.
        dense_kept = self.wire_error(first[self.p_numel:])
        summed_p = allreduce_values(self.comm, self.wire(first), traffic, hvd.Sum, 1.0,
                                    1.0, role="powersgd-p").to(acc.dtype)
        # Second allreduce: Q_w = M^T P with P orthonormal, the same P on every rank.
        local_q = torch.empty(self.q_numel, dtype=acc.dtype, device=acc.device)
        for m in self.matrices:
            p = orthonormalize_(self._p_of(summed_p, m))
            torch.mm(acc[m.start:m.end].view(m.rows, m.cols).T, p, out=self._q_of(local_q, m))
        local_sent = self.wire(local_q)
        summed_q = allreduce_values(self.comm, local_sent.clone(), traffic, hvd.Sum, 1.0,
                                    1.0, role="powersgd-q").to(acc.dtype)
        # The aggregate P (sum Q)^T, and what this rank's share P Q_w^T leaves of M_w,
        # matrix by matrix, into two buffers kept across steps (no fresh N-sized memory
        # to fault in every step).
        values, kept = self._buffers(acc)
        own_q = local_sent.to(acc.dtype)  # what of Q_w reached the sum
        for m in self.matrices:
            p = self._p_of(summed_p, m)
            torch.mm(p, self._q_of(summed_q, m).T, out=values[m.start:m.end].view(m.rows, m.cols))
            torch.addmm(acc[m.start:m.end].view(m.rows, m.cols), p, self._q_of(own_q, m).T,
                        alpha=-1.0, out=kept[m.start:m.end].view(m.rows, m.cols))
        values.index_copy_(0, dense, summed_p[self.p_numel:])
        kept.index_copy_(0, dense, dense_kept)
        next_q = summed_q.div_(n)  # the next warm start, adopted if the step is applied
        return Aggregate(everything, reduction.finish_sum(values, n), everything, counts,
                         kept=kept, learned=next_q)

    def _buffers(self, acc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The aggregate's and the residual's N-sized buffers (2 N numbers of memory)."""
        if self._out is None or self._out[0].dtype != acc.dtype \
                or self._out[0].device != acc.device:
            self._out = (torch.empty_like(acc), torch.empty_like(acc))
        return self._out

    def observe(self, reduced: Aggregate) -> None:
        """An applied step: its averaged ``Q`` is the next step's warm start."""
        if reduced.learned is not None:
            self.q = reduced.learned

    # ----- checkpointing -------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"q": None if self.q is None else self.q.detach().cpu().clone()}

    def load_state_dict(self, state: dict) -> None:
        q = state.get("q")
        if q is not None and (not isinstance(q, torch.Tensor) or q.numel() != self.q_numel):
            raise ValueError(f"powersgd: the state's Q holds "
                             f"{getattr(q, 'numel', lambda: '?')()} numbers, this model's "
                             f"{self.q_numel} (another model or rank?)")
        self.q = None if q is None else q.clone()
