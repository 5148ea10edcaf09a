"""The DistributedOptimizer contract on real ranks: checkpoints, gradient accumulation,
bad input reported on every rank, the dense path, and Horovod's usage patterns."""

import math

import pytest
import torch
from multirank import run_ranks
from simulation import rank_gradient, simulate_micro

import horovod_micro as hvm


def test_checkpoint_resume_equals_uninterrupted_run(backend):
    results = run_ranks("ranks_optimizer:checkpoint_resume", np=2, backend=backend,
                        kwargs={"first": 12, "second": 9})
    for r in results:
        v = r.value
        assert v["threshold_restored"] and v["residual_nonzero"]
        assert v["iterations"] == [21, 21]
        assert v["thresholds"][0] == v["thresholds"][1]
        assert v["max_param_diff"] == 0.0
        assert v["max_residual_diff"] == 0.0


def test_backward_passes_per_step_accumulates_locally():
    numel, steps, passes = 600, 4, 2
    results = run_ranks("ranks_optimizer:accumulation", np=2,
                        kwargs={"numel": numel, "steps": steps, "passes": passes})
    # One threshold per rank and step (the default controller scales each rank's own).
    thresholds = [[r.value["thresholds"][s] for r in results] for s in range(steps)]
    grads = [[sum(rank_gradient(r, s * passes + j, numel, seed=3) for j in range(passes))
              for r in range(2)] for s in range(steps)]
    sim = simulate_micro(grads, thresholds, 2, judge="drift", density=0.02)
    for r in results:
        for s in range(steps):
            torch.testing.assert_close(torch.tensor(r.value["grads"][s]), sim[s]["grad"],
                                       rtol=1e-5, atol=1e-7)
        errors = r.value["errors"]
        assert sum(e.startswith("zero_grad") for e in errors) == steps
        assert any(e.startswith("extra pass") and "backward_passes_per_step" in e
                   for e in errors)


BAD_CASES = {
    "density_out_of_range": ("ValueError", ["rank 1", "density", "1.5"]),
    "density_nan": ("ValueError", ["rank 1", "density", "nan"]),
    "density_differs": ("ValueError", ["rank 1", "compression", "differs"]),
    "shapes_differ": ("ValueError", ["rank 1", "parameters differ"]),
    "complex_parameter": ("ValueError", ["rank 0", "floating point"]),
    "backward_passes": ("ValueError", ["rank 0", "backward_passes_per_step"]),
    "sparse_gradient": ("CollectiveInputError", ["rank 1", "sparse"]),
}


@pytest.mark.parametrize("backend_", ["gloo", "mpi"])
def test_bad_input_raises_on_every_rank(backend_):
    results = run_ranks("ranks_optimizer:bad_inputs", np=2, backend=backend_,
                        kwargs={"cases": list(BAD_CASES)}, timeout=300)
    for r in results:
        for case, (error_type, words) in BAD_CASES.items():
            got = r.value[case]
            assert got["raised"] == error_type, (r.rank, case, got)
            for word in words:
                assert word in got["message"], (r.rank, case, got["message"])


@pytest.mark.parametrize("sparse", [False, True])
def test_rank_outside_the_process_set_steps_locally(backend, sparse):
    """Horovod's rule: a rank outside the optimizer's set exchanges nothing and steps on
    its own gradient; the member exchanges over a set of one."""
    results = run_ranks("ranks_optimizer:process_set_member_and_outsider", np=3,
                        backend=backend, kwargs={"sparse": sparse},
                        env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"}, timeout=180)
    member = ["optimizer", "sparse"] if sparse else ["optimizer"]
    assert results[0].value == {"moved": True, "exchanges": 3, "snapshot": member}
    for r in results[1:]:
        assert r.value == {"moved": True, "exchanges": None, "snapshot": ["optimizer"]}


@pytest.mark.parametrize("np_", [2, 3])
def test_resume_by_rank0_load_and_broadcast_keeps_micro_exclusive(np_):
    first, second = 7, 6
    results = run_ranks("ranks_optimizer:resume_by_broadcast", np=np_,
                        kwargs={"first": first, "second": second}, timeout=180)
    reference = results[0].value["steps"]
    assert [s["iteration"] for s in reference] == list(range(first, first + second))
    for r in results:
        steps = r.value["steps"]
        # Same iteration and bit-identical controller state on every rank at every step
        # (the thresholds themselves differ: each rank scales its own by its a_t's RMS).
        assert [(s["iteration"], s["controller"]) for s in steps] == [
            (s["iteration"], s["controller"]) for s in reference]
        # Parts disjoint: the update touches as many distinct coordinates as were
        # selected in all (overlapping parts would select some twice).
        assert all(s["touched"] == s["global_count"] > 0 for s in steps), steps
        assert r.value["params_equal"]
    assert results[0].value["refused"] is None
    for r in results[1:]:
        assert "rank 0 of" in r.value["refused"] and "residual" in r.value["refused"]


@pytest.mark.parametrize("sparse", [False, True])
def test_tied_parameters_take_part_once(sparse):
    results = run_ranks("ranks_optimizer:tied_parameters", np=2, kwargs={"sparse": sparse})
    for r in results:
        assert r.value["numel"] == r.value["unique_numel"]
        assert max(r.value["steps"]) < 1e-6, r.value["steps"]


@pytest.mark.parametrize("sparse", [False, True])
def test_rewrapping_closes_the_previous_optimizer(sparse):
    results = run_ranks("ranks_optimizer:rewrap_and_close", np=2, kwargs={"sparse": sparse})
    for r in results:
        v = r.value
        assert v["warned"] and v["buffers_freed"] and v["collected"]
        assert "closed" in v["first_step"]
        assert v["third_iterations"] == 2


def test_pass_counters_reset_after_a_collective_error():
    results = run_ranks("ranks_optimizer:clean_after_collective_error", np=2)
    for r in results:
        assert r.value == {"raised": "CollectiveInputError", "zero_grad_ok": True}


@pytest.mark.parametrize("density", [0.0, -0.1, 1.5, math.nan, math.inf, True, "0.1"])
def test_factory_rejects_bad_density_outside_a_job(density):
    with pytest.raises(ValueError, match="density"):
        hvm.Compression.micro(density=density)


def test_dense_path_is_horovods_average():
    numel, iterations = 257, 3
    results = run_ranks("ranks_optimizer:dense_paths", np=2,
                        kwargs={"numel": numel, "iterations": iterations})
    for t in range(iterations):
        mean = (rank_gradient(0, t, numel, seed=9) + rank_gradient(1, t, numel, seed=9)) / 2
        for r in results:
            for name in ("hvd.none", "hvm.none"):
                torch.testing.assert_close(torch.tensor(r.value[name]["grads"][t]), mean)
            torch.testing.assert_close(torch.tensor(r.value["hvd.fp16"]["grads"][t]), mean,
                                       rtol=2e-3, atol=1e-5)
    v = results[0].value
    assert v["hvd.none"]["bytes_sent"] == 2 * v["hvd.fp16"]["bytes_sent"] == 4 * numel


def test_dense_path_with_fusion_groups():
    iterations, sizes = 2, (50, 7, 30, 3)
    results = run_ranks("ranks_optimizer:dense_groups", np=2,
                        kwargs={"num_groups": 2, "iterations": iterations})
    for r in results:
        for label in ("num_groups", "groups"):
            for t in range(iterations):
                for i, n in enumerate(sizes):
                    mean = sum(rank_gradient(q, 10 * t + i, n, seed=5) for q in range(2)) / 2
                    torch.testing.assert_close(torch.tensor(r.value[label][t][i]), mean)


def test_horovod_usage_patterns():
    results = run_ranks("ranks_optimizer:usage_patterns", np=2)
    for r in results:
        v = r.value
        # broadcast_optimizer_state initialises state without an exchange step.
        assert v["iteration_after_broadcast"] == 0 and not v["stats_after_broadcast"]
        assert v["iterations"] == 30
        assert v["params_equal_across_ranks"] and v["clipped"]
        assert v["last_loss"] < v["first_loss"]


@pytest.mark.parametrize("sparse", [False, True])
def test_parameter_frozen_after_wrapping_is_left_alone(sparse):
    results = run_ranks("ranks_optimizer:frozen_after_wrapping", np=2, kwargs={"sparse": sparse})
    for r in results:
        assert r.value == {"grad_is_none": True, "moved": False, "others_moved": True}


def test_grad_scaler_changes_rescale_residual_and_threshold():
    results = run_ranks("ranks_optimizer:loss_scale_changes", np=2, kwargs={"steps": 12})
    for r in results:
        v = r.value
        assert v["scales"][-1] == 2.0**4 * 2**12  # the scale really changed every step
        reference, passed, ignored = v["counts"]
        assert passed == reference, v["counts"]
        assert v["passed_diff"] < 1e-6
        # Without the scaler the residual mixes units and the threshold lags: another run.
        assert v["ignored_diff"] > 1e-4 and ignored != reference
