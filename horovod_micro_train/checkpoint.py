"""Checkpoints written every epoch by rank 0, with every rank's own state inside.

Most of a run's state is identical on all ranks (parameters, momentum: every rank applies
the same aggregated gradient). Some is not: each rank's error-feedback residual (a sparse
method's memory of what it has not sent yet), its RNG states (data augmentation) and its
BatchNorm running statistics. Each rank moves its part to the CPU and sends it to rank 0
alone (one ``alltoall`` in which only the sends to rank 0 are non-empty: O(N) bytes per
rank, not the O(n N) of broadcasting every part to every rank), and rank 0 writes a single
file, so resuming needs no shared filesystem; on ``--resume`` rank 0 reads the file and
sends each rank its own part the same way. Resuming thus continues exactly the
uninterrupted run. The file is written atomically and verified when read
(:mod:`horovod_micro_train.checkpoint_file`): a crash mid-write keeps the previous checkpoint, and a
damaged file is a :class:`~horovod_micro_train.cli.TrainError` naming it, on every rank.
"""

from __future__ import annotations

import io
import random
from pathlib import Path

import horovod.torch as hvd
import numpy as np
import torch

from .checkpoint_file import read_verified, write_atomically
from .cli import TrainError

FORMAT = 2  # 2: with a SHA-256 of the contents (horovod_micro_train.checkpoint_file)
SPARSE_KEY = "horovod_micro"  # where hvm.DistributedOptimizer.state_dict keeps its state


def rng_state() -> dict:
    """This process's random number generators."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _to_cpu(obj):
    if torch.is_tensor(obj):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    return obj


def _rank_state(model: torch.nn.Module, optimizer_state: dict) -> dict:
    return {"sparse": _to_cpu(optimizer_state.get(SPARSE_KEY)), "rng": rng_state(),
            "buffers": {k: v.detach().cpu().clone() for k, v in model.named_buffers()}}


def _encode(obj) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def _decode(data: torch.Tensor):
    return torch.load(io.BytesIO(data.numpy().tobytes()), map_location="cpu",
                      weights_only=False)


def _gather_to_root(obj, name: str) -> list | None:
    """Every rank's ``obj``, on rank 0 only (``None`` elsewhere)."""
    data = _encode(obj)
    splits = [data.numel() if r == 0 else 0 for r in range(hvd.size())]
    received, counts = hvd.alltoall(data, splits=torch.tensor(splits, dtype=torch.int32),
                                    name=name)
    if hvd.rank() != 0:
        return None
    return [_decode(chunk) for chunk in torch.split(received, counts.tolist())]


def _scatter_from_root(objs: list | None, name: str):
    """Rank ``r``'s entry of rank 0's list ``objs``, on rank ``r``."""
    if hvd.rank() == 0:
        parts = [_encode(obj) for obj in objs]
        data, splits = torch.cat(parts), [p.numel() for p in parts]
    else:
        data, splits = torch.empty(0, dtype=torch.uint8), [0] * hvd.size()
    received, _ = hvd.alltoall(data, splits=torch.tensor(splits, dtype=torch.int32),
                               name=name)
    return _decode(received)


def save(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         counters: dict) -> None:
    """Write the checkpoint (collective: every rank calls it; rank 0 writes).

    ``counters`` holds the epoch to start from (also the sampler's next epoch), the global
    iteration, the cumulative training time and the run's arguments. Every rank's part is taken
    at the same point, after the same ``counters["iteration"]`` steps, so each residual shard
    belongs to the weights in the file. The file is replaced atomically
    (:mod:`horovod_micro_train.checkpoint_file`); when this returns on any rank the new
    checkpoint is durable, and a failed write raises :class:`TrainError` on every rank.
    """
    opt_state = optimizer.state_dict()
    ranks = _gather_to_root(_rank_state(model, opt_state), name="train.ckpt.gather")
    error = None
    if hvd.rank() == 0:
        opt_state = {k: v for k, v in opt_state.items() if k != SPARSE_KEY}
        payload = {"format": FORMAT, "world_size": hvd.size(), "model": model.state_dict(),
                   "optimizer": opt_state, "rank_states": ranks, **counters}
        try:
            problem = _inconsistency(payload)
            if problem:
                raise TrainError(f"refusing to write {path}: {problem}")
            write_atomically(path, payload, epoch=counters.get("epoch"))
        except (OSError, TrainError) as exc:
            error = f"cannot write checkpoint {path}: {exc}"
    error = hvd.broadcast_object(error, root_rank=0, name="train.ckpt.written")
    if error is not None:
        raise TrainError(error)


def _inconsistency(payload: dict) -> str | None:
    """What makes ``payload`` unusable for resuming this job, if anything."""
    missing = [k for k in ("world_size", "optimizer", "rank_states", "epoch", "iteration",
                           "train_time", "elapsed") if k not in payload]
    if missing:
        return f"it lacks {', '.join(missing)}"
    ranks = payload["rank_states"]
    size = payload["world_size"]
    if not isinstance(ranks, list) or len(ranks) != size:
        return f"it holds {len(ranks) if isinstance(ranks, list) else 'no'} rank states " \
               f"for {size} ranks"
    for r, part in enumerate(ranks):
        if not isinstance(part, dict) or {"sparse", "rng", "buffers"} - set(part):
            return f"rank {r}'s state is incomplete"
        sparse = part["sparse"]
        if sparse is None:
            continue
        if (sparse.get("rank"), sparse.get("size")) != (r, size):
            return f"entry {r} holds rank {sparse.get('rank')} of {sparse.get('size')}'s state"
        if sparse.get("iteration") != payload["iteration"]:
            return (f"rank {r}'s residual is from iteration {sparse.get('iteration')}, the "
                    f"weights from iteration {payload['iteration']}")
    return None


def load(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Restore a checkpoint written by :func:`save` (collective); returns its counters.

    A missing, truncated, corrupt or mismatched file raises :class:`TrainError` naming it
    on every rank (rank 0 reads and checks it, then tells everyone)."""
    error, payload = None, None
    if hvd.rank() == 0:
        try:
            payload = read_verified(path)
            if payload.get("world_size") != hvd.size():
                raise TrainError(
                    f"{path} was written by {payload.get('world_size')} ranks, this job has "
                    f"{hvd.size()}: every rank's residual is part of the state, resume with "
                    "the same number of ranks")
            problem = _inconsistency(payload)
            if problem:
                raise TrainError(f"checkpoint {path} is inconsistent: {problem}")
        except TrainError as exc:
            error = str(exc)
    error = hvd.broadcast_object(error, root_rank=0, name="train.ckpt.error")
    if error is not None:
        raise TrainError(error)
    shared = None
    if hvd.rank() == 0:
        shared = {k: v for k, v in payload.items() if k != "rank_states"}
    shared = hvd.broadcast_object(shared, root_rank=0, name="train.ckpt.shared")
    mine = _scatter_from_root(payload["rank_states"] if hvd.rank() == 0 else None,
                              name="train.ckpt.scatter")
    try:
        _apply(shared, mine, model, optimizer)
        error = None
    except (RuntimeError, ValueError, KeyError, TypeError) as exc:
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    errors = hvd.allgather_object(error, name="train.ckpt.applied")
    failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None]
    if failed:
        raise TrainError(f"checkpoint {path} does not fit this run (different model or "
                         "options?): " + "; ".join(failed))
    return {k: v for k, v in shared.items()
            if k not in ("model", "optimizer", "format", "world_size")}


def _apply(shared: dict, mine: dict, model: torch.nn.Module,
           optimizer: torch.optim.Optimizer) -> None:
    model.load_state_dict(shared["model"])
    with torch.no_grad():
        for name, buf in model.named_buffers():
            buf.copy_(mine["buffers"][name])
    opt_state = dict(shared["optimizer"])
    if mine["sparse"] is not None:
        opt_state[SPARSE_KEY] = mine["sparse"]
    optimizer.load_state_dict(opt_state)
    set_rng_state(mine["rng"])
