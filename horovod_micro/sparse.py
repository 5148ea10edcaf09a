"""The sparse half of ``hvm.DistributedOptimizer``: one exchange per step, on a state every
rank holds alike.

:class:`SparsePath` runs the :class:`~horovod_micro.reducer.SparseReducer` in
``synchronize()``, after making sure that the state every rank of the set must share is
shared: the iteration and the compressor's state (MiCRO's controller, PowerSGD's ``Q``)
must be the same on every rank, or parts overlap and thresholds differ; each rank keeps
its own error-feedback residual.
"""

from __future__ import annotations

import math
import warnings
import weakref

import horovod.torch as hvd
import torch

from .naming import alive_alike
from .status import OK, PARAMS_CHANGED, STATE_LOADED, CollectiveInputError, StateReloaded


class SparsePath:
    """The sparse exchange, and whether this rank must first adopt the set's first rank's
    shared state.

    ``pending``: True after construction (the first exchange adopts on every rank),
    ``"loaded"`` after a ``load_state_dict`` since (the next exchange asks every rank
    whether it loaded too), False otherwise. ``loaded``: whether a state was loaded since
    the last parameter check. ``owner`` is the optimizer, told apart from others built
    alike (:func:`~horovod_micro.naming.alive_alike`), which exchange while they hold a
    ``reducer`` (until closed).
    """

    def __init__(self, reducer, owner):
        self.reducer = reducer
        self.comm = reducer.comm  # its process set and collective names
        self.owner = weakref.ref(owner)
        self.pending: bool | str = True
        self.loaded = False

    def synchronize(self, change: str | None, grad_scaler) -> None:
        """This step's exchange. ``change``: how this rank's parameters differ from
        wrapping time (reported collectively); ``grad_scaler``: the scaler whose scale the
        residual follows, or None."""
        if self.pending is True:  # the first exchange: every rank
            self.adopt(check_parameters=True)
        if grad_scaler is not None and grad_scaler.is_enabled():
            # before unscale_: the residual is loss-scaled (a GPU host sync)
            self.reducer.follow_loss_scale(float(grad_scaler.get_scale()))
        try:
            self.reduce(PARAMS_CHANGED if change else OK)
        except CollectiveInputError as error:
            if change:
                raise CollectiveInputError(f"{error} (this rank: {change})") from None
            raise

    def take_applied(self):
        """Where the last exchange gave an aggregate (:class:`~horovod_micro.momentum.
        Arrived`), once (None after a skipped step, or when taken): where the wrapped
        optimizer's step that follows masks its momentum
        (:func:`~horovod_micro.momentum.masking`)."""
        applied, self.reducer.applied = self.reducer.applied, None
        return applied

    def after_load(self) -> None:
        """A checkpoint was loaded into the reducer (``load_state_dict``)."""
        self.pending = True if self.pending is True else "loaded"
        self.loaded = True

    def adopt(self, check_parameters: bool = False) -> None:
        """Make the iteration and the compressor's state (e.g. MiCRO's controller) those of
        the set's first rank; each rank keeps its own residual.

        Horovod's resume idiom loads a checkpoint on rank 0 only and then calls
        ``hvd.broadcast_optimizer_state``, which carries the wrapped optimizer's state but
        not ours; without this, rank 0 would own part ``(t0 + 0) mod n`` while the others
        start from iteration 0, parts would overlap, and thresholds would differ. Runs once
        after construction and after each ``load_state_dict`` (every rank constructs,
        so every rank takes part), and is a no-op when the ranks already agree.

        ``check_parameters`` (the first exchange, and the first after a load): first
        compare the ranks' parameters, see :meth:`check_same_parameters`.
        """
        root = (self.comm.process_set.ranks or list(range(hvd.size())))[0]
        if check_parameters:
            self.check_same_parameters()
        shared = self.comm.broadcast_object(self.reducer.shared_state(), root, "shared-state")
        self.reducer.load_shared_state(shared)
        self.pending = False

    def reduce(self, reported: int) -> None:
        """The sparse exchange; where this rank loaded a state since its last exchange, it
        reports :data:`~horovod_micro.status.STATE_LOADED`. If every rank did (Horovod's
        resume idiom), every rank adopts the first rank's shared state and exchanges
        again; if some did, every rank raises the same error."""
        if reported == OK and self.pending:
            reported = STATE_LOADED
        try:
            self.reducer.reduce(reported)
        except StateReloaded:
            self.adopt(check_parameters=True)
            self.reducer.reduce(OK)

    def check_same_parameters(self) -> None:
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
        digest = parameter_digest([p.detach() for p in self.reducer.layout.params])
        me = self.owner()
        others = [o for o in alive_alike(self.comm.prefix) if o is not me and o.reducer is not None]
        flags = torch.tensor([1.0 if self.loaded else 0.0, 1.0 if others else 0.0],
                             dtype=torch.float64)
        everyone = self.comm.allgather(torch.cat([digest, flags]).view(1, 5), "parameters")
        self.loaded = False
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
        if self.comm.rank == 0:
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
