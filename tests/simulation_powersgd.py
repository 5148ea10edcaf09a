"""PowerSGD on n workers in one process, written from the paper's Algorithm 1 (Vogels et
al., NeurIPS 2019) with error feedback and a warm start, independently of
:mod:`horovod_micro.compressors.powersgd`: orthonormalisation by Householder QR in float64
(the library runs Gram-Schmidt in the gradient's dtype), one matrix at a time, no flat
buffers, no batching.
"""

from __future__ import annotations

import math

import torch

#: The library's documented default: a matrix is compressed when its factors are at least
#: this many times smaller than it.
DEFAULT_MIN_COMPRESSION = 16.0


def compressed(shape: tuple[int, ...], rank: int,
               min_compression: float = DEFAULT_MIN_COMPRESSION) -> bool:
    """Whether a parameter of ``shape`` travels as rank-``rank`` factors."""
    if len(shape) < 2:
        return False
    rows, cols = shape[0], math.prod(shape[1:])
    return rows * cols > min_compression * rank * (rows + cols)


def initial_qs(shapes, rank: int, seed: int = 0,
               min_compression: float = DEFAULT_MIN_COMPRESSION) -> list[torch.Tensor | None]:
    """The first Q of every compressed parameter: one float64 normal draw of ``seed`` for
    all of them, cut in parameter order (the library's documented initialisation)."""
    sizes = [math.prod(s[1:]) * rank if compressed(s, rank, min_compression) else 0
             for s in shapes]
    draw = torch.randn(sum(sizes), generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)
    out, start = [], 0
    for size in sizes:
        out.append(draw[start:start + size].view(-1, rank) if size else None)
        start += size
    return out


def _orthonormal(p: torch.Tensor) -> torch.Tensor:
    q, r = torch.linalg.qr(p)
    return q * torch.sign(torch.diagonal(r)).where(torch.diagonal(r) != 0, 1.0)


def simulate_powersgd(grads, shapes, rank: int, seed: int = 0, average: bool = True,
                      start_iteration: int = 0,
                      min_compression: float = DEFAULT_MIN_COMPRESSION):
    """``grads[t][w]``: worker w's list of parameter gradients at step t. Per step: the
    aggregate (list per parameter, identical on every worker) and each worker's residual
    (list per parameter), in float64. Before ``start_iteration`` the step is the plain
    average (the residual is sent whole) and Q waits."""
    n = len(grads[0])
    first = initial_qs(shapes, rank, seed, min_compression)
    qs = [None if q is None else q.clone() for q in first]
    residuals = [[torch.zeros(s, dtype=torch.float64) for s in shapes] for _ in range(n)]
    out = []
    for t, step in enumerate(grads):
        accs = [[e + g.double() for e, g in zip(residuals[w], step[w])] for w in range(n)]
        aggregate = []
        for i, shape in enumerate(shapes):
            ms = [accs[w][i] for w in range(n)]
            if qs[i] is None or t < start_iteration:
                aggregate.append(sum(ms) / (n if average else 1))
                for w in range(n):
                    residuals[w][i] = torch.zeros(shape, dtype=torch.float64)
                continue
            mats = [m.reshape(shape[0], -1) for m in ms]
            # The warm start: the kept Q with orthonormal columns; where one of its
            # columns is zero or not finite (after a step whose gradient was zero), the
            # first Q again.
            q = qs[i]
            if not bool(torch.isfinite(q).all()) or bool((q.norm(dim=0) == 0).any()):
                q = first[i]
            p = _orthonormal(sum(m @ _orthonormal(q) for m in mats))
            local_q = [m.T @ p for m in mats]
            total_q = sum(local_q)
            aggregate.append((p @ total_q.T / (n if average else 1)).reshape(shape))
            for w in range(n):
                residuals[w][i] = (mats[w] - p @ local_q[w].T).reshape(shape)
            qs[i] = total_q / n
        out.append({"aggregate": aggregate,
                    "residuals": [[r.clone() for r in res] for res in residuals]})
    return out
