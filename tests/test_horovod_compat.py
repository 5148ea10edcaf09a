"""Horovod 0.28.1 compatibility: the behaviours that Horovod's own ``DistributedOptimizer``
tests (``test/parallel/test_torch.py``) check, checked against ``hvm.DistributedOptimizer``
on real ranks, once with Horovod's dense allreduce (``hvd.Compression.none``/``fp16``) and
once with MiCRO (``hvm.Compression.micro``).

Expected values are recomputed here without Horovod (``compat_models.py``): a dense
exchange is the mean of the ranks' gradients, a MiCRO exchange the single-process
simulation of ``simulation.py`` run with the thresholds the ranks report. The thresholds
are not under test here (test_micro_exchange derives them from the controllers' plain
statements, ``simulation.BoundedRule`` and ``NewtonRule``): which gradients reach the
exchange, and where its aggregate lands, are.

Each rank launch covers several behaviours and is made once per session (``_launch``);
the tests below then each check one behaviour of a launch.
"""

from __future__ import annotations

import json

import pytest
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
    exchanged,
    gan_pair,
    image,
    indexed_input,
    local_flat_grad,
    mixed_loss,
    mixed_precision,
    mlp,
    mlp_loss,
    optimizer_classes,
    stepped_params,
    two_heads,
    two_heads_loss,
)
from horovod.torch.compression import Compression as HorovodCompression
from multirank import RankFailure, run_ranks

import horovod_micro as hvm

MODES = ["dense", "micro"]
DENSITY = 0.5  # k = floor(0.5 N) >= 1 for every toy model below
STEP_WARNING = "optimizer.step() called without optimizer.skip_synchronize()"

_launches: dict = {}


def _launch(target: str, np: int = 2, backend: str = "gloo", timeout: float = 180,
            env: dict | None = None, **kwargs):
    """``run_ranks`` once per distinct launch in this session (its failure too)."""
    key = (target, np, backend, json.dumps(kwargs, sort_keys=True))
    if key not in _launches:
        try:
            _launches[key] = run_ranks(f"ranks_compat:{target}", np=np, backend=backend,
                                       kwargs=kwargs, timeout=timeout, env=env)
        except RankFailure as error:
            _launches[key] = error
    result = _launches[key]
    if isinstance(result, RankFailure):
        raise RankFailure(str(result))
    return [r.value for r in result]


@pytest.fixture(autouse=True)
def _one_thread():
    """The references are computed with one thread, as the ranks compute (same sums)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _close(got, want, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(torch.as_tensor(got, dtype=torch.float64),
                               want.to(torch.float64), rtol=rtol, atol=atol)


def _thresholds(values, mode):
    """MiCRO's thresholds of one step, one per rank (the default controller scales each
    rank's threshold with that rank's gradient); the dense modes have none."""
    if mode in ("dense", "fp16"):
        assert all(v is None for v in values)
        return None
    assert all(v > 0 for v in values), values
    return [list(values)]


def _local(build, loss_of, ranks):
    return [local_flat_grad(model, loss_of(model, r)) for r in ranks
            for model in [build()]]


# ----- test_broadcast_state ---------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_broadcast_state(mode):
    """Rank 0's checkpoint, loaded on rank 0 only, reaches every rank through
    broadcast_parameters + broadcast_optimizer_state, for every torch optimizer."""
    results = _launch("broadcast", mode=mode, density=DENSITY)
    expected = [(name, i) for name, _ in optimizer_classes() for i in range(len(OPTION_SETS))]
    for values in results:
        entries = values["state"]
        assert [(e["optimizer"], e["options"]) for e in entries] == expected
        for e in entries:
            assert e["differences"] == [], (e["optimizer"], e["options"], e["differences"])
            assert e["states"][0] == e["states"][1], e
            assert e["finite_after_next_step"], e
    # The stateful optimizers really had state to broadcast.
    assert any(e["states"][0] > 0 for e in results[1]["state"])


def test_broadcast_state_resumes_one_micro_run():
    """MiCRO's cross-rank state (iteration, hence the rotation of the parts, and the
    density controller's state) must agree on every rank after Horovod's resume pattern,
    as it does in an uninterrupted run: otherwise two ranks own the same part and the
    controllers drift."""
    results = _launch("broadcast", mode="micro", density=DENSITY)
    for first, second in zip(results[0]["state"], results[1]["state"]):
        label = (first["optimizer"], first["options"])
        # The checkpoint was taken after one exchange: the next one is iteration 1 on
        # every rank (rank 1's fresh optimizer would otherwise start again at 0).
        assert first["micro_iteration"] == second["micro_iteration"] == 1, label
        assert first["controller"] == second["controller"], label


@pytest.mark.parametrize("mode", MODES)
def test_broadcast_state_options(mode):
    """Ranks built with different hyper-parameters run with rank 0's after the broadcast,
    with the same Python types, and can step again."""
    results = _launch("broadcast", mode=mode, density=DENSITY)
    classes = dict(optimizer_classes())
    for values in results:
        for entry in values["options"]:
            want = accepted_options(classes[entry["optimizer"]], RANK_OPTIONS[0])
            assert set(entry["options"]) == set(want)
            for key, expected in want.items():
                got = entry["options"][key]
                assert got["type"] == type(expected).__name__, (entry["optimizer"], key, got)
                if isinstance(expected, tuple):
                    assert got["element_types"] == [type(e).__name__ for e in expected]
                    assert got["value"] == pytest.approx(list(expected), abs=1e-5)
                else:
                    assert got["value"] == pytest.approx(expected, abs=1e-5)
            assert entry["finite_after_next_step"]


# ----- the single-optimizer usage patterns (Gloo and MPI) ------------------------------
def _usage(mode, backend):
    return _launch("usage", backend=backend, mode=mode, density=DENSITY)


@pytest.mark.parametrize("mode", MODES)
def test_broadcast_state_no_grad(mode, backend):
    """A parameter without gradient keeps ``grad is None`` through the broadcast of a
    fresh optimizer's state; the other one gets rank 0's; training exchanges only it."""
    results = [v["broadcast_no_grad"] for v in _usage(mode, backend)]
    model = IndexedScale()
    local = _local(lambda: model, lambda m, r: m(indexed_input(r)).sum(), range(2))
    grad = exchanged(local, mode, _thresholds([v["threshold"] for v in results], mode))
    for v in results:
        assert v["a_grad_none"] and v["b_grad_is_roots"]
        assert v["b_grad"] == [0.0] * 4
        assert v["exchanges_before_training"] == 0  # the state broadcast is no exchange
        assert v["a_grad_none_after_step"] and v["a_unchanged"]
        _close(v["b_grad_after_step"], grad)
    assert grad.abs().sum() > 0


@pytest.mark.parametrize("mode", MODES)
def test_gradient_clipping(mode, backend):
    """synchronize(), clip, step() inside skip_synchronize(): the step applies the clipped
    exchanged gradient and exchanges nothing more."""
    results = [v["gradient_clipping"] for v in _usage(mode, backend)]

    def build():
        model = torch.nn.Linear(1, 1)
        with torch.no_grad():
            model.weight.fill_(0.5)
            model.bias.zero_()
        return model

    def loss_of(model, rank):
        x, y = torch.ones(1, 1) + 0.5 * rank, torch.ones(1, 1)
        return torch.nn.functional.mse_loss(model(x), y)

    local = _local(build, loss_of, range(2))
    prior = exchanged(local, mode, _thresholds([v["threshold"] for v in results], mode))
    clipped = prior * min(1.0, 0.1 / (float(prior.norm()) + 1e-6))
    params = torch.tensor([0.0, 0.5], dtype=torch.float64) - 0.1 * clipped  # [bias, weight]
    for v in results:
        _close(v["prior"], prior)
        _close(v["clipped"], clipped)
        assert abs(v["prior"][1]) > abs(v["clipped"][1])
        _close(v["params"], params)
        assert v["exchanges"] == 1


@pytest.mark.parametrize("mode", MODES)
def test_synchronize_step_warning(mode, backend):
    """synchronize() then step() without skip_synchronize(): exactly one warning; a dense
    step exchanges again (as Horovod's step does, which leaves an average unchanged), a
    sparse one does not (a second sparse exchange would change the aggregate)."""
    for v in [v["step_warning"] for v in _usage(mode, backend)]:
        assert len(v["warnings"]) == 1 and STEP_WARNING in v["warnings"][0], v["warnings"]
        assert v["exchanges"] == (2 if mode == "dense" else 1)
        assert v["same_on_all_ranks"]


@pytest.mark.parametrize("mode", MODES)
def test_dynamic_requires_grad(mode, backend):
    """Two optimizers trained in turns by switching requires_grad: only the trained
    module has gradients; its exchange is the average and never waits for the other."""
    results = [v["dynamic_requires_grad"] for v in _usage(mode, backend)]
    gen, disc = gan_pair(seed=0)
    for p in disc.parameters():
        p.requires_grad_(False)
    local = _local(lambda: gen, lambda m, r: disc(m(image(r))).sum(), range(2))
    grad = exchanged(local, mode, _thresholds([v["first_threshold"] for v in results], mode))
    for v in results:
        assert v["pattern_ok"] == [True] * len(v["pattern_ok"])
        assert v["exchanges"] == [len(v["pattern_ok"]) // 2] * 2
        assert v["same_on_all_ranks"]
        _close(v["first_gen_grad"], grad)


@pytest.mark.parametrize("mode", MODES)
def test_no_named_parameters(mode, backend):
    """named_parameters left out: the optimizer names the parameters itself and exchanges
    their gradients."""
    results = [v["no_named_parameters"] for v in _usage(mode, backend)]
    names = results[0]["names"]
    assert len(set(names)) == len(names) == 4
    order = sorted(range(len(names)), key=lambda i: names[i])  # the flat layout's order
    local = []
    for r in range(2):
        model = conv_pair(seed=0)
        grads = torch.autograd.grad(model(image(r)).sum(), list(model.parameters()))
        local.append(torch.cat([grads[i].reshape(-1).double() for i in order]))
    grad = exchanged(local, mode, _thresholds([v["threshold"] for v in results], mode))
    for v in results:
        assert v["names"] == names
        _close(torch.cat([torch.tensor(v["grads"][i]) for i in order]), grad)


@pytest.mark.parametrize("mode", MODES)
def test_optimizer_no_named_parameters(mode, backend):
    """Several parameter groups, no names: every parameter gets a unique name, the same on
    every rank, and a step keeps the ranks' models identical."""
    for v in [v["optimizer_no_named_parameters"] for v in _usage(mode, backend)]:
        assert len(v["names"]) == len(set(v["names"])) == v["num_params"] == 4
        assert all(names == v["everyone"][0] for names in v["everyone"])
        assert len(v["everyone"]) == 2
        assert v["same_on_all_ranks"]


@pytest.mark.parametrize("mode", MODES)
def test_duplicate_and_missing_names(mode, backend):
    """Duplicate parameter names, and names for part of the model only: ValueError. (hvm
    reports argument errors collectively: the same message on every rank.)"""
    results = [v["bad_names"] for v in _usage(mode, backend)]
    for case, word in (("duplicate", "unique"), ("missing", "not named")):
        for v in results:
            assert v[case] is not None and v[case]["type"] == "ValueError", (case, v[case])
            assert word in v[case]["message"]
        assert results[0][case]["message"] == results[1][case]["message"]


# ----- test_force_allreduce -----------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_force_allreduce(mode):
    """A parameter with no gradient on some rank is still exchanged (as zeros there), for
    every torch optimizer: one step gives the parameters the optimizer computes from the
    exchanged gradient, on every rank."""
    results = _launch("force_allreduce", mode=mode, density=DENSITY)
    local = _local(lambda: two_heads(seed=0), two_heads_loss, range(2))
    assert local[0].abs().sum() > 0 and local[1].abs().sum() > 0
    classes = dict(optimizer_classes())
    entries = list(zip(results[0], results[1]))
    assert len(entries) == len(classes) * len(OPTION_SETS)
    for first, second in entries:
        label = (first["optimizer"], first["options"])
        assert first["same_on_all_ranks"] and second["same_on_all_ranks"], label
        assert not first["fc3_had_grad"] and second["fc3_had_grad"]
        grad = exchanged(local, mode, _thresholds([first["threshold"], second["threshold"]],
                                                  mode))
        want = stepped_params(two_heads(seed=0), classes[first["optimizer"]],
                              OPTION_SETS[first["options"]], grad)
        try:
            _close(first["params"], want)
        except AssertionError as error:
            raise AssertionError(f"{label}: {error}") from None


# ----- test_compression_fp16 ------------------------------------------------------------------
def test_compression_fp16_is_horovods():
    """hvm.Compression.none/fp16 are Horovod's compressors: floating point goes to float16
    and back to its own dtype, integers pass unchanged."""
    assert hvm.Compression.fp16 is HorovodCompression.fp16
    assert hvm.Compression.none is HorovodCompression.none
    for dtype in (torch.float32, torch.float64):
        tensor = torch.full((5, 5, 5), 1.0, dtype=dtype)
        wire, ctx = hvm.Compression.fp16.compress(tensor)
        assert wire.dtype == torch.float16
        back = hvm.Compression.fp16.decompress(wire, ctx)
        assert back.dtype == dtype and torch.equal(back, tensor)
    for dtype in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64):
        tensor = torch.ones(5, 5, 5, dtype=dtype)
        wire, ctx = hvm.Compression.fp16.compress(tensor)
        assert wire.dtype == dtype
        back = hvm.Compression.fp16.decompress(wire, ctx)
        assert back.dtype == dtype and torch.equal(back, tensor)


def test_compression_fp16_in_the_optimizer():
    """float32 and float64 parameters, float16 on the wire (Horovod's fp16 compressor,
    MiCRO with fp16 values): gradients keep their dtypes and are the exchanged ones."""
    results = _launch("fp16_wire", density=DENSITY)
    local = _local(lambda: mixed_precision(seed=0), mixed_loss, range(2))
    model = mixed_precision(seed=0)
    dtypes = {n: str(p.dtype) for n, p in model.named_parameters()}
    assert "torch.float64" in dtypes.values() and "torch.float32" in dtypes.values()
    for mode, ref_mode in (("fp16", "fp16"), ("micro_fp16", "micro")):
        values = [v[mode] for v in results]
        grad = exchanged(local, ref_mode,
                         _thresholds([v["threshold"] for v in values], ref_mode))
        for v in values:
            assert v["dtypes"] == dtypes
            _close(v["grad"], grad, rtol=2e-3, atol=1e-4)
        assert grad.abs().sum() > 0


# ----- test_delta_optimizer ---------------------------------------------------------------
def _adasum(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    dot = torch.dot(a, b)
    return (1 - dot / (2 * torch.dot(a, a))) * a + (1 - dot / (2 * torch.dot(b, b))) * b


def test_delta_optimizer_adasum():
    """op=hvd.Adasum (MPI): Horovod's own delta optimizer, parameters moved by the Adasum
    of the ranks' steps, per tensor. With a sparse compressor: ValueError."""
    results = _launch("adasum", backend="mpi", density=DENSITY)

    def build():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return torch.nn.Sequential(torch.nn.Conv2d(1, 6, 1), torch.nn.Conv2d(6, 1, 1))

    initial = dict(build().named_parameters())
    grads = []
    for r in range(2):
        model = build()
        names = [n for n, _ in model.named_parameters()]
        values = torch.autograd.grad(model(image(r, side=12)).sum(), list(model.parameters()))
        grads.append(dict(zip(names, values)))
    for v in results:
        assert v["class_module"] == "horovod.torch.optimizer"
        for name, p0 in initial.items():
            deltas = [-0.1 * grads[r][name].reshape(-1).double() for r in range(2)]
            want = p0.detach().reshape(-1).double() + _adasum(*deltas)
            _close(v["params"][name], want, rtol=1e-4, atol=1e-6)
        assert v["sparse"]["type"] == "ValueError" and "Adasum" in v["sparse"]["message"]


# ----- test_optimizer_process_sets ----------------------------------------------------------
@pytest.mark.parametrize("np_", [2, 3])
def test_optimizer_process_sets(np_, backend):
    """Optimizers over the even and the odd ranks' process sets, built on every rank, and
    one over each rank's own set (on 3 ranks also one over {0, 1}, which overlaps the even
    set {0, 2}): members step on their set's exchange and agree, a rank outside a set steps on
    its own gradient, ranks in different sets differ."""
    results = _launch("process_sets", np=np_, backend=backend, timeout=120,
                      env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"}, modes=MODES,
                      density=DENSITY)
    local = _local(lambda: mlp(seed=0), mlp_loss, range(np_))
    even, odd = list(range(0, np_, 2)), list(range(1, np_, 2))
    fixed = {"even": even, "odd": odd}
    if np_ == 3:
        fixed["low"] = [0, 1]
    for mode in MODES:
        assert set(results[0][mode]) == {*fixed, "own"}
        for label in (*fixed, "own"):
            for r in range(np_):
                members = fixed.get(label, even if r % 2 == 0 else odd)
                got = results[r][mode][label]
                if r in members:
                    thresholds = [results[q][mode][label]["threshold"] for q in members]
                    grad = exchanged([local[q] for q in members], mode,
                                     _thresholds(thresholds, mode))
                else:
                    grad = local[r]
                want = stepped_params(mlp(seed=0), torch.optim.SGD, SGD_OPTIONS, grad)
                _close(got["params"], want)
                everyone = torch.tensor(got["everyone"], dtype=torch.float64)
                for q in range(np_):
                    same_set = q in members and r in members
                    if same_set or q == r:
                        assert torch.equal(everyone[q], everyone[r]), (mode, label, r, q)
                    else:
                        assert not torch.allclose(everyone[q], everyone[r]), (mode, label, r, q)


# ----- test_sparse_embeddings -------------------------------------------------------------
def _dense_embedding_grad(rank):
    model = embedding(seed=0)
    model(embedding_input(rank)).sum().backward()
    return model.weight.grad.to_dense().double()


def test_sparse_embeddings():
    """nn.Embedding(sparse=True) + SparseAdam on the dense path, sparse_as_dense False and
    True: the gradient is the ranks' average (sparse, as SparseAdam needs) and the step
    leaves identical embeddings on every rank."""
    results = _launch("sparse_embeddings", timeout=120, mode="dense", density=DENSITY)
    grad = (_dense_embedding_grad(0) + _dense_embedding_grad(1)) / 2
    model = embedding(seed=0)
    model.weight.grad = grad.float().to_sparse()
    torch.optim.SparseAdam(list(model.parameters()), lr=0.1).step()
    for key in ("False", "True"):
        for v in results:
            got = v[key]
            assert got["raised"] is None, got["raised"]
            _close(got["initial"], embedding(seed=0).weight.detach())
            assert got["is_sparse"]
            _close(got["grad"], grad)
            _close(got["weight"], model.weight.detach())
            assert got["same_on_all_ranks"]


def test_sparse_embeddings_rejected_by_sparse_compressor(backend):
    """With MiCRO a sparse gradient is refused collectively: every rank raises
    hvm.CollectiveInputError (with either sparse_as_dense) and nobody is left waiting."""
    results = _launch("sparse_embeddings", backend=backend, timeout=120, mode="micro",
                      density=DENSITY)
    for key in ("False", "True"):
        for v in results:
            raised = v[key]["raised"]
            assert raised is not None and raised["type"] == "CollectiveInputError", v[key]
            assert "sparse" in raised["message"]
        assert results[0][key]["raised"]["message"] == results[1][key]["raised"]["message"]
