"""Momentum masking on real ranks (Gloo and MPI): after each step the wrapped optimizer's
momentum buffer is zero exactly where the sparse aggregate arrived, and every other
coordinate follows torch's SGD. Checked against a plain recomputation of the SGD update
from the logged weights, buffers and aggregate, not against the code under test."""

import pytest
import torch
from multirank import run_ranks
from ranks_momentum import LR, MOMENTUM, WEIGHT_DECAY

import horovod_micro as hvm
from horovod_micro.momentum import mask_momentum


def kept(lr, nesterov, masking):
    """The fraction of an arrived burst the momentum keeps carrying, restated: none with
    masking on, all with it off; the default scales the carry so that the burst's whole
    effect is at most ``0.05 / lr`` of its unmasked one, ``1 / (1 - m)``: Nesterov applies
    a buffer's burst ``1 + m`` at once and ``c m^2 / (1 - m)`` later, heavy ball ``1`` and
    ``c m / (1 - m)``."""
    if masking is not None:
        return 0.0 if masking else 1.0
    m = MOMENTUM
    if lr <= 0.05:
        return 1.0
    share = 0.05 / lr
    c = (share - (1 - m * m)) / (m * m) if nesterov else (share - (1 - m)) / m
    return min(1.0, max(0.0, c))


def expected_step(step, nesterov, lr, kept):
    """torch.optim.SGD's update (momentum, dampening 0, weight decay), then the mask."""
    w = torch.tensor(step["weights_before"], dtype=torch.float64)
    buf = torch.tensor(step["buffers_before"], dtype=torch.float64)
    g = torch.tensor(step["aggregate"], dtype=torch.float64)
    d = g + WEIGHT_DECAY * w
    first = not buf.any()
    buf = d.clone() if first else MOMENTUM * buf + d
    update = d + MOMENTUM * buf if nesterov else buf
    w = w - lr * update
    unmasked = buf.clone()
    buf[g != 0] *= kept
    return w, buf, unmasked


@pytest.mark.parametrize("backend,np,method,masking,nesterov,lr", [
    ("gloo", 2, "micro", True, True, LR),
    ("gloo", 3, "micro", True, False, LR),
    ("mpi", 2, "micro", True, True, LR),
    ("gloo", 8, "micro", None, True, LR),     # the default, at 0.05: nothing masked
    ("gloo", 3, "micro", None, True, 0.15),   # above: the carry scaled (Nesterov)
    ("gloo", 2, "micro", None, False, 0.1),   # (heavy ball)
    ("gloo", 8, "micro", False, True, 0.4),   # as published: the momentum keeps the burst
    ("gloo", 2, "topk", None, True, 0.4),     # the baselines never mask by default
    ("gloo", 2, "gtopk", True, True, LR),
])
def test_momentum_is_cleared_where_the_aggregate_arrived(backend, np, method, masking,
                                                         nesterov, lr):
    results = run_ranks("ranks_momentum:masked_steps", np=np, backend=backend,
                        kwargs={"method": method, "masking": masking,
                                "nesterov": nesterov, "lr": lr})
    fraction = kept(lr, nesterov, masking if method == "micro" or masking else False)
    first = results[0].value
    assert first["masking"] is (method == "micro" if masking is None else masking)
    for r in results[1:]:  # identical weights and buffers on every rank
        assert r.value["steps"] == first["steps"]
    acted = False
    for step in first["steps"]:
        w, buf, unmasked = expected_step(step, nesterov, lr, fraction)
        assert torch.tensor(step["weights"], dtype=torch.float64) == pytest.approx(
            w, rel=1e-5, abs=1e-6)
        got = torch.tensor(step["buffers"], dtype=torch.float64)
        assert got == pytest.approx(buf, rel=1e-5, abs=1e-6)
        arrived = torch.tensor(step["aggregate"]) != 0
        assert 0 < int(arrived.sum()) <= step["applied"]
        acted |= bool((got - unmasked).abs().max() > 1e-4)
    assert acted is (fraction < 1.0)
    assert (first["masked"] > 0) is (fraction < 1.0)


def test_mask_splits_flat_indices_by_parameter():
    a, b = torch.nn.Parameter(torch.zeros(2, 3)), torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([a, b], lr=0.1, momentum=0.9)
    opt.state[a]["momentum_buffer"] = torch.ones(2, 3)
    opt.state[b]["momentum_buffer"] = torch.ones(4)
    assert mask_momentum(opt, [a, b], [(0, 6), (6, 10)], torch.tensor([9, 0, 5, 7])) == 2
    assert opt.state[a]["momentum_buffer"].reshape(-1).tolist() == [0, 1, 1, 1, 1, 0]
    assert opt.state[b]["momentum_buffer"].tolist() == [1, 0, 1, 0]


def test_momentum_masking_is_a_checked_setting():
    micro, topk = hvm.Compression.micro(0.01), hvm.Compression.topk(0.01)
    assert micro.masks() and not topk.masks()
    assert hvm.Compression.topk(0.01, momentum_masking=True).masks()
    assert not hvm.Compression.micro(0.01, momentum_masking=False).masks()
    assert not hvm.Compression.micro(1.0, momentum_masking=True).masks()
    # In the configuration only where it can act (older states compare equal otherwise).
    assert micro.config()["momentum_masking"] == "auto"
    assert "momentum_masking" not in topk.config()
    assert "momentum_masking" not in hvm.Compression.micro(
        0.01, momentum_masking=False).config()
    with pytest.raises(ValueError, match="momentum_masking"):
        hvm.Compression.micro(0.01, momentum_masking="yes")


def test_masking_asked_of_sgd_without_momentum_is_refused_on_every_rank():
    results = run_ranks("ranks_momentum:with_optimizer", np=2,
                        kwargs={"kind": "plain", "masking": True})
    for r in results:
        message = r.value["raised"]
        assert message and "momentum_masking=True" in message, r.value
        assert "keeps no momentum buffer" in message and "reported on every rank" in message


def test_default_masking_without_momentum_warns_once_on_the_first_rank():
    """MiCRO's default masks: SGD without momentum has nothing to mask, which rank 0 says
    once, and every step records 0 masked parameters. With AdamW the same default masks
    the first moment, silently."""
    results = run_ranks("ranks_momentum:with_optimizer", np=3, timeout=300,
                        kwargs={"kind": "plain"})
    for r in results:
        warned = [w for w in r.value["warnings"] if "keeps no momentum" in w]
        assert len(warned) == (1 if r.rank == 0 else 0), (r.rank, r.value["warnings"])
        assert r.value["masked"] == [0] * 4, r.value["masked"]
    # Adamax keeps no second moment (exp_inf) and amsgrad its maximum: their first moment
    # is primed and cleared, their second moment left to them.
    for kind in ("adamw", "adamax", "amsgrad", "sgd"):
        masked = run_ranks("ranks_momentum:with_optimizer", np=3, timeout=300,
                           kwargs={"kind": kind, "lr": 0.3})
        for r in masked:
            assert not [w for w in r.value["warnings"] if "momentum" in w], r.value
            assert all(m == 4 for m in r.value["masked"][1:]), (kind, r.value["masked"])


def adamw_expected(step, masking, age):
    """torch's AdamW (lr 0.01, betas 0.9/0.999, eps 1e-8, weight decay 0.01) with the
    burst applied whole where it arrived: there the step's bias-corrected first moment is
    the burst ``g`` itself, the second moment takes ``g^2 / sqrt(age)`` (``age``: the
    iterations since the coordinate last arrived, or since the start), and the first
    moment is cleared after the step."""
    lr, (b1, b2), eps, wd = 0.01, (0.9, 0.999), 1e-8, 0.01
    t = step["t"]
    w = torch.tensor(step["before"]["weights"], dtype=torch.float64)
    m = torch.tensor(step["before"]["exp_avg"], dtype=torch.float64)
    v = torch.tensor(step["before"]["exp_avg_sq"], dtype=torch.float64)
    g = torch.tensor(step["aggregate"], dtype=torch.float64)
    arrived = g != 0
    w = w * (1 - lr * wd)
    m = b1 * m + (1 - b1) * g
    first = m / (1 - b1 ** t)
    if masking:
        v = torch.where(arrived, b2 * v + (1 - b2) * g * g / age.sqrt(), b2 * v)
        first = torch.where(arrived, g, first)
    else:
        v = b2 * v + (1 - b2) * g * g
    w = w - lr * first / ((v / (1 - b2 ** t)).sqrt() + eps)
    if masking:
        m[arrived] = 0.0
    return w, m, v


@pytest.mark.parametrize("backend,masking", [("gloo", None), ("gloo", False), ("mpi", None)])
def test_adamw_applies_a_burst_whole_and_clears_its_first_moment(backend, masking):
    """On 3 ranks (Gloo; MPI), AdamW behind MiCRO against a plain recomputation of torch's
    AdamW: by default each burst is applied whole in its step (the bias-corrected first
    moment there is the burst, the second moment takes its square over the square root of
    its age) and the first moment is cleared after it; unmasked, AdamW as is."""
    results = run_ranks("ranks_momentum:adamw_steps", np=3, backend=backend,
                        kwargs={"masking": masking})
    steps = results[0].value
    for r in results[1:]:
        assert r.value == steps
    last = torch.zeros(len(steps[0]["aggregate"]), dtype=torch.float64)
    waited = 0  # arrivals after more than one iteration: where the age counts
    for step in steps:
        arrived = torch.tensor(step["aggregate"]) != 0
        age = step["t"] - last
        w, m, v = adamw_expected(step, masking is None, age)
        waited += int((age[arrived] > 1).sum())
        last[arrived] = step["t"]
        for key, want in (("weights", w), ("exp_avg", m), ("exp_avg_sq", v)):
            got = torch.tensor(step[key], dtype=torch.float64)
            assert got == pytest.approx(want, rel=1e-4, abs=1e-7), (step["t"], key)
        assert arrived.any()
        assert bool((torch.tensor(step["exp_avg"])[arrived] == 0).all()) is (masking is None)
        assert (step["masked"] > 0) is (masking is None)
    assert waited > 0


def test_density_one_with_masking_is_dense():
    """At density 1 every coordinate is this step's aggregate and nothing is stale:
    masking does not act, so MiCRO with ``momentum_masking=True`` trains SGD with momentum
    exactly as Horovod's dense allreduce does."""
    sparse = run_ranks("ranks_momentum:with_optimizer", np=2,
                       kwargs={"kind": "sgd", "masking": True, "density": 1.0})
    dense = run_ranks("ranks_momentum:with_optimizer", np=2,
                      kwargs={"kind": "sgd", "compression": "none"})
    for s, d in zip(sparse, dense):
        assert s.value["masked"] == [0] * 4, s.value["masked"]
        gap = max(abs(a - b) for a, b in zip(s.value["weights"], d.value["weights"]))
        assert gap < 1e-6, gap
