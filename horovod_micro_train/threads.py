"""How many intra-op threads torch uses in each rank.

torch starts one thread per core in every process, so ``n`` ranks on one host put ``n``
times the cores' worth of threads on the cores; the ranks then spend their turns in each
other's spin-waits, and each collective waits for a rank that is not running. Horovod's own
examples pin one thread per rank for this reason. The entry point therefore shares the
cores among the ranks on a host unless told otherwise: ``--threads N`` wins, then
``OMP_NUM_THREADS`` (which torch already follows), then the cores this process may run on
divided by the ranks on this host, at least 1.
"""

from __future__ import annotations

import os

import torch


def cores() -> int:
    """The cores this process may run on (its affinity mask, where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity masks (macOS)
        return os.cpu_count() or 1


def share_cores(requested: int | None, local_ranks: int) -> int:
    """Set and return torch's intra-op threads for one of ``local_ranks`` ranks on this
    host: ``requested`` if given, else as ``OMP_NUM_THREADS`` says if it is set, else an
    equal share of :func:`cores`."""
    if requested is not None:
        torch.set_num_threads(requested)
    elif not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(max(1, cores() // max(1, local_ranks)))
    return torch.get_num_threads()
