"""MiCRO's exchange on real ranks equals an independent simulation of n workers."""

import math

import pytest
import torch
from multirank import run_ranks
from simulation import (
    BoundedRule,
    NewtonRule,
    contiguous_parts,
    fp16_round_trip,
    identity,
    rank_gradient,
    simulate_micro,
)


def _check_against_simulation(results, n, numel, iterations, seed, skew, average=True,
                              error_feedback=True, rtol=1e-5, atol=1e-7, wire=identity,
                              plateau=0.0, rule=None, judge="drift", capacity=None):
    """The default controller: the simulation decides every rank's threshold itself from
    the rule's definition (simulation.BoundedRule); the ranks' thresholds must match it."""
    traces = [r.value for r in results]
    if capacity is None:  # the sizes the ranks' exchange ran with (None: exact)
        capacity = traces[0][0].get("slots")
    # The controller's state is identical on every rank, bit for bit, every iteration.
    for t in range(iterations):
        assert len({repr(trace[t]["controller"]) for trace in traces}) == 1, t
    grads = [[rank_gradient(r, t, numel, seed, skew, plateau=plateau) for r in range(n)]
             for t in range(iterations)]
    sim = simulate_micro(grads, rule or BoundedRule(0.02, numel, n), n, average=average,
                         error_feedback=error_feedback, wire=wire, judge=judge,
                         capacity=capacity)
    for t in range(iterations):
        for r in range(n):
            assert traces[r][t]["threshold"] == pytest.approx(sim[t]["thresholds"][r],
                                                              rel=1e-5), (t, r)
    parts = contiguous_parts(numel, n)
    for t in range(iterations):
        want = sim[t]
        owned = [set(range(*parts[(t + r) % n])) for r in range(n)]
        for r in range(n):
            # Rank r selected only in the part it owns this iteration; parts are disjoint.
            assert set(want["selections"][r].tolist()) <= owned[r]
            # What each rank's threshold picked (the controller learns from it), and
            # what it sent (less where the capacity cut).
            assert traces[r][t]["selected_counts"] == want["picked"]
            assert traces[r][t]["rank_counts"] == [len(s) for s in want["selections"]]
            got = torch.tensor(traces[r][t]["grad"])
            nz_got = set(torch.nonzero(got).view(-1).tolist())
            nz_want = set(torch.nonzero(want["grad"]).view(-1).tolist())
            assert nz_got == nz_want, (t, r)
            torch.testing.assert_close(got, want["grad"], rtol=rtol, atol=atol)
            torch.testing.assert_close(torch.tensor(traces[r][t]["residual"]),
                                       want["residual"][r], rtol=1e-5, atol=1e-7)
        union = sum(len(s) for s in want["selections"])
        assert traces[0][t]["global_count"] == union
    return traces


def test_newton_controller_equals_simulation():
    """controller="newton": one shared threshold, the Newton controller's response to the
    global counts and the slope probe."""
    n, numel, iterations, seed = 2, 1003, 7, 11
    results = run_ranks("ranks_micro:exchange_trace", np=n,
                        kwargs={"numel": numel, "iterations": iterations, "density": 0.02,
                                "seed": seed, "controller": "newton"})
    traces = [r.value for r in results]
    for t in range(iterations):
        assert len({trace[t]["threshold_hex"] for trace in traces}) == 1, t
    thresholds = [traces[0][t]["threshold"] for t in range(iterations)]
    grads = [[rank_gradient(r, t, numel, seed) for r in range(n)] for t in range(iterations)]
    sim = simulate_micro(grads, thresholds, n)
    for t in range(iterations):
        assert traces[0][t]["rank_counts"] == [len(s) for s in sim[t]["selections"]]
    # The thresholds the ranks used, from the rule's plain statement and the counts the
    # simulation found at them.
    rule = NewtonRule(int(0.02 * numel))
    for t in range(iterations - 1):
        assert rule.threshold == pytest.approx(thresholds[t], rel=1e-12), t
        rule.update(sum(len(s) for s in sim[t]["selections"]), sim[t]["above_probe"])


#: What a GPU runs, on the CPU: the choice made on the device (no host read), with the
#: host rule where it cannot decide (its report RESELECT, and a second index gather).
TORCH_PATH = {"HOROVOD_MICRO_SELECT": "torch"}


def _regathers(trace: list[dict], block: int, single: int) -> int:
    """Steps of ``trace`` whose index gather ran twice (a rank reselected by the host
    rule); each step's bytes are the single gather's or one ``block`` gather more."""
    extra = [step["bytes_sent"] - single for step in trace]
    assert set(extra) <= {0, block}, extra
    assert [step["bytes_received"] - single for step in trace] == extra
    return extra.count(block)


@pytest.mark.parametrize("np_,backend,skew,path", [(2, "gloo", 0.0, "native"),
                                                   (2, "mpi", 3.0, "native"),
                                                   (3, "gloo", 3.0, "native"),
                                                   (3, "mpi", 3.0, "torch")])
def test_exchange_equals_simulation(np_, backend, skew, path):
    """The default: index slots of one fixed size per rank, ceil(1.2 k / n). On the torch
    path (a GPU's) the choice is made on the device, downward passes included (the first
    steps' base threshold is far too high), with no second gather."""
    numel, iterations, seed = 1003, 7, 11
    results = run_ranks("ranks_micro:exchange_trace", np=np_, backend=backend,
                        env=TORCH_PATH if path == "torch" else None,
                        kwargs={"numel": numel, "iterations": iterations, "density": 0.02,
                                "seed": seed, "skew": skew})
    slots = math.ceil(1.2 * int(0.02 * numel) / np_)
    traces = _check_against_simulation(results, np_, numel, iterations, seed, skew,
                                       capacity=slots)
    # Ring-model bytes: int32 blocks of a 4-int header and the slots, and float32 values
    # in every rank's slots; the same every step but where the index gather ran twice.
    block = 4 * (4 + slots)
    allreduce = 2 * (np_ - 1) * 4 * np_ * slots // np_
    regathers = {_regathers(trace, (np_ - 1) * block, (np_ - 1) * block + allreduce)
                 for trace in traces}
    assert regathers == {0}
    for trace in traces:
        assert all(step["slots"] == slots for step in trace)


@pytest.mark.parametrize("np_,backend", [(2, "gloo"), (3, "mpi")])
def test_exact_sizes_equal_simulation(np_, backend):
    """``capacity="exact"``: variable-size blocks, bytes of the counts themselves."""
    numel, iterations, seed, skew = 1003, 7, 11, 3.0
    results = run_ranks("ranks_micro:exchange_trace", np=np_, backend=backend,
                        kwargs={"numel": numel, "iterations": iterations, "density": 0.02,
                                "seed": seed, "skew": skew, "capacity": "exact"})
    traces = _check_against_simulation(results, np_, numel, iterations, seed, skew)
    # Ring-model bytes: int32 index blocks with a 3-int header, float32 values.
    for r, trace in enumerate(traces):
        for t in range(iterations):
            counts = trace[t]["rank_counts"]
            blocks = [4 * (c + 3) for c in counts]
            union = sum(counts)
            allreduce = 2 * (np_ - 1) * 4 * union // np_ if union else 0
            assert trace[t]["bytes_received"] == sum(blocks) - blocks[r] + allreduce
            assert trace[t]["bytes_sent"] == sum(blocks) - blocks[(r + 1) % np_] + allreduce


@pytest.mark.parametrize("np_,backend,judge,path", [(2, "gloo", "drift", "native"),
                                                    (3, "mpi", "drift", "native"),
                                                    (2, "mpi", "magnitude", "native"),
                                                    (2, "gloo", "drift", "torch")])
def test_overflow_keeps_the_highest_scores(np_, backend, judge, path):
    """The overflow rule: with fewer slots than the controller's target (4 against about
    20 / n), every step overflows; the slots' worth of the highest scores travel, the rest
    stays in the residual, and the controller still learns from what it picked. On the
    torch path the device leaves every such step to the host rule (a second gather)."""
    numel, iterations, seed, skew, slots = 1003, 7, 11, 3.0, 4
    results = run_ranks("ranks_micro:exchange_trace", np=np_, backend=backend,
                        env=TORCH_PATH if path == "torch" else None,
                        kwargs={"numel": numel, "iterations": iterations, "density": 0.02,
                                "seed": seed, "skew": skew, "capacity": slots,
                                "judge": judge})
    traces = _check_against_simulation(results, np_, numel, iterations, seed, skew,
                                       capacity=slots, judge=judge)
    for trace in traces:
        assert all(t["global_count"] == np_ * slots for t in trace)
        assert all(sum(t["selected_counts"]) > np_ * slots for t in trace)
        assert all(t["rank_counts"] == [slots] * np_ for t in trace)
        block, allreduce = (np_ - 1) * 4 * (4 + slots), 2 * (np_ - 1) * 4 * slots
        assert _regathers(trace, block, block + allreduce) == (
            iterations if path == "torch" else 0)


@pytest.mark.parametrize("np_,backend,path", [(2, "gloo", "native"), (3, "mpi", "native"),
                                              (2, "mpi", "torch")])
def test_a_cliff_is_cut_at_the_target(np_, backend, path):
    """A tenth of the entries within 0.01 % of each other (a cliff in the count, as error
    feedback makes on ResNet-18 at d = 0.001): where no ladder step comes within 10 % of a
    part's target, the owner cuts at the round(target)-th largest |a|, as the rule says.
    Judged by magnitude, where the plateau in |a| is a plateau of what is judged (the drift
    judge spreads it by the coordinates' ages)."""
    numel, iterations, seed = 1003, 8, 3
    results = run_ranks("ranks_micro:exchange_trace", np=np_, backend=backend,
                        env=TORCH_PATH if path == "torch" else None,
                        kwargs={"numel": numel, "iterations": iterations, "density": 0.02,
                                "seed": seed, "plateau": 0.1, "judge": "magnitude"})
    rule = BoundedRule(0.02, numel, np_)
    traces = _check_against_simulation(results, np_, numel, iterations, seed, 0.0,
                                       plateau=0.1, rule=rule, judge="magnitude")
    assert rule.exact_cuts >= 2  # the cliff was met, and cut, more than once
    # Every count stayed within 25 % of the target k = 20 (0.02 x 1003).
    assert all(15 <= t["global_count"] <= 25 for t in traces[0][1:])


def test_sum_op_equals_simulation():
    numel, iterations, seed = 500, 4, 5
    results = run_ranks("ranks_micro:exchange_trace", np=2,
                        kwargs={"numel": numel, "iterations": iterations, "density": 0.02,
                                "seed": seed, "op": "sum"})
    _check_against_simulation(results, 2, numel, iterations, seed, 0.0, average=False)


def test_fp16_values_on_the_wire():
    numel, iterations, seed = 800, 5, 2
    results = run_ranks("ranks_micro:exchange_trace", np=2,
                        kwargs={"numel": numel, "iterations": iterations, "density": 0.02,
                                "seed": seed, "fp16_values": True})
    traces = _check_against_simulation(results, 2, numel, iterations, seed, 0.0,
                                       rtol=2e-3, atol=1e-4, wire=fp16_round_trip)
    # Values travel as 2 bytes: a 2-rank ring allreduce moves 2 x 2 bytes per value,
    # half of what float32 would.
    slots = traces[0][1]["slots"]
    assert slots == math.ceil(1.2 * int(0.02 * numel) / 2)
    assert traces[0][1]["bytes_received"] == 4 * (4 + slots) + 2 * 2 * slots


def test_without_error_feedback():
    numel, iterations, seed = 700, 5, 4
    results = run_ranks("ranks_micro:exchange_trace", np=2,
                        kwargs={"numel": numel, "iterations": iterations, "density": 0.02,
                                "seed": seed, "error_feedback": False})
    # Without a residual the default judge is the magnitude (an age means nothing there).
    traces = _check_against_simulation(results, 2, numel, iterations, seed, 0.0,
                                       error_feedback=False, judge="magnitude")
    assert all(t["residual_norm"] == 0.0 for t in traces[0])


def test_empty_selection_neither_hangs_nor_breaks():
    results = run_ranks("ranks_micro:empty_selection", np=2,
                        kwargs={"numel": 2000, "iterations": 6})
    for r in results:
        first = r.value[0]
        assert first["global_count"] == 0 and first["grad_abs_sum"] == 0.0
        thresholds = [t["threshold"] for t in r.value]
        # The controller lowers the threshold after empty selections ...
        assert thresholds == sorted(thresholds, reverse=True) and thresholds[-1] < 1e6
    # ... identically on both ranks.
    assert results[0].value == results[1].value


def test_one_rank_selecting_nothing():
    results = run_ranks("ranks_micro:one_rank_silent", np=2, backend="gloo",
                        kwargs={"numel": 400, "iterations": 4})
    for t in range(4):
        counts = results[0].value[t]["rank_counts"]
        assert counts[1] == 0 and counts[0] > 0
        assert results[0].value[t]["grad"] == results[1].value[t]["grad"]


def test_nonfinite_gradient_on_one_rank():
    results = run_ranks("ranks_micro:nonfinite", np=2,
                        kwargs={"numel": 300, "bad_rank": 1, "bad_iteration": 2,
                                "iterations": 5})
    for r in results:
        for t, rec in enumerate(r.value):
            # Every rank sees the overflow at the same step (and only then), as NaN, ...
            assert rec["stats_nonfinite"] == (t == 2)
            assert rec["all_nan"] == (t == 2)
            assert rec["any_nonfinite"] == (t == 2)
            # ... while residual and threshold stay finite, so training can go on.
            assert rec["residual_finite"] and rec["threshold_finite"]


@pytest.mark.parametrize("capacity,warned", [(4, True), (None, False)])
def test_a_persistent_capacity_cut_is_reported(capacity, warned):
    """Slots too few for the target every step (4 against about 10 per rank): the
    statistics count what was sent (every slot, so no imbalance), and after ten such
    exchanges the set's first rank warns once that the density sent stays below the
    target. With the default capacity nothing is cut for long, and nothing is said."""
    results = run_ranks("ranks_micro:capacity_cut_warnings", np=2,
                        kwargs={"iterations": 12, "capacity": capacity})
    for r in results:
        said = [w for w in r.value["warnings"] if "capacity" in w and "cut" in w]
        assert len(said) == (1 if warned and r.rank == 0 else 0), (r.rank, said)
        if capacity is not None:
            assert all(c == [capacity] * 2 for c in r.value["rank_counts"])
            assert r.value["imbalance"] == [0.0] * 12
