"""Shared helpers of the benchmarks: the ResNet-18 (CIFAR) model and timing utilities.

Launching ranks (horovodrun command lines, bounded child processes):
``hvm_testbed.launch``.
"""

from __future__ import annotations

import ast
import statistics
import time

import torch

RESNET18_CIFAR_NUMEL = 11_173_962


def parse_method(text: str) -> tuple[str, dict]:
    """``name[:key=value,...]`` -> (name, keyword arguments; values as Python literals):
    ``powersgd:rank=2``, ``micro:judge='magnitude'``."""
    name, _, rest = text.partition(":")
    kwargs = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        kwargs[key] = ast.literal_eval(value)
    return name, kwargs


def resnet18(num_classes: int = 10) -> tuple[torch.nn.Module, str]:
    """ResNet-18 for CIFAR (3x3 stem, no max-pool; 11,173,962 parameters) and its source.

    Uses the project's ``horovod_micro_train.models.resnet18`` when it exists; otherwise
    torchvision's
    ResNet-18 with the CIFAR stem (the same parameter count and shapes).
    """
    try:
        from horovod_micro_train.models import resnet18 as project_resnet18

        return project_resnet18(num_classes=num_classes), "horovod_micro_train.models.resnet18"
    except ImportError:
        import torchvision

        model = torchvision.models.resnet18(num_classes=num_classes)
        model.conv1 = torch.nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        model.maxpool = torch.nn.Identity()
        return model, "torchvision resnet18, CIFAR stem"


def real_gradient(seed: int = 0, batch: int = 32) -> tuple[torch.Tensor, str]:
    """Flat gradient of ResNet-18 after one backward pass on random CIFAR-shaped data."""
    torch.manual_seed(seed)
    model, source = resnet18()
    x = torch.randn(batch, 3, 32, 32)
    y = torch.randint(0, 10, (batch,))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    flat = torch.cat([p.grad.reshape(-1) for _, p in sorted(model.named_parameters())])
    return flat.contiguous(), source


def random_batches(model: str, batch: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` batches of random inputs with random labels for ``model`` (the MLPs:
    784 features; otherwise 3x32x32), to cycle through one per iteration. With one fixed
    batch the wide MLP memorises it within tens of steps, its gradient collapses, and the
    density controller chases a vanishing scale (counts of 0, then 40x k)."""
    shape = (784,) if model in ("wide_mlp", "fmnist_mlp") else (3, 32, 32)
    return [(torch.randn(batch, *shape), torch.randint(0, 10, (batch,)))
            for _ in range(count)]


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start

