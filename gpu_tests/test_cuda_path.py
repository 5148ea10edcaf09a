"""The CUDA path on a real GPU, against the same independent
simulations as the CPU tests (tests/simulation.py, computed on the CPU):

* the reducer on CUDA tensors, n ranks in one process (horovod_micro.testing.loopback): MiCRO with
  each controller, and every registered method, exactly as tests/test_loopback.py checks
  them on the CPU;
* a real Horovod rank (``horovodrun -np 1``) whose collectives run on NCCL: zero-copy
  error feedback, the copy path and the mix, exactly as tests/test_zero_copy.py checks
  them on Gloo and MPI ranks; PowerSGD's factors and warm start, exactly as
  tests/test_powersgd.py checks them.

One GPU cannot hold two NCCL ranks (NCCL refuses two ranks on one device), so the
NCCL test runs one rank; the n-rank arithmetic on CUDA tensors is the loopback tests'.
"""

import json
import sys
from pathlib import Path

import pytest
from multirank import run_ranks
from test_loopback import SPECS, check_baseline, check_micro
from test_powersgd import STEPS, check_traces
from test_zero_copy import ITERATIONS, NUMEL, SEED, check_variants

from hvm_testbed.launch import run_bounded

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("controller", ["bounded", "newton", "paper", "scale"])
@pytest.mark.parametrize("n", [2, 4])
def test_micro_on_cuda_equals_simulation(n, controller):
    check_micro(n, controller, device="cuda")


@pytest.mark.parametrize("label", sorted(SPECS))
def test_every_method_on_cuda_equals_simulation(label):
    check_baseline(label, 2, device="cuda")


def test_horovod_was_built_with_nccl():
    from horovod.common.util import nccl_built

    assert nccl_built()


def test_zero_copy_on_a_nccl_rank_equals_the_simulation():
    results = run_ranks("ranks_zero_copy:variants", np=1, backend="gloo",
                        kwargs={"numel": NUMEL, "iterations": ITERATIONS, "seed": SEED,
                                "device": "cuda"})
    check_variants(results, native=False)


@pytest.mark.parametrize("rank", [1, 4])
def test_powersgd_on_a_nccl_rank_equals_the_simulation(rank):
    results = run_ranks("ranks_powersgd:traces", np=1, backend="gloo",
                        kwargs={"rank_r": rank, "steps": STEPS, "device": "cuda"})
    # One rank: its residual is the whole error, so float32 rounding on the GPU (another
    # summation order than the CPU's) grows over the steps; 1e-3 of the largest entry (up
    # to 30), far below the O(1) of it that a wrong factor makes.
    check_traces(results, "nccl", 1, rank, atol=1e-3)


def test_a_micro_step_synchronises_the_host_once(tmp_path):
    """PyTorch's sync debug mode over MiCRO steps on the GPU (bench/cuda_syncs.py, the
    defaults, after warm-up): the host waits once per step, for the gathered header's
    tolist(); the selection is decided on the device (internal syncs of an op, such as
    bincount's, would show here, where the CPU's census cannot see them)."""
    out = tmp_path / "syncs.json"
    run_bounded([sys.executable, "-m", "bench.cuda_syncs", "--np", "1", "--warmup", "20",
                 "--steps", "10", "--json", str(out)], 900, cwd=REPO)
    result = json.loads(out.read_text())
    assert result["per_step"] <= 1.0, result["rows"]
    assert all(row["file"].endswith("exchange.py") for row in result["rows"]), result["rows"]


def test_a_checkpoint_resumed_on_cuda_equals_the_uninterrupted_run(tmp_path):
    """MiCRO with the drift judge on a CUDA rank: a checkpoint loaded onto the host and
    resumed gives the uninterrupted run's weights exactly (the ages move to the GPU with
    their values; they were replaced by zeros)."""
    results = run_ranks("ranks_out_of_step:reload_midway", np=1, backend="gloo",
                        kwargs={"path": str(tmp_path / "ckpt-{rank}.pt"), "who": "every",
                                "device": "cuda"})
    for r in results:
        assert r.value["raised"] is None, r.value
        assert r.value["max_difference"] == 0.0 and r.value["iteration"] == 5, r.value


def test_a_checkpoint_resumed_by_a_fresh_optimizer_on_cuda_equals_the_uninterrupted_run(
        tmp_path):
    """MiCRO's defaults (drift judge) on a CUDA rank: the checkpoint after step 5 of 12,
    loaded onto the host by a new model and optimizer (a new process's resume), gives
    after every remaining step exactly the uninterrupted run's weights (the fresh
    optimizer's ages arrive on the host; they were remade as zeros on the GPU)."""
    results = run_ranks("ranks_drift_judge:resume_fresh", np=1, backend="gloo",
                        kwargs={"path": str(tmp_path / "ckpt-{rank}.pt"), "steps": 12,
                                "resume_at": 5, "density": 0.05, "device": "cuda"})
    for r in results:
        assert r.value["differences"] == [0.0] * 7, r.value
        assert r.value["iteration"] == 11, r.value
