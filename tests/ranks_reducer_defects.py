"""Rank bodies for tests/test_reducer_defects.py (dtypes, float16 overflow and
rounding, non-finite steps, the finiteness check, the state after a collective error).

Several methods run in one launch, one optimizer each, as in ranks_baselines.py.
"""

from __future__ import annotations

import horovod.torch as hvd
import torch
from simulation import feed_gradients, injected_gradient

import horovod_micro as hvm

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
          "float64": torch.float64}


def _optimizer(named, run):
    compression = getattr(hvm.Compression, run["method"])(**run.get("kwargs", {}))
    return hvm.DistributedOptimizer(
        torch.optim.SGD([p for _, p in named], lr=0.0), named_parameters=named,
        compression=compression, op=hvd.Sum if run.get("op") == "sum" else hvd.Average)


def _record(grad, stats, residual) -> dict:
    return {"grad": grad.tolist(), "grad_dtype": str(grad.dtype),
            "residual": residual.tolist(), "residual_dtype": str(residual.dtype),
            "nonfinite": stats.nonfinite, "threshold": stats.threshold,
            "residual_norm": stats.residual_norm, "global_count": stats.global_count,
            "iteration": stats.iteration}


def traces(runs, numel, iterations, seed=0, dtype="float32", inject=()):
    """Per run label: per-iteration records of a flat parameter of ``dtype`` fed with
    ``injected_gradient`` (exchanged gradient, residual, statistics)."""
    out = {}
    for run in runs:
        param = torch.nn.Parameter(torch.zeros(numel, dtype=DTYPES[dtype]))
        opt = _optimizer([("flat", param)], run)
        out[run["label"]] = [
            dict(_record(*item), controller=repr(opt.compression.state_dict()))
            for item in feed_gradients(opt, param, hvd.rank(), iterations, numel, seed,
                                       step=False, inject=[tuple(i) for i in inject])]
    return out


def suite(configs):
    """Several ``traces`` calls in one launch: ``configs`` maps a name to its kwargs."""
    return {name: traces(**kwargs) for name, kwargs in configs.items()}


def mixed_dtypes(sizes, iterations, seed=0):
    """MiCRO over parameters of different dtypes (``sizes``: name -> (numel, dtype)), fed
    with slices of one float64 ``rank_gradient`` cast to each parameter's dtype."""
    named = [(name, torch.nn.Parameter(torch.zeros(n, dtype=DTYPES[d])))
             for name, (n, d) in sorted(sizes.items())]
    numel = sum(p.numel() for _, p in named)
    opt = _optimizer(named, {"method": "micro", "kwargs": {"density": 0.05}})
    records = []
    for t in range(iterations):
        flat, start = injected_gradient(hvd.rank(), t, numel, seed, torch.float64), 0
        for _, p in named:
            p.grad = flat[start:start + p.numel()].to(p.dtype)
            start += p.numel()
        opt.synchronize()
        residual = opt.state_dict()["horovod_micro"]["residual"]
        records.append({
            "grads": {name: p.grad.double().tolist() for name, p in named},
            "grad_dtypes": {name: str(p.grad.dtype) for name, p in named},
            "residual": residual.tolist(), "residual_dtype": str(residual.dtype),
            "threshold": opt.last_stats.threshold})
    return records


def collective_error(runs, numel, iterations, fail_before, seed=0):
    """An embedding (sparse on rank 1 only) and a dense parameter; ``iterations`` steps
    with dense gradients (``rank_gradient`` of the flat layout), and before step
    ``fail_before`` one attempt whose embedding gradient comes from a backward pass, so
    rank 1's is sparse and every rank must raise ``CollectiveInputError``.

    Per run: the error message, whether the residual and the iteration after the error are
    exactly those before it, and the records of the successful steps.
    """
    out = {}
    for run in runs:
        torch.manual_seed(0)
        emb = torch.nn.Embedding(50, 4, sparse=hvd.rank() == 1)
        w = torch.nn.Parameter(torch.zeros(numel - emb.weight.numel()))
        opt = _optimizer([("emb", emb.weight), ("w", w)], run)
        result = {"records": []}
        for t in range(iterations):
            if t == fail_before:
                result.update(_failed_step(opt, emb, w))
            flat = injected_gradient(hvd.rank(), t, numel, seed)
            emb.weight.grad = flat[:emb.weight.numel()].view_as(emb.weight).clone()
            w.grad = flat[emb.weight.numel():].clone()
            opt.synchronize()
            grad = torch.cat([emb.weight.grad.reshape(-1), w.grad])
            residual = opt.state_dict()["horovod_micro"]["residual"]
            result["records"].append(_record(grad, opt.last_stats, residual))
        out[run["label"]] = result
    return out


def _failed_step(opt, emb, w) -> dict:
    emb.weight.grad = None
    emb(torch.tensor([1, 5, 7])).sum().backward()
    w.grad = torch.full_like(w, 3.0)
    before = opt.state_dict()["horovod_micro"]
    try:
        opt.synchronize()
        message = None
    except hvm.CollectiveInputError as error:
        message = str(error)
    after = opt.state_dict()["horovod_micro"]
    return {"error": message,
            "residual_restored": bool(torch.equal(before["residual"], after["residual"])),
            "iteration_restored": before["iteration"] == after["iteration"]}


def grad_views(numel, iterations, seed=0):
    """Two MiCRO optimizers fed by backward passes: one zeroes ``.grad`` in place
    (``zero_grad(set_to_none=False)``: backward then accumulates into the views of the
    output buffer that the last step installed, the buffer that the next step builds
    ``a_t`` in), the other sets it to None. Per variant: gradients and residuals."""
    out = {}
    for set_to_none in (True, False):
        param = torch.nn.Parameter(torch.zeros(numel))
        opt = _optimizer([("flat", param)], {"method": "micro", "kwargs": {"density": 0.05}})
        records = []
        for t in range(iterations):
            opt.zero_grad(set_to_none=set_to_none)
            (param * injected_gradient(hvd.rank(), t, numel, seed)).sum().backward()
            opt.step()
            residual = opt.state_dict()["horovod_micro"]["residual"]
            records.append({"grad": param.grad.tolist(), "residual": residual.tolist(),
                            "threshold": opt.last_stats.threshold,
                            "grad_is_view": param.grad._base is not None})
        out[f"set_to_none={set_to_none}"] = records
    return out


def frozen_midway(method: str) -> dict:
    """A two-layer MLP trained 3 steps, its last weight frozen on every rank for 3 steps,
    then unfrozen for 2. Per step: that weight's values and its slice of the residual
    (the public state_dict), whether it has a .grad, and the step's density."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    kwargs = {"density": 0.05} if method != "powersgd" else {"min_compression": 1}
    compression = getattr(hvm.Compression, method)(**kwargs)
    opt = hvm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(),
                                   compression=compression)
    gen = torch.Generator().manual_seed(100 + hvd.rank())
    watched = model[2].weight
    steps = []
    for t in range(8):
        watched.requires_grad_(not 3 <= t < 6)
        x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        steps.append({"weight": watched.detach().reshape(-1).tolist(),
                      "residual": opt.state_dict()["horovod_micro"]["residual"].tolist(),
                      "has_grad": watched.grad is not None,
                      "density": opt.last_stats.density})
    return {"steps": steps}
