"""Elastic Horovod for ``hvm.DistributedOptimizer``: its methods and ``TorchState``'s handler.

:class:`ElasticBinding` (one per optimizer) re-derives what depends on the set's size
(:meth:`~ElasticBinding.rebind`) and saves and restores this process's whole optimizer
state (:meth:`~ElasticBinding.snapshot`, :meth:`~ElasticBinding.restore`), behind the
optimizer's ``rebind``, ``elastic_snapshot`` and ``elastic_restore``.

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
import copy
import os
from collections.abc import Callable

import torch
from horovod.torch.elastic import state as torch_state
from horovod.torch.functions import broadcast_optimizer_state, broadcast_parameters

from .exchange import Comm
from .validation import Arguments, check_collectively, local_errors


class ElasticOptimizer(abc.ABC):  # noqa: B024  (a marker: no abstract methods)
    """Every ``hvm.DistributedOptimizer`` is registered as one (``isinstance`` is true)."""


class ElasticBinding:
    """What this optimizer was sized for, and the collective argument check.

    ``bound_size`` is the set size the sparse path is partitioned for; ``checked`` whether
    the arguments passed the collective check (:mod:`.validation`), deferred under Elastic
    Horovod, where a worker that joins a running job builds its optimizer while the others
    already wait in the state sync, so no collective may run at construction.
    ``arguments`` returns what the optimizer was given, for that check.
    """

    def __init__(self, process_set, arguments: Callable[[], Arguments]):
        self.process_set = process_set
        self.arguments = arguments
        self.bound_size = process_set.size()
        self.checked = os.environ.get("HOROVOD_ELASTIC") != "1"
        self.comm = Comm(process_set, prefix=f"hvm.ps{process_set.process_set_id}.check")

    def check_at_construction(self) -> bool:
        """Check the arguments collectively, except under Elastic Horovod (the check then
        runs in the first :meth:`rebind`). Returns whether this rank may build its
        exchange (False: its own arguments are wrong, and that deferred check reports it
        on every rank)."""
        if self.checked:
            check_collectively(self.arguments(), self.comm)
            return True
        return not local_errors(self.arguments())

    def stale(self) -> bool:
        """Whether the next exchange must :meth:`rebind` first: the check is still due,
        or the set changed size."""
        return not self.checked or self.process_set.size() != self.bound_size

    def rebind(self, reducer, adopt: Callable[[], None]) -> None:
        """Re-derive everything that depends on the process set's size, collectively.

        Called on every rank after an elastic reset (by the TorchState handler's sync, or
        by the first ``synchronize()`` that sees a new size), and once under Elastic Horovod
        in place of the construction-time check. It checks the arguments collectively,
        re-partitions the flat gradient for the new ``n`` (ownership follows, since rank
        ``r`` owns part ``(t + r) mod n``), maps the controller's per-part state onto the
        new parts, and then ``adopt``s the iteration and the compressor's state of the
        set's first rank, so every rank holds the same. Residuals are left as they are
        (the documentation's usage page, "Elastic training").
        """
        # On every rank, checked before or not: a newcomer's first check and a survivor's
        # rebind are the same collectives.
        check_collectively(self.arguments(), self.comm)
        self.checked = True
        size = self.process_set.size()
        if reducer is not None:
            reducer.compressor.rebind(size)
            adopt()
        self.bound_size = size

    def snapshot(self, wrapped_state: dict, reducer) -> dict:
        """This rank's whole optimizer state, copied to host-independent storage for
        ``hvd.elastic.TorchState``'s commit: the wrapped optimizer's state and, for sparse
        methods, this rank's residual, the iteration, the compressor's state and the set
        size it was sized for. Unlike ``state_dict()`` it is restored only into this same
        process (:meth:`restore`), so it carries no rank check."""
        snapshot = {"optimizer": copy.deepcopy(wrapped_state)}
        if reducer is not None:
            snapshot["sparse"] = {"size": self.bound_size,
                                  "shared": copy.deepcopy(reducer.shared_state()),
                                  "residual": reducer.residual.detach().clone(),
                                  "loss_scale": reducer.loss_scale}
        return snapshot

    def restore(self, snapshot: dict, reducer) -> None:
        """The sparse half of a :meth:`snapshot`, back into ``reducer``; the next rebind
        adapts it to the new set size."""
        sparse = snapshot.get("sparse")
        if reducer is None or sparse is None:
            return
        if sparse["size"] != self.bound_size:
            reducer.compressor.rebind(sparse["size"])
            self.bound_size = sparse["size"]
        reducer.forget_views()
        reducer.residual.copy_(sparse["residual"])
        reducer.load_shared_state(copy.deepcopy(sparse["shared"]))
        reducer.loss_scale = sparse["loss_scale"]


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
