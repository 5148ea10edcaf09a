"""Collective argument checks: every rank raises the same error, none waits forever.

A rank that raised on its own would leave the others blocked in their first collective
until the launcher noticed. Instead every rank collects what is wrong with its own
arguments, the ranks allgather those findings together with what must agree across
ranks (parameter names, shapes and dtypes; the compressor's settings; the optimizer's
options), and then every rank raises one error naming each offending rank.
"""

from __future__ import annotations

import math

import horovod.torch as hvd
import torch

from .exchange import Comm, allgather_object
from .sparsifiers.base import Sparsifier


def local_errors(opt, named, groups) -> list[str]:
    """Problems with this rank's own arguments."""
    errors = list(opt._argument_errors)
    names = [n for n, _ in named]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        errors.append(f"parameter names in named_parameters must be unique, found duplicates: "
                      f"{', '.join(dups)}")
    named_ids = {id(p) for _, p in named}
    unnamed = [p for g in opt.param_groups for p in g["params"] if id(p) not in named_ids]
    if unnamed:
        errors.append(f"named_parameters was given but {len(unnamed)} optimizer parameter(s) "
                      "are not named in it")
    bpps = opt.backward_passes_per_step
    if isinstance(bpps, bool) or not isinstance(bpps, int) or bpps < 1:
        errors.append(f"backward_passes_per_step must be an integer >= 1, got {bpps!r}")
    if opt.op not in (hvd.Average, hvd.Sum):
        errors.append(f"op must be hvd.Average or hvd.Sum (hvd.Adasum: dense only), "
                      f"got {opt.op!r}")
    factor = opt.gradient_predivide_factor
    if not isinstance(factor, int | float) or not math.isfinite(factor) or factor <= 0:
        errors.append(f"gradient_predivide_factor must be a positive number, got {factor!r}")
    elif factor != 1.0 and opt.op != hvd.Average:
        errors.append("gradient_predivide_factor != 1.0 requires op=hvd.Average")
    if groups is not None and not isinstance(groups, int | list | tuple):
        errors.append(f"groups must be an int or a list of lists of parameters, got "
                      f"{type(groups).__name__}")

    layout = opt._layout
    for name, p in zip(layout.names, layout.params):
        if not torch.is_floating_point(p):
            errors.append(f"parameter {name!r} has dtype {p.dtype}: gradients must be "
                          "floating point")
    compression = opt._compression
    devices = {str(p.device) for p in layout.params}
    if isinstance(compression, Sparsifier) and len(devices) > 1:
        # The sparse exchange treats the model as one flat vector on one device; the dense
        # path, like Horovod's, exchanges each parameter where it lives.
        errors.append(f"{compression.name}: all parameters must be on one device for a "
                      f"sparse exchange, found {sorted(devices)}")
    if isinstance(compression, Sparsifier):
        error = compression.config_error() or compression.bind_error(layout.numel)
        if error:
            errors.append(error)
        if compression.comm is not None and compression.comm is not getattr(opt, "_comm", None):
            errors.append(f"this {compression.name} compressor already serves another "
                          "optimizer; create one compressor per optimizer")
        if layout.numel == 0:
            errors.append("no parameter requires a gradient")
    return errors


def _compression_config(compression) -> dict:
    if isinstance(compression, Sparsifier):
        return compression.config()
    name = compression.__name__ if isinstance(compression, type) else type(compression).__name__
    return {"method": name}


def check_collectively(opt, named, groups, comm: Comm) -> None:
    """Raise on every rank of ``opt.process_set`` if any rank's arguments are wrong.

    ``comm``'s names must not depend on anything that may differ across ranks (the
    parameters, the compressor), or a rank with a typo would wait in a differently named
    collective."""
    mine = {
        "errors": local_errors(opt, named, groups),
        "signature": opt._layout.signature(),
        "compression": _compression_config(opt._compression),
        "options": {
            "backward_passes_per_step": opt.backward_passes_per_step,
            "op": str(opt.op),
            "gradient_predivide_factor": opt.gradient_predivide_factor,
        },
    }
    if opt.process_set.size() > 1:
        everyone = allgather_object(comm, mine)
    else:
        everyone = [mine]

    problems = [f"rank {r}: {e}" for r, report in enumerate(everyone) for e in report["errors"]]
    reference = everyone[0]
    for r, report in enumerate(everyone[1:], start=1):
        if report["signature"] != reference["signature"]:
            problems.append(f"rank {r}: parameters differ from rank 0's "
                            f"({_first_difference(reference['signature'], report['signature'])})")
        for key in ("compression", "options"):
            if report[key] != reference[key]:
                problems.append(f"rank {r}: {key} {report[key]} differs from rank 0's "
                                f"{reference[key]}")
    if problems:
        raise ValueError("horovod_micro.DistributedOptimizer: invalid arguments (reported on "
                         "every rank):\n  " + "\n  ".join(problems))


def _first_difference(a: list, b: list) -> str:
    for x, y in zip(a, b):
        if x != y:
            return f"{x} vs {y}"
    return f"{len(a)} vs {len(b)} parameters"
