"""The foundation: Horovod as the set-up builds it runs real collectives on Gloo and MPI ranks."""

from multirank import run_ranks


def expected(size):
    """What ``ranks_stack.collectives`` must return, computed in one process."""
    gathered = [100 * r + i for r in range(size) for i in range(r + 1)]
    total = sum(r + 1 for r in range(size))
    return {"gathered": gathered, "gathered_empty": [1.0] * sum(range(size)),
            "summed": [float(total)] * 5, "averaged": [total / size] * 3}


def test_collectives_match_single_process_computation(backend):
    results = run_ranks("ranks_stack:collectives", np=2, backend=backend)
    want = expected(2)
    for r in results:
        assert r.value["rank"] == r.rank and r.value["size"] == 2
        for key, value in want.items():
            assert r.value[key] == value, (r.rank, key)
        # The controller really is the one asked for.
        assert r.value["mpi" if backend == "mpi" else "gloo"] is True


def test_three_ranks_oversubscribed():
    results = run_ranks("ranks_stack:collectives", np=3, backend="gloo")
    want = expected(3)
    for r in results:
        for key, value in want.items():
            assert r.value[key] == value, (r.rank, key)
