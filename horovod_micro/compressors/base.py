"""What every compressor shares: configuration checks, the error-feedback switch and the
hand-off to the exchange.

A compressor answers three questions for the optimizer's pipeline
(:mod:`horovod_micro.reducer`)::

    flatten -> add residual -> select -> exchange -> average -> update residual -> step
                               ^^^^^^    ^^^^^^^^
    select(acc, iteration)    -> Selection: this rank's choice (local, no communication)
    combine(acc, selection,   -> Aggregate: the method's collective pattern after the index
            gathered, ...)       gather; the aggregated coordinates and which of this
                                 rank's coordinates went into them
    observe(reduced)             what the compressor learns from an applied step (e.g.
                                 MiCRO's threshold update from the global count)

The protocol between them is the base class's :meth:`Compressor.exchange`, the same for
every method: one index gather of ``[status, count, report, indices]`` per rank (the indices
only if the method announces them), after which every rank raises the same
:class:`~horovod_micro.status.CollectiveInputError` if any rank reported a bad input, and
the reducer reads the NaN/Inf flags from the same gather. A method's :meth:`combine` then
sees every rank's announced indices and header integer.

A step's own data travels in the data structures, never in an attribute that one stage
leaves on the compressor for the next: what ``combine`` needs of this rank's choice is in
the :class:`Selection` (e.g. ``threshold``), what ``observe`` needs is in the
:class:`Aggregate` (``iteration``, ``threshold``, and ``learned``: what the method adopts
if the step is applied). What a compressor keeps on itself is state that persists across
steps: its controller, PowerSGD's ``Q``, buffers reused step after step, and what
``observe`` stored. ``observe`` runs only for an applied step (the reducer skips it on a
non-finite one), so nothing of a skipped step is adopted.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

import horovod.torch as hvd
import numpy as np
import torch

from ..exchange import Comm, Gathered, Traffic, gather_indices, gather_slots
from ..selection import Selection, index_bytes
from ..stats import ring_allgather_bytes


def as_int(value):
    """An integral setting as a Python int (``np.int64(2)`` is 2); anything else, a bool
    included, unchanged for the settings check to judge. Every rank then names and compares
    the same value alike (``16`` and ``np.int64(16)``)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    return value


def as_bool(value):
    """A flag as a Python bool (``np.True_`` is True); anything else, ``1`` and ``0``
    included, unchanged for the settings check to refuse: ``1 == True``, so the ranks'
    settings would compare equal while their collectives were named apart."""
    if isinstance(value, np.bool_):
        return bool(value)
    return value


def as_float(value):
    """A real-valued setting as a Python float (``16`` and ``16.0`` are one setting, named
    alike on every rank); anything else, a bool included, unchanged."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return value


@dataclass(frozen=True)
class ReduceOp:
    """How contributions combine: Horovod's ``op`` with its pre/post scale factors."""

    op: Any = hvd.Average
    prescale: float = 1.0
    postscale: float = 1.0

    def finish_sum(self, summed: torch.Tensor, size: int) -> torch.Tensor:
        """Turn a plain sum of raw contributions into what ``allreduce(op=...)`` returns."""
        scale = self.prescale * self.postscale
        if self.op == hvd.Average:
            scale /= size
        if scale != 1.0:
            summed.mul_(scale)
        return summed


@dataclass
class Aggregate:
    """Result of one sparse exchange, identical on every rank except ``contributed``.

    Attributes:
        indices: distinct coordinates that received an aggregate (int32 or int64).
        values: the aggregate at ``indices``, ``op`` already applied, in the flat buffer's
            dtype (``acc.dtype``, see :mod:`horovod_micro.reducer`): never narrower.
        contributed: this rank's coordinates whose value went into the aggregate; error
            feedback clears exactly these in this rank's residual on a finite step
            (keeping only :meth:`Compressor.wire_error`, 0 in full precision).
        gathered: the per-rank selections and statuses from the index exchange.
        threshold: the threshold this rank's selection used, for methods that have one
            (:attr:`Selection.threshold`).
        kept: what this rank's residual keeps at ``contributed`` on a finite step (None:
            :meth:`Compressor.wire_error` of the values sent). A method whose share of the
            aggregate is not the value itself (PowerSGD's projection) says what it missed.
            A ``kept`` as long as the flat buffer covers every coordinate in order (then
            ``indices`` and ``contributed`` are ``arange(N)``, ``values`` the whole
            aggregate): the reducer copies it and ``values`` whole, with no index pass.
        iteration: the step this aggregate belongs to (set by :meth:`Compressor.exchange`).
        learned: what the method adopts in :meth:`Compressor.observe` once the step is
            applied, its own type (PowerSGD's averaged ``Q``, the next step's warm start);
            None: nothing. On a skipped step ``observe`` does not run and it is dropped.
        waited: per entry of ``indices``, how many iterations its aggregate accumulated
            (1: this step's gradient alone), for methods that keep the ages (MiCRO's drift
            judge); None elsewhere. Adam's second moment takes a burst by it
            (:func:`~horovod_micro.momentum.prime_adam`).
    """

    indices: torch.Tensor
    values: torch.Tensor
    contributed: torch.Tensor
    gathered: Gathered
    threshold: float | torch.Tensor | None = None
    kept: torch.Tensor | None = None
    iteration: int | None = None
    learned: Any = None
    waited: torch.Tensor | None = None


class Compressor:
    """Base class of the sparse compressors (Horovod's Compressor shape, extended).

    Args:
        density: wanted fraction of coordinates exchanged per iteration, in (0, 1].
        error_feedback: keep what was not sent in a residual and add it to the next
            gradient (on by default; off reproduces the ablation of Sahu et al.).
        fp16_values: send values as float16 on the wire; residuals keep the flat buffer's
            dtype (float32 or float64).
        momentum_masking: after each step, clear the wrapped optimizer's momentum buffer
            at the coordinates that received an aggregate, so that an error-feedback burst
            is applied once instead of being carried on by the momentum
            (:mod:`horovod_micro.momentum`). ``None`` (default): the method's own rule,
            :attr:`masks_momentum`.
    """

    name = "sparse"
    #: With ``momentum_masking=None``, whether the method masks (at every number of ranks).
    masks_momentum: bool = False
    #: Index slots per rank in the exchange's gather, one shape every step (None: exact
    #: variable sizes). A method whose count is bounded sets it when bound.
    slots: int | None = None
    #: Whether every value a rank puts into the value allreduce is an entry of its own
    #: ``a_t`` (or that entry rounded to float16): the reducer then proves the aggregate
    #: finite from the ranks' norms instead of reading it (:data:`~horovod_micro.status.BOUNDED`).
    values_are_entries: bool = False

    def __init__(self, density: float | None, *, error_feedback: bool = True,
                 fp16_values: bool = False, momentum_masking: bool | None = None):
        # A NumPy scalar (np.float32(0.05)) is a number too: held as a Python float.
        if isinstance(density, numbers.Real) and not isinstance(density, bool):
            density = float(density)
        self.density = density
        self.error_feedback = as_bool(error_feedback)
        self.fp16_values = as_bool(fp16_values)
        self.momentum_masking = as_bool(momentum_masking)
        self.numel = 0
        self.comm: Comm | None = None

    # ----- configuration -------------------------------------------------------------
    def config(self) -> dict:
        """Everything that must agree across ranks (compared when the optimizer starts)."""
        config = {"method": self.name, "density": self.density,
                  "error_feedback": self.error_feedback, "fp16_values": self.fp16_values}
        # Named only when it can mask, so that a state written before the option existed
        # (when no method masked) still matches a configuration that never masks.
        if self.momentum_masking or (self.momentum_masking is None
                                     and self.masks_momentum):
            config["momentum_masking"] = ("auto" if self.momentum_masking is None
                                          else self.momentum_masking)
        return config

    def config_error(self) -> str | None:
        """Why this configuration is invalid, or None."""
        d = self.density
        if (isinstance(d, bool) or not isinstance(d, int | float) or not math.isfinite(d)
                or not 0.0 < d <= 1.0):
            return f"{self.name}: density must be a number in (0, 1], got {d!r}"
        return self.flags_error()

    def flags_error(self) -> str | None:
        """Why ``error_feedback``, ``fp16_values`` or ``momentum_masking`` is invalid, or
        None. Flags are bools: ``1`` or ``1.0`` for True would compare equal across ranks
        while naming the collectives apart."""
        for flag in ("error_feedback", "fp16_values"):
            if not isinstance(getattr(self, flag), bool):
                return (f"{self.name}: {flag} must be True or False, got "
                        f"{getattr(self, flag)!r}")
        if not (self.momentum_masking is None or isinstance(self.momentum_masking, bool)):
            return (f"{self.name}: momentum_masking must be True, False or None (the "
                    f"method's default), got {self.momentum_masking!r}")
        return None

    def bind_error(self, numel: int) -> str | None:
        """Why this configuration cannot serve a gradient of ``numel`` elements, or None."""
        if self.density is not None and math.floor(self.density * numel) < 1:
            return (f"{self.name}: density {self.density} selects no element of a "
                    f"{numel}-element gradient (k = floor(density * N) = 0)")
        return None

    def bind_shapes(self, shapes: list[tuple[int, ...]]) -> None:
        """The parameters' shapes, in the flat vector's order; called before :meth:`bind`
        by the reducer. Default: ignored (a compressor sees one flat vector)."""
        del shapes

    def bind(self, numel: int, comm: Comm) -> None:
        """Size the compressor's state for a flat gradient of ``numel`` elements."""
        if self.comm is not None:
            raise RuntimeError(f"this {self.name} compressor already serves an optimizer; "
                               "create one compressor per optimizer")
        self.numel = numel
        self.comm = comm

    def fit_optimizer(self, param_groups: list[dict]) -> None:
        """The wrapped optimizer's parameter groups, once, before its first step, for a
        method whose default depends on the optimizer's family (``micro_ahead``'s guess).
        Default: ignored."""
        del param_groups

    def rebind(self, size: int) -> None:
        """The process set now has ``size`` ranks (an elastic reset): re-derive whatever
        was sized for the old number of ranks. Called on every rank alike, before the
        set's first rank's state is adopted. Default: nothing (the baselines read
        ``comm.size`` at every step)."""
        del size

    def masks(self) -> bool:
        """Whether momentum masking acts. Never at density 1: every coordinate then gets
        this step's aggregate, nothing is a stale burst, and clearing every momentum each
        step would turn the optimizer into plain SGD. Not a function of the number of
        ranks: the bursts it cures come from error feedback at any size."""
        if self.density is not None and self.density >= 1.0:
            return False
        if self.momentum_masking is not None:
            return self.momentum_masking
        return self.masks_momentum

    @property
    def target_count(self) -> int:
        """``k = floor(density * N)``."""
        return math.floor(self.density * self.numel)  # >= 1: bind_error rejects 0

    # ----- the pipeline --------------------------------------------------------------
    def prepare(self, sq_norm: float | torch.Tensor) -> None:
        """Called by the reducer once per step, before :meth:`select`, with the squared L2
        norm of this rank's whole ``a_t`` (from the pass that checks it for NaN/Inf, so it
        costs nothing extra; may be ``inf`` if it overflowed): a float, or where a host
        read would wait for a device (:func:`~horovod_micro.selection.reads_wait`) a 0-dim
        tensor there. A scale every method may use without another pass over N; the
        default ignores it."""

    def select(self, acc: torch.Tensor, iteration: int) -> Selection:
        """This rank's choice among the coordinates of ``acc`` (no communication)."""
        raise NotImplementedError

    def exchange(self, acc: torch.Tensor, selection: Selection, status: int | torch.Tensor,
                 iteration: int, reduction: ReduceOp, traffic: Traffic) -> Aggregate:
        """The protocol every method shares (see the module docstring): the index gather
        with ``status`` (in :attr:`slots` of one fixed shape where the method sets them,
        :func:`~horovod_micro.exchange.gather_slots`), the collective error check, then
        :meth:`combine`."""
        selection, gathered = self.gather(selection, status, traffic)
        gathered.raise_errors()
        reduced = self.combine(acc, selection, gathered, iteration, reduction, traffic)
        reduced.iteration = iteration
        return reduced

    def gather(self, selection: Selection, status: int | torch.Tensor,
               traffic: Traffic) -> tuple[Selection, Gathered]:
        """The index gather: every rank's header and announced indices, in exact sizes or
        in :attr:`slots`. Returns the selection that travelled (a method may replace it
        after seeing the headers, as MiCRO's device-side choice does) and the gather."""
        if self.slots is None:
            return selection, gather_indices(self.comm, selection.sent, status, traffic,
                                             report=selection.report)
        return selection, gather_slots(self.comm, selection.sent, self.slots, status,
                                       traffic, report=selection.report,
                                       selected=selection.selected, count=selection.count)

    def combine(self, acc: torch.Tensor, selection: Selection, gathered: Gathered,
                iteration: int, reduction: ReduceOp, traffic: Traffic) -> Aggregate:
        """The method's own collectives after the index gather; returns the aggregate."""
        raise NotImplementedError

    def observe(self, reduced: Aggregate) -> None:
        """Learn from an applied step's result, from ``reduced`` alone (default:
        nothing). Not called for a skipped (non-finite) step."""

    def skipped(self) -> None:
        """The step just exchanged was not applied (non-finite): drop whatever the
        selection did ahead of the step's outcome (``micro_ahead``'s early restart of the
        ages). Default: nothing; :meth:`observe` is not called for such a step."""

    def threshold(self) -> float | None:
        """The method's current threshold, for statistics (None: it has none)."""
        return None

    def rescale(self, ratio: float) -> None:
        """The gradients' units changed by ``ratio`` (a loss scale grew or backed off):
        scale whatever is measured in them (default: nothing)."""

    def wire(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` as they travel: float16 with ``fp16_values``."""
        return values.to(torch.float16) if self.fp16_values else values

    def wire_error(self, values: torch.Tensor) -> torch.Tensor:
        """What of ``values`` does not survive :meth:`wire`: ``a - float(half(a))`` with
        ``fp16_values``, else zeros. Error feedback keeps it in the residual where the
        value was sent, so the rounding is paid back later instead of lost.

        For gTop-k this is the rounding of the rank's own value: exact for a rank whose
        message holds only its own values, an approximation for an inner tree node or the
        root, whose rounded messages also carry other ranks' values (that remainder belongs
        to no single rank)."""
        if not self.fp16_values:
            return torch.zeros_like(values)
        return values - self.wire(values).to(values.dtype)

    # ----- the byte model ------------------------------------------------------------
    def modeled_bytes(self, size: int, numel: int) -> float:
        """Bytes the busiest rank sends in one exchange among ``size`` ranks over a flat
        float32 gradient of ``numel`` elements, as :attr:`StepStats.bytes_sent` counts them
        (Horovod's ring algorithms; direct for alltoall), when every rank selects its
        target count. Projections to other worker counts use it (``bench/model.py``); the
        tests hold it against real ranks. Every method defines it."""
        raise NotImplementedError(f"{self.name} defines no byte model")

    def modeled_header_bytes(self, size: int, numel: int) -> int:
        """Bytes a rank sends in the status gather when only the 3-word header travels
        (a method whose selection is not announced)."""
        return ring_allgather_bytes([3 * index_bytes(numel)] * size, 0)[0]

    def modeled_count(self, numel: int) -> int:
        """The count each rank selects in the byte model: ``floor(density * numel)``."""
        return math.floor(self.density * numel)

    def value_bytes(self) -> int:
        """Bytes of one value on the wire in the byte model: 2 with ``fp16_values``, else
        float32's 4."""
        return 2 if self.fp16_values else 4

    # ----- checkpointing -------------------------------------------------------------
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        del state

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items() if k != "method")
        return f"{type(self).__name__}({args})"


def config_of(compression) -> dict | None:
    """A sparse method's whole configuration (:meth:`Compressor.config`, defaults
    included), as every run records it; None for Horovod's own compressions (dense)."""
    return compression.config() if isinstance(compression, Compressor) else None
