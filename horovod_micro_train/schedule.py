"""Learning-rate schedule of the paper's recipe: linear scaling, gradual warm-up, step decay.

Warm-up follows Goyal et al. (2017), as Horovod's examples and the MiCRO reference scripts
do: the lr rises linearly, per iteration, from the single-worker value ``peak / n`` to
``peak`` over the warm-up epochs, so the early large-batch steps do not diverge.
"""

from __future__ import annotations

from collections.abc import Sequence


def peak_lr(base_lr: float, batch_size: int, size: int, scale: bool = True) -> float:
    """``base_lr * batch_size * size / 128`` (the reference's scaling), or ``base_lr``."""
    return base_lr * batch_size * size / 128 if scale else base_lr


def lr_at(epoch: float, peak: float, size: int, warmup_epochs: float,
          decay_epochs: Sequence[int], decay_factor: float) -> float:
    """Learning rate at fractional ``epoch`` (``epoch + step / steps_per_epoch``)."""
    if epoch < warmup_epochs:
        return peak * (1.0 + epoch * (size - 1) / warmup_epochs) / size
    decays = sum(1 for boundary in decay_epochs if epoch >= boundary)
    return peak * decay_factor ** decays
