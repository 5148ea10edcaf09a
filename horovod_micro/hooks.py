"""Backward's side of ``hvm.DistributedOptimizer``: one post-accumulate hook per parameter.

:class:`BackwardHooks` counts the backward passes of each parameter
(``backward_passes_per_step``) and tells its owner each time backward accumulated into a
parameter's ``.grad``, and whether that gradient is now final for the step. The owner
decides what follows: the sparse reducer notes that backward wrote into its residual view,
and the dense path starts that parameter's allreduce at once, overlapping backward.
"""

from __future__ import annotations

import warnings
import weakref

# id(parameter) -> the live hooks on it (see ``BackwardHooks.register``). Keyed by id: a
# weak-keyed dict would compare tensors with ``==`` (elementwise).
_hook_owner: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


class BackwardHooks:
    """The hooks on ``params`` and the count of backward passes since the last exchange.

    ``passes`` maps each parameter to the backward passes that reached it since the last
    exchange; a parameter's gradient is final when its count reaches ``passes_per_step``.
    """

    def __init__(self, params: list, passes_per_step: int):
        self.params = params
        self.passes_per_step = passes_per_step
        self.passes: dict = {}
        self._handles: list = []
        self._on_gradient = self._close = lambda: None  # weak methods of the owner

    @property
    def registered(self) -> bool:
        return bool(self._handles)

    def register(self, owner, on_gradient, close) -> None:
        """One post-accumulate hook per parameter, each calling ``on_gradient(p)``, a
        method of ``owner``.

        The hooks hold only weak references to ``owner``'s methods, and they are removed
        when the owner is closed, collected, or replaced: wrapping the same parameters
        again (a notebook re-running a cell, an elastic reset) calls the previous owner's
        ``close``, whose hooks would otherwise keep counting backward passes and keep its
        2N-element buffers alive.
        """
        for p in self.params:
            previous = _hook_owner.get(id(p))
            if previous is not None and previous is not self and p in previous.passes:
                warnings.warn("horovod_micro: these parameters are already wrapped by "
                              "another DistributedOptimizer; closing the previous one "
                              "(its hooks are removed)", stacklevel=4)
                previous.close_owner()
        self._on_gradient = weakref.WeakMethod(on_gradient)
        self._close = weakref.WeakMethod(close)
        for p in self.params:
            self.passes[p] = 0
            self._handles.append(p.register_post_accumulate_grad_hook(self._hook))
            _hook_owner[id(p)] = self
        weakref.finalize(owner, _remove_handles, list(self._handles))

    def _hook(self, p) -> None:
        on_gradient = self._on_gradient()
        if on_gradient is not None:
            on_gradient(p)

    def close_owner(self) -> None:
        close = self._close()
        if close is not None:
            close()

    def count(self, p) -> bool:
        """Count one backward pass into ``p``; whether its gradient is now final."""
        if self.passes[p] >= self.passes_per_step:
            raise AssertionError(
                "Gradients were computed more than backward_passes_per_step times before "
                "call to step(). Increase backward_passes_per_step to accumulate "
                "gradients locally.")
        self.passes[p] += 1
        return self.passes[p] == self.passes_per_step

    def final(self, p) -> bool:
        """Whether every backward pass of this step has reached ``p``."""
        return self.passes.get(p, 0) >= self.passes_per_step

    def pending(self) -> bool:
        """Whether backward reached some parameter since the last exchange."""
        return any(self.passes.values())

    def reset(self, passes_per_step: int | None = None) -> None:
        """Zero the counts (after an exchange, or with a new ``passes_per_step``)."""
        if passes_per_step is not None:
            self.passes_per_step = passes_per_step
        for p in self.passes:
            self.passes[p] = 0

    def remove(self) -> None:
        _remove_handles(self._handles)
        self._handles.clear()
        self.passes.clear()


def _remove_handles(handles: list) -> None:
    for handle in handles:
        handle.remove()
