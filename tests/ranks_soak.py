"""Rank body of tests/test_soak.py: a long MiCRO run that samples this process's resources."""

from __future__ import annotations

import os

import horovod.torch as hvd
import torch

import horovod_micro as hvm


def resources() -> dict[str, int]:
    """Resident memory (kB), threads and open file descriptors of this process, read
    from /proc/self (the kernel's numbers, not the allocator's)."""
    status = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            status[key] = value.split()
    return {"rss_kb": int(status["VmRSS"][0]), "threads": int(status["Threads"][0]),
            "fds": len(os.listdir("/proc/self/fd"))}


def soak(steps: int, sample_every: int, density: float = 0.01) -> dict:
    """``steps`` MiCRO steps of a small MLP on a fixed pool of random batches, sampling
    :func:`resources` every ``sample_every`` steps (step 0 included)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 10))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   compression=hvm.Compression.micro(density=density))
    gen = torch.Generator().manual_seed(1 + hvd.rank())
    batches = [(torch.randn(32, 64, generator=gen), torch.randint(0, 10, (32,), generator=gen))
               for _ in range(16)]
    samples, densities = [], []
    for step in range(steps):
        if step % sample_every == 0:
            samples.append({"step": step, **resources()})
        x, y = batches[step % len(batches)]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        densities.append(opt.last_stats.density)
    samples.append({"step": steps, **resources()})
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    spread = hvd.allreduce(flat, op=hvd.Max, name="soak.max") - hvd.allreduce(
        flat, op=hvd.Min, name="soak.min")
    return {"samples": samples, "iterations": opt.last_stats.iteration + 1,
            "mean_density": sum(densities) / len(densities),
            "weights_equal": bool(spread.abs().max() == 0), "size": hvd.size()}
