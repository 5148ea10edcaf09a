"""PowerSGD on real ranks (Gloo and MPI) equals an independent single-process simulation
of the same algorithm and seed, step after step; its bytes are the model's r (m + c) per
matrix; its state resumes; a NaN on one rank skips the step everywhere."""

from __future__ import annotations

import math

import pytest
import torch
from multirank import run_ranks
from ranks_powersgd import MIN_COMPRESSION, SHAPES, rank_grads
from simulation_powersgd import compressed, simulate_powersgd

import horovod_micro as hvm

STEPS = 4


def _flat(tensors) -> torch.Tensor:
    return torch.cat([torch.as_tensor(t, dtype=torch.float64).reshape(-1) for t in tensors])


def model_numbers(rank: int) -> tuple[int, int]:
    """The two allreduces' sizes by the paper's model: every compressed m x c matrix sends
    r m numbers (P, with the uncompressed entries) and r c numbers (Q)."""
    first = second = 0
    for shape in SHAPES:
        if compressed(shape, rank, MIN_COMPRESSION):
            first += rank * shape[0]
            second += rank * math.prod(shape[1:])
        else:
            first += math.prod(shape)
    return first, second


@pytest.mark.parametrize("backend,n,rank,op,start", [("gloo", 2, 1, "average", 0),
                                                     ("gloo", 3, 2, "sum", 0),
                                                     ("mpi", 2, 4, "average", 0),
                                                     ("gloo", 2, 2, "average", 2)])
def test_powersgd_on_real_ranks_equals_the_simulation(backend, n, rank, op, start):
    results = run_ranks("ranks_powersgd:traces", np=n, backend=backend,
                        kwargs={"rank_r": rank, "steps": STEPS, "op": op,
                                "start_iteration": start})
    check_traces(results, backend, n, rank, op, start)


def _close(got: torch.Tensor, want: torch.Tensor, atol: float, context) -> None:
    scale = max(1.0, float(want.abs().max()))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=atol * scale, msg=str(context))


def check_traces(results, backend, n, rank, op="average", start=0, atol=1e-5):
    """The ranks' traces (ranks_powersgd.traces) against simulate_powersgd: aggregates,
    residuals, bytes, statistics, identical weights and the resumed half. ``atol``: the
    float32 rounding allowed, relative to the step's largest entry (a wrong factor is off by
    O(1) of it). The library's float32 Gram-Schmidt and the simulation's float64 QR part by
    rounding that the warm start carries from step to step: at rank 4 it doubles every
    step (2.5e-6, 9e-6, 1.9e-5, 4.1e-5 on entries up to 18), by an amount that depends on
    the CPU's BLAS kernels. The simulation itself moves as much: gradients perturbed by
    1e-7 of themselves (float32 rounding) move its rank-4 aggregates by 3e-6 to 1.1e-5."""
    grads = [[rank_grads(w, t) for w in range(n)] for t in range(STEPS)]
    want = simulate_powersgd(grads, SHAPES, rank, average=op == "average",
                             start_iteration=start, min_compression=MIN_COMPRESSION)
    first, second = model_numbers(rank)
    dense = sum(math.prod(s) for s in SHAPES)
    # the test compresses something
    assert sum(compressed(s, rank, MIN_COMPRESSION) for s in SHAPES) >= 2
    for r in results:
        v = r.value
        assert v["same_weights"]
        assert v["compressed"] == [[s[0], math.prod(s[1:])] for s in SHAPES
                                   if compressed(s, rank, MIN_COMPRESSION)]
        assert v["sent_numbers"] == first + second
        for t, got in enumerate(v["steps"]):
            context = (backend, n, rank, t, r.rank)
            _close(_flat(got["grads"]), _flat(want[t]["aggregate"]), atol, context)
            _close(_flat([got["residual"]]), _flat(want[t]["residuals"][r.rank]), atol,
                   context)
            # Bytes: the status header's allgather (3 int32 per rank: in a ring every
            # rank sends and receives n - 1 blocks) and two ring allreduces of float32
            # factors (each rank sends and receives 2 (n - 1) / n of them), nothing else.
            header = 12 * (n - 1)
            sizes = (dense, 0) if t < start else (first, second)  # warm-up: plain average
            moved = sum(2 * (n - 1) * 4 * size // n for size in sizes)
            assert got["bytes_sent"] == header + moved, context
            assert got["bytes_received"] == header + moved, context
            assert got["method"] == "powersgd" and not got["nonfinite"]
            assert got["global_count"] == sum(math.prod(s) for s in SHAPES)
            assert got["density"] == 1.0
        for got, t in zip(v["resumed"], range(STEPS // 2, STEPS)):
            torch.testing.assert_close(_flat(got), _flat(v["steps"][t]["grads"]),
                                       rtol=1e-5, atol=1e-6)


def test_powersgd_first_step_is_the_simulation_to_float_rounding():
    """The first step alone, tight: the library's float32 Gram-Schmidt against the
    simulation's float64 QR differs by float32 rounding only."""
    results = run_ranks("ranks_powersgd:traces", np=2, kwargs={"rank_r": 2, "steps": 2})
    grads = [[rank_grads(w, 0) for w in range(2)]]
    want = simulate_powersgd(grads, SHAPES, 2, min_compression=MIN_COMPRESSION)[0]
    for r in results:
        got = _flat(r.value["steps"][0]["grads"])
        expected = _flat(want["aggregate"])
        assert float((got - expected).abs().max()) <= 1e-5 * float(expected.abs().max())


def test_nonfinite_step_is_skipped_everywhere_and_keeps_the_warm_start():
    results = run_ranks("ranks_powersgd:nonfinite_then_finite", np=2)
    for r in results:
        seen = r.value["seen"]
        assert [s["nonfinite"] for s in seen] == [False, True, False]
        assert seen[1]["all_nan"] and not seen[2]["all_nan"]
        assert seen[1]["q"] == seen[0]["q"]  # the skipped step left Q as it was
        assert seen[2]["q"] != seen[1]["q"]
    assert results[0].value["seen"] == results[1].value["seen"]


def test_a_bad_rank_on_one_rank_raises_on_every_rank():
    results = run_ranks("ranks_powersgd:bad_rank_on_one_rank", np=2)
    errors = {r.value["error"] for r in results}
    assert len(errors) == 1 and "rank must be a positive integer" in errors.pop()


@pytest.mark.parametrize("kwargs,message", [({"rank": 0}, "rank must be"),
                                            ({"rank": 1.5}, "rank must be"),
                                            ({"min_compression": 0.5}, "min_compression"),
                                            ({"seed": -1}, "seed must be"),
                                            ({"start_iteration": -2}, "start_iteration")])
def test_bad_arguments_outside_a_job(kwargs, message):
    with pytest.raises(ValueError, match=message):
        hvm.Compression.powersgd(**kwargs)


@pytest.mark.parametrize("rank", [1, 2, 4])
def test_the_default_leaves_a_classifier_whole_and_compresses_the_large_matrices(rank):
    """``min_compression=16`` (the default): of ``make run``'s 784-256-10 MLP and of the
    benchmarks' 784-4096-2048-512-10, every hidden layer's weight travels as factors and
    the 10-class classifier's weight (a gradient of rank up to 10) goes whole; the
    simulation's rule agrees."""
    from horovod_micro.compressors.powersgd import PowerSGDCompressor

    for widths in ((256,), (4096, 2048, 512)):
        shapes, width = [], 784
        for w in (*widths, 10):
            shapes += [(w, width), (w,)]
            width = w
        compressor = PowerSGDCompressor(rank=rank)
        compressor.bind_shapes(shapes)
        matrices, _ = compressor.plan(sum(math.prod(s) for s in shapes))
        got = [(m.rows, m.cols) for m in matrices]
        assert got == [s for s in shapes[:-2] if len(s) == 2], (widths, got)
        assert [s for s in shapes if compressed(s, rank)] == [tuple(g) for g in got]


def test_a_layer_after_a_zero_gradient_step_trains_as_with_dense():
    """The first layer's gradient is exactly zero at step 0 (its successor starts at
    zero). Dense moves it from step 1 on; so must PowerSGD: its warm-start Q, the mean of a
    zero M^T P, restarts from the first Q instead of staying 0 (P = M Q = 0 for ever)."""
    dense = run_ranks("ranks_powersgd:zero_successor", np=2, kwargs={"method": "none"})
    low_rank = run_ranks("ranks_powersgd:zero_successor", np=2, kwargs={"method": "powersgd"})
    for d, p in zip(dense, low_rank):
        assert d.value["moved"][0] == 0.0 and d.value["moved"][1] > 0, d.value
        assert p.value["moved"][0] == 0.0, p.value
        assert p.value["grad_norms"][1] > 0 and p.value["moved"][1] > 0, p.value


@pytest.mark.parametrize("fp16_values", [True, False])
def test_float16_factors_stay_finite_on_modest_gradients(fp16_values):
    """Gradient entries of about 16 (4,000 times below float16's 65504): the factors are
    of the gradient's scale (Q orthonormal), so float16 on the wire never overflows."""
    results = run_ranks("ranks_powersgd:float16_factors", np=2,
                        kwargs={"fp16_values": fp16_values})
    for r in results:
        assert r.value["nonfinite"] == [False] * 8, r.value
