"""Rank bodies of tests/test_out_of_step.py: ranks out of step, and edge inputs.

Each body catches what it raises and returns it with the seconds it took, so that the test
sees every rank's outcome; a rank left waiting forever would show as a hang of the run,
which the harness reports."""

from __future__ import annotations

import copy
import io
import sys
import time
import warnings

import horovod.torch as hvd
import torch

import horovod_micro as hvm

ODD = 1  # the rank that misbehaves alone


def _model(seed: int = 0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _wrap(model, compression=None, **kwargs):
    base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return hvm.DistributedOptimizer(
        base, named_parameters=model.named_parameters(),
        compression=compression or hvm.Compression.micro(density=0.05), **kwargs)


def _backward(model, opt, t: int) -> None:
    gen = torch.Generator().manual_seed(100 * hvd.rank() + t)
    x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()


def _outcome(body) -> dict:
    start = time.monotonic()
    try:
        body()
        result = {"raised": None, "message": ""}
    except Exception as error:  # noqa: BLE001  the type is part of what is checked
        result = {"raised": type(error).__name__, "message": str(error)}
    result["seconds"] = time.monotonic() - start
    return result


def out_of_step(case: str) -> dict:
    """One of the out-of-step cases; what this rank raised and how long it took.

    * ``uneven_first``: rank ODD has no batch, the others one; then every rank averages a
      metric (the first exchange's state broadcast meets an allreduce elsewhere);
    * ``caught``: rank ODD catches its own exception between backward and ``step()`` at
      step 1 and goes on (its next ``zero_grad`` raises, which it catches too), then
      every rank averages a metric;
    * ``steps_swapped``: two models, built alike; rank ODD steps them in the other order;
    * ``built_swapped``: two same-shaped models whose optimizers rank ODD builds in the
      other order, stepped in the same order;
    * ``both_swapped``: built and stepped in the other order on rank ODD.
    """
    odd = hvd.rank() == ODD
    if case in ("uneven_first", "caught"):
        model = _model()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = _wrap(model)

        def body():
            steps = (0 if odd else 1) if case == "uneven_first" else 4
            for t in range(steps):
                try:
                    _backward(model, opt, t)
                    if odd and t == 1:
                        raise RuntimeError("a user's error between backward and step()")
                    opt.step()
                except (RuntimeError, AssertionError):
                    if case != "caught" or not odd:  # only rank ODD catches and goes on
                        raise
            hvd.allreduce(torch.ones(1), name="metric")
        return _outcome(body)

    first, second = _model(0), _model(1)
    hvd.broadcast_parameters(first.state_dict(), root_rank=0)
    hvd.broadcast_parameters(second.state_dict(), root_rank=0)
    order = [first, second]
    built = {}
    for model in (order[::-1] if odd and case in ("built_swapped", "both_swapped") else order):
        built[id(model)] = _wrap(model)
    stepped = order[::-1] if odd and case in ("steps_swapped", "both_swapped") else order

    def body():
        for t in range(3):
            for model in stepped:
                opt = built[id(model)]
                _backward(model, opt, t)
                opt.step()
    result = _outcome(body)
    if result["raised"] is None:
        flat = torch.cat([p.detach().reshape(-1) for m in order for p in m.parameters()])
        everyone = hvd.allgather(flat.unsqueeze(0), name="weights")
        result["same_weights"] = bool((everyone == everyone[0]).all())
    return result


def works_alone(seconds: float) -> dict:
    """Horovod's common script: rank 0 works alone (evaluation, a checkpoint) for
    ``seconds`` before its fourth step while the others wait in that step's exchange.
    What each rank printed to stderr meanwhile (the stall warnings), and whether the
    weights agree after six steps."""
    model = _model()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = _wrap(model)
    printed, real = io.StringIO(), sys.stderr
    sys.stderr = printed  # the deadline's watching thread prints to sys.stderr
    try:
        result = _outcome(lambda: _steps_with_a_pause(model, opt, seconds))
    finally:
        sys.stderr = real
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = hvd.allgather(flat.unsqueeze(0), name="weights")
    result.update(same_weights=bool((everyone == everyone[0]).all()),
                  iteration=opt.last_stats.iteration, printed=printed.getvalue())
    return result


def _steps_with_a_pause(model, opt, seconds: float) -> None:
    for t in range(6):
        if t == 3 and hvd.rank() == 0:
            time.sleep(seconds)
        _backward(model, opt, t)
        opt.step()


def diverged_in_step() -> dict:
    """A plugin method whose ``combine`` fails on rank ODD alone at step 2, after every
    rank joined the exchange's first collective: rank ODD goes on to average a metric,
    the others wait in the value allreduce (the in-step deadline's case)."""
    from plugin_compressor import CyclicBlockCompressor

    class FailsOnOneRank(CyclicBlockCompressor):
        def combine(self, acc, selection, gathered, iteration, *args):
            if self.comm.rank == ODD and iteration == 2:
                raise RuntimeError("a plugin's error on one rank")
            return super().combine(acc, selection, gathered, iteration, *args)

    model = _model()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = _wrap(model, FailsOnOneRank(density=0.05))

    def body():
        for t in range(4):
            try:
                _backward(model, opt, t)
                opt.step()
            except RuntimeError as error:
                if "plugin's error" not in str(error):
                    raise
                break
        hvd.allreduce(torch.ones(1), name="metric")
    return _outcome(body)


def float16_overflow() -> dict:
    """Every rank's gradient is [40000, 50000, 1, 2] in float16 at density 0.25: the
    float32 residual of coordinate 0 grows past float16's 65504 before it is sent. Per
    step: the exchange's nonfinite flag, and whether any ``.grad`` is Inf or NaN."""
    param = torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))
    opt = hvm.DistributedOptimizer(torch.optim.SGD([param], lr=1e-6),
                                   named_parameters=[("w", param)],
                                   compression=hvm.Compression.micro(density=0.25))
    steps = []
    for _ in range(4):
        opt.zero_grad()
        (param * torch.tensor([40000, 50000, 1, 2], dtype=torch.float16)).sum().backward()
        opt.synchronize()
        grad = param.grad.float()
        steps.append({"nonfinite": opt.last_stats.nonfinite,
                      "inf": bool(torch.isinf(grad).any()),
                      "nan": bool(torch.isnan(grad).any()),
                      "grad_max": float(grad.nan_to_num(nan=0.0).abs().max()),
                      "residual": opt.reducer.residual.tolist()})
        with opt.skip_synchronize():
            opt.step()
    return {"steps": steps}


def synchronize_twice(method: str) -> dict:
    """``synchronize()`` twice, then ``step()`` without ``skip_synchronize()``: the
    gradient each time, and the warning step() gave."""
    model = _model()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    compression = (hvm.Compression.none if method == "dense"
                   else getattr(hvm.Compression, method)(density=0.05))
    opt = _wrap(model, compression)
    grads = []
    for t in range(3):
        _backward(model, opt, t)
        opt.synchronize()
        first = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone()
        opt.synchronize()
        second = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            before = [p.detach().clone() for p in model.parameters()]
            opt.step()
        moved = torch.cat([(b - p.detach()).reshape(-1)
                           for b, p in zip(before, model.parameters())])
        grads.append({"equal": bool(torch.equal(first, second)),
                      "changed_by": float((first - second).abs().max()),
                      "step_used_first": bool(torch.allclose(moved, 0.05 * first, atol=1e-7)
                                              or t > 0),
                      "warned": any("skip_synchronize" in str(w.message) for w in caught)})
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = hvd.allgather(flat.unsqueeze(0), name="weights")
    return {"steps": grads, "same_weights": bool((everyone == everyone[0]).all())}


def density_one(controller: str, judge: str | None) -> dict:
    """MiCRO at density 1: each step's aggregate, against the plain average of the ranks'
    gradients computed here from every rank's gathered gradient."""
    model = _model()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = _wrap(model, hvm.Compression.micro(density=1.0, controller=controller, judge=judge))
    errors = []
    for t in range(4):
        _backward(model, opt, t)
        mine = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone()
        everyone = hvd.allgather(mine.unsqueeze(0), name=f"grads.{t}")
        opt.synchronize()
        got = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        errors.append(float((got - everyone.mean(0)).abs().max()))
        with opt.skip_synchronize():
            opt.step()
    return {"errors": errors, "density": opt.last_stats.density}


def save_checkpoint(path: str) -> dict:
    """Train 3 steps and save this rank's optimizer state to ``path`` (one per rank)."""
    model = _model()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = _wrap(model)
    for t in range(3):
        _backward(model, opt, t)
        opt.step()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()},
               path.format(rank=hvd.rank()))
    return {"iteration": opt.last_stats.iteration}


def load_checkpoint(path: str) -> dict:
    """At another number of ranks: a refused load changes nothing; then Horovod's resume
    idiom (load on rank 0, broadcast parameters and optimizer state) and training on."""
    saved = torch.load(path.format(rank=0), weights_only=False)
    model = _model(5)
    opt = _wrap(model)
    for t in range(2):
        _backward(model, opt, 10 + t)
        opt.step()
    before = copy.deepcopy(opt.state_dict())
    foreign = torch.load(path.format(rank=1), weights_only=False)["opt"]
    refused = None
    try:
        opt.load_state_dict(foreign)  # rank 1's residual: refused on every rank but 1
    except ValueError as error:
        refused = str(error)
    after = opt.state_dict()
    unchanged = all(torch.equal(before["state"][i]["momentum_buffer"],
                                after["state"][i]["momentum_buffer"]) for i in before["state"])
    unchanged = unchanged and torch.equal(before["horovod_micro"]["residual"],
                                          after["horovod_micro"]["residual"])

    resumed = _model(7)
    opt = _wrap(resumed)
    if hvd.rank() == 0:
        resumed.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
    hvd.broadcast_parameters(resumed.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    for t in range(3):
        _backward(resumed, opt, 20 + t)
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in resumed.parameters()])
    everyone = hvd.allgather(flat.unsqueeze(0), name="weights")
    return {"refused": refused, "unchanged": unchanged,
            "iteration": opt.last_stats.iteration,
            "same_weights": bool((everyone == everyone[0]).all()),
            "finite": bool(torch.isfinite(flat).all())}


def unbroadcast() -> dict:
    """Each rank seeds its own model and nothing is broadcast (Horovod trains such
    weights): whether wrapping and three steps raised, the warnings each rank gave, whether
    the weights moved, and whether every rank received the same aggregate each step."""
    torch.manual_seed(hvd.rank())
    model = _model(seed=10 + hvd.rank())
    start = [p.detach().clone() for p in model.parameters()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = _wrap(model)
        same_aggregate = []

        def body():
            for t in range(3):
                _backward(model, opt, t)
                opt.synchronize()
                flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
                everyone = hvd.allgather(flat.unsqueeze(0), name=f"aggregate.{t}")
                same_aggregate.append(bool((everyone == everyone[0]).all()))
                with opt.skip_synchronize():
                    opt.step()
        result = _outcome(body)
    result.update(warnings=[str(w.message) for w in caught], same_aggregate=same_aggregate,
                  moved=all(not torch.equal(a, p.detach())
                            for a, p in zip(start, model.parameters())))
    return result


def reload_midway(path: str, who: str, device: str = "cpu") -> dict:
    """Six steps uninterrupted (the reference); then back to the checkpoint taken after
    step 3, loaded on ``who`` ("every" rank, each its own, or rank "0" only, with no
    broadcast) onto the host first (``map_location="cpu"``, as a resume on another machine
    does), and steps 4-6 again, the model on ``device``. What the repeated steps raised,
    and whether they reproduced the reference weights."""
    model = _model().to(device)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = _wrap(model)

    def _backward(model, opt, t):
        gen = torch.Generator().manual_seed(100 * hvd.rank() + t)
        x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device)).backward()

    for t in range(3):
        _backward(model, opt, t)
        opt.step()
    mine = path.format(rank=hvd.rank())
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, mine)
    for t in range(3, 6):
        _backward(model, opt, t)
        opt.step()
    reference = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    if who == "every" or hvd.rank() == 0:
        saved = torch.load(mine, weights_only=False, map_location="cpu")
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])

    def again():
        for t in range(3, 6):
            _backward(model, opt, t)
            opt.step()
    result = _outcome(again)
    if result["raised"] is None:
        final = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        result["max_difference"] = float((final - reference).abs().max())
        result["iteration"] = opt.last_stats.iteration
    return result


def settings_alike(method: str) -> dict:
    """The same setting written as an int on rank 0 and a float on rank 1 (PowerSGD's
    ``min_compression`` 16 / 16.0, MiCRO's ``initial_threshold`` 1 / 1.0, as
    ``np.int64`` on rank 0 for the integral ones): three steps, what they raised, how long
    they took, and whether the weights agree."""
    import numpy as np

    first = hvd.rank() == 0
    if method == "powersgd":
        compression = hvm.Compression.powersgd(rank=np.int64(1) if first else 1,
                                               min_compression=16 if first else 16.0)
    else:
        compression = hvm.Compression.micro(density=0.05, controller="newton",
                                            judge="magnitude",
                                            initial_threshold=1 if first else 1.0)
    model = _model()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = _wrap(model, compression)

    def body():
        for t in range(3):
            _backward(model, opt, t)
            opt.step()
    result = _outcome(body)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = hvd.allgather(flat.unsqueeze(0), name="weights")
    result["same_weights"] = bool((everyone == everyone[0]).all())
    return result


def unbroadcast_one_after_another(rounds: int = 3) -> dict:
    """Horovod's own optimizer tests build a fresh model and optimizer per case, never
    broadcast before the first step, each dropped before the next is built: per round,
    what its step raised."""
    def one_round(i: int) -> dict:
        model = _model(seed=20 + 10 * i + hvd.rank())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = _wrap(model)

            def step():
                _backward(model, opt, i)
                opt.step()
            return _outcome(step)

    return {"raised": [one_round(i)["raised"] for i in range(rounds)]}
