"""A deadline on every blocking collective of the sparse exchange, on by default.

Ranks that fall out of step (one calls ``step()`` once more, skips one, or waits in a
different collective) would otherwise wait forever: Horovod 0.28.1 ends such a wait on MPI
only with ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`` set, and on Gloo not at all. Every
blocking collective of the exchange runs inside :func:`bounded`, which costs two attribute
writes on the normal path: the wait itself stays Horovod's blocking ``synchronize``. One
daemon thread per process looks twice a second at the wait in progress; once it has lasted
longer than the deadline, the thread shuts Horovod down. That ends this rank's wait, which
then raises :class:`ExchangeTimeout`, and through Horovod's coordinator every other rank's
pending collective, which raises ``HorovodInternalError`` ("Horovod has been shut down").

Tuning: ``HOROVOD_MICRO_EXCHANGE_TIMEOUT_SECONDS`` (default 45; ``0`` waits forever, as
Horovod's own collectives do). Raise it when one rank legitimately works alone between
steps for longer (evaluation or a slow checkpoint on rank 0 only, while the others wait in
the next exchange).
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager

import horovod.torch as hvd
from horovod.common.exceptions import HorovodInternalError

TIMEOUT_ENV = "HOROVOD_MICRO_EXCHANGE_TIMEOUT_SECONDS"
DEFAULT_TIMEOUT_S = 45.0
_TICK_S = 0.5  # how often the watching thread looks; a deadline fires within one tick


class ExchangeTimeout(HorovodInternalError):
    """A collective of the sparse exchange found no partner within the deadline
    (``HOROVOD_MICRO_EXCHANGE_TIMEOUT_SECONDS``): the ranks are out of step, and Horovod
    was shut down. A ``HorovodInternalError``, as the other ranks' errors are: under
    Elastic Horovod every rank then restores its last commit and resets."""


def timeout_from_env() -> float | None:
    """The deadline in seconds (``None``: wait forever)."""
    value = os.environ.get(TIMEOUT_ENV, "").strip()
    if not value:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={value!r} is not a number of seconds "
                         "(0 waits forever)") from None
    return seconds if seconds > 0 else None


class _Wait:
    """One armed wait: its deadline, its collective's name, and whether it fired."""

    __slots__ = ("deadline", "name", "timeout", "fired", "shut_down")

    def __init__(self, timeout: float, name: str):
        self.timeout, self.name = timeout, name
        self.deadline = time.monotonic() + timeout
        self.fired = False
        self.shut_down = threading.Event()  # set once the watching thread's shutdown returned


class _Watchdog:
    def __init__(self):
        self._lock = threading.Lock()
        self._current: _Wait | None = None
        self._thread: threading.Thread | None = None

    def arm(self, wait: _Wait) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._watch, name="hvm-deadline",
                                            daemon=True)
            self._thread.start()
        self._current = wait

    def disarm(self, wait: _Wait) -> bool:
        """Stop watching ``wait``; whether it fired."""
        with self._lock:
            if self._current is wait:
                self._current = None
            return wait.fired

    def _watch(self) -> None:
        while True:
            time.sleep(_TICK_S)
            wait = self._current
            if wait is None or time.monotonic() <= wait.deadline:
                continue
            with self._lock:  # the main thread may have finished the wait meanwhile
                if self._current is not wait:
                    continue
                wait.fired, self._current = True, None
            try:
                hvd.shutdown()
            finally:
                wait.shut_down.set()


_WATCHDOG = _Watchdog()


@contextmanager
def bounded(name: str, timeout: float | None):
    """Run the blocking collective ``name`` inside; raise :class:`ExchangeTimeout` if it
    lasted longer than ``timeout`` seconds (``None``: no deadline)."""
    if timeout is None:
        yield
        return
    wait = _Wait(timeout, name)
    _WATCHDOG.arm(wait)
    try:
        yield
    except Exception as error:
        if _WATCHDOG.disarm(wait):
            raise _timeout_error(wait) from error
        raise
    if _WATCHDOG.disarm(wait):
        raise _timeout_error(wait)


def _timeout_error(wait: _Wait) -> ExchangeTimeout:
    # The wait may end (its handle cleared) before the shutdown has joined Horovod's
    # background thread: raising now could let the exit's own hvd.shutdown() join the same
    # thread a second time, concurrently, which never returns.
    wait.shut_down.wait(timeout=120)
    return ExchangeTimeout(
        f"{wait.name}: no other rank joined this collective within {wait.timeout:g} s "
        f"({TIMEOUT_ENV}; 0 waits forever). The ranks are out of step: step() or "
        "synchronize() was called more often on some ranks (uneven data?), optimizers were "
        "stepped in a different order, or another rank is in a different collective, or "
        "gone. Horovod was shut down so that every rank stops.")
