"""Rank bodies of the drift judge's tests (tests/test_drift_judge.py, gpu_tests/): which
coordinates MiCRO reaches without error feedback, a checkpoint resumed by a fresh
optimizer, and the judge every rank resolves from one setting written two ways."""

import gc

import horovod.torch as hvd
import numpy as np
import torch

import horovod_micro as hvm


def weights_ever_changed(steps: int, density: float, error_feedback: bool) -> dict:
    """A 10,240-weight linear layer (1024 -> 10, no bias) trained by plain SGD through
    ``micro(density, error_feedback=...)`` with the judge left unset, each rank on its own
    random batches: the share of the weights that ever moved, and the judge the compressor
    resolved."""
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 10, bias=False)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    compression = hvm.Compression.micro(density=density, error_feedback=error_feedback)
    opt = hvm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(),
                                   compression=compression)
    start = model.weight.detach().clone()
    changed = torch.zeros_like(start, dtype=torch.bool)
    gen = torch.Generator().manual_seed(1000 + hvd.rank())
    for _ in range(steps):
        x, y = torch.randn(16, 1024, generator=gen), torch.randn(16, 10, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        changed |= model.weight.detach() != start
    return {"changed": float(changed.double().mean()), "judge": compression.judge}


def _model(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 4)).to(device)


def _wrapped(model: torch.nn.Module, density: float):
    """MiCRO with its defaults (the drift judge, momentum SGD) on ``model``."""
    base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return hvm.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                    compression=hvm.Compression.micro(density=density))


def _step(model, opt, t: int, device: str) -> list[float]:
    gen = torch.Generator().manual_seed(100 * hvd.rank() + t)
    x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device)).backward()
    opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu().tolist()


def resume_fresh(path: str, steps: int, resume_at: int, density: float,
                 device: str = "cpu") -> dict:
    """The uninterrupted run: ``steps`` steps of MiCRO's defaults on ``device``, each
    rank's checkpoint written after step ``resume_at``. Then, as a new process would, a
    new model and a new optimizer load that checkpoint onto the host
    (``map_location="cpu"``; the model moves to ``device`` afterwards) and take the
    remaining steps. Per resumed step, the largest difference from the uninterrupted run's
    weights after the same step."""
    model = _model(device)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = _wrapped(model, density)
    mine = path.format(rank=hvd.rank())
    reference = []
    for t in range(steps):
        reference.append(_step(model, opt, t, device))
        if t + 1 == resume_at:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, mine)
    del model, opt
    gc.collect()

    saved = torch.load(mine, weights_only=False, map_location="cpu")
    model = _model("cpu")
    model.load_state_dict(saved["model"])
    model.to(device)
    opt = _wrapped(model, density)
    opt.load_state_dict(saved["opt"])
    differences = []
    for t in range(resume_at, steps):
        weights = torch.tensor(_step(model, opt, t, device))
        differences.append(float((weights - torch.tensor(reference[t])).abs().max()))
    return {"differences": differences, "iteration": opt.last_stats.iteration}


def flag_written_two_ways(steps: int) -> dict:
    """``error_feedback=np.False_`` on the first rank, ``False`` on the others, the judge
    unset: what each rank resolved, what the steps raised, and whether the weights agree."""
    first = hvd.rank() == 0
    try:
        compression = hvm.Compression.micro(density=0.05,
                                            error_feedback=np.False_ if first else False)
        raised = None
    except ValueError as error:
        raised = f"ValueError: {error}"
    # Where a rank refused its setting, every rank stops here (no wait in a collective).
    refused = hvd.allreduce(torch.tensor([float(raised is not None)]), op=hvd.Sum,
                            name="flag_written_two_ways.refused")
    if refused.item():
        return {"raised": raised, "refused_on": int(refused.item())}
    model = _model("cpu")
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(),
                                   compression=compression)
    for t in range(steps):
        _step(model, opt, t, "cpu")
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = hvd.allgather(flat.unsqueeze(0), name="flag_written_two_ways.weights")
    return {"raised": None, "judge": compression.judge,
            "same_weights": bool((everyone == everyone[0]).all())}


def judged_under(kind: str, judge, steps: int, density: float) -> dict:
    """A two-layer MLP wrapped with ``micro(density, judge=judge)`` over ``kind`` (``adamw``:
    AdamW, lr 0.01; ``sgd``: momentum 0.9, lr 0.05). Per step this rank's own gradient
    (computed apart, before backward) and the aggregate the step applied, both flat in the
    layout's order (parameters sorted by name); and the judge the compressor resolved and
    whether it keeps ages."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 3))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    base = (torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
            if kind == "adamw" else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    compression = hvm.Compression.micro(density=density, judge=judge)
    opt = hvm.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                   compression=compression)
    params = [p for _, p in sorted(model.named_parameters())]
    gen = torch.Generator().manual_seed(100 + hvd.rank())
    rows = []
    for _ in range(steps):
        x, y = torch.randn(16, 12, generator=gen), torch.randint(0, 3, (16,), generator=gen)
        own = torch.autograd.grad(torch.nn.functional.cross_entropy(model(x), y), params)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.synchronize()
        aggregate = torch.cat([p.grad.detach().reshape(-1) for p in params])
        with opt.skip_synchronize():
            opt.step()
        rows.append({"grad": torch.cat([g.reshape(-1) for g in own]).tolist(),
                     "aggregate": aggregate.tolist()})
    return {"judge": compression.judge, "ages": compression.ages is not None, "steps": rows}
