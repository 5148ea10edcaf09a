"""Rank bodies for tests/test_registry.py."""

from __future__ import annotations

import horovod.torch as hvd
import torch

import horovod_micro as hvm


def plugin_steps(numel, steps, density):
    """Drive the fixture method (a plugin or a built-in, as the environment makes it) with known
    per-rank gradients; return the gradients the optimizer hands back, the bytes each step
    sent and what the method's byte model says."""
    from simulation import rank_gradient

    param = torch.nn.Parameter(torch.zeros(numel))
    compression = hvm.Compression.cyclicblock(density=density)
    opt = hvm.DistributedOptimizer(torch.optim.SGD([param], lr=0.0),
                                   named_parameters=[("w", param)], compression=compression)
    grads, sent = [], []
    for t in range(steps):
        (param * rank_gradient(hvd.rank(), t, numel, seed=4)).sum().backward()
        opt.step()
        grads.append(param.grad.tolist())
        sent.append(opt.last_stats.bytes_sent)
        opt.zero_grad()
    return {"grads": grads, "method": opt.last_stats.method, "sent": sent,
            "modeled": compression.modeled_bytes(hvd.size(), numel)}


def local_selection(numel):
    """What each compressor selects from a rank's own flat tensor (no communication)."""
    from horovod_micro.exchange import Comm

    x = torch.randn(numel, generator=torch.Generator().manual_seed(hvd.rank())).view(-1, 10)
    out = {"x": x.tolist()}
    for name, kwargs in [("topk", {"density": 0.1}), ("micro", {"density": 0.1}),
                         ("randomk", {"density": 0.1, "seed": 3})]:
        compressor = getattr(hvm.Compression, name)(**kwargs)
        compressor.bind(numel, Comm(prefix=f"compress.{name}"))
        selection = compressor.select(x.reshape(-1), 1)
        threshold = None if selection.threshold is None else float(selection.threshold)
        out[name] = {"indices": selection.indices.long().tolist(), "threshold": threshold}
    return out


def traffic(methods, steps):
    """Every named method (``{name: kwargs}``) on a small two-layer model: per step, the
    bytes this rank sent and every rank's count."""
    out = {}
    for name, kwargs in methods.items():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(30, 40), torch.nn.Linear(40, 5))
        opt = hvm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                       named_parameters=model.named_parameters(),
                                       compression=getattr(hvm.Compression, name)(**kwargs))
        gen = torch.Generator().manual_seed(100 + hvd.rank())
        rows = []
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(16, 30, generator=gen)).square().sum().backward()
            opt.step()
            rows.append({"sent": opt.last_stats.bytes_sent,
                         "counts": list(opt.last_stats.rank_counts)})
        out[name] = rows
    return out
