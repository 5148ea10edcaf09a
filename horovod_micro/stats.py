"""Per-iteration statistics of a gradient exchange, identical in shape for every method.

Every compressor (MiCRO, the sparse baselines and the dense paths) fills one
:class:`StepStats` per exchange, so one harness can draw actual-vs-user-set density,
bytes on the wire and the time breakdown for all methods. ``DistributedOptimizer``
keeps the latest in ``optimizer.last_stats`` and, if given ``stats_callback``, passes
each one to it.

Bytes are those a bandwidth-optimal ring moves per rank (the algorithm Gloo, MPI and
NCCL use for large messages):

* allgather of blocks ``b_0 .. b_{n-1}`` bytes: rank ``r`` receives every block but its
  own and sends every block but its successor's;
* allreduce of ``m`` bytes: each rank sends and receives ``2 (n - 1) / n * m``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class _OnRead:
    """A float field whose value may be given as a function, called on the first read
    (and then kept): a statistic that costs a host read of a device tensor is paid only
    when someone reads it."""

    def __set_name__(self, owner, name: str) -> None:
        self._slot = "_" + name

    def __get__(self, obj, owner=None):
        if obj is None:  # the dataclass asks for the default
            return 0.0
        value = obj.__dict__[self._slot]
        if callable(value):
            value = obj.__dict__[self._slot] = float(value())
        return value

    def __set__(self, obj, value) -> None:
        obj.__dict__[self._slot] = value


@dataclass
class StepStats:
    """What one exchange did, as seen by this rank.

    Attributes:
        iteration: exchanges completed before this one (0 for the first).
        method: the compressor's name (``micro``, ``topk``, ``none`` ...).
        numel: elements in the flat gradient (``N``).
        target_count: ``k = floor(density * N)`` (``N`` for dense methods).
        threshold: threshold used for this selection (``None`` where there is none); on a
            GPU it is read from the device on its first read, like ``residual_norm``.
        rank_counts: coordinates each rank sent, by rank.
        selected_counts: coordinates each rank's selection picked, by rank: more than
            ``rank_counts`` where a capacity cut kept the rest in the residual (MiCRO's
            ``capacity``); the density controller learns from these.
        global_count: distinct coordinates whose aggregate was applied.
        density: ``global_count / numel``, the actual density.
        target_density: the user-set density (1.0 for dense methods).
        bytes_sent, bytes_received: this rank's traffic for the exchange (ring model).
        residual_norm: L2 norm of this rank's error-feedback residual after the exchange
            (finite for any finite residual: no float32 square overflows it). Computed on
            its first read (on a GPU a host read), so a step nobody asks it of pays none.
            Read it before the next exchange for an exact value: afterwards, in the rare
            case that needs a pass over the residual (nearly all of its energy was sent),
            it is the float64 difference of the sums of squares, clamped at 0.
        select_time: seconds spent selecting on this rank (including flattening and the
            residual update).
        comm_time: seconds spent in collectives on this rank, waiting included.
        nonfinite: whether any rank's gradient held NaN/Inf this iteration.
        phases: seconds per phase of the sparse step on this rank, in order
            (:class:`PhaseClock`): ``accumulate`` (a_t = e_t + g_t), ``status`` (norm,
            NaN/Inf, the header's status word), ``select``, the exchange split into its
            collectives (by role, e.g. ``indices``, ``values``; waiting for other ranks
            included) and
            ``exchange_local`` (the method's own gathers and casts), ``update`` (residual
            and output buffer), ``write_back``.
        momentum_masked: parameters whose momentum buffer was masked after this step
            (:mod:`horovod_micro.momentum`): filled in by ``step()``, after the wrapped
            optimizer's step (``None`` until then, and after ``synchronize()`` alone); 0
            where masking does not act.
    """

    iteration: int
    method: str
    numel: int
    target_count: int
    threshold: float | None = _OnRead()  # type: ignore[assignment]
    rank_counts: list[int] = field(default_factory=list)
    selected_counts: list[int] = field(default_factory=list)
    global_count: int = 0
    density: float = 0.0
    target_density: float = 1.0
    bytes_sent: int = 0
    bytes_received: int = 0
    residual_norm: float = _OnRead()  # type: ignore[assignment]
    select_time: float = 0.0
    comm_time: float = 0.0
    nonfinite: bool = False
    phases: dict[str, float] = field(default_factory=dict)
    momentum_masked: int | None = None

    @property
    def load_imbalance(self) -> float:
        """``max_r(k_r) * n / sum_r(k_r) - 1`` over the counts sent (ExDyna's
        ``load_inc``); 0 when balanced."""
        total = sum(self.rank_counts)
        if total == 0 or not self.rank_counts:
            return 0.0
        return max(self.rank_counts) * len(self.rank_counts) / total - 1.0

    def to_dict(self) -> dict:
        record = asdict(self)
        record["load_imbalance"] = self.load_imbalance
        return record


def ring_allgather_bytes(block_bytes: list[int], rank: int) -> tuple[int, int]:
    """(sent, received) bytes of ``rank`` in a ring allgather of the given blocks."""
    n = len(block_bytes)
    if n <= 1:
        return 0, 0
    total = sum(block_bytes)
    return total - block_bytes[(rank + 1) % n], total - block_bytes[rank]


def ring_allreduce_bytes(nbytes: int, size: int) -> tuple[int, int]:
    """(sent, received) bytes of one rank in a ring allreduce of ``nbytes``."""
    if size <= 1:
        return 0, 0
    moved = 2 * (size - 1) * nbytes // size
    return moved, moved


class StatsLog:
    """Writes :class:`StepStats` as JSON Lines; usable as ``stats_callback``.

    Each record is flushed as it is written, so a run that crashes or is killed leaves
    every completed step on disk (and ``tail -f`` follows a live run).

    Example::

        log = hvm.StatsLog(open(f"stats-rank{hvd.rank()}.jsonl", "w"))
        opt = hvm.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=hvm.Compression.micro(density=0.01),
                                       stats_callback=log)
    """

    def __init__(self, stream: IO[str]):
        self.stream = stream

    def __call__(self, stats: StepStats) -> None:
        self.stream.write(json.dumps(stats.to_dict()) + "\n")
        self.stream.flush()


#: ``HOROVOD_MICRO_SYNC_PHASES=1``: on a GPU, wait for the device at every phase boundary, so
#: that ``StepStats.phases`` charges each kernel to the phase that launched it. It adds a
#: host synchronisation per phase: for measuring, not for training.
SYNC_PHASES_ENV = "HOROVOD_MICRO_SYNC_PHASES"


def phase_sync(device: torch.device) -> Callable[[], object] | None:
    """What :class:`PhaseClock` calls at each boundary on ``device``: ``None`` unless
    ``HOROVOD_MICRO_SYNC_PHASES=1`` and the device is a GPU (a CPU's phases are already
    synchronous)."""
    if os.environ.get(SYNC_PHASES_ENV) != "1" or device.type != "cuda":
        return None
    import torch

    return torch.cuda.synchronize


class PhaseClock:
    """Wall time of consecutive phases: ``lap(name)`` charges the time since the previous
    lap to ``name``. Two ``perf_counter`` reads per phase, so it runs on every step.

    ``sync``: called before every reading (``torch.cuda.synchronize`` in a benchmark on a
    GPU), so that asynchronous kernels are charged to the phase that launched them rather
    than to the next one that waits. It adds a host synchronisation per phase, so the
    reducer leaves it off unless asked (:func:`phase_sync`)."""

    def __init__(self, sync: Callable[[], object] | None = None) -> None:
        self.seconds: dict[str, float] = {}
        self._sync = sync
        if sync is not None:
            sync()
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        if self._sync is not None:
            self._sync()
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self._last
        self._last = now

    def split(self, name: str, parts: dict[str, float]) -> None:
        """Replace phase ``name`` by ``parts`` (seconds measured inside it) and the
        remainder, ``{name}_local``, keeping the order of the phases."""
        total = self.seconds.get(name, 0.0)
        rest = total - sum(parts.values())
        out: dict[str, float] = {}
        for key, value in self.seconds.items():
            if key == name:
                out.update(parts)
                out[f"{name}_local"] = max(rest, 0.0)
            else:
                out[key] = value
        self.seconds = out

    @property
    def total(self) -> float:
        return sum(self.seconds.values())
