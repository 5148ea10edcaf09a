"""Rank bodies for the baseline-compressor tests (run by multirank.run_ranks).

Several methods run in one launch (one optimizer each, one after the other): a launch
costs seconds, an exchange of a few hundred elements milliseconds.
"""

from __future__ import annotations

import math

import horovod.torch as hvd
import torch
from simulation import feed_gradients
from simulation_baselines import buildup_gradient

import horovod_micro as hvm


def _optimizer(numel, compression, op="average"):
    param = torch.nn.Parameter(torch.zeros(numel))
    opt = hvm.DistributedOptimizer(torch.optim.SGD([param], lr=0.0),
                                   named_parameters=[("flat", param)], compression=compression,
                                   op=hvd.Average if op == "average" else hvd.Sum)
    return opt, param


def _record(grad, stats, residual):
    return {"grad": grad.tolist(), "residual": residual.tolist(),
            "rank_counts": stats.rank_counts, "global_count": stats.global_count,
            "density": stats.density, "target_density": stats.target_density,
            "target_count": stats.target_count, "threshold": stats.threshold,
            "bytes_sent": stats.bytes_sent, "bytes_received": stats.bytes_received,
            "residual_norm": stats.residual_norm, "method": stats.method,
            "select_time": stats.select_time, "comm_time": stats.comm_time}


def traces(runs, numel, iterations, seed=0, skew=0.0):
    """``runs``: list of ``{"label", "method", "kwargs", "op"}``; per label, the per-iteration
    exchanged gradient, residual and statistics on this rank."""
    out = {}
    for run in runs:
        compression = getattr(hvm.Compression, run["method"])(**run.get("kwargs", {}))
        opt, param = _optimizer(numel, compression, run.get("op", "average"))
        out[run["label"]] = [_record(*item) for item in
                             feed_gradients(opt, param, hvd.rank(), iterations, numel, seed,
                                                    skew)]
    return out


def buildup(methods, numel, density, iterations):
    """Per method, the actual global density per iteration on ``buildup_gradient``."""
    n, k = hvd.size(), math.floor(density * numel)
    out = {}
    for method in methods:
        kwargs = {"density": density}
        if method == "micro":  # start at the gap between the noise and the large entries
            kwargs.update(initial_threshold=0.5, controller="newton")
        opt, param = _optimizer(numel, getattr(hvm.Compression, method)(**kwargs))
        densities = []
        for t in range(iterations):
            param.grad = buildup_gradient(hvd.rank(), t, numel, k, n)
            opt.synchronize()
            densities.append(opt.last_stats.density)
            opt.zero_grad()
        out[method] = densities
    return out


def nonfinite(methods, numel, bad_rank, bad_iteration, iterations):
    """Rank ``bad_rank`` puts NaN/Inf into its gradient at ``bad_iteration``."""
    out = {}
    for method in methods:
        opt, param = _optimizer(numel, getattr(hvm.Compression, method)(density=0.05))
        records = []
        for t in range(iterations):
            grad = torch.randn(numel,
                               generator=torch.Generator().manual_seed(100 * t + hvd.rank()))
            if hvd.rank() == bad_rank and t == bad_iteration:
                grad[3], grad[7] = math.nan, -math.inf
            param.grad = grad
            opt.synchronize()
            residual = opt.state_dict()["horovod_micro"]["residual"]
            records.append({"all_nan": bool(torch.isnan(param.grad).all()),
                            "any_nonfinite": bool((~torch.isfinite(param.grad)).any()),
                            "residual_finite": bool(torch.isfinite(residual).all()),
                            "stats_nonfinite": opt.last_stats.nonfinite})
            opt.zero_grad()
        out[method] = records
    return out


def suite(traces_args=None, buildup_args=None, nonfinite_args=None, argument_errors=False):
    """Several of the bodies in this module in one launch."""
    out = {}
    if argument_errors:
        out["argument_errors"] = collective_argument_errors()
    if traces_args:
        out["traces"] = traces(**traces_args)
    if buildup_args:
        out["buildup"] = buildup(**buildup_args)
    if nonfinite_args:
        out["nonfinite"] = nonfinite(**nonfinite_args)
    return out


def collective_argument_errors():
    """Two mistakes made on one rank only; every rank must raise (reported here)."""
    caught = {}
    bad = hvm.Compression.gtopk(density=2.0) if hvd.rank() == 1 else hvm.Compression.gtopk(0.1)
    for label, compression in [
        ("bad_density", bad),
        ("seed_mismatch", hvm.Compression.randomk(0.1, seed=hvd.rank())),
        ("threshold_both", hvm.Compression.threshold(value=0.1, density=0.1)
         if hvd.rank() == 0 else hvm.Compression.threshold(value=0.1)),
    ]:
        try:
            _optimizer(100, compression)
            caught[label] = None
        except ValueError as error:
            caught[label] = str(error)
    return caught
