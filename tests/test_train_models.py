"""The paper's CIFAR models and the digits model: sizes and output shapes (one process)."""

import pytest
import torch

from horovod_micro_train.models import MODELS, build_model, resnet18


def test_resnet18_has_the_cifar_parameter_count():
    assert sum(p.numel() for p in resnet18(num_classes=10).parameters()) == 11_173_962


# Input shapes by model: the CIFAR models take 3x32x32; the others their dataset's images.
INPUTS = {"digits_cnn": (2, 1, 8, 8), "wide_mlp": (2, 1, 28, 28), "fmnist_mlp": (2, 1, 28, 28)}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_forward_backward_shapes(name):
    torch.manual_seed(0)
    model = build_model(name, num_classes=7)
    shape = INPUTS.get(name, (2, 3, 32, 32))
    out = model(torch.randn(shape))
    assert out.shape == (2, 7)
    out.sum().backward()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())


def test_unknown_model_is_named_in_the_error():
    with pytest.raises(ValueError, match="resnet18"):
        build_model("vgg", 10)
