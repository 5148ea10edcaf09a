"""What changed in the wrapped optimizer after wrapping, checked at every exchange.

Two mistakes would otherwise let ranks drift apart silently, each rank's weights taking
its own path (Horovod's dense optimizer does not catch them either):

* the wrapped optimizer's parameters changed after wrapping (``add_param_group``, a
  parameter removed from ``param_groups``, or a parameter frozen at wrapping time that
  now requires a gradient): the added ones would be updated from this rank's gradient
  alone, the removed ones exchanged and never updated. Each rank sees this locally
  (:func:`parameter_changes`) and reports it as a status in the index gather, so every
  rank raises.
* ``requires_grad`` toggled on some ranks only: the rank that froze a parameter neither
  contributes to nor applies its update, the others do. Every rank puts a digest of which
  parameters are frozen into the check word of its status
  (:func:`horovod_micro.status.step_check`), and if the ranks' words differ every rank
  raises the same :class:`~horovod_micro.status.CollectiveInputError`.

Not detectable this way: a rank calling ``step()`` more often than the others. Its extra
exchange simply pairs with the others' next one (same names, same iteration count), and
only its last exchange finds no partner; that wait is bounded by
``HOROVOD_MICRO_EXCHANGE_TIMEOUT_SECONDS`` (:mod:`horovod_micro.deadline`; the
documentation's "Failure modes" page).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def parameter_changes(param_groups: list[dict], wrapped: set[int],
                      exchanged: Sequence[torch.Tensor], names: dict) -> str | None:
    """How the optimizer's parameters differ from those it was wrapped with, or None.

    ``wrapped``: ids of the parameters in ``param_groups`` at wrapping time;
    ``exchanged``: the parameters of the flat layout; ``names``: parameter -> name."""
    current = [p for group in param_groups for p in group["params"]]
    current_ids = {id(p) for p in current}
    exchanged_ids = {id(p) for p in exchanged}
    added = [p for p in current if id(p) not in wrapped]
    removed = [p for p in exchanged if id(p) not in current_ids]
    unfrozen = [p for p in current
                if id(p) in wrapped and id(p) not in exchanged_ids and p.requires_grad]
    problems = []
    if added:
        problems.append(f"{len(added)} parameter(s) added after wrapping (shapes "
                        f"{[tuple(p.shape) for p in added][:5]})")
    if removed:
        problems.append(f"removed after wrapping: {_names(removed, names)}")
    if unfrozen:
        problems.append(f"frozen when wrapped, now requiring a gradient: "
                        f"{_names(unfrozen, names)}")
    if not problems:
        return None
    return ("; ".join(problems) + ". The exchange covers the parameters of wrapping time "
            "only: wrap the optimizer again (hvm.DistributedOptimizer(...)) after changing "
            "its parameters")


def _names(params: Sequence[torch.Tensor], names: dict) -> str:
    shown = [names.get(p, f"a {tuple(p.shape)} tensor") for p in params[:5]]
    return ", ".join(shown) + (f" and {len(params) - 5} more" if len(params) > 5 else "")
