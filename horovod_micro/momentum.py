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

It acts on every optimizer whose parameter groups set ``momentum > 0`` and whose
per-parameter state then holds a ``momentum_buffer`` (``torch.optim.SGD``, ``RMSprop``).
Adam and AdamW keep their first moment in ``exp_avg`` and are not masked: asking for masking
there (``momentum_masking=True``) is refused on every rank when the optimizer is wrapped,
and MiCRO's default warns once, on the set's first rank, where it would have masked. A
``step()`` that should have masked and found no buffer at all raises, so masking is never
silently off; ``opt.last_stats.momentum_masked`` says how many parameters were masked.
Never at density 1 (:meth:`~horovod_micro.compressors.base.Compressor.masks`).

Tuning: the compressor's ``momentum_masking`` argument. MiCRO's default (``None``) masks
from 8 ranks on: there the linearly scaled learning rate makes the momentum's re-applied
bursts diverge, while on fewer ranks the momentum's acceleration is worth more than the
protection (short runs converge markedly slower with masking). ``True`` masks at any size,
the first thing to try when a sparse run diverges; ``False`` never masks (the method as
published, with the momentum applied to the sparse aggregate like to a dense gradient).
The baselines default to ``False``.
"""

from __future__ import annotations

import warnings

import torch


def keeps_momentum_buffer(param_groups: list[dict]) -> bool:
    """Whether a torch optimizer with these parameter groups keeps a ``momentum_buffer``
    to mask (torch's convention: a group's ``momentum > 0``, as SGD and RMSprop have)."""
    return any(isinstance(g.get("momentum"), int | float) and g["momentum"] > 0
               for g in param_groups)


def masking_error(compression, param_groups: list[dict]) -> str | None:
    """Why masking cannot do what was asked of it, or None: ``momentum_masking=True``
    where the wrapped optimizer keeps nothing to mask."""
    if getattr(compression, "momentum_masking", None) is True and not keeps_momentum_buffer(
            param_groups):
        return (f"{compression.name}: momentum_masking=True, but the wrapped optimizer keeps "
                "no momentum buffer to mask (masking clears torch's 'momentum_buffer', kept "
                "by SGD and RMSprop with momentum > 0; Adam's and AdamW's 'exp_avg' is not "
                "masked): pass momentum_masking=None or False")
    return None


def warn_if_unmaskable(compression, param_groups: list[dict], size: int, first: bool) -> None:
    """On the set's first rank (``first``): warn once where the method's default would
    mask at ``size`` ranks but the wrapped optimizer has no momentum buffer."""
    if (first and getattr(compression, "momentum_masking", True) is None
            and compression.masks(size) and not keeps_momentum_buffer(param_groups)):
        warnings.warn(f"horovod_micro: {compression.name} masks the momentum from "
                      f"{compression.masks_momentum_from} ranks by default, but the wrapped "
                      "optimizer keeps no momentum buffer (Adam, AdamW, SGD without "
                      "momentum): nothing is masked (opt.last_stats.momentum_masked is 0)",
                      stacklevel=4)


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
    number of ranks (``reducer``: a :class:`~horovod_micro.reducer.SparseReducer`), and
    record how many parameters were masked in ``reducer.last_stats``. Raises where
    masking should have acted and found no momentum buffer at all (every rank holds the
    same optimizer state, so every rank raises alike)."""
    applied, reducer.applied = reducer.applied, None
    masked = 0
    if (applied is not None and reducer.compressor.masks(reducer.comm.size)
            and keeps_momentum_buffer(optimizer.param_groups)):
        masked = mask_momentum(optimizer, reducer.layout.params, reducer.layout.slices,
                               applied)
        if masked == 0 and applied.numel() > 0 and not any(
                "momentum_buffer" in optimizer.state.get(p, {}) for p in reducer.layout.params):
            raise RuntimeError(
                f"horovod_micro: {reducer.compressor.name}'s momentum masking found no "
                f"momentum buffer in the wrapped {type(optimizer).__name__}'s state after "
                "its step, so nothing was masked: masking clears torch's 'momentum_buffer' "
                "(SGD, RMSprop with momentum > 0); pass momentum_masking=False")
    if reducer.last_stats is not None and applied is not None:
        reducer.last_stats.momentum_masked = masked
