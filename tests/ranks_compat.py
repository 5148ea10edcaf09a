"""Rank bodies of the Horovod-compatibility suite (``test_horovod_compat.py``).

Each function runs on every rank after ``hvd.init()`` and walks through several of the
behaviours that Horovod 0.28.1's own ``DistributedOptimizer`` tests exercise, with
``hvm.DistributedOptimizer`` in one ``mode``:

* ``"dense"``: Horovod's compressor ``hvd.Compression.none`` (Horovod's dense allreduce),
* ``"fp16"``: ``hvd.Compression.fp16``,
* ``"micro"``: ``hvm.Compression.micro(density)``; ``"micro_fp16"`` with float16 values.

They return what the checks need to recompute the expected result independently (flat
vectors in name order, the thresholds MiCRO used) plus what only the ranks can observe
(raised errors, warnings, agreement across ranks).
"""

from __future__ import annotations

import io
import warnings

import horovod.torch as hvd
import torch
from compat_models import (
    OPTION_SETS,
    RANK_OPTIONS,
    SGD_OPTIONS,
    IndexedScale,
    accepted_options,
    conv_pair,
    embedding,
    embedding_input,
    flat_grads,
    flat_params,
    gan_pair,
    image,
    indexed_input,
    make_optimizer,
    mixed_loss,
    mixed_precision,
    mlp,
    mlp_loss,
    optimizer_classes,
    two_heads,
    two_heads_loss,
)

import horovod_micro as hvm


def compressor(mode: str, density: float):
    if mode == "dense":
        return hvd.Compression.none
    if mode == "fp16":
        return hvd.Compression.fp16
    # The published judge: these references simulate |a| >= threshold (the drift judge
    # has its own tests against the simulation: test_loopback, test_micro_exchange).
    if mode == "micro":
        return hvm.Compression.micro(density=density, judge="magnitude")
    if mode == "micro_fp16":
        return hvm.Compression.micro(density=density, fp16_values=True, judge="magnitude")
    raise ValueError(f"unknown mode {mode!r}")


def _wrap(opt, model, mode, density, **kwargs):
    named = model.named_parameters() if model is not None else None
    return hvm.DistributedOptimizer(opt, named_parameters=named,
                                    compression=compressor(mode, density), **kwargs)


def _threshold(opt):
    stats = getattr(opt, "last_stats", None)
    return None if stats is None else stats.threshold


def _exchanges(opt):
    stats = getattr(opt, "last_stats", None)
    return 0 if stats is None else stats.iteration + 1


def _same_on_all_ranks(tensor: torch.Tensor, name: str, process_set=hvd.global_process_set):
    gathered = hvd.allgather(tensor.detach().reshape(1, -1).double(), name=name,
                             process_set=process_set)
    return bool((gathered == gathered[0]).all())


def _error(error: BaseException) -> dict:
    return {"type": type(error).__name__, "message": str(error)}


# ----- test_force_allreduce -------------------------------------------------------------
def force_allreduce(mode, density):
    """Every optimizer class x both option sets: rank 0's loss leaves ``fc3`` without a
    gradient, the other ranks' losses reach it; one step each."""
    out = []
    for (name, cls), (index, options) in [(c, o) for c in optimizer_classes()
                                          for o in enumerate(OPTION_SETS)]:
        model = two_heads(seed=0)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = _wrap(make_optimizer(cls, options, model.parameters()), model, mode, density)
        loss = two_heads_loss(model, hvd.rank())
        opt.zero_grad()
        loss.backward()
        fc3_had_grad = model.fc3.weight.grad is not None
        opt.step()
        params = flat_params(model)
        out.append({"optimizer": name, "options": index,
                    "params": params.tolist() if hvd.rank() == 0 else None,
                    "same_on_all_ranks": _same_on_all_ranks(params, f"fa.{name}.{index}"),
                    "fc3_had_grad": fc3_had_grad, "threshold": _threshold(opt)})
    return out


# ----- test_broadcast_state, test_broadcast_state_options, test_broadcast_state_no_grad --
def _model_snapshot(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _state_snapshot(opt) -> dict:
    state = opt.state_dict()
    entries = []
    for group in state["param_groups"]:
        for pid in group["params"]:
            for key, value in sorted(state["state"].get(pid, {}).items()):
                entries.append((pid, key, value.clone() if torch.is_tensor(value) else value))
    return {"entries": entries, "num_states": len(state["state"])}


def _differences(reference: dict, now: dict) -> list[str]:
    found = []
    for key, value in reference["model"].items():
        if not torch.equal(value, now["model"][key]):
            found.append(f"model {key}")
    if len(reference["entries"]) != len(now["entries"]):
        found.append(f"{len(reference['entries'])} state entries on rank 0, "
                     f"{len(now['entries'])} here")
    for (pid, key, want), (pid2, key2, got) in zip(reference["entries"], now["entries"]):
        if (pid, key) != (pid2, key2) or type(want) is not type(got):
            found.append(f"state {pid}.{key}: {type(want).__name__} vs {type(got).__name__}")
        elif torch.is_tensor(want) and not torch.equal(want, got):
            found.append(f"state {pid}.{key} values")
        elif not torch.is_tensor(want) and want != got:
            found.append(f"state {pid}.{key}: {want!r} vs {got!r}")
    return found


def broadcast_state(mode, density):
    """Per optimizer class and option set: train a step, save rank 0's checkpoint, rebuild
    everything (different values on every rank), load the checkpoint on rank 0 only, then
    ``broadcast_parameters`` + ``broadcast_optimizer_state``: every rank must hold rank 0's
    checkpointed model and optimizer state, and training must go on."""
    rank = hvd.rank()
    out = []
    for (name, cls), (index, options) in [(c, o) for c in optimizer_classes()
                                          for o in enumerate(OPTION_SETS)]:
        tag = f"bs.{name}.{index}"
        model = mlp(seed=rank)
        # Unlike Horovod's test, the first model is broadcast: a sparse optimizer refuses
        # weights that differ across ranks at its first exchange (docs/failure-modes.md).
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = _wrap(make_optimizer(cls, options, model.parameters()), model, mode, density)
        opt.zero_grad()
        mlp_loss(model, rank).backward()
        opt.step()
        reference = hvd.broadcast_object({"model": _model_snapshot(model), **_state_snapshot(opt)},
                                         root_rank=0, name=f"{tag}.ref")
        checkpoint = None
        if rank == 0:
            buffer = io.BytesIO()
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
            checkpoint = buffer.getvalue()

        model = mlp(seed=100 + rank)
        opt = _wrap(make_optimizer(cls, options, model.parameters()), model, mode, density)
        if rank == 0:
            saved = torch.load(io.BytesIO(checkpoint))
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["optimizer"])
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        # The model is compared right after its broadcast: broadcast_optimizer_state then
        # initialises a fresh optimizer's state with a step on zero gradients, which moves
        # the parameters of the ranks other than 0 wherever weight decay applies (Horovod
        # does exactly this too).
        after = {"model": _model_snapshot(model)}
        expected_states = hvd.broadcast_object(len(opt.state_dict()["state"]), root_rank=0,
                                               name=f"{tag}.n")
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        after.update(_state_snapshot(opt))
        differences = _differences(reference, after)

        opt.zero_grad()
        mlp_loss(model, rank).backward()
        opt.step()
        # The iteration the next exchange ran at: a sparse optimizer adopts rank 0's
        # iteration and controller at its first exchange after construction or loading.
        sparse = opt.state_dict().get("horovod_micro") is not None
        iteration = opt.last_stats.iteration if sparse else None
        out.append({"optimizer": name, "options": index, "differences": differences,
                    "states": [expected_states, after["num_states"]],
                    "finite_after_next_step": bool(flat_params(model).isfinite().all()),
                    "micro_iteration": iteration, "next_threshold": _threshold(opt),
                    "controller": repr(opt.compression.state_dict()) if sparse else None})
    return out


def broadcast_options(mode, density):
    """Ranks build their optimizers with different hyper-parameters; after a step and
    ``broadcast_optimizer_state`` every rank runs with rank 0's options (same types)."""
    rank = hvd.rank()
    out = []
    for name, cls in optimizer_classes():
        model = mlp(seed=0)
        options = accepted_options(cls, RANK_OPTIONS[min(rank, 1)])
        opt = _wrap(cls(model.parameters(), **options), model, mode, density)
        opt.zero_grad()
        mlp_loss(model, rank).backward()
        opt.step()
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        group = opt.param_groups[0]
        got = {k: {"type": type(group[k]).__name__,
                   "value": list(group[k]) if isinstance(group[k], tuple) else group[k],
                   "element_types": [type(e).__name__ for e in group[k]]
                   if isinstance(group[k], tuple) else None}
               for k in options}
        opt.zero_grad()
        mlp_loss(model, rank).backward()
        opt.step()
        out.append({"optimizer": name, "options": got,
                    "finite_after_next_step": bool(flat_params(model).isfinite().all())})
    return out


def broadcast_no_grad(mode, density):
    """A model with an integer parameter that never gets a gradient: broadcasting the
    state of a fresh optimizer leaves it alone and gives the float parameter rank 0's
    (zero) gradient; a training step afterwards exchanges the float gradient only."""
    model = IndexedScale()
    opt = torch.optim.SGD(model.parameters(), lr=0.001, weight_decay=1e-6, momentum=0.9,
                          nesterov=True)
    opt = _wrap(opt, model, mode, density)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    b_grad = opt.param_groups[0]["params"][1].grad
    out = {"a_grad_none": opt.param_groups[0]["params"][0].grad is None,
           "b_grad_is_roots": bool(torch.equal(b_grad, hvd.broadcast(b_grad, root_rank=0,
                                                                      name="bng.b"))),
           "b_grad": b_grad.tolist(), "exchanges_before_training": _exchanges(opt)}
    opt.zero_grad()
    model(indexed_input(hvd.rank())).sum().backward()
    opt.step()
    out.update({"a_grad_none_after_step": model.a.grad is None,
                "b_grad_after_step": model.b.grad.tolist(), "threshold": _threshold(opt),
                "a_unchanged": model.a.tolist() == [1, 3]})
    return out


def broadcast(mode, density):
    return {"state": broadcast_state(mode, density),
            "options": broadcast_options(mode, density)}


# ----- the usage patterns -----------------------------------------------------------------
def _linear_one(weight=0.5):
    model = torch.nn.Linear(1, 1)
    model.weight = torch.nn.Parameter(torch.zeros(1, 1) + weight)
    model.bias = torch.nn.Parameter(torch.zeros(1))
    return model


def _linear_input(rank):
    return torch.ones(1, 1) + 0.5 * rank, torch.ones(1, 1)


def _synchronized_linear(mode, density, **weight):
    """The one-weight linear model, wrapped, after one backward and ``synchronize()``."""
    model = _linear_one(**weight)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = _wrap(torch.optim.SGD(model.parameters(), lr=0.1), model, mode, density)
    x, y = _linear_input(hvd.rank())
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.synchronize()
    return model, opt


def gradient_clipping(mode, density):
    """``synchronize()``, clip the exchanged gradient, ``step()`` inside
    ``skip_synchronize()``: the step uses the clipped gradient, no second exchange."""
    model, opt = _synchronized_linear(mode, density)
    prior = flat_grads(model)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    clipped = flat_grads(model)
    with opt.skip_synchronize():
        opt.step()
    return {"prior": prior.tolist(), "clipped": clipped.tolist(),
            "params": flat_params(model).tolist(), "threshold": _threshold(opt),
            "exchanges": _exchanges(opt)}


def step_warning(mode, density):
    """``synchronize()`` then ``step()`` outside ``skip_synchronize()``: one warning, and
    the number of exchanges (dense: the step exchanges again; sparse: not)."""
    model, opt = _synchronized_linear(mode, density, weight=0.3)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    return {"warnings": [str(w.message) for w in caught], "exchanges": _exchanges(opt),
            "same_on_all_ranks": _same_on_all_ranks(flat_params(model), "sw.params")}


def dynamic_requires_grad(mode, density, rounds=4):
    """A generator and a discriminator with one optimizer each, trained in turns by
    switching ``requires_grad``: only the trained module has gradients, and its exchange
    does not wait for the frozen one."""
    gen, disc = gan_pair(seed=0)
    for module in (gen, disc):
        hvd.broadcast_parameters(module.state_dict(), root_rank=0)
    gen_opt = _wrap(torch.optim.SGD(gen.parameters(), lr=0.1), gen, mode, density)
    disc_opt = _wrap(torch.optim.SGD(disc.parameters(), lr=0.1), disc, mode, density)
    inp = image(hvd.rank())
    pattern_ok, first_gen_grad, first_threshold = [], None, None
    for step in range(2 * rounds):
        train_gen = step % 2 == 0
        for p in gen.parameters():
            p.requires_grad_(train_gen)
        for p in disc.parameters():
            p.requires_grad_(not train_gen)
        gen_opt.zero_grad()
        disc_opt.zero_grad()
        disc(gen(inp)).sum().backward()
        pattern_ok.append(
            all(train_gen == (p.grad is not None and bool(p.grad.abs().max() > 0))
                for p in gen.parameters())
            and all((not train_gen) == (p.grad is not None and bool(p.grad.abs().max() > 0))
                    for p in disc.parameters()))
        (gen_opt if train_gen else disc_opt).step()
        if step == 0:
            first_gen_grad = flat_grads(gen).tolist()
            first_threshold = _threshold(gen_opt)
    return {"pattern_ok": pattern_ok, "first_gen_grad": first_gen_grad,
            "first_threshold": first_threshold,
            "exchanges": [_exchanges(gen_opt), _exchanges(disc_opt)],
            "same_on_all_ranks": _same_on_all_ranks(
                torch.cat([flat_params(gen), flat_params(disc)]), "drg.params")}


def no_named_parameters(mode, density):
    """``named_parameters`` left out: the optimizer names every parameter itself."""
    model = conv_pair(seed=0)
    opt = hvm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   compression=compressor(mode, density))
    opt.zero_grad()
    model(image(hvd.rank())).sum().backward()
    opt.step()
    names = opt._parameter_names  # Horovod's attribute: {parameter: name}
    return {"names": [names[p] for p in model.parameters()],
            "grads": [p.grad.reshape(-1).tolist() for p in model.parameters()],
            "threshold": _threshold(opt)}


def optimizer_no_named_parameters(mode, density):
    """Two parameter groups, no names: unique names, identical on every rank."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 10))
    opt = torch.optim.SGD([{"params": model[0].parameters()},
                           {"params": model[1].parameters()}], lr=0.001)
    opt = hvm.DistributedOptimizer(opt, compression=compressor(mode, density))
    names = list(opt._parameter_names.values())
    everyone = hvd.allgather_object(sorted(names), name="onnp.names")
    opt.zero_grad()
    model(torch.full((3, 10), 1.0 + hvd.rank())).pow(2).sum().backward()
    opt.step()
    return {"names": names, "everyone": everyone, "num_params": len(list(model.parameters())),
            "same_on_all_ranks": _same_on_all_ranks(flat_params(model), "onnp.params")}


def bad_names(mode, density):
    """Duplicate names, and names for only part of the model: ``ValueError``."""
    out = {}
    net1, net2 = torch.nn.Conv2d(1, 1, 1), torch.nn.Conv2d(1, 1, 1)
    opt = torch.optim.SGD(list(net1.parameters()) + list(net2.parameters()), lr=0.1)
    try:
        hvm.DistributedOptimizer(opt, named_parameters=list(net1.named_parameters())
                                 + list(net2.named_parameters()),
                                 compression=compressor(mode, density))
        out["duplicate"] = None
    except Exception as error:  # noqa: BLE001  the type is what is checked
        out["duplicate"] = _error(error)
    model = conv_pair(seed=0)
    try:
        hvm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=list(model.named_parameters())[:1],
                                 compression=compressor(mode, density))
        out["missing"] = None
    except Exception as error:  # noqa: BLE001
        out["missing"] = _error(error)
    return out


def mixed_dtypes(mode, density):
    """float32 and float64 parameters in one model, float16 on the wire: every gradient
    keeps its parameter's dtype and is (within float16 precision) the average."""
    model = mixed_precision(seed=0)
    opt = _wrap(torch.optim.SGD(model.parameters(), lr=0.0), model, mode, density)
    opt.zero_grad()
    mixed_loss(model, hvd.rank()).backward()
    opt.step()
    return {"dtypes": {n: str(p.grad.dtype) for n, p in model.named_parameters()},
            "grad": flat_grads(model).tolist(), "threshold": _threshold(opt)}


def fp16_wire(density):
    return {mode: mixed_dtypes(mode, density) for mode in ("fp16", "micro_fp16")}


def usage(mode, density):
    """All the single-optimizer usage checks of one mode in one launch."""
    return {"gradient_clipping": gradient_clipping(mode, density),
            "step_warning": step_warning(mode, density),
            "dynamic_requires_grad": dynamic_requires_grad(mode, density),
            "no_named_parameters": no_named_parameters(mode, density),
            "optimizer_no_named_parameters": optimizer_no_named_parameters(mode, density),
            "bad_names": bad_names(mode, density),
            "broadcast_no_grad": broadcast_no_grad(mode, density)}


# ----- test_delta_optimizer (Adasum) ------------------------------------------------------
def adasum(density):
    """``op=hvd.Adasum`` (Horovod's delta optimizer); with a sparse compressor: rejected."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Conv2d(1, 6, 1), torch.nn.Conv2d(6, 1, 1))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum)
    opt.zero_grad()
    model(image(hvd.rank(), side=12)).sum().backward()
    opt.step()
    hvd.barrier()
    out = {"class_module": type(opt).__module__,
           "params": {n: p.detach().reshape(-1).tolist() for n, p in model.named_parameters()}}
    try:
        hvm.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=model.named_parameters(), op=hvd.Adasum,
                                 compression=hvm.Compression.micro(density=density))
        out["sparse"] = None
    except Exception as error:  # noqa: BLE001
        out["sparse"] = _error(error)
    return out


# ----- test_optimizer_process_sets --------------------------------------------------------
def process_sets(modes, density):
    """Even and odd ranks form two process sets. Per mode, three models and optimizers,
    all built on every rank: one over the even set (Horovod's case), one over the odd set,
    and one over the rank's own set (two optimizers on disjoint sets exchanging at the
    same time). On 3 ranks also one over {0, 1}, which overlaps the even set {0, 2}. A
    rank outside an optimizer's set steps on its own gradient."""
    rank, size = hvd.rank(), hvd.size()
    even = hvd.add_process_set(list(range(0, size, 2)))
    odd = hvd.add_process_set(list(range(1, size, 2)))
    sets = {"even": even}
    if size == 3:
        # Right after the even set's optimizer, which rank 1 is not in: its collectives
        # must still match rank 0's.
        sets["low"] = hvd.add_process_set([0, 1])
    sets.update({"odd": odd, "own": even if rank % 2 == 0 else odd})
    out = {}
    for mode in modes:
        out[mode] = {}
        for label, process_set in sets.items():
            model = mlp(seed=0)
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            opt = _wrap(torch.optim.SGD(model.parameters(), **SGD_OPTIONS), model, mode,
                        density, process_set=process_set)
            opt.zero_grad()
            mlp_loss(model, rank).backward()
            opt.step()
            params = flat_params(model)
            out[mode][label] = {"params": params.tolist(), "threshold": _threshold(opt),
                                "everyone": hvd.allgather(params.reshape(1, -1),
                                                          name=f"ps.{mode}.{label}").tolist()}
    hvd.barrier()
    for label in ("low", "odd", "even"):
        if label in sets:
            hvd.remove_process_set(sets[label])
    return out


# ----- test_sparse_embeddings -------------------------------------------------------------
def sparse_embeddings(mode, density):
    """``nn.Embedding(sparse=True)`` + ``SparseAdam``, ``sparse_as_dense`` False and True.
    Dense compressors: the step runs on the averaged gradient (still sparse for SparseAdam).
    Sparse compressors: every rank raises ``hvm.CollectiveInputError``."""
    out = {}
    for sparse_as_dense in (False, True):
        model = embedding(seed=hvd.rank())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        initial = model.weight.detach().clone()
        opt = torch.optim.SparseAdam(list(model.parameters()), lr=0.1)
        opt = hvm.DistributedOptimizer(opt, sparse_as_dense=sparse_as_dense,
                                       compression=compressor(mode, density))
        opt.zero_grad()
        model(embedding_input(hvd.rank())).sum().backward()
        try:
            opt.step()
        except hvm.CollectiveInputError as error:
            out[str(sparse_as_dense)] = {"raised": _error(error)}
            continue
        grad = model.weight.grad
        out[str(sparse_as_dense)] = {
            "raised": None, "initial": initial.tolist(), "is_sparse": grad.is_sparse,
            "grad": grad.to_dense().tolist(), "weight": model.weight.detach().tolist(),
            "same_on_all_ranks": _same_on_all_ranks(model.weight, f"se.{sparse_as_dense}")}
    return out
