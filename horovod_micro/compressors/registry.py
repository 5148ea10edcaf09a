"""The one list of sparse compressors: everything that offers one asks this module.

A compressor is one module that defines a :class:`~horovod_micro.compressors.base.Compressor`
subclass decorated with :func:`register`. ``hvm.Compression.<name>(...)``, the train CLI's
``--compressor``, ``jobs/matrix.py``'s ``--compressors``, the benchmarks and the tests'
parametrisation all derive their lists from :func:`names`, so adding a compressor edits no
other file. Modules are found two ways, on first use:

* every module of the ``horovod_micro.compressors`` package (a built-in compressor is a
  new file there);
* every module named in the environment variable ``HOROVOD_MICRO_PLUGINS``
  (comma-separated, importable names), for compressors that live elsewhere: a user's own
  package, or a test's fixture. ``horovodrun`` passes the environment to every rank, so
  all ranks see the same compressors.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import threading

PLUGINS_ENV = "HOROVOD_MICRO_PLUGINS"
DENSE = ("none", "fp16")  # Horovod's own compressors: dense allreduce, no density

_compressors: dict[str, type] = {}
_discovered = False
# Discovery imports modules, which takes a while: a thread that asks meanwhile (n loopback
# ranks building their compressors at once) must wait for the whole list, not read half
# of it. Reentrant, since a module being imported may itself ask for the compressors.
_lock = threading.RLock()
_discovering = False


def register(cls: type) -> type:
    """Class decorator: offer ``cls`` (a Compressor subclass) under ``cls.name``."""
    name = cls.name
    if not name.isidentifier() or name.startswith("_") or name in DENSE:
        raise ValueError(f"compressor name {name!r} must be a public identifier other than "
                         f"{DENSE}")
    known = _compressors.get(name)
    if known is not None and known.__qualname__ != cls.__qualname__:
        raise ValueError(f"two compressors are named {name!r}: {known.__module__}."
                         f"{known.__qualname__} and {cls.__module__}.{cls.__qualname__}")
    _compressors[name] = cls
    return cls


def _discover() -> None:
    global _discovered, _discovering
    if _discovered:
        return
    with _lock:
        if _discovered or _discovering:  # done meanwhile, or asked by a module it imports
            return
        _discovering = True
        try:
            _import_all()
            _discovered = True
        finally:
            _discovering = False


def _import_all() -> None:
    package = importlib.import_module(__package__)
    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{__package__}.{module.name}")
    for name in filter(None, (m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(","))):
        try:
            importlib.import_module(name)
        except ImportError as error:
            raise ImportError(f"{PLUGINS_ENV} names {name!r}, which cannot be imported: "
                              f"{error}") from error


def compressors() -> dict[str, type]:
    """Every registered sparse compressor class, by name."""
    _discover()
    return dict(_compressors)


def names() -> tuple[str, ...]:
    """The names of the sparse compressors, sorted (independent of import order)."""
    return tuple(sorted(compressors()))


def compressor_names() -> tuple[str, ...]:
    """Every ``--compressor`` value: the sparse compressors, then Horovod's dense ones."""
    return names() + DENSE
