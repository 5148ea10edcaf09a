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


def local_selection(numel):
    """What each sparsifier selects from a rank's own flat tensor (no communication)."""
    from horovod_micro.exchange import Comm

    x = torch.randn(numel, generator=torch.Generator().manual_seed(hvd.rank())).view(-1, 10)
    out = {"x": x.tolist()}
    for name, kwargs in [("topk", {"density": 0.1}), ("micro", {"density": 0.1}),
                         ("randomk", {"density": 0.1, "seed": 3})]:
        sparsifier = getattr(hvm.Compression, name)(**kwargs)
        sparsifier.bind(numel, Comm(prefix=f"compress.{name}"))
        indices = sparsifier.select(x.reshape(-1), 1).indices.long()
        out[name] = {"indices": indices.tolist(), "threshold": sparsifier.threshold()}
    return out
