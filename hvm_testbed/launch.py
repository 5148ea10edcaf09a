"""Start local Horovod ranks and bounded child processes (shared by bench/ and tests/).

* :func:`horovodrun_cmd`: the ``horovodrun`` command line for ``np`` ranks on this machine
  over Gloo or MPI (MPI: ``--allow-run-as-root`` when root, ``--oversubscribe --bind-to
  none``, and by default ``-x OMPI_MCA_mpi_yield_when_idle=1``).
* :func:`run_bounded`: run a command in its own session (process group) with
  ``OMP_NUM_THREADS=1`` and ``PYTHONUNBUFFERED=1``, collect stdout and stderr together,
  and kill the whole group when it exceeds its timeout: a hang becomes an error carrying
  the output's tail, never a stuck run.

The project's benchmarks and real-rank test harness use it; so can a method author's own
tests. Standard library only.

Example: two Gloo ranks of a script, killed with their process group after 120 s::

    from hvm_testbed.launch import horovodrun_cmd, run_bounded

    proc = run_bounded(horovodrun_cmd(2, "gloo", [sys.executable, "my_test_body.py"]), 120)
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

BACKENDS = ("gloo", "mpi")


class LaunchError(RuntimeError):
    """A command could not be launched, did not finish in time, or exited non-zero."""

    def __init__(self, message: str, *, output: str = "", returncode: int | None = None,
                 timed_out: bool = False):
        super().__init__(message)
        self.output, self.returncode, self.timed_out = output, returncode, timed_out


def horovodrun() -> str:
    """The ``horovodrun`` next to this interpreter, else the one on ``PATH``."""
    path = shutil.which("horovodrun", path=str(Path(sys.executable).parent)) or shutil.which(
        "horovodrun")
    if path is None:
        raise LaunchError("horovodrun not found: Horovod is not installed in this environment "
                          "(run the README's set-up)")
    return path


def horovodrun_cmd(np: int, backend: str, argv: list[str], *,
                   mpi_yield_when_idle: bool = True) -> list[str]:
    """``horovodrun -np NP -H localhost:NP --gloo|--mpi ... ARGV`` for ``np`` local ranks.

    ``mpi_yield_when_idle``: MPI ranks that busy-poll steal the cores of oversubscribed
    peers; yielding when idle keeps 3+ MPI ranks on 2 cores from running several times
    slower. Pass False to keep Open MPI's default (busy polling).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be gloo or mpi, got {backend!r}")
    cmd = [horovodrun(), "-np", str(np), "-H", f"localhost:{np}"]
    if backend == "gloo":
        return cmd + ["--gloo"] + list(argv)
    mpi_args = "--oversubscribe --bind-to none"
    if os.geteuid() == 0:
        mpi_args = "--allow-run-as-root " + mpi_args
    if mpi_yield_when_idle:
        mpi_args += " -x OMPI_MCA_mpi_yield_when_idle=1"
    return cmd + ["--mpi", f"--mpi-args={mpi_args}"] + list(argv)


def tail(output: str, lines: int = 120) -> str:
    """The last ``lines`` lines of ``output`` (what error messages quote)."""
    return "\n".join(output.splitlines()[-lines:])


def run_bounded(cmd: list[str], timeout: float, *, env: dict | None = None,
                base_env: dict | None = None, cwd: str | Path | None = None,
                check: bool = True, label: str | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own process group; kill the whole group after ``timeout`` s.

    The environment is ``base_env`` (default: this process's) plus ``OMP_NUM_THREADS=1``,
    ``PYTHONUNBUFFERED=1`` and ``env`` (which wins; a None value removes the variable).
    Returns the :class:`subprocess.CompletedProcess` with stdout and stderr merged in
    ``.stdout``.
    Raises :class:`LaunchError` (message: ``label``, default the command, and the
    output's tail) on a timeout and, with ``check``, on a non-zero exit.
    """
    label = label or shlex.join(str(c) for c in cmd)
    start = os.environ if base_env is None else base_env
    full_env = {name: value for name, value in
                {**start, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}.items()
                if value is not None}
    proc = subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # the whole group ended in the meantime
            pass
        output, _ = proc.communicate()
        raise LaunchError(f"{label} did not finish within {timeout:.0f} s (a hang?)\n"
                          f"{tail(output)}", output=output, returncode=proc.returncode,
                          timed_out=True) from None
    if check and proc.returncode != 0:
        raise LaunchError(f"{label} exited {proc.returncode}\n{tail(output)}", output=output,
                          returncode=proc.returncode)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout=output)
