"""Defects found in review of the sparse step, each on real ranks against the
independent simulations of tests/simulation.py and tests/simulation_baselines.py:

1. float64 models keep float64 (the dtype rule of docs/design.md);
2. float16 values on the wire: overflow is a non-finite step on every rank, and the
   rounding error stays in the residual;
3. a non-finite step keeps every finite residual entry;
4. the finiteness check does not overflow on finite values;
9. a collective error leaves the residual as it was before the step.
"""

from __future__ import annotations

import math

import pytest
import torch
from multirank import run_ranks
from simulation import injected_gradient, per_rank_thresholds, simulate_micro
from test_baselines import common_arguments
from test_baselines import simulate as simulate_baseline

from horovod_micro.compressors.randomk import shared_indices
from horovod_micro.layout import FlatLayout

NUMEL, DENSITY, VALUE = 300, 0.05, 0.03
K = math.floor(DENSITY * NUMEL)


def run(label, method, **kwargs):
    op = kwargs.pop("op", "average")
    return {"label": label, "method": method, "kwargs": kwargs, "op": op}


def every_method(**kwargs):
    """MiCRO and the five baselines, with the same extra arguments."""
    return [run("micro", "micro", density=DENSITY, **kwargs),
            run("topk", "topk", density=DENSITY, **kwargs),
            run("cltk", "cltk", density=DENSITY, **kwargs),
            run("threshold", "threshold", value=VALUE, **kwargs),
            run("randomk", "randomk", density=DENSITY, **kwargs),
            run("gtopk", "gtopk", density=DENSITY, **kwargs)]


def simulate(spec, n, grads, traces):
    """The independent reference of ``spec``'s method over ``grads[t][r]``: MiCRO's, or a
    baseline's from :data:`test_baselines.BASELINES`."""
    kw = spec["kwargs"]
    if spec["method"] != "micro":
        return simulate_baseline(spec, n, grads, density=DENSITY)
    return simulate_micro(grads, per_rank_thresholds(traces), n,
                          judge=kw.get("judge", "drift"),
                          density=kw.get("density", DENSITY), **common_arguments(spec))


def norm(x: torch.Tensor) -> float:
    """L2 norm in float64, scaled so that 1e200 entries do not overflow."""
    scale = float(x.abs().max()) if x.numel() else 0.0
    return scale * float((x.double() / scale).norm()) if scale else 0.0


def check(results, runs, config, rtol, atol, name=None):
    """Every rank's exchanged gradient, residual, residual norm and non-finite flag equal the
    simulation's at every iteration; returns the simulations by label."""
    n = len(results)
    dtype = getattr(torch, config.get("dtype", "float32"))
    grads = [[injected_gradient(r, t, config["numel"], config.get("seed", 0), dtype,
                                config.get("inject", ())) for r in range(n)]
             for t in range(config["iterations"])]
    sims = {}
    for spec in runs:
        label = spec["label"]
        traces = [res.value[name][label] if name else res.value[label] for res in results]
        sims[label] = want = simulate(spec, n, grads, traces)
        for t, w in enumerate(want):
            for r in range(n):
                got, context = traces[r][t], (name, label, t, r)
                g = torch.tensor(got["grad"], dtype=dtype)
                assert got["grad_dtype"] == str(dtype), context
                assert got["residual_dtype"] == str(dtype), context
                assert got["nonfinite"] == (not w["finite"]), context
                if w["finite"]:
                    torch.testing.assert_close(g, w["grad"], rtol=rtol, atol=atol,
                                               msg=lambda m, c=context: f"{c}: {m}")
                else:
                    assert bool(torch.isnan(g).all()), context
                residual = torch.tensor(got["residual"], dtype=dtype)
                torch.testing.assert_close(residual, w["residual"][r], rtol=rtol, atol=atol,
                                           msg=lambda m, c=context: f"{c}: {m}")
                assert got["residual_norm"] == pytest.approx(norm(w["residual"][r]),
                                                             rel=1e-4), context
    return sims


# ----- 1. dtypes ------------------------------------------------------------------------


def test_layout_dtype_rule():
    """The flat buffers take the promoted dtype of all parameters, float32 at least."""
    def layout(*dtypes):
        return FlatLayout([(f"p{i}", torch.nn.Parameter(torch.zeros(3, dtype=d)))
                           for i, d in enumerate(dtypes)]).dtype

    assert layout(torch.float16) == torch.float32
    assert layout(torch.bfloat16, torch.float16) == torch.float32
    assert layout(torch.float32) == torch.float32
    assert layout(torch.float16, torch.float64, torch.float32) == torch.float64
    assert FlatLayout([]).dtype == torch.float32


def test_layout_views_cut_the_flat_vector_in_name_order():
    """Each view has its parameter's shape and writes land in the flat vector at that
    parameter's offset (sizes summed by hand here)."""
    shapes = [(2, 3), (4,), (1, 1, 5)]
    layout = FlatLayout([(f"p{i}", torch.nn.Parameter(torch.zeros(s)))
                         for i, s in enumerate(shapes)])
    flat = torch.zeros(6 + 4 + 5)
    views = layout.views(flat)
    assert [tuple(v.shape) for v in views] == shapes
    for i, v in enumerate(views):
        v.fill_(i + 1)
    assert flat.tolist() == [1.0] * 6 + [2.0] * 4 + [3.0] * 5


def test_kept_views_are_handed_out_again_until_one_stops_being_its_slice():
    """The views of a buffer that lives across steps are built once; one that an in-place
    ``t_()``, ``unsqueeze_()`` or ``set_()`` moved or reshaped (as a user's code may do to
    a ``.grad``) makes them all be rebuilt, and a new buffer gets views of its own."""
    shapes = [(2, 3), (4,), (3, 3)]
    layout = FlatLayout([(f"p{i}", torch.nn.Parameter(torch.zeros(s)))
                         for i, s in enumerate(shapes)])
    flat, other = torch.zeros(6 + 4 + 9), torch.zeros(6 + 4 + 9)
    views = layout.kept_views(flat)
    assert layout.kept_views(flat) is views
    assert layout.kept_views(other) is not views and layout.kept_views(flat) is views
    for damage in (lambda v: v[2].t_(), lambda v: v[1].unsqueeze_(0),
                   lambda v: v[0].set_(torch.zeros(2, 3))):
        damage(views)
        fresh = layout.kept_views(flat)
        assert fresh is not views
        assert [tuple(v.shape) for v in fresh] == shapes
        for i, v in enumerate(fresh):
            v.fill_(i + 1)
        assert flat.tolist() == [1.0] * 6 + [2.0] * 4 + [3.0] * 9
        views = fresh


def test_float64_model_equals_float64_simulation():
    """A float64 model's exchange keeps float64 in every method: equal to a float64
    simulation of n workers to float64 precision (a float32 round trip is 1e-8 off)."""
    runs = every_method()
    config = {"runs": runs, "numel": NUMEL, "iterations": 5, "seed": 3, "dtype": "float64"}
    results = run_ranks("ranks_reducer_defects:traces", np=2, kwargs=config)
    check(results, runs, config, rtol=1e-13, atol=1e-16)


def test_mixed_dtypes_write_back_in_each_parameters_dtype():
    """float64 + float32 + float16 + bfloat16 parameters: one float64 residual; each
    parameter receives the float64 result cast to its own dtype."""
    sizes = {"a": (120, "float64"), "b": (100, "float32"), "c": (50, "float16"),
             "d": (30, "bfloat16")}
    iterations, n = 4, 2
    results = run_ranks("ranks_reducer_defects:mixed_dtypes", np=n,
                        kwargs={"sizes": sizes, "iterations": iterations, "seed": 1})
    numel = sum(size for size, _ in sizes.values())
    grads = []
    for t in range(iterations):
        grads.append([])
        for r in range(n):
            flat, parts, start = injected_gradient(r, t, numel, 1, torch.float64), [], 0
            for size, dtype in sizes.values():  # as the rank body casts it
                parts.append(flat[start:start + size].to(getattr(torch, dtype)).double())
                start += size
            grads[t].append(torch.cat(parts))
    sim = simulate_micro(grads, per_rank_thresholds([r.value for r in results]), n,
                         judge="drift", density=0.05)
    for res in results:
        for t, rec in enumerate(res.value):
            assert rec["residual_dtype"] == "torch.float64"
            torch.testing.assert_close(torch.tensor(rec["residual"], dtype=torch.float64),
                                       sim[t]["residual"][res.rank], rtol=1e-13, atol=1e-16)
            start = 0
            for name, (size, dtype) in sizes.items():
                want = sim[t]["grad"][start:start + size].to(getattr(torch, dtype))
                assert rec["grad_dtypes"][name] == str(want.dtype), (name, t)
                got = torch.tensor(rec["grads"][name], dtype=torch.float64).to(want.dtype)
                torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-16,
                                           msg=lambda m, c=(name, t): f"{c}: {m}")
                start += size


# ----- 2. float16 values -----------------------------------------------------------------


def test_fp16_rounding_error_stays_in_the_residual():
    """Where a rank sent a float16 value its residual keeps ``a - float(half(a))``."""
    runs = every_method(fp16_values=True)
    config = {"runs": runs, "numel": NUMEL, "iterations": 5, "seed": 4}
    results = run_ranks("ranks_reducer_defects:traces", np=2, kwargs=config)
    check(results, runs, config, rtol=1e-6, atol=1e-9)


def _overflow(spec, big, iteration=2):
    """Both ranks hold ``big`` at a coordinate that ``spec``'s method sends at
    ``iteration`` (MiCRO: 200 lies in part 1, which rank 1 owns at iteration 2)."""
    if spec["method"] == "randomk":
        return [[iteration, None, int(shared_indices(NUMEL, K, 0, iteration)[0]), big]]
    return [[iteration, None, 200, big]]


#: Backends, and the selection path: "torch" is the device path a GPU takes, where the
#: status word and its bounded flag are computed on the device (HOROVOD_MICRO_SELECT=torch).
PATHS = [("gloo", "native"), ("mpi", "native"), ("gloo", "torch")]


def _env(select):
    return {"HOROVOD_MICRO_SELECT": "torch"} if select == "torch" else {}


@pytest.mark.parametrize("backend_,select", PATHS)
def test_fp16_overflow_is_a_nonfinite_step_on_every_rank(backend_, select):
    """|a| > 65504 cannot travel as float16 (nor can a sum beyond it): every rank treats
    the step as non-finite, the overflowing coordinate leaves the residuals, the next
    step is normal. (Each backend's allreduce must hand every rank the same aggregate;
    a rank's bounded flag must not hide a sum that overflows.)"""
    configs = {}
    for spec in every_method(fp16_values=True):
        configs[spec["label"]] = {"runs": [spec], "numel": NUMEL, "iterations": 4, "seed": 5,
                                  "inject": _overflow(spec, 1e5)}
    # 40000 on each of 2 ranks: each value fits in float16, their sum does not.
    summed = run("micro_sum", "micro", density=DENSITY, fp16_values=True, op="sum")
    configs["micro_sum"] = {"runs": [summed], "numel": NUMEL, "iterations": 4, "seed": 5,
                            "inject": _overflow(summed, 40000.0)}
    results = run_ranks("ranks_reducer_defects:suite", np=2, backend=backend_,
                        kwargs={"configs": configs}, env=_env(select))
    for name, config in configs.items():
        sims = check(results, config["runs"], config, rtol=1e-6, atol=1e-9, name=name)
        assert [h["finite"] for h in sims[name]] == [True, True, False, True], name


# ----- 3. non-finite steps -----------------------------------------------------------------


@pytest.mark.parametrize("backend_,select", PATHS)
def test_nonfinite_step_keeps_the_finite_residual(backend_, select):
    """NaN, +Inf and -Inf in rank 1's gradient at iteration 2 (the +Inf in the part rank 1
    owns, so MiCRO sends it): every rank gets NaN; each residual keeps its finite entries;
    only non-finite entries and the coordinates of non-finite aggregates become 0."""
    runs = every_method()
    inject = [[2, 1, 3, math.nan], [2, 1, 7, -math.inf], [2, 1, 160, math.inf]]
    config = {"runs": runs, "numel": NUMEL, "iterations": 4, "seed": 6, "inject": inject}
    results = run_ranks("ranks_reducer_defects:traces", np=2, backend=backend_,
                        kwargs=config, env=_env(select))
    sims = check(results, runs, config, rtol=1e-6, atol=1e-9)
    for label, sim in sims.items():
        assert [h["finite"] for h in sim] == [True, True, False, True], label
        # The test has teeth: the step's selected coordinates hold finite residual mass.
        # On rank 0 at most 3, 7 and 160 (where the aggregate can be non-finite) are 0.
        assert int(torch.count_nonzero(sim[2]["residual"][0])) >= NUMEL - 3, label
    # The controller is left unchanged by a non-finite step (its state after step 2, the
    # non-finite one, is its state after step 1).
    micro = results[0].value["micro"]
    assert micro[2]["controller"] == micro[1]["controller"]


# ----- 4. finiteness check ------------------------------------------------------------------


@pytest.mark.parametrize("select", ["native", "torch"])
def test_huge_finite_values_are_not_mistaken_for_overflow(select):
    """A finite 1e20 in float32 (its square overflows float32) and 1e200 in float64 (its
    square overflows float64) are ordinary values: finite steps, finite residual norms
    (on the device path too, where the entries, not the square, decide on the device)."""
    configs = {
        "float32": {"runs": every_method(), "numel": NUMEL, "iterations": 4, "seed": 7,
                    "inject": [[2, None, 200, 1e20], [2, 1, 20, -1e20]]},
        "float64": {"runs": every_method(), "numel": NUMEL, "iterations": 4, "seed": 7,
                    "dtype": "float64", "inject": [[2, None, 200, 1e200], [2, 1, 20, 1e200]]},
    }
    results = run_ranks("ranks_reducer_defects:suite", np=2, kwargs={"configs": configs},
                        env=_env(select))
    for name, config in configs.items():
        rtol, atol = (1e-6, 1e-9) if name == "float32" else (1e-13, 1e-16)
        sims = check(results, config["runs"], config, rtol=rtol, atol=atol, name=name)
        assert all(h["finite"] for sim in sims.values() for h in sim), name
        # Some residual held the huge value after the step (it was not sent everywhere).
        big = 1e19 if name == "float32" else 1e199
        assert any(norm(sim[2]["residual"][r]) > big
                   for sim in sims.values() for r in range(2)), name


# ----- 9. collective errors -----------------------------------------------------------------


@pytest.mark.parametrize("backend_", ["gloo", "mpi"])
def test_collective_error_leaves_the_residual_as_before(backend_):
    """Rank 1's embedding gradient is sparse: every rank raises CollectiveInputError, and
    every rank's residual and iteration are exactly those before the failed step; later
    steps go on as if it never happened."""
    runs = every_method()
    config = {"runs": runs, "numel": NUMEL, "iterations": 4, "fail_before": 2, "seed": 8}
    results = run_ranks("ranks_reducer_defects:collective_error", np=2, backend=backend_,
                        kwargs=config)
    for res in results:
        for spec in runs:
            got = res.value[spec["label"]]
            assert "rank 1" in got["error"] and "sparse" in got["error"], got["error"]
            assert got["residual_restored"], (res.rank, spec["label"])
            assert got["iteration_restored"], (res.rank, spec["label"])
    records = {spec["label"]: [res.value[spec["label"]]["records"] for res in results]
               for spec in runs}
    for spec in runs:
        check_records(records[spec["label"]], spec, config)


def check_records(traces, spec, config):
    """The successful steps of ``collective_error`` equal the simulation without the
    failed attempt."""
    n = len(traces)
    grads = [[injected_gradient(r, t, config["numel"], config["seed"]) for r in range(n)]
             for t in range(config["iterations"])]
    want = simulate(spec, n, grads, traces)
    for t, w in enumerate(want):
        for r in range(n):
            got = traces[r][t]

            def msg(m, c=(spec["label"], t, r)):
                return f"{c}: {m}"

            torch.testing.assert_close(torch.tensor(got["grad"]), w["grad"], rtol=1e-6,
                                       atol=1e-9, msg=msg)
            torch.testing.assert_close(torch.tensor(got["residual"]), w["residual"][r],
                                       rtol=1e-6, atol=1e-9, msg=msg)


def test_grad_views_in_place_equal_fresh_grads():
    """``zero_grad(set_to_none=False)`` makes backward accumulate into the previous step's
    output views, the buffer that the next step builds ``a_t`` in: same result as fresh
    gradients, and as the simulation."""
    numel, iterations = NUMEL, 4
    results = run_ranks("ranks_reducer_defects:grad_views", np=2,
                        kwargs={"numel": numel, "iterations": iterations, "seed": 9})
    grads = [[injected_gradient(r, t, numel, 9) for r in range(2)] for t in range(iterations)]
    sim = simulate_micro(grads, per_rank_thresholds(
        [r.value["set_to_none=True"] for r in results]), 2, judge="drift", density=0.05)
    for res in results:
        fresh, in_place = res.value["set_to_none=True"], res.value["set_to_none=False"]
        assert all(rec["grad_is_view"] for rec in in_place)
        assert in_place == [dict(rec, grad_is_view=True) for rec in fresh]
        for t, rec in enumerate(in_place):
            torch.testing.assert_close(torch.tensor(rec["grad"]), sim[t]["grad"], rtol=1e-6,
                                       atol=1e-9)
            torch.testing.assert_close(torch.tensor(rec["residual"]),
                                       sim[t]["residual"][res.rank], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("method", ["micro", "topk", "powersgd"])
def test_a_parameter_frozen_after_wrapping_keeps_its_residual(method):
    """While ``2.weight`` is frozen (steps 3-5 on every rank) its leftover residual is
    neither sent nor cleared and the weight does not move; unfrozen, its residual takes
    part again. The weight's slice of the flat vector is counted here from the parameters
    in name order (0.bias 32, 0.weight 512, 2.bias 4, then 2.weight's 128)."""
    results = run_ranks("ranks_reducer_defects:frozen_midway", np=2, kwargs={"method": method})
    start, end = 32 + 512 + 4, 32 + 512 + 4 + 128
    for r in results:
        steps = r.value["steps"]
        held = steps[2]["residual"][start:end]
        assert any(v != 0.0 for v in held), "a leftover residual to keep"
        for t in (3, 4, 5):
            assert not steps[t]["has_grad"]
            assert steps[t]["weight"] == steps[2]["weight"], t
            assert steps[t]["residual"][start:end] == held, (method, t)
        # Unfrozen: the weight trains again, and its residual moves again.
        assert steps[7]["weight"] != steps[5]["weight"]
        assert steps[7]["residual"][start:end] != held
