"""Rank bodies for the optimizer-contract tests (checkpoints, accumulation, bad input,
dense path, Horovod's usage patterns)."""

from __future__ import annotations

import copy

import horovod.torch as hvd
import torch

import horovod_micro as hvm


def _digits():
    from sklearn.datasets import load_digits

    digits = load_digits()
    return torch.tensor(digits.data, dtype=torch.float32) / 16.0, torch.tensor(digits.target)


def _mlp(hidden=64):
    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, 10))


def _batch(x, y, rank, t, batch=32):
    idx = torch.randint(0, len(x), (batch,), generator=torch.Generator().manual_seed(
        10_000 * rank + t))
    return x[idx], y[idx]


def _build(model, density, weight_decay=1e-4):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True,
                          weight_decay=weight_decay)
    return hvm.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                    compression=hvm.Compression.micro(density=density))


def _train(model, opt, x, y, start, stop):
    for t in range(start, stop):
        xb, yb = _batch(x, y, hvd.rank(), t)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()


def checkpoint_resume(first, second, density=0.02):
    """Train ``first`` iterations, checkpoint, train ``second`` more; then restore the
    checkpoint into a fresh model and optimizer and train the same ``second`` again."""
    x, y = _digits()
    torch.manual_seed(0)
    model = _mlp()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = _build(model, density)
    _train(model, opt, x, y, 0, first)
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    # torch's state_dict() holds references to live buffers; a checkpoint is a copy.
    saved_opt = copy.deepcopy(opt.state_dict())
    saved_controller = repr(opt.compression.controller.state_dict())
    _train(model, opt, x, y, first, first + second)
    straight = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    straight_state = opt.state_dict()["horovod_micro"]

    torch.manual_seed(123)  # a different initialisation, overwritten by the checkpoint
    resumed_model = _mlp()
    resumed_model.load_state_dict(saved_model)
    resumed_opt = _build(resumed_model, density)
    resumed_opt.load_state_dict(saved_opt)
    restored_controller = repr(resumed_opt.compression.controller.state_dict())
    _train(resumed_model, resumed_opt, x, y, first, first + second)
    resumed = torch.cat([p.detach().reshape(-1) for p in resumed_model.parameters()])
    resumed_state = resumed_opt.state_dict()["horovod_micro"]
    return {
        "max_param_diff": float((straight - resumed).abs().max()),
        "max_residual_diff": float((straight_state["residual"]
                                    - resumed_state["residual"]).abs().max()),
        "iterations": [straight_state["iteration"], resumed_state["iteration"]],
        "thresholds": [repr(straight_state["compressor"]["controller"]),
                       repr(resumed_state["compressor"]["controller"])],
        "threshold_restored": restored_controller == saved_controller,
        "residual_nonzero": bool(straight_state["residual"].abs().sum() > 0),
    }


def accumulation(numel, steps, passes):
    """``backward_passes_per_step=passes``: gradients of ``passes`` backward passes are
    summed locally and exchanged once per step."""
    from simulation import rank_gradient

    param = torch.nn.Parameter(torch.zeros(numel))
    opt = hvm.DistributedOptimizer(torch.optim.SGD([param], lr=0.0),
                                   named_parameters=[("w", param)],
                                   compression=hvm.Compression.micro(density=0.02),
                                   backward_passes_per_step=passes)
    out = {"grads": [], "thresholds": [], "errors": []}
    for s in range(steps):
        for j in range(passes):
            coeff = rank_gradient(hvd.rank(), s * passes + j, numel, seed=3)
            (param * coeff).sum().backward()
            if j == 0 and passes > 1:
                try:
                    opt.zero_grad()
                except AssertionError as error:
                    out["errors"].append(f"zero_grad: {error}")
        opt.step()
        out["grads"].append(param.grad.tolist())
        out["thresholds"].append(opt.last_stats.threshold)
        opt.zero_grad()
    # One pass too many before step() is refused, like Horovod does.
    for _ in range(passes):
        (param * 1.0).sum().backward()
    try:
        (param * 1.0).sum().backward()
    except AssertionError as error:
        out["errors"].append(f"extra pass: {error}")
    return out


def bad_inputs(cases):
    """Each case makes one rank's (or every rank's) arguments wrong; record what every rank
    raised. Ranks that survive a case go on to the next one: nobody is left waiting."""
    rank = hvd.rank()
    report = {}
    for case in cases:
        try:
            _bad_case(case, rank)
            report[case] = {"raised": None}
        except Exception as error:  # noqa: BLE001  the type is part of what is checked
            report[case] = {"raised": type(error).__name__, "message": str(error)}
    return report


def _bad_case(case, rank):
    torch.manual_seed(0)
    model = _mlp()
    density = 0.01
    params = list(model.named_parameters())
    if case == "density_out_of_range" and rank == 1:
        density = 1.5
    if case == "density_nan" and rank == 1:
        density = float("nan")
    if case == "density_differs" and rank == 1:
        density = 0.02
    if case == "shapes_differ" and rank == 1:
        model = _mlp(hidden=65)
        params = list(model.named_parameters())
    if case == "complex_parameter" and rank == 0:
        extra = torch.nn.Parameter(torch.zeros(4, dtype=torch.complex64))
        params.append(("extra", extra))
    if case == "backward_passes" and rank == 0:
        passes = 0
    else:
        passes = 1
    opt = torch.optim.SGD([p for _, p in params], lr=0.1)
    embedding = None
    if case == "sparse_gradient":
        embedding = torch.nn.Embedding(100, 8, sparse=(rank == 1))
        params = [("emb", embedding.weight)]
        opt = torch.optim.SGD(embedding.parameters(), lr=0.1)
    opt = hvm.DistributedOptimizer(opt, named_parameters=params,
                                   compression=hvm.Compression.micro(density=density),
                                   backward_passes_per_step=passes)
    if embedding is not None:
        embedding(torch.tensor([1, 2, 3])).sum().backward()
        opt.step()


def process_set_membership():
    """Rank 1 builds an optimizer over a process set that holds only rank 0."""
    only_zero = hvd.add_process_set([0])
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        opt = hvm.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=hvm.Compression.micro(density=0.05),
                                       process_set=only_zero)
        x, y = _digits()
        _train(model, opt, x, y, 0, 3)
        result = {"raised": None, "iteration": opt.last_stats.iteration}
    except ValueError as error:
        result = {"raised": str(error)}
    # Rank 1 must not shut Horovod down while rank 0 still uses the process set.
    hvd.barrier()
    return result


def dense_paths(numel, iterations):
    """Horovod's own compressors through our optimizer: the plain average (fp16: close)."""
    from simulation import rank_gradient

    out = {}
    for name, compression in [("hvd.none", hvd.Compression.none),
                              ("hvd.fp16", hvd.Compression.fp16),
                              ("hvm.none", hvm.Compression.none)]:
        param = torch.nn.Parameter(torch.zeros(numel))
        opt = hvm.DistributedOptimizer(torch.optim.SGD([param], lr=0.0),
                                       named_parameters=[("w", param)],
                                       compression=compression)
        grads = []
        for t in range(iterations):
            coeff = rank_gradient(hvd.rank(), t, numel, seed=9)
            (param * coeff).sum().backward()
            opt.step()
            grads.append(param.grad.tolist())
            opt.zero_grad(set_to_none=(t % 2 == 0))
        out[name] = {"grads": grads, "bytes_sent": opt.last_stats.bytes_sent}
    return out


def dense_groups(num_groups, iterations):
    """Dense path with Horovod's fusion groups (``num_groups`` and explicit ``groups``)."""
    from simulation import rank_gradient

    out = {}
    for label in ("num_groups", "groups"):
        params = [torch.nn.Parameter(torch.zeros(n)) for n in (50, 7, 30, 3)]
        named = [(f"p{i}", p) for i, p in enumerate(params)]
        kwargs = ({"num_groups": num_groups} if label == "num_groups"
                  else {"groups": [params[:2], params[2:]]})
        opt = hvm.DistributedOptimizer(torch.optim.SGD(params, lr=0.0), named_parameters=named,
                                       compression=hvm.Compression.none, **kwargs)
        grads = []
        for t in range(iterations):
            loss = sum((p * rank_gradient(hvd.rank(), 10 * t + i, p.numel(), seed=5)).sum()
                       for i, p in enumerate(params))
            loss.backward()
            opt.step()
            grads.append([p.grad.tolist() for p in params])
            opt.zero_grad()
        out[label] = grads
    return out


def usage_patterns():
    """Horovod's patterns: broadcast of state, synchronize + clipping + skip_synchronize,
    Adam, GradScaler, zero_grad(set_to_none=...)."""
    x, y = _digits()
    torch.manual_seed(0)
    model = _mlp()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvm.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3),
                                   named_parameters=model.named_parameters(),
                                   compression=hvm.Compression.micro(density=0.05))
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    result = {"iteration_after_broadcast": opt.state_dict()["horovod_micro"]["iteration"],
              "stats_after_broadcast": opt.last_stats is not None}
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    norms, losses = [], []
    for t in range(30):
        xb, yb = _batch(x, y, hvd.rank(), t)
        opt.zero_grad(set_to_none=(t % 2 == 1))
        loss = torch.nn.functional.cross_entropy(model(xb), yb)
        scaler.scale(loss).backward()
        opt.synchronize()
        scaler.unscale_(opt)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
        losses.append(float(loss))
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = hvd.allgather(params.unsqueeze(0), name="patterns.params")
    result.update({
        "iterations": opt.last_stats.iteration + 1,
        "params_equal_across_ranks": bool((gathered[0] == gathered[-1]).all()),
        "first_loss": losses[0], "last_loss": losses[-1],
        "clipped": max(norms) > 0.5,
    })
    return result


def process_set_member_and_outsider(sparse):
    """Every rank builds an optimizer over a set holding only rank 0 (Horovod's
    test_optimizer_process_sets shape): rank 0 exchanges, the others step locally."""
    only_zero = hvd.add_process_set([0])
    torch.manual_seed(hvd.rank())
    model = _mlp()
    compression = hvm.Compression.micro(density=0.05) if sparse else hvd.Compression.none
    opt = hvm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=compression, process_set=only_zero)
    x, y = _digits()
    before = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
    _train(model, opt, x, y, 0, 3)
    after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    # What a plain local SGD step computes from this rank's last gradient is checked by
    # the test through "moved"; the exchange count through last_stats.
    result = {"moved": bool((after != before).any()),
              "exchanges": None if opt.last_stats is None else opt.last_stats.iteration + 1}
    # Elastic Horovod's commit and restore work on every rank, member or not.
    snapshot = opt.elastic_snapshot()
    result["snapshot"] = sorted(snapshot)
    opt.elastic_restore(snapshot)
    hvd.barrier()
    hvd.remove_process_set(only_zero)
    return result


def resume_by_broadcast(first, second, density=0.02):
    """Horovod's resume idiom: rank 0 loads a checkpoint, then every rank broadcasts
    parameters and optimizer state. Records, per step after the resume, every rank's
    iteration and threshold and how many distinct coordinates the update touched.

    No weight decay: hvd.broadcast_optimizer_state initialises an empty state with a
    zero-gradient local step, which weight decay turns into a parameter change on the
    ranks that did not load (stock Horovod does the same)."""
    x, y = _digits()
    torch.manual_seed(0)
    model = _mlp()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = _build(model, density, weight_decay=0.0)
    _train(model, opt, x, y, 0, first)
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = copy.deepcopy(opt.state_dict())

    torch.manual_seed(1 + hvd.rank())
    model = _mlp()
    opt = _build(model, density, weight_decay=0.0)
    if hvd.rank() == 0:
        model.load_state_dict(saved_model)
        opt.load_state_dict(saved_opt)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    steps = []
    for t in range(first, first + second):
        xb, yb = _batch(x, y, hvd.rank(), t)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xb), yb).backward()
        opt.synchronize()
        touched = sum(int((p.grad != 0).sum()) for p in model.parameters())
        with opt.skip_synchronize():
            opt.step()
        s = opt.last_stats
        steps.append({"iteration": s.iteration, "threshold": s.threshold,
                      "controller": repr(opt.compression.controller.state_dict()),
                      "global_count": s.global_count, "touched": touched})
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = hvd.allgather(params.unsqueeze(0), name="resume.params")
    # Loading another rank's residual is refused with a clear error.
    foreign = hvd.broadcast_object(saved_opt if hvd.rank() == 0 else None, root_rank=0,
                                   name="resume.foreign")
    try:
        opt.load_state_dict(foreign)
        refused = None
    except ValueError as error:
        refused = str(error)
    return {"steps": steps, "params_equal": bool((gathered == gathered[0]).all()),
            "refused": refused}


class _Tied(torch.nn.Module):
    """Input and output projections share one weight (tied embeddings)."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(64, 16, bias=False)
        self.out = torch.nn.Linear(16, 64, bias=False)
        self.out.weight = torch.nn.Parameter(self.inp.weight.t().contiguous())
        self.tied = torch.nn.Linear(16, 16)
        self.tied2 = torch.nn.Linear(16, 16)
        self.tied2.weight = self.tied.weight

    def forward(self, x):
        return self.out(self.tied2(self.tied(self.inp(x))))


def tied_parameters(sparse):
    """A tensor listed twice by ``named_parameters(remove_duplicate=False)`` takes part
    once; the result is the ranks' average (the sparse path through Top-k at density 1,
    which sends every coordinate)."""
    torch.manual_seed(0)
    model = _Tied()
    compression = hvm.Compression.topk(density=1.0) if sparse else hvm.Compression.none
    opt = hvm.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0),
        named_parameters=list(model.named_parameters(remove_duplicate=False)),
        compression=compression)
    x, _ = _digits()
    out = []
    for t in range(3):
        xb = x[10 * hvd.rank() + t: 10 * hvd.rank() + t + 8]
        opt.zero_grad()
        loss = model(xb).pow(2).mean()
        # This rank's own gradient, taken before backward: on the dense path Horovod's hook
        # reduces .grad in place while backward still runs, so a copy of .grad made after
        # backward may already hold part of the average. autograd.grad runs no hook.
        (local,) = torch.autograd.grad(loss, model.tied.weight, retain_graph=True)
        loss.backward()
        opt.step()
        mean = hvd.allreduce(local, name=f"tied.mean.{t}")
        out.append(float((model.tied.weight.grad - mean).abs().max()))
    return {"steps": out, "numel": opt.last_stats.numel,
            "unique_numel": sum(p.numel() for p in model.parameters())}


def rewrap_and_close(sparse):
    """Wrapping the same model again closes the previous optimizer; an optimizer that
    is dropped releases its hooks and buffers."""
    import gc
    import warnings
    import weakref

    torch.manual_seed(0)
    model = _mlp()
    x, y = _digits()

    def wrap():
        compression = hvm.Compression.micro(density=0.05) if sparse else hvm.Compression.none
        return hvm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters(),
                                        compression=compression)

    first = wrap()
    _train(model, first, x, y, 0, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        second = wrap()
    # The first one's hooks would raise after backward_passes_per_step passes.
    _train(model, second, x, y, 2, 6)
    try:
        first.step()
        first_step = None
    except RuntimeError as error:
        first_step = str(error)
    buffers_freed = first.reducer is None
    gone = weakref.ref(second)
    del second
    gc.collect()
    collected = gone() is None
    # With no optimizer left, backward passes count nothing and raise nothing.
    for _ in range(3):
        torch.nn.functional.cross_entropy(model(x[:8]), y[:8]).backward()
    third = wrap()
    _train(model, third, x, y, 6, 8)
    return {"warned": any("already wrapped" in str(w.message) for w in caught),
            "first_step": first_step, "buffers_freed": buffers_freed,
            "collected": collected, "third_iterations": third.last_stats.iteration + 1}


def clean_after_collective_error():
    """After a CollectiveInputError the pass counters are reset: zero_grad() and the next
    backward work on every rank."""
    embedding = torch.nn.Embedding(100, 8, sparse=(hvd.rank() == 1))
    opt = hvm.DistributedOptimizer(torch.optim.SGD(embedding.parameters(), lr=0.1),
                                   named_parameters=[("emb", embedding.weight)],
                                   compression=hvm.Compression.micro(density=0.05))
    embedding(torch.tensor([1, 2, 3])).sum().backward()
    try:
        opt.step()
        raised = None
    except hvm.CollectiveInputError as error:
        raised = type(error).__name__
    opt.zero_grad()  # raised AssertionError before: counters were left at 1
    embedding(torch.tensor([4, 5])).sum().backward()
    return {"raised": raised, "zero_grad_ok": True}


def frozen_after_wrapping(sparse):
    """A parameter frozen after the optimizer was built gets no ``.grad`` and does not
    move (momentum SGD would move it on a zero gradient)."""
    torch.manual_seed(0)
    model = _mlp()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = _build(model, 0.05) if sparse else hvm.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        named_parameters=model.named_parameters())
    x, y = _digits()
    _train(model, opt, x, y, 0, 2)
    frozen = model[0].weight
    frozen.requires_grad_(False)
    before = frozen.detach().clone()
    _train(model, opt, x, y, 2, 5)
    return {"grad_is_none": frozen.grad is None, "moved": bool((frozen != before).any()),
            "others_moved": bool(model[2].weight.grad is not None)}


def loss_scale_changes(steps, density=0.05):
    """The same run three times: without loss scaling; with a GradScaler whose scale
    doubles every step (growth_interval=1), passed to the optimizer; and with that scaler
    not passed. Powers of two scale exactly, so the first two must agree."""
    x, y = _digits()

    def run(mode):
        torch.manual_seed(0)
        model = _mlp()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=1)
        opt = hvm.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05),
            named_parameters=model.named_parameters(),
            compression=hvm.Compression.micro(density=density),
            grad_scaler=scaler if mode == "passed" else None)
        counts, scales = [], []
        for t in range(steps):
            xb, yb = _batch(x, y, hvd.rank(), t)
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(xb), yb)
            if mode == "unscaled":
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                opt.synchronize()
                scaler.unscale_(opt)
                with opt.skip_synchronize():
                    scaler.step(opt)
                scaler.update()
                scales.append(scaler.get_scale())
            counts.append(opt.last_stats.global_count)
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), counts, scales

    reference, ref_counts, _ = run("unscaled")
    passed, passed_counts, scales = run("passed")
    ignored, ignored_counts, _ = run("ignored")
    return {"passed_diff": float((passed - reference).abs().max()),
            "ignored_diff": float((ignored - reference).abs().max()),
            "counts": [ref_counts, passed_counts, ignored_counts], "scales": scales}
