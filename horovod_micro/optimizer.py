"""``horovod_micro.DistributedOptimizer``: Horovod's optimizer contract, sparse exchange inside.

Switching a Horovod script is one line::

    opt = hvm.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=hvm.Compression.micro(density=0.001))

Like ``hvd.DistributedOptimizer`` the returned object is an instance of a class made at
run time from the wrapped optimizer's class, so it *is* an ``SGD``/``Adam``/... and
``step`` ends in the real optimizer's ``step``. The methods below are merged into that
class; they reach the real optimizer with ``super(self.__class__, self)`` (a bare
``super()`` cannot work in a class assembled with ``type``). We do not subclass Horovod's
own class: its methods also use ``super(self.__class__, self)``, which would recurse.

Two exchange paths:

* dense compressors (``hvm.Compression.none``/``fp16``, or Horovod's own
  ``hvd.Compression.none``/``fp16``): Horovod's behaviour, per-parameter allreduces
  started by the hooks (:mod:`horovod_micro.dense`);
* sparse compressors (``hvm.Compression.micro`` and the others): the whole model's
  gradient is one flat vector, exchanged once per step in ``synchronize()`` by
  :class:`~horovod_micro.reducer.SparseReducer`. Hooks only count backward passes.

This module holds Horovod's optimizer contract (hooks, ``synchronize``, ``step``,
``zero_grad``, checkpoints) and the sparse path; the run-time class also takes the dense
path's methods (:class:`~horovod_micro.dense.DenseExchange`) and Elastic Horovod's
(:class:`~horovod_micro.elastic.ElasticMethods`).

Arguments are checked collectively when the optimizer is built: every rank validates its
own arguments, the ranks allgather what they found together with their parameter
signatures and compressor settings, and then *every* rank raises the same error if any
rank's input is wrong or the ranks disagree. A mistake on one rank never leaves the
others waiting in a collective.
"""

from __future__ import annotations

import hashlib
import math
import os
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Iterable
from contextlib import contextmanager

import horovod.torch as hvd
import torch

from .compression import Compression, is_dense_compressor
from .consistency import parameter_changes
from .dense import DenseExchange, resolve_groups
from .elastic import ElasticMethods, ElasticOptimizer
from .exchange import Comm
from .layout import FlatLayout
from .momentum import mask_momentum
from .reducer import SparseReducer
from .sparsifiers.base import ReduceOp, Sparsifier
from .stats import StepStats
from .status import OK, PARAMS_CHANGED, CollectiveInputError
from .validation import check_collectively, local_errors

_STATE_KEY = "horovod_micro"
# How many optimizers this process has built per (process set, parameters, compressor):
# part of the collective names. Every rank of a set builds the same optimizers over the
# same parameters in the same order, so the count agrees across ranks even when ranks
# build different numbers of optimizers for *other* process sets.
_built: Counter = Counter()
# id(parameter) -> the live optimizer whose hooks sit on it (see ``_register_hooks``).
# Keyed by id: a weak-keyed dict would compare tensors with ``==`` (elementwise).
_hook_owner: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


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
        # The scale of the residual's and the threshold's units: they start unscaled
        # (the first threshold, 1/(2 sqrt k), is a gradient magnitude).
        self._loss_scale = 1.0
        self.last_stats: StepStats | None = None
        self._synchronized = False
        # A sparse exchange whose aggregate is still in .grad: no step(), zero_grad() or
        # backward since. A second synchronize() then exchanges nothing (see synchronize).
        self._exchanged = False
        self._should_synchronize = True
        self._closed = False
        self._handles: dict = {}
        self._passes: dict = {}
        self._hooks: list = []
        self._reducer: SparseReducer | None = None
        self._groups = None
        # Set after construction and after load_state_dict: the next sparse exchange
        # first adopts the iteration and the sparsifier's state of the set's first rank
        # (Horovod's resume idiom loads on rank 0 only; see ``_adopt_shared_state``).
        self._state_sync_pending = True
        # Whether load_state_dict ran since construction (see _check_same_parameters).
        self._loaded = False

        try:
            named = _name_parameters(self.param_groups, named_parameters)
            self._argument_errors = []
        except ValueError as error:  # reported collectively below, not raised here
            named = _name_parameters(self.param_groups, None)
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
        # Under Elastic Horovod a worker that joins a running job builds its optimizer
        # while the others already wait in the state sync: no collective may run here. The
        # collective check then runs in the first rebind (TorchState's sync, or the first
        # synchronize()); a rank whose own arguments are wrong builds no reducer, and that
        # check reports it on every rank.
        self._elastic = os.environ.get("HOROVOD_ELASTIC") == "1"
        self._bound_size = process_set.size()
        self._checked = not self._elastic
        if self._checked:
            check_collectively(self, named, groups, self._check_comm())
        elif local_errors(self, named, groups):
            compression = _Unbuildable(compression)
        self._comm = Comm(process_set, prefix=_collective_prefix(set_id, self._layout,
                                                                 compression))
        if isinstance(compression, _Unbuildable):
            return
        if self._sparse:
            # With a GradScaler the residual follows the loss scale between steps, which
            # needs e_t and g_t apart: no zero-copy error feedback then.
            self._reducer = SparseReducer(self._layout, compression, self._comm,
                                          ReduceOp(op, *self._scale_factors()),
                                          stats_callback=self._record,
                                          zero_copy=zero_copy and grad_scaler is None)
        else:
            self._groups = resolve_groups(groups, self._layout)
        if self._sparse or hvd.size() > 1 or os.environ.get("HOROVOD_ELASTIC") == "1":
            self._register_hooks()

    # ----- what kind of exchange ----------------------------------------------------------
    @property
    def _sparse(self) -> bool:
        return isinstance(self._compression, Sparsifier)

    @property
    def compression(self):
        """The compressor (for sparse methods: its threshold, density, state)."""
        return self._compression

    # ----- hooks ------------------------------------------------------------------------
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

    def _scale_factors(self) -> tuple[float, float]:
        if self.op == hvd.Average:
            return 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        return 1.0, 1.0

    # ----- synchronize / step -------------------------------------------------------------
    def synchronize(self) -> None:
        """Exchange the gradients now (``step()`` calls this unless inside
        ``skip_synchronize()``). On a rank outside the process set: nothing."""
        if self._closed:
            raise RuntimeError("this horovod_micro DistributedOptimizer was closed (its "
                               "parameters were wrapped again, or close() was called)")
        if self._included and (not self._checked
                               or self.process_set.size() != self._bound_size):
            self.rebind()
        if self._exchanged and self._reducer.grads_hold_the_aggregate():
            # Already exchanged, and no step(), zero_grad(), backward or new .grad since:
            # the gradients are the aggregate, and a second sparse exchange would change
            # them (dense exchanges run again, as Horovod's do: a second allreduce of
            # equal averages changes nothing).
            return
        try:
            change = self._parameter_change() if self._included else None
            if self._included and self._sparse:
                if self._state_sync_pending:
                    self._adopt_shared_state(check_parameters=True)
                self._follow_loss_scale()
                try:
                    self._reducer.reduce(PARAMS_CHANGED if change else OK)
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

    def _load_wrapped_state(self, state: dict) -> None:
        """Load the wrapped optimizer's ``state``, forgetting any exchange in flight; the
        next step synchronizes again (``load_state_dict`` and the elastic restore)."""
        self._forget_pending_exchange()
        self._synchronized = self._exchanged = False
        self._should_synchronize = True
        super(self.__class__, self).load_state_dict(state)

    def _parameter_change(self) -> str | None:
        """How ``param_groups`` differ from wrapping time (:mod:`.consistency`)."""
        return parameter_changes(self.param_groups, self._wrapped_ids, self._layout.params,
                                 self._parameter_names)

    def _adopt_shared_state(self, check_parameters: bool = False) -> None:
        """Make the iteration and the sparsifier's state (e.g. MiCRO's controller) those of
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

    def _check_same_parameters(self) -> None:
        """Raise on every rank unless every rank holds the same parameters.

        Ranks whose weights differ at the first exchange would train apart with no error:
        the model was not broadcast (``hvd.broadcast_parameters``), or two same-shaped
        models' optimizers were built in a different order on different ranks, so their
        collectives (named by shapes and build order) pair one rank's model with another
        rank's other model. Each rank gathers four float64 numbers once
        (:func:`_parameter_digest`, and whether it loaded a state), to within 1 % of the
        weights' norm. Skipped when any rank loaded a state: Horovod's resume idiom
        (``hvd.broadcast_optimizer_state`` after a load on rank 0) steps the other ranks'
        fresh optimizers on zero gradients, which weight decay turns into a change of the
        weights (of about ``lr`` per weight with Adam), as in stock Horovod.
        """
        digest = _parameter_digest([p.detach() for p in self._layout.params])
        loaded = torch.tensor([1.0 if self._loaded else 0.0], dtype=torch.float64)
        everyone = self._comm.allgather(torch.cat([digest, loaded]).view(1, 4), "parameters")
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
        if differ:
            raise CollectiveInputError(
                f"the parameters of rank(s) {differ} differ from those of the set's first "
                "rank at the first exchange: broadcast them first "
                "(hvd.broadcast_parameters(model.state_dict(), root_rank=0)), and build "
                "the optimizers of same-shaped models in the same order on every rank "
                "(their collectives pair up by shapes and build order)")

    def _follow_loss_scale(self) -> None:
        """With ``grad_scaler``, keep the residual and the threshold in the units of this
        step's gradients: GradScaler doubles the scale after ``growth_interval`` clean
        steps and halves it on an overflow, and ``synchronize()`` runs before
        ``unscale_``, so the residual holds loss-scaled values."""
        if self.grad_scaler is None or not self.grad_scaler.is_enabled():
            return
        scale = float(self.grad_scaler.get_scale())  # a host sync on a GPU, once a step
        if scale != self._loss_scale:
            self._reducer.rescale(scale / self._loss_scale)
            self._loss_scale = scale

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
        result = super(self.__class__, self).step(closure)
        self._mask_momentum()
        return result

    def _mask_momentum(self) -> None:
        """Momentum masking (:mod:`horovod_micro.momentum`), once per exchange."""
        reducer = self._reducer
        if reducer is None or reducer.applied is None:
            return
        applied, reducer.applied = reducer.applied, None
        if reducer.sparsifier.masks(reducer.comm.size):
            mask_momentum(self, self._layout.params, self._layout.slices, applied)

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

    # ----- checkpointing ----------------------------------------------------------------
    def state_dict(self) -> dict:
        """The wrapped optimizer's state plus, for sparse methods, this rank's residual,
        the iteration and the sparsifier's state (e.g. MiCRO's threshold controller).

        The residual belongs to this rank: the state records the rank and the set size,
        and :meth:`load_state_dict` refuses another rank's (the documentation's usage
        page, "Checkpoints and resuming").
        """
        state = super(self.__class__, self).state_dict()
        if self._reducer is not None:
            state[_STATE_KEY] = {**self._reducer.state_dict(), "loss_scale": self._loss_scale}
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a :meth:`state_dict`, all or nothing: if any part is refused, the
        optimizer keeps its state from before. A sparse state saved at another number of
        ranks loads on the rank that saved it (its residual) and maps the sparsifier's
        state onto this number of ranks, as an elastic reset does."""
        state_dict = dict(state_dict)
        sparse_state = state_dict.pop(_STATE_KEY, None)
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
        self._loss_scale = sparse_state.get("loss_scale", 1.0)
        self._state_sync_pending = True
        self._loaded = True


class _Unbuildable:
    """Stands in for a compressor that this rank's own check refused (elastic start):
    no reducer is built, and the deferred collective check raises on every rank."""

    def __init__(self, compression):
        self.compression = compression

    def __repr__(self) -> str:
        return f"unbuildable {self.compression!r}"


def _make_hook(optimizer: weakref.ref):
    def hook(p):
        opt = optimizer()
        if opt is not None:
            opt._on_gradient(p)
    return hook


def _remove_handles(handles: list) -> None:
    for handle in handles:
        handle.remove()


def _collective_prefix(set_id: int, layout: FlatLayout, compression) -> str:
    """Names for this optimizer's collectives, from what every rank of the set shares.

    Horovod matches collectives by name. The prefix combines the process set, a digest of
    the (already collectively checked) parameter signature and compressor settings, and
    how many such optimizers this process built before: ranks that build different
    numbers of optimizers for other process sets still name the same collective alike.
    """
    config = compression.config() if isinstance(compression, Sparsifier) else repr(compression)
    digest = hashlib.sha1(repr((layout.signature(), config)).encode()).hexdigest()[:10]
    key = (set_id, digest)
    _built[key] += 1
    return f"hvm.ps{set_id}.{digest}.{_built[key] - 1}"


def _parameter_digest(params: list[torch.Tensor]) -> torch.Tensor:
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


def _name_parameters(param_groups, named_parameters):
    all_params = [p for group in param_groups for p in group["params"]]
    if named_parameters is None:
        return [(f"allreduce.noname.{i}", p) for i, p in enumerate(all_params)]
    named = list(named_parameters)
    if any(not isinstance(item, tuple) or len(item) != 2 for item in named):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                         "usually produced by model.named_parameters().")
    in_optimizer = {id(p) for p in all_params}
    # Only parameters the optimizer updates take part, sorted by name as Horovod does, so
    # every rank builds the same flat layout. A tensor listed under several names (tied
    # weights, ``named_parameters(remove_duplicate=False)``) takes part once, under its
    # first name in that order: Horovod, too, keys its state by tensor.
    unique, seen = [], set()
    for n, p in sorted(named, key=lambda x: x[0]):
        if id(p) in in_optimizer and id(p) not in seen:
            seen.add(id(p))
            unique.append((n, p))
    return unique


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
        if isinstance(compression, Sparsifier):
            raise ValueError("op=hvd.Adasum cannot be combined with a sparse compressor")
        return hvd.DistributedOptimizer(
            optimizer, named_parameters=named_parameters, compression=compression,
            backward_passes_per_step=backward_passes_per_step, op=op,
            gradient_predivide_factor=gradient_predivide_factor, groups=groups,
            sparse_as_dense=sparse_as_dense, process_set=process_set)
    if not is_dense_compressor(compression) and not isinstance(compression, Sparsifier):
        raise TypeError(f"compression must be a horovod_micro or Horovod compressor, got "
                        f"{compression!r}")
    methods = {}
    for part in (DenseExchange, ElasticMethods, _DistributedOptimizer):
        methods.update({k: v for k, v in vars(part).items()
                        if k not in ("__dict__", "__weakref__")})
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), methods)
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
