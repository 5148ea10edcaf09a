"""Run a Python function on N real Horovod ranks launched by ``horovodrun`` and collect
what each rank returned.

    results = run_ranks("ranks_micro:exchange_matches_simulation", np=2, backend="gloo",
                        kwargs={"density": 0.01})

``target`` is ``module:function`` with the module under ``tests/``. The function runs on
every rank after ``hvd.init()`` and gets ``**kwargs``; whatever JSON-able value it returns
(or the exception it raises) is written by each rank to its own file in a fresh temporary
directory, so several runs in one pytest session never share files, and horovodrun picks
free ports itself. A run that exceeds ``timeout`` is killed with its whole process group
and reported, with every rank's output, as :class:`RankFailure`: a hang is a test failure,
never a stuck CI.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
ENTRY = TESTS / "rank_entry.py"


class RankFailure(AssertionError):
    """A multi-rank run failed, hung, or a rank produced no result."""


@dataclass
class RankResult:
    rank: int
    ok: bool
    value: object = None
    error_type: str | None = None
    message: str | None = None


def horovodrun() -> str:
    path = shutil.which("horovodrun", path=str(Path(sys.executable).parent)) or shutil.which(
        "horovodrun")
    if path is None:
        raise RankFailure("horovodrun not found: Horovod is not installed in this environment "
                          "(run the README's set-up)")
    return path


def launch_command(np: int, backend: str, argv: list[str]) -> list[str]:
    cmd = [horovodrun(), "-np", str(np), "-H", f"localhost:{np}"]
    if backend == "gloo":
        cmd.append("--gloo")
    elif backend == "mpi":
        mpi_args = "--oversubscribe --bind-to none"
        if os.geteuid() == 0:
            mpi_args = "--allow-run-as-root " + mpi_args
        # Ranks that busy-poll steal the cores of oversubscribed peers; yielding when idle
        # keeps 3+ MPI ranks on 2 cores from running several times slower.
        mpi_args += " -x OMPI_MCA_mpi_yield_when_idle=1"
        cmd += ["--mpi", f"--mpi-args={mpi_args}"]
    else:
        raise ValueError(f"backend must be gloo or mpi, got {backend!r}")
    return cmd + argv


def run_ranks(target: str, np: int = 2, backend: str = "gloo", kwargs: dict | None = None,
              timeout: float = 240, env: dict | None = None,
              allow_errors: bool = False) -> list[RankResult]:
    """Run ``target`` on ``np`` ranks; return one :class:`RankResult` per rank.

    Unless ``allow_errors``, any rank raising is a :class:`RankFailure` carrying every
    rank's traceback and output.
    """
    out_dir = Path(tempfile.mkdtemp(prefix="hvm-ranks-"))
    argv = [sys.executable, str(ENTRY), target, json.dumps(kwargs or {}), str(out_dir)]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join([str(TESTS), str(REPO),
                                               os.environ.get("PYTHONPATH", "")]),
                **(env or {})}
    proc = subprocess.Popen(launch_command(np, backend, argv), cwd=REPO, env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise RankFailure(f"{target} on {np} {backend} ranks did not finish within "
                          f"{timeout:.0f} s (a hang?)\n{_tail(output)}") from None

    results = []
    for rank in range(np):
        path = out_dir / f"rank{rank}.json"
        if not path.exists():
            raise RankFailure(f"{target}: rank {rank} wrote no result (exit code "
                              f"{proc.returncode})\n{_tail(output)}")
        results.append(RankResult(rank=rank, **json.loads(path.read_text())))
    shutil.rmtree(out_dir, ignore_errors=True)
    failed = [r for r in results if not r.ok]
    if failed and not allow_errors:
        details = "\n".join(f"rank {r.rank}: {r.error_type}: {r.message}" for r in failed)
        raise RankFailure(f"{target} failed on {len(failed)} rank(s):\n{details}\n"
                          f"{_tail(output)}")
    if not failed and proc.returncode != 0:
        raise RankFailure(f"{target}: horovodrun exited {proc.returncode}\n{_tail(output)}")
    return results


def run_script(argv: list[str], np: int = 2, backend: str = "gloo", timeout: float = 300,
               env: dict | None = None, cwd: Path | None = None) -> str:
    """Run an ordinary script under horovodrun (as a user would); return its output."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(launch_command(np, backend, argv), cwd=cwd or REPO, env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise RankFailure(f"{argv} did not finish within {timeout:.0f} s\n{_tail(output)}"
                          ) from None
    if proc.returncode != 0:
        raise RankFailure(f"{argv} exited {proc.returncode}\n{_tail(output)}")
    return output


def _tail(output: str, lines: int = 120) -> str:
    return "\n".join(output.splitlines()[-lines:])
