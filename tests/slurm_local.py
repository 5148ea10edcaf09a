"""A throwaway single-node SLURM (Debian's slurm-wlm) for tests/test_jobs_slurm.py.

Why: jobs/submit_slurm.sh and jobs/slurm.sbatch must run under a real ``sbatch``, not a
stand-in, and no SLURM cluster is available. :func:`local_slurm` writes a slurm.conf into
a temporary folder (this machine as the only node; no munge: ``auth/none``; no cgroups:
``proctrack/linuxproc``, ``task/none``; free ports on loopback), starts ``slurmctld`` and
``slurmd`` in the foreground in their own sessions and stops both on every exit path.
Clients find it through ``SLURM_CONF`` in the environment it returns.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_conf(folder: Path) -> Path:
    """slurm.conf for a one-node cluster whose state, spool and logs live in ``folder``."""
    node = socket.gethostname()
    for sub in ("state", "spool"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    conf = folder / "slurm.conf"
    conf.write_text(f"""ClusterName=hvmtest
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd.log
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
NodeName={node} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP
""")
    return conf


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextlib.contextmanager
def local_slurm(folder: Path, start_timeout: float = 120.0) -> Iterator[dict[str, str]]:
    """Run slurmctld + slurmd configured in ``folder``; yields the clients' environment."""
    conf = write_conf(folder)
    env = {**os.environ, "SLURM_CONF": str(conf)}
    procs = []
    try:
        for daemon in ("slurmctld", "slurmd"):
            with open(folder / f"{daemon}.out", "wb") as log:
                procs.append(subprocess.Popen([daemon, "-D", "-f", str(conf)], env=env,
                                              stdin=subprocess.DEVNULL, stdout=log,
                                              stderr=subprocess.STDOUT,
                                              start_new_session=True))
        deadline = time.monotonic() + start_timeout
        while True:  # the node must be idle before jobs can start
            state = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True,
                                   text=True).stdout.strip()
            if state == "idle":
                break
            dead = [p.args[0] for p in procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = "\n".join((folder / f"{d}.out").read_text(errors="replace")[-3000:]
                                 for d in ("slurmctld", "slurmd"))
                raise RuntimeError(f"SLURM did not come up (exited: {dead}, node state "
                                   f"{state!r}):\n{logs}")
            time.sleep(0.5)
        yield env
    finally:
        subprocess.run(["scancel", "--full", "--user", "root"], env=env, capture_output=True)
        for proc in reversed(procs):
            _stop(proc)


def wait_for_job(job: str, env: dict[str, str], timeout: float) -> str:
    """Wait until job ``job`` (all its array tasks) left the queue; returns
    ``scontrol show job``'s text (kept by slurmctld for MinJobAge, 300 s)."""
    deadline = time.monotonic() + timeout
    while subprocess.run(["squeue", "-h", "-j", job], env=env, capture_output=True,
                         text=True).stdout.strip():
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job], env=env, capture_output=True)
            raise TimeoutError(f"SLURM job {job} still queued or running after {timeout:.0f} s")
        time.sleep(1)
    return subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True,
                          text=True).stdout
