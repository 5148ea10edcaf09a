"""Rank bodies for the MiCRO tests (run by multirank.run_ranks on real ranks)."""

from __future__ import annotations

import math
import re

import horovod.torch as hvd
import torch
from simulation import feed_gradients, rank_gradient

import horovod_micro as hvm
from horovod_micro.compression import takes_density


def _flat_param_optimizer(numel, compression, **kwargs):
    param = torch.nn.Parameter(torch.zeros(numel))
    opt = hvm.DistributedOptimizer(torch.optim.SGD([param], lr=0.0),
                                   named_parameters=[("flat", param)],
                                   compression=compression, **kwargs)
    return opt, param


def exchange_trace(numel, iterations, density, seed=0, skew=0.0, op="average",
                   initial_threshold=None, fp16_values=False, error_feedback=True,
                   controller="bounded", plateau=0.0, judge=None, capacity=None,
                   method="micro", **settings):
    """Per iteration: exchanged gradient, threshold, counts, residual, bytes, and the
    controller's state after the step (``method``: micro or micro_ahead, whose own
    ``settings`` go with it)."""
    compression = getattr(hvm.Compression, method)(
        density=density, initial_threshold=initial_threshold, fp16_values=fp16_values,
        error_feedback=error_feedback, controller=controller, judge=judge, capacity=capacity,
        **settings)
    opt, param = _flat_param_optimizer(numel, compression,
                                       op=hvd.Average if op == "average" else hvd.Sum)
    trace = []
    for grad, stats, residual in feed_gradients(opt, param, hvd.rank(), iterations, numel,
                                                seed, skew, plateau=plateau):
        trace.append({
            "grad": grad.tolist(), "threshold": stats.threshold,
            "threshold_hex": float(stats.threshold).hex(),
            "rank_counts": stats.rank_counts, "global_count": stats.global_count,
            "selected_counts": stats.selected_counts, "load_imbalance": stats.load_imbalance,
            "density": stats.density, "residual": residual.tolist(),
            "residual_norm": stats.residual_norm, "bytes_sent": stats.bytes_sent,
            "bytes_received": stats.bytes_received, "iteration": stats.iteration,
            "controller": compression.controller.state_dict(),
            "slots": compression.slots,
        })
    return trace


def empty_selection(numel, iterations):
    """A threshold far above every gradient: nobody selects anything for a while."""
    trace = exchange_trace(numel, iterations, density=0.01, initial_threshold=1e6,
                           controller="newton")
    return [{"global_count": t["global_count"], "grad_abs_sum": sum(map(abs, t["grad"])),
             "threshold": t["threshold"]} for t in trace]


def one_rank_silent(numel, iterations):
    """Rank 1's gradient is all zeros: it never selects, rank 0 does."""
    compression = hvm.Compression.micro(density=0.05)
    opt, param = _flat_param_optimizer(numel, compression)
    out = []
    for t in range(iterations):
        gen = torch.Generator().manual_seed(t)
        grad = torch.randn(numel, generator=gen)
        param.grad = grad if hvd.rank() == 0 else torch.zeros(numel)
        opt.synchronize()
        out.append({"rank_counts": opt.last_stats.rank_counts,
                    "grad": param.grad.tolist()})
        opt.zero_grad()
    return out


def nonfinite(numel, bad_rank, bad_iteration, iterations):
    """Rank ``bad_rank`` puts NaN and Inf into its gradient at ``bad_iteration``."""
    compression = hvm.Compression.micro(density=0.05)
    opt, param = _flat_param_optimizer(numel, compression)
    out = []
    for t in range(iterations):
        grad = torch.randn(numel, generator=torch.Generator().manual_seed(100 * t + hvd.rank()))
        if hvd.rank() == bad_rank and t == bad_iteration:
            grad[3] = math.nan
            grad[7] = math.inf
        param.grad = grad
        opt.synchronize()
        residual = opt.state_dict()["horovod_micro"]["residual"]
        out.append({"all_nan": bool(torch.isnan(param.grad).all()),
                    "any_nonfinite": bool((~torch.isfinite(param.grad)).any()),
                    "residual_finite": bool(torch.isfinite(residual).all()),
                    "stats_nonfinite": opt.last_stats.nonfinite,
                    "threshold_finite": math.isfinite(opt.last_stats.threshold)})
        opt.zero_grad()
    return out


def digits_density_trace(density, iterations, batch=32, hidden=(512, 256), lr=0.05, seed=0,
                         controller=None, controller_name="bounded"):
    """Train an MLP on scikit-learn's bundled digits with MiCRO (``controller_name``'s
    density controller; ``controller``: attributes to override on it); per iteration the
    density, global count, this rank's threshold, the controller's state and the loss."""
    from sklearn.datasets import load_digits

    torch.manual_seed(seed)
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    layers, width = [], 64
    for h in hidden:
        layers += [torch.nn.Linear(width, h), torch.nn.ReLU()]
        width = h
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True,
                          weight_decay=1e-4)
    opt = hvm.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=hvm.Compression.micro(
                                       density=density, controller=controller_name))
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    for key, value in (controller or {}).items():
        setattr(opt.compression.controller, key, value)
    gen = torch.Generator().manual_seed(1000 * (seed + 1) + hvd.rank())
    trace = []
    for _ in range(iterations):
        idx = torch.randint(0, len(x), (batch,), generator=gen)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
        s = opt.last_stats
        trace.append({"density": s.density, "threshold": s.threshold, "loss": float(loss),
                      "target_density": s.target_density, "numel": s.numel,
                      "global_count": s.global_count, "target_count": s.target_count,
                      "state": repr(opt.compression.controller.state_dict())})
    return trace


def negotiations(steps, capacity=None, density=0.01, method="micro", options=None):
    """Per training step of a small MLP with MiCRO: how many "messages to coordinator"
    Horovod's trace log (``HOROVOD_LOG_LEVEL=trace``, set by the test) wrote on this rank
    during it, i.e. how often this rank's collectives missed the response cache and were
    negotiated. Horovod writes its log below the warning level to stdout: fd 1 is pointed
    at a file for the run."""
    import os
    import sys
    import tempfile

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 10))
    opt = hvm.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01),
        named_parameters=model.named_parameters(),
        compression=(hvm.Compression.micro(density=density, capacity=capacity)
                     if method == "micro"
                     else getattr(hvm.Compression, method)(
                         **({"density": density}
                            if takes_density(getattr(hvm.Compression, method)) else {}),
                         **(options or {}))))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    log = tempfile.NamedTemporaryFile(prefix="hvm-trace-", delete=False)
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(log.fileno(), 1)
    try:
        gen = torch.Generator().manual_seed(hvd.rank())
        for step in range(steps):
            x, y = torch.randn(32, 64, generator=gen), torch.randint(0, 10, (32,), generator=gen)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            os.write(1, f"=== step {step} done\n".encode())
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    text = open(log.name).read()
    os.unlink(log.name)
    # Horovod's background thread writes to the same fd while the steps run, so a marker
    # may land inside one of its lines: both are found wherever they are, in file order.
    per_step, current = [], 0
    for found in re.finditer(r"messages to coordinator|=== step \d+ done", text):
        if found.group().startswith("==="):
            per_step.append(current)
            current = 0
        else:
            current += 1
    return {"per_step": per_step, "slots": getattr(opt.reducer.compressor, "slots", None)}


def capacity_cut_warnings(iterations: int, capacity) -> dict:
    """:func:`exchange_trace` with every warning this rank gave recorded."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trace = exchange_trace(1003, iterations, 0.02, seed=11, skew=3.0, capacity=capacity)
    return {"warnings": [str(w.message) for w in caught],
            "imbalance": [t["load_imbalance"] for t in trace],
            "rank_counts": [t["rank_counts"] for t in trace]}


def ahead_resume(numel, iterations, resume_at, seed=3):
    """micro_ahead run straight through and resumed from a state saved after step
    ``resume_at - 1`` on a fresh optimizer: each run's exchanged gradients, the judge's
    weight under SGD and under Adam."""
    def run(start, state=None):
        compression = hvm.Compression.micro_ahead(density=0.02)
        opt, param = _flat_param_optimizer(numel, compression)
        if state is not None:
            opt.load_state_dict(state)
        grads, saved = [], None
        for t in range(start, iterations):
            param.grad = rank_gradient(hvd.rank(), t, numel, seed)
            opt.synchronize()
            grads.append(param.grad.tolist())
            with opt.skip_synchronize():
                opt.step()
            opt.zero_grad()
            if t == resume_at - 1:
                saved = opt.state_dict()
        return grads, saved

    straight, state = run(0)
    resumed, _ = run(resume_at, state)
    adam = hvm.Compression.micro_ahead(density=0.02)
    param = torch.nn.Parameter(torch.zeros(numel))
    hvm.DistributedOptimizer(torch.optim.AdamW([param]), named_parameters=[("w", param)],
                             compression=adam)
    return {"straight": straight, "resumed": resumed,
            "union_saved": state["horovod_micro"]["compressor"]["union"][1].sum().item(),
            "weights": [hvm.Compression.micro_ahead().weight, adam.weight]}
