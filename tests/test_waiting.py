"""How a rank waits for the others in a collective: asleep on Gloo, spinning on MPI.

Horovod 0.28.1's ``synchronize`` spins until the operation is done; on Gloo, ranks that
share cores with their peers (more ranks than cores) then slow the very ranks they wait
for, so ``horovod_micro.waiting`` sleeps between looks there. On MPI it keeps Horovod's
wait (measured faster there). ``HOROVOD_MICRO_WAIT`` overrides either way; each test
checks a default against its override, which also shows that the measurement tells the two
apart."""

import pytest
from multirank import run_ranks

LATE = 1.0  # seconds rank 1 reaches each exchange after rank 0
STEPS = 3


def _waiting_rank(method, backend, env=None):
    results = run_ranks("ranks_waiting:late_peer", np=2, backend=backend,
                        kwargs={"method": method, "late": LATE, "steps": STEPS}, env=env)
    # Every rank holds the mean of the ranks' gradients (inputs 1 and 2: 1.5 everywhere).
    for r in results:
        assert r.value["grad"] == pytest.approx([1.5] * 64)
    return results[0].value


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
@pytest.mark.parametrize("method", ["micro", "none"])
def test_a_rank_waiting_for_a_late_peer_sleeps_on_gloo(method, backend):
    """Rank 0 waits about LATE seconds per step for rank 1 (MiCRO in its exchange's first
    collective, dense in synchronize()). Asleep (Gloo's default, or HOROVOD_MICRO_WAIT=sleep)
    its main thread spends a small part of that wait on a core; with Horovod's wait (MPI's
    default, or HOROVOD_MICRO_WAIT=spin) nearly all of it."""
    override = {"gloo": "spin", "mpi": "sleep"}[backend]
    default = _waiting_rank(method, backend)
    other = _waiting_rank(method, backend, env={"HOROVOD_MICRO_WAIT": override})
    asleep, spinning = (default, other) if backend == "gloo" else (other, default)
    for run in (asleep, spinning):
        assert run["wall"] > 0.8 * LATE * STEPS, run  # rank 0 did wait for rank 1
    assert asleep["cpu"] < 0.25 * asleep["wall"], asleep
    assert spinning["cpu"] > 0.5 * spinning["wall"], spinning


def test_an_unknown_wait_setting_is_refused():
    results = run_ranks("ranks_waiting:late_peer", np=2, allow_errors=True,
                        kwargs={"method": "micro", "late": 0.0, "steps": 1},
                        env={"HOROVOD_MICRO_WAIT": "busy"})
    for r in results:
        assert not r.ok and r.error_type == "ValueError"
        assert "HOROVOD_MICRO_WAIT='busy'" in r.message
