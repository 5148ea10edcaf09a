"""MiCRO (Yoon & Oh, HiPC 2023): the compressor and its parts.

- :mod:`.compressor`: the method (``hvm.Compression.micro``), registered as ``micro``;
- :mod:`.partition`: the parts and which rank owns which at an iteration;
- :mod:`.ahead`: ``micro_ahead``, the coordinates agreed a step ahead (one collective);
- :mod:`.drift`: the default judge, a coordinate's residual weighed by its age;
- :mod:`.controller`: the interface of the density controllers, implemented by
  :mod:`.part_controller` (a threshold per part, the default) and
  :mod:`.density_controller` (one shared threshold).

The threshold selection kernel itself is shared with the other threshold methods
(:mod:`horovod_micro.selection`).
"""

from .ahead import MicroAheadCompressor
from .compressor import CONTROLLERS, JUDGES, MicroCompressor

__all__ = ["CONTROLLERS", "JUDGES", "MicroAheadCompressor", "MicroCompressor"]
