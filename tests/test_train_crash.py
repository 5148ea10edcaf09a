"""Crash-safe checkpoints of ``python -m horovod_micro_train`` on 2 real Gloo ranks.

The job is SIGKILLed, all of it, while rank 0 is inside the write of a checkpoint: the test-only
knob ``TRAIN_TEST_PAUSE_IN_CHECKPOINT`` (horovod_micro_train/checkpoint_file.py) stops rank 0 at
a known point of the write and tells the test, which then kills horovodrun's process group and
every process carrying this job's token (the rank processes live in sessions of their own under
horovodrun). ``--resume`` must then continue from the last complete checkpoint and end exactly
where an uninterrupted run ends. Damaged files (truncated, empty, garbage, a flipped byte,
another torch file, missing) are a ``TrainError`` naming the file on every rank, and ``python -m
horovod_micro_train`` prints it without a traceback; so is a checkpoint that rank 0 cannot
write.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from multirank import REPO, run_ranks, run_script

from horovod_micro_train.checkpoint_file import PAUSE_ENV, read_verified
from horovod_micro_train.cli import TrainError
from horovod_micro_train.records import read_jsonl
from hvm_testbed.launch import horovodrun_cmd, run_bounded

EPOCHS, ITERS = 4, 6
# The embedded digits run: seconds, no data files, whatever the CLI's default dataset is.
RECIPE = ["--dataset", "digits", "--epochs", str(EPOCHS), "--lr-decay-epochs", "3",
          "--max-iters-per-epoch", str(ITERS), "--progress", "lines", "--no-plots"]
JOB_TOKEN = "HVM_CRASH_TEST_JOB"


def train_argv(out: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "horovod_micro_train", "--out", str(out), *RECIPE, *flags]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """The uninterrupted run."""
    out = tmp_path_factory.mktemp("straight")
    run_script(train_argv(out))
    return out


def _job_pids(token: str) -> list[int]:
    """Processes whose environment carries ``JOB_TOKEN=token``: this job's, and only its."""
    needle = f"{JOB_TOKEN}={token}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
        except OSError:  # gone, or not ours to read
            continue
    return pids


def run_and_kill_inside_checkpoint(out: Path, epoch: int, timeout: float = 300) -> str:
    """Start the run with the pause knob; once rank 0 is stopped inside the checkpoint of
    ``epoch``, SIGKILL the whole job. Returns the job's output."""
    token = uuid.uuid4().hex
    marker = out / "checkpoint.pt.paused"
    log_path = out.parent / f"{out.name}.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           PAUSE_ENV: str(epoch), JOB_TOKEN: token}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(horovodrun_cmd(2, "gloo", train_argv(out)), cwd=REPO, env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        paused = marker.exists()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        for _ in range(100):  # the ranks and Horovod's middlemen run in sessions of their own
            pids = _job_pids(token)
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        proc.wait()
    output = log_path.read_text()
    assert paused, f"rank 0 never reached the checkpoint write window\n{output[-3000:]}"
    assert not _job_pids(token), "processes of the killed job survived"
    return output


def assert_same_end(straight: Path, resumed: Path) -> None:
    a = read_verified(straight / "checkpoint.pt")
    b = read_verified(resumed / "checkpoint.pt")
    assert (a["epoch"], a["iteration"]) == (b["epoch"], b["iteration"]) == (EPOCHS,
                                                                            EPOCHS * ITERS)
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    for ra, rb in zip(a["rank_states"], b["rank_states"], strict=True):
        assert torch.equal(ra["sparse"]["residual"], rb["sparse"]["residual"])
        sa, sb = ra["sparse"]["compressor"], rb["sparse"]["compressor"]
        assert sa.keys() == sb.keys() == {"controller", "last"}  # the drift judge's ages
        assert sa["controller"] == sb["controller"]
        assert torch.equal(sa["last"], sb["last"])
    for key, state in a["optimizer"]["state"].items():
        assert torch.equal(state["momentum_buffer"],
                           b["optimizer"]["state"][key]["momentum_buffer"])
    assert [r["iteration"] for r in read_jsonl(resumed / "iterations.jsonl")] == list(
        range(EPOCHS * ITERS))
    assert [e["epoch"] for e in read_jsonl(resumed / "epochs.jsonl")] == list(range(EPOCHS))


def test_kill_inside_checkpoint_write_then_resume(straight, tmp_path):
    """Killed while the checkpoint of epoch 3 is half on disk: the previous one (epoch 2)
    is intact, and ``--resume`` continues from it and ends equal to the uninterrupted run."""
    out = tmp_path / "run"
    out.mkdir()
    run_and_kill_inside_checkpoint(out, epoch=3)
    kept = read_verified(out / "checkpoint.pt")
    assert (kept["epoch"], kept["iteration"]) == (2, 2 * ITERS)
    tmp = out / "checkpoint.pt.tmp"  # the kill hit a half-written file, which is unreadable
    assert tmp.stat().st_size >= 4096
    with pytest.raises(TrainError, match=r"checkpoint\.pt\.tmp cannot be read"):
        read_verified(tmp)
    log = run_script(train_argv(out, "--resume"))
    assert "epoch 2/4:" not in log and "epoch 3/4:" in log and "epoch 4/4:" in log
    assert_same_end(straight, out)


def _damaged_copies(source: Path, into: Path) -> dict[str, str]:
    data = source.read_bytes()
    # The model's largest weight tensor (its name depends on the model): one byte of it
    # is flipped where it is stored.
    weight = max(read_verified(source)["model"].values(), key=lambda t: t.numel())
    at = data.find(weight.numpy().tobytes()[:64])
    assert at > 0, "the weight's bytes are not stored as they are"
    flipped = bytearray(data)
    flipped[at + 10] ^= 0x01
    files = {"truncated": data[: len(data) // 2], "empty": b"",
             "garbage": bytes(range(256)) * 64, "flipped": bytes(flipped)}
    paths = {}
    for case, content in files.items():
        paths[case] = str(into / f"{case}.pt")
        Path(paths[case]).write_bytes(content)
    torch.save({"weights": weight}, into / "other.pt")
    paths["other"] = str(into / "other.pt")
    paths["missing"] = str(into / "missing.pt")
    return paths


DAMAGE = {"truncated": "cannot be read, it is truncated or corrupt",
          "empty": "is empty (0 bytes)", "garbage": "cannot be read, it is truncated or corrupt",
          "flipped": "is corrupt: its contents do not match the SHA-256",
          "other": "is not a checkpoint written by python -m horovod_micro_train",
          "missing": "no checkpoint at"}


def test_damaged_checkpoint_is_a_clear_error_on_every_rank(straight, tmp_path):
    paths = _damaged_copies(straight / "checkpoint.pt", tmp_path)
    paths["intact"] = str(straight / "checkpoint.pt")
    unwritable = tmp_path / "no-such-directory" / "checkpoint.pt"
    results = run_ranks("ranks_checkpoint:load_each", np=2,
                        kwargs={"paths": paths, "flags": RECIPE,
                                "unwritable": str(unwritable)})
    for r in results:
        for case, words in DAMAGE.items():
            got = r.value[case]
            assert got["raised"] == "TrainError", (r.rank, case, got)
            assert paths[case] in got["message"] and words in got["message"], (r.rank, got)
        assert r.value["intact"] == {"raised": None, "epoch": EPOCHS}
        # A write that fails on rank 0 is an error on every rank, not a hang.
        assert r.value["unwritable"]["raised"] == "TrainError", r.value["unwritable"]
        message = r.value["unwritable"]["message"]
        assert f"cannot write checkpoint {unwritable}" in message and "No such file" in message
    assert results[0].value == results[1].value


def test_resume_from_a_damaged_file_prints_one_line_and_exits_2(straight, tmp_path):
    bad = tmp_path / "garbage.pt"
    bad.write_bytes(b"\x80\x04not a checkpoint" * 100)
    proc = run_bounded(horovodrun_cmd(2, "gloo", train_argv(tmp_path / "out", "--resume",
                                                            str(bad))),
                       300, cwd=REPO, check=False)
    assert proc.returncode != 0
    marker = "python -m horovod_micro_train: error:"
    errors = [line for line in proc.stdout.splitlines() if marker in line]
    assert len(errors) == 1 and str(bad) in errors[0], proc.stdout[-3000:]
    # horovodrun itself reports the exit code with a traceback of its own; the ranks print none.
    assert not re.search(r"^\[\d+\]<std(out|err)>:Traceback", proc.stdout, re.M), proc.stdout
