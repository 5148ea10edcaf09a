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


def expected_step(step, nesterov, masking):
    """torch.optim.SGD's update (momentum, dampening 0, weight decay), then the mask."""
    w = torch.tensor(step["weights_before"], dtype=torch.float64)
    buf = torch.tensor(step["buffers_before"], dtype=torch.float64)
    g = torch.tensor(step["aggregate"], dtype=torch.float64)
    d = g + WEIGHT_DECAY * w
    first = not buf.any()
    buf = d.clone() if first else MOMENTUM * buf + d
    update = d + MOMENTUM * buf if nesterov else buf
    w = w - LR * update
    if masking:
        buf[g != 0] = 0.0
    return w, buf


@pytest.mark.parametrize("backend,np,method,masking,nesterov", [
    ("gloo", 2, "micro", True, True),
    ("gloo", 3, "micro", True, False),
    ("mpi", 2, "micro", True, True),
    ("gloo", 8, "micro", None, True),      # MiCRO's default: on from 8 ranks
    ("gloo", 2, "micro", None, True),      # and off below
    ("gloo", 8, "micro", False, True),     # as published: the momentum keeps the burst
    ("gloo", 2, "topk", None, True),       # the baselines never mask by default
    ("gloo", 2, "gtopk", True, True),
])
def test_momentum_is_cleared_where_the_aggregate_arrived(backend, np, method, masking,
                                                         nesterov):
    results = run_ranks("ranks_momentum:masked_steps", np=np, backend=backend,
                        kwargs={"method": method, "masking": masking,
                                "nesterov": nesterov})
    expected_masking = (method == "micro" and np >= 8) if masking is None else masking
    first = results[0].value
    assert first["masking"] is expected_masking
    for r in results[1:]:  # identical weights and buffers on every rank
        assert r.value["steps"] == first["steps"]
    masked_somewhere = False
    for step in first["steps"]:
        w, buf = expected_step(step, nesterov, expected_masking)
        assert torch.tensor(step["weights"], dtype=torch.float64) == pytest.approx(
            w, rel=1e-5, abs=1e-6)
        assert torch.tensor(step["buffers"], dtype=torch.float64) == pytest.approx(
            buf, rel=1e-5, abs=1e-6)
        arrived = torch.tensor(step["aggregate"]) != 0
        assert 0 < int(arrived.sum()) <= step["applied"]
        zero = torch.tensor(step["buffers"])[arrived] == 0
        masked_somewhere |= bool(zero.all())
    assert masked_somewhere is expected_masking


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
    assert [micro.masks(n) for n in (1, 2, 4, 7, 8, 16)] == [False] * 4 + [True] * 2
    assert not any(topk.masks(n) for n in (2, 8, 64))
    assert hvm.Compression.topk(0.01, momentum_masking=True).masks(2)
    assert not hvm.Compression.micro(0.01, momentum_masking=False).masks(64)
    # In the configuration only where it can act (older states compare equal otherwise).
    assert micro.config()["momentum_masking"] == "auto"
    assert "momentum_masking" not in topk.config()
    assert "momentum_masking" not in hvm.Compression.micro(
        0.01, momentum_masking=False).config()
    with pytest.raises(ValueError, match="momentum_masking"):
        hvm.Compression.micro(0.01, momentum_masking="yes")


@pytest.mark.parametrize("kind", ["adam", "adamw"])
def test_masking_asked_of_adam_is_refused_on_every_rank(kind):
    results = run_ranks("ranks_momentum:with_optimizer", np=2,
                        kwargs={"kind": kind, "masking": True})
    for r in results:
        message = r.value["raised"]
        assert message and "momentum_masking=True" in message, r.value
        assert "keeps no momentum buffer" in message and "reported on every rank" in message


def test_default_masking_with_adam_warns_once_on_the_first_rank():
    """At 8 ranks MiCRO's default would mask: with AdamW there is nothing to mask, which
    rank 0 says once, and every step records 0 masked parameters."""
    results = run_ranks("ranks_momentum:with_optimizer", np=8, timeout=300,
                        kwargs={"kind": "adamw"})
    for r in results:
        warned = [w for w in r.value["warnings"] if "keeps no momentum buffer" in w]
        assert len(warned) == (1 if r.rank == 0 else 0), (r.rank, r.value["warnings"])
        assert r.value["masked"] == [0] * 4, r.value["masked"]
    # With SGD's momentum the same default masks, and says so.
    sgd = run_ranks("ranks_momentum:with_optimizer", np=8, timeout=300, kwargs={"kind": "sgd"})
    for r in sgd:
        assert not [w for w in r.value["warnings"] if "momentum buffer" in w], r.value
        assert all(m == 4 for m in r.value["masked"]), r.value["masked"]  # 2 weights, 2 biases


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
