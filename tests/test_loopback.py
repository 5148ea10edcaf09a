"""Every registered method on n in-process ranks (horovod_micro.testing.loopback) equals the same
independent simulations the multi-rank tests use: a compressor's unit tests in
milliseconds, no horovodrun. (The real multi-rank tests stay: tests/test_baselines.py,
tests/test_micro_exchange.py.)"""

import math
from types import SimpleNamespace

import horovod.torch as hvd
import pytest
import torch
from ranks_baselines import _record
from simulation import BoundedRule, rank_gradient, simulate_micro, simulate_micro_ahead
from test_baselines import ALL_METHODS, ITERATIONS, NUMEL, SEED, VARIANTS, check_traces

import horovod_micro as hvm
from horovod_micro.compressors import registry
from horovod_micro.compressors.base import ReduceOp
from horovod_micro.layout import FlatLayout
from horovod_micro.reducer import SparseReducer
from horovod_micro.testing.loopback import LoopbackGroup

SPECS = {spec["label"]: spec for spec in ALL_METHODS + VARIANTS}


def loopback_traces(n, method, kwargs, op="average", iterations=ITERATIONS, device="cpu"):
    """Per rank: the exchanged gradient, residual and statistics of each iteration, with
    the parameter, its gradients and so the reducer's buffers on ``device``
    (gpu_tests/ runs this on CUDA)."""

    def rank_body(comm):
        compression = getattr(hvm.Compression, method)(**kwargs)
        param = torch.nn.Parameter(torch.zeros(NUMEL, device=device))
        reducer = SparseReducer(FlatLayout([("flat", param)]), compression, comm,
                                ReduceOp(hvd.Average if op == "average" else hvd.Sum))
        out = []
        for t in range(iterations):
            param.grad = rank_gradient(comm.rank, t, NUMEL, SEED).to(device)
            stats = reducer.reduce()
            buffers = {param.grad.device, reducer.residual.device, reducer.output.device}
            assert buffers == {param.device}, buffers
            out.append(_record(param.grad, stats, reducer.residual))
        return out

    return LoopbackGroup(n).run(rank_body)


def test_specs_cover_every_registered_method():
    assert {s["method"] for s in SPECS.values()} | {"micro", "micro_ahead", "powersgd"} == set(
        registry.names())


def check_baseline(label, n, device="cpu"):
    """Method ``label`` on n loopback ranks equals its simulation (computed on the CPU)."""
    spec = SPECS[label]
    per_rank = loopback_traces(n, spec["method"], spec["kwargs"], spec["op"], device=device)
    results = [SimpleNamespace(value={"traces": {label: trace}}) for trace in per_rank]
    check_traces(results, [spec], n)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("label", sorted(SPECS))
def test_baseline_on_loopback_ranks_equals_simulation(label, n):
    check_baseline(label, n)


@pytest.mark.parametrize("controller", ["bounded", "newton", "paper", "scale"])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_micro_on_loopback_ranks_equals_simulation(n, controller):
    check_micro(n, controller)


@pytest.mark.parametrize("controller", ["bounded", "scale"])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_micro_magnitude_judge_on_loopback_ranks_equals_simulation(n, controller):
    check_micro(n, controller, judge="magnitude")


@pytest.mark.parametrize("n", [8])
def test_micro_drift_judge_at_eight_ranks_equals_simulation(n):
    check_micro(n, "bounded")


def check_micro(n, controller, device="cpu", judge=None):
    """MiCRO with ``controller`` (and ``judge``; None: the controller's default) on n
    loopback ranks equals simulate_micro (on the CPU)."""
    kwargs = {"density": 0.02, "controller": controller}
    if judge is not None:
        kwargs["judge"] = judge
    judge = hvm.Compression.micro(**kwargs).judge
    per_rank = loopback_traces(n, "micro", kwargs, device=device)
    grads = [[rank_gradient(r, t, NUMEL, SEED) for r in range(n)] for t in range(ITERATIONS)]
    common = {"judge": judge, "density": 0.02}
    if controller == "bounded":  # the simulation decides the thresholds from the rule
        sim = simulate_micro(grads, BoundedRule(0.02, NUMEL, n), n, **common)
        thresholds = [step["thresholds"] for step in sim]
        for r, trace in enumerate(per_rank):
            assert [s["threshold"] for s in trace] == pytest.approx(
                [step[r] for step in thresholds], rel=1e-5)
    else:  # the ranks' reported thresholds; shared ones are identical on every rank
        thresholds = [[trace[t]["threshold"] for trace in per_rank] for t in range(ITERATIONS)]
        if controller != "scale":
            assert all(len(set(step)) == 1 for step in thresholds)
        sim = simulate_micro(grads, thresholds, n, **common)
    for r, trace in enumerate(per_rank):
        for t, step in enumerate(trace):
            torch.testing.assert_close(torch.tensor(step["grad"]), sim[t]["grad"])
            torch.testing.assert_close(torch.tensor(step["residual"]), sim[t]["residual"][r])
            assert step["rank_counts"] == [len(s) for s in sim[t]["selections"]]


@pytest.mark.parametrize("n,op,capacity", [(2, "average", None), (4, "sum", None),
                                           (5, "average", None), (6, "average", None),
                                           (7, "sum", None), (3, "average", 2)])
def test_micro_ahead_on_loopback_ranks_equals_simulation(n, op, capacity):
    """The coordinates agreed a step ahead, at worker counts on and off the powers of two
    and with either op, against simulate_micro_ahead; with 2 slots per rank every choice
    overflows and keeps its highest drift scores."""
    kwargs = {"density": 0.02} if capacity is None else {"density": 0.02, "capacity": capacity}
    iterations = ITERATIONS if capacity is None else 3 * ITERATIONS  # ages spread out
    per_rank = loopback_traces(n, "micro_ahead", kwargs, op=op, iterations=iterations)
    grads = [[rank_gradient(r, t, NUMEL, SEED) for r in range(n)] for t in range(iterations)]
    slots = capacity or math.ceil(1.2 * int(0.02 * NUMEL) / n)
    sim = simulate_micro_ahead(grads, BoundedRule(0.02, NUMEL, n), n, guess=2.0,
                               capacity=slots, average=op == "average")
    for r, trace in enumerate(per_rank):
        for t, step in enumerate(trace):
            torch.testing.assert_close(torch.tensor(step["grad"]), sim[t]["grad"])
            torch.testing.assert_close(torch.tensor(step["residual"]), sim[t]["residual"][r])
            assert step["rank_counts"] == [len(s) for s in sim[t]["selections"]]
    assert sum(len(step["applied"]) for step in sim) > 0
    if capacity is not None:  # every choice was cut to the slots
        assert all(sum(step["picked"]) > n * capacity for step in sim)


def test_a_failing_rank_fails_the_group_instead_of_hanging():
    def body(comm):
        if comm.rank == 1:
            raise ValueError("rank 1 is broken")
        return comm.allgather(torch.ones(2), "x")

    with pytest.raises(ValueError, match="rank 1 is broken"):
        LoopbackGroup(3, timeout=30).run(body)


def test_loopback_collectives_follow_horovods_semantics():
    def body(comm):
        r = comm.rank
        gathered = comm.allgather(torch.full((r + 1,), float(r)), "g")
        averaged = comm.allreduce_(torch.tensor([1.0, 2.0]) * (r + 1), "a", hvd.Average,
                                   0.5, 3.0)
        summed = comm.allreduce_(torch.tensor([float(r)]), "s", hvd.Sum, 1.0, 1.0)
        out, counts = comm.alltoall(torch.arange(3.0) + 10 * r, [1, 2, 0][: comm.size], "t")
        return gathered.tolist(), averaged.tolist(), summed.tolist(), out.tolist(), counts

    got = LoopbackGroup(2).run(body)
    assert got[0][0] == got[1][0] == [0.0, 1.0, 1.0]
    assert got[0][1] == [3 * 0.5 * 3 / 2, 3 * 0.5 * 6 / 2]  # postscale * sum(pre * x) / n
    assert got[0][2] == got[1][2] == [1.0]
    assert got[0][3] == [0.0, 10.0] and got[0][4] == [1, 1]
    assert got[1][3] == [1.0, 2.0, 11.0, 12.0] and got[1][4] == [2, 2]


def test_reducer_synchronises_at_every_phase_boundary_when_asked(monkeypatch):
    """``SparseReducer.phase_sync`` (``HOROVOD_MICRO_SYNC_PHASES=1`` on a GPU) is called
    once before the step and once at the end of each phase the step times; by default it
    is off (no extra host synchronisation in training), and a CPU never needs it."""
    from horovod_micro.stats import SYNC_PHASES_ENV, phase_sync

    assert phase_sync(torch.device("cpu")) is None
    monkeypatch.setenv(SYNC_PHASES_ENV, "1")
    assert phase_sync(torch.device("cpu")) is None
    assert phase_sync(torch.device("cuda", 0)) is torch.cuda.synchronize
    monkeypatch.delenv(SYNC_PHASES_ENV)
    assert phase_sync(torch.device("cuda", 0)) is None

    def body(comm):
        param = torch.nn.Parameter(torch.zeros(NUMEL))
        reducer = SparseReducer(FlatLayout([("flat", param)]), hvm.Compression.micro(0.02),
                                comm, ReduceOp(hvd.Average))
        assert reducer.phase_sync is None
        calls = []
        reducer.phase_sync = lambda: calls.append(1)
        param.grad = rank_gradient(comm.rank, 0, NUMEL, SEED)
        stats = reducer.reduce()
        return len(calls), [p for p in stats.phases if p not in ("indices", "values")]

    for calls, laps in LoopbackGroup(2).run(body):
        assert laps == ["accumulate", "status", "select", "exchange_local", "update",
                        "write_back"]
        assert calls == 1 + len(laps)


def test_a_checkpoint_from_before_the_compressor_rename_loads():
    """Optimizer states saved when the base class was ``Sparsifier`` keep the compressor's
    state under ``"sparsifier"``: it loads into the compressor, as under the new key."""

    def body(comm):
        def reducer():
            param = torch.nn.Parameter(torch.zeros(NUMEL))
            return param, SparseReducer(FlatLayout([("flat", param)]),
                                        hvm.Compression.micro(0.02), comm,
                                        ReduceOp(hvd.Average))

        (param, saved), (_, old), (_, new) = reducer(), reducer(), reducer()
        for t in range(3):
            param.grad = rank_gradient(comm.rank, t, NUMEL, SEED)
            saved.reduce()
        state = saved.state_dict()
        legacy = {("sparsifier" if k == "compressor" else k): v for k, v in state.items()}
        old.load_state_dict(legacy)
        new.load_state_dict(state)
        return (repr(saved.compressor.state_dict()), repr(old.compressor.state_dict()),
                repr(new.compressor.state_dict()), old.iteration)

    for saved, old, new, iteration in LoopbackGroup(2).run(body):
        assert old == saved == new
        assert iteration == 3
        assert "controller" in saved


def test_micro_without_error_feedback_reaches_every_coordinate():
    """``micro(0.01, error_feedback=False)`` on 8 loopback ranks, Gaussian gradients, 400
    steps (each coordinate is owned 50 times): the coordinates ever applied. Without a
    residual the default judge is the magnitude (an age would favour the coordinates sent
    the step before: 10 % reached); the drift judge is refused there."""
    numel, steps = 10_240, 400

    def rank_body(comm):
        compression = hvm.Compression.micro(density=0.01, error_feedback=False)
        assert compression.judge == "magnitude"
        param = torch.nn.Parameter(torch.zeros(numel))
        reducer = SparseReducer(FlatLayout([("flat", param)]), compression, comm,
                                ReduceOp(hvd.Average))
        gen = torch.Generator().manual_seed(1000 + comm.rank)
        reached = torch.zeros(numel, dtype=torch.bool)
        for _ in range(steps):
            param.grad = torch.randn(numel, generator=gen)
            reducer.reduce()
            reached |= param.grad != 0
        return float(reached.double().mean())

    shares = LoopbackGroup(8).run(rank_body)
    assert len(set(shares)) == 1 and shares[0] >= 0.9, shares
    with pytest.raises(ValueError, match="judge='drift' needs error feedback"):
        hvm.Compression.micro(density=0.01, error_feedback=False, judge="drift")


def test_micro_ahead_skipped_step_keeps_the_agreed_coordinates():
    """A NaN on one rank skips the step on every rank; nothing of it is adopted: the ages
    restarted early by the selection are given back, and the next step applies the union
    the skipped one would have applied."""
    skip = 3

    def rank_body(comm):
        compression = hvm.Compression.micro_ahead(density=0.02)
        param = torch.nn.Parameter(torch.zeros(NUMEL))
        reducer = SparseReducer(FlatLayout([("flat", param)]), compression, comm,
                                ReduceOp(hvd.Average))
        out = {}
        for t in range(skip + 2):
            grad = rank_gradient(comm.rank, t, NUMEL, SEED)
            if t == skip and comm.rank == 1:
                grad[7] = math.nan
            param.grad = grad
            if t == skip:
                out["agreed"] = compression.union.flat.tolist()
                before = compression.state_dict()["last"]
            stats = reducer.reduce()
            if t == skip:
                out["skipped"] = stats.nonfinite and bool(param.grad.isnan().all())
                out["ages_given_back"] = torch.equal(compression.state_dict()["last"], before)
            if t == skip + 1:
                out["applied"] = torch.nonzero(param.grad).view(-1).tolist()
        return out

    for got in LoopbackGroup(2).run(rank_body):
        assert got["skipped"] and got["ages_given_back"]
        assert got["agreed"] and set(got["applied"]) <= set(got["agreed"])
        assert len(got["applied"]) >= len(got["agreed"]) - 1  # a sum may be exactly 0
