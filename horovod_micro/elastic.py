"""``hvd.elastic.TorchState`` support for ``hvm.DistributedOptimizer``.

Horovod's TorchState picks a handler per attribute from a registry of ``(type, handler)``
pairs; its optimizer handler commits ``optimizer.state_dict()`` and syncs with
``hvd.broadcast_optimizer_state``, which would carry neither our residual nor a rebinding
to a new number of ranks, and whose restore would meet our ``load_state_dict``'s rank check.
Importing ``horovod_micro`` puts :class:`SparseOptimizerHandler` first in that registry for
every optimizer :func:`~horovod_micro.DistributedOptimizer` builds (they are instances of
classes made at run time, so they are registered with the :class:`ElasticOptimizer` ABC).

What the handler does at each point of Horovod's elastic loop (the documentation's usage
page, "Elastic training"):

* ``commit()`` -> :meth:`~SparseOptimizerHandler.save`: a copy of the wrapped optimizer's
  state, this rank's residual, the iteration and the controller (host memory, no collective).
* a collective failed (a worker died) -> :meth:`~SparseOptimizerHandler.restore`: back to
  the last commit, so the residual belongs to the same iteration as the restored weights.
* after every reset, on every rank, newcomers included -> :meth:`~SparseOptimizerHandler.sync`:
  the optimizer rebinds to the new set size (partition, ownership, controller mapped and
  then taken from rank 0), and the wrapped optimizer's state (momentum) is broadcast from
  rank 0, as Horovod's handler does, followed by the parameters once more (Horovod's
  optimizer broadcast can step a newcomer's weights).
"""

from __future__ import annotations

import abc

import torch
from horovod.torch.elastic import state as torch_state
from horovod.torch.functions import broadcast_optimizer_state, broadcast_parameters


class ElasticOptimizer(abc.ABC):  # noqa: B024  (a marker: no abstract methods)
    """Every ``hvm.DistributedOptimizer`` is registered as one (``isinstance`` is true)."""


class SparseOptimizerHandler(torch_state.StateHandler):
    """TorchState's handler for an ``hvm.DistributedOptimizer`` (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        super().__init__(optimizer)
        self._saved = optimizer.elastic_snapshot()

    def save(self) -> None:
        self._saved = self.value.elastic_snapshot()

    def restore(self) -> None:
        self.value.elastic_restore(self._saved)

    def sync(self) -> None:
        self.value.rebind()
        broadcast_optimizer_state(self.value, root_rank=0)
        # A worker with no optimizer state yet (a newcomer) makes it with one step of the
        # wrapped optimizer on zero gradients, inside broadcast_optimizer_state; with
        # weight decay that step moves its weights away from rank 0's, which the model's
        # handler broadcast just before. Broadcast them again.
        params = [p for group in self.value.param_groups for p in group["params"]]
        broadcast_parameters([(f"hvm.elastic.param.{i}", p) for i, p in enumerate(params)],
                             root_rank=0)


def register_handler() -> None:
    """Put :class:`SparseOptimizerHandler` first in TorchState's registry (idempotent)."""
    registry = torch_state.get_handler_registry()
    if not any(handler is SparseOptimizerHandler for _, handler in registry):
        torch_state.set_handler_registry([(ElasticOptimizer, SparseOptimizerHandler),
                                          *registry])


register_handler()
