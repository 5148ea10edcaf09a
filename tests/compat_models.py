"""Plain-torch pieces shared by the Horovod-compatibility rank bodies (``ranks_compat.py``)
and their checks (``test_horovod_compat.py``): toy models and per-rank data, built the same
way in every process from fixed seeds, and the independent references the checks compare
the ranks' results with (no Horovod here: an exchange is a Python mean or the MiCRO
simulation of ``simulation.py``).

Flat vectors always list parameters in name order, as the optimizer's flat layout does.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
from simulation import simulate_micro

BATCH, D_IN, HIDDEN, D_OUT = 64, 100, 10, 10

# Two option sets as in Horovod's optimizer tests: each optimizer class takes the options
# its constructor knows (``centered`` only reaches RMSprop, ``momentum`` SGD/RMSprop).
OPTION_SETS = [
    {"lr": 0.2, "momentum": 0.9, "weight_decay": 0.1, "centered": True},
    {"lr": 0.2},
]

# Rank-specific options for the broadcast-of-options check: rank 0's win.
RANK_OPTIONS = [
    {"lr": 0.1, "momentum": 0.8, "weight_decay": 0.2, "nesterov": True,
     "betas": (0.9, 0.999), "etas": (0.8, 2.4), "step_sizes": (1e-5, 100)},
    {"lr": 0.2, "momentum": 0.9, "weight_decay": 0.1, "nesterov": False,
     "betas": (0.8, 0.9), "etas": (0.25, 1.75), "step_sizes": (1e-7, 5)},
]

# Per-rank token ids of the sparse-embedding check (ranks look up different rows).
EMBEDDING_INPUTS = [
    [[1, 2, 4, 5], [4, 3, 2, 9]],
    [[1, 3, 4], [4, 7, 9]],
]

SGD_OPTIONS = {"lr": 0.2, "momentum": 0.9, "weight_decay": 0.1}


@contextlib.contextmanager
def seeded(seed: int):
    """Run a block under ``torch.manual_seed(seed)`` without touching the global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rank_data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Regression inputs and targets of ``rank`` (different on every rank)."""
    gen = generator(7_000 + rank)
    return torch.randn(BATCH, D_IN, generator=gen), torch.randn(BATCH, D_OUT, generator=gen)


def mlp(seed: int = 0) -> torch.nn.Sequential:
    with seeded(seed):
        return torch.nn.Sequential(torch.nn.Linear(D_IN, HIDDEN), torch.nn.ReLU(),
                                   torch.nn.Linear(HIDDEN, D_OUT))


class TwoHeads(torch.nn.Module):
    """Two outputs; a loss on the first leaves ``fc3`` without a gradient."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(D_IN, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, D_OUT)
        self.fc3 = torch.nn.Linear(D_OUT, D_OUT)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        first = self.fc2(h)
        return first, self.fc3(torch.relu(first))


def two_heads(seed: int = 0) -> TwoHeads:
    with seeded(seed):
        return TwoHeads()


def two_heads_loss(model: TwoHeads, rank: int) -> torch.Tensor:
    """Rank 0 trains the first head only, every other rank the second one."""
    x, y = rank_data(rank)
    first, second = model(x)
    return torch.nn.functional.mse_loss(first if rank == 0 else second, y, reduction="sum")


def mlp_loss(model, rank: int) -> torch.Tensor:
    x, y = rank_data(rank)
    return torch.nn.functional.mse_loss(model(x), y, reduction="sum")


class ConvPair(torch.nn.Module):
    """Two 1x1 convolutions (Horovod's model for the unnamed-parameters case)."""

    def __init__(self, width: int = 100):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, width, 1)
        self.conv2 = torch.nn.Conv2d(width, 1, 1)

    def forward(self, x):
        return self.conv2(self.conv1(x))


def conv_pair(seed: int = 0) -> ConvPair:
    with seeded(seed):
        return ConvPair()


def image(rank: int, side: int = 24) -> torch.Tensor:
    return torch.rand(1, 1, side, side, generator=generator(8_000 + rank))


def gan_pair(seed: int = 0) -> tuple[torch.nn.Conv2d, torch.nn.Conv2d]:
    """A 'generator' and a 'discriminator', trained alternately by two optimizers."""
    with seeded(seed):
        return torch.nn.Conv2d(1, 10, 1), torch.nn.Conv2d(10, 1, 1)


class MixedPrecision(torch.nn.Module):
    """A float32 layer followed by a float64 layer."""

    def __init__(self):
        super().__init__()
        self.lin32 = torch.nn.Linear(8, 6)
        self.lin64 = torch.nn.Linear(6, 2).double()

    def forward(self, x):
        return self.lin64(torch.tanh(self.lin32(x)).double())


def mixed_precision(seed: int = 0) -> MixedPrecision:
    with seeded(seed):
        return MixedPrecision()


def mixed_loss(model: MixedPrecision, rank: int) -> torch.Tensor:
    x = torch.randn(16, 8, generator=generator(9_000 + rank))
    return model(x).pow(2).sum()


class IndexedScale(torch.nn.Module):
    """An integer parameter that never has a gradient next to a float one."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor([1, 3], dtype=torch.int32),
                                    requires_grad=False)
        with seeded(3):
            self.b = torch.nn.Parameter(torch.rand(4))

    def forward(self, x):
        return torch.index_select(self.b, 0, self.a.long()) * x


def indexed_input(rank: int) -> torch.Tensor:
    return torch.tensor([1.0 + rank, 2.0 - 0.5 * rank])


def embedding(seed: int = 0) -> torch.nn.Embedding:
    with seeded(seed):
        return torch.nn.Embedding(10, 3, sparse=True)


def embedding_input(rank: int) -> torch.Tensor:
    return torch.tensor(EMBEDDING_INPUTS[rank % len(EMBEDDING_INPUTS)])


# ----- optimizers ------------------------------------------------------------------------
def optimizer_classes() -> list[tuple[str, type]]:
    """torch.optim's optimizers, sorted by name so every rank walks them in one order.

    Left out: LBFGS (closure-driven; Horovod excludes it too), SparseAdam (sparse gradients
    only: its own check) and Muon (2-D parameters only; newer than Horovod 0.28.1).
    """
    skip = {"LBFGS", "SparseAdam", "Muon"}
    found = {cls.__name__: cls for cls in torch.optim.Optimizer.__subclasses__()
             if cls.__module__.startswith("torch.optim") and cls.__name__ not in skip}
    return sorted(found.items())


def accepted_options(cls: type, options: dict) -> dict:
    known = inspect.signature(cls.__init__).parameters
    return {k: v for k, v in options.items() if k in known}


def make_optimizer(cls: type, options: dict, params) -> torch.optim.Optimizer:
    return cls(params, **accepted_options(cls, options))


# ----- flat vectors in name order ----------------------------------------------------------
def named_in_order(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return sorted(model.named_parameters(), key=lambda item: item[0])


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double() for _, p in named_in_order(model)])


def flat_grads(model: torch.nn.Module) -> torch.Tensor:
    """Gradients in name order (zeros where a parameter has none)."""
    parts = []
    for _, p in named_in_order(model):
        if not p.requires_grad:
            continue
        grad = torch.zeros_like(p) if p.grad is None else p.grad
        parts.append(grad.detach().to_dense().reshape(-1).double())
    return torch.cat(parts)


def set_flat_grads(model: torch.nn.Module, flat: torch.Tensor) -> None:
    offset = 0
    for _, p in named_in_order(model):
        if not p.requires_grad:
            continue
        n = p.numel()
        p.grad = flat[offset:offset + n].reshape(p.shape).to(p.dtype).clone()
        offset += n


def local_flat_grad(model: torch.nn.Module, loss: torch.Tensor) -> torch.Tensor:
    """``d loss / d params`` in name order, zeros for unused parameters; ``.grad`` untouched."""
    params = [p for _, p in named_in_order(model) if p.requires_grad]
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1).double()
                      for p, g in zip(params, grads)])


# ----- the references ------------------------------------------------------------------------
def exchanged(local: list[torch.Tensor], mode: str, thresholds: list[float] | None = None,
              steps: list[list[torch.Tensor]] | None = None) -> torch.Tensor:
    """What one exchange of ``local`` (one flat gradient per rank, process-set rank order)
    gives every rank: the average for the dense modes, MiCRO's aggregate (simulated from
    the ranks' reported thresholds, ``steps`` earlier iterations first) for the sparse."""
    if mode in ("dense", "fp16"):
        return torch.stack(local).mean(0)
    history = (steps or []) + [local]
    grads = [[g.float() for g in step] for step in history]
    return simulate_micro(grads, thresholds, len(local))[-1]["grad"].double()


def stepped_params(model: torch.nn.Module, cls: type, options: dict,
                   grad: torch.Tensor) -> torch.Tensor:
    """Parameters after one step of ``cls`` from ``model``'s parameters with ``grad``."""
    set_flat_grads(model, grad)
    make_optimizer(cls, options, model.parameters()).step()
    return flat_params(model)
