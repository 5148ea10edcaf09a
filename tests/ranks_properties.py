"""Rank body of tests/test_properties.py: Hypothesis explores the optimizer's inputs on real
ranks.

Every rank runs the same derandomized search (``derandomize=True``, no database), so every
rank draws the same examples in the same order, and each example's verdict is agreed
collectively before it is judged: all ranks pass, fail and shrink alike. Per example (model
shapes and dtype, method, density, ``backward_passes_per_step``, steps, seed), after every
exchange:

* mass is conserved: the sum over ranks of (old residual + gradient - new residual) is
  n times the aggregate (``op=hvd.Average``), to the rounding of the parameters' dtype;
* after training, every rank holds the same weights;
* a density that selects nothing from the model raises the same error on every rank.
"""

from __future__ import annotations

import horovod.torch as hvd
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import horovod_micro as hvm

METHODS = ["micro", "topk", "gtopk", "randomk", "threshold", "cltk", "powersgd"]
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16}

CASES = st.fixed_dictionaries({
    "shapes": st.lists(st.lists(st.integers(1, 12), min_size=1, max_size=3),
                       min_size=1, max_size=4),
    "dtype": st.sampled_from(sorted(DTYPES)),
    "method": st.sampled_from(METHODS),
    # Mostly densities that select something; some so low that nothing is selected.
    "density": st.one_of(st.floats(0.05, 1.0), st.floats(0.001, 0.05)),
    "bpps": st.integers(1, 3),
    "steps": st.integers(1, 4),
    "seed": st.integers(0, 2**16),
})


def _compression(method: str, density: float):
    if method == "threshold":
        return hvm.Compression.threshold(density=density)
    if method == "powersgd":  # no density: the rank of the approximation, 1 to 4
        # min_compression 2: the drawn shapes (sides up to 12) are then compressed often
        return hvm.Compression.powersgd(rank=1 + int(density * 3.999), min_compression=2.0)
    return getattr(hvm.Compression, method)(density=density)


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).double() for t in tensors])


def run_case(case: dict, tag: str) -> dict:
    """One example on every rank; what this rank saw (the caller agrees on a verdict)."""
    torch.manual_seed(case["seed"])
    dtype = DTYPES[case["dtype"]]
    params = [torch.nn.Parameter(torch.randn(shape).to(dtype)) for shape in case["shapes"]]
    named = [(f"p{i:02d}", p) for i, p in enumerate(params)]
    try:
        opt = hvm.DistributedOptimizer(
            torch.optim.SGD(params, lr=0.01, momentum=0.9), named_parameters=named,
            compression=_compression(case["method"], case["density"]),
            backward_passes_per_step=case["bpps"], zero_copy=False)
    except (ValueError, hvm.CollectiveInputError) as error:
        return {"error": f"{type(error).__name__}: {error}"}
    n, worst = hvd.size(), 0.0
    eps = torch.finfo(dtype).eps
    for step in range(case["steps"]):
        opt.zero_grad()
        for backward in range(case["bpps"]):
            gen = torch.Generator().manual_seed(
                case["seed"] * 7919 + 101 * hvd.rank() + 13 * step + backward)
            loss = sum((p.float() * torch.randn(p.shape, generator=gen)).sum() for p in params)
            loss.backward()
        before = opt.state_dict()["horovod_micro"]["residual"].double()
        grads = _flat(p.grad for p in params)
        opt.synchronize()
        after = opt.state_dict()["horovod_micro"]["residual"].double()
        aggregate = _flat(p.grad for p in params)
        sent = before + grads - after
        total = hvd.allreduce(sent, op=hvd.Sum, name=f"{tag}.mass.{step}")
        # The aggregate went into .grad in the parameters' dtype: its rounding, n times.
        tolerance = n * aggregate.abs() * eps + 1e-6 * (1.0 + total.abs())
        worst = max(worst, float(((total - n * aggregate).abs() / tolerance).max()))
        with opt.skip_synchronize():
            opt.step()
    weights = _flat(params)
    everyone = hvd.allgather(weights.unsqueeze(0), name=f"{tag}.weights")
    return {"mass_ratio": worst, "same_weights": bool((everyone == everyone[0]).all()),
            "finite": bool(torch.isfinite(weights).all())}


def explore(examples: int) -> dict:
    """Run ``examples`` Hypothesis examples; the cases seen, and the verdict."""
    seen = []

    @settings(max_examples=examples, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck), print_blob=False)
    @given(case=CASES)
    def optimizer_keeps_its_promises(case):
        tag = f"prop.{len(seen)}"
        mine = run_case(case, tag)
        seen.append({"case": case, "result": mine})
        everyone = hvd.allgather_object(mine, name=f"{tag}.verdict")
        errors = {r.get("error") for r in everyone}
        if any(errors - {None}):
            # A configuration the method refuses: the same error on every rank.
            assert len(errors) == 1, (case, everyone)
            assert "selects no element" in errors.pop(), (case, everyone)
            return
        for result in everyone:
            assert result["mass_ratio"] <= 1.0, (case, everyone)
            assert result["same_weights"] and result["finite"], (case, everyone)

    optimizer_keeps_its_promises()
    return {"examples": len(seen),
            "refused": sum("error" in s["result"] for s in seen),
            "methods": sorted({s["case"]["method"] for s in seen}),
            "dtypes": sorted({s["case"]["dtype"] for s in seen}),
            "bpps": sorted({s["case"]["bpps"] for s in seen})}
