"""``horovod_micro.DistributedOptimizer``: Horovod's optimizer contract, sparse exchange inside.

Like ``hvd.DistributedOptimizer`` it returns an instance of a class made at run time from
the wrapped optimizer's class (so it *is* an ``SGD``/``Adam``/...), whose methods reach the
real optimizer with ``super(self.__class__, self)``. It does not subclass Horovod's class,
whose methods do the same and would recurse.

Dense compressors (``Compression.none``/``fp16``) take Horovod's per-parameter allreduces,
started by the hooks (:mod:`.dense`); sparse compressors exchange the whole gradient as one
flat vector once per step in ``synchronize()`` (:class:`~.reducer.SparseReducer`).

This module holds ``synchronize``, ``step``, ``zero_grad`` and the sparse orchestration;
the run-time class also takes the methods of :class:`~.dense.DenseExchange`,
:class:`~.elastic.ElasticMethods`, :class:`~.hooks.HookMethods`,
:class:`~.shared_state.SharedStateMethods` and :class:`~.optimizer_state.CheckpointMethods`.
Arguments are checked collectively (:mod:`.validation`).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable
from contextlib import contextmanager

import horovod.torch as hvd
import torch

from .compression import Compression, is_dense_compressor
from .compressors.base import Compressor, ReduceOp
from .consistency import parameter_changes
from .dense import DenseExchange, resolve_groups
from .elastic import ElasticMethods, ElasticOptimizer
from .exchange import Comm
from .hooks import HookMethods
from .layout import FlatLayout
from .momentum import masking, warn_if_unmaskable
from .naming import collective_prefix, name_parameters
from .optimizer_state import CheckpointMethods
from .reducer import SparseReducer
from .shared_state import SharedStateMethods
from .stats import StepStats
from .status import OK, PARAMS_CHANGED, CollectiveInputError
from .validation import Arguments


class _DistributedOptimizer(torch.optim.Optimizer):
    """Methods merged into the run-time class; see :func:`DistributedOptimizer`."""

    def __init__(self, params, *, named_parameters, compression, backward_passes_per_step,
                 op, gradient_predivide_factor, groups, sparse_as_dense, process_set,
                 stats_callback, grad_scaler, zero_copy):
        super(self.__class__, self).__init__(params)
        self._compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self.stats_callback = stats_callback
        self.grad_scaler = grad_scaler
        self.last_stats: StepStats | None = None
        self._synchronized = False
        # A sparse aggregate still in .grad: a second synchronize() exchanges nothing.
        self._exchanged = False
        self._should_synchronize = True
        self._closed = False
        self._handles: dict = {}
        self._passes: dict = {}
        self._hooks: list = []
        self._reducer: SparseReducer | None = None
        self._comm: Comm | None = None  # built below, for a rank of the process set
        self._groups = None
        # Set after construction and load_state_dict: the next sparse exchange first adopts
        # the set's first rank's iteration and compressor state (``_adopt_shared_state``).
        self._state_sync_pending = True
        # Whether load_state_dict ran since construction (see _check_same_parameters).
        self._loaded = False

        try:
            named = name_parameters(self.param_groups, named_parameters)
            self._argument_errors = []
        except ValueError as error:  # reported collectively below, not raised here
            named = name_parameters(self.param_groups, None)
            self._argument_errors = [str(error)]
        self._layout = FlatLayout([(n, p) for n, p in named if p.requires_grad])
        self._wrapped_ids = {id(p) for g in self.param_groups for p in g["params"]}
        self._parameter_names = {p: n for n, p in named}
        # Horovod: a rank outside the optimizer's process set exchanges nothing and its
        # step() is the wrapped optimizer's local step.
        self._included = bool(process_set.included())
        if not self._included:
            return

        set_id = process_set.process_set_id
        self._named, self._groups_argument = named, groups
        buildable = self._check_at_construction()
        key = compression if buildable else f"unbuildable {compression!r}"
        self._comm = Comm(process_set, prefix=collective_prefix(set_id, self._layout, key, self))
        if not buildable:  # the deferred collective check raises on every rank
            return
        if self._sparse:
            # With a GradScaler the residual follows the loss scale between steps, which
            # needs e_t and g_t apart: no zero-copy error feedback then.
            self._reducer = SparseReducer(self._layout, compression, self._comm,
                                          ReduceOp(op, *self._scale_factors()),
                                          stats_callback=self._record,
                                          zero_copy=zero_copy and grad_scaler is None)
            warn_if_unmaskable(compression, self.param_groups, process_set.rank() == 0)
        else:
            self._groups = resolve_groups(groups, self._layout)
        if self._sparse or hvd.size() > 1 or os.environ.get("HOROVOD_ELASTIC") == "1":
            self._register_hooks()

    def _arguments(self) -> Arguments:
        """What this optimizer was given, for the collective checks."""
        return Arguments(named=self._named, param_groups=self.param_groups,
                         layout=self._layout, compression=self._compression,
                         groups=self._groups_argument,
                         backward_passes_per_step=self.backward_passes_per_step, op=self.op,
                         gradient_predivide_factor=self.gradient_predivide_factor,
                         own_comm=self._comm, errors=self._argument_errors)

    # ----- what kind of exchange ----------------------------------------------------------
    @property
    def _sparse(self) -> bool:
        return isinstance(self._compression, Compressor)

    @property
    def compression(self):
        """The compressor (for sparse methods: its threshold, density, state)."""
        return self._compression

    @property
    def reducer(self) -> SparseReducer | None:
        """The sparse path (residual, statistics), read-only; None on a dense one."""
        return self._reducer

    # ----- synchronize / step -------------------------------------------------------------
    def synchronize(self) -> None:
        """Exchange the gradients now (``step()`` calls this unless inside
        ``skip_synchronize()``). On a rank outside the process set: nothing."""
        if self._closed:
            raise RuntimeError("this horovod_micro DistributedOptimizer was closed (its "
                               "parameters were wrapped again, or close() was called)")
        if self._included:  # the next collective waits for ranks that work alone
            self._comm.begin_exchange()
        if self._included and (not self._checked
                               or self.process_set.size() != self._bound_size):
            self.rebind()
        if self._exchanged and self._reducer.grads_hold_the_aggregate():
            # Already exchanged, and no step(), zero_grad(), backward or new .grad since:
            # a second sparse exchange would change the aggregate (dense ones run again,
            # as Horovod's do: an allreduce of equal averages changes nothing).
            return
        try:
            change = self._parameter_change() if self._included else None
            if self._included and self._sparse:
                if self._state_sync_pending is True:  # the first exchange: every rank
                    self._adopt_shared_state(check_parameters=True)
                if self.grad_scaler is not None and self.grad_scaler.is_enabled():
                    # before unscale_: the residual is loss-scaled (a GPU host sync)
                    self._reducer.follow_loss_scale(float(self.grad_scaler.get_scale()))
                try:
                    self._reduce_adopting(PARAMS_CHANGED if change else OK)
                except CollectiveInputError as error:
                    if change:
                        raise CollectiveInputError(f"{error} (this rank: {change})") from None
                    raise
            elif change:  # dense: Horovod's collectives carry no status; every rank that
                # changed its optimizer raises here (docs/failure-modes.md)
                raise ValueError(f"horovod_micro.DistributedOptimizer: {change}")
            elif self._included and (self.process_set.size() > 1 or self._hooks):
                self._synchronize_dense()
        finally:
            # Also after a collective error, so that the next zero_grad() and backward
            # start clean on every rank.
            self._forget_pending_exchange()
        self._synchronized = True
        self._exchanged = self._reducer is not None

    def _forget_pending_exchange(self) -> None:
        """Drop the handles of gradients already sent and zero the backward-pass counts."""
        self._handles.clear()
        for p in self._passes:
            self._passes[p] = 0

    def _parameter_change(self) -> str | None:
        """How ``param_groups`` differ from wrapping time (:mod:`.consistency`)."""
        return parameter_changes(self.param_groups, self._wrapped_ids, self._layout.params,
                                 self._parameter_names)

    def _record(self, stats: StepStats) -> None:
        self.last_stats = stats
        if self.stats_callback is not None:
            self.stats_callback(stats)

    @contextmanager
    def skip_synchronize(self):
        """``optimizer.synchronize(); with optimizer.skip_synchronize(): optimizer.step()``."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "context after optimizer.synchronize(). This can cause training "
                              "slowdown. You may want to consider using "
                              "optimizer.skip_synchronize() context if you use "
                              "optimizer.synchronize() in your code.", stacklevel=2)
            self.synchronize()
        self._synchronized = self._exchanged = False
        with masking(self, self._reducer):
            return super(self.__class__, self).step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._handles or any(self._passes.values()):
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() "
                                 "but before optimizer.step() or optimizer.synchronize(). "
                                 "This is prohibited as it can cause a race condition.")
        self._exchanged = False
        if self._reducer is None:
            return super(self.__class__, self).zero_grad(set_to_none=set_to_none)
        # The parameters of the flat layout get their residual slice as .grad (zero-copy
        # error feedback, SparseReducer.install_residual_views): never zeroed in place,
        # whatever set_to_none says, since it holds e_t. Other parameters: as torch does.
        for p in self._layout.params:
            p.grad = None
        super(self.__class__, self).zero_grad(set_to_none=set_to_none)
        self._reducer.install_residual_views()
        return None

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes
        for p in self._passes:
            self._passes[p] = 0


def DistributedOptimizer(  # noqa: N802  (Horovod's name)
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
    compression=Compression.none,
    backward_passes_per_step: int = 1,
    op=hvd.Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups=None,
    sparse_as_dense: bool = False,
    process_set: hvd.ProcessSet = hvd.global_process_set,
    stats_callback: Callable[[StepStats], None] | None = None,
    grad_scaler: torch.amp.GradScaler | None = None,
    zero_copy: bool = True,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` first exchanges gradients across ranks.

    Same arguments and behaviour as ``hvd.DistributedOptimizer`` (Horovod 0.28), plus:

    Args:
        compression: ``hvm.Compression.micro(density=...)`` or another sparse compressor
            for a sparse exchange; Horovod's or our ``Compression.none``/``fp16`` for
            Horovod's dense allreduce.
        stats_callback: called with a :class:`~horovod_micro.stats.StepStats` after every
            exchange (the latest is also kept in ``optimizer.last_stats``).
        grad_scaler: the ``torch.amp.GradScaler`` of a mixed-precision run whose steps
            call ``synchronize()`` before ``scaler.unscale_(optimizer)`` (Horovod's
            pattern). A sparse method's residual and threshold then live in loss-scaled
            units; passing the scaler lets them follow each change of the scale. Not
            needed when ``scaler.step(optimizer)`` unscales before the exchange. Turns
            ``zero_copy`` off.
        zero_copy: sparse compressors only. ``zero_grad()`` makes each ``.grad`` a view of
            the error-feedback residual ``e_t``, so backward adds ``g_t`` into it in place
            and the reducer needs no pass to build ``a_t = e_t + g_t`` (backward's
            AccumulateGrad does that add instead, so iterations take about as long; what
            is saved is one N-sized gradient tensor per step and its free). Between
            backward and ``synchronize()``, ``.grad`` then shows ``a_t``, not ``g_t``;
            after ``synchronize()`` it is the aggregate, as always. Anything that writes into
            ``.grad`` in place before ``synchronize()`` (``scaler.unscale_``, gradient
            clipping) is detected through the tensors' version counter: a warning, and
            separate gradient buffers from then on. ``backward(create_graph=True)`` needs
            ``zero_copy=False`` (a clear error on every rank otherwise).

    Differences from Horovod, each deliberate:

    * ``zero_grad(set_to_none=...)`` is accepted (Horovod 0.28.1's override takes no
      argument). With a sparse compressor and ``zero_copy`` it installs the residual
      views whatever ``set_to_none`` says (see ``zero_copy``).
    * ``groups``/``num_groups`` only shape the dense path; a sparse exchange always treats
      the whole model as one flat vector.
    * ``op=hvd.Adasum`` is handed to Horovod's own optimizer (dense compressors only).
    * With a sparse compressor the exchange runs even on a single rank, so single- and
      multi-rank runs follow the same algorithm.
    * Sparse exchanges have a deadline (:mod:`horovod_micro.deadline`), refuse weights
      that differ across ranks at the first exchange (``_check_same_parameters``), and
      skip a second ``synchronize()`` whose aggregate is still in ``.grad``.

    Example::

        import horovod.torch as hvd
        import horovod_micro as hvm

        hvd.init()
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1 * hvd.size(), momentum=0.9)
        opt = hvm.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=hvm.Compression.micro(density=0.01))
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        for data, target in loader:
            opt.zero_grad()
            loss_fn(model(data), target).backward()
            opt.step()                    # the sparse exchange, then SGD's step
            print(opt.last_stats.density, opt.last_stats.bytes_sent)

    With a ``torch.amp.GradScaler`` on several ranks, pass ``grad_scaler=scaler`` and
    step as ``opt.synchronize(); scaler.unscale_(opt)``, then
    ``with opt.skip_synchronize(): scaler.step(opt)``.
    """
    if num_groups and groups is None:
        groups = num_groups
    if op == hvd.Adasum:
        if isinstance(compression, Compressor):
            raise ValueError("op=hvd.Adasum cannot be combined with a sparse compressor")
        return hvd.DistributedOptimizer(
            optimizer, named_parameters=named_parameters, compression=compression,
            backward_passes_per_step=backward_passes_per_step, op=op,
            gradient_predivide_factor=gradient_predivide_factor, groups=groups,
            sparse_as_dense=sparse_as_dense, process_set=process_set)
    if not is_dense_compressor(compression) and not isinstance(compression, Compressor):
        raise TypeError(f"compression must be a horovod_micro or Horovod compressor, got "
                        f"{compression!r}")
    merged = {}
    for part in (DenseExchange, ElasticMethods, HookMethods, SharedStateMethods,
                 CheckpointMethods, _DistributedOptimizer):
        merged.update({k: v for k, v in vars(part).items()
                        if k not in ("__dict__", "__weakref__")})
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), merged)
    # hvd.broadcast_optimizer_state recognises a distributed optimizer by its module and
    # then initialises state with the wrapped optimizer's own step (no exchange); saying
    # that we are one keeps a state broadcast from running a collective step.
    cls.__module__ = hvd.DistributedOptimizer.__module__
    ElasticOptimizer.register(cls)  # hvd.elastic.TorchState picks our handler
    return cls(optimizer.param_groups, named_parameters=named_parameters,
               compression=compression, backward_passes_per_step=backward_passes_per_step,
               op=op, gradient_predivide_factor=gradient_predivide_factor, groups=groups,
               sparse_as_dense=sparse_as_dense, process_set=process_set,
               stats_callback=stats_callback, grad_scaler=grad_scaler, zero_copy=zero_copy)
