import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from multirank import run_ranks  # noqa: E402


@pytest.fixture(params=["gloo", "mpi"])
def backend(request):
    """Runs a test once on Gloo ranks and once on MPI ranks."""
    return request.param


@pytest.fixture
def ranks():
    """``ranks(target, np=2, backend="gloo", kwargs=None, ...)``: see tests/multirank.py."""
    return run_ranks
