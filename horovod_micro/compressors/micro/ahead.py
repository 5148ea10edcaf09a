"""MiCRO with the coordinates agreed a step ahead: one collective per step, no index gather.

MiCRO's own exchange runs two dependent collectives after backward: the owners' indices
are gathered, and only then can the values at them be summed. In this method the
coordinates that step ``t`` applies, ``U_t``, were chosen and agreed during step ``t - 1``,
so step ``t`` needs a single allreduce, which carries three things in one flat vector of
the buffer's dtype (each rank fills its own rows, the others hold zeros, so a sum hands
every rank every rank's rows exactly):

* the values: this rank's ``a_t`` at ``U_t``, in ``n`` rows of ``C`` slots (MiCRO's fixed
  shape, ``C = ceil(1.2 k / n)``); after the sum, the aggregate;
* the next indices: the owner's choice ``U_{t+1}`` in the part it owns at ``t + 1``, as
  part-relative positions (exact in float32 below ``2**24``, which a part must be);
* the header: the status word (NaN/Inf, the overflow bound, input errors, the check
  word), the count, the controller's report and the count before the capacity cut.

**The judgement a step ahead.** At step ``t`` the owner of the part it owns next ranks
``e_{t+1} + w g_t``: the residual this step will leave (``a_t`` with ``U_t`` cleared) plus
``w`` times this step's gradient, the guess of the gradient backward has not computed yet.
The drift judge and the bounded controller work unchanged on that vector. ``w``
(``guess=``) depends on the wrapped optimizer's family, measured in ``bench.scaling``'s
simulator: with SGD (plain, momentum, Nesterov) the residual alone is wrong, since a
coordinate applied at ``t`` is 0 there on every rank and the steady coordinates would go
every other step at most; ``w = 2`` ranks them as MiCRO's own ``a_t`` does. With Adam and
AdamW an arrival moves a weight by about the learning rate whatever its size, so spreading
the arrivals helps and ``w = 0`` does best. ``guess=None`` (default) picks 2 or 0 from the
optimizer (Adam's kind has ``betas``).

The first step applies nothing (no coordinates are agreed yet): its gradient waits in the
residual. The values sent are those of ``a_t`` itself, never a step old.

Costs and limits (figures: BENCHMARKS.md, "Choosing the coordinates a step ahead"):

* 16 bytes per coordinate on a ring allreduce (the positions travel with the values)
  against MiCRO's 12, in one collective instead of two;
* per step, a copy of the residual's next part (``N / n``, for the guess ``g = a - e``) and
  one pass to form the judged vector, beside MiCRO's threshold pass: where a step is bound
  by memory passes over a large part (2 ranks of a 12.6M-weight model) that costs more than
  the gather saves; where collectives' latency dominates (8 ranks of a small model) it wins;
* no checkpoint holds the copy: the first step after a load judges the residual alone; an
  elastic reset drops the agreed coordinates, so its first step applies nothing;
* the choice takes the host rule (on a GPU, host reads), and the positions travel as float
  words: ``fp16_values`` and exact sizes are refused (:meth:`config_error`), and a part
  must be below ``2**24`` elements.

Tune: ``density`` as for ``micro``; ``guess`` only to override the family rule.
"""

from __future__ import annotations

import math
import time

import horovod.torch as hvd
import torch

from ...exchange import SlotsGathered, Traffic
from ...selection import Selection, index_dtype
from ...stats import ring_allreduce_bytes
from ...status import BOUNDED, CODE_BITS, split_status
from ..base import Aggregate, ReduceOp, as_float
from ..registry import register
from .compressor import MicroCompressor, cut_to_slots
from .drift import stamp
from .partition import owned_part, part_bounds

#: Words per rank in the allreduce's header: status code (with the bounded flag), check
#: word, count, report, count before the capacity cut.
HEADER = 5
#: The largest part whose positions float32 carries exactly.
EXACT_POSITIONS = 1 << 24


class Agreed:
    """The coordinates a step applies, as every rank received them: ``slots`` ``(n, C)``
    absolute coordinates, ``valid`` which are in use, ``counts`` per row; row ``r`` lies in
    the part rank ``r`` owns at iteration ``step`` (the one they were chosen for; a skipped
    step leaves them to the next). What each step needs of it is derived once."""

    def __init__(self, slots: torch.Tensor, valid: torch.Tensor, counts: list[int],
                 step: int, numel: int):
        self.slots, self.valid, self.counts, self.step = slots, valid, counts, step
        self.positions = valid.view(-1).nonzero().view(-1)  # in the flat (n * C) slots
        self.flat = slots.view(-1).index_select(0, self.positions)
        self.indices = self.flat.to(index_dtype(numel))
        self.rows = torch.split(self.flat, counts)

    @classmethod
    def load(cls, slots: torch.Tensor, valid: torch.Tensor, step: int, numel: int) -> Agreed:
        return cls(slots, valid, valid.sum(1).tolist(), step, numel)

    def to(self, device: torch.device, numel: int) -> Agreed:
        return Agreed(self.slots.to(device), self.valid.to(device), self.counts, self.step,
                      numel)

    def in_part(self, part: int, start: int) -> torch.Tensor:
        """Its coordinates in ``part`` (starting at ``start``), as positions there: the row
        of the rank that owned the part at :attr:`step`."""
        return self.rows[(part - self.step) % len(self.rows)] - start


def guess_error(guess) -> str | None:
    if guess is None or (isinstance(guess, float) and math.isfinite(guess) and guess >= 0):
        return None
    return f"micro_ahead: guess must be a finite number >= 0 or None, got {guess!r}"


def family_guess(param_groups: list[dict]) -> float:
    """The weight of the previous gradient in the judge for this optimizer: 0 for Adam's
    family (its groups have ``betas``), 2 for SGD's."""
    return 0.0 if any("betas" in g for g in param_groups) else 2.0


@register
class MicroAheadCompressor(MicroCompressor):
    """MiCRO whose coordinates are agreed a step ahead (see the module docstring).

    Args:
        guess: weight of this step's gradient in the judgement for the next step's
            coordinates; ``None`` (default): 2 under SGD, 0 under Adam and AdamW.
        The others: :class:`~horovod_micro.compressors.micro.compressor.MicroCompressor`
        (``controller="bounded"`` with slots, error feedback, float32 values).

    Example::

        opt = hvm.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=hvm.Compression.micro_ahead(density=0.001))
    """

    name = "micro_ahead"

    def __init__(self, density: float = 0.001, *, guess: float | None = None,
                 initial_threshold: float | None = None, controller: str = "bounded",
                 judge: str | None = None, error_feedback: bool = True,
                 fp16_values: bool = False, momentum_masking: bool | None = None,
                 capacity: int | str | None = None):
        super().__init__(density, initial_threshold=initial_threshold, controller=controller,
                         judge=judge, error_feedback=error_feedback, fp16_values=fp16_values,
                         momentum_masking=momentum_masking, capacity=capacity)
        self.guess = as_float(guess)
        self.weight = 2.0 if self.guess is None else self.guess
        self.union: Agreed | None = None  # U_t
        self.saved: tuple[int, torch.Tensor] | None = None  # (t, e_t on t's next part)
        # Ages restarted by the selection before the step's outcome: (indices, old stamps).
        self._early: tuple[torch.Tensor, torch.Tensor] | None = None

    def config(self) -> dict:
        return {**super().config(), "guess": "auto" if self.guess is None else self.guess}

    def config_error(self) -> str | None:
        error = super().config_error() or guess_error(self.guess)
        if error:
            return error
        if (self.controller_name != "bounded" or self.capacity == "exact" or self.fp16_values
                or self.error_feedback is not True):
            return ("micro_ahead: needs controller='bounded' with index slots (capacity "
                    "not 'exact'), error_feedback=True and fp16_values=False: the next "
                    "indices travel as float words in the value allreduce's fixed slots")
        return None

    def fit_optimizer(self, param_groups: list[dict]) -> None:
        if self.guess is None:
            self.weight = family_guess(param_groups)

    def _partition(self, size: int) -> None:
        super()._partition(size)
        largest = max(self._part_sizes())
        if largest > EXACT_POSITIONS:
            raise ValueError(
                f"micro_ahead: a part of {largest} elements (N / n at {size} ranks) is above "
                f"2**24, where float32 no longer carries its positions exactly; use micro")
        self.union = self.saved = self._early = None  # the next step applies nothing
        self._buffers: dict[str, torch.Tensor] = {}

    def modeled_bytes(self, size: int, numel: int) -> float:
        """One ring allreduce of ``n`` rows of ``C`` values, ``C`` next positions and the
        header: ``2 (n - 1) (2 C + 5) b_v``, about ``16 * 1.2 k`` at 4-byte words."""
        if size < 2:
            return 0
        k = self.modeled_count(numel)
        slots = self._slots_for(size, k, max(b - a for a, b in part_bounds(numel, size)))
        return ring_allreduce_bytes(4 * size * (2 * slots + HEADER), size)[0]

    # ----- the step --------------------------------------------------------------------
    def select(self, acc: torch.Tensor, iteration: int) -> Selection:
        """The choice of ``U_{t+1}`` in the part this rank owns at ``t + 1``, as positions
        in that part, ranked by ``e_{t+1} + w g_t``."""
        if self.union is not None and self.union.slots.device != acc.device:  # loaded on the host
            self.union = self.union.to(acc.device, self.numel)
        part = owned_part(self.comm.rank, iteration + 1, self.comm.size)
        start, end = self.bounds[part]
        segment, applied = acc[start:end], self._applied_in(part, start)
        judged = self._buffer("judged", segment)
        if self.weight and self.saved is not None and self.saved[0] == iteration:
            # One pass: (1 + w) a - w e, which is e_{t+1} + w g_t wherever this step leaves
            # a_t in the residual; where it applies U_t, e_{t+1} is 0 and only w g_t stays.
            saved = self.saved[1]
            torch.lerp(saved, segment, 1.0 + self.weight, out=judged)
            if applied is not None:
                judged.index_copy_(0, applied, (segment.index_select(0, applied)
                                                - saved.index_select(0, applied)) * self.weight)
        else:
            judged.copy_(segment)
            if applied is not None:
                judged.index_fill_(0, applied, 0.0)  # e_{t+1}: what this step leaves
        now = iteration + 2  # the next step's
        if self.ages is not None:
            self._undo_early_restart()
            last = self.ages.at(acc.device, now)[start:end]
            if applied is not None:  # U_t restarts at t + 1 (observe: all of it), undone if
                # this step is skipped
                self._early = (applied + start, last.index_select(0, applied))
                last.index_fill_(0, applied, stamp(iteration + 1))
            self.selector.bind(judged, last, now, self.ages.wait(now))
        indices, threshold, report = self.controller.select(
            judged, 0, end - start, part, self.selector, self.rms_scale)
        selected = indices.numel()
        if selected > self.slots:  # the highest scores go, the rest stays in the residual
            indices = cut_to_slots(judged, indices, self.slots, self.ages, now, offset=start)
        return Selection(indices, report=report, selected=selected, threshold=threshold)

    def _buffer(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """A buffer of ``like``'s size, reused from step to step (a part's size, at most
        one apart between parts): a fresh N / n tensor each step costs its page faults."""
        buffer = self._buffers.get(name)
        if (buffer is None or buffer.numel() < like.numel() or buffer.dtype != like.dtype
                or buffer.device != like.device):
            buffer = self._buffers[name] = torch.empty(max(self._part_sizes()),
                                                       dtype=like.dtype, device=like.device)
        return buffer[:like.numel()]

    def skipped(self) -> None:
        self._undo_early_restart()

    def _undo_early_restart(self) -> None:
        """The last selection restarted its part's share of ``U_t`` ahead of the step's
        outcome; a step that was not applied gives it back: at once where it was skipped
        (:meth:`skipped`), at the next selection where its exchange raised."""
        if self._early is not None:
            indices, stamps = self._early
            self.ages.last.index_copy_(0, indices, stamps)
            self._early = None

    def _applied_in(self, part: int, start: int) -> torch.Tensor | None:
        """The positions of ``U_t`` in ``part`` (starting at ``start``); None if nothing is
        agreed."""
        return None if self.union is None else self.union.in_part(part, start)

    def exchange(self, acc: torch.Tensor, selection: Selection, status, iteration: int,
                 reduction: ReduceOp, traffic: Traffic) -> Aggregate:
        """The one allreduce (values at ``U_t``, next positions, header), then the same
        collective error check as every method's exchange."""
        n, rank, slots = self.comm.size, self.comm.rank, self.slots
        payload = acc.new_zeros(n * (2 * slots + HEADER))
        values = payload[:n * slots].view(n, slots)
        positions = payload[n * slots:2 * n * slots].view(n, slots)
        header = payload[2 * n * slots:].view(n, HEADER)
        if self.union is not None:  # 0 in the slots not in use (a NaN must not leak there)
            values.view(-1).index_copy_(0, self.union.positions,
                                        acc.index_select(0, self.union.flat))
        count = selection.indices.numel()
        positions[rank, :count] = selection.indices.to(acc.dtype)
        # The status word in two exact float words (a device word stays on the device).
        header[rank, 0] = status & ((1 << CODE_BITS) - 1)
        header[rank, 1] = status >> CODE_BITS
        header[rank, 2:] = torch.tensor([count, int(selection.report), selection.selected],
                                        dtype=acc.dtype)
        start = time.perf_counter()
        self.comm.allreduce_(payload, "ahead", hvd.Sum, 1.0, 1.0)
        traffic.timed("ahead", start)
        traffic.add(ring_allreduce_bytes(payload.numel() * payload.element_size(), n))
        gathered = self._next(positions, header.tolist(), iteration + 1)
        gathered.raise_errors()
        if self.union is None:
            union = acc.new_zeros(0, dtype=index_dtype(self.numel))
            summed = acc.new_zeros(0)
        else:
            union = self.union.indices
            summed = reduction.finish_sum(values.view(-1).index_select(
                0, self.union.positions), n)
        waited = (self.ages.waited(union, iteration + 1) if self.ages is not None
                  and union.numel() else None)
        learned = (Agreed(gathered.slots, gathered.valid, gathered.sent_counts, iteration + 1,
                          self.numel),
                   self._residual_next(acc, iteration))
        return Aggregate(union, summed, union, gathered, selection.threshold,
                         iteration=iteration, learned=learned, waited=waited)

    def _next(self, positions: torch.Tensor, heads: list[list[float]], step: int
              ) -> SlotsGathered:
        """Every rank's choice for ``step`` as absolute coordinates in ``(n, C)`` slots."""
        n, slots = self.comm.size, self.slots
        starts = torch.tensor([self.bounds[owned_part(r, step, n)][0] for r in range(n)],
                              device=positions.device)
        counts = [int(h[2]) for h in heads]
        valid = (torch.arange(slots, device=positions.device)
                 < torch.tensor(counts, device=positions.device)[:, None])
        absolute = (positions.long() + starts[:, None]).masked_fill_(~valid, 0)
        words = [int(h[0]) | (int(h[1]) << CODE_BITS) for h in heads]
        return SlotsGathered(
            per_rank=[absolute[r, :c] for r, c in enumerate(counts)],
            statuses=[split_status(w)[0] for w in words],
            reports=[int(h[3]) for h in heads],
            checks=[split_status(w)[1] for w in words],
            bounded=[bool(w & BOUNDED) for w in words],
            slots=absolute, valid=valid, selected=[int(h[4]) for h in heads])

    def _residual_next(self, acc: torch.Tensor, iteration: int
                       ) -> tuple[int, torch.Tensor] | None:
        """``e_{t+1}`` on the part this rank owns at ``t + 2``, which the next step's guess
        subtracts from its ``a_{t+1}``; None where no guess is made."""
        if not self.weight:
            return None
        part = owned_part(self.comm.rank, iteration + 2, self.comm.size)
        start, end = self.bounds[part]
        # Into the buffer the judge read this step's e_t from: a skipped step leaves the
        # tag at t, so the next step makes no guess from it.
        residual = self._buffer("saved", acc[start:end]).copy_(acc[start:end])
        applied = self._applied_in(part, start)
        if applied is not None:
            residual.index_fill_(0, applied, 0.0)
        return iteration + 1, residual

    def observe(self, reduced: Aggregate) -> None:
        t, n, gathered = reduced.iteration, self.comm.size, reduced.gathered
        if self.ages is not None and reduced.indices.numel():
            self.ages.restart(reduced.indices.long(), t + 1)
        self.controller.observe(list(gathered.counts), list(gathered.reports),
                                [owned_part(r, t + 1, n) for r in range(n)])
        self.last_threshold = reduced.threshold
        self._cuts.observe(gathered, self.comm.rank == 0, self.slots)
        self.union, self.saved = reduced.learned
        self._early = None  # applied: the early restart stands

    def state_dict(self) -> dict:
        state = super().state_dict()
        if self.union is not None:
            state["union"] = [self.union.slots.cpu().clone(), self.union.valid.cpu().clone(),
                              self.union.step]
        return state

    def load_state_dict(self, state: dict) -> None:
        union = state.get("union")
        if union is not None and (len(union) != 3 or tuple(union[0].shape)
                                  != (self.comm.size, self.slots)):
            raise ValueError("micro_ahead: this state's agreed coordinates were made for "
                             "another number of ranks or slots")
        super().load_state_dict(state)
        # On the host; select() moves it to the gradient's device.
        self.union = None if union is None else Agreed.load(*union, self.numel)
        self.saved = self._early = None  # g_t is not in a checkpoint: e alone is judged next
