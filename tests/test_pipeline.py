"""``bench/pipeline.py``'s bucket floors (``buckets-B`` and ``parts``) on real Horovod ranks.

The floors' figures in BENCHMARKS.md are only worth something if the floors do the exchange
they claim to. Each rank trains a small MLP whose gradients backward adds into a flat
residual (as the benchmark does), runs the floor for a few steps, and returns what it held
before and after each exchange. Checked here against a plain computation of what the ranks
should hold:

* every rank applies the same coordinates, a non-empty set within the slots;
* the output there is the ranks' mean of ``a_t`` (the residual after backward), and zero
  elsewhere;
* the residual there is zero, and ``a_t`` elsewhere.
"""

from __future__ import annotations

import pytest
from multirank import run_ranks

#: buckets-1, -2 and -4, and MiCRO's parts (``None``)
MODES = (1, 2, 4, None)
STEPS = 3
DENSITY = 0.05


def floor_steps(modes: list, steps: int, density: float) -> dict:
    """On every rank: per mode, per step, ``a_t``, the applied coordinates, the output and the
    residual after the exchange, and the slots' total."""
    import horovod.torch as hvd
    import torch

    from bench.pipeline import BucketFloor
    from horovod_micro.layout import FlatLayout

    torch.set_num_threads(1)
    out = {}
    for mode in modes:
        torch.manual_seed(0)  # the same weights on every rank
        model = torch.nn.Sequential(torch.nn.Linear(20, 40), torch.nn.ReLU(),
                                    torch.nn.Linear(40, 30), torch.nn.ReLU(),
                                    torch.nn.Linear(30, 5))
        layout = FlatLayout(list(model.named_parameters()))
        residual, output = torch.zeros(layout.numel), torch.zeros(layout.numel)
        floor = BucketFloor(layout, density, hvd.size(), hvd.rank(), mode, residual)
        torch.manual_seed(1 + hvd.rank())  # each rank its own data
        steps_out = []
        for t in range(steps):
            for p, g in zip(model.parameters(), layout.views(residual)):
                p.grad = g
            x, y = torch.randn(16, 20), torch.randint(0, 5, (16,))
            torch.nn.functional.cross_entropy(model(x), y).backward()
            a = residual.clone()
            floor.exchange(residual, output, t)
            steps_out.append({"a": a.tolist(), "applied": floor.written.tolist(),
                              "output": output.tolist(), "residual": residual.tolist()})
        slots = sum(c * (1 if mode is None else hvd.size()) for c in floor.capacity)
        out[str(mode)] = {"steps": steps_out, "slots": slots}
    return out


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_the_bucket_floors_exchange_the_ranks_mean_at_shared_coordinates(backend):
    import torch

    results = run_ranks("test_pipeline:floor_steps", np=2, backend=backend,
                        kwargs={"modes": list(MODES), "steps": STEPS, "density": DENSITY})
    ranks = [r.value for r in results]
    for mode in map(str, MODES):
        slots = ranks[0][mode]["slots"]
        for t in range(STEPS):
            held = [rank[mode]["steps"][t] for rank in ranks]
            applied = held[0]["applied"]
            assert all(h["applied"] == applied for h in held), (mode, t)
            assert len(set(applied)) == len(applied), (mode, t)  # no coordinate twice
            assert 0 < len(applied) <= slots, (mode, t, len(applied), slots)
            index = torch.tensor(applied)
            a = torch.tensor([h["a"] for h in held], dtype=torch.float32)
            mean = a.mean(0)
            rest = torch.ones(a.shape[1], dtype=torch.bool)
            rest[index] = False
            for rank, h in enumerate(held):
                output, residual = torch.tensor(h["output"]), torch.tensor(h["residual"])
                torch.testing.assert_close(output[index], mean[index])
                assert not output[rest].any(), (mode, t, rank)
                assert not residual[index].any(), (mode, t, rank)
                assert torch.equal(residual[rest], a[rank][rest]), (mode, t, rank)
        # Something was chosen in every step, and more than a third of k on average.
        k = DENSITY * len(ranks[0][mode]["steps"][0]["a"])
        counts = [len(ranks[0][mode]["steps"][t]["applied"]) for t in range(STEPS)]
        assert sum(counts) / STEPS > k / 3, (mode, counts, k)
