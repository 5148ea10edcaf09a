"""Horovod renegotiates a collective whose shape changed since the last step (its response
cache is keyed by name and shape). MiCRO's default exchange keeps one shape, so after the
first steps every collective is a cache hit; exact sizes renegotiate every step."""

import pytest
from multirank import run_ranks

TRACE = {"HOROVOD_LOG_LEVEL": "trace"}


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_no_renegotiation_after_the_first_steps(backend):
    results = run_ranks("ranks_micro:negotiations", np=2, backend=backend,
                        kwargs={"steps": 30}, env=TRACE)
    for r in results:
        per_step = r.value["per_step"]
        assert len(per_step) == 30
        assert r.value["slots"] is not None
        assert sum(per_step[:5]) > 0  # the first steps do negotiate (the log is read)
        assert per_step[5:] == [0] * 25, per_step


def test_exact_sizes_renegotiate_every_step():
    """The same run with exact sizes: the trace shows a negotiation in every step, so the
    test above would see one if the shapes changed."""
    results = run_ranks("ranks_micro:negotiations", np=2,
                        kwargs={"steps": 12, "capacity": "exact"}, env=TRACE)
    for r in results:
        per_step = r.value["per_step"]
        assert r.value["slots"] is None
        assert all(count >= 1 for count in per_step[5:]), per_step


@pytest.mark.parametrize("method", ["topk", "gtopk", "randomk", "powersgd"])
def test_fixed_count_methods_are_cache_hits(method):
    """Top-k, gTop-k and Random-k send exactly k per rank, PowerSGD its factors: fixed
    shapes already."""
    options = {"rank": 2} if method == "powersgd" else None
    results = run_ranks("ranks_micro:negotiations", np=2,
                        kwargs={"steps": 10, "method": method, "options": options},
                        env=TRACE)
    for r in results:
        assert r.value["per_step"][5:] == [0] * 5, r.value["per_step"]
