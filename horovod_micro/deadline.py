"""Deadlines on the blocking collectives of a sparse exchange, and a stall warning.

Ranks that fall out of step (one calls ``step()`` once more, skips one, or waits in a
different collective) would otherwise wait forever: Horovod 0.28.1 ends such a wait on MPI
only with ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`` set, and on Gloo not at all. But a rank
that works alone between steps (rank 0 evaluating or writing a checkpoint while the others
go on into the next step) makes the others wait too, and stock Horovod lets them. So every
exchange has two deadlines:

* **arrival** (``HOROVOD_MICRO_ARRIVAL_TIMEOUT_SECONDS``, default 1800 s, PyTorch's default
  for a Gloo process group): how long the exchange's *first* collective waits for every
  other rank to reach the same step. Long, since a healthy job waits here whenever one rank
  works alone. From ``HOROVOD_STALL_CHECK_TIME_SECONDS`` (Horovod's own setting, 60 s by
  default; ``HOROVOD_STALL_CHECK_DISABLE=1`` turns it off) the waiting rank prints a warning
  that names the collective, and repeats it at that interval, as Horovod's stall inspector
  does on MPI;
* **in step** (``HOROVOD_MICRO_EXCHANGE_TIMEOUT_SECONDS``, default 45 s): every later
  collective of the exchange. Once every rank has joined the first one, the rest depend only
  on each rank's own selection (milliseconds), so a wait there means the ranks went different
  ways within the step.

``0`` waits forever (as Horovod's own collectives do); an exchange timeout of ``0`` also makes
the arrival wait forever unless the arrival is set. An arrival is never shorter than the
in-step deadline.

Every collective runs inside :func:`bounded`, which costs two attribute writes on the normal
path: the wait itself stays Horovod's blocking ``synchronize``. One daemon thread per process
looks twice a second at the wait in progress; once it has lasted longer than its deadline,
the thread shuts Horovod down. That ends this rank's wait, which then raises
:class:`ExchangeTimeout`, and through Horovod's coordinator every other rank's pending
collective, which raises ``HorovodInternalError`` ("Horovod has been shut down").
"""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager

import horovod.torch as hvd
from horovod.common.exceptions import HorovodInternalError

TIMEOUT_ENV = "HOROVOD_MICRO_EXCHANGE_TIMEOUT_SECONDS"
ARRIVAL_ENV = "HOROVOD_MICRO_ARRIVAL_TIMEOUT_SECONDS"
DEFAULT_TIMEOUT_S = 45.0
DEFAULT_ARRIVAL_S = 1800.0  # torch.distributed's default timeout for a Gloo process group
STALL_ENV = "HOROVOD_STALL_CHECK_TIME_SECONDS"  # Horovod's own stall-warning interval
STALL_DISABLE_ENV = "HOROVOD_STALL_CHECK_DISABLE"
DEFAULT_STALL_S = 60.0  # Horovod's default for STALL_ENV
_TICK_S = 0.5  # how often the watching thread looks; a deadline fires within one tick


class ExchangeTimeout(HorovodInternalError):
    """A collective of the sparse exchange found no partner within its deadline (the
    arrival deadline for an exchange's first collective, the in-step deadline for the
    others; :mod:`horovod_micro.deadline`): the ranks are out of step, and Horovod was
    shut down. A ``HorovodInternalError``, as the other ranks' errors are: under Elastic
    Horovod every rank then restores its last commit and resets."""


def _seconds(name: str, default: float | None) -> float | None:
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a number of seconds "
                         "(0 waits forever)") from None
    return seconds if seconds > 0 else None


def timeout_from_env() -> float | None:
    """The in-step deadline in seconds (``None``: wait forever)."""
    return _seconds(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)


def arrival_from_env() -> float | None:
    """The arrival deadline in seconds (``None``: wait forever): the variable if set, else
    1800 s, or forever where the in-step deadline is off; never below the in-step one."""
    in_step = timeout_from_env()
    arrival = _seconds(ARRIVAL_ENV, DEFAULT_ARRIVAL_S if in_step is not None else None)
    if arrival is None or in_step is None:
        return arrival
    return max(arrival, in_step)


def stall_warning_from_env() -> float | None:
    """Seconds between stall warnings (Horovod's settings; ``None``: no warnings)."""
    if os.environ.get(STALL_DISABLE_ENV, "").strip() in ("1", "true", "True"):
        return None
    return _seconds(STALL_ENV, DEFAULT_STALL_S)


class _Wait:
    """One armed wait: its deadline, its collective's name, and whether it fired."""

    __slots__ = ("start", "deadline", "name", "timeout", "arrival", "fired", "shut_down",
                 "warn_every", "next_warning")

    def __init__(self, timeout: float | None, name: str, arrival: bool,
                 warn_every: float | None):
        self.timeout, self.name, self.arrival = timeout, name, arrival
        self.start = time.monotonic()
        self.deadline = None if timeout is None else self.start + timeout
        self.warn_every = warn_every
        self.next_warning = None if warn_every is None else self.start + warn_every
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
            if wait is None:
                continue
            now = time.monotonic()
            if wait.next_warning is not None and now > wait.next_warning:
                wait.next_warning += wait.warn_every
                _stall_warning(wait, now - wait.start)
            if wait.deadline is None or now <= wait.deadline:
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


def _stall_warning(wait: _Wait, waited: float) -> None:
    if wait.arrival:
        why = ("for the other ranks to reach this step. Expected while one rank works alone "
               "(evaluation or a checkpoint on rank 0 only)")
        env = ARRIVAL_ENV
    else:
        why = ("although every rank entered this exchange: the ranks went different ways "
               "within the step")
        env = TIMEOUT_ENV
    end = ("waits forever" if wait.timeout is None
           else f"ends with ExchangeTimeout after {wait.timeout:g} s")
    try:
        rank = hvd.rank()
    except ValueError:  # Horovod shut down meanwhile
        rank = "?"
    print(f"[horovod_micro] rank {rank} has waited {waited:.0f} s in collective {wait.name} "
          f"{why}; this wait {end} ({env}; warnings every {wait.warn_every:g} s, "
          f"{STALL_ENV})", file=sys.stderr, flush=True)


@contextmanager
def bounded(name: str, timeout: float | None, arrival: bool = False,
            warn_every: float | None = None):
    """Run the blocking collective ``name`` inside; raise :class:`ExchangeTimeout` if it
    lasted longer than ``timeout`` seconds (``None``: no deadline), and warn every
    ``warn_every`` seconds of waiting (``None``: never). ``arrival``: the exchange's first
    collective (the warning and the error say so)."""
    if timeout is None and warn_every is None:
        yield
        return
    wait = _Wait(timeout, name, arrival, warn_every)
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
    if wait.arrival:
        when = (f"({ARRIVAL_ENV}: how long a rank waits for the others to reach the same "
                "step; 0 waits forever). Either one rank worked alone for longer than that "
                "(evaluation or a checkpoint on one rank: raise the variable), or the ranks "
                "are out of step")
    else:
        when = (f"after every rank had entered this exchange ({TIMEOUT_ENV}; 0 waits "
                "forever). The ranks are out of step")
    return ExchangeTimeout(
        f"{wait.name}: no other rank joined this collective within {wait.timeout:g} s "
        f"{when}: step() or synchronize() was called more often on some ranks (uneven "
        "data?), optimizers were stepped in a different order, or another rank is in a "
        "different collective, or gone. Horovod was shut down so that every rank stops.")
