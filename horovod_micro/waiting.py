"""How a rank waits for a collective it started: asleep between looks, not spinning.

Why. Horovod 0.28.1's ``synchronize`` waits for a handle by spinning: a loop of
``sched_yield`` that keeps the core busy for the whole wait. A rank that reaches a
collective first spends that time burning a core, and where ranks share cores (more ranks
than cores, as on a workstation or a CPU node, and always beside each rank's own Horovod
background thread, which does the communication) the spinning slows the very ranks and
threads it waits for. The sparse exchange waits at least twice a step, for collectives that
start only after backward, so it pays this in full; a dense allreduce started during
backward has mostly finished by the time anyone waits for it.

What. :func:`wait` looks at the handle with ``hvd.poll`` and sleeps between looks, the pause
doubling from 10 us to :data:`MAX_PAUSE_S`; once the operation is done, ``hvd.synchronize``
returns at once with its result (and raises as it would, should the operation have failed
or Horovod have been shut down). A wait then costs a few microseconds of CPU per look and
ends at most one pause (plus the kernel's timer slack) after the operation did.

Where. Where Horovod runs on Gloo, tensors on the CPU wait asleep: on 8 Gloo ranks of one
2-vCPU machine the main job's iteration took about half the time, dense and MiCRO alike. On MPI
they keep Horovod's wait: Open MPI's own progress loop yields instead of blocking, so the
other ranks' threads stay runnable and a rank that slept wakes a scheduler slice late (the
same job's MiCRO iteration was longer asleep). CUDA tensors keep Horovod's wait too
(a GPU rank normally has cores of its own, and every tenth of a millisecond counts in a GPU
step). ``HOROVOD_MICRO_WAIT=spin`` restores Horovod's wait everywhere, ``sleep`` sleeps
everywhere. Measured in ``BENCHMARKS.md`` ("The main job on loopback ranks").
"""

from __future__ import annotations

import os
import time

import horovod.torch as hvd
import torch

WAIT_ENV = "HOROVOD_MICRO_WAIT"
#: The longest pause between two looks at an operation in progress (seconds).
MAX_PAUSE_S = 1e-4
_FIRST_PAUSE_S = 1e-5


def wait_mode() -> str | None:
    """``"sleep"``, ``"spin"`` or None (asleep for CPU tensors on Gloo, else spinning), from
    ``HOROVOD_MICRO_WAIT``."""
    value = os.environ.get(WAIT_ENV, "").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in ("sleep", "spin"):
        raise ValueError(f"{WAIT_ENV}={value!r}: use 'sleep', 'spin' or leave it unset")
    return value


def _sleeps_for(like: torch.Tensor, mode: str | None) -> bool:
    """Whether a collective on ``like`` is waited for asleep under ``mode``
    (:func:`wait_mode`)."""
    if mode is not None:
        return mode == "sleep"
    return like.device.type != "cuda" and hvd.gloo_enabled()


def wait(handle, like: torch.Tensor, mode: str | None):
    """The result of the Horovod operation ``handle`` on ``like`` (what ``hvd.synchronize``
    returns), waited for asleep between looks or by Horovod's own spinning wait, as ``mode``
    (:func:`wait_mode`) and ``like``'s device decide."""
    if _sleeps_for(like, mode):
        pause = _FIRST_PAUSE_S
        while not hvd.poll(handle):
            time.sleep(pause)
            pause = min(2 * pause, MAX_PAUSE_S)
    return hvd.synchronize(handle)
