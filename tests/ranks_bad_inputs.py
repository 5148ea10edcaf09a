"""Rank bodies of tests/test_bad_inputs.py: misuse after wrapping, on real ranks.

Each case builds a fresh model and optimizer, trains a few steps, misuses them as the
case says (on every rank, or on ``ODD`` only), and keeps stepping. What every rank raised
is recorded, and the ranks go on to the next case: a case that left a rank waiting would
show up as a hang of the run, which the harness reports."""

from __future__ import annotations

import horovod.torch as hvd
import torch

import horovod_micro as hvm

ODD = 1  # the rank that misbehaves alone in the "one rank" cases


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _wrap(model, sparse: bool, params=None):
    base = torch.optim.SGD(params if params is not None else model.parameters(), lr=0.05,
                           momentum=0.9)
    named = [(n, p) for n, p in model.named_parameters()
             if params is None or any(p is q for q in params)]
    compression = hvm.Compression.micro(density=0.05) if sparse else hvm.Compression.none
    return hvm.DistributedOptimizer(base, named_parameters=named, compression=compression)


def _step(model, opt, t: int) -> None:
    gen = torch.Generator().manual_seed(100 * hvd.rank() + t)
    x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def _same_on_all_ranks(model, name: str) -> bool:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    low = hvd.allreduce(flat, op=hvd.Min, name=f"{name}.min")
    high = hvd.allreduce(flat, op=hvd.Max, name=f"{name}.max")
    return bool(torch.equal(low, high))


def _misuse(case: str, model, opt, everyone: bool):
    """Apply ``case`` to this rank (all ranks, or ODD only); returns the tensor to watch."""
    if not everyone and hvd.rank() != ODD:
        return None
    if case == "param_added":
        extra = torch.nn.Parameter(torch.zeros(3))
        opt.add_param_group({"params": [extra]})
        return extra
    if case == "param_removed":
        return opt.param_groups[0]["params"].pop()
    if case in ("frozen", "frozen_unfrozen"):
        model[0].weight.requires_grad_(False)
        return model[0].weight
    if case == "unfrozen_after_wrapping":
        model[0].bias.requires_grad_(True)  # frozen when wrapped (see run_case)
        return model[0].bias
    raise AssertionError(case)


def run_case(case: str, sparse: bool, everyone: bool, steps: int = 3) -> dict:
    model = _model()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    if case == "unfrozen_after_wrapping":
        model[0].bias.requires_grad_(False)
    opt = _wrap(model, sparse)
    for t in range(2):
        _step(model, opt, t)
    watched = _misuse(case, model, opt, everyone)
    before = None if watched is None else watched.detach().clone()
    result = {"raised": None}
    try:
        for t in range(2, 2 + steps):
            _step(model, opt, t)
        if case == "frozen_unfrozen":  # unfreeze again: it trains again
            model[0].weight.requires_grad_(True)
            _step(model, opt, 50)
    except Exception as error:  # noqa: BLE001  the type is part of what is checked
        result = {"raised": type(error).__name__, "message": str(error)}
    if result["raised"] is None:
        result["same_on_all_ranks"] = _same_on_all_ranks(model, f"bad.{case}")
        result["watched_moved"] = (None if watched is None
                                   else bool((watched.detach() != before).any()))
    return result


def sweep(cases: list[list]) -> dict:
    """``cases``: [case, sparse, everyone] triples; what this rank saw in each."""
    report = {}
    for case, sparse, everyone in cases:
        key = f"{case}/{'sparse' if sparse else 'dense'}/{'all' if everyone else 'one'}"
        report[key] = run_case(case, sparse, everyone)
    return report


def extra_step_then(then: str) -> dict:
    """Rank ODD calls step() once more than the others, who meanwhile ``then``:
    ``barrier`` (wait in an allreduce of their own) or ``exit`` (return at once)."""
    model = _model()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = _wrap(model, sparse=True)
    for t in range(2):
        _step(model, opt, t)
    try:
        if hvd.rank() == ODD:
            _step(model, opt, 2)
        if then == "barrier":
            hvd.allreduce(torch.zeros(1), name="bad.barrier")
    except Exception as error:  # noqa: BLE001  the type is part of what is checked
        return {"raised": type(error).__name__, "message": str(error)}
    return {"raised": None}
