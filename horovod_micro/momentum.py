"""Momentum masking: a sparse aggregate moves the weights once, not for 1/(1 - m) steps.

Why. With error feedback a coordinate that waited ``T`` iterations arrives as one burst
holding ``T`` iterations of gradient. A momentum optimizer then keeps re-applying that
burst, decaying by ``m`` per step, for about ``1 / (1 - m)`` further steps: ten at
``m = 0.9``. Error feedback already delays the gradient; momentum on top stretches the
stale burst further. At the linearly scaled learning rates of many workers this feedback
becomes unstable (training degrades instead of converging), and it is worse the longer
coordinates wait, which is the case when each coordinate is judged by one worker's view
(MiCRO) and grows with the number of workers.

What. After the wrapped optimizer's step, the momentum buffer is cleared at the
coordinates that just received an aggregate. This is the momentum factor masking of Deep
Gradient Compression (Lin et al., ICLR 2018, Sec. 3.2), applied to the wrapped optimizer's
own buffer: the burst is applied in that step (with Nesterov's look-ahead factor
``1 + m``), and the momentum does not carry it on. Coordinates that received nothing keep
their momentum. Every rank applies the same aggregate at the same coordinates, so the
buffers stay identical across ranks.

It acts on every optimizer whose per-parameter state has a ``momentum_buffer``
(``torch.optim.SGD`` with ``momentum > 0``, ``RMSprop`` with ``momentum > 0``); other
optimizers are left alone.

Tuning: the compressor's ``momentum_masking`` argument. MiCRO's default (``None``) masks
from 8 ranks on: there the linearly scaled learning rate makes the momentum's re-applied
bursts diverge, while on fewer ranks the momentum's acceleration is worth more than the
protection (short runs converge markedly slower with masking). ``True`` masks at any size,
the first thing to try when a sparse run diverges; ``False`` never masks (the method as
published, with the momentum applied to the sparse aggregate like to a dense gradient).
The baselines default to ``False``.
"""

from __future__ import annotations

import torch


def mask_momentum(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter],
                  slices: list[tuple[int, int]], indices: torch.Tensor) -> int:
    """Zero each parameter's ``momentum_buffer`` at the flat ``indices`` (coordinates of
    the flat vector that ``params`` and their ``[start, end)`` ``slices`` make up).
    Returns how many parameters had a buffer to mask."""
    if indices.numel() == 0:
        return 0
    ordered = torch.sort(indices.long()).values
    starts = torch.tensor([s for s, _ in slices] + [slices[-1][1]], device=ordered.device)
    cuts = torch.searchsorted(ordered, starts).tolist()
    masked = 0
    for i, p in enumerate(params):
        lo, hi = cuts[i], cuts[i + 1]
        if lo == hi:
            continue
        buffer = optimizer.state.get(p, {}).get("momentum_buffer")
        if buffer is None:
            continue
        buffer.view(-1).index_fill_(0, ordered[lo:hi] - slices[i][0], 0.0)
        masked += 1
    return masked


def mask_applied(optimizer: torch.optim.Optimizer, reducer) -> None:
    """After the wrapped optimizer's step: mask the momentum at the coordinates the
    reducer's last exchange applied, once per exchange, where its compressor masks at this
    number of ranks (``reducer``: a :class:`~horovod_micro.reducer.SparseReducer`)."""
    applied, reducer.applied = reducer.applied, None
    if applied is not None and reducer.compressor.masks(reducer.comm.size):
        mask_momentum(optimizer, reducer.layout.params, reducer.layout.slices, applied)
