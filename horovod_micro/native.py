"""The built native CPU kernels (``_native/*.c``, compiled into ``horovod_micro._select``)
and the switch that keeps them off.

:func:`native_library` loads the shared object once per caller; each kernel's module
(:mod:`.selection`, :mod:`.accumulate`) declares its own functions' signatures. A source
tree where the kernels were not built gets None, and every caller then takes its torch
path. ``HOROVOD_MICRO_SELECT=torch`` (:func:`forced_torch`) forces the device-generic torch
path on the CPU too: the path a CUDA tensor takes, so tests exercise it on machines
without a GPU.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os


def native_library() -> ctypes.CDLL | None:
    """The built native kernels, or None in a tree where they were not built."""
    spec = importlib.util.find_spec("horovod_micro._select")
    if spec is None or spec.origin is None:
        return None
    return ctypes.CDLL(spec.origin)


def forced_torch() -> bool:
    """Whether ``HOROVOD_MICRO_SELECT=torch`` asks for the torch path on the CPU."""
    return os.environ.get("HOROVOD_MICRO_SELECT", "").lower() == "torch"
