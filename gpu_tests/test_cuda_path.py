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

import pytest
from multirank import run_ranks
from test_loopback import SPECS, check_baseline, check_micro
from test_powersgd import STEPS, check_traces
from test_zero_copy import ITERATIONS, NUMEL, SEED, check_variants


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
