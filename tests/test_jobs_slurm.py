"""jobs/submit_slurm.sh + jobs/slurm.sbatch under a real SLURM (tests/slurm_local.py).

A throwaway single-node slurmctld + slurmd; ``submit_slurm.sh`` calls the real ``sbatch``
(a job array of one configuration: digits, MiCRO, 2 ranks, 2 iterations), the array task
turns its allocation into ``horovodrun -H node:2`` and trains. The test waits for the job
to leave the queue and checks SLURM's verdict, the task's output file and the records.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

from slurm_local import local_slurm, wait_for_job

from hvm_testbed.launch import horovodrun, run_bounded

REPO = Path(__file__).resolve().parent.parent


def test_submit_slurm_runs_the_job_under_real_sbatch(tmp_path):
    out = tmp_path / "runs"
    submit_dir = tmp_path / "submit"
    submit_dir.mkdir()
    with local_slurm(tmp_path / "slurm") as env:
        # PYTHONPATH: the ranks import this checkout's train (sbatch exports it all).
        env = {**env, "PYTHON": sys.executable, "HOROVODRUN": horovodrun(),
               "PYTHONPATH": str(REPO)}
        # The #SBATCH lines ask for 2 nodes x 8 GPUs: a one-node CPU allocation instead.
        cmd = ["bash", str(REPO / "jobs" / "submit_slurm.sh"), "--sbatch-args",
               "--nodes=1 --ntasks-per-node=2 --cpus-per-task=1 --gpus-per-node=0 --time=20",
               "--data-dir", str(tmp_path / "data"), "--out-dir", str(out), "--datasets",
               "digits", "--models", "digits_cnn", "--compressors", "micro", "--densities",
               "0.01", "--", "--epochs", "1", "--max-iters-per-epoch", "2", "--no-plots",
               "--progress", "none"]
        submitted = run_bounded(cmd, 120, base_env=env, cwd=submit_dir).stdout
        job = re.search(r"Submitted batch job (\d+)", submitted)
        assert job, submitted
        assert "sbatch --array=0-0 " in submitted
        state = wait_for_job(job.group(1), env, 900)
    assert "JobState=COMPLETED" in state and "ExitCode=0:0" in state, state
    log = (submit_dir / f"micro-matrix-{job.group(1)}_0.out").read_text()
    assert "[jobs] digits/digits_cnn/micro-d0.01/np2: exit 0" in log, log
    node = socket.gethostname()
    assert f"-H {node}:2" in log  # the allocation, through scontrol show hostnames
    run_dir = out / "digits" / "digits_cnn" / "micro-d0.01" / "np2"
    ranks = [json.loads((run_dir / "ranks" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["hostname"] for r in ranks] == [node, node]
    assert ranks[0]["parameters_sha256"] == ranks[1]["parameters_sha256"]
    assert len((run_dir / "epochs.jsonl").read_text().splitlines()) == 1
    # Nothing of the throwaway SLURM is left running.
    conf = str(tmp_path / "slurm" / "slurm.conf")
    left = subprocess.run(["pgrep", "-f", conf], capture_output=True, text=True).stdout
    assert not left.strip(), left
