"""Checkpoints written every epoch by rank 0, with every rank's own state inside.

Most of a run's state is identical on all ranks (parameters, momentum: every rank applies
the same aggregated gradient). Some is not: each rank's error-feedback residual (a sparse
method's memory of what it has not sent yet), its RNG states (data augmentation) and its
BatchNorm running statistics. Rank 0 collects those per-rank parts with one broadcast per
rank and writes a single file, so resuming needs no shared filesystem; on ``--resume``
rank 0 reads the file and hands each rank its part. Resuming thus continues exactly the
uninterrupted run.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import horovod.torch as hvd
import numpy as np
import torch

from .cli import TrainError

FORMAT = 1
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


def _rank_state(model: torch.nn.Module, optimizer_state: dict) -> dict:
    return {"sparse": optimizer_state.get(SPARSE_KEY), "rng": rng_state(),
            "buffers": {k: v.detach().cpu().clone() for k, v in model.named_buffers()}}


def save(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         counters: dict) -> None:
    """Write the checkpoint (collective: every rank calls it; rank 0 writes).

    ``counters`` holds the epoch to start from (also the sampler's next epoch), the global
    iteration, the cumulative training time and the run's arguments.
    """
    opt_state = optimizer.state_dict()
    mine = _rank_state(model, opt_state)
    ranks = [hvd.broadcast_object(mine if r == hvd.rank() else None, root_rank=r,
                                  name=f"train.ckpt.rank{r}") for r in range(hvd.size())]
    if hvd.rank() != 0:
        return
    opt_state = {k: v for k, v in opt_state.items() if k != SPARSE_KEY}
    payload = {"format": FORMAT, "world_size": hvd.size(), "model": model.state_dict(),
               "optimizer": opt_state, "rank_states": ranks, **counters}
    tmp = path.with_suffix(".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)  # a crash mid-write leaves the previous checkpoint intact


def load(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Restore a checkpoint written by :func:`save` (collective); returns its counters."""
    error, payload = None, None
    if hvd.rank() == 0:
        try:
            payload = torch.load(path, map_location="cpu", weights_only=False)
            if payload.get("world_size") != hvd.size():
                error = (f"{path} was written by {payload.get('world_size')} ranks, this job "
                         f"has {hvd.size()}: every rank's residual is part of the state, "
                         "resume with the same number of ranks")
        except (OSError, RuntimeError, EOFError) as exc:
            error = f"cannot read checkpoint {path}: {exc}"
    error = hvd.broadcast_object(error, root_rank=0, name="train.ckpt.error")
    if error is not None:
        raise TrainError(error)
    shared = None
    if hvd.rank() == 0:
        shared = {k: v for k, v in payload.items() if k != "rank_states"}
    shared = hvd.broadcast_object(shared, root_rank=0, name="train.ckpt.shared")
    mine = None
    for r in range(1, hvd.size()):
        got = hvd.broadcast_object(payload["rank_states"][r] if hvd.rank() == 0 else None,
                                   root_rank=0, name=f"train.ckpt.to{r}")
        if hvd.rank() == r:
            mine = got
    if hvd.rank() == 0:
        mine = payload["rank_states"][0]
    model.load_state_dict(shared["model"])
    with torch.no_grad():
        for name, buf in model.named_buffers():
            buf.copy_(mine["buffers"][name])
    opt_state = dict(shared["optimizer"])
    if mine["sparse"] is not None:
        opt_state[SPARSE_KEY] = mine["sparse"]
    optimizer.load_state_dict(opt_state)
    set_rng_state(mine["rng"])
    return {k: v for k, v in shared.items()
            if k not in ("model", "optimizer", "format", "world_size")}
