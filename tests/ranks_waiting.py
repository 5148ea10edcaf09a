"""Rank bodies for the waiting tests (run by multirank.run_ranks on real ranks)."""

from __future__ import annotations

import time

import horovod.torch as hvd
import torch

import horovod_micro as hvm


def late_peer(method: str, late: float, steps: int = 3) -> dict:
    """``steps`` steps of ``hvm.DistributedOptimizer`` (``method``: a Compression name) on
    a linear model, rank 1 reaching each step's exchange ``late`` seconds after the others
    (it sleeps before its backward). Per rank: the main thread's CPU seconds spent in
    ``backward`` + ``step`` (where the others wait for rank 1), the wall seconds there, and
    the averaged gradient of the last step (every rank's gradient is known in closed form:
    rank ``r``'s input is ``r + 1`` everywhere, so the mean is what the test restates)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    compression = getattr(hvm.Compression, method)
    if method == "micro":
        compression = compression(density=1.0)
    opt = hvm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   named_parameters=model.named_parameters(),
                                   compression=compression)
    cpu = wall = 0.0
    grad = None
    for _ in range(steps):
        opt.zero_grad()
        x = torch.full((1, 64), float(hvd.rank() + 1))
        if hvd.rank() == 1:
            time.sleep(late)
        start_cpu, start_wall = time.thread_time(), time.perf_counter()
        model(x).sum().backward()
        opt.step()
        cpu += time.thread_time() - start_cpu
        wall += time.perf_counter() - start_wall
        grad = model.weight.grad.view(-1).tolist()
    return {"cpu": cpu, "wall": wall, "grad": grad}
