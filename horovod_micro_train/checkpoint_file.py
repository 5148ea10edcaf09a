"""The checkpoint file on disk: written atomically, read back verified.

A crash (SIGKILL, a lost node, a full disk) while a checkpoint is being written must never
destroy the previous one, and a file damaged later must never resume a run with wrong
numbers or fail with a traceback from deep inside torch. So:

* :func:`write_atomically` writes into ``NAME.tmp`` in the same directory (same
  filesystem, so the rename is atomic), flushes and ``fsync``s it, renames it over
  ``NAME`` with ``os.replace`` and ``fsync``s the directory, so that the rename itself is
  durable. At every instant ``NAME`` is either the previous complete checkpoint or the
  new complete one; a crash leaves at most a stale ``NAME.tmp``, which the next write
  overwrites.
* the payload carries a SHA-256 of its own contents (every tensor's bytes, every other
  value pickled), because torch's zip reader does not check the CRCs it writes: a flipped
  byte inside a tensor loads silently. :func:`read_verified` turns every way a file can be
  wrong (missing, empty, truncated, garbage, another kind of file, a checksum mismatch)
  into a :class:`~horovod_micro_train.cli.TrainError` that names the file.

Test-only knob: ``TRAIN_TEST_PAUSE_IN_CHECKPOINT=EPOCH`` makes the writing process stop
inside the write of the checkpoint that completes epoch ``EPOCH``, once the first 4 KiB of
the temporary file are on disk, create ``NAME.paused`` holding its pid, and sleep until it
is killed. The crash test
(tests/test_train_crash.py) uses it to SIGKILL the job inside the write window
deterministically. Never set it otherwise.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import time
from pathlib import Path

import torch

from .cli import TrainError

DIGEST_KEY = "sha256"
PAUSE_ENV = "TRAIN_TEST_PAUSE_IN_CHECKPOINT"
_PARTIAL_BYTES = 4096  # any checkpoint is larger: one torch RNG state alone is 5 KB


def digest(payload: dict) -> str:
    """SHA-256 of ``payload``'s contents, in its (insertion) order."""
    h = hashlib.sha256()
    _feed(h, payload)
    return h.hexdigest()


def _feed(h, obj) -> None:
    if torch.is_tensor(obj):
        t = obj.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy())
    elif isinstance(obj, dict):
        h.update(f"D{len(obj)}".encode())
        for key, value in obj.items():
            _feed(h, key)
            _feed(h, value)
    elif isinstance(obj, list | tuple):
        h.update(f"{type(obj).__name__[0]}{len(obj)}".encode())
        for value in obj:
            _feed(h, value)
    else:
        data = pickle.dumps(obj, protocol=4)
        h.update(f"P{len(data)}".encode())
        h.update(data)


def write_atomically(path: Path, payload: dict, epoch: int | None = None) -> None:
    """Write ``payload`` (with its digest added) to ``path`` as described above.
    ``epoch`` only matters to the test-only pause knob."""
    payload = {**payload, DIGEST_KEY: digest(payload)}
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        target = _StopPartWay(f, path) if _pause_armed(epoch) else f
        torch.save(payload, target)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_directory(path.parent)


def read_verified(path: Path) -> dict:
    """The payload of ``path`` without its digest; :class:`TrainError` naming ``path``
    for anything but an intact checkpoint of ``python -m horovod_micro_train``."""
    if not path.is_file():
        raise TrainError(f"no checkpoint at {path}")
    if path.stat().st_size == 0:
        raise TrainError(f"checkpoint {path} is empty (0 bytes): it was never completely "
                         "written; resume from another checkpoint or start afresh")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001  torch raises many types for a damaged file
        reason = str(exc).splitlines()[0] if str(exc) else ""
        raise TrainError(f"checkpoint {path} cannot be read, it is truncated or corrupt "
                         f"({type(exc).__name__}: {reason[:200]})") from None
    if (not isinstance(payload, dict) or not isinstance(payload.get("format"), int)
            or "model" not in payload):
        raise TrainError(f"{path} is not a checkpoint written by python -m horovod_micro_train")
    stored = payload.pop(DIGEST_KEY, None)
    if payload["format"] >= 2 and stored != digest(payload):
        raise TrainError(f"checkpoint {path} is corrupt: its contents do not match the "
                         "SHA-256 written with it")
    return payload


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _StopPartWay:
    """Test-only file wrapper: pauses the process once part of the file is on disk."""

    def __init__(self, f, path: Path):
        self.f, self.path, self.written = f, path, 0

    def write(self, data) -> int:
        n = self.f.write(data)
        self.written += n
        if self.written >= _PARTIAL_BYTES:
            self.f.flush()
            os.fsync(self.f.fileno())
            _pause(self.path)
        return n

    def flush(self) -> None:
        self.f.flush()


def _pause_armed(epoch: int | None) -> bool:
    value = os.environ.get(PAUSE_ENV)
    return bool(value) and epoch is not None and int(value) == epoch


def _pause(path: Path) -> None:
    marker = path.with_name(path.name + ".paused")
    tmp = marker.with_name(marker.name + ".tmp")
    tmp.write_text(str(os.getpid()))
    os.replace(tmp, marker)
    while True:  # until the test kills the job
        time.sleep(3600)
