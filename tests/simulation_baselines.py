"""Independent single-process references of the baseline compressors.

Written from the methods' definitions (their papers), in the style of ``simulation.py``: n
workers live in one process as n residual vectors, every collective is a Python sum,
concatenation or recursion. Plain torch; no horovod_micro code.

``grads[t][r]`` is rank r's gradient at iteration t. Each function returns, per iteration,
``{"grad": aggregated gradient, "residual": [per-rank residual after the exchange],
"selections": [per-rank selected coordinates], ...}``. ``wire`` rounds values as they are
sent (identity, or a float16 round trip for ``fp16_values``). Every method ends its step
with :func:`simulation.exchange_outcome`: where a rank's value went into the aggregate its
residual keeps only what the wire lost; non-finite steps follow the rule of docs/failure-modes.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from simulation import (
    allreduce_sum,
    exchange_outcome,
    fp16_round_trip,  # noqa: F401  (the tests import it from here)
    identity,
)


def _local_topk(acc: torch.Tensor, k: int) -> torch.Tensor:
    return torch.topk(acc.abs(), min(k, acc.numel())).indices.sort().values


def _finish(total: torch.Tensor, n: int, average: bool) -> torch.Tensor:
    return total / n if average else total


def _step(grads_t, residual, error_feedback):
    return [(residual[r] if error_feedback else 0) + g for r, g in enumerate(grads_t)]


def simulate_own_choice(grads, n: int, choose: Callable[[torch.Tensor], torch.Tensor],
                        average: bool = True, error_feedback: bool = True,
                        wire: Callable = identity) -> list[dict]:
    """Top-k / hard threshold: each rank picks its own coordinates and sends (index, value)
    pairs; the aggregate sums per coordinate; each rank's residual is cleared only where it
    sent a value."""
    numel, dtype = grads[0][0].numel(), grads[0][0].dtype
    residual = [torch.zeros(numel, dtype=dtype) for _ in range(n)]
    history = []
    for grads_t in grads:
        acc = _step(grads_t, residual, error_feedback)
        picks = [choose(a) for a in acc]
        total = torch.zeros(numel, dtype=dtype)
        for a, p in zip(acc, picks):
            total[p] += wire(a[p])
        union = torch.tensor(sorted(set().union(*(p.tolist() for p in picks))),
                             dtype=torch.long)
        out, residual, finite = exchange_outcome(acc, union, _finish(total[union], n, average),
                                                 picks, wire, error_feedback)
        history.append({"grad": out, "residual": residual, "selections": picks,
                        "union": union.tolist(), "finite": finite})
    return history


def simulate_topk(grads, n, k, **kw):
    return simulate_own_choice(grads, n, lambda a: _local_topk(a, k), **kw)


def simulate_threshold(grads, n, lam, **kw):
    return simulate_own_choice(
        grads, n, lambda a: torch.nonzero(a.abs() >= lam).view(-1), **kw)


def hard_threshold_from_density(density: float, numel: int) -> float:
    """Sahu et al.'s Top-k-equivalent heuristic ``1 / (2 sqrt(k))``."""
    return 1.0 / (2.0 * math.sqrt(math.floor(density * numel)))


def simulate_common(grads, n: int, coordinates_at: Callable[[int, list], torch.Tensor],
                    average: bool = True, error_feedback: bool = True,
                    wire: Callable = identity) -> list[dict]:
    """CLT-k / Random-k: one set of coordinates per iteration for all ranks; every rank sends
    its value there (one sum); every rank's residual is cleared there."""
    numel, dtype = grads[0][0].numel(), grads[0][0].dtype
    residual = [torch.zeros(numel, dtype=dtype) for _ in range(n)]
    history = []
    for t, grads_t in enumerate(grads):
        acc = _step(grads_t, residual, error_feedback)
        chosen = coordinates_at(t, acc)
        aggregate = _finish(allreduce_sum([a[chosen] for a in acc], wire), n, average)
        out, residual, finite = exchange_outcome(acc, chosen, aggregate, [chosen] * n, wire,
                                                 error_feedback)
        history.append({"grad": out, "residual": residual, "chosen": chosen,
                        "finite": finite})
    return history


def simulate_cltk(grads, n, k, **kw):
    """The leader of iteration t is rank t mod n; its local top-k is everyone's choice."""
    return simulate_common(grads, n, lambda t, acc: _local_topk(acc[t % n], k), **kw)


def simulate_randomk(grads, n, index_sets, **kw):
    """Random-k given the coordinates drawn at each iteration (the shared seed's choice is
    the implementation's; its properties are checked separately)."""
    return simulate_common(grads, n, lambda t, acc: index_sets[t], **kw)


def simulate_gtopk(grads, n: int, k: int, average: bool = True, error_feedback: bool = True,
                   wire: Callable = identity, index_bytes: int = 4,
                   value_bytes: int = 4) -> list[dict]:
    """gTop-k as a recursion over a binomial tree. A sparse set is a dict
    ``coordinate -> (summed value, set of ranks whose value is in the sum)``; a merge adds
    the two sums (the child's rounded by ``wire``, as sent) and keeps the k largest.
    A rank's residual is cleared at the final coordinates whose contributor set holds it.

    Also returns each rank's bytes (sent, received) under the implementation's message
    format: 8-byte count, indices, values, down messages one bit per coordinate; one
    alltoall per round with Horovod's 4 (n - 1)-byte split exchange; 12-byte header
    allgather first.
    """
    numel, dtype = grads[0][0].numel(), grads[0][0].dtype
    residual = [torch.zeros(numel, dtype=dtype) for _ in range(n)]
    levels = math.ceil(math.log2(n)) if n > 1 else 0
    history = []
    for grads_t in grads:
        acc = _step(grads_t, residual, error_feedback)
        sent = [12 * (n - 1) + 2 * levels * 4 * (n - 1)] * n
        received = list(sent)

        final = _subtree(0, levels, acc, k, n, wire, index_bytes + value_bytes, sent,
                         received)
        down = 8 + len(final) * (index_bytes + value_bytes) + (len(final) + 7) // 8
        for r in range(1, n):  # each non-root receives the final set once, from its parent
            parent = r - (1 << ((r & -r).bit_length() - 1))
            sent[parent] += down
            received[r] += down
        coords = list(final)
        values = wire(torch.tensor([final[i][0] for i in coords], dtype=dtype))
        contributed = [[i for i in coords if r in final[i][1]] for r in range(n)]
        out, residual, finite = exchange_outcome(
            acc, torch.tensor(coords, dtype=torch.long), _finish(values, n, average),
            [torch.tensor(c, dtype=torch.long) for c in contributed], wire, error_feedback)
        local = [_local_topk(a, k).tolist() for a in acc]
        history.append({"grad": out, "residual": residual, "final": coords, "finite": finite,
                        "contributed": contributed, "local": local, "bytes_sent": sent,
                        "bytes_received": received})
    return history


def _subtree(root: int, level: int, acc, k, n, wire, pair_bytes, sent, received) -> dict:
    """The set rank ``root`` holds after merging its subtree of ``2**level`` slots."""
    if level == 0:
        idx = _local_topk(acc[root], k)
        return {int(i): (float(acc[root][i]), {root}) for i in idx}
    args = (acc, k, n, wire, pair_bytes, sent, received)
    mine = _subtree(root, level - 1, *args)
    child = root + 2 ** (level - 1)
    if child >= n:
        return mine
    theirs = _subtree(child, level - 1, *args)
    size = 8 + len(theirs) * pair_bytes
    sent[child] += size
    received[root] += size
    dtype = acc[0].dtype
    rounded = wire(torch.tensor([v for v, _ in theirs.values()], dtype=dtype))
    merged = {i: (v, set(who)) for i, (v, who) in mine.items()}
    for (i, (_, who)), v in zip(theirs.items(), rounded.tolist()):
        if i in merged:  # addition in the residual's dtype, as on the rank
            total = torch.tensor([merged[i][0]], dtype=dtype) + torch.tensor([v], dtype=dtype)
            merged[i] = (float(total), merged[i][1] | who)
        else:
            merged[i] = (v, set(who))
    # Largest |sum| first; NaN ranks above everything, as in torch.topk.
    ranked = sorted(merged, key=lambda i: (not math.isnan(merged[i][0]),
                                           -abs(merged[i][0])))[:k]
    return {i: merged[i] for i in sorted(ranked)}


def buildup_gradient(rank: int, iteration: int, numel: int, k: int, n: int) -> torch.Tensor:
    """Input that shows Top-k's build-up: each rank has exactly k large entries (about 1)
    at coordinates no other rank uses, spread over the whole vector, on tiny noise; so the
    ranks' top-k sets are disjoint and their union holds n k coordinates."""
    gen = torch.Generator().manual_seed(rank * 7919 + iteration * 104_729 + 17)
    grad = torch.randn(numel, generator=gen) * 1e-4
    stride = numel // (n * k)
    large = torch.arange(k) * n * stride + rank * stride
    grad[large] = 1.0 + 0.1 * torch.rand(k, generator=gen)
    return grad
