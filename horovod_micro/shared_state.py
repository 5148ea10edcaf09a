"""The state every rank of a sparse optimizer's process set holds alike.

The iteration and the compressor's state (MiCRO's controller, PowerSGD's ``Q``) must be
the same on every rank, or parts overlap and thresholds differ; each rank keeps its own
error-feedback residual. Its methods are merged into ``hvm.DistributedOptimizer``'s class
(see :mod:`horovod_micro.optimizer`).
"""

from __future__ import annotations

import math
import warnings

import horovod.torch as hvd
import torch

from .naming import alive_alike
from .status import OK, STATE_LOADED, CollectiveInputError, StateReloaded


class SharedStateMethods:
    """Adopting the set's first rank's shared state, and checking the ranks' weights."""

    def _adopt_shared_state(self, check_parameters: bool = False) -> None:
        """Make the iteration and the compressor's state (e.g. MiCRO's controller) those of
        the set's first rank; each rank keeps its own residual.

        Horovod's resume idiom loads a checkpoint on rank 0 only and then calls
        ``hvd.broadcast_optimizer_state``, which carries the wrapped optimizer's state but
        not ours; without this, rank 0 would own part ``(t0 + 0) mod n`` while the others
        start from iteration 0, parts would overlap, and thresholds would differ. Runs once
        after construction and after each ``load_state_dict`` (every rank constructs,
        so every rank takes part), and is a no-op when the ranks already agree.

        ``check_parameters`` (the first exchange, and the first after a load): first
        compare the ranks' parameters, see :meth:`_check_same_parameters`.
        """
        root = (self.process_set.ranks or list(range(hvd.size())))[0]
        if check_parameters:
            self._check_same_parameters()
        shared = self._comm.broadcast_object(self._reducer.shared_state(), root,
                                             "shared-state")
        self._reducer.load_shared_state(shared)
        self._state_sync_pending = False

    def _reduce_adopting(self, reported: int) -> None:
        """The sparse exchange; where this rank loaded a state since its last exchange, it
        reports :data:`~horovod_micro.status.STATE_LOADED`. If every rank did (Horovod's
        resume idiom), every rank adopts the first rank's shared state and exchanges
        again; if some did, every rank raises the same error."""
        if reported == OK and self._state_sync_pending:
            reported = STATE_LOADED
        try:
            self._reducer.reduce(reported)
        except StateReloaded:
            self._adopt_shared_state(check_parameters=True)
            self._reducer.reduce(OK)

    def _check_same_parameters(self) -> None:
        """Refuse, on every rank, models paired across ranks; warn about weights that were
        not broadcast.

        Two same-shaped models' optimizers built in a different order on different ranks
        have collectives (named by shapes and build order) that pair one rank's model with
        another rank's other model, and train them into each other with no error. Each rank
        gathers five float64 numbers once: :func:`parameter_digest` (to within 1 % of the
        weights' norm), whether it loaded a state, and whether it built several optimizers
        alike that are still alive (:func:`~horovod_micro.naming.alive_alike`). Where the
        weights differ and some rank holds such a pair, the pairing is ambiguous: every
        rank raises.
        Where no rank did, nothing can be paired wrongly; the weights were simply not
        broadcast (``hvd.broadcast_parameters``), and each rank trains its own weights with
        the shared gradient, as with Horovod's optimizer: the set's first rank warns once.
        Skipped when any rank loaded a state: Horovod's resume idiom
        (``hvd.broadcast_optimizer_state`` after a load on rank 0) steps the other ranks'
        fresh optimizers on zero gradients, which weight decay turns into a change of the
        weights (of about ``lr`` per weight with Adam), as in stock Horovod.
        """
        digest = parameter_digest([p.detach() for p in self._layout.params])
        others = [o for o in alive_alike(self._comm.prefix) if o is not self and not o._closed]
        flags = torch.tensor([1.0 if self._loaded else 0.0, 1.0 if others else 0.0],
                             dtype=torch.float64)
        everyone = self._comm.allgather(torch.cat([digest, flags]).view(1, 5), "parameters")
        self._loaded = False
        if bool((everyone[:, 3] > 0).any()):
            return
        first = everyone[0]
        differ = []
        for r in range(1, everyone.shape[0]):
            norm = math.sqrt(max(float(first[2]), float(everyone[r][2]), 0.0))
            if bool((everyone[r] - first)[:2].abs().max() > 1e-2 * norm) \
                    or abs(float(everyone[r][2] - first[2])) > 2e-2 * norm * norm:
                differ.append(r)
        if not differ:
            return
        if bool((everyone[:, 4] > 0).any()):
            raise CollectiveInputError(
                f"the parameters of rank(s) {differ} differ from those of the set's first "
                "rank at the first exchange, and the same-shaped optimizers built on these "
                "ranks pair up by build order: build the optimizers of same-shaped models "
                "in the same order on every rank, and broadcast the weights first "
                "(hvd.broadcast_parameters(model.state_dict(), root_rank=0))")
        if self._comm.rank == 0:
            warnings.warn(
                f"horovod_micro: the parameters of rank(s) {differ} differ from those of the "
                "set's first rank at the first exchange (not broadcast?): each rank trains "
                "its own weights with the shared gradient, as with Horovod's optimizer. "
                "Call hvd.broadcast_parameters(model.state_dict(), root_rank=0) first for "
                "identical models", stacklevel=4)


def parameter_digest(params: list[torch.Tensor]) -> torch.Tensor:
    """Two projections of the flat parameters on fixed pseudo-random signs, and their
    squared norm (float64, on the host). Two independently initialised copies of a model
    have nearly the same norm, but projections that differ by about the norm itself."""
    total = torch.zeros(3, dtype=torch.float64, device=params[0].device if params else "cpu")
    offset = 0
    for p in params:
        flat = p.reshape(-1).double()
        index = torch.arange(offset, offset + flat.numel(), device=flat.device)
        for row, multiplier in enumerate((2654435761, 2246822519)):
            sign = ((index * multiplier) % 4294967296 >= 2147483648).double() * 2.0 - 1.0
            total[row] += torch.dot(flat, sign)
        total[2] += torch.dot(flat, flat)
        offset += flat.numel()
    return total.cpu()
