"""Compressors, in the shape of Horovod's ``horovod.torch.compression``.

``Compression.none`` and ``Compression.fp16`` *are* Horovod's own stateless compressors
(dense allreduce, optionally float16 on the wire). The sparse ones are factories: each call
returns a new stateful compressor for one optimizer (it holds the threshold controller
and, through the optimizer, the error-feedback residual)::

    hvm.Compression.micro(density=0.001)

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
from .sparsifiers.micro import MicroCompressor


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
        """MiCRO (Yoon & Oh, HiPC 2023): see :class:`~horovod_micro.sparsifiers.micro.MicroCompressor`."""
        return _checked(MicroCompressor(density, initial_threshold=initial_threshold,
                                        error_feedback=error_feedback,
                                        fp16_values=fp16_values))
