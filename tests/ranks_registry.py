"""Rank bodies for tests/test_registry.py."""

from __future__ import annotations

import horovod.torch as hvd
import torch

import horovod_micro as hvm


def plugin_steps(numel, steps, density):
    """Drive the fixture method (registered through HOROVOD_MICRO_PLUGINS) with known
    per-rank gradients; return the gradients the optimizer hands back."""
    from simulation import rank_gradient

    param = torch.nn.Parameter(torch.zeros(numel))
    opt = hvm.DistributedOptimizer(torch.optim.SGD([param], lr=0.0),
                                   named_parameters=[("w", param)],
                                   compression=hvm.Compression.cyclicblock(density=density))
    grads = []
    for t in range(steps):
        (param * rank_gradient(hvd.rank(), t, numel, seed=4)).sum().backward()
        opt.step()
        grads.append(param.grad.tolist())
        opt.zero_grad()
    return {"grads": grads, "method": opt.last_stats.method}
