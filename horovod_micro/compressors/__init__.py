"""What a compressor's author needs, in one import.

``from horovod_micro.compressors import Compressor, Selection, Aggregate, register`` and the
collectives and byte counts a method builds its exchange from (see ``docs/extending.md``
and the built-in methods in this package, each one file registered once)."""

from ..exchange import (
    Comm,
    SelectedCounts,
    Traffic,
    allgather_values,
    allreduce_values,
    gather_indices,
    gather_slots,
)
from ..selection import index_dtype
from ..stats import ring_allgather_bytes, ring_allreduce_bytes
from .base import (
    Aggregate,
    Compressor,
    ReduceOp,
    Selection,
    as_bool,
    as_float,
    as_int,
    config_of,
)
from .registry import register

__all__ = [
    "Aggregate", "Comm", "Compressor", "ReduceOp", "SelectedCounts", "Selection", "Traffic",
    "allgather_values", "allreduce_values", "as_bool", "as_float", "as_int", "config_of",
    "gather_indices", "gather_slots", "index_dtype", "register", "ring_allgather_bytes",
    "ring_allreduce_bytes",
]
