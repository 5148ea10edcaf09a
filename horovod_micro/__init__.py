"""horovod-micro: MiCRO gradient sparsification as a drop-in Horovod DistributedOptimizer.

Example::

    import horovod.torch as hvd
    import horovod_micro as hvm

    hvd.init()
    opt = hvm.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=hvm.Compression.micro(density=0.001))
"""

from .compression import Compression
from .compressors.base import Compressor
from .deadline import ExchangeTimeout
from .optimizer import DistributedOptimizer
from .stats import StatsLog, StepStats
from .status import CollectiveInputError

__version__ = "0.2.0"

__all__ = [
    "CollectiveInputError",
    "Compression",
    "DistributedOptimizer",
    "ExchangeTimeout",
    "Compressor",
    "StatsLog",
    "StepStats",
    "__version__",
]
