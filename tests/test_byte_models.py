"""Every registered method's byte model (``Compressor.modeled_bytes``, what projections to
other worker counts use) against the bytes its exchange counts on real Gloo ranks, at n = 2
and 3. Derived from the registry: a new method is checked without editing this file."""

import pytest
import torch
from multirank import run_ranks

import horovod_micro as hvm
from horovod_micro.compression import takes_density
from horovod_micro.compressors import registry

DENSITY, STEPS = 0.05, 4
SHAPES = [(40, 30), (40,), (5, 40), (5,)]  # the rank body's two Linear layers
NUMEL = sum(torch.Size(s).numel() for s in SHAPES)


def example(name: str) -> dict:
    """Arguments for a method: a density where it takes one, else its defaults."""
    return {"density": DENSITY} if takes_density(getattr(hvm.Compression, name)) else {}


def model_of(name: str, n: int) -> float:
    """The modeled bytes of the busiest rank."""
    compressor = getattr(hvm.Compression, name)(**example(name))
    compressor.bind_shapes(SHAPES)
    return compressor.modeled_bytes(n, NUMEL)


#: Methods whose count is the data's: the hard threshold selects whatever the gradient
#: holds above a threshold it does not steer (its model is Top-k's exchange at the target
#: count, checked here through Top-k).
COUNT_FROM_DATA = {"threshold"}


@pytest.mark.parametrize("n", [2, 3])
def test_every_method_sends_what_its_byte_model_says(n):
    """Exactly, every step, for every method whose exchange has a fixed size (fixed slots,
    a fixed count, fixed factors)."""
    methods = {name: example(name) for name in registry.names()}
    results = run_ranks("ranks_registry:traffic", np=n,
                        kwargs={"methods": methods, "steps": STEPS})
    for name in set(methods) - COUNT_FROM_DATA:
        modeled = model_of(name, n)
        for t in range(STEPS):
            rows = [r.value[name][t] for r in results]
            busiest = max(row["sent"] for row in rows)
            assert busiest == pytest.approx(modeled, abs=1), (name, n, t, rows)


def test_every_registered_method_has_a_byte_model():
    for name in registry.names():
        assert model_of(name, 4) > 0, name
