"""Sparse collectives built from Horovod's own operations (never patched).

Every exchange starts with one ``allgather`` of an int32 block per rank::

    [status, count, report, i_1 ... i_count]      (int64 blocks when N >= 2**31)

* the header means no rank ever contributes an empty tensor (an empty
  contribution breaks other libraries' collectives on Gloo) and gives every rank every
  other rank's count and status with no extra message;
* ``status`` is the status word (:mod:`horovod_micro.status`): per-rank conditions that
  must be acted on collectively (NaN/Inf in the gradient, a gradient this method cannot
  take, parameters changed after wrapping) and a check word every rank must hold alike
  (which parameters are frozen); every rank raises or reacts identically, so one rank's
  bad input never leaves the others waiting;
* ``report`` is what the rank reports about its selection, for the method's own use
  (:class:`~horovod_micro.compressors.base.Selection`).

An overflow that happens only on the wire (a float16 value beyond 65504, or a sum beyond
the dtype's range) needs no status: it shows in the aggregate, which every rank holds
identically; the reducer checks it there.

Two block shapes. A collective whose shape changes from step to step misses Horovod's
response cache (keyed by name and shape) and is negotiated through the coordinator again
every step; on NCCL an allgather of unequal sizes also runs as one broadcast per rank
instead of one allgather. So where a method's count has a bound, its blocks have one fixed
shape (:func:`gather_slots`): ``capacity`` index slots per rank behind a 4-integer header,
the unused slots marked by the count, and the value allreduce over every rank's slots
(``n * capacity`` values, zeros in the unused ones). MiCRO with its default controller
holds each owner's count within about 10 % of ``k / n`` and sends in slots of ``1.2 k / n``
(:class:`~horovod_micro.compressors.micro.MicroCompressor`, ``capacity=``). A count with
no such bound (a fixed threshold, MiCRO's shared-threshold controllers, whose counts
scatter by tens of percent) would need a capacity far above the mean, so those keep exact
variable-size blocks (:func:`gather_indices`): ``[status, count, report, indices]``. Top-k,
Random-k and gTop-k select exactly ``k`` per rank, so their shapes are fixed as they are.
CLT-k's leader sends ``k`` indices and the others only a header, and the leader rotates, so
each rank's block changes shape every step; one fixed shape would cost ``k`` slots on every
rank (``n`` times the index bytes) or an allreduce of the leader's indices (twice them), so
it keeps exact sizes too.

Bytes are accounted with the ring model of :mod:`horovod_micro.stats`.
"""

from __future__ import annotations

import math
import pickle
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import horovod.torch as hvd
import torch

from .deadline import arrival_from_env, bounded, stall_warning_from_env, timeout_from_env
from .stats import ring_allgather_bytes, ring_allreduce_bytes
from .status import NONFINITE, is_bounded, raise_reported, split_status
from .waiting import wait, wait_mode


@dataclass
class Traffic:
    """Bytes and seconds spent in collectives during one exchange on this rank."""

    sent: int = 0
    received: int = 0
    seconds: float = 0.0
    by_role: dict[str, float] = field(default_factory=dict)

    def add(self, sent_received: tuple[int, int]) -> None:
        self.sent += sent_received[0]
        self.received += sent_received[1]

    def timed(self, role: str, start: float) -> None:
        """Charge the time since ``start`` (``perf_counter``) to the collective ``role``."""
        spent = time.perf_counter() - start
        self.seconds += spent
        self.by_role[role] = self.by_role.get(role, 0.0) + spent


@dataclass
class Comm:
    """The process set an optimizer exchanges over, and names for its collectives.

    Horovod matches collectives across ranks by name; a fixed name per role lets its
    response cache recognise the same operation every step.
    """

    process_set: hvd.ProcessSet = field(default_factory=lambda: hvd.global_process_set)
    prefix: str = "hvm"
    #: seconds a collective after an exchange's first may wait for the other ranks
    #: (:mod:`horovod_micro.deadline`; ``None``: forever)
    timeout: float | None = field(default_factory=timeout_from_env)
    #: seconds an exchange's first collective may wait for the other ranks to reach it
    arrival_timeout: float | None = field(default_factory=arrival_from_env)
    #: seconds between stall warnings while a collective waits (``None``: none)
    warn_every: float | None = field(default_factory=stall_warning_from_env)
    #: how a rank waits for a collective (:func:`~horovod_micro.waiting.wait_mode`; None:
    #: asleep for CPU tensors on Gloo, else Horovod's wait)
    wait: str | None = field(default_factory=wait_mode)
    #: whether the next collective is an exchange's first (:meth:`begin_exchange`)
    arriving: bool = field(default=True, repr=False)

    def begin_exchange(self) -> None:
        """The next collective is the first of an exchange: it waits up to the arrival
        deadline, since a rank may work alone between steps (:mod:`.deadline`)."""
        self.arriving = True

    @contextmanager
    def _bounded(self, role: str):
        arrival = self.arriving
        with bounded(self.name(role), self.arrival_timeout if arrival else self.timeout,
                     arrival, self.warn_every):
            yield
        self.arriving = False

    @property
    def rank(self) -> int:
        return self.process_set.rank()

    @property
    def size(self) -> int:
        return self.process_set.size()

    def name(self, role: str) -> str:
        return f"{self.prefix}.{role}"

    # The three collectives every sparse exchange is built from. Everything in this module
    # goes through them, so an in-process group (horovod_micro.testing.loopback) can stand in for
    # Horovod in unit tests of a compressor.
    def allgather(self, tensor: torch.Tensor, role: str) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along dim 0, in rank order."""
        with self._bounded(role):
            return wait(hvd.allgather_async(tensor, name=self.name(role),
                                            process_set=self.process_set),
                        tensor, self.wait)

    def allreduce_(self, tensor: torch.Tensor, role: str, op, prescale: float,
                   postscale: float) -> torch.Tensor:
        """Horovod's ``allreduce_``: ``postscale * sum(prescale * x)`` (``/ size`` for
        ``op=hvd.Average``), in place."""
        with self._bounded(role):
            return wait(hvd.allreduce_async_(tensor, name=self.name(role), op=op,
                                             prescale_factor=prescale,
                                             postscale_factor=postscale,
                                             process_set=self.process_set),
                        tensor, self.wait)

    def alltoall(self, tensor: torch.Tensor, splits: list[int],
                 role: str) -> tuple[torch.Tensor, list[int]]:
        """Rows ``splits[d]`` of ``tensor`` to rank ``d``; what arrived, and its row counts
        by source rank."""
        with self._bounded(role):
            output, received = wait(hvd.alltoall_async(
                tensor, splits=torch.tensor(splits, dtype=torch.int32),
                name=self.name(role), process_set=self.process_set),
                tensor, self.wait)
        return output, [int(c) for c in received]

    def broadcast_object(self, obj, root_rank: int, role: str):
        """``obj`` of Horovod rank ``root_rank`` (a member of the set), on every rank: two
        broadcasts, its pickled length and then its bytes."""
        root = hvd.rank() == root_rank
        payload = (torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
                   if root else torch.empty(0, dtype=torch.uint8))
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        with self._bounded(role):
            size = hvd.broadcast(size, root_rank, name=self.name(f"{role}-size"),
                                 process_set=self.process_set)
            if not root:
                payload = torch.empty(int(size[0]), dtype=torch.uint8)
            payload = hvd.broadcast(payload, root_rank, name=self.name(role),
                                    process_set=self.process_set)
        return pickle.loads(payload.numpy().tobytes())


@dataclass
class Gathered:
    """Every rank's selected indices, as gathered by :func:`gather_indices`."""

    per_rank: list[torch.Tensor]
    statuses: list[int]
    reports: list[int]
    checks: list[int] = field(default_factory=list)
    #: per rank, the status word's :data:`~horovod_micro.status.BOUNDED` flag
    bounded: list[bool] = field(default_factory=list)

    @property
    def counts(self) -> list[int]:
        """What each rank's selection picked (what a density controller learns from)."""
        return [int(t.numel()) for t in self.per_rank]

    @property
    def sent_counts(self) -> list[int]:
        """What each rank sent: :attr:`counts`, less what a capacity cut left behind."""
        return self.counts

    def nonfinite(self) -> bool:
        return any(s == NONFINITE for s in self.statuses)

    def cannot_overflow(self) -> bool:
        """Every rank's ``a_t`` was too small for a sum of the ranks' values to overflow."""
        return bool(self.bounded) and all(self.bounded)

    def raise_errors(self) -> None:
        """Raise the same error on every rank if any rank reported one."""
        raise_reported(self.statuses, self.checks)


def _header(values: list[int], status: int | torch.Tensor, like: torch.Tensor
            ) -> torch.Tensor:
    """A block header ``[status, *values]`` on ``like``'s device, in its dtype: built on
    the host and copied without waiting for the device (on a GPU a tensor made with
    ``device=`` would be a blocking copy: a host synchronisation); a status word computed
    on the device (a 0-dim tensor) is copied in there, never read by the host."""
    on_device = isinstance(status, torch.Tensor)
    header = torch.tensor([0 if on_device else status, *values], dtype=like.dtype).to(
        like.device, non_blocking=True)
    if on_device:
        header[0] = status
    return header


def gather_indices(comm: Comm, indices: torch.Tensor, status: int | torch.Tensor,
                   traffic: Traffic, report: int = 0, role: str = "indices") -> Gathered:
    """Allgather every rank's ``indices`` (1-D, any length, int32 or int64) with a status
    (an integer, or a 0-dim integer tensor on the indices' device)."""
    header = _header([indices.numel(), report], status, indices)
    block = torch.cat([header, indices])
    start = time.perf_counter()
    gathered = comm.allgather(block, role)
    traffic.timed(role, start)

    host = gathered if gathered.device.type == "cpu" else gathered.cpu()
    per_rank, statuses, checks, reports, sizes, bounded = [], [], [], [], [], []
    pos, head = 0, header.numel()
    for _ in range(comm.size):
        rank_status, count, rank_report = host[pos : pos + head].tolist()  # one read
        code, check = split_status(rank_status)
        statuses.append(code)
        checks.append(check)
        bounded.append(is_bounded(rank_status))
        reports.append(rank_report)
        per_rank.append(gathered[pos + head : pos + head + count])
        sizes.append((count + head) * block.element_size())
        pos += head + count
    traffic.add(ring_allgather_bytes(sizes, comm.rank))
    return Gathered(per_rank, statuses, reports, checks, bounded)


def allreduce_values(comm: Comm, values: torch.Tensor, traffic: Traffic, op,
                     prescale: float, postscale: float, role: str = "values") -> torch.Tensor:
    """Sum (or average, with ``op=hvd.Average``) ``values`` across ranks, in place."""
    if values.numel() == 0:
        return values
    start = time.perf_counter()
    comm.allreduce_(values, role, op, prescale, postscale)
    traffic.timed(role, start)
    traffic.add(ring_allreduce_bytes(values.numel() * values.element_size(), comm.size))
    return values


def allgather_values(comm: Comm, values: torch.Tensor, counts: list[int], traffic: Traffic,
                     role: str = "pair-values") -> torch.Tensor:
    """Allgather per-rank value vectors whose lengths ``counts`` are already known."""
    start = time.perf_counter()
    gathered = comm.allgather(values, role)
    traffic.timed(role, start)
    traffic.add(ring_allgather_bytes([c * values.element_size() for c in counts], comm.rank))
    return gathered


def allgather_object(comm: Comm, obj) -> list:
    """Every rank's picklable ``obj``, by rank (``hvd.allgather_object`` of Horovod 0.28
    takes no process set)."""
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    sizes = comm.allgather(torch.tensor([payload.numel()]), "object-sizes").tolist()
    data = comm.allgather(payload, "object")
    return [pickle.loads(chunk.numpy().tobytes()) for chunk in torch.split(data, sizes)]


@dataclass
class SelectedCounts(Gathered):
    """A :class:`Gathered` whose per-rank selection sizes are not the gathered blocks'.

    Random-k and gTop-k send only the header in the status exchange (their indices travel
    otherwise, or are known everywhere); ``selected`` holds what each rank selected, so
    ``StepStats.rank_counts`` means the same for every method.
    """

    selected: list[int] = field(default_factory=list)

    @property
    def counts(self) -> list[int]:
        return list(self.selected)


#: Integers ahead of the index slots in a fixed-capacity block:
#: ``status, count (slots in use), report, selected (the count before the capacity cut)``.
FIXED_HEADER = 4


@dataclass
class SlotsGathered(SelectedCounts):
    """A fixed-capacity index gather (:func:`gather_slots`): ``per_rank`` holds each rank's
    slots in use; ``slots`` the gathered ``(n, capacity)`` index slots themselves and
    ``valid`` which of them are in use, for a value exchange of the same fixed shape;
    ``selected`` what each rank's threshold picked before the capacity cut (what the
    density controller learns from)."""

    slots: torch.Tensor | None = None
    valid: torch.Tensor | None = None

    @property
    def sent_counts(self) -> list[int]:
        return [int(t.numel()) for t in self.per_rank]


def slots_block(indices: torch.Tensor, status: int | torch.Tensor, count: torch.Tensor,
                report: int | torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """The fixed-capacity block ``[status, count, report, selected, *indices]`` assembled on
    the indices' device from device words (0-dim tensors; ``status`` and ``report`` may be
    host integers), with no host read: tensor ops only, one graph for ``torch._dynamo``."""
    header = _header([0, 0, 0], status, indices)
    for word, value in enumerate((count, report, selected), start=1):
        header[word] = value
    return torch.cat([header, indices])


def gather_slots(comm: Comm, indices: torch.Tensor, capacity: int, status: int | torch.Tensor,
                 traffic: Traffic, report: int | torch.Tensor = 0,
                 selected: int | torch.Tensor | None = None,
                 count: torch.Tensor | None = None, role: str = "indices") -> SlotsGathered:
    """Allgather every rank's ``indices`` (at most ``capacity``) in a block of one fixed
    shape, ``[status, count, report, selected, i_1 ... i_count, 0 ...]``: the unused slots
    hold index 0 and are marked unused by ``count``. The shape and the name are the same
    every step, so Horovod's response cache recognises the collective and skips its
    negotiation, and NCCL can run it as one allgather. One host read per step: the
    headers, in a single ``tolist()``.

    ``count`` given (a 0-dim device tensor): ``indices`` already fill all ``capacity``
    slots, the first ``count`` in use, and ``report`` and ``selected`` may be device
    tensors too: the block is assembled on the device, with no read."""
    on_device = count is not None
    if not on_device:
        count = indices.numel()
        if count > capacity:
            raise ValueError(f"{count} indices do not fit a capacity of {capacity}")
    words = (count, report, count if selected is None else selected)
    if on_device:
        block = slots_block(indices, status, *words)
    else:
        block = torch.zeros(FIXED_HEADER + capacity, dtype=indices.dtype,
                            device=indices.device)
        block[:FIXED_HEADER] = _header(list(words), status, indices)
        block[FIXED_HEADER:FIXED_HEADER + count] = indices
    start = time.perf_counter()
    gathered = comm.allgather(block, role).view(comm.size, FIXED_HEADER + capacity)
    traffic.timed(role, start)
    traffic.add(ring_allgather_bytes([block.numel() * block.element_size()] * comm.size,
                                     comm.rank))

    heads = gathered[:, :FIXED_HEADER].tolist()
    slots = gathered[:, FIXED_HEADER:]
    positions = torch.arange(capacity, device=slots.device)
    valid = positions < gathered[:, 1:2]
    return SlotsGathered(
        per_rank=[slots[r, :head[1]] for r, head in enumerate(heads)],
        statuses=[split_status(head[0])[0] for head in heads],
        reports=[head[2] for head in heads],
        checks=[split_status(head[0])[1] for head in heads],
        bounded=[is_bounded(head[0]) for head in heads],
        slots=slots, valid=valid, selected=[head[3] for head in heads])


def alltoall_bytes(sent_rows: list[int], received_rows: list[int], row_bytes: int,
                   rank: int) -> tuple[int, int]:
    """(sent, received) bytes of ``rank`` in one Horovod ``alltoall`` (direct model).

    Payload goes straight to each destination (Gloo's and MPI's alltoallv), nothing is
    forwarded; the slice a rank keeps for itself crosses no link. Horovod first exchanges
    the split sizes with an alltoall of one int32 per rank pair
    (``Controller::AlltoallGetRecvSplits``), counted here: ``4 (n - 1)`` bytes each way.
    """
    n = len(sent_rows)
    if n <= 1:
        return 0, 0
    sent = sum(c for d, c in enumerate(sent_rows) if d != rank) * row_bytes
    received = sum(c for s, c in enumerate(received_rows) if s != rank) * row_bytes
    return sent + 4 * (n - 1), received + 4 * (n - 1)


def alltoall_tensor(comm: Comm, tensor: torch.Tensor, splits: list[int], traffic: Traffic,
                    role: str = "alltoall") -> tuple[torch.Tensor, list[int]]:
    """Send rows ``splits[d]`` of ``tensor`` (in rank order) to set-rank ``d``; return what
    arrived (in source order) and how many rows came from each rank.

    With all splits but one zero this is a point-to-point send inside a collective: every
    rank of the set must still call it (Horovod has no send/recv), possibly with nothing.
    """
    start = time.perf_counter()
    output, received = comm.alltoall(tensor, splits, role)
    traffic.timed(role, start)
    received = [int(c) for c in received]
    row_bytes = tensor.element_size() * math.prod(tensor.shape[1:])
    traffic.add(alltoall_bytes(splits, received, row_bytes, comm.rank))
    return output, received
