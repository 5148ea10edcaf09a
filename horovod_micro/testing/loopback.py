"""n simulated ranks in one process: a stand-in for Horovod in a compressor's unit tests.

Every sparse exchange is built from three collectives, :class:`~horovod_micro.exchange.Comm`'s
``allgather``, ``allreduce_`` and ``alltoall``. :class:`LoopbackComm` implements them
between threads of one process, one thread per rank, with Horovod's semantics (rank order
of concatenation, pre- and postscale factors, ``Average`` dividing by the size), so a
:class:`~horovod_micro.reducer.SparseReducer` or a method's ``select``/``exchange`` runs
for n ranks in milliseconds, without ``horovodrun``::

    group = LoopbackGroup(3)
    results = group.run(lambda comm: my_rank_body(comm))   # one result per rank

It does not replace the real multi-rank tests (they keep running under ``horovodrun`` on
Gloo and MPI); it makes the inner loop of writing a compressor fast. A rank that raises breaks
the group's barrier, so the other ranks fail at their next collective instead of waiting,
and :meth:`LoopbackGroup.run` re-raises the first real error.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import horovod.torch as hvd
import torch

from ..exchange import Comm


class LoopbackGroup:
    """``size`` simulated ranks that meet at a barrier for every collective."""

    def __init__(self, size: int, timeout: float = 60.0):
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.size = size
        self._barrier = threading.Barrier(size, timeout=timeout)
        self._slots: list = [None] * size

    def comm(self, rank: int, prefix: str = "loopback") -> LoopbackComm:
        return LoopbackComm(prefix=prefix, group=self, index=rank)

    def share(self, rank: int, item) -> list:
        """Every rank's ``item``, by rank: each rank calls this with its own."""
        self._slots[rank] = item
        self._barrier.wait()
        items = list(self._slots)
        self._barrier.wait()  # nobody overwrites a slot before everyone has read it
        return items

    def run(self, body: Callable[[LoopbackComm], object]) -> list:
        """``body(comm)`` on every rank, each in its own thread; the results by rank."""
        results: list = [None] * self.size
        errors: list[BaseException | None] = [None] * self.size

        def rank_main(rank: int) -> None:
            try:
                results[rank] = body(self.comm(rank))
            except BaseException as error:  # noqa: BLE001  re-raised below
                errors[rank] = error
                self._barrier.abort()

        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(self.size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        real = [e for e in errors if e is not None
                and not isinstance(e, threading.BrokenBarrierError)]
        if real or any(errors):
            raise (real or [e for e in errors if e is not None])[0]
        return results


@dataclass
class LoopbackComm(Comm):
    """One simulated rank of a :class:`LoopbackGroup` (see the module docstring)."""

    group: LoopbackGroup = field(default=None, repr=False)  # type: ignore[assignment]
    index: int = 0

    @property
    def rank(self) -> int:
        return self.index

    @property
    def size(self) -> int:
        return self.group.size

    def allgather(self, tensor: torch.Tensor, role: str) -> torch.Tensor:
        return torch.cat(self.group.share(self.index, tensor.clone()))

    def allreduce_(self, tensor: torch.Tensor, role: str, op, prescale: float,
                   postscale: float) -> torch.Tensor:
        parts = self.group.share(self.index, tensor.clone())
        total = torch.zeros_like(tensor)
        for part in parts:  # in rank order, in the tensor's dtype, as a ring would
            total += part * prescale if prescale != 1.0 else part
        scale = postscale / self.size if op == hvd.Average else postscale
        return tensor.copy_(total * scale if scale != 1.0 else total)

    def alltoall(self, tensor: torch.Tensor, splits: list[int],
                 role: str) -> tuple[torch.Tensor, list[int]]:
        sent = self.group.share(self.index, (tensor.clone(), list(splits)))
        chunks = [torch.split(t, s)[self.index] for t, s in sent]
        return torch.cat(chunks), [c.shape[0] for c in chunks]
