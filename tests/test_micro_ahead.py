"""``micro_ahead`` on real ranks equals an independent simulation of n workers: the union a
step applies was agreed a step before, one allreduce carries values, next positions and
the header, and the judge adds the gradient as its guess under SGD."""

import math

import pytest
import torch
from multirank import run_ranks
from simulation import BoundedRule, rank_gradient, simulate_micro_ahead


@pytest.mark.parametrize("np_,backend,skew", [(2, "gloo", 0.0), (3, "mpi", 3.0),
                                              (5, "gloo", 3.0)])
def test_exchange_equals_simulation(np_, backend, skew):
    numel, iterations, seed, density = 1003, 8, 11, 0.02
    results = run_ranks("ranks_micro:exchange_trace", np=np_, backend=backend,
                        kwargs={"numel": numel, "iterations": iterations, "density": density,
                                "seed": seed, "skew": skew, "method": "micro_ahead"})
    traces = [r.value for r in results]
    slots = math.ceil(1.2 * int(density * numel) / np_)
    assert {step["slots"] for trace in traces for step in trace} == {slots}
    for t in range(iterations):  # the controller's state is the same on every rank
        assert len({repr(trace[t]["controller"]) for trace in traces}) == 1, t
    grads = [[rank_gradient(r, t, numel, seed, skew) for r in range(np_)]
             for t in range(iterations)]
    sim = simulate_micro_ahead(grads, BoundedRule(density, numel, np_), np_, guess=2.0,
                               capacity=slots)
    # One ring allreduce of n rows of (2 slots + 5) float32 words, and nothing else.
    moved = 2 * (np_ - 1) * 4 * np_ * (2 * slots + 5) // np_
    for r, trace in enumerate(traces):
        for t, (step, want) in enumerate(zip(trace, sim)):
            assert step["bytes_sent"] == step["bytes_received"] == moved
            assert step["global_count"] == len(want["applied"]), (t, r)
            assert step["threshold"] == pytest.approx(want["thresholds"][r], rel=1e-5)
            assert step["selected_counts"] == want["picked"], (t, r)
            assert step["rank_counts"] == [len(s) for s in want["selections"]], (t, r)
            got = torch.tensor(step["grad"])
            assert set(torch.nonzero(got).view(-1).tolist()) == set(
                torch.nonzero(want["grad"]).view(-1).tolist()), (t, r)
            torch.testing.assert_close(got, want["grad"], rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(torch.tensor(step["residual"]), want["residual"][r],
                                       rtol=1e-5, atol=1e-7)
    assert sim[0]["applied"].numel() == 0  # the first step applies nothing
    assert all(len(s["applied"]) >= int(density * numel) // 2 for s in sim[2:])


def test_without_the_guess_equals_simulation():
    """``guess=0``: the residual alone ranks the next coordinates (Adam's family)."""
    numel, iterations, seed, density, np_ = 1003, 6, 5, 0.02, 2
    results = run_ranks("ranks_micro:exchange_trace", np=np_, backend="mpi",
                        kwargs={"numel": numel, "iterations": iterations, "density": density,
                                "seed": seed, "method": "micro_ahead", "guess": 0.0})
    grads = [[rank_gradient(r, t, numel, seed) for r in range(np_)] for t in range(iterations)]
    slots = math.ceil(1.2 * int(density * numel) / np_)
    sim = simulate_micro_ahead(grads, BoundedRule(density, numel, np_), np_, guess=0.0,
                               capacity=slots)
    for r, result in enumerate(results):
        for step, want in zip(result.value, sim):
            torch.testing.assert_close(torch.tensor(step["grad"]), want["grad"], rtol=1e-5,
                                       atol=1e-7)
            assert step["selected_counts"] == want["picked"]
            torch.testing.assert_close(torch.tensor(step["residual"]), want["residual"][r],
                                       rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_a_resumed_run_applies_the_agreed_coordinates(backend):
    """A state saved between steps holds the union agreed for the next step: the resumed
    run's first step applies exactly what the run straight through applied (the same
    coordinates and values). The guess needs ``g_t``, which no state holds, so the
    resumed run's next choice may differ; every step stays finite. The judge's weight is
    2 under SGD and 0 under AdamW."""
    numel, iterations, resume_at = 601, 7, 4
    results = run_ranks("ranks_micro:ahead_resume", np=3, backend=backend,
                        kwargs={"numel": numel, "iterations": iterations,
                                "resume_at": resume_at})
    for result in results:
        got = result.value
        assert got["union_saved"] > 0
        assert got["weights"] == [2.0, 0.0]
        straight, resumed = got["straight"], got["resumed"]
        assert len(resumed) == iterations - resume_at
        first = torch.tensor(resumed[0])
        assert torch.count_nonzero(first) == got["union_saved"]
        assert torch.equal(first, torch.tensor(straight[resume_at]))
        assert all(math.isfinite(v) for step in resumed for v in step)
