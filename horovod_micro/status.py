"""The status word: what every rank tells every other rank in each exchange's header.

Each sparse exchange starts with an allgather whose block header holds one status integer
per rank (:mod:`horovod_micro.exchange`). It carries two things, at no extra message:

* a **code** (low 7 bits): a condition on this rank that must be acted on collectively:
  NaN/Inf in its gradient (every rank skips the step), or an input no rank can proceed
  with (a sparse gradient, a gradient with an autograd graph over the residual views,
  parameters changed after wrapping: every rank raises :class:`CollectiveInputError`);
* the **bounded** flag (bit 7): this rank's ``a_t`` cannot make the sum overflow
  (:data:`BOUNDED`);
* a **check word** (the bits above): a value every rank must hold alike, today a digest of
  which parameters are frozen (:func:`step_check`). Ranks that toggled ``requires_grad``
  on some ranks only would otherwise drift apart silently; if the words differ, every rank
  raises (:func:`describe_disagreement`).

A rank that finds a problem still takes part in the collective, so one rank's bad input
never leaves the others waiting; then :func:`raise_reported` raises the same error on
every rank. Checks of the arguments at construction are collective too
(:mod:`horovod_micro.validation`); what changed in the optimizer after wrapping is
:mod:`horovod_micro.consistency`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

OK = 0
NONFINITE = 1
SPARSE_GRADIENT = 2
GRAPH_GRADIENT = 3
PARAMS_CHANGED = 4
#: This rank loaded an optimizer state since its last exchange, and must adopt the set's
#: first rank's shared state before selecting. Every rank reporting it: they all adopt it
#: and exchange again (:class:`StateReloaded`); some ranks only: an error on every rank.
STATE_LOADED = 5
CODE_BITS = 8  # the status integer: code | check << CODE_BITS
#: A flag beside the code: this rank's ``a_t`` is small enough that no sum of the ranks'
#: values can overflow (:meth:`~horovod_micro.reducer.SparseReducer.reduce` sets it);
#: when every rank sets it, the aggregate is finite without a look at it.
BOUNDED = 1 << (CODE_BITS - 1)
CHECK_BITS = 23  # the check word's width: the integer fits int32 headers
STATUS_MESSAGES = {
    NONFINITE: "gradient holds NaN or Inf",
    SPARSE_GRADIENT: "a gradient is a sparse tensor (e.g. nn.Embedding(sparse=True)); "
    "sparse compressors need dense gradients: use sparse=False",
    GRAPH_GRADIENT: "a gradient carries an autograd graph (backward(create_graph=True)) "
    "while the gradients are views of the error-feedback residual; pass zero_copy=False "
    "to DistributedOptimizer for higher-order gradients",
    PARAMS_CHANGED: "the wrapped optimizer's parameters changed after wrapping "
    "(param_groups edited, add_param_group, or a parameter unfrozen that was frozen when "
    "wrapped); wrap the optimizer again after such a change",
}


class CollectiveInputError(RuntimeError):
    """A rank reported, through the exchange, an input that no rank can proceed with."""


class StateReloaded(Exception):
    """Every rank reported :data:`STATE_LOADED`: the exchange stops before any value moved,
    so that every rank adopts the set's first rank's state and exchanges again."""


def with_check(code: int, check: int) -> int:
    """The header's status integer: ``code`` plus a check word (< 2**23) that every rank
    must agree on."""
    return code | (check << CODE_BITS)


def split_status(word: int) -> tuple[int, int]:
    """``(code, check word)`` of a gathered status integer (without the
    :data:`BOUNDED` flag)."""
    return word & (BOUNDED - 1), word >> CODE_BITS


def is_bounded(word: int) -> bool:
    """Whether a gathered status integer carries the :data:`BOUNDED` flag."""
    return bool(word & BOUNDED)


def step_check(params: Sequence[torch.Tensor]) -> int:
    """The word every rank must agree on at each exchange:
    ``sum(i + 1 for frozen parameter i) mod 2**23`` (one parameter frozen alone, or one
    swapped for another, always changes it)."""
    return sum(i + 1 for i, p in enumerate(params) if not p.requires_grad) % (1 << CHECK_BITS)


def describe_disagreement(checks: Sequence[int]) -> str | None:
    """What the ranks' :func:`step_check` words say, or None if they agree."""
    if len(set(checks)) <= 1:
        return None
    return ("the ranks disagree on which parameters require a gradient (requires_grad "
            "toggled on some ranks only; frozen-parameter digests "
            + ", ".join(f"rank {r}: {c}" for r, c in enumerate(checks))
            + "): freeze and unfreeze parameters on every rank alike")


def raise_reported(codes: Sequence[int], checks: Sequence[int]) -> None:
    """Raise the same :class:`CollectiveInputError` on every rank if any rank reported an
    error code or the check words differ (every rank holds the same gathered lists)."""
    problems = [f"rank {r}: {STATUS_MESSAGES.get(c, f'status {c}')}"
                for r, c in enumerate(codes) if c not in (OK, NONFINITE, STATE_LOADED)]
    disagreement = describe_disagreement(checks)
    if disagreement:
        problems.append(disagreement)
    loaded = [r for r, c in enumerate(codes) if c == STATE_LOADED]
    if loaded and len(loaded) < len(codes):
        problems.append(
            f"rank(s) {loaded} loaded an optimizer state (load_state_dict) that the other "
            "ranks did not: load the checkpoint on every rank, or load it on one and then "
            "call hvd.broadcast_parameters(model.state_dict(), root_rank=0) and "
            "hvd.broadcast_optimizer_state(optimizer, root_rank=0) on every rank")
    if problems:
        raise CollectiveInputError("; ".join(problems))
    if loaded:
        raise StateReloaded()
