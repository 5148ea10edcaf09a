"""Rank bodies for tests/test_zero_copy.py: zero-copy error feedback, where
``zero_grad()`` makes each ``.grad`` a view of the residual and backward adds into it."""

from __future__ import annotations

import warnings

import horovod.torch as hvd
import torch
from simulation import injected_gradient

import horovod_micro as hvm


def _optimizer(param, zero_copy=True, density=0.05):
    return hvm.DistributedOptimizer(
        torch.optim.SGD([param], lr=0.0), named_parameters=[("flat", param)],
        compression=hvm.Compression.micro(density=density), zero_copy=zero_copy)


def _residual(opt) -> torch.Tensor:
    return opt.state_dict()["horovod_micro"]["residual"]


def variants(numel, iterations, seed=0, device="cpu"):
    """The same backward-driven run three ways: zero-copy, ``zero_copy=False``, and
    ``mixed`` (rank 0 zero-copy, the others ``model.zero_grad()``-style None gradients).
    Per variant and iteration: what ``.grad`` held before backward, the exchanged gradient,
    the residual and the threshold. ``device``: where the parameter lives (gpu_tests/
    runs this on CUDA, where Horovod's collectives are NCCL's)."""
    out = {}
    for label in ("zero_copy", "copy", "mixed"):
        param = torch.nn.Parameter(torch.zeros(numel, device=device))
        opt = _optimizer(param, zero_copy=label != "copy")
        records = []
        for t in range(iterations):
            opt.zero_grad()
            if label == "mixed" and hvd.rank() != 0:
                param.grad = None
            before = None if param.grad is None else param.grad.tolist()
            (param * injected_gradient(hvd.rank(), t, numel, seed).to(device)).sum().backward()
            opt.step()
            assert _residual(opt).device == param.grad.device == param.device
            records.append({"before": before, "grad": param.grad.tolist(),
                            "residual": _residual(opt).tolist(),
                            "threshold": opt.last_stats.threshold,
                            "native": opt.compression.selector.use_native,
                            "full_clears": opt.reducer.full_clears,
                            "phases": opt.last_stats.phases})
        out[label] = records
    return out


def tampered(numel, iterations, seed=0):
    """``.grad.mul_(0.5)`` between backward and ``synchronize()`` at step 1, the first with
    views (what an unscale_ or a clip before synchronize() does): a warning, and separate
    gradients from then on."""
    param = torch.nn.Parameter(torch.zeros(numel))
    opt = _optimizer(param)
    records, caught = [], []
    for t in range(iterations):
        opt.zero_grad()
        grad_was_none = param.grad is None
        (param * injected_gradient(hvd.rank(), t, numel, seed)).sum().backward()
        if t == 1:
            param.grad.mul_(0.5)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            opt.step()
        caught += [str(w.message) for w in seen]
        records.append({"grad": param.grad.tolist(), "residual": _residual(opt).tolist(),
                        "threshold": opt.last_stats.threshold,
                        "grad_was_none": grad_was_none})
    return {"records": records, "warnings": caught}


def written_after(numel, iterations, seed=0):
    """In-place writes into ``.grad`` after the step (the exchanged gradient, a view of
    the reducer's output buffer): ``add_(1.0)`` at step 1 and a ``clip_grad_norm_`` at
    step 3. The next steps' gradients must not keep any of it. Per iteration: the
    exchanged gradient (before the write) and the reducer's count of whole-buffer clears."""
    param = torch.nn.Parameter(torch.zeros(numel))
    opt = _optimizer(param)
    records = []
    for t in range(iterations):
        opt.zero_grad()
        (param * injected_gradient(hvd.rank(), t, numel, seed)).sum().backward()
        opt.step()
        records.append({"grad": param.grad.tolist(), "residual": _residual(opt).tolist(),
                        "threshold": opt.last_stats.threshold,
                        "full_clears": opt.reducer.full_clears})
        if t == 1:
            param.grad.add_(1.0)
        if t == 3:
            torch.nn.utils.clip_grad_norm_([param], max_norm=1e-3)
    return records


def create_graph(numel):
    """After a first plain step, rank 1 runs backward(create_graph=True) into the views:
    every rank raises the same error; with zero_copy=False the same step goes through."""
    out = {}
    for zero_copy in (True, False):
        param = torch.nn.Parameter(torch.ones(numel))
        opt = _optimizer(param, zero_copy=zero_copy)
        opt.zero_grad()
        (param * param).sum().backward()
        opt.step()
        opt.zero_grad()
        loss = (param * param).sum()
        loss.backward(create_graph=hvd.rank() == 1)
        try:
            opt.synchronize()
            out[str(zero_copy)] = None
        except hvm.CollectiveInputError as error:
            out[str(zero_copy)] = str(error)
        param.grad = None  # break the graph's reference cycle
    return out
