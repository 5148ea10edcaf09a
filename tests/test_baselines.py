"""The baseline compressors on real ranks equal independent simulations.

Three launches (each costs seconds, so each runs many methods): 2 Gloo ranks (every
method and variant, build-up, NaN/Inf, argument errors on one rank raising on every rank),
3 MPI ranks (CLT-k's leader rotation and gTop-k's non-power-of-two tree on MPI), 5 Gloo
ranks (gTop-k's deeper uneven tree, CLT-k).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from multirank import run_ranks
from simulation import rank_gradient
from simulation_baselines import (
    fp16_round_trip,
    hard_threshold_from_density,
    identity,
    simulate_cltk,
    simulate_gtopk,
    simulate_randomk,
    simulate_threshold,
    simulate_topk,
)

import horovod_micro as hvm
from horovod_micro.compressors.randomk import shared_indices

NUMEL, ITERATIONS, SEED, DENSITY, VALUE = 600, 6, 3, 0.02, 0.03
K = math.floor(DENSITY * NUMEL)


def run(label, method, **kwargs):
    op = kwargs.pop("op", "average")
    return {"label": label, "method": method, "kwargs": kwargs, "op": op}


ALL_METHODS = [
    run("topk", "topk", density=DENSITY),
    run("cltk", "cltk", density=DENSITY),
    run("threshold", "threshold", value=VALUE),
    run("randomk", "randomk", density=DENSITY),
    run("gtopk", "gtopk", density=DENSITY),
]
VARIANTS = [
    run("topk_fp16", "topk", density=DENSITY, fp16_values=True),
    run("topk_sum", "topk", density=DENSITY, op="sum"),
    run("cltk_no_ef", "cltk", density=DENSITY, error_feedback=False),
    run("threshold_density", "threshold", density=DENSITY),
    run("threshold_no_ef", "threshold", value=VALUE, error_feedback=False),
    run("randomk_seed7", "randomk", density=DENSITY, seed=7, fp16_values=True),
    run("gtopk_fp16", "gtopk", density=DENSITY, fp16_values=True),
    run("gtopk_no_ef", "gtopk", density=DENSITY, error_feedback=False, op="sum"),
]


def ring_allgather(blocks, r):
    n = len(blocks)
    return sum(blocks) - blocks[(r + 1) % n], sum(blocks) - blocks[r]


def _wire_bytes(spec):
    return 2 if spec["kwargs"].get("fp16_values") else 4


def _allreduce(spec, n, union):
    return 2 * (n - 1) * _wire_bytes(spec) * union // n


def _gathered_pairs_bytes(spec, n, r, counts, union, want):
    """Top-k and the hard threshold: an index gather with a 3-word header, then the
    values gathered (ring model)."""
    s1, r1 = ring_allgather([4 * (c + 3) for c in counts], r)
    s2, r2 = ring_allgather([_wire_bytes(spec) * c for c in counts], r) if union else (0, 0)
    return s1 + s2, r1 + r2


def _leader_bytes(spec, n, r, counts, union, want):
    """CLT-k: the leader's index gather, then a value allreduce over the union."""
    s1, r1 = ring_allgather([4 * (c + 3) for c in counts], r)
    return s1 + _allreduce(spec, n, union), r1 + _allreduce(spec, n, union)


def _header_only_bytes(spec, n, r, counts, union, want):
    """Random-k: a header-only gather (every rank drew the same coordinates), then a
    value allreduce."""
    s1, r1 = ring_allgather([12] * n, r)
    return s1 + _allreduce(spec, n, union), r1 + _allreduce(spec, n, union)


def _simulated_tree_bytes(spec, n, r, counts, union, want):
    """gTop-k: the tree's bytes, counted by its simulation."""
    return want["bytes_sent"][r], want["bytes_received"][r]


def _randomk(grads, n, k, kw, **common):
    # The draw stays an input (a pseudo-random sequence cannot be restated without its
    # generator; test_two_gloo_ranks_every_method_equals_simulation checks that it is k
    # distinct coordinates, new each step and per seed, the same on every rank): what the
    # exchange does with it is under test.
    numel = grads[0][0].numel()
    drawn = [shared_indices(numel, k, kw.get("seed", 0), t) for t in range(len(grads))]
    return simulate_randomk(grads, n, drawn, **common)


@dataclass(frozen=True)
class Baseline:
    """What the tests know of one built-in baseline, independently of the library: its
    simulation (``simulate(grads, n, k, kwargs, **common)``), how many coordinates each
    rank selects (``counts(simulated_selections, n, t)``), its bytes per rank
    (``bytes(spec, n, r, counts, union, want)``, the ring and direct models of the
    docstrings), and whether float16 values are summed on the wire (an allreduce, in
    float16) rather than gathered and summed in float32. A new built-in method is one
    library file plus one entry in :data:`BASELINES`."""

    simulate: Callable
    counts: Callable
    bytes: Callable
    sums_on_wire: bool = False


def _own_counts(selections, n, t):
    return [len(s) for s in selections]


BASELINES = {
    "topk": Baseline(lambda grads, n, k, kw, **c: simulate_topk(grads, n, k, **c),
                     _own_counts, _gathered_pairs_bytes),
    "threshold": Baseline(
        lambda grads, n, k, kw, **c: simulate_threshold(
            grads, n, kw.get("value") or hard_threshold_from_density(
                kw["density"], grads[0][0].numel()), **c),
        _own_counts, _gathered_pairs_bytes),
    "cltk": Baseline(lambda grads, n, k, kw, **c: simulate_cltk(grads, n, k, **c),
                     lambda selections, n, t: [K if q == t % n else 0 for q in range(n)],
                     _leader_bytes, sums_on_wire=True),
    "randomk": Baseline(_randomk, lambda selections, n, t: [K] * n, _header_only_bytes,
                        sums_on_wire=True),
    "gtopk": Baseline(
        lambda grads, n, k, kw, **c: simulate_gtopk(
            grads, n, k, value_bytes=2 if kw.get("fp16_values") else 4, **c),
        lambda selections, n, t: [K] * n, _simulated_tree_bytes),
}


def common_arguments(spec) -> dict:
    """The simulation's arguments that every method takes, from ``spec``."""
    kw = spec["kwargs"]
    return {"average": spec["op"] == "average", "error_feedback": kw.get("error_feedback", True),
            "wire": fp16_round_trip if kw.get("fp16_values") else identity}


def simulate(spec, n, grads, traces=None, density=DENSITY):
    """The independent reference of ``spec``'s baseline over ``grads[t][r]``."""
    kw = spec["kwargs"]
    k = math.floor(kw.get("density", density) * grads[0][0].numel())
    return BASELINES[spec["method"]].simulate(grads, n, k, kw, **common_arguments(spec))


def expected_bytes(spec, n, r, counts, union, want):
    """(sent, received) of rank r under the ring / direct models of the docstrings."""
    return BASELINES[spec["method"]].bytes(spec, n, r, counts, union, want)


def check_traces(results, specs, n, skew=0.0):
    """Every rank's exchanged gradient, residual and statistics equal the simulation's."""
    grads = [[rank_gradient(r, t, NUMEL, SEED, skew) for r in range(n)]
             for t in range(ITERATIONS)]
    sims = {}
    for spec in specs:
        label = spec["label"]
        traces = [res.value["traces"][label] for res in results]
        want = simulate(spec, n, grads, traces)
        sims[label] = want
        # Allreduce-based methods sum float16 values in float16 (Horovod's op), the
        # simulation in float32; gather-based ones sum in float32 on both sides.
        loose = spec["kwargs"].get("fp16_values") and BASELINES[spec["method"]].sums_on_wire
        rtol, atol = (2e-3, 1e-5) if loose else (1e-5, 1e-7)
        for t in range(ITERATIONS):
            w = want[t]
            union = int(torch.count_nonzero(w["grad"]))
            for r in range(n):
                got = traces[r][t]
                context = (label, t, r)
                g = torch.tensor(got["grad"])
                assert set(torch.nonzero(g).view(-1).tolist()) == set(
                    torch.nonzero(w["grad"]).view(-1).tolist()), context
                torch.testing.assert_close(g, w["grad"], rtol=rtol, atol=atol, msg=str(context))
                torch.testing.assert_close(torch.tensor(got["residual"]), w["residual"][r],
                                           rtol=1e-5, atol=1e-7, msg=str(context))
                assert got["residual_norm"] == pytest.approx(
                    float(w["residual"][r].norm()), rel=1e-4, abs=1e-6), context
                assert got["global_count"] == union, context
                assert got["density"] == union / NUMEL, context
                counts = got["rank_counts"]
                assert counts == BASELINES[spec["method"]].counts(
                    w.get("selections"), n, t), context
                assert (got["bytes_sent"], got["bytes_received"]) == expected_bytes(
                    spec, n, r, counts, union, w), context
                assert got["comm_time"] > 0 and got["select_time"] >= 0, context
                assert got["method"] == spec["method"]
    return sims


def test_two_gloo_ranks_every_method_equals_simulation():
    results = run_ranks("ranks_baselines:suite", np=2, backend="gloo", kwargs={
        "traces_args": {"runs": ALL_METHODS + VARIANTS, "numel": NUMEL,
                        "iterations": ITERATIONS, "seed": SEED},
        "buildup_args": {"methods": ["topk", "threshold", "micro"], "numel": 2000,
                         "density": 0.01, "iterations": 8},
        "nonfinite_args": {"methods": ["topk", "cltk", "threshold", "randomk", "gtopk"],
                           "numel": 300, "bad_rank": 1, "bad_iteration": 2,
                           "iterations": 4},
        "argument_errors": True,
    })
    check_traces(results, ALL_METHODS + VARIANTS, 2)
    check_argument_errors(results)
    traces = results[0].value["traces"]

    # Statistics that only some methods have.
    th = traces["threshold_density"][0]
    assert th["threshold"] == pytest.approx(hard_threshold_from_density(DENSITY, NUMEL))
    assert th["target_density"] == DENSITY and th["target_count"] == K
    fixed = traces["threshold"][0]
    assert fixed["threshold"] == VALUE and fixed["target_density"] is None
    assert all(t["residual_norm"] == 0.0 for t in traces["cltk_no_ef"])
    assert all(t["threshold"] is None for t in traces["topk"])

    # Random-k: k distinct coordinates per iteration, new ones each iteration and per seed.
    drawn = {label: [frozenset(torch.nonzero(torch.tensor(t["grad"])).view(-1).tolist())
                     for t in traces[label]] for label in ("randomk", "randomk_seed7")}
    for sets in drawn.values():
        assert all(len(s) == K for s in sets) and len(set(sets)) == ITERATIONS
    assert drawn["randomk"][0] != drawn["randomk_seed7"][0]

    # Build-up: with disjoint per-rank top-k sets, Top-k and hard threshold exchange
    # n k coordinates (twice the user-set density); MiCRO's exclusive parts keep k.
    for res in results:
        build = res.value["buildup"]
        assert all(d == pytest.approx(2 * 0.01) for d in build["topk"]), build["topk"]
        assert all(d == pytest.approx(2 * 0.01) for d in build["threshold"])
        assert max(build["micro"]) <= 0.01 * 1.05, build["micro"]

    # NaN/Inf on one rank at one step: every rank sees it then (as NaN), residuals stay
    # finite, later steps are normal.
    for res in results:
        for method, records in res.value["nonfinite"].items():
            for t, rec in enumerate(records):
                bad = t == 2
                assert rec["stats_nonfinite"] == bad, (method, t)
                assert rec["all_nan"] == bad and rec["any_nonfinite"] == bad, (method, t)
                assert rec["residual_finite"], (method, t)


def reentries(history, n):
    """How often a final coordinate that a rank selected locally holds no value of that
    rank (dropped in its subtree, re-entered from another): the case exact error feedback
    exists for (Shi et al.'s rule, local top-k ∩ global top-k, would zero it anyway)."""
    return sum(len(set(h["final"]) & set(h["local"][r]) - set(h["contributed"][r]))
               for h in history for r in range(n))


# MPI ranks busy-poll by default; oversubscribed on a small machine they starve each other.
MPI_ENV = {"OMPI_MCA_mpi_yield_when_idle": "1"}


def test_three_mpi_ranks_leader_rotation_and_uneven_tree():
    specs = [run("gtopk", "gtopk", density=DENSITY), run("cltk", "cltk", density=DENSITY)]
    results = run_ranks("ranks_baselines:suite", np=3, backend="mpi", env=MPI_ENV, kwargs={
        "traces_args": {"runs": specs, "numel": NUMEL, "iterations": ITERATIONS,
                        "seed": SEED, "skew": 3.0}})
    sims = check_traces(results, specs, 3, skew=3.0)
    assert reentries(sims["gtopk"], 3) > 0


def test_five_gloo_ranks_gtopk_tree_and_cltk():
    specs = [run("gtopk", "gtopk", density=DENSITY), run("cltk", "cltk", density=DENSITY),
             run("gtopk_fp16", "gtopk", density=DENSITY, fp16_values=True)]
    results = run_ranks("ranks_baselines:suite", np=5, backend="gloo", kwargs={
        "traces_args": {"runs": specs, "numel": NUMEL, "iterations": ITERATIONS,
                        "seed": SEED, "skew": 3.0}})
    sims = check_traces(results, specs, 5, skew=3.0)
    assert reentries(sims["gtopk"], 5) > 0


def check_argument_errors(results):
    """Mistakes made on one rank only raise the same error on every rank."""
    for res in results:
        caught = res.value["argument_errors"]
        assert "rank 1: gtopk: density must be a number in (0, 1], got 2.0" in caught[
            "bad_density"]
        assert "rank 1: compression" in caught["seed_mismatch"]
        assert "'seed': 1" in caught["seed_mismatch"]
        assert "rank 0: threshold: give exactly one of value" in caught["threshold_both"]


@pytest.mark.parametrize("factory,kwargs,message", [
    ("topk", {"density": 0.0}, "topk: density must be a number in (0, 1]"),
    ("topk", {"density": 1.5}, "topk: density must be a number in (0, 1]"),
    ("cltk", {"density": "0.1"}, "cltk: density must be a number in (0, 1]"),
    ("cltk", {"density": math.nan}, "cltk: density must be a number in (0, 1]"),
    ("gtopk", {"density": -0.1}, "gtopk: density must be a number in (0, 1]"),
    ("gtopk", {"density": True}, "gtopk: density must be a number in (0, 1]"),
    ("randomk", {"density": 2}, "randomk: density must be a number in (0, 1]"),
    ("randomk", {"density": 0.1, "seed": -1}, "randomk: seed must be a non-negative int"),
    ("randomk", {"density": 0.1, "seed": 1.5}, "randomk: seed must be a non-negative int"),
    ("threshold", {}, "threshold: give exactly one of value"),
    ("threshold", {"value": 0.1, "density": 0.1}, "threshold: give exactly one of value"),
    ("threshold", {"value": 0.0}, "threshold: value must be a positive finite number"),
    ("threshold", {"value": math.inf}, "threshold: value must be a positive finite number"),
    ("threshold", {"density": 0.0}, "threshold: density must be a number in (0, 1]"),
])
def test_factory_rejects_bad_arguments_at_once(factory, kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("]", r"\]")):
        getattr(hvm.Compression, factory)(**kwargs)


@pytest.mark.parametrize("factory,kwargs", [
    ("topk", {"density": 0.01}), ("cltk", {"density": 0.01}), ("gtopk", {"density": 0.01}),
    ("randomk", {"density": 0.01, "seed": 3}), ("threshold", {"value": 0.1}),
    ("threshold", {"density": 0.01}),
])
def test_factories_return_fresh_compressors(factory, kwargs):
    a = getattr(hvm.Compression, factory)(**kwargs, error_feedback=False, fp16_values=True)
    b = getattr(hvm.Compression, factory)(**kwargs)
    assert isinstance(a, hvm.Compressor) and a is not b
    assert a.config()["method"] == factory and a.config_error() is None
    assert not a.error_feedback and a.fp16_values and b.error_feedback


def test_shared_indices_are_distinct_uniform_and_cheap():
    for numel, k in [(50, 10), (50, 40), (1000, 1), (7, 7)]:
        for it in range(5):
            idx = shared_indices(numel, k, 0, it)
            assert idx.numel() == k and idx.unique().numel() == k
            assert 0 <= int(idx.min()) and int(idx.max()) < numel
            assert torch.equal(idx, shared_indices(numel, k, 0, it))  # same on every rank
    # Every coordinate about equally often (expected 400 each; 6 sigma is about 110).
    hits = torch.zeros(50)
    for it in range(2000):
        hits[shared_indices(50, 10, 1, it)] += 1
    assert (hits - 400).abs().max() < 110, hits
    # ResNet-18-sized gradient at density 0.001: no permutation of 11M elements.
    start = time.perf_counter()
    idx = shared_indices(11_173_962, 11_173, 0, 0)
    assert idx.unique().numel() == 11_173
    assert time.perf_counter() - start < 0.5
