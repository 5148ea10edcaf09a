"""Compressors, in the shape of Horovod's ``horovod.torch.compression``.

``Compression.none`` and ``Compression.fp16`` *are* Horovod's own stateless compressors
(dense allreduce, optionally float16 on the wire). The sparse ones are factories: each call
returns a new stateful compressor for one optimizer (it holds the threshold controller
and, through the optimizer, the error-feedback residual)::

    hvm.Compression.micro(density=0.001)

The baselines for side-by-side comparison share MiCRO's optimizer, exchange machinery
(status header, collective error reporting) and per-iteration statistics: ``topk``,
``cltk``, ``threshold``, ``randomk``, ``gtopk``. Every sparse factory takes the keyword
arguments ``error_feedback`` (default on) and ``fp16_values`` (default off).

Argument errors: outside a multi-rank Horovod job a factory raises at once. Under
``horovodrun`` the error is kept and raised by ``DistributedOptimizer`` on *every* rank
(after the ranks have compared notes), so one rank's typo cannot leave the others
blocked in a collective.
"""

from __future__ import annotations

import horovod.torch as hvd
from horovod.torch.compression import Compressor as HorovodCompressor
from horovod.torch.compression import FP16Compressor, NoneCompressor

from .sparsifiers.base import Sparsifier
from .sparsifiers.cltk import CltkCompressor
from .sparsifiers.gtopk import GtopkCompressor
from .sparsifiers.micro import MicroCompressor
from .sparsifiers.randomk import RandomkCompressor
from .sparsifiers.threshold import HardThresholdCompressor
from .sparsifiers.topk import TopkCompressor


def _multi_rank_job() -> bool:
    try:
        return hvd.is_initialized() and hvd.size() > 1
    except ValueError:
        return False


def _checked(compressor: Sparsifier) -> Sparsifier:
    error = compressor.config_error()
    if error is not None and not _multi_rank_job():
        raise ValueError(error)
    return compressor


def is_dense_compressor(compression) -> bool:
    """Whether ``compression`` is one of Horovod's (stateless, per-tensor) compressors."""
    return isinstance(compression, type) and issubclass(compression, HorovodCompressor) or (
        isinstance(compression, HorovodCompressor))


class Compression:
    """Factory of compressors, mirroring ``hvd.Compression``."""

    none = NoneCompressor
    """Dense allreduce, no compression (Horovod's ``hvd.Compression.none``)."""

    fp16 = FP16Compressor
    """Dense allreduce with float16 on the wire (Horovod's ``hvd.Compression.fp16``)."""

    @staticmethod
    def micro(density: float = 0.001, *, initial_threshold: float | None = None,
              error_feedback: bool = True, fp16_values: bool = False) -> MicroCompressor:
        """MiCRO (Yoon & Oh, HiPC 2023): partitioned exclusive selection with a steered
        threshold. See :class:`~horovod_micro.sparsifiers.micro.MicroCompressor`."""
        return _checked(MicroCompressor(density, initial_threshold=initial_threshold,
                                        error_feedback=error_feedback,
                                        fp16_values=fp16_values))

    @staticmethod
    def topk(density: float = 0.001, *, error_feedback: bool = True,
             fp16_values: bool = False) -> TopkCompressor:
        """Top-k: each rank sends its own k largest pairs, allgathered (O(k n) traffic; the
        union can reach n k). See :mod:`horovod_micro.sparsifiers.topk`."""
        return _checked(TopkCompressor(density, error_feedback=error_feedback,
                                       fp16_values=fp16_values))

    @staticmethod
    def cltk(density: float = 0.001, *, error_feedback: bool = True,
             fp16_values: bool = False) -> CltkCompressor:
        """Cyclic local top-k (ScaleCom, NeurIPS 2020): a rotating leader's top-k indices,
        everyone's values allreduced. See :mod:`horovod_micro.sparsifiers.cltk`."""
        return _checked(CltkCompressor(density, error_feedback=error_feedback,
                                       fp16_values=fp16_values))

    @staticmethod
    def threshold(value: float | None = None, density: float | None = None, *,
                  error_feedback: bool = True,
                  fp16_values: bool = False) -> HardThresholdCompressor:
        """Hard threshold (Sahu et al., NeurIPS 2021): send ``|a| >= value``; or, with
        ``density``, ``value = 1 / (2 sqrt(floor(density N)))``. Give exactly one.
        See :mod:`horovod_micro.sparsifiers.threshold`."""
        return _checked(HardThresholdCompressor(value, density, error_feedback=error_feedback,
                                                fp16_values=fp16_values))

    @staticmethod
    def randomk(density: float = 0.001, seed: int = 0, *, error_feedback: bool = True,
                fp16_values: bool = False) -> RandomkCompressor:
        """Random-k: k coordinates from a seed shared by all ranks (from ``seed`` and the
        iteration), values allreduced. See :mod:`horovod_micro.sparsifiers.randomk`."""
        return _checked(RandomkCompressor(density, seed=seed, error_feedback=error_feedback,
                                          fp16_values=fp16_values))

    @staticmethod
    def gtopk(density: float = 0.001, *, error_feedback: bool = True,
              fp16_values: bool = False) -> GtopkCompressor:
        """gTop-k (Shi et al., ICDCS 2019): tree merge of the ranks' top-k sets and tree
        broadcast, O(k log n) traffic. See :mod:`horovod_micro.sparsifiers.gtopk`."""
        return _checked(GtopkCompressor(density, error_feedback=error_feedback,
                                        fp16_values=fp16_values))
