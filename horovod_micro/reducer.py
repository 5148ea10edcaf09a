"""One sparse exchange of the whole model's gradient, top to bottom.

::

    flatten -> add residual -> select -> exchange -> average -> update residual -> write back

Two N-sized flat buffers, the residual ``e_t`` and the output, trade roles every step, and
no third copy exists. The error-compensated gradient ``a_t = g_t + e_t`` is built in one
pass over N into the output buffer, which the optimizer no longer needs, so the residual
stays untouched until the exchange has succeeded: a collective error
(:class:`~horovod_micro.status.CollectiveInputError`, raised on every rank) leaves the
reducer exactly as it was before the step. After the exchange ``a_t``'s buffer becomes the
residual, keeping ``a_t`` except at the coordinates this rank sent, and the old residual's
buffer becomes the output: the aggregated sparse gradient, whose slices are installed as
the parameters' ``.grad`` (a view per parameter, like DDP's ``gradient_as_bucket_view``),
ready for the wrapped optimizer.

Dtypes. The flat buffers take ``torch.promote_types`` over all parameters' dtypes, float32
at least: one float64 parameter makes the whole flat vector float64, so no float64
gradient is ever rounded to float32; float16/bfloat16 parameters keep a float32 residual,
where small updates add up instead of vanishing. Every method returns its aggregate in the
buffer's dtype, and the write-back casts each parameter's slice to that parameter's dtype
(a view where they agree, a copy where they differ). ``fp16_values`` rounds only what
travels. Selection (:mod:`horovod_micro.selection`): the native kernel serves float32
buffers on CPU; float64 buffers take the torch path (several times slower, exact in
float64), as CUDA tensors do.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .compressors.base import Aggregate, Compressor, ReduceOp, Selection
from .exchange import Comm, Traffic
from .layout import FlatLayout, FrozenSlices
from .momentum import Arrived
from .reducer_checkpoint import ReducerCheckpoint
from .residual_views import ResidualViews
from .selection import reads_wait
from .stats import PhaseClock, StepStats, phase_sync
from .status import BOUNDED, NONFINITE, OK, step_check, with_check


def _all_finite(acc: torch.Tensor, sq_norm: float) -> bool:
    """Whether every entry of ``acc`` is finite, given ``sq_norm = acc . acc`` (a pass
    that happens anyway, for the residual norm). A finite sum of squares proves it, and a
    NaN or Inf entry always makes it non-finite; but finite entries beyond the square
    root of the dtype's range (1.8e19 in float32) overflow it too, so only an infinite
    sum is checked entry by entry: exact, and no extra pass on an ordinary step."""
    return math.isfinite(sq_norm) or bool(torch.isfinite(acc).all())


def _sum_of_squares(x: torch.Tensor) -> torch.Tensor:
    """``x . x`` accumulated in float64 (one conversion of the k-sized ``x``), on the
    device: no host read."""
    x = x.double()
    return torch.dot(x, x)


def _norm_on_read(squared: torch.Tensor, exact_below: float | torch.Tensor,
                  residual: torch.Tensor) -> Callable[[], float]:
    """The residual's norm as :class:`~horovod_micro.stats.StepStats` reads it, from its
    square ``squared`` (a device tensor) computed without a pass over N. Should that
    square be below ``exact_below`` (a difference of sums that may be rounding, or an
    overflow), one exact pass over ``residual``, while it is unchanged."""
    version = residual._version

    def read() -> float:
        value = float(squared)
        if value >= float(exact_below) and math.isfinite(value):
            return math.sqrt(value)
        if residual._version == version:
            return _norm(residual)
        return math.sqrt(max(value, 0.0))
    return read


def _norm(x: torch.Tensor) -> float:
    """L2 norm of a finite ``x`` that cannot overflow: accumulated in float64 (enough for
    any float32 entry) and, should even that overflow (float64 entries beyond 1e154),
    computed again scaled by the largest entry."""
    norm = float(torch.linalg.vector_norm(x, dtype=torch.float64))
    if math.isinf(norm):
        scale = float(x.abs().max())
        norm = scale * float(torch.linalg.vector_norm(x / scale, dtype=torch.float64))
    return norm


def status_word(acc: torch.Tensor, status: int, sq_norm: float | torch.Tensor, check: int,
                bound: float) -> int | torch.Tensor:
    """The header's status word: an input error as reported; otherwise NONFINITE if
    ``a_t`` holds NaN or Inf, and the BOUNDED flag when ``sq_norm`` is below ``bound``
    (:func:`overflow_bound`), with the check word. From a device scalar ``sq_norm`` the
    same decisions are tensor ops and the word stays on the device (no host read); an
    overflowed square is then told from a non-finite entry by one more pass over ``a_t``
    on every step, which a GPU pays (a fraction of the norm's pass) instead of a
    synchronisation; a handful of 0-dim ops (kernel launches) replace the read."""
    if status != OK:
        return with_check(status, check)
    if not isinstance(sq_norm, torch.Tensor):
        if not _all_finite(acc, sq_norm):
            return with_check(NONFINITE, check)
        return with_check(BOUNDED if sq_norm < bound else OK, check)
    # A square below the bound is finite, so every entry is; otherwise the entries tell
    # (a square overflows on finite entries beyond 1.8e19 in float32).
    finite = torch.where(torch.isfinite(acc).all(), with_check(OK, check),
                         with_check(NONFINITE, check))
    bound = min(bound, torch.finfo(sq_norm.dtype).max)  # half the range: room to round
    return torch.where(sq_norm < bound, with_check(BOUNDED, check), finite)


def overflow_bound(compressor: Compressor, layout: FlatLayout, size: int,
                   reduction: ReduceOp) -> float:
    """How small ``||a_t||^2`` must be for the aggregate not to overflow: with a method
    whose values are entries of the ranks' ``a_t``
    (:attr:`~horovod_micro.compressors.base.Compressor.values_are_entries`), each is at
    most ``||a_t||``, so a sum over ``size`` ranks, scaled as Horovod's ``op`` scales it,
    stays below ``size ||a_t||`` times the scale factors (if above 1). Below half the
    range of the wire's dtype (float16 with ``fp16_values``) and of the buffer's, with
    room for the float16 rounding, nothing can overflow, and every rank that knows each
    rank said so (:data:`~horovod_micro.status.BOUNDED`) skips the look at the aggregate:
    one host read fewer on a GPU. 0 for other methods (no square is below it)."""
    if not compressor.values_are_entries:
        return 0.0
    wire = torch.float16 if compressor.fp16_values else layout.dtype
    limit = min(torch.finfo(wire).max, torch.finfo(layout.dtype).max)
    scale = size * max(1.0, abs(reduction.prescale)) * max(1.0, abs(reduction.postscale))
    bound = limit / 2 / scale
    return bound * bound  # inf for float64 buffers: no finite square reaches it


def write_aggregate(acc: torch.Tensor, output: torch.Tensor, applied: torch.Tensor,
                    contributed: torch.Tensor, values: torch.Tensor,
                    keep: torch.Tensor | Callable[[torch.Tensor], torch.Tensor],
                    cleared: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A finite step's writes into the two flat buffers, tensor ops only (one graph for
    ``torch._dynamo``): the residual ``acc`` keeps ``keep`` at the coordinates this rank
    ``contributed`` (a tensor, or what the wire lost of the values sent: a function of
    them), the ``output`` is zeroed (at ``cleared``, or whole where None) and receives the
    aggregate ``values`` at ``applied``. Returns ``(sent, kept)``, for the residual's norm.
    index_select/index_copy_/index_fill_: 3-10x cheaper than advanced indexing at ~1e5
    coordinates (bench/pipeline.py)."""
    sent = acc.index_select(0, contributed)
    kept = keep(sent) if callable(keep) else keep
    acc.index_copy_(0, contributed, kept)
    if cleared is None:
        output.zero_()
    else:
        output.index_fill_(0, cleared, 0.0)
    output.index_copy_(0, applied, values.to(output.dtype))
    return sent, kept


def skip_nonfinite(residual: torch.Tensor, output: torch.Tensor, layout: FlatLayout,
                   reduced: Aggregate) -> float:
    """A non-finite step's writes. Every rank hands NaN to its optimizer (``output``), as
    dense Horovod would spread it, so a GradScaler skips the step everywhere, and the
    threshold stays. Nothing was applied, so the ``residual`` keeps ``a_t``, all of it but
    two kinds of entry, which become 0: its own non-finite entries (they would poison every
    later step) and the coordinates whose aggregate came out non-finite or beyond a
    float16 parameter's range (a value that cannot travel, be summed or be written back
    would overflow again at once and block training for good; every rank holds the same
    aggregate, so every rank drops the same coordinates). Returns the residual's norm."""
    output.fill_(math.nan)
    torch.nan_to_num_(residual, nan=0.0, posinf=0.0, neginf=0.0)
    overflowed = reduced.indices[layout.unrepresentable(reduced.indices, reduced.values)]
    residual.index_fill_(0, overflowed.long(), 0.0)
    return _norm(residual)


@dataclass
class _Step:
    """What one :meth:`SparseReducer.reduce` carries from phase to phase: the phases'
    clock, ``a_t`` (``acc``) and whether it lies in the residual's buffer (``in_place``),
    the parameters frozen after wrapping, ``||a_t||^2`` (None until squared), the status
    backward's views reported, and the exchange's traffic."""

    clock: PhaseClock
    acc: torch.Tensor
    in_place: bool
    frozen: FrozenSlices
    sq_norm: float | torch.Tensor | None
    status: int
    traffic: Traffic = field(default_factory=Traffic)


def step_stats(reducer: SparseReducer, step: _Step, reduced: Aggregate, nonfinite: bool,
               residual_norm: float | Callable[[], float]) -> StepStats:
    """The :class:`StepStats` of one exchange (device scalars are read when asked)."""
    gathered, traffic, clock = reduced.gathered, step.traffic, step.clock
    threshold = reduced.threshold
    compressor, numel = reducer.compressor, reducer.layout.numel
    return StepStats(
        iteration=reducer.iteration,
        method=compressor.name,
        numel=numel,
        target_count=compressor.target_count,
        threshold=threshold.item if isinstance(threshold, torch.Tensor) else threshold,
        rank_counts=gathered.sent_counts,
        selected_counts=gathered.counts,
        global_count=int(reduced.indices.numel()),
        density=reduced.indices.numel() / numel,
        target_density=compressor.density,
        bytes_sent=traffic.sent,
        bytes_received=traffic.received,
        residual_norm=residual_norm,
        select_time=clock.total - traffic.seconds,
        comm_time=traffic.seconds,
        nonfinite=nonfinite,
        phases=clock.seconds,
    )


class SparseReducer(ReducerCheckpoint):
    """Runs a :class:`Compressor` over the flat gradient of a fixed list of parameters."""

    def __init__(self, layout: FlatLayout, compressor: Compressor, comm: Comm,
                 reduction: ReduceOp,
                 stats_callback: Callable[[StepStats], None] | None = None,
                 zero_copy: bool = True):
        self.layout = layout
        self.compressor = compressor
        self.comm = comm
        self.reduction = reduction
        self.stats_callback = stats_callback
        self.iteration = 0
        self.loss_scale = 1.0  # the units of the residual and the threshold
        self.last_stats: StepStats | None = None
        compressor.bind_shapes([tuple(p.shape) for p in layout.params])
        compressor.bind(layout.numel, comm)
        self.residual = torch.zeros(layout.numel, dtype=layout.dtype, device=layout.device)
        self.output = torch.zeros(layout.numel, dtype=layout.dtype, device=layout.device)
        # Zero-copy error feedback: .grad as views of the residual
        # (ResidualViews.error_compensated).
        self.views = ResidualViews(layout, zero_copy)
        # The output's support as this step wrote it, and the output's version counter
        # then (see _support_to_clear): the next step clears only those coordinates.
        self._written: tuple[torch.Tensor, torch.Tensor, int] | None = None
        self.full_clears = 0  # steps that zeroed the whole output (a statistic)
        # Where the last finite step gave an aggregate, and how long each coordinate
        # waited (None after a skipped step): where momentum masking acts once the
        # wrapped optimizer has stepped.
        self.applied: Arrived | None = None
        # What the last write-back put into each .grad (see grads_hold_the_aggregate).
        self._aggregate_grads: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        # Called at every phase boundary when asked (stats.phase_sync), so that
        # StepStats.phases charges a GPU's kernels to their own phase.
        self.phase_sync = phase_sync(layout.device)

    def reduce(self, reported: int = OK) -> StepStats:
        """Exchange the current ``.grad`` of every parameter and replace it by the result.

        ``reported``: an error status the caller found on this rank (PARAMS_CHANGED),
        raised collectively like the reducer's own.

        The phases, each its own method, in the order of the module's diagram:

        1. accumulate: ``a_t = e_t + g_t`` (nothing to do where backward wrote into the
           residual's views);
        2. status: the header's status word (NaN/Inf, the overflow bound, input errors);
        3. select: the compressor's choice in ``a_t``;
        4. exchange: indices gathered, values summed and averaged (the compressor's);
        5. update: the residual keeps what was not sent, the output takes the aggregate;
        6. write back: each ``.grad`` becomes its slice of the output.

        If the exchange raises, nothing was applied: the iteration and the compressor's
        state are those from before the call, and ``a_t`` is kept whole. Where backward
        wrote into the residual (:meth:`install_residual_views`), the residual keeps
        ``a_t``, this step's gradient included, and ``.grad`` still shows it; a gradient
        that came in its own tensor is left where it was, with the residual untouched.
        """
        step = self._accumulate()                           # 1
        word = self._status(step, reported)                 # 2
        selection = self._select(step)                      # 3
        reduced = self._exchange(step, selection, word)     # 4
        nonfinite, residual_norm = self._update(step, reduced)  # 5
        self._write_back()                                  # 6
        step.clock.lap("write_back")
        step.clock.split("exchange", step.traffic.by_role)
        stats = step_stats(self, step, reduced, nonfinite, residual_norm)
        self.iteration += 1
        self.last_stats = stats
        if self.stats_callback is not None:
            self.stats_callback(stats)
        return stats

    def _accumulate(self) -> _Step:
        """1. ``a_t = e_t + g_t``, and ``||a_t||^2`` where it comes on the way."""
        clock = PhaseClock(self.phase_sync)
        watching = self.views.check(self.residual)
        acc, status, in_place, sq_norm = self.views.error_compensated(
            self.residual, self.output, watching)
        if not in_place:  # a_t was written over the output's support
            self._written = None
        frozen = FrozenSlices(self.layout, acc)  # parameters frozen after wrapping
        clock.lap("accumulate")
        return _Step(clock, acc, in_place, frozen, sq_norm, status)

    def _status(self, step: _Step, reported: int) -> int | torch.Tensor:
        """2. The header's status word, from ``||a_t||^2`` (squared now if it was not)."""
        acc, sq_norm = step.acc, step.sq_norm
        if sq_norm is None:  # not squared on the way (zero-copy, or no native kernel)
            sq_norm = torch.dot(acc, acc)
            if not reads_wait(acc):  # a read costs nothing here
                sq_norm = float(sq_norm)
        elif step.frozen:
            sq_norm = sq_norm - step.frozen.squared_norm()
        step.sq_norm = sq_norm
        status = reported if reported != OK else step.status
        word = status_word(acc, status, sq_norm, step_check(self.layout.params),
                           overflow_bound(self.compressor, self.layout, self.comm.size,
                                          self.reduction))
        step.clock.lap("status")
        return word

    def _select(self, step: _Step) -> Selection:
        """3. The compressor's choice in ``a_t`` (its scale from ``||a_t||^2``)."""
        self.compressor.prepare(step.sq_norm)
        selection = self.compressor.select(step.acc, self.iteration)
        step.clock.lap("select")
        return selection

    def _exchange(self, step: _Step, selection: Selection, word) -> Aggregate:
        """4. The compressor's exchange; on an error ``a_t`` is kept whole, and where it
        was built in the output buffer the two buffers trade roles after success."""
        with step.frozen.restored_on_error(step.acc):  # a_t kept whole
            reduced = self.compressor.exchange(step.acc, selection, word, self.iteration,
                                               self.reduction, step.traffic)
        step.clock.lap("exchange")
        if not step.in_place:  # a_t was built in the output buffer: the buffers trade roles
            self.residual, self.output = step.acc, self.residual
        return reduced

    def _update(self, step: _Step, reduced: Aggregate
                ) -> tuple[bool, float | Callable[[], float]]:
        """5. The residual and the output after the exchange: a finite step applies the
        aggregate (:meth:`_apply`), a non-finite one is skipped (:func:`skip_nonfinite`). Returns
        whether it was skipped, and the residual's norm.

        NaN/Inf in some rank's ``a_t`` came with the status; a value that overflowed on
        the wire (fp16_values) or in the sum shows in the aggregate, which every rank holds
        identically, so it is judged the same everywhere without another message. So does
        an aggregate beyond a float16 parameter's range. Where every rank's norm bounds its
        values far below the range (the BOUNDED flag), no look is needed."""
        proven = reduced.gathered.cannot_overflow() and not self.layout.narrow
        nonfinite = reduced.gathered.nonfinite() or (
            not proven and self.layout.any_unrepresentable(reduced.indices, reduced.values))
        if nonfinite:
            self.compressor.skipped()
            self._written = self.applied = None
            residual_norm = skip_nonfinite(self.residual, self.output, self.layout, reduced)
        else:
            residual_norm = self._apply(reduced, step.sq_norm)
        if not self.compressor.error_feedback:
            self.residual.zero_()
            residual_norm = 0.0
        elif step.frozen:  # back after the update, which may rewrite the whole residual
            step.frozen.restore(self.residual)
        step.clock.lap("update")
        return nonfinite, residual_norm

    def _apply(self, reduced: Aggregate, sq_norm: float | torch.Tensor
               ) -> float | Callable[[], float]:
        """A finite step: the aggregate becomes the output; where this rank's value went
        into it, the residual keeps only what the wire lost (0 in full precision, the
        float16 rounding error with ``fp16_values``). Returns the residual's norm, or the
        function that computes it on read (:func:`_norm_on_read`)."""
        acc = self.residual
        if reduced.kept is not None and reduced.kept.numel() == acc.numel():
            return self._apply_everywhere(reduced)
        applied = reduced.indices.long()
        contributed = (applied if reduced.contributed is reduced.indices
                       else reduced.contributed.long())
        keep = self.compressor.wire_error if reduced.kept is None else reduced.kept
        sent, kept = write_aggregate(acc, self.output, applied, contributed, reduced.values,
                                     keep, self._support_to_clear())
        self._written = (self.output, applied, self.output._version)
        self.applied = Arrived(applied, reduced.waited)
        self.compressor.observe(reduced)
        if not isinstance(sq_norm, torch.Tensor) and not math.isfinite(sq_norm):
            return _norm(acc)  # ||a||^2 overflowed on finite entries (on a device: on read)
        # ||a||^2 - ||sent||^2 + ||kept||^2 (float64 sums over k entries): no second pass
        # over N, unless nearly all of ||a||^2 was sent and the difference would be
        # rounding (a 1e20 entry sent, the rest of order 1): then one exact pass.
        rest = sq_norm - _sum_of_squares(sent) + _sum_of_squares(kept)
        return _norm_on_read(rest, 1e-6 * sq_norm, acc)

    def _apply_everywhere(self, reduced: Aggregate) -> Callable[[], float]:
        """A finite step of a method whose aggregate covers every coordinate (PowerSGD):
        two copies, no index pass and no clearing (the whole output is overwritten)."""
        self.residual.copy_(reduced.kept)
        self.output.copy_(reduced.values)
        self._written = None
        self.applied = Arrived(reduced.indices)
        self.compressor.observe(reduced)
        # In the buffer's dtype (several times faster than a float64 pass over N), unless
        # that overflows.
        squared = torch.linalg.vector_norm(self.residual).double().square()
        return _norm_on_read(squared, 0.0, self.residual)

    def _support_to_clear(self) -> torch.Tensor | None:
        """What of the output to zero before this step's aggregate goes in: the previous
        step's support, or None for the whole buffer.

        The output holds the previous step's aggregate: zero outside its support, which
        this reducer wrote itself. So when the output is still that step's buffer and its
        version counter has not moved since (no in-place write into it, nor into the
        ``.grad`` views of it: the optimizer, a clip or an ``unscale_`` after
        ``synchronize()``), zeroing that support (O(k)) restores all zeros. Otherwise (the
        buffers traded roles on an out-of-place step, a NaN fill, a write into ``.grad``)
        the whole buffer is zeroed, a pass over N. One blind spot, shared with the residual
        views: a write through ``.grad.data`` does not move the version counter."""
        written, self._written = self._written, None
        if written is not None and written[0] is self.output \
                and self.output._version == written[2]:
            return written[1]
        self.full_clears += 1
        return None

    def forget_views(self) -> None:
        """The residual is about to be overwritten whole (an elastic restore)."""
        self.views.forget()

    def count_accumulation(self, p: torch.nn.Parameter) -> None:
        """Backward just accumulated into ``p.grad`` (a post-accumulate hook)."""
        self.views.count_accumulation(p, self.residual)

    def install_residual_views(self) -> None:
        """Each ``.grad`` becomes its slice of the residual (:meth:`ResidualViews.install`)."""
        self.views.install(self.residual)

    def _write_back(self) -> None:
        written = []
        for p, view in zip(self.layout.params, self.layout.kept_views(self.output)):
            if not p.requires_grad:  # frozen after wrapping: the optimizer must skip it
                p.grad = None
                continue
            if p.dtype != view.dtype:
                view = view.to(p.dtype)
            p.grad = view
            written.append((p, view))
        self._aggregate_grads = written

    def grads_hold_the_aggregate(self) -> bool:
        """Whether every ``.grad`` is still the tensor the last exchange wrote (none was
        assigned since): a second exchange would then only re-exchange the aggregate, or
        that aggregate as clipped in place, which dense Horovod's second allreduce leaves
        as it is."""
        written = self._aggregate_grads
        return bool(written) and all(p.grad is view for p, view in written)

    def follow_loss_scale(self, scale: float) -> None:
        """Gradients now come scaled by ``scale`` (a GradScaler's, which doubles after
        ``growth_interval`` clean steps and halves on an overflow): the residual and the
        compressor's threshold follow, so that error feedback adds like to like and the
        density holds. Both start unscaled (MiCRO's first threshold is a gradient
        magnitude)."""
        if scale != self.loss_scale:
            ratio, self.loss_scale = scale / self.loss_scale, scale
            self.residual.mul_(ratio)
            self.compressor.rescale(ratio)
