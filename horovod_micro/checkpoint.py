"""The checkpoint of ``hvm.DistributedOptimizer``: the wrapped optimizer's state plus, for a
sparse compressor, the reducer's (this rank's residual, the iteration, the compressor's
state), loaded all or nothing."""

from __future__ import annotations

from collections.abc import Callable

#: The key of the sparse state in ``optimizer.state_dict()``.
STATE_KEY = "horovod_micro"


def with_sparse_state(wrapped_state: dict, reducer) -> dict:
    """The wrapped optimizer's ``state_dict()`` plus, for sparse methods, the reducer's
    under :data:`STATE_KEY`."""
    if reducer is not None:
        wrapped_state[STATE_KEY] = reducer.state_dict()
    return wrapped_state


def load_all_or_nothing(state_dict: dict, reducer, load_wrapped: Callable[[dict], None]
                        ) -> bool:
    """Load a :func:`with_sparse_state` checkpoint: the reducer's part (checked whole
    before anything changes) and then the wrapped optimizer's with ``load_wrapped``; if
    that refuses, the reducer goes back to its state from before. Returns whether a sparse
    state was loaded."""
    state_dict = dict(state_dict)
    sparse_state = state_dict.pop(STATE_KEY, None)
    if reducer is None or sparse_state is None:
        load_wrapped(state_dict)
        return False
    backup = reducer.state_dict()
    reducer.load_state_dict(sparse_state)  # checks everything before it changes anything
    try:
        load_wrapped(state_dict)
    except Exception:
        reducer.load_state_dict(backup)
        raise
    return True
