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
never a stuck CI. The horovodrun command line and the bounded child process come from
``hvm_testbed/launch.py`` (shared with the benchmarks).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hvm_testbed.launch import LaunchError, horovodrun_cmd, run_bounded, tail

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


def run_ranks(target: str, np: int = 2, backend: str = "gloo", kwargs: dict | None = None,
              timeout: float = 240, env: dict | None = None,
              allow_errors: bool = False) -> list[RankResult]:
    """Run ``target`` on ``np`` ranks; return one :class:`RankResult` per rank.

    Unless ``allow_errors``, any rank raising is a :class:`RankFailure` carrying every
    rank's traceback and output.
    """
    out_dir = Path(tempfile.mkdtemp(prefix="hvm-ranks-"))
    argv = [sys.executable, str(ENTRY), target, json.dumps(kwargs or {}), str(out_dir)]
    pythonpath = os.pathsep.join([str(TESTS), str(REPO), os.environ.get("PYTHONPATH", "")])
    try:
        proc = run_bounded(horovodrun_cmd(np, backend, argv), timeout, cwd=REPO,
                           env={"PYTHONPATH": pythonpath, **(env or {})}, check=False,
                           label=f"{target} on {np} {backend} ranks")
        output = proc.stdout
        results = []
        for rank in range(np):
            path = out_dir / f"rank{rank}.json"
            if not path.exists():
                raise RankFailure(f"{target}: rank {rank} wrote no result (exit code "
                                  f"{proc.returncode})\n{tail(output)}")
            results.append(RankResult(rank=rank, **json.loads(path.read_text())))
    except LaunchError as error:
        raise RankFailure(str(error)) from None
    finally:  # every exit path, a rank that wrote nothing or a timeout included
        shutil.rmtree(out_dir, ignore_errors=True)
    failed = [r for r in results if not r.ok]
    if failed and not allow_errors:
        details = "\n".join(f"rank {r.rank}: {r.error_type}: {r.message}" for r in failed)
        raise RankFailure(f"{target} failed on {len(failed)} rank(s):\n{details}\n"
                          f"{tail(output)}")
    if not failed and proc.returncode != 0:
        raise RankFailure(f"{target}: horovodrun exited {proc.returncode}\n{tail(output)}")
    return results


def run_script(argv: list[str], np: int = 2, backend: str = "gloo", timeout: float = 300,
               env: dict | None = None, cwd: Path | None = None) -> str:
    """Run an ordinary script under horovodrun (as a user would); return its output."""
    try:
        return run_bounded(horovodrun_cmd(np, backend, argv), timeout, cwd=cwd or REPO,
                           env=env, label=str(argv)).stdout
    except LaunchError as error:
        raise RankFailure(str(error)) from None
