"""Which host ran which rank, and what each rank ended with.

Why: on several hosts a run must show that every host took part and that the ranks
finished with the same model (Horovod keeps the replicas in step; a rank that silently
diverged or a host that ran nothing would not show in rank 0's records otherwise).
``run.json`` gets ``hosts`` (rank i's hostname at index i) and every rank writes
``ranks/rank<R>.json``: its rank, hostname, torch threads and the SHA-256 of its final
parameters.
"""

from __future__ import annotations

import hashlib
import json
import socket
from pathlib import Path

import horovod.torch as hvd
import torch

RANKS_DIR = "ranks"


def gather_hosts() -> list[str]:
    """Every rank's hostname, in rank order (a collective: all ranks call it)."""
    return list(hvd.allgather_object(socket.gethostname(), name="train.hosts"))


def parameters_sha256(model: torch.nn.Module) -> str:
    """SHA-256 over the parameters (name, dtype, shape, bytes) in name order; buffers such
    as BatchNorm's running statistics are local to each rank and left out."""
    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters()):
        tensor = param.detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()


def write_rank_record(out: Path, model: torch.nn.Module) -> Path:
    """``out/ranks/rank<R>.json`` of this rank (every rank writes its own)."""
    folder = out / RANKS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank{hvd.rank()}.json"
    path.write_text(json.dumps({
        "rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(),
        "hostname": socket.gethostname(), "torch_threads": torch.get_num_threads(),
        "parameters_sha256": parameters_sha256(model)}))
    return path
