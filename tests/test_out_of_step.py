"""Ranks out of step, and edge inputs, on real ranks: each ends with a correct result or a
clear error on every rank, by default (no variable set).

* one rank working alone between steps for longer than the in-step deadline (rank 0
  evaluating while the others wait in the next exchange): the job completes, with a stall
  warning that names the collective;
* out of step (a rank with no batch at the first step, a rank that catches its own error
  between backward and ``step()``, two optimizers stepped or built in another order on one
  rank): the arrival deadline (1800 s by default, shortened here through its variable)
  ends the wait with ``ExchangeTimeout`` and shuts Horovod down, which ends every other
  rank's wait with ``HorovodInternalError``; ranks that part within a step (a plugin that
  fails on one rank) end at the in-step deadline;
* two same-shaped models built and stepped in another order on one rank: their
  collectives pair across models; the first exchange's parameter check raises
  ``CollectiveInputError`` on every rank at once;
* a float16 model whose float32 aggregate exceeds 65504: a non-finite step (NaN, flagged),
  never a silent Inf;
* ``synchronize()`` twice: the second changes nothing, as in dense Horovod;
* MiCRO at density 1 with every controller: the plain average of the ranks' gradients;
* a checkpoint of 2 ranks resumed on 3 with Horovod's idiom; a refused load changes nothing.
"""

import math

import numpy as np
import pytest
from multirank import run_ranks

import horovod_micro as hvm
from horovod_micro import deadline

OUT_OF_STEP = [("uneven_first", "gloo"), ("caught", "gloo"), ("caught", "mpi"),
               ("steps_swapped", "gloo"), ("built_swapped", "gloo")]
ARRIVAL_S = 20  # the deadlines these tests set (1800 s and 45 s by default: an arrival
# deadline is never below the in-step one, so both are set)


@pytest.mark.parametrize("case,backend", OUT_OF_STEP, ids=[f"{c}-{b}" for c, b in OUT_OF_STEP])
def test_out_of_step_ends_at_the_arrival_deadline(case, backend):
    results = run_ranks("ranks_out_of_step:out_of_step", np=2, backend=backend,
                        kwargs={"case": case}, timeout=200,
                        env={deadline.ARRIVAL_ENV: str(ARRIVAL_S),
                             deadline.TIMEOUT_ENV: str(ARRIVAL_S)})
    seen = [r.value for r in results]
    assert all(v["raised"] in ("ExchangeTimeout", "HorovodInternalError") for v in seen), seen
    timed_out = [v for v in seen if v["raised"] == "ExchangeTimeout"]
    assert timed_out, seen
    for v in timed_out:
        assert f"no other rank joined this collective within {ARRIVAL_S} s" in v["message"], v
        assert deadline.ARRIVAL_ENV in v["message"] and "out of step" in v["message"], v
    for v in seen:
        if v["raised"] == "HorovodInternalError":
            assert "Horovod has been shut down" in v["message"], v
        # Ended by the arrival deadline (not sooner: the ranks meet in a collective just
        # before, so their clocks start within a few ms).
        assert ARRIVAL_S - 1 <= v["seconds"] < ARRIVAL_S + 15, seen


def test_a_rank_working_alone_longer_than_the_in_step_deadline_completes():
    """Rank 0 sleeps 10 s before its fourth step, with a 3 s in-step deadline and no
    arrival deadline set: the other rank waits in that step's first collective, warned
    every 2 s (Horovod's stall interval), and the job completes with equal weights."""
    results = run_ranks("ranks_out_of_step:works_alone", np=2, kwargs={"seconds": 10},
                        env={deadline.TIMEOUT_ENV: "3", deadline.STALL_ENV: "2"},
                        timeout=200)
    for r in results:
        assert r.value["raised"] is None, r.value
        assert r.value["same_weights"] and r.value["iteration"] == 5, r.value  # 6 exchanges
    waited = results[1].value
    assert waited["seconds"] >= 10, waited
    warnings_ = [line for line in waited["printed"].splitlines() if "has waited" in line]
    assert len(warnings_) >= 3, waited["printed"]  # at about 2, 4, 6, 8 s
    assert "rank 1 has waited 2 s in collective hvm." in warnings_[0], warnings_
    assert "for the other ranks to reach this step" in warnings_[0], warnings_
    assert "ends with ExchangeTimeout after 1800 s" in warnings_[0], warnings_
    assert deadline.ARRIVAL_ENV in warnings_[0], warnings_
    assert "has waited" not in results[0].value["printed"]  # rank 0 never waited


def test_ranks_that_part_within_a_step_end_at_the_in_step_deadline():
    results = run_ranks("ranks_out_of_step:diverged_in_step", np=2, timeout=200,
                        env={deadline.TIMEOUT_ENV: "6"})
    waiting, failed = (r.value for r in results)
    assert waiting["raised"] == "ExchangeTimeout", waiting
    assert "no other rank joined this collective within 6 s" in waiting["message"]
    assert "after every rank had entered this exchange" in waiting["message"]
    assert deadline.TIMEOUT_ENV in waiting["message"]
    assert 5 <= waiting["seconds"] < 25, waiting  # the in-step deadline, not the arrival
    assert failed["raised"] == "HorovodInternalError", failed
    assert "Horovod has been shut down" in failed["message"], failed


def test_models_paired_across_ranks_are_refused_on_every_rank():
    results = run_ranks("ranks_out_of_step:out_of_step", np=2, kwargs={"case": "both_swapped"})
    messages = {r.value["message"] for r in results}
    assert [r.value["raised"] for r in results] == ["CollectiveInputError"] * 2, results
    assert len(messages) == 1, messages
    message = messages.pop()
    assert "differ from those of the set's first rank" in message
    assert "hvd.broadcast_parameters" in message and "same order" in message


def test_weights_not_broadcast_train_as_with_horovod():
    """Each rank initialises its own model and nothing is broadcast: as with Horovod's
    optimizer, every rank trains its own weights with the same aggregate; the set's first
    rank warns once. (Cross-paired models are still refused, above.)"""
    results = run_ranks("ranks_out_of_step:unbroadcast", np=2)
    for r in results:
        v = r.value
        assert v["raised"] is None, v
        assert v["moved"] and v["same_aggregate"] == [True] * 3, v
        warned = [w for w in v["warnings"] if "not broadcast?" in w]
        assert len(warned) == (1 if r.rank == 0 else 0), (r.rank, v["warnings"])
        assert "differ from those of the set's first rank" in "".join(warned) or r.rank


def test_optimizers_built_one_after_another_on_weights_not_broadcast_train():
    """Same-shaped optimizers built in turn, each dropped before the next (as Horovod's
    own optimizer tests do): nothing can pair across models, so none is refused."""
    results = run_ranks("ranks_out_of_step:unbroadcast_one_after_another", np=2)
    for r in results:
        assert r.value["raised"] == [None] * 3, r.value


def test_checkpoint_loaded_on_every_rank_midway_resumes_exactly(tmp_path):
    """Every rank loads its own checkpoint after three exchanges: the next exchange finds
    that every rank loaded, adopts rank 0's shared state, and the repeated steps give the
    uninterrupted run's weights exactly."""
    results = run_ranks("ranks_out_of_step:reload_midway", np=2,
                        kwargs={"path": str(tmp_path / "ckpt-{rank}.pt"), "who": "every"})
    for r in results:
        assert r.value["raised"] is None, r.value
        assert r.value["max_difference"] == 0.0 and r.value["iteration"] == 5, r.value


def test_checkpoint_loaded_on_one_rank_only_is_refused_on_every_rank(tmp_path):
    """Rank 0 alone loads a checkpoint and nothing is broadcast: the next exchange raises
    the same error on every rank at once (no wait for a deadline)."""
    results = run_ranks("ranks_out_of_step:reload_midway", np=2,
                        kwargs={"path": str(tmp_path / "ckpt-{rank}.pt"), "who": "0"})
    messages = {r.value["message"] for r in results}
    assert [r.value["raised"] for r in results] == ["CollectiveInputError"] * 2, results
    assert len(messages) == 1, messages
    message = messages.pop()
    assert "rank(s) [0] loaded an optimizer state" in message
    assert "hvd.broadcast_optimizer_state" in message
    assert all(r.value["seconds"] < 10 for r in results), results


@pytest.mark.parametrize("method", ["powersgd", "micro"])
def test_settings_equal_in_value_but_not_in_type_train(method):
    """16 on one rank and 16.0 on another (np.int64 beside int) are one setting: the
    collective check held them equal while the collectives' names differed, and the
    ranks waited in different collectives until the deadline."""
    results = run_ranks("ranks_out_of_step:settings_alike", np=2, kwargs={"method": method})
    for r in results:
        assert r.value["raised"] is None, r.value
        assert r.value["same_weights"] and r.value["seconds"] < 30, r.value


def test_collective_names_use_the_settings_canonical_form():
    from horovod_micro.naming import canonical

    # What the names hash: the canonical form's repr.
    assert repr(canonical({"a": 16, "b": [1, np.int64(2)], "c": "x", "d": True, "e": None})) \
        == repr(canonical({"a": 16.0, "b": (1.0, 2.0), "c": "x", "d": True, "e": None}))
    assert repr(canonical({"d": True})) != repr(canonical({"d": 1}))
    micro = hvm.Compression.micro(density=0.01, capacity=np.int64(5))
    assert micro.capacity == 5 and type(micro.capacity) is int
    assert micro.config_error() is None
    psgd = hvm.Compression.powersgd(rank=np.int64(2), min_compression=np.float32(4))
    assert (psgd.rank, psgd.min_compression) == (2, 4.0) and psgd.config_error() is None
    with pytest.raises(ValueError, match="rank must be a positive integer"):
        hvm.Compression.powersgd(rank=np.bool_(True))


def test_float16_overflow_is_a_nonfinite_step():
    results = run_ranks("ranks_out_of_step:float16_overflow", np=2)
    steps = results[0].value["steps"]
    assert steps == results[1].value["steps"]
    # Step 0 sends coordinate 1 (50000 fits float16); coordinate 0 then holds 80000 in
    # the float32 residual of two steps, beyond float16's 65504.
    assert not steps[0]["nonfinite"] and steps[0]["grad_max"] == 49984.0
    assert steps[1]["nonfinite"], steps
    for step in steps:
        assert not step["inf"], step  # never a silent Inf in .grad
        assert step["nan"] == step["nonfinite"], step
    # The coordinate whose aggregate could not be written back is dropped from the
    # residual on every rank, so it does not overflow again at once.
    assert steps[1]["residual"][0] == 0.0, steps[1]


@pytest.mark.parametrize("method", ["micro", "topk", "dense"])
def test_second_synchronize_changes_nothing(method):
    results = run_ranks("ranks_out_of_step:synchronize_twice", np=2,
                        kwargs={"method": method})
    for r in results:
        for step in r.value["steps"]:
            assert step["equal"], (r.rank, step)
            assert step["warned"], (r.rank, step)  # step() after synchronize(): Horovod's
            assert step["step_used_first"], (r.rank, step)
        assert r.value["same_weights"]


@pytest.mark.parametrize("controller,judge", [("bounded", None), ("scale", None),
                                              ("newton", "magnitude"),
                                              ("paper", "magnitude")])
def test_density_one_is_the_plain_average(controller, judge):
    results = run_ranks("ranks_out_of_step:density_one", np=3,
                        kwargs={"controller": controller, "judge": judge})
    for r in results:
        assert r.value["density"] == 1.0
        assert max(r.value["errors"]) < 1e-6, r.value


def test_checkpoint_of_two_ranks_resumes_on_three(tmp_path):
    path = str(tmp_path / "ckpt-{rank}.pt")
    saved = run_ranks("ranks_out_of_step:save_checkpoint", np=2, kwargs={"path": path})
    assert saved[0].value["iteration"] == 2
    results = run_ranks("ranks_out_of_step:load_checkpoint", np=3, kwargs={"path": path})
    for r in results:
        v = r.value
        if r.rank == 1:
            assert v["refused"] is None  # its own residual, at another number of ranks
        else:
            assert "rank 1 of 2's" in v["refused"] and "residual" in v["refused"], v
            assert v["unchanged"], (r.rank, v)  # a refused load is all or nothing
        # Rank 0's iteration (2) went to every rank, and three more steps followed.
        assert v["iteration"] == 5, v
        assert v["same_weights"] and v["finite"], v


def test_numpy_densities_are_numbers():
    for density in (np.float32(0.05), np.float64(0.05), np.int64(1)):
        compressor = hvm.Compression.micro(density=density)
        assert type(compressor.density) is float
        assert math.isclose(compressor.density, float(density))
    with pytest.raises(ValueError, match="density must be a number"):
        hvm.Compression.micro(density=np.bool_(True))


def test_deadline_settings(monkeypatch):
    for name in (deadline.TIMEOUT_ENV, deadline.ARRIVAL_ENV, deadline.STALL_ENV,
                 deadline.STALL_DISABLE_ENV):
        monkeypatch.delenv(name, raising=False)
    assert deadline.timeout_from_env() == 45.0
    assert deadline.arrival_from_env() == 1800.0  # PyTorch's Gloo default
    assert deadline.stall_warning_from_env() == 60.0  # Horovod's default
    monkeypatch.setenv(deadline.TIMEOUT_ENV, "0")
    assert deadline.timeout_from_env() is None
    assert deadline.arrival_from_env() is None  # off altogether, unless set
    monkeypatch.setenv(deadline.ARRIVAL_ENV, "600")
    assert deadline.arrival_from_env() == 600.0
    monkeypatch.setenv(deadline.TIMEOUT_ENV, "2.5")
    assert deadline.timeout_from_env() == 2.5
    monkeypatch.setenv(deadline.ARRIVAL_ENV, "1")
    assert deadline.arrival_from_env() == 2.5  # never below the in-step deadline
    monkeypatch.setenv(deadline.ARRIVAL_ENV, "0")
    assert deadline.arrival_from_env() is None
    monkeypatch.setenv(deadline.STALL_ENV, "5")
    assert deadline.stall_warning_from_env() == 5.0
    monkeypatch.setenv(deadline.STALL_DISABLE_ENV, "1")
    assert deadline.stall_warning_from_env() is None
    monkeypatch.setenv(deadline.TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match="not a number of seconds"):
        deadline.timeout_from_env()
