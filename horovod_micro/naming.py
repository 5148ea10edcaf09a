"""Names every rank agrees on: the parameters' and the collectives'.

Horovod pairs collectives across ranks by name, so a name may depend only on what every
rank of the process set shares: the parameters (sorted by name, as Horovod sorts them),
the compressor's settings, and how many such optimizers the process built before.
"""

from __future__ import annotations

import gc
import hashlib
import numbers
import weakref
from collections import Counter

import torch

from .compressors.base import Compressor
from .layout import FlatLayout

# How many optimizers this process has built per (process set, parameters, compressor):
# part of the collective names. Every rank of a set builds the same optimizers over the
# same parameters in the same order, so the count agrees across ranks even when ranks
# build different numbers of optimizers for *other* process sets.
_built: Counter = Counter()
# The optimizers of each key that are still alive: two of them at once can have their
# collectives paired across models (the sparse path's parameter check).
_alive: dict[tuple[int, str], weakref.WeakSet] = {}


def canonical(value):
    """``value`` with every real number as a float, in containers too: settings that the
    collective check holds equal (``16 == 16.0``, ``np.int64(2) == 2``) must also name the
    collectives alike, or the ranks wait in differently named ones."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, dict):
        return {k: canonical(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [canonical(v) for v in value]
    return value


def collective_prefix(set_id: int, layout: FlatLayout, compression, owner=None) -> str:
    """Names for this optimizer's collectives, from what every rank of the set shares.

    Horovod matches collectives by name. The prefix combines the process set, a digest of
    the (already collectively checked) parameter signature and compressor settings, and
    how many such optimizers this process built before: ranks that build different
    numbers of optimizers for other process sets still name the same collective alike.
    """
    config = compression.config() if isinstance(compression, Compressor) else repr(compression)
    digest = hashlib.sha1(repr((layout.signature(), canonical(config))).encode()).hexdigest()[:10]
    key = (set_id, digest)
    _built[key] += 1
    if owner is not None:
        _alive.setdefault(key, weakref.WeakSet()).add(owner)
    return f"hvm.ps{set_id}.{digest}.{_built[key] - 1}"


def name_parameters(param_groups, named_parameters) -> list[tuple[str, torch.nn.Parameter]]:
    """The (name, parameter) pairs that take part in the exchange, in an order every rank
    shares. Without ``named_parameters``, Horovod's ``allreduce.noname.<i>`` names."""
    all_params = [p for group in param_groups for p in group["params"]]
    if named_parameters is None:
        return [(f"allreduce.noname.{i}", p) for i, p in enumerate(all_params)]
    named = list(named_parameters)
    if any(not isinstance(item, tuple) or len(item) != 2 for item in named):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                         "usually produced by model.named_parameters().")
    in_optimizer = {id(p) for p in all_params}
    # Only parameters the optimizer updates take part, sorted by name as Horovod does, so
    # every rank builds the same flat layout. A tensor listed under several names (tied
    # weights, ``named_parameters(remove_duplicate=False)``) takes part once, under its
    # first name in that order: Horovod, too, keys its state by tensor.
    unique, seen = [], set()
    for n, p in sorted(named, key=lambda x: x[0]):
        if id(p) in in_optimizer and id(p) not in seen:
            seen.add(id(p))
            unique.append((n, p))
    return unique


def alive_alike(prefix: str) -> list:
    """The optimizers still alive that this process built with the same process set,
    parameters and compressor as the one named ``prefix`` (from :func:`collective_prefix`,
    given its ``owner``): where two are, their collectives pair by build order alone. An
    optimizer dropped meanwhile may wait for the cyclic garbage collector (its hooks hold
    it), so where others seem alive the collector runs once first."""
    _, set_part, digest, _ = prefix.split(".")
    alive = _alive.get((int(set_part[2:]), digest), weakref.WeakSet())
    if len(alive) > 1:
        gc.collect()
    return list(alive)
