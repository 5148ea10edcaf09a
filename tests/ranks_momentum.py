"""Rank bodies for the momentum-masking tests (run by multirank.run_ranks on real ranks)."""

from __future__ import annotations

import horovod.torch as hvd
import torch

import horovod_micro as hvm

LR, MOMENTUM, WEIGHT_DECAY = 0.05, 0.9, 1e-3


def exchanged_step(opt, model, params, gen) -> list[float]:
    """One step on a fresh batch of 16 drawn from ``gen``: backward, the exchange, then the
    wrapped optimizer's step; returns the aggregate it received (flat, ``params``' order)."""
    x, y = torch.randn(16, 12, generator=gen), torch.randint(0, 3, (16,), generator=gen)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.synchronize()
    aggregate = torch.cat([p.grad.detach().reshape(-1) for p in params]).tolist()
    with opt.skip_synchronize():
        opt.step()
    return aggregate


def masked_steps(method="micro", density=0.05, iterations=8, masking=None, nesterov=True,
                 seed=0, lr=LR):
    """Train a two-layer MLP; per step, what the independent check needs: the weights and
    momentum buffers before the step, the aggregate the wrapped optimizer received, and
    the weights and buffers after it (flat lists, parameters in name order)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 3))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    kwargs = {} if masking is None else {"momentum_masking": masking}
    base = torch.optim.SGD(model.parameters(), lr=lr, momentum=MOMENTUM, nesterov=nesterov,
                           weight_decay=WEIGHT_DECAY)
    opt = hvm.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                   compression=getattr(hvm.Compression, method)(
                                       density=density, **kwargs))
    params = [p for _, p in sorted(model.named_parameters())]

    def flat(tensors):
        return torch.cat([t.detach().reshape(-1) for t in tensors]).tolist()

    def buffers():
        return flat(opt.state[p].get("momentum_buffer", torch.zeros_like(p)) for p in params)

    gen = torch.Generator().manual_seed(100 + hvd.rank())
    steps = []
    for _ in range(iterations):
        before = {"weights": flat(params), "buffers": buffers()}
        aggregate = exchanged_step(opt, model, params, gen)
        steps.append({**{f"{k}_before": v for k, v in before.items()},
                      "aggregate": aggregate, "weights": flat(params), "buffers": buffers(),
                      "applied": opt.last_stats.global_count})
    return {"steps": steps, "masking": opt.compression.masks(),
            "masked": opt.last_stats.momentum_masked}


def with_optimizer(kind: str, masking=None, density=0.05, compression="micro",
                   iterations=4, lr=LR) -> dict:
    """Wrap ``kind`` (``adam``, ``adamw``, ``adamax``, ``amsgrad``: Adam with it, ``sgd``:
    momentum 0.9, ``plain``: SGD without momentum) and train a few steps;
    whatever wrapping raised, the warnings it gave on this rank, what each step recorded as
    masked, and this rank's weights."""
    import warnings

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 3))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    base = {"adam": lambda p: torch.optim.Adam(p, lr=1e-2),
            "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.01),
            "adamax": lambda p: torch.optim.Adamax(p, lr=1e-2),
            "amsgrad": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True),
            "sgd": lambda p: torch.optim.SGD(p, lr=lr, momentum=MOMENTUM),
            "plain": lambda p: torch.optim.SGD(p, lr=lr)}[kind](
        model.parameters())
    if compression == "none":
        method = hvm.Compression.none
    else:
        kwargs = {} if masking is None else {"momentum_masking": masking}
        method = hvm.Compression.micro(density=density, **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            opt = hvm.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                           compression=method)
        except ValueError as error:
            return {"raised": str(error)}
    gen = torch.Generator().manual_seed(100 + hvd.rank())
    masked = []
    for _ in range(iterations):
        x, y = torch.randn(16, 12, generator=gen), torch.randint(0, 3, (16,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        masked.append(None if opt.last_stats is None else opt.last_stats.momentum_masked)
    weights = torch.cat([p.detach().reshape(-1) for _, p in sorted(model.named_parameters())])
    return {"raised": None, "warnings": [str(w.message) for w in caught], "masked": masked,
            "weights": weights.tolist()}


def adamw_steps(masking=None, density=0.05, iterations=6, seed=0):
    """AdamW (lr 0.01, weight decay 0.01) wrapped with MiCRO; per step what the independent
    check needs: weights and both moments before, the aggregate, the step count, and
    weights and moments after (flat lists, parameters in name order)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 3))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    base = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    kwargs = {} if masking is None else {"momentum_masking": masking}
    opt = hvm.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                   compression=hvm.Compression.micro(density=density, **kwargs))
    params = [p for _, p in sorted(model.named_parameters())]

    def flat(tensors):
        return torch.cat([t.detach().reshape(-1) for t in tensors]).tolist()

    def moment(key):
        return flat(opt.state[p].get(key, torch.zeros_like(p)) for p in params)

    gen = torch.Generator().manual_seed(100 + hvd.rank())
    steps = []
    for t in range(1, iterations + 1):
        before = {"weights": flat(params), "exp_avg": moment("exp_avg"),
                  "exp_avg_sq": moment("exp_avg_sq")}
        aggregate = exchanged_step(opt, model, params, gen)
        steps.append({"t": t, "before": before, "aggregate": aggregate,
                      "weights": flat(params), "exp_avg": moment("exp_avg"),
                      "exp_avg_sq": moment("exp_avg_sq"),
                      "masked": opt.last_stats.momentum_masked})
    return steps
