"""One replica step while it is traced: its version claim and what it read.

A replica step reads the store's count of completed updates before its forward
pass, and claims a new version once its gradient is known, before its first
update. The hooks of the strategy and `AsyncOptimizer` meet here: both find
the step being traced with `current_step()`.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tf_diffmap import _tf_internal
from tf_diffmap.store.parameter_store import ParameterStore
from tf_diffmap.updates import sparse

__all__ = ["Claim", "StepState", "current_step", "step_reach", "tracing_step"]

_tracing = _tf_internal.replica_tracing()


def step_reach(fn) -> tuple[Any, list]:
    """What a step function can reach: the object a bound method belongs
    to (None for a plain function), and the values its code names as free
    variables or globals."""
    target = inspect.unwrap(fn)
    owner = getattr(target, "__self__", None)
    if owner is not None:
        target = getattr(target, "__func__", target)
    try:
        named = inspect.getclosurevars(target)
    except (TypeError, ValueError):
        return owner, []
    return owner, [*named.nonlocals.values(), *named.globals.values()]


class Claim:
    """A replica step's claim on a store version.

    Attributes:
        staleness: int64 scalar: versions claimed by others between this
            step's read and this claim.
        step_staleness: int64 scalar: optimizer steps applied between this
            step's read and this claim, where the strategy aggregates
            gradients into steps; else None (every update is a step, and
            the staleness in steps is `staleness`).
        applied: bool scalar: False when a staleness rule dropped the update.
        lr_scale: float scalar the learning rate is multiplied by, or None.
        keep: bool scalar, set by a rule that drops updates before an
            aggregated push (`AsyncOptimizer(drop_above=...)`), or None.
    """

    def __init__(self, staleness: tf.Tensor, step_staleness: tf.Tensor | None = None):
        self.staleness = staleness
        self.step_staleness = step_staleness
        self.applied: tf.Tensor | None = None
        self.lr_scale: tf.Tensor | None = None
        self.keep: tf.Tensor | None = None


class StepState:
    """What one replica step knows while it is traced (or run eagerly).

    The step claims its version once its gradient is known, before its first
    update; updates that need no gradient (weight decay) wait for the claim.
    A claim made inside a conditional (Keras' loss-scale optimizer applies
    updates under `tf.cond`) belongs to that branch's graph and to the graphs
    nested in it.

    Attributes:
        replica_id: int32 scalar tensor.
        read_version: the store version read before the forward pass.
        read_steps: the optimizer steps applied at that read, where the
            strategy aggregates gradients into steps (else None).
        read_time: float64 scalar, when the step read, where the strategy
            aggregates (else None).
        window_reads: per fresh windows' gate (`tf_diffmap.store.gate`, by
            id), the windows whose step was applied when the step read.
        aggregating: whether the strategy aggregates gradients into steps
            (`tf_diffmap.updates.aggregation` then applies the step's optimizer).
        claimed: whether any claim was made while tracing.
        pushed: whether an aggregated push was traced.
        sparse_updates: `"lazy"` (rows only) or `"dense"` (Keras' update),
            for the step's `IndexedSlices` gradients (`tf_diffmap.updates.sparse`).
        splits_penalties: whether weight regularizers give this step their
            value and no gradient (`tf_diffmap.updates.penalties`).
        penalized: per Keras variable id, `(variable, regularizer)` of each
            penalty whose gradient the step's loss left to the store.
        penalties_taken: the ids of those an aggregation took.
    """

    def __init__(
        self,
        store: ParameterStore,
        replica_id: tf.Tensor,
        examples: tf.Tensor | None = None,
        aggregating: bool = False,
        gates: Sequence = (),
    ):
        self.store = store
        self.replica_id = replica_id
        self.examples = examples
        self.aggregating = aggregating
        self.graph = tf.compat.v1.get_default_graph()
        # Per fresh windows' gate (by id), the windows whose step this
        # step's read saw applied: read first, before the parameters.
        self.window_reads = {id(gate): gate.read_closed() for gate in gates}
        self.read_version = store.read_version()
        self.read_steps = store.read_optimizer_steps() if aggregating else None
        # When the step read: a fresh window's patience is measured from it.
        with tf.device(store.host):
            self.read_time = tf.timestamp() if aggregating else None
        self.claimed = False
        self.pushed = False
        # How an `IndexedSlices` gradient is applied (`tf_diffmap.updates.sparse`);
        # `AsyncOptimizer(sparse_updates=...)` sets it for its updates.
        self.sparse_updates = "lazy"
        self.splits_penalties = False
        self.penalized: dict[int, tuple[Any, Any]] = {}
        self.penalties_taken: set[int] = set()
        self._claims: dict[Any, Claim] = {}
        self._deferred: dict[Any, list] = {}
        # Filled on first use: the step graph's first read of each variable.
        self._first_reads: dict[int, tf.Tensor] | None = None
        self._internal_handles: dict[int, tf.Tensor] = {}
        # Per variable id, how the step read a large variable (see
        # `_tf_internal.StoreVariable`): filled when the step claims.
        self._row_reads: dict[int, _tf_internal.RowReads] = {}

    def _graphs(self):
        """The graph being built and those it is nested in (None: eager)."""
        graph = _graph_now()
        if graph is None:
            yield None
        while graph is not None:
            yield graph
            graph = getattr(graph, "outer_graph", None)

    def current_claim(self) -> Claim | None:
        """The claim visible from the current graph, if any."""
        for graph in self._graphs():
            claim = self._claims.get(_key(graph))
            if claim is not None:
                return claim
        return None

    def claim(self, after: Sequence[Any], record: bool = True) -> Claim:
        """Claims a version once `after` (the gradients) are computed.

        Args:
            after: tensors the claim waits for.
            record: record the update in the statistics now, as applied
                with an unchanged learning rate. `AsyncOptimizer` passes
                False and calls `record` itself once its rule has decided.
        """
        existing = self.current_claim()
        if existing is not None:
            return existing
        self._resolve_reads()
        deps = [t for t in (as_dependency(a) for a in tf.nest.flatten(after)) if t is not None]
        with tf.control_dependencies(deps):
            staleness = self.store.claim_version(self.read_version, self.replica_id)
        step_staleness = None
        if self.read_steps is not None:
            with tf.control_dependencies([staleness]):
                steps_now = self.store.read_optimizer_steps()
            with tf.device(self.store.host):
                step_staleness = tf.maximum(steps_now - self.read_steps, 0)
        claim = Claim(staleness, step_staleness)
        self._claims[_key(_graph_now())] = claim
        self.claimed = True
        if record:
            self.record(claim, tf.constant(True), None)
        return claim

    def record(self, claim: Claim, applied: tf.Tensor, lr_scale: tf.Tensor | None) -> None:
        """Records a claimed update in the store's statistics."""
        claim.applied, claim.lr_scale = applied, lr_scale
        self.store.record(
            self.replica_id,
            claim.staleness,
            applied,
            lr_scale,
            self.examples,
            step_staleness=claim.step_staleness,
        )

    def claim_outside_replicas(self) -> Claim:
        """A claim for updates made outside any replica's step (an
        aggregation's flush at a drain): it takes no version and records
        nothing, and the updates of the current graph wait for nothing."""
        claim = Claim(tf.constant(0, tf.int64), tf.constant(0, tf.int64))
        self._claims[_key(_graph_now())] = claim
        self.claimed = True
        return claim

    def update(self, var, fn, args, kwargs):
        """Applies one of the step's updates to a trainable store variable.

        `fn(var, *args, **kwargs)` is the optimizer's update (Keras' calls it
        with `(gradient, learning_rate)`). It waits for the step's claim,
        made here once the gradient is known; an update that comes before
        any gradient (weight decay) is deferred until the claim. A rule's
        learning-rate factor scales the learning rate, and an
        `IndexedSlices` gradient updates rows alone (`tf_diffmap.updates.sparse`)
        unless the optimizer asked for Keras' dense update.
        """
        claim = self.current_claim()
        if claim is None:
            gradients = [
                a
                for a in tf.nest.flatten((args, kwargs))
                if isinstance(as_dependency(a), tf.Tensor) and a.shape == var.shape
            ]
            if not gradients:
                # No gradient yet (Keras applies weight decay before the
                # gradients): apply it after the step claims its version.
                def deferred():
                    with tf.device(var.device):
                        fn(var, *args, **kwargs)

                self.defer(deferred)
                return None
            claim = self.claim(after=gradients)
        self.flush()
        if claim.lr_scale is not None and len(args) == 2 and not kwargs:
            # Keras' optimizers update with (gradient, learning_rate).
            gradient, learning_rate = args
            learning_rate = tf.convert_to_tensor(learning_rate)
            learning_rate = learning_rate * tf.cast(claim.lr_scale, learning_rate.dtype)
            args = (gradient, learning_rate)
        with tf.control_dependencies([claim.staleness]):
            if (
                self.sparse_updates == "lazy"
                and len(args) == 2
                and not kwargs
                and isinstance(args[0], tf.IndexedSlices)
            ):
                optimizer = _tf_internal.optimizer_of_update(fn)
                if optimizer is not None and sparse.updates_rows(optimizer):
                    return sparse.update_rows(optimizer, var, *args)
            with tf.device(var.device):
                return fn(var, *args, **kwargs)

    def defer(self, update) -> None:
        self._deferred.setdefault(_key(_graph_now()), []).append(update)

    def flush(self) -> None:
        """Applies the updates deferred in this graph (after the claim)."""
        pending = self._deferred.pop(_key(_graph_now()), [])
        if pending:
            with tf.control_dependencies([self.current_claim().staleness]):
                for update in pending:
                    update()

    def finish(self, outputs: Any) -> Any:
        """Runs what was deferred, claiming a version if none was yet.

        Returns:
            `outputs`, where a value read by rows stood in for is replaced
            by its read (see `_tf_internal.rewire_late_uses`).
        """
        eager = tf.executing_eagerly()
        if self._deferred.get(_key(None if eager else self.graph)):
            self.claim(after=outputs)
            self.flush()
        self._resolve_reads()
        if eager:
            return outputs
        with self.graph.as_default():
            return _tf_internal.rewire_late_uses(self._row_reads, outputs)

    def _resolve_reads(self) -> None:
        if not tf.executing_eagerly():
            self._row_reads.update(_tf_internal.resolve_row_reads())

    def read_rows_of(self, variable, ids: tf.Tensor) -> tf.Tensor:
        """Rows `ids` of `variable` as this step's forward pass read them.

        For a table the step gathered rows of, those are the rows its
        lookups read; an id no lookup read (and a variable read whole)
        takes the row from the step's whole read, or reads it now.

        Args:
            variable: a `tf.Variable` the step read.
            ids: int64 `[k]` row ids.

        Returns:
            `[k, ...]` rows.
        """
        reads = self._row_reads.get(id(variable))
        if reads is None or reads.value is not None or not reads.lookups:
            return tf.gather(self.read_value_of(variable), ids)
        if len(reads.lookups) == 1:
            looked_up, rows = reads.lookups[0]
        else:
            looked_up = tf.concat([i for i, _ in reads.lookups], 0)
            rows = tf.concat([r for _, r in reads.lookups], 0)
        order = tf.argsort(looked_up, stable=True)
        ordered = tf.gather(looked_up, order)
        at = tf.minimum(tf.searchsorted(ordered, ids), tf.size(ordered) - 1)
        found = tf.gather(ordered, at) == ids
        read = tf.gather(rows, tf.gather(order, at))
        now = variable.sparse_read(ids)
        mask = tf.reshape(found, [-1] + [1] * (read.shape.rank - 1))
        return tf.where(mask, read, now)

    def read_value_of(self, variable) -> tf.Tensor:
        """The value of `variable` that this step's forward pass read.

        In a traced step that is the output of the first read of the variable
        in the step's graph; a variable the forward pass did not read (and an
        eager step) reads it now.
        """
        reads = self._row_reads.get(id(variable))
        if reads is not None and reads.value is not None:
            return reads.value
        if not tf.executing_eagerly() and self._first_reads is None:
            self._internal_handles = {
                id(external): internal for external, internal in self.graph.captures
            }
            self._first_reads = {}
            for op in self.graph.get_operations():
                if op.type == "ReadVariableOp":
                    self._first_reads.setdefault(id(op.inputs[0]), op.outputs[0])
        internal = self._internal_handles.get(id(variable.handle))
        if internal is not None and id(internal) in (self._first_reads or {}):
            return self._first_reads[id(internal)]
        return variable.read_value()


def current_step() -> StepState | None:
    """The replica step being traced in this thread, if any.

    `tf_diffmap.AsyncOptimizer` reads the step's staleness from here.
    """
    return getattr(_tracing, "step", None)


_FIELDS = (
    "active",
    "step_graph",
    "snapshots",
    "reads_as_rows",
    "stand_ins",
    "step",
    "plain_writes",
)


@contextlib.contextmanager
def tracing_step(state: StepState | None, reads_as_rows: bool = True):
    """Marks this thread as tracing (or eagerly running) `state`'s step.

    Args:
        state: the step.
        reads_as_rows: whether reads of large variables before the claim
            get stand-ins (see `_tf_internal.InStore`): a replica step's
            forward pass, not a function that updates without one.
    """
    previous = [getattr(_tracing, field, None) for field in _FIELDS]
    graph = _graph_now()
    fresh = (True, graph, {}, reads_as_rows and graph is not None, {}, state, [])
    for field, value in zip(_FIELDS, fresh):
        setattr(_tracing, field, value)
    try:
        yield
    finally:
        for field, value in zip(_FIELDS, previous):
            setattr(_tracing, field, value)


def _graph_now():
    """The graph being built, or None when executing eagerly."""
    return None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()


def _key(graph) -> Any:
    # Eager execution has no graph object to key on.
    return id(graph) if graph is not None else None


def as_dependency(value):
    if isinstance(value, tf.IndexedSlices):
        return value.values
    if isinstance(value, (tf.Tensor, tf.Operation)):
        return value
    return None
