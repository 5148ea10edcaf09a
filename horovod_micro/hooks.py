"""The hooks of ``hvm.DistributedOptimizer``: one post-accumulate hook per parameter.

A hook counts the backward passes of its parameter (``backward_passes_per_step``), tells
the sparse reducer that backward accumulated into its residual view, and, on the dense
path, starts the parameter's allreduce as soon as its gradient is final. Its methods are
merged into the optimizer's run-time class (see :mod:`horovod_micro.optimizer`).
"""

from __future__ import annotations

import warnings
import weakref

# id(parameter) -> the live optimizer whose hooks sit on it (see ``_register_hooks``).
# Keyed by id: a weak-keyed dict would compare tensors with ``==`` (elementwise).
_hook_owner: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


class HookMethods:
    """Registering, running and removing the optimizer's hooks."""

    def _register_hooks(self) -> None:
        """One post-accumulate hook per parameter.

        A hook holds only a weak reference to the optimizer, and the hooks are removed
        when the optimizer is closed, collected, or replaced: wrapping the same
        parameters again (a notebook re-running a cell, an elastic reset) closes the
        previous optimizer, whose hooks would otherwise keep counting backward passes and
        keep its 2N-element buffers alive.
        """
        for p in self._layout.params:
            previous = _hook_owner.get(id(p))
            if (previous is not None and previous is not self and not previous._closed
                    and p in previous._passes):
                warnings.warn("horovod_micro: these parameters are already wrapped by "
                              "another DistributedOptimizer; closing the previous one "
                              "(its hooks are removed)", stacklevel=3)
                previous.close()
        me = weakref.ref(self)
        for p in self._layout.params:
            self._passes[p] = 0
            self._hooks.append(p.register_post_accumulate_grad_hook(_make_hook(me)))
            _hook_owner[id(p)] = self
        weakref.finalize(self, _remove_handles, list(self._hooks))

    def close(self) -> None:
        """Remove this optimizer's hooks and free its exchange buffers.

        The wrapped optimizer's state is kept; ``step()`` and ``synchronize()`` raise
        afterwards. Called automatically when the same parameters are wrapped again.
        """
        _remove_handles(self._hooks)
        self._hooks.clear()
        self._handles.clear()
        self._passes.clear()
        self._reducer = None
        self._closed = True

    def _on_gradient(self, p) -> None:
        if self._passes[p] >= self.backward_passes_per_step:
            raise AssertionError(
                "Gradients were computed more than backward_passes_per_step times before "
                "call to step(). Increase backward_passes_per_step to accumulate "
                "gradients locally.")
        self._passes[p] += 1
        self._exchanged = False
        if self._reducer is not None:
            self._reducer.count_accumulation(p)
        if not self._sparse and self._passes[p] == self.backward_passes_per_step:
            self._start_dense(p)


def _make_hook(optimizer: weakref.ref):
    def hook(p):
        opt = optimizer()
        if opt is not None:
            opt._on_gradient(p)
    return hook


def _remove_handles(handles: list) -> None:
    for handle in handles:
        handle.remove()
