"""The native one-pass threshold selection agrees with a plain torch computation."""

import math

import pytest
import torch

from horovod_micro.compressors.micro.partition import owned_part, part_bounds
from horovod_micro.selection import ThresholdSelector, native_available


def reference(values, threshold, offset):
    return (torch.nonzero(values.abs() >= threshold).view(-1) + offset).tolist()


def test_native_kernel_is_built():
    # The set-up builds it; a silent fall-back to torch would hide a 10x slowdown.
    assert native_available()


@pytest.mark.parametrize("numel", [0, 1, 31, 32, 33, 1000, 100_003])
@pytest.mark.parametrize("density", [0.0005, 0.01, 0.3])
def test_matches_reference(numel, density):
    gen = torch.Generator().manual_seed(numel)
    values = torch.randn(numel, generator=gen)
    threshold = float(values.abs().quantile(1 - density)) if numel else 1.0
    selector = ThresholdSelector(capacity=4)  # forces the buffer to grow
    got = selector(values, threshold, 17, 10**6)
    assert got.dtype == torch.int32
    assert got.tolist() == reference(values, threshold, 17)


@pytest.mark.parametrize("numel", [0, 5, 31, 32, 33, 1000, 100_003])
@pytest.mark.parametrize("density", [0.0005, 0.01, 0.3])
@pytest.mark.parametrize("path", ["native", "torch"])
def test_with_values_matches_reference(numel, density, path, monkeypatch):
    # The kernel writes each selected value next to its index (the density controller's
    # ladder search reads them); the torch path (forced: what a CUDA tensor takes) gathers.
    if path == "torch":
        monkeypatch.setenv("HOROVOD_MICRO_SELECT", "torch")
    gen = torch.Generator().manual_seed(numel + 1)
    values = torch.randn(numel, generator=gen)
    threshold = float(values.abs().quantile(1 - density)) if numel else 1.0
    selector = ThresholdSelector(capacity=4)  # forces the buffer to grow
    assert selector.use_native == (path == "native")
    indices, got = selector.with_values(values, threshold, 17, 10**6)
    expected = reference(values, threshold, 17)
    assert indices.tolist() == expected
    assert got.tolist() == [values[i - 17].item() for i in expected]  # signs kept, exact


def test_nan_never_selected_and_inf_always():
    values = torch.tensor([math.nan, 1.0, -math.inf, 0.5, math.inf, -2.0] * 11)
    got = ThresholdSelector()(values, 0.9, 0, 1000).tolist()
    assert got == [i for i, v in enumerate(values.tolist()) if abs(v) >= 0.9]


def test_torch_fallback_for_other_dtypes():
    values = torch.randn(500, dtype=torch.float64)
    got = ThresholdSelector()(values, 1.5, 3, 1000)
    assert got.tolist() == reference(values, 1.5, 3)


def test_parts_cover_and_rotate():
    bounds = part_bounds(10, 3)
    assert bounds == [(0, 4), (4, 7), (7, 10)]
    for t in range(6):
        owners = sorted(owned_part(r, t, 3) for r in range(3))
        assert owners == [0, 1, 2]  # exclusive: one owner per part, every iteration
    assert [owned_part(0, t, 3) for t in range(4)] == [0, 1, 2, 0]  # rotation


def test_counts_read_at_once_equal_counts_read_one_by_one():
    """The ladder's counts on the torch path (a GPU) come from one comparison matrix and
    one host read; each must equal the single count, in float32 and float64, with values
    sitting exactly on a threshold, and when the matrix is cut into chunks."""
    from horovod_micro.selection import count_abs_ge, counts_abs_ge_many

    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.float64):
        x = torch.randn(5000, generator=g, dtype=dtype)
        base = float(x.abs().median())
        thresholds = [base * 2.0 ** (j / 64) for j in range(-20, 40)]
        x[:60] = torch.tensor(thresholds, dtype=dtype)  # ties: |x| == threshold counts
        x[60:120] = -torch.tensor(thresholds, dtype=dtype)
        want = [count_abs_ge(x, t) for t in thresholds]
        assert counts_abs_ge_many(x, thresholds) == want
        assert counts_abs_ge_many(x, thresholds, chunk=3 * x.numel()) == want  # 3 rows
    assert counts_abs_ge_many(torch.ones(3), []) == []


@pytest.mark.parametrize("n", [2, 4, 8])
def test_micro_on_the_device_generic_path_equals_simulation(n, monkeypatch):
    """What a GPU runs, on the CPU: HOROVOD_MICRO_SELECT=torch takes the torch selection,
    keeps the squared norm, the status word, the scale and the thresholds on the device
    and reads the bounded controller's ladder counts at once (counts_abs_ge_many); the
    exchange must still be the independent simulation's, step for step."""
    from test_loopback import check_micro

    monkeypatch.setenv("HOROVOD_MICRO_SELECT", "torch")
    check_micro(n, "bounded")


@pytest.mark.parametrize("numel", [0, 5, 31, 32, 33, 1000, 100_003])
@pytest.mark.parametrize("path", ["native", "torch"])
def test_drift_judge_matches_its_definition(numel, path, monkeypatch):
    """DriftSelector selects ``|x| sqrt(wait / age) >= t`` over the bound part, exactly as
    the plain definition (simulation.drift_score) computes it, thresholds placed on the
    scores themselves included; its values are the signed scores; any other tensor (the
    values the ladder counts among) is selected on |x|."""
    from simulation import drift_score

    from horovod_micro.compressors.micro.drift import DriftSelector, stamps

    if path == "torch":
        monkeypatch.setenv("HOROVOD_MICRO_SELECT", "torch")
    gen = torch.Generator().manual_seed(numel + 7)
    acc = torch.randn(numel + 3, generator=gen)
    part = acc[3:]  # a view, as the part of a_t is
    # Iterations past 2^16: the 16-bit stamps have wrapped, the ages must not.
    now, wait = 70_000, 37.0
    last = now - torch.randint(1, 40_000, (numel,), generator=gen).to(torch.int32)
    scores = drift_score(part, now - last, wait)
    selector = DriftSelector(capacity=4)  # forces the buffer to grow
    assert selector.use_native == (path == "native")
    selector.bind(part, stamps(last), now, wait)
    cuts = [float(scores.quantile(q)) for q in (0.5, 0.99)] if numel else [1.0]
    if numel:
        cuts.append(float(scores[numel // 2]))  # a threshold equal to one score
    for cut in cuts:
        expected = (torch.nonzero(scores >= cut).view(-1) + 3).tolist()
        indices, values = selector.with_values(part, cut, 3, 10**6)
        assert indices.tolist() == expected
        signed = drift_score(part, now - last, wait) * part.sign()
        assert values.tolist() == signed[[i - 3 for i in expected]].tolist()
        assert selector(part, cut, 3, 10**6).tolist() == expected
    plain = torch.randn(50, generator=gen)
    assert selector(plain, 0.5, 0, 50).tolist() == reference(plain, 0.5, 0)


def test_drift_ages_are_capped_before_their_stamps_wrap():
    """MiCRO keeps ages in 16-bit stamps: at the first selection of every window of
    AGE_RECAP iterations (now = 1, 1 + AGE_RECAP, ...) ages above AGE_CAP become AGE_CAP,
    so no age reaches 2^16; others stay."""
    import horovod_micro as hvm
    from horovod_micro.compressors.micro.drift import AGE_CAP, AGE_RECAP, ages, stamps
    from horovod_micro.testing.loopback import LoopbackGroup

    micro = hvm.Compression.micro(density=0.5)
    micro.bind(4, LoopbackGroup(1).comm(0))
    now = 1 + 12 * AGE_RECAP  # a window's first iteration
    true_ages = torch.tensor([1, 5_000, AGE_CAP, AGE_CAP + 9_000], dtype=torch.int32)
    micro.ages.load_state_dict(stamps(now - true_ages))
    last = micro.ages.at(torch.device("cpu"), now)
    assert ages(last, now).tolist() == [1, 5_000, AGE_CAP, AGE_CAP]
    # Not again before AGE_RECAP iterations: ages grow, and stay below 2^16 meanwhile.
    later = now + AGE_RECAP - 1
    micro.ages.cap(later)
    assert ages(micro.ages.last, later).tolist() == [t + AGE_RECAP - 1 for t in
                                                     (1, 5_000, AGE_CAP, AGE_CAP)]
    micro.ages.cap(later + 1)
    assert ages(micro.ages.last, later + 1).max() == AGE_CAP


def _true_ages(last: torch.Tensor, now: int) -> list[int]:
    """Ages from 16-bit stamps, restated: ``(now - stamp) mod 2^16``."""
    return [(now - int(s)) % 65536 for s in last.tolist()]


def test_drift_ages_move_to_the_gradients_device_with_their_values():
    """Stamps loaded on the host (a checkpoint) and then asked for on the gradient's
    device keep their values: they were replaced by zeros, so a resumed GPU run lost
    every age. ``cpu:0`` stands in for a second device (torch holds it unequal to
    ``cpu``); gpu_tests/ checks CUDA."""
    import horovod_micro as hvm
    from horovod_micro.compressors.micro.drift import stamps
    from horovod_micro.testing.loopback import LoopbackGroup

    micro = hvm.Compression.micro(density=0.5)
    micro.bind(4, LoopbackGroup(1).comm(0))
    now = 70_000
    micro.ages.load_state_dict(stamps(torch.tensor([now - 1, now - 7, now - 300, now - 2])))
    last = micro.ages.at(torch.device("cpu:0"), now)
    assert _true_ages(last, now) == [1, 7, 300, 2]


def test_no_drift_age_is_zero_where_the_stamps_wrap():
    """Stamps of zero judged at a multiple of 2^16 iterations (what a state written
    before the first selection gives there): every age would be 0, every score infinite or
    NaN. A zero age is a full wrap: the cap makes it AGE_CAP, and the scores are finite."""
    import horovod_micro as hvm
    from horovod_micro.compressors.micro.drift import AGE_CAP, drift_scores
    from horovod_micro.testing.loopback import LoopbackGroup

    micro = hvm.Compression.micro(density=0.5)
    micro.bind(4, LoopbackGroup(1).comm(0))
    now = 3 * 65536
    micro.ages.load_state_dict(torch.zeros(4, dtype=torch.int16))
    last = micro.ages.at(torch.device("cpu"), now)
    assert _true_ages(last, now) == [AGE_CAP] * 4
    scores = drift_scores(torch.tensor([1.0, -2.0, 0.0, 3.0]), last, now, 2.0)
    assert bool(torch.isfinite(scores).all()), scores


def test_a_resumed_drift_judge_caps_its_ages_when_the_uninterrupted_one_does():
    """A compressor loaded from another's state in the middle of a cap window keeps the
    ages the uninterrupted one keeps, at every later iteration, across the next window's
    cap: the loaded one capped every age above AGE_CAP at its first selection, so a
    resumed run judged coordinates older than that otherwise for up to AGE_RECAP
    iterations. Ages restated from the stamps (``_true_ages``)."""
    import horovod_micro as hvm
    from horovod_micro.compressors.micro.drift import AGE_CAP, AGE_RECAP, stamps
    from horovod_micro.testing.loopback import LoopbackGroup

    def bound():
        micro = hvm.Compression.micro(density=0.5)
        micro.bind(6, LoopbackGroup(1).comm(0))
        return micro

    cpu = torch.device("cpu")
    start = 1 + 12 * AGE_RECAP  # a window's first iteration: the uninterrupted run caps
    straight = bound()
    true_ages = torch.tensor([1, 300, 20_000, AGE_CAP, AGE_CAP - 5, 2])
    straight.ages.load_state_dict(stamps(start - true_ages))
    straight.ages.at(cpu, start)
    resume = start + 10_000  # mid-window: two coordinates are now older than AGE_CAP
    straight.ages.at(cpu, resume)
    straight.ages.restart(torch.tensor([0]), resume)
    resumed = bound()
    resumed.load_state_dict(straight.state_dict())
    expected = [1, 300, 20_000, AGE_CAP, AGE_CAP - 5, 2]
    for now in list(range(resume + 1, resume + 40)) + [start + AGE_RECAP - 1,
                                                       start + AGE_RECAP, start + AGE_RECAP + 1]:
        a = _true_ages(straight.ages.at(cpu, now), now)
        b = _true_ages(resumed.ages.at(cpu, now), now)
        assert a == b, (now, a, b)
        if now == resume + 1:
            assert a == [1] + [t + 10_001 for t in expected[1:]], a  # nothing capped yet
    assert max(a) == AGE_CAP + 1  # the next window's cap, one iteration on


def test_a_fresh_drift_judge_at_a_wrap_of_its_stamps_selects_about_k():
    """MiCRO's defaults started fresh at iteration 2^16 - 1, where iteration + 1 is a
    multiple of 2^16 (stamps of 0 there would give every coordinate an age of 0, infinite
    scores and a ladder search that never ends, or an OverflowError): on 2 loopback
    ranks, every one of the first steps applies within 50 % of ``k`` coordinates, as a
    run from iteration 0 does (a fresh coordinate is judged at the mean wait; capped as
    overdue instead, nothing was sent for about 50 steps)."""
    import horovod.torch as hvd

    import horovod_micro as hvm
    from horovod_micro.compressors.base import ReduceOp
    from horovod_micro.layout import FlatLayout
    from horovod_micro.reducer import SparseReducer
    from horovod_micro.testing.loopback import LoopbackGroup

    numel, k = 4096, 40

    def rank_body(comm):
        compression = hvm.Compression.micro(density=0.01)
        param = torch.nn.Parameter(torch.zeros(numel))
        reducer = SparseReducer(FlatLayout([("flat", param)]), compression, comm,
                                ReduceOp(hvd.Average))
        reducer.iteration = 65_535
        gen = torch.Generator().manual_seed(comm.rank)
        counts = []
        for _ in range(5):
            param.grad = torch.randn(numel, generator=gen)
            counts.append(reducer.reduce().global_count)
        return counts

    counts = LoopbackGroup(2).run(rank_body)
    assert counts[0] == counts[1], counts
    assert all(k / 2 <= c <= 1.5 * k for c in counts[0]), counts
