"""Independent single-process references for the multi-rank tests, and the gradient feeder.

The references are plain torch, written from the algorithm's definition
(``/work/shared/notes/sparsifiers.md``), not from horovod_micro's code: n workers live in
one process as n residual vectors, and every collective is a Python sum or concatenation.

``feed_gradients`` is what the rank bodies use to drive a real ``hvm.DistributedOptimizer``
with known per-rank gradients: one flat parameter whose ``.grad`` is set to
``rank_gradient(rank, t)`` before each ``synchronize()``.
"""

from __future__ import annotations

import torch


def rank_gradient(rank: int, iteration: int, numel: int, seed: int = 0,
                  skew: float = 0.0) -> torch.Tensor:
    """Deterministic float32 gradient of ``rank`` at ``iteration``.

    Heavy-tailed (Student-t like) values; ``skew > 0`` makes magnitudes grow along the
    vector, so later parts hold more large entries (unbalanced parts).
    """
    gen = torch.Generator().manual_seed(seed * 1_000_003 + rank * 7919 + iteration * 104_729)
    normal = torch.randn(numel, generator=gen)
    chi = torch.randn(numel, 3, generator=gen).pow(2).sum(1).div(3).sqrt()
    values = normal / chi * 0.01
    if skew:
        values *= torch.exp(torch.linspace(0.0, skew, numel))
    return values.float()


def contiguous_parts(numel: int, n: int) -> list[tuple[int, int]]:
    """n contiguous ranges covering [0, numel), the first numel % n one longer."""
    base, extra = divmod(numel, n)
    bounds, start = [], 0
    for p in range(n):
        end = start + base + (p < extra)
        bounds.append((start, end))
        start = end
    return bounds


def simulate_micro(grads: list[list[torch.Tensor]], thresholds: list[float], n: int,
                   average: bool = True, error_feedback: bool = True,
                   probe: float = 1.25) -> list[dict]:
    """MiCRO on n simulated workers. ``grads[t][r]`` is rank r's gradient at iteration t.

    Returns per iteration: the aggregated gradient, each rank's selection, each rank's
    residual after the exchange, and how many selected entries reach ``probe`` times the
    threshold (what the density controller measures its slope from).
    """
    numel = grads[0][0].numel()
    parts = contiguous_parts(numel, n)
    residual = [torch.zeros(numel) for _ in range(n)]
    history = []
    for t, threshold in enumerate(thresholds):
        acc = [(residual[r] if error_feedback else 0) + grads[t][r] for r in range(n)]
        selections = []
        for r in range(n):
            start, end = parts[(t + r) % n]
            local = torch.nonzero(acc[r][start:end].abs() >= threshold).view(-1) + start
            selections.append(local)
        above_probe = sum(int((acc[r][sel].abs() >= threshold * probe).sum())
                          for r, sel in enumerate(selections))
        union = torch.cat(selections)
        summed = sum(acc[r][union] for r in range(n))
        out = torch.zeros(numel)
        out[union] = summed / n if average else summed
        for r in range(n):
            residual[r] = acc[r].clone()
            residual[r][union] = 0.0
            if not error_feedback:
                residual[r].zero_()
        history.append({"grad": out, "selections": selections, "above_probe": above_probe,
                        "residual": [x.clone() for x in residual]})
    return history


def feed_gradients(opt, param: torch.nn.Parameter, rank: int, iterations: int,
                   numel: int, seed: int = 0, skew: float = 0.0, step: bool = True):
    """Drive ``opt`` with ``rank_gradient`` for ``iterations`` exchanges; yield per iteration
    (exchanged gradient, stats, residual after the exchange)."""
    for t in range(iterations):
        param.grad = rank_gradient(rank, t, numel, seed, skew)
        opt.synchronize()
        grad = param.grad.detach().clone()
        residual = opt.state_dict()["horovod_micro"]["residual"]
        yield grad, opt.last_stats, residual
        if step:
            with opt.skip_synchronize():
                opt.step()
        opt.zero_grad()
