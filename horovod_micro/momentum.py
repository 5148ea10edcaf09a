"""Momentum masking: a sparse aggregate moves the weights once, not for 1/(1 - m) steps.

Why. With error feedback a coordinate that waited ``T`` iterations arrives as one burst
holding ``T`` iterations of gradient. A momentum optimizer then keeps re-applying that
burst, decaying by ``m`` per step, for about ``1 / (1 - m)`` further steps: ten at
``m = 0.9``. Error feedback already delays the gradient; momentum on top stretches the
stale burst further. At the linearly scaled learning rates of many workers this feedback
becomes unstable (training degrades instead of converging), and it is worse the longer
coordinates wait, which is the case when each coordinate is judged by one worker's view
(MiCRO) and grows with the number of workers.

What. After the wrapped optimizer's step, the momentum buffer is scaled down (or cleared)
at the coordinates that just received an aggregate. This is the momentum factor masking of
Deep Gradient Compression (Lin et al., ICLR 2018, Sec. 3.2), applied to the wrapped
optimizer's own buffer: the burst is applied in that step (with Nesterov's look-ahead
factor ``1 + m``), and the momentum carries on only what is kept of it. Coordinates that
received nothing keep their momentum. Every rank applies the same aggregate at the same
coordinates, so the buffers stay identical across ranks.

How much. Unmasked, a burst moves the weights by ``lr / (1 - m)`` times itself over the
following steps; cleared, by ``lr (1 + m)`` with Nesterov (``lr`` with heavy ball): about
a fifth at ``m = 0.9``, which is what cures the instability and also what slows a short
run at a small learning rate. MiCRO's default (``momentum_masking=None``) keeps the carry
in between, from the learning rate of the parameter's group at each step: at or below
:data:`SAFE_LR` nothing is masked; above it a fraction of the burst stays in the buffer,
chosen so that the burst's whole effect is that of a burst at ``SAFE_LR`` unmasked
(:func:`kept_fraction`), until the buffer is cleared outright (at ``lr`` about ``0.26``
with Nesterov). The rule is continuous in the learning rate, so in the number of ranks
under linear scaling; it does not depend on a rank count. ``True`` always clears (the
first thing to try when a sparse run diverges), ``False`` never masks (the method as
published). The baselines default to ``False``.

Which optimizers. SGD and RMSprop with ``momentum > 0`` (``momentum_buffer``), as above.
Adam and AdamW (``exp_avg``): their first moment applies only ``1 - beta1`` of a burst in
its step and spreads the rest over the following ones, so clearing it after the step
alone would drop nine tenths of every burst. Instead the first moment at the burst's
coordinates is set before the step so that the step's bias-corrected first moment there is
the burst itself, and cleared after it: the burst is applied whole, once, normalised by the
second moment (:func:`prime_adam`). The second moment takes the burst's square divided by
the square root of its age (the iterations it accumulated; MiCRO keeps them under Adam,
other methods give the plain square). A burst of age ``k`` holds about ``k`` gradients:
its plain square would make the second moment ``k`` times a gradient's, and each burst
would move a weight about ``sqrt(k)`` times the learning rate where dense Adam moves it
``k`` times over the same steps; divided by ``k``, a stale burst of noise moves as far as
one of signal and training becomes unstable from 8 workers. The square root between the
two is measured best (``BENCHMARKS.md``, "Off the grid"). This is the default (and
``True``) with Adam at any learning rate; ``amsgrad`` keeps the plain square.
``momentum_masking=True`` with an optimizer that keeps no momentum (SGD without momentum)
is refused on every rank when the optimizer is wrapped, and MiCRO's default warns there
once. A ``step()`` that should have
masked and found no buffer at all raises, so masking is never silently off;
``opt.last_stats.momentum_masked`` says how many parameters were masked.
Cost: where it acts, the arrived indices are split by parameter, which reads one vector of
a few integers per parameter to the host each step (on a GPU, a wait); at a learning rate
where the rule keeps every burst, nothing runs. Never at density
1 (:meth:`~horovod_micro.compressors.base.Compressor.masks`).
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from dataclasses import dataclass

import torch

#: The per-parameter optimizer state that carries a gradient on to later steps, by torch's
#: names: SGD's and RMSprop's momentum, Adam's and AdamW's first moment.
CARRIERS = ("momentum_buffer", "exp_avg")
#: Adam's second moment takes an arrived burst's square divided by its age to this power
#: (see the module docstring).
AGE_POWER = 0.5
#: MiCRO's default masking keeps a burst's effect to at most what it has at this learning
#: rate unmasked: the linearly scaled rate of 2 workers of batch 32 at the usual base lr
#: 0.1 per 128 samples.
SAFE_LR = 0.05


@dataclass(frozen=True)
class Arrived:
    """Where an exchange applied an aggregate: flat ``indices``, and per index how many
    iterations it accumulated (``waited``, int; None where the method keeps no ages)."""
    indices: torch.Tensor
    waited: torch.Tensor | None = None


def keeps_momentum(param_groups: list[dict]) -> bool:
    """Whether a torch optimizer with these parameter groups carries gradients on to later
    steps (torch's conventions: a group's ``momentum > 0``, as SGD and RMSprop have, or
    ``betas[0] > 0``, as Adam and AdamW have)."""
    def carries(g):
        m = g.get("momentum", 0) if "betas" not in g else g["betas"][0]
        return isinstance(m, int | float) and m > 0
    return any(carries(g) for g in param_groups)


def masking_error(compression, param_groups: list[dict]) -> str | None:
    """Why masking cannot do what was asked of it, or None: ``momentum_masking=True``
    where the wrapped optimizer keeps nothing to mask."""
    if getattr(compression, "momentum_masking", None) is True and not keeps_momentum(
            param_groups):
        return (f"{compression.name}: momentum_masking=True, but the wrapped optimizer keeps "
                "no momentum buffer to mask (masking acts on SGD's and RMSprop's "
                "'momentum_buffer' with momentum > 0, and Adam's and AdamW's 'exp_avg'): pass "
                "momentum_masking=None or False")
    return None


def warn_if_unmaskable(compression, param_groups: list[dict], first: bool) -> None:
    """On the set's first rank (``first``): warn once where the method's default masks but
    the wrapped optimizer has no momentum buffer."""
    if (first and getattr(compression, "momentum_masking", True) is None
            and compression.masks() and not keeps_momentum(param_groups)):
        warnings.warn(f"horovod_micro: {compression.name} masks the momentum by default, "
                      "but the wrapped optimizer keeps no momentum (SGD without momentum): "
                      "nothing is masked (opt.last_stats.momentum_masked is 0)", stacklevel=4)


def kept_fraction(group: dict, full: bool) -> float:
    """The fraction of an arrived burst that a parameter group's momentum keeps carrying:
    0 with ``full`` masking (``momentum_masking=True``). MiCRO's default scales the carry
    so that a burst moves the weights by at most what the same gradient would move them
    at a learning rate of :data:`SAFE_LR` without masking: nothing is masked at or below
    that rate, and the carry shrinks continuously above it (see the module docstring)."""
    if full or "betas" in group:  # Adam's burst is applied whole, then cleared
        return 0.0
    lr, m = float(group.get("lr", 0.0)), float(group.get("momentum", 0.0) or 0.0)
    if m <= 0.0 or lr <= SAFE_LR:
        return 1.0
    wanted = SAFE_LR / lr  # the burst's share of its unmasked effect, 1 / (1 - m)
    # A burst's effect relative to the unmasked one when a fraction c of it stays in the
    # buffer: Nesterov applies it with 1 + m at once and c m^2 / (1 - m) later, heavy ball
    # with 1 and c m / (1 - m).
    floor, slope = (1.0 - m * m, m * m) if group.get("nesterov") else (1.0 - m, m)
    return min(1.0, max(0.0, (wanted - floor) / slope))


def per_parameter(slices: list[tuple[int, int]], indices: torch.Tensor,
                  *aligned: torch.Tensor):
    """``(i, local, *parts)`` for each parameter ``i`` that holds some of the flat
    ``indices`` (coordinates of the flat vector that the parameters' ``[start, end)``
    ``slices`` make up), ``local`` being those coordinates within it and ``parts`` the
    entries of each ``aligned`` tensor (one entry per index) that belong to them."""
    ordered, order = torch.sort(indices.long())
    aligned = tuple(a.index_select(0, order) for a in aligned)
    starts = torch.tensor([s for s, _ in slices] + [slices[-1][1]], device=ordered.device)
    cuts = torch.searchsorted(ordered, starts).tolist()
    for i in range(len(slices)):
        if cuts[i] < cuts[i + 1]:
            yield (i, ordered[cuts[i]:cuts[i + 1]] - slices[i][0],
                   *(a[cuts[i]:cuts[i + 1]] for a in aligned))


def prime_adam(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter],
               slices: list[tuple[int, int]], arrived: Arrived) -> list:
    """Before an Adam or AdamW step, at the flat coordinates where a burst ``g`` arrived
    (``arrived.indices``, each of age ``k``: ``arrived.waited``): set
    ``exp_avg`` so that the step's bias-corrected first moment there applies the burst
    whole, as a first moment of ``g`` would over a second moment that took ``g^2 /
    k^AGE_POWER`` (``v_b``) instead of the ``g^2`` the step adds (``v_a``): ``g (sqrt(v_a) +
    eps) / (sqrt(v_b) + eps)`` (bias-corrected ``v``; equal to ``g`` where ``k`` is 1).
    Without ages (``waited`` None), and for Adamax and ``amsgrad``, the first moment is
    ``g`` and the second moment is Adam's own. Returns the ``(exp_avg_sq, coordinates,
    v_b)`` that :func:`settle_adam` writes after the step. Other optimizers' state is left
    alone, and so is a parameter's first step (a first moment of 0 gives ``g`` there)."""
    settle = []
    if arrived.indices.numel() == 0:
        return settle
    groups = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    aligned = () if arrived.waited is None else (arrived.waited,)
    for i, at, *waited in per_parameter(slices, arrived.indices, *aligned):
        p = params[i]
        group, state = groups.get(id(p), {}), optimizer.state.get(p, {})
        if "betas" not in group or "exp_avg" not in state or p.grad is None:
            continue
        (b1, b2), t = group["betas"], int(state["step"]) + 1
        moment, square = state["exp_avg"].view(-1), state.get("exp_avg_sq")
        g = p.grad.reshape(-1).index_select(0, at).float()
        g = -g if group.get("maximize") else g
        burst = g
        if waited and square is not None and not group.get("amsgrad"):  # Adamax: no square
            k, square = waited[0], square.view(-1)
            before, bias2, eps = square.index_select(0, at).float(), 1.0 - b2 ** t, group["eps"]
            added = before * b2 + (1.0 - b2) * g * g
            taken = before * b2 + (1.0 - b2) * g * g / k.float().pow(AGE_POWER)
            burst = g * ((added / bias2).sqrt() + eps) / ((taken / bias2).sqrt() + eps)
            settle.append((square, at, taken.to(square.dtype)))
        # The step adds (1 - b1) g to b1 m: its first moment is burst (1 - b1^t) after it.
        moment.index_copy_(0, at, ((burst * (1.0 - b1 ** t) - (1.0 - b1) * g) / b1
                                   ).to(moment.dtype))
    return settle


def settle_adam(settle: list) -> None:
    """After the step: each burst's second moment as :func:`prime_adam` took it."""
    for square, at, taken in settle:
        square.index_copy_(0, at, taken)


def mask_momentum(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter],
                  slices: list[tuple[int, int]], indices: torch.Tensor, *,
                  full: bool = True) -> int:
    """Clear each parameter's carried momentum (``momentum_buffer``; ``exp_avg``) at the
    flat ``indices`` (coordinates of the flat vector that ``params`` and their
    ``[start, end)`` ``slices`` make up): zero it with ``full`` or for Adam, else scale it
    by its group's :func:`kept_fraction`. Returns how many parameters had a buffer masked."""
    if indices.numel() == 0:
        return 0
    groups = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    masked = 0
    for i, at in per_parameter(slices, indices):
        p = params[i]
        state = optimizer.state.get(p, {})
        buffer = next((state[key] for key in CARRIERS if key in state), None)
        kept = kept_fraction(groups.get(id(p), {}), full)
        if buffer is None or kept >= 1.0:
            continue
        if kept == 0.0:
            buffer.view(-1).index_fill_(0, at, 0.0)
        else:
            flat = buffer.view(-1)
            flat.index_copy_(0, at, flat.index_select(0, at) * kept)
        masked += 1
    return masked


@contextmanager
def masking(optimizer: torch.optim.Optimizer, compressor, layout, arrived: Arrived | None,
            stats):
    """Around the wrapped optimizer's step, after an exchange that applied an aggregate
    where ``arrived`` says (None: nothing to mask, a dense path or a skipped step) over
    ``layout``'s parameters: Adam's moments primed before the step and settled after it
    (:func:`prime_adam`), the momentum masked after it (:func:`mask_applied`), where
    ``compressor`` masks."""
    settle = []
    if (arrived is not None and compressor.masks()
            and any("betas" in g for g in optimizer.param_groups)):  # Adam's kind only
        settle = prime_adam(optimizer, layout.params, layout.slices, arrived)
    yield
    settle_adam(settle)
    if arrived is not None:
        mask_applied(optimizer, compressor, layout, arrived.indices, stats)


def mask_applied(optimizer: torch.optim.Optimizer, compressor, layout, applied: torch.Tensor,
                 stats) -> None:
    """After the wrapped optimizer's step: mask the momentum at the flat coordinates
    ``applied`` of ``layout``'s parameters, where ``compressor`` masks at this number of
    ranks, and record how many parameters were masked in ``stats`` (the exchange's
    :class:`~horovod_micro.stats.StepStats`, or None). Raises where masking should have
    acted and found no momentum buffer at all (every rank holds the same optimizer state,
    so every rank raises alike)."""
    masked = 0
    full = compressor.momentum_masking is True
    if (compressor.masks() and keeps_momentum(optimizer.param_groups)
            # At a learning rate where the rule keeps every burst, nothing to do (and no
            # split of the indices by parameter, which reads the host).
            and any(kept_fraction(g, full) < 1.0 for g in optimizer.param_groups)):
        masked = mask_momentum(optimizer, layout.params, layout.slices, applied, full=full)
        if masked == 0 and applied.numel() > 0 and not any(
                key in optimizer.state.get(p, {}) for p in layout.params
                for key in CARRIERS):
            raise RuntimeError(
                f"horovod_micro: {compressor.name}'s momentum masking found no "
                f"momentum buffer in the wrapped {type(optimizer).__name__}'s state after "
                "its step, so nothing was masked: masking acts on torch's 'momentum_buffer' "
                "(SGD, RMSprop with momentum > 0) and 'exp_avg' (Adam, AdamW); pass "
                "momentum_masking=False")
    if stats is not None:
        stats.momentum_masked = masked
