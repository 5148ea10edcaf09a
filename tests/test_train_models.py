"""The paper's CIFAR models, the digits model and the scaling benchmark's LeNet and
transformer: sizes and output shapes (one process)."""

import pytest
import torch

from horovod_micro_train.models import MODELS, build_model, resnet18


def test_resnet18_has_the_cifar_parameter_count():
    assert sum(p.numel() for p in resnet18(num_classes=10).parameters()) == 11_173_962


@pytest.mark.parametrize("name, classes, count", [("fmnist_lenet", 10, 61_706),
                                                  ("text_transformer", 256, 137_216)])
def test_small_models_parameter_counts(name, classes, count):
    assert sum(p.numel() for p in build_model(name, classes).parameters()) == count


# Input shapes by model: the CIFAR models take 3x32x32; the others their dataset's images.
INPUTS = {"digits_cnn": (2, 1, 8, 8), "wide_mlp": (2, 1, 28, 28), "fmnist_mlp": (2, 1, 28, 28),
          "fmnist_lenet": (2, 1, 28, 28)}
#: Language models take token ids (batch, length) and give logits (batch, length, vocab).
TOKENS = {"text_transformer": (2, 16)}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_forward_backward_shapes(name):
    torch.manual_seed(0)
    model = build_model(name, num_classes=7)
    if name in TOKENS:
        out = model(torch.randint(0, 7, TOKENS[name]))
        assert out.shape == (*TOKENS[name], 7)
    else:
        out = model(torch.randn(INPUTS.get(name, (2, 3, 32, 32))))
        assert out.shape == (2, 7)
    out.sum().backward()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())


def test_unknown_model_is_named_in_the_error():
    with pytest.raises(ValueError, match="resnet18"):
        build_model("vgg", 10)
