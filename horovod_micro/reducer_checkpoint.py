"""A sparse reducer's checkpoint: what every rank shares, and this rank's residual.

The iteration and the compressor's state are the same on every rank of the set (the
optimizer adopts the first rank's after a load); the error-feedback residual belongs to
the rank that accumulated it, so a state records its rank and set size, and loading
another rank's is refused. A state saved at another number of ranks is mapped onto this
one's, as an elastic reset does.
"""

from __future__ import annotations

import copy

import torch


class ReducerCheckpoint:
    """The checkpoint methods of :class:`~horovod_micro.reducer.SparseReducer`, which
    holds ``layout``, ``compressor``, ``comm``, ``iteration``, ``residual`` and ``loss_scale``."""

    def shared_state(self) -> dict:
        """What every rank of the set holds identically: the iteration and the
        compressor's state (e.g. MiCRO's controller). Not the residual, which is per rank."""
        return {"iteration": self.iteration, "compressor": self.compressor.state_dict()}

    def load_shared_state(self, state: dict) -> None:
        self.iteration = int(state["iteration"])
        # Checkpoints written before the rename of the method's class keep its state
        # under "sparsifier".
        self.compressor.load_state_dict(state["compressor"] if "compressor" in state
                                        else state["sparsifier"])

    def state_dict(self) -> dict:
        return {
            **self.shared_state(),
            "numel": self.layout.numel,
            "config": self.compressor.config(),
            "rank": self.comm.rank,
            "size": self.comm.size,
            "residual": self.residual.detach().clone(),
            "loss_scale": self.loss_scale,
        }

    def load_state_dict(self, state: dict) -> None:
        if state["numel"] != self.layout.numel:
            raise ValueError(f"checkpoint holds a {state['numel']}-element residual, this "
                             f"model has {self.layout.numel} elements")
        if state["config"] != self.compressor.config():
            raise ValueError(f"checkpoint was made with {state['config']}, this optimizer "
                             f"uses {self.compressor.config()}")
        saved_rank = state.get("rank", self.comm.rank)
        saved_size = state.get("size", self.comm.size)
        if saved_rank != self.comm.rank:
            raise ValueError(
                f"this optimizer state is rank {saved_rank} of {saved_size}'s, but this is "
                f"rank {self.comm.rank}: the error-feedback residual belongs to the rank that "
                "accumulated it. Load each rank's own optimizer state, or load on rank 0 only "
                "and call hvd.broadcast_optimizer_state(optimizer, 0) on every rank (the "
                "iteration and the compressor's state then follow rank 0; the other ranks "
                "restart with an empty residual)")
        residual = state["residual"]
        if not isinstance(residual, torch.Tensor) or residual.numel() != self.layout.numel:
            raise ValueError("checkpoint's residual does not match this model")
        # All or nothing: the compressor's state is loaded for the saved number of ranks
        # and then mapped onto this one's (as an elastic reset does); if any of it fails,
        # the state from before stays.
        size, before = self.comm.size, copy.deepcopy(self.shared_state())
        try:
            if saved_size != size:
                self.compressor.rebind(saved_size)
            self.load_shared_state(state)
        except Exception:
            self.compressor.rebind(size)
            self.load_shared_state(before)
            raise
        if saved_size != size:
            self.compressor.rebind(size)
        self.residual.copy_(residual)
        self.loss_scale = state.get("loss_scale", 1.0)  # the residual's units
