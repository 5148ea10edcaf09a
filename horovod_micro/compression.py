"""Compressors, in the shape of Horovod's ``horovod.torch.compression``.

``Compression.none`` and ``Compression.fp16`` *are* Horovod's own stateless compressors
(dense allreduce, optionally float16 on the wire). The sparse ones are factories: each call
returns a new stateful compressor for one optimizer (it holds the threshold controller
and, through the optimizer, the error-feedback residual)::

    hvm.Compression.micro(density=0.001)

The baselines for side-by-side comparison share MiCRO's optimizer, exchange machinery
(status header, collective error reporting) and per-iteration statistics: ``topk``,
``cltk``, ``threshold``, ``randomk``, ``gtopk``, and the low-rank ``powersgd``. Every
sparse factory takes the keyword arguments ``error_feedback`` (default on) and
``fp16_values`` (default off).

Argument errors: outside a multi-rank Horovod job a factory raises at once. Under
``horovodrun`` the error is kept and raised by ``DistributedOptimizer`` on *every* rank
(after the ranks have compared notes), so one rank's typo cannot leave the others
blocked in a collective.
"""

from __future__ import annotations

import functools
import inspect

import horovod.torch as hvd
from horovod.torch.compression import Compressor as HorovodCompressor
from horovod.torch.compression import FP16Compressor, NoneCompressor

from .compressors import registry
from .compressors.base import Compressor


def _multi_rank_job() -> bool:
    try:
        return hvd.is_initialized() and hvd.size() > 1
    except ValueError:
        return False


def _checked(compressor: Compressor) -> Compressor:
    error = compressor.config_error()
    if error is not None and not _multi_rank_job():
        raise ValueError(error)
    return compressor


def is_dense_compressor(compression) -> bool:
    """Whether ``compression`` is one of Horovod's (stateless, per-tensor) compressors."""
    return isinstance(compression, type) and issubclass(compression, HorovodCompressor) or (
        isinstance(compression, HorovodCompressor))


def takes_density(factory) -> bool:
    """Whether a ``hvm.Compression`` factory takes a density (PowerSGD takes a rank; the
    dense compressors take nothing)."""
    return not isinstance(factory, type) and "density" in inspect.signature(factory).parameters


def factory(cls: type[Compressor]):
    """``cls``'s constructor, with the argument check of this module's docstring; it keeps
    ``cls``'s signature and docstring (``help(hvm.Compression.micro)``)."""
    @functools.wraps(cls)
    def make(*args, **kwargs) -> Compressor:
        return _checked(cls(*args, **kwargs))
    return make


class _Registered(type):
    """Resolves ``Compression.<name>`` to the factory of the registered method ``name``."""

    def __getattr__(cls, name: str):
        known = registry.compressors()
        if name in known:
            return factory(known[name])
        raise AttributeError(f"Compression has no {name!r}; compressors: "
                             f"{', '.join(registry.compressor_names())}")

    def __dir__(cls):
        return sorted(set(super().__dir__()) | set(registry.names()))


class Compression(metaclass=_Registered):
    """Factory of compressors, mirroring ``hvd.Compression``.

    ``Compression.none``/``fp16`` are Horovod's own; every sparse method registered in
    :mod:`horovod_micro.compressors.registry` is ``Compression.<name>(...)``, taking its
    class's arguments: ``micro(density, controller="bounded", judge=None,
    momentum_masking=None, capacity=None)``, ``topk(density)``, ``cltk(density)``,
    ``threshold(value=None, density=None)``, ``randomk(density, seed=0)``,
    ``gtopk(density)``, ``powersgd(rank=1)``, each also with ``error_feedback`` and
    ``fp16_values``. Each call returns a new compressor: use one per optimizer.

    Example::

        micro = hvm.Compression.micro(density=0.001)        # MiCRO, the defaults
        published = hvm.Compression.micro(density=0.001, judge="magnitude",
                                          momentum_masking=False, controller="paper")
        low_rank = hvm.Compression.powersgd(rank=2)
        dense = hvm.Compression.none                        # Horovod's allreduce
        opt = hvm.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=micro)
    """

    none = NoneCompressor
    """Dense allreduce, no compression (Horovod's ``hvd.Compression.none``)."""

    fp16 = FP16Compressor
    """Dense allreduce with float16 on the wire (Horovod's ``hvd.Compression.fp16``)."""
