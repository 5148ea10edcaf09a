"""``horovod_micro.DistributedOptimizer``: Horovod's optimizer contract, sparse exchange inside.

Like ``hvd.DistributedOptimizer`` it returns an instance of a class made at run time from
the wrapped optimizer's class (so it *is* an ``SGD``/``Adam``/...), whose methods reach the
real optimizer with ``super(self.__class__, self)``. It does not subclass Horovod's class,
whose methods do the same and would recurse.

The whole contract is the one class :class:`_DistributedOptimizer`; it holds its parts as
objects, each with its own interface:

* :class:`~.hooks.BackwardHooks`: one hook per parameter, counting backward passes;
* for a sparse compressor, :class:`~.sparse.SparsePath`: the flat gradient's exchange once
  per step in ``synchronize()`` (its :class:`~.reducer.SparseReducer`, ``opt.reducer``), on
  a state every rank holds alike;
* for a dense one (``Compression.none``/``fp16``), :class:`~.dense.DensePath`: Horovod's
  per-parameter allreduces, started by the hooks as backward goes;
* :class:`~.elastic.ElasticBinding`: the collective argument check (:mod:`.validation`)
  and what depends on the set's size; the checkpoint's format is
  :mod:`.checkpoint`'s.
"""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Callable, Iterable
from contextlib import contextmanager

import horovod.torch as hvd
import torch

from .checkpoint import load_all_or_nothing, with_sparse_state
from .compression import Compression, is_dense_compressor
from .compressors.base import Compressor, ReduceOp
from .consistency import parameter_changes
from .dense import DensePath, scale_factors
from .elastic import ElasticBinding, ElasticOptimizer
from .exchange import Comm
from .hooks import BackwardHooks
from .layout import FlatLayout
from .momentum import masking, warn_if_unmaskable
from .naming import collective_prefix, name_parameters
from .reducer import SparseReducer
from .sparse import SparsePath
from .stats import StepStats
from .validation import Arguments


class _DistributedOptimizer(torch.optim.Optimizer):
    """The run-time class's methods; see :func:`DistributedOptimizer`."""

    def __init__(self, params, *, named_parameters, compression, backward_passes_per_step,
                 op, gradient_predivide_factor, groups, sparse_as_dense, process_set,
                 stats_callback, grad_scaler, zero_copy):
        super(self.__class__, self).__init__(params)
        self._compression = compression
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
        self._sparse_path: SparsePath | None = None
        self._dense: DensePath | None = None
        self._binding: ElasticBinding | None = None
        self._comm: Comm | None = None  # built below, for a rank of the process set

        try:
            named = name_parameters(self.param_groups, named_parameters)
            self._argument_errors = []
        except ValueError as error:  # reported collectively below, not raised here
            named = name_parameters(self.param_groups, None)
            self._argument_errors = [str(error)]
        self._layout = FlatLayout([(n, p) for n, p in named if p.requires_grad])
        self._backward = BackwardHooks(self._layout.params, backward_passes_per_step)
        self._wrapped_ids = {id(p) for g in self.param_groups for p in g["params"]}
        self._parameter_names = {p: n for n, p in named}  # Horovod's attribute
        # Horovod: a rank outside the optimizer's process set exchanges nothing and its
        # step() is the wrapped optimizer's local step.
        self._included = bool(process_set.included())
        if not self._included:
            return

        self._named, self._groups_argument = named, groups
        self._binding = ElasticBinding(process_set, self._arguments)
        buildable = self._binding.check_at_construction()
        key = compression if buildable else f"unbuildable {compression!r}"
        self._comm = Comm(process_set, prefix=collective_prefix(
            process_set.process_set_id, self._layout, key, self))
        if not buildable:  # the deferred collective check raises on every rank
            return
        sparse = isinstance(compression, Compressor)
        if sparse:
            # With a GradScaler the residual follows the loss scale between steps, which
            # needs e_t and g_t apart: no zero-copy error feedback then.
            self._sparse_path = SparsePath(SparseReducer(
                self._layout, compression, self._comm,
                ReduceOp(op, *scale_factors(op, gradient_predivide_factor)),
                stats_callback=self._record, zero_copy=zero_copy and grad_scaler is None),
                self)
            compression.fit_optimizer(self.param_groups)
            warn_if_unmaskable(compression, self.param_groups, process_set.rank() == 0)
        else:
            self._dense = DensePath(self._layout, self._parameter_names, compression, op,
                                    gradient_predivide_factor, sparse_as_dense, process_set,
                                    self._comm.prefix, groups, self._backward, self._record)
        if sparse or hvd.size() > 1 or os.environ.get("HOROVOD_ELASTIC") == "1":
            self._backward.register(self, self._on_gradient, self.close)

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
    def compression(self):
        """The compressor (for sparse methods: its threshold, density, state)."""
        return self._compression

    @property
    def reducer(self) -> SparseReducer | None:
        """The sparse path's reducer (residual, statistics), read-only; None on a dense one."""
        return self._sparse_path.reducer if self._sparse_path is not None else None

    @property
    def backward_passes_per_step(self) -> int:
        return self._backward.passes_per_step

    def set_backward_passes_per_step(self, passes: int) -> None:
        self._backward.reset(passes)

    # ----- backward -----------------------------------------------------------------------
    def _on_gradient(self, p) -> None:
        """Backward accumulated into ``p.grad`` (the post-accumulate hook)."""
        final = self._backward.count(p)
        self._exchanged = False
        if self.reducer is not None:
            self.reducer.count_accumulation(p)
        if final and self._dense is not None:
            self._dense.start(p)

    def close(self) -> None:
        """Remove this optimizer's hooks and free its exchange buffers.

        The wrapped optimizer's state is kept; ``step()`` and ``synchronize()`` raise
        afterwards. Called automatically when the same parameters are wrapped again.
        """
        self._backward.remove()
        self._sparse_path = self._dense = None
        self._closed = True

    # ----- synchronize / step -------------------------------------------------------------
    def synchronize(self) -> None:
        """Exchange the gradients now (``step()`` calls this unless inside
        ``skip_synchronize()``). On a rank outside the process set: nothing."""
        if self._closed:
            raise RuntimeError("this horovod_micro DistributedOptimizer was closed (its "
                               "parameters were wrapped again, or close() was called)")
        if self._included:  # the next collective waits for ranks that work alone
            self._comm.begin_exchange()
            if self._binding.stale():
                self.rebind()
        if self._exchanged and self.reducer.grads_hold_the_aggregate():
            # Already exchanged, and no step(), zero_grad(), backward or new .grad since:
            # a second sparse exchange would change the aggregate (dense ones run again,
            # as Horovod's do: an allreduce of equal averages changes nothing).
            return
        try:
            change = parameter_changes(  # since wrapping time (.consistency)
                self.param_groups, self._wrapped_ids, self._layout.params,
                self._parameter_names) if self._included else None
            if self._sparse_path is not None:
                self._sparse_path.synchronize(change, self.grad_scaler)
            elif change:  # dense: Horovod's collectives carry no status; every rank that
                # changed its optimizer raises here (docs/failure-modes.md)
                raise ValueError(f"horovod_micro.DistributedOptimizer: {change}")
            elif self._dense is not None and (self.process_set.size() > 1
                                              or self._backward.registered):
                self._dense.synchronize()
        finally:
            # Also after a collective error, so that the next zero_grad() and backward
            # start clean on every rank.
            self._forget_pending_exchange()
        self._synchronized = True
        self._exchanged = self.reducer is not None

    def _forget_pending_exchange(self) -> None:
        """Drop the handles of gradients already sent and zero the backward-pass counts."""
        if self._dense is not None:
            self._dense.handles.clear()
        self._backward.reset()

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
        applied = self._sparse_path.take_applied() if self._sparse_path else None
        with masking(self, self._compression, self._layout, applied, self.last_stats):
            return super(self.__class__, self).step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if (self._dense is not None and self._dense.handles) or self._backward.pending():
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() "
                                 "but before optimizer.step() or optimizer.synchronize(). "
                                 "This is prohibited as it can cause a race condition.")
        self._exchanged = False
        if self.reducer is None:
            return super(self.__class__, self).zero_grad(set_to_none=set_to_none)
        # The parameters of the flat layout get their residual slice as .grad (zero-copy
        # error feedback, SparseReducer.install_residual_views): never zeroed in place,
        # whatever set_to_none says, since it holds e_t. Other parameters: as torch does.
        for p in self._layout.params:
            p.grad = None
        super(self.__class__, self).zero_grad(set_to_none=set_to_none)
        self.reducer.install_residual_views()
        return None

    # ----- checkpoints and Elastic Horovod ------------------------------------------------
    def state_dict(self) -> dict:
        """The wrapped optimizer's state plus, for sparse methods, this rank's residual,
        the iteration and the compressor's state (e.g. MiCRO's threshold controller).

        The residual belongs to this rank: the state records the rank and the set size,
        and :meth:`load_state_dict` refuses another rank's (the documentation's usage
        page, "Checkpoints and resuming").
        """
        return with_sparse_state(super(self.__class__, self).state_dict(), self.reducer)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a :meth:`state_dict`, all or nothing: if any part is refused, the
        optimizer keeps its state from before. A sparse state saved at another number of
        ranks loads on the rank that saved it (its residual) and maps the compressor's
        state onto this number of ranks, as an elastic reset does."""
        if load_all_or_nothing(state_dict, self.reducer, self._load_wrapped_state):
            self._sparse_path.after_load()

    def _load_wrapped_state(self, state: dict) -> None:
        """Load the wrapped optimizer's ``state``, forgetting any exchange in flight; the
        next step synchronizes again (``load_state_dict`` and the elastic restore)."""
        self._forget_pending_exchange()
        self._synchronized = self._exchanged = False
        self._should_synchronize = True
        super(self.__class__, self).load_state_dict(state)

    def rebind(self) -> None:
        """After an elastic reset: :meth:`~.elastic.ElasticBinding.rebind`, collectively."""
        if self._included:
            self._binding.rebind(self.reducer, self._sparse_path and self._sparse_path.adopt)

    def elastic_snapshot(self) -> dict:
        """For ``TorchState``'s commit: :meth:`~.elastic.ElasticBinding.snapshot`."""
        wrapped = super(self.__class__, self).state_dict()
        if self._binding is None:  # a rank outside the process set: its own state only
            return {"optimizer": copy.deepcopy(wrapped)}
        return self._binding.snapshot(wrapped, self.reducer)

    def elastic_restore(self, snapshot: dict) -> None:
        """Back to a snapshot of this process (after a collective failed: Horovod restores
        the last commit on every surviving rank, so model, residual and controller are all
        from the same iteration). Gradients are dropped, since a half-done step's ``.grad``
        must not be added to by the next backward."""
        self._load_wrapped_state(copy.deepcopy(snapshot["optimizer"]))
        for p in self._layout.params:
            p.grad = None
        if self._binding is not None:
            self._binding.restore(snapshot, self.reducer)


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
      that differ across ranks at the first exchange
      (:meth:`~.sparse.SparsePath.check_same_parameters`), and skip a second
      ``synchronize()`` whose aggregate is still in ``.grad``.

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
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               {k: v for k, v in vars(_DistributedOptimizer).items()
                if k not in ("__dict__", "__weakref__")})
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
