"""The checkpoint of ``hvm.DistributedOptimizer``: the wrapped optimizer's state plus, for a
sparse compressor, the reducer's (this rank's residual, the iteration, the compressor's
state). Its methods are merged into the optimizer's run-time class (see
:mod:`horovod_micro.optimizer`)."""

from __future__ import annotations

#: The key of the sparse state in ``optimizer.state_dict()``.
STATE_KEY = "horovod_micro"


class CheckpointMethods:
    """``state_dict``/``load_state_dict`` (all or nothing), and loading the wrapped
    optimizer's state alone (also the elastic restore's)."""

    def _load_wrapped_state(self, state: dict) -> None:
        """Load the wrapped optimizer's ``state``, forgetting any exchange in flight; the
        next step synchronizes again (``load_state_dict`` and the elastic restore)."""
        self._forget_pending_exchange()
        self._synchronized = self._exchanged = False
        self._should_synchronize = True
        super(self.__class__, self).load_state_dict(state)

    def state_dict(self) -> dict:
        """The wrapped optimizer's state plus, for sparse methods, this rank's residual,
        the iteration and the compressor's state (e.g. MiCRO's threshold controller).

        The residual belongs to this rank: the state records the rank and the set size,
        and :meth:`load_state_dict` refuses another rank's (the documentation's usage
        page, "Checkpoints and resuming").
        """
        state = super(self.__class__, self).state_dict()
        if self._reducer is not None:
            state[STATE_KEY] = self._reducer.state_dict()
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a :meth:`state_dict`, all or nothing: if any part is refused, the
        optimizer keeps its state from before. A sparse state saved at another number of
        ranks loads on the rank that saved it (its residual) and maps the compressor's
        state onto this number of ranks, as an elastic reset does."""
        state_dict = dict(state_dict)
        sparse_state = state_dict.pop(STATE_KEY, None)
        reducer = self._reducer
        if reducer is None or sparse_state is None:
            self._load_wrapped_state(state_dict)
            return
        backup = reducer.state_dict()
        reducer.load_state_dict(sparse_state)  # checks everything before it changes anything
        try:
            self._load_wrapped_state(state_dict)
        except Exception:
            reducer.load_state_dict(backup)
            raise
        # Before the first exchange every rank adopts the shared state anyway; after it,
        # the next exchange first asks every rank whether it loaded too (STATE_LOADED).
        self._state_sync_pending = True if self._state_sync_pending is True else "loaded"
        self._loaded = True
