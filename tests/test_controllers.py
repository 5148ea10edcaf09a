"""MiCRO's controller option and the controllers' state, without ranks (fast)."""

import math
import random

import pytest

import horovod_micro as hvm
from horovod_micro.compressors.micro.density_controller import DensityController, PaperController
from horovod_micro.compressors.micro.part_controller import PartController, closest_step


def test_unknown_controller_is_a_config_error():
    with pytest.raises(ValueError, match="unknown controller 'pid'.*'bounded'"):
        hvm.Compression.micro(0.01, controller="pid")


def test_initial_threshold_only_for_shared_threshold_controllers():
    with pytest.raises(ValueError, match="initial_threshold"):
        hvm.Compression.micro(0.01, initial_threshold=0.1)
    assert hvm.Compression.micro(0.01, initial_threshold=0.1, controller="paper")


def test_default_is_bounded_and_config_names_it():
    assert hvm.Compression.micro(0.01).config()["controller"] == "bounded"
    # Left out for newton, so that states written before the option still load.
    assert "controller" not in hvm.Compression.micro(0.01, controller="newton").config()


@pytest.mark.parametrize("capacity", [0, -3, 2.5, True, "big"])
def test_capacity_must_be_slots_or_exact(capacity):
    with pytest.raises(ValueError, match="capacity must be a positive integer"):
        hvm.Compression.micro(0.01, capacity=capacity)


class _Comm:
    def __init__(self, size: int):
        self.size, self.rank = size, 0


@pytest.mark.parametrize("n", [2, 3, 8, 16])
def test_slots_follow_the_controller(n):
    """ceil(1.2 k / n) slots with the bounded controller, at most a part; exact sizes with
    the controllers whose counts scatter, or when asked; an integer as given."""
    numel, density = 100_003, 0.01
    k = int(density * numel)

    def slots(**kwargs):
        micro = hvm.Compression.micro(density, **kwargs)
        micro.bind(numel, _Comm(n))
        return micro.slots

    assert slots() == math.ceil(1.2 * k / n)
    assert slots(capacity="exact") is None
    assert slots(controller="newton") is None and slots(controller="scale") is None
    assert slots(capacity=7) == 7
    assert slots(capacity=10**9) == -(-numel // n)  # no more than the largest part
    assert "capacity" not in hvm.Compression.micro(density).config()
    assert hvm.Compression.micro(density, capacity=7).config()["capacity"] == 7


@pytest.mark.parametrize("correct", [True, False])
def test_part_controller_state_round_trips(correct):
    a = PartController(100, [50, 50, 51], 0.01, correct=correct)
    a.observe([30, 40, 20], [3, -2, 7] if correct else [30, 40, 20], [0, 1, 2])
    b = PartController(100, [50, 50, 51], 0.01, correct=correct)
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()
    with pytest.raises(ValueError, match="parts"):
        PartController(100, [75, 76], 0.01, correct=correct).load_state_dict(a.state_dict())


def test_version_1_newton_state_still_loads_and_is_refused_elsewhere():
    old = {"version": 1, "threshold": 0.25, "alpha": 5.0, "excess": 0.1, "engaged": True}
    newton = DensityController(100)
    newton.load_state_dict(old)
    assert newton.threshold == 0.25 and newton.alpha == 5.0
    with pytest.raises(ValueError, match="controller='newton'"):
        PartController(100, [50, 50], 0.01).load_state_dict(old)
    with pytest.raises(ValueError, match="controller='newton'"):
        PaperController(100).load_state_dict(old)
    paper = PaperController(100)
    paper.update(500)
    with pytest.raises(ValueError, match="controller='paper'"):
        newton.load_state_dict(paper.state_dict())


def test_closest_step_equals_a_scan_of_the_ladder():
    """The searches pick what a scan of every step picks: the count closest to the target
    in log ratio, ties toward j = 0."""
    rng = random.Random(1)
    for _ in range(5000):
        counts = sorted((rng.choice([0, 1, 2, 3, 5, 8, 10, 12, 15, 20, 30, 50, 100])
                         for _ in range(200)), reverse=True)
        target = rng.choice([0.7, 3, 9.5, 10, 12, 40])
        up = rng.random() < 0.5
        offset, lo = (100, 0) if up else (150, -rng.randint(1, 40))

        def count(j, offset=offset, counts=counts):
            return counts[min(offset + j, 199)]

        if (count(0) >= target) != up:
            continue
        steps = range(0, 100) if up else range(lo, 1)

        def err(j, target=target, count=count):
            return abs(math.log(max(count(j), 0.5) / target))

        best = min(steps, key=lambda j: (err(j), abs(j)))
        assert closest_step(count, target, lo, None if up else 0) == best
