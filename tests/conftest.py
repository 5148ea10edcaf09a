import pytest
from multirank import run_ranks


@pytest.fixture(params=["gloo", "mpi"])
def backend(request):
    """Runs a test once on Gloo ranks and once on MPI ranks."""
    return request.param


@pytest.fixture
def ranks():
    """``ranks(target, np=2, backend="gloo", kwargs=None, ...)``: see tests/multirank.py."""
    return run_ranks
