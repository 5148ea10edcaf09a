"""Models of the MiCRO paper's experiments (CIFAR, 32x32 inputs), the embedded default, and
the scaling benchmark's small models (a LeNet-5 for Fashion-MNIST, a byte-level transformer
language model for ``python-text``).

``from horovod_micro_train.models import resnet18; model = resnet18(num_classes=10)``, or by
name through :func:`build_model` (what ``--model`` selects).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from .digits import DigitsCNN, digits_cnn
from .googlenet import GoogLeNet, googlenet
from .lenet import LeNet5, fmnist_lenet
from .resnet import ResNet, resnet18
from .senet import SENet, senet18
from .text_transformer import TextTransformer, text_transformer
from .wide_mlp import WideMLP, fmnist_mlp, wide_mlp

MODELS: dict[str, Callable[..., nn.Module]] = {
    "resnet18": resnet18,
    "googlenet": googlenet,
    "senet18": senet18,
    "digits_cnn": digits_cnn,
    "wide_mlp": wide_mlp,
    "fmnist_mlp": fmnist_mlp,
    "fmnist_lenet": fmnist_lenet,
    "text_transformer": text_transformer,
}


def build_model(name: str, num_classes: int) -> nn.Module:
    """The model called ``name`` (one of :data:`MODELS`) with ``num_classes`` outputs (for
    ``text_transformer``: the vocabulary, the logits' last dimension)."""
    try:
        factory = MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)}") from None
    return factory(num_classes=num_classes)


__all__ = ["MODELS", "DigitsCNN", "GoogLeNet", "ResNet", "SENet", "build_model", "digits_cnn",
           "googlenet", "resnet18", "senet18", "WideMLP", "wide_mlp", "fmnist_mlp", "LeNet5",
           "fmnist_lenet", "TextTransformer", "text_transformer"]
