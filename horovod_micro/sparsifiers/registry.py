"""The one list of sparse methods: everything that offers a method asks this module.

A method is one module that defines a :class:`~horovod_micro.sparsifiers.base.Sparsifier`
subclass decorated with :func:`register`. ``hvm.Compression.<name>(...)``, the train CLI's
``--compressor``, ``jobs/matrix.py``'s ``--compressors``, the benchmarks and the tests'
parametrisation all derive their lists from :func:`names`, so adding a method edits no
other file. Modules are found two ways, on first use:

* every module of the ``horovod_micro.sparsifiers`` package (a built-in method is a new
  file there);
* every module named in the environment variable ``HOROVOD_MICRO_PLUGINS``
  (comma-separated, importable names), for methods that live elsewhere: a user's own
  package, or a test's fixture. ``horovodrun`` passes the environment to every rank, so
  all ranks see the same methods.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import threading

PLUGINS_ENV = "HOROVOD_MICRO_PLUGINS"
DENSE = ("none", "fp16")  # Horovod's own compressors: dense allreduce, no density

_methods: dict[str, type] = {}
_discovered = False
# Discovery imports modules, which takes a while: a thread that asks meanwhile (n loopback
# ranks building their compressors at once) must wait for the whole list, not read half
# of it. Reentrant, since a module being imported may itself ask for the methods.
_lock = threading.RLock()
_discovering = False


def register(cls: type) -> type:
    """Class decorator: offer ``cls`` (a Sparsifier subclass) under ``cls.name``."""
    name = cls.name
    if not name.isidentifier() or name.startswith("_") or name in DENSE:
        raise ValueError(f"sparsifier name {name!r} must be a public identifier other than "
                         f"{DENSE}")
    known = _methods.get(name)
    if known is not None and known.__qualname__ != cls.__qualname__:
        raise ValueError(f"two sparsifiers are named {name!r}: {known.__module__}."
                         f"{known.__qualname__} and {cls.__module__}.{cls.__qualname__}")
    _methods[name] = cls
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


def methods() -> dict[str, type]:
    """Every registered sparse method, by name."""
    _discover()
    return dict(_methods)


def names() -> tuple[str, ...]:
    """The names of the sparse methods, sorted (independent of import order)."""
    return tuple(sorted(methods()))


def compressor_names() -> tuple[str, ...]:
    """Every ``--compressor`` value: the sparse methods, then Horovod's dense ones."""
    return names() + DENSE
