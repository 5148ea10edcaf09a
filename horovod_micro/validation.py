"""Collective argument checks: every rank raises the same error, none waits forever.

A rank that raised on its own would leave the others blocked in their first collective
until the launcher noticed. Instead every rank collects what is wrong with its own
arguments, the ranks allgather those findings together with what must agree across
ranks (parameter names, shapes and dtypes; the compressor's settings; the optimizer's
options), and then every rank raises one error naming each offending rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import horovod.torch as hvd
import torch

from .compressors.base import Compressor, config_of
from .exchange import Comm, allgather_object
from .layout import FlatLayout
from .momentum import masking_error
from .naming import canonical


@dataclass
class Arguments:
    """What ``hvm.DistributedOptimizer`` was given, as the checks see it.

    ``own_comm`` is the communicator the optimizer built for its exchange (None while it is
    being constructed): a sparse compressor bound to any other serves another optimizer.
    ``errors`` are problems found before the checks ran (naming the parameters)."""

    named: list[tuple[str, torch.nn.Parameter]]
    param_groups: list[dict]
    layout: FlatLayout
    compression: object
    groups: object
    backward_passes_per_step: object
    op: object
    gradient_predivide_factor: object
    own_comm: Comm | None = None
    errors: list[str] = field(default_factory=list)


def local_errors(args: Arguments) -> list[str]:
    """Problems with this rank's own arguments."""
    named, groups = args.named, args.groups
    errors = list(args.errors)
    names = [n for n, _ in named]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        errors.append(f"parameter names in named_parameters must be unique, found duplicates: "
                      f"{', '.join(dups)}")
    named_ids = {id(p) for _, p in named}
    unnamed = [p for g in args.param_groups for p in g["params"] if id(p) not in named_ids]
    if unnamed:
        errors.append(f"named_parameters was given but {len(unnamed)} optimizer parameter(s) "
                      "are not named in it")
    bpps = args.backward_passes_per_step
    if isinstance(bpps, bool) or not isinstance(bpps, int) or bpps < 1:
        errors.append(f"backward_passes_per_step must be an integer >= 1, got {bpps!r}")
    if args.op not in (hvd.Average, hvd.Sum):
        errors.append(f"op must be hvd.Average or hvd.Sum (hvd.Adasum: dense only), "
                      f"got {args.op!r}")
    factor = args.gradient_predivide_factor
    if not isinstance(factor, int | float) or not math.isfinite(factor) or factor <= 0:
        errors.append(f"gradient_predivide_factor must be a positive number, got {factor!r}")
    elif factor != 1.0 and args.op != hvd.Average:
        errors.append("gradient_predivide_factor != 1.0 requires op=hvd.Average")
    if groups is not None and not isinstance(groups, int | list | tuple):
        errors.append(f"groups must be an int or a list of lists of parameters, got "
                      f"{type(groups).__name__}")

    layout = args.layout
    for name, p in zip(layout.names, layout.params):
        if not torch.is_floating_point(p):
            errors.append(f"parameter {name!r} has dtype {p.dtype}: gradients must be "
                          "floating point")
    compression = args.compression
    devices = {str(p.device) for p in layout.params}
    if isinstance(compression, Compressor) and len(devices) > 1:
        # The sparse exchange treats the model as one flat vector on one device; the dense
        # path, like Horovod's, exchanges each parameter where it lives.
        errors.append(f"{compression.name}: all parameters must be on one device for a "
                      f"sparse exchange, found {sorted(devices)}")
    if isinstance(compression, Compressor):
        error = compression.config_error() or compression.bind_error(layout.numel)
        if error:
            errors.append(error)
        if compression.comm is not None and compression.comm is not args.own_comm:
            errors.append(f"this {compression.name} compressor already serves another "
                          "optimizer; create one compressor per optimizer")
        if layout.numel == 0:
            errors.append("no parameter requires a gradient")
        error = masking_error(compression, args.param_groups)
        if error:
            errors.append(error)
    return errors


def _compression_config(compression) -> dict:
    name = compression.__name__ if isinstance(compression, type) else type(compression).__name__
    return config_of(compression) or {"method": name}


def check_collectively(args: Arguments, comm: Comm) -> None:
    """Raise on every rank of ``comm``'s process set if any rank's arguments are wrong.

    ``comm``'s names must not depend on anything that may differ across ranks (the
    parameters, the compressor), or a rank with a typo would wait in a differently named
    collective."""
    mine = {
        "errors": local_errors(args),
        "signature": args.layout.signature(),
        "compression": _compression_config(args.compression),
        "options": {
            "backward_passes_per_step": args.backward_passes_per_step,
            "op": str(args.op),
            "gradient_predivide_factor": args.gradient_predivide_factor,
        },
    }
    if comm.size > 1:
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
            elif key == "compression" and (repr(canonical(report[key]))
                                           != repr(canonical(reference[key]))):
                # Equal in value, not in form (a plugin's -0.0 beside 0.0, a NumPy bool
                # beside a bool): the collectives' names hash the canonical form, so the
                # ranks would wait in differently named collectives.
                problems.append(f"rank {r}: compression {report[key]} is equal in value to "
                                f"rank 0's {reference[key]} but not in type or form; give "
                                "every rank the same settings")
    if problems:
        raise ValueError("horovod_micro.DistributedOptimizer: invalid arguments (reported on "
                         "every rank):\n  " + "\n  ".join(problems))


def _first_difference(a: list, b: list) -> str:
    for x, y in zip(a, b):
        if x != y:
            return f"{x} vs {y}"
    return f"{len(a)} vs {len(b)} parameters"
