"""Rank bodies of tests/test_settings_forms.py: one compressor setting written in a
different form on each rank (a NumPy scalar beside a Python number, ``1`` beside ``True``,
``-0.0`` beside ``0.0``), on real ranks.

Every such pair compares equal with ``==``, which is how the ranks' settings were
compared, while the collectives' names hashed their ``repr``: the ranks then waited in
differently named collectives until a deadline. Each case either trains alike on every
rank or is refused with the same ``ValueError`` on every rank, never waiting."""

from __future__ import annotations

import time

import horovod.torch as hvd
import numpy as np
import torch

import horovod_micro as hvm
from horovod_micro.compressors.topk import TopkCompressor


class OffsetTopk(TopkCompressor):
    """A method defined outside horovod_micro with a real-valued setting of its own (as
    docs/extending.md describes): Top-k, with ``offset`` in its settings."""

    name = "offsettopk"

    def __init__(self, density: float, offset: float):
        super().__init__(density)
        self.offset = offset

    def config(self) -> dict:
        return {**super().config(), "offset": self.offset}


def _compression(case: str, first: bool):
    """Rank 0's form of the setting where ``first``, the other ranks' otherwise."""
    if case == "randomk_numpy_seed":
        return hvm.Compression.randomk(density=0.05, seed=np.int64(7) if first else 7)
    if case == "numpy_bool_flag":
        return hvm.Compression.topk(density=0.05, error_feedback=np.True_ if first else True)
    if case == "int_flag":
        return hvm.Compression.topk(density=0.05, fp16_values=0 if first else False)
    if case == "bool_initial_threshold":
        return hvm.Compression.micro(density=0.05, controller="newton", judge="magnitude",
                                     initial_threshold=True if first else 1.0)
    if case == "plugin_negative_zero":
        return OffsetTopk(density=0.05, offset=0.0 if first else -0.0)
    raise ValueError(case)


def settings_forms(case: str) -> dict:
    """Three steps with ``case``'s settings: what this rank raised, how long it took, and
    whether every rank ends with the same weights."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 4))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    start = time.monotonic()
    try:
        base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        opt = hvm.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                       compression=_compression(case, hvd.rank() == 0))
        for t in range(3):
            gen = torch.Generator().manual_seed(100 * hvd.rank() + t)
            x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        result = {"raised": None, "message": ""}
    except Exception as error:  # noqa: BLE001  the type is part of what is checked
        result = {"raised": type(error).__name__, "message": str(error)}
    result["seconds"] = time.monotonic() - start
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = hvd.allgather(flat.unsqueeze(0), name=f"weights.{case}")
    result["same_weights"] = bool((everyone == everyone[0]).all())
    return result
