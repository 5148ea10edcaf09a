"""Rank bodies of tests/test_powersgd.py: PowerSGD through ``hvm.DistributedOptimizer``."""

from __future__ import annotations

import horovod.torch as hvd
import torch

import horovod_micro as hvm

SHAPES = [(16, 12), (12,), (6, 4, 5), (3, 3), (20, 3, 2, 2), (40, 30), (12, 8, 3, 3)]
#: Small enough that the small matrices above are compressed at ranks 1-4 (the default, 16,
#: would send most of them whole; tests/test_powersgd.py checks the default's choice).
MIN_COMPRESSION = 2.0


def rank_grads(rank: int, step: int) -> list[torch.Tensor]:
    """Deterministic gradients of ``rank`` at ``step``, one per parameter of SHAPES."""
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return [torch.randn(shape, generator=gen) * (1 + i) for i, shape in enumerate(SHAPES)]


def _optimizer(rank_r, op=hvd.Average, device="cpu", **options):
    options.setdefault("min_compression", MIN_COMPRESSION)
    params = [torch.nn.Parameter(torch.zeros(shape, device=device)) for shape in SHAPES]
    opt = hvm.DistributedOptimizer(
        torch.optim.SGD(params, lr=0.1), named_parameters=[(f"p{i}", p)
                                                           for i, p in enumerate(params)],
        compression=hvm.Compression.powersgd(rank=rank_r, **options), op=op)
    return opt, params


def _feed(opt, params, step):
    opt.zero_grad()
    for p, g in zip(params, rank_grads(hvd.rank(), step)):
        p.grad = g.to(p.device)
    opt.synchronize()


def traces(rank_r: int, steps: int, op: str = "average", start_iteration: int = 0,
           device: str = "cpu") -> dict:
    """Per step: the aggregate (.grad), this rank's residual and statistics; the final
    weights; and a restart from a checkpoint taken halfway, which must continue alike.
    ``device``: where the parameters live (gpu_tests/ runs this on CUDA, where Horovod's
    allreduces are NCCL's)."""
    reduce_op = hvd.Average if op == "average" else hvd.Sum
    options = {"device": device, "start_iteration": start_iteration}
    opt, params = _optimizer(rank_r, reduce_op, **options)
    out = []
    for step in range(steps):
        if step == steps // 2:
            saved = opt.state_dict()
        _feed(opt, params, step)
        stats = opt.last_stats
        out.append({"grads": [p.grad.tolist() for p in params],
                    "residual": opt.state_dict()["horovod_micro"]["residual"].tolist(),
                    "bytes_sent": stats.bytes_sent, "bytes_received": stats.bytes_received,
                    "global_count": stats.global_count, "density": stats.density,
                    "method": stats.method, "nonfinite": stats.nonfinite})
        with opt.skip_synchronize():
            opt.step()
    # A second optimizer loads the halfway checkpoint and replays the second half: its
    # aggregates must be the first one's (the warm-start Q travels in the state).
    other, other_params = _optimizer(rank_r, reduce_op, **options)
    other.load_state_dict(saved)
    resumed = []
    for step in range(steps // 2, steps):
        _feed(other, other_params, step)
        resumed.append([p.grad.tolist() for p in other_params])
        with other.skip_synchronize():
            other.step()
    weights = torch.cat([p.detach().reshape(-1) for p in params])
    everyone = hvd.allgather(weights.unsqueeze(0), name="psgd.weights")
    compression = opt.compression
    return {"steps": out, "resumed": resumed,
            "same_weights": bool((everyone == everyone[0]).all()),
            "sent_numbers": compression.sent_numbers(),
            "compressed": [(m.rows, m.cols) for m in compression.matrices]}


def nonfinite_then_finite() -> dict:
    """Rank 0's gradient holds a NaN at step 1: every rank skips that step (NaN in .grad,
    the warm start unchanged) and step 2 goes on as if step 1 had not been fed."""
    opt, params = _optimizer(1)
    seen = []
    for step in range(3):
        opt.zero_grad()
        for p, g in zip(params, rank_grads(hvd.rank(), step)):
            if step == 1 and hvd.rank() == 0:
                g[0] = float("nan")
            p.grad = g.clone()
        opt.synchronize()
        seen.append({"nonfinite": opt.last_stats.nonfinite,
                     "all_nan": all(bool(torch.isnan(p.grad).all()) for p in params),
                     "q": opt.compression.q.tolist()})
        with opt.skip_synchronize():
            opt.step()
    return {"seen": seen}


def bad_rank_on_one_rank() -> dict:
    """rank=0 on rank 1 only: every rank raises the same error, none hangs."""
    try:
        _optimizer(0 if hvd.rank() == 1 else 1)
    except (ValueError, hvm.CollectiveInputError) as error:
        return {"error": f"{type(error).__name__}: {error}"}
    return {"error": None}


def zero_successor(method: str, steps: int = 3) -> dict:
    """A 256-256-4 MLP whose last layer starts at zero: at step 0 the first layer's
    gradient is exactly zero. Per step: how far the first layer's weight has moved from
    its start, and its gradient's norm after the exchange."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 4))
    torch.nn.init.zeros_(model[2].weight)
    torch.nn.init.zeros_(model[2].bias)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    compression = hvm.Compression.powersgd() if method == "powersgd" else hvm.Compression.none
    opt = hvm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=compression)
    start = model[0].weight.detach().clone()
    gen = torch.Generator().manual_seed(10 + hvd.rank())
    moved, grad_norms = [], []
    for _ in range(steps):
        x, y = torch.randn(32, 256, generator=gen), torch.randint(0, 4, (32,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.synchronize()
        grad_norms.append(float(model[0].weight.grad.norm()))
        with opt.skip_synchronize():
            opt.step()
        moved.append(float((model[0].weight.detach() - start).abs().max()))
    return {"moved": moved, "grad_norms": grad_norms}


def float16_factors(fp16_values: bool, steps: int = 8, scale: float = 16.0) -> dict:
    """A 64 x 32 weight whose gradient is the same each step on each rank, with entries of
    about ``scale`` (far inside float16's 65504; error feedback adds up what rank 1 leaves
    behind): per step, whether the exchange came out non-finite."""
    weight = torch.nn.Parameter(torch.zeros(64, 32))
    opt = hvm.DistributedOptimizer(
        torch.optim.SGD([weight], lr=1e-6), named_parameters=[("w", weight)],
        compression=hvm.Compression.powersgd(fp16_values=fp16_values))
    gradient = scale * torch.randn(64, 32, generator=torch.Generator().manual_seed(20 + hvd.rank()))
    nonfinite = []
    for _ in range(steps):
        opt.zero_grad()
        (weight * gradient).sum().backward()
        opt.step()
        nonfinite.append(bool(opt.last_stats.nonfinite))
    return {"nonfinite": nonfinite}
