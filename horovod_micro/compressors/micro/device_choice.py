"""The bounded controller's choice made on the device: a selection with no host read.

The host rule (:meth:`~.part_controller.PartController.select`) reads the first pass's
count and the ladder's counts, then decides: keep the base threshold, step up the ladder,
pass over the part again lower down, cut at a cliff. On a GPU each read is a host
synchronisation. :func:`choose_in_slots` takes the same decisions with tensor ops and
writes the result straight into the exchange's fixed slots:

* one pass counts the part's scores at every ladder step within ``LEVELS`` of the base
  threshold ``th0`` (``bucketize`` against the steps, then ``histc``): the counts the
  host rule's upward search, band test and downward pass (``J`` steps down, at most
  ``max_down``) would read, all at once;
* the closest step in log ratio, ties toward ``j = 0``, upward from a count at or above the
  target, downward in ``[-J, 0]`` below the band; a cliff's cut is the ``round(t_p)``-th
  largest score (``kthvalue`` among the scores at or above the highest step that still
  counts that many);
* the selection at the chosen threshold compacted into ``slots`` (``nonzero_static``;
  unused slots 0), its count and the report (``j``) as 0-dim device tensors for the
  block's header.

What the device cannot decide, it leaves to the host rule: an upward crossing beyond
``LEVELS`` steps, more scores at the cut than the buffer holds, more picks than the slots
hold (the overflow rule's cut), an all-zero ``a_t``. The report is then :data:`RESELECT`:
after the index gather every rank sees it, the ranks that sent it select again by the host
rule (with its reads) and every rank gathers once more, in the same shape and under the
same name, so with no new negotiation (``MicroCompressor.gather``).
So the result is the host rule's in every case; only such a step pays a second gather.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...selection import ThresholdSelector, index_dtype, reads_wait
from .controller import ThresholdController
from .part_controller import LADDER, PartController

#: The report of a rank whose device-side choice needs the host's rule after all: every rank
#: sees it in the gathered headers, that rank selects again, and every rank gathers again.
RESELECT = -(1 << 30)

#: Ladder steps either side of the base threshold that the device counts at: the host
#: rule's reach downward (``max_down``); upward, a crossing beyond it (a base threshold
#: more than 4x too low) is left to the host.
LEVELS = 128
_tables: dict[tuple, tuple[torch.Tensor, ...]] = {}


def _constants(device: torch.device, buffer: int, slots: int) -> tuple[torch.Tensor, ...]:
    """Made once per device and sizes: ``LADDER ** j`` for ``j = -LEVELS .. LEVELS``
    (float64: the Python floats the host rule multiplies ``th0`` by), ``j`` itself, the
    masks ``j < 0`` and ``j > 0``, and ``arange(buffer)``, ``arange(slots)``."""
    key = (device, buffer, slots)
    if key not in _tables:
        steps = torch.arange(-LEVELS, LEVELS + 1)
        factors = torch.tensor([LADDER ** j for j in range(-LEVELS, LEVELS + 1)],
                               dtype=torch.float64)
        _tables[key] = tuple(t.to(device) for t in (
            factors, steps, steps < 0, steps > 0, torch.arange(buffer), torch.arange(slots)))
    return _tables[key]


@dataclass
class SlotChoice:
    """A selection decided on the device (every field a device tensor).

    Attributes:
        slots: ``slots`` indices (``offset``-based), the first ``count`` in use, the rest 0.
        count: how many slots are in use (0-dim).
        report: the ladder step ``j``, or ``RESELECT`` (0-dim).
        threshold: the threshold applied (0-dim float64).
    """

    slots: torch.Tensor
    count: torch.Tensor
    report: torch.Tensor
    threshold: torch.Tensor


def device_choice(controller: ThresholdController, acc: torch.Tensor, start: int, end: int,
                  part: int, selector: ThresholdSelector, scale: float | torch.Tensor,
                  slots: int | None) -> SlotChoice | None:
    """The choice in ``acc[start:end]`` made on the device, where host reads wait for one
    and the bounded controller sends in fixed slots; None where the host rule runs
    directly: a read costs nothing (the CPU's native path), exact sizes, the other
    controllers, density 1 or an empty part."""
    if not (reads_wait(acc) and isinstance(scale, torch.Tensor) and slots is not None
            and isinstance(controller, PartController) and controller.correct
            and controller.density < 1.0 and end > start and controller.max_down <= LEVELS):
        return None
    th0 = controller.base_threshold(part, scale)
    return choose_in_slots(selector.scores(acc[start:end]).abs(),
                           torch.where(th0 > 0.0, th0, math.inf), selector.capacity,
                           controller, controller.part_target(part), slots, start,
                           acc.numel())


def choose_in_slots(scores: torch.Tensor, th0: torch.Tensor, capacity: int,
                    rule: PartController, target: float, slots: int, offset: int,
                    numel: int) -> SlotChoice:
    """The host rule's choice among ``scores`` (the part's judged values, ``|a|`` or the
    drift score, in absolute value) for a base threshold ``th0`` (a 0-dim float64 device
    tensor, ``inf`` where nothing may be selected) and a part target ``target`` (``rule``:
    the controller, for its band, fine, gamma and max_down), or ``RESELECT`` where only the
    host rule can decide (see the module docstring). ``capacity``: the selector's buffer.
    Tensor ops only, no read and no shape that depends on the data: one graph for
    ``torch._dynamo``."""
    buffer = max(capacity, slots)
    factors, steps, negative, positive, buffer_slots, index_slots = _constants(
        scores.device, buffer, slots)
    levels = th0 * factors  # float64, the host rule's thresholds
    bounds = levels.to(scores.dtype)  # as a comparison with scores rounds them
    # Each score's bucket (how many bounds it reaches), histogrammed: histc over a given
    # range has a fixed size and never reads the device (bincount reads the largest bucket
    # on a GPU); float64 counts are exact.
    buckets = torch.bucketize(scores, bounds, right=True).double()
    below_each = torch.histc(buckets, 2 * LEVELS + 2, -0.5, 2 * LEVELS + 1.5).cumsum(0)
    counts = scores.numel() - below_each[:-1].long()  # counts[i]: scores >= bounds[i]
    errors = torch.log(counts.double().clamp(min=0.5) / target).abs()

    c0 = counts[LEVELS].double()
    upward, below = c0 >= target, c0 < target / rule.band
    depth = torch.ceil(torch.log(rule.gamma * target / c0.clamp(min=0.5))
                       / (2.0 * math.log(LADDER))).clamp(1, rule.max_down)  # descent()
    # Upward: the first minimum over j >= 0; downward: the last over [-depth, 0]; both
    # are the minimum nearest j = 0.
    up = torch.argmin(errors.masked_fill(negative, math.inf))
    outside = positive | (steps < -depth)
    down = 2 * LEVELS - torch.argmin(errors.masked_fill(outside, math.inf).flip(0))
    at = torch.where(upward, up, down.masked_fill(~below, LEVELS)).view(1)
    lowest = (LEVELS - depth.long()).masked_fill(~below, LEVELS).view(1)
    cliff = ((errors.index_select(0, at) > math.log(rule.fine))
             & (counts.index_select(0, lowest) >= target)).view(())

    # The buffer: the scores at the chosen step or, at a cliff, at the highest step that
    # still counts m (the m-th largest is among them).
    m = max(round(target), 1)  # a cliff's lowest count is >= target, so >= m
    highest_m = ((counts >= m).sum() - 1).clamp(min=0).view(1)
    gate = bounds.index_select(0, torch.where(cliff, highest_m, at)).view(())
    chosen = scores >= gate
    first = chosen.sum()
    positions = torch.nonzero_static(chosen, size=buffer, fill_value=0).view(-1)
    used = buffer_slots < first
    values = torch.where(used, scores.index_select(0, positions), 0)
    cut = (torch.kthvalue(values, buffer - m + 1).values if m <= buffer
           else values.new_zeros(()))  # m > buffer: the buffer overflows, reselected
    level = levels.index_select(0, at).view(())
    keep = used & (values >= torch.where(cliff, cut, level.to(values.dtype)))
    count = keep.sum()
    reselect = ((first > buffer) | (count > slots) | (upward & (counts[-1] > target))
                | ~torch.isfinite(th0))

    kept = torch.nonzero_static(keep, size=slots, fill_value=0).view(-1)
    indices = (positions.index_select(0, kept) + offset).masked_fill(index_slots >= count, 0)
    report = torch.where(reselect, RESELECT, steps.index_select(0, at).view(()))
    return SlotChoice(indices.to(index_dtype(numel)), count, report,
                      torch.where(cliff, cut.double(), level))

