"""Ranks out of step, and edge inputs, on real ranks: each ends with a correct result or a
clear error on every rank, by default (no variable set).

* out of step (a rank with no batch at the first step, a rank that catches its own error
  between backward and ``step()``, two optimizers stepped or built in another order on one
  rank): the exchange's deadline (45 s by default) ends the wait with ``ExchangeTimeout``
  and shuts Horovod down, which ends every other rank's wait with
  ``HorovodInternalError``;
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


@pytest.mark.parametrize("case,backend", OUT_OF_STEP, ids=[f"{c}-{b}" for c, b in OUT_OF_STEP])
def test_out_of_step_ends_by_default(case, backend):
    results = run_ranks("ranks_out_of_step:out_of_step", np=2, backend=backend,
                        kwargs={"case": case}, timeout=200)
    seen = [r.value for r in results]
    assert all(v["raised"] in ("ExchangeTimeout", "HorovodInternalError") for v in seen), seen
    timed_out = [v for v in seen if v["raised"] == "ExchangeTimeout"]
    assert timed_out, seen
    for v in timed_out:
        assert "no other rank joined this collective within 45 s" in v["message"], v
        assert "out of step" in v["message"], v
    for v in seen:
        if v["raised"] == "HorovodInternalError":
            assert "Horovod has been shut down" in v["message"], v
        # Ended by the default deadline (not sooner: the ranks meet in a collective just
        # before, so their clocks start within a few ms), within the 60 s bar.
        assert deadline.DEFAULT_TIMEOUT_S - 1 <= v["seconds"] < 60, seen


def test_models_paired_across_ranks_are_refused_on_every_rank():
    results = run_ranks("ranks_out_of_step:out_of_step", np=2, kwargs={"case": "both_swapped"})
    messages = {r.value["message"] for r in results}
    assert [r.value["raised"] for r in results] == ["CollectiveInputError"] * 2, results
    assert len(messages) == 1, messages
    message = messages.pop()
    assert "differ from those of the set's first rank" in message
    assert "hvd.broadcast_parameters" in message and "same order" in message


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


def test_deadline_setting(monkeypatch):
    monkeypatch.delenv(deadline.TIMEOUT_ENV, raising=False)
    assert deadline.timeout_from_env() == deadline.DEFAULT_TIMEOUT_S
    monkeypatch.setenv(deadline.TIMEOUT_ENV, "0")
    assert deadline.timeout_from_env() is None
    monkeypatch.setenv(deadline.TIMEOUT_ENV, "2.5")
    assert deadline.timeout_from_env() == 2.5
    monkeypatch.setenv(deadline.TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match="not a number of seconds"):
        deadline.timeout_from_env()
