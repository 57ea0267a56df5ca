"""One replica step while it is traced: its version claim and what it read.

A replica step reads the store's count of completed updates before its forward
pass, and claims a new version once its gradient is known, before its first
update. The hooks of the strategy and `AsyncOptimizer` meet here: both find
the step being traced with `current_step()`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tf_diffmap import _tf_internal
from tf_diffmap.store import ParameterStore

__all__ = ["Claim", "StepState", "current_step", "tracing_step"]

_tracing = _tf_internal.replica_tracing()


class Claim:
    """A replica step's claim on a store version.

    Attributes:
        staleness: int64 scalar: versions claimed by others between this
            step's read and this claim.
        applied: bool scalar: False when a staleness rule dropped the update.
        lr_scale: float scalar the learning rate is multiplied by, or None.
    """

    def __init__(self, staleness: tf.Tensor):
        self.staleness = staleness
        self.applied: tf.Tensor | None = None
        self.lr_scale: tf.Tensor | None = None


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
        claimed: whether any claim was made while tracing.
        sparse_updates: `"lazy"` (rows only) or `"dense"` (Keras' update),
            for the step's `IndexedSlices` gradients (`tf_diffmap.sparse`).
    """

    def __init__(
        self, store: ParameterStore, replica_id: tf.Tensor, examples: tf.Tensor | None = None
    ):
        self.store = store
        self.replica_id = replica_id
        self.examples = examples
        self.graph = tf.compat.v1.get_default_graph()
        self.read_version = store.read_version()
        self.claimed = False
        # How an `IndexedSlices` gradient is applied (`tf_diffmap.sparse`);
        # `AsyncOptimizer(sparse_updates=...)` sets it for its updates.
        self.sparse_updates = "lazy"
        self._claims: dict[Any, Claim] = {}
        self._deferred: dict[Any, list] = {}
        # Filled on first use: the step graph's first read of each variable.
        self._first_reads: dict[int, tf.Tensor] | None = None
        self._internal_handles: dict[int, tf.Tensor] = {}
        # Per variable id, how the step read a large variable (see
        # `_tf_internal.StoreVariable`): filled when the step claims.
        self._row_reads: dict[int, _tf_internal.RowReads] = {}

    @staticmethod
    def _graph_key(graph) -> Any:
        # Eager execution has no graph object to key on.
        return id(graph) if graph is not None else None

    def _graphs(self):
        graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
        while graph is not None:
            yield graph
            graph = getattr(graph, "outer_graph", None)
        if tf.executing_eagerly():
            yield None

    def current_claim(self) -> Claim | None:
        """The claim visible from the current graph, if any."""
        for graph in self._graphs():
            claim = self._claims.get(self._graph_key(graph))
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
            claim = Claim(self.store.claim_version(self.read_version, self.replica_id))
        graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
        self._claims[self._graph_key(graph)] = claim
        self.claimed = True
        if record:
            self.record(claim, tf.constant(True), None)
        return claim

    def record(self, claim: Claim, applied: tf.Tensor, lr_scale: tf.Tensor | None) -> None:
        """Records a claimed update in the store's statistics."""
        claim.applied, claim.lr_scale = applied, lr_scale
        self.store.record(self.replica_id, claim.staleness, applied, lr_scale, self.examples)

    def defer(self, update) -> None:
        graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
        self._deferred.setdefault(self._graph_key(graph), []).append(update)

    def flush(self) -> None:
        """Applies the updates deferred in this graph (after the claim)."""
        graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
        pending = self._deferred.pop(self._graph_key(graph), [])
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
        key = self._graph_key(None if tf.executing_eagerly() else self.graph)
        if self._deferred.get(key):
            self.claim(after=outputs)
            self.flush()
        self._resolve_reads()
        if tf.executing_eagerly():
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


_current = threading.local()


def current_step() -> StepState | None:
    """The replica step being traced in this thread, if any.

    `tf_diffmap.AsyncOptimizer` reads the step's staleness from here.
    """
    return getattr(_current, "step", None)


@contextlib.contextmanager
def tracing_step(state: StepState | None):
    previous = (
        _tracing.active,
        _tracing.step_graph,
        _tracing.snapshots,
        _tracing.reads_as_rows,
        _tracing.stand_ins,
        getattr(_current, "step", None),
    )
    graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
    _tracing.active, _tracing.step_graph, _tracing.snapshots = True, graph, {}
    _tracing.reads_as_rows, _tracing.stand_ins = graph is not None, {}
    _current.step = state
    try:
        yield
    finally:
        (
            _tracing.active,
            _tracing.step_graph,
            _tracing.snapshots,
            _tracing.reads_as_rows,
            _tracing.stand_ins,
            _current.step,
        ) = previous


def as_dependency(value):
    if isinstance(value, tf.IndexedSlices):
        return value.values
    if isinstance(value, (tf.Tensor, tf.Operation)):
        return value
    return None
