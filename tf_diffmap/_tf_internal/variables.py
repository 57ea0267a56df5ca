"""The parameter store's variables: TensorFlow's resource variable, extended.

A store variable is the `tf.Variable` that the strategy's creator chain
made, whose class is then switched to `StoreVariable` (`adopt`): the class
adds methods and overrides the private read hook `_read_variable_op`, and
keeps every attribute its creators gave it. A variable split by rows
(`tf_diffmap.store.partitioned`) builds on the private `UninitializedVariable`
and records its reads on the gradient tape itself (`record_read`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import tensorflow as tf
from tensorflow.python.eager import record
from tensorflow.python.ops import resource_variable_ops
from tensorflow.python.trackable import base as trackable_base

ResourceVariable = resource_variable_ops.ResourceVariable


class InStore:
    """What every variable of the parameter store adds to a resource variable.

    * An eager read or write from a thread that is not a replica worker first
      waits for the updates in flight (`on_host_access`), so that whatever
      reads the model as a whole (an epoch's metrics, `get_weights`, a
      checkpoint, a callback) sees every update that was dispatched.
    * Inside a replica step, a large trainable variable read before the
      step's version claim gets a stand-in for its value (`_stands_in`),
      which `resolve_row_reads` turns into reads of the rows the step gathers.
    """

    _on_host_access: Callable[[], None] | None = None
    # Read once per replica step (see `snapshot_in_steps`).
    _snapshot_in_steps = False
    # Read as rows where a replica step gathers rows (see `_read_variable_op`).
    _read_as_rows = False

    def _before_eager_access(self) -> None:
        if self._on_host_access is not None and tf.executing_eagerly():
            self._on_host_access()

    def _stands_in(self) -> bool:
        """Whether a read now gets a stand-in: a large trainable variable read
        by a replica step's own graph before the step claims its version.

        Keras reads a table whole and gathers rows from the copy
        (`ops.take`), which moves and, once the table has had a sparse
        update, copies the whole table at every step. At the claim
        (`resolve_row_reads`) each gather of the stand-in becomes a gather
        beside the table, which reads only the rows, and any other use of
        it gets a whole read of the variable.
        """
        return (
            self._read_as_rows
            and _replica_tracing.reads_as_rows
            and not tf.executing_eagerly()
            and tf.compat.v1.get_default_graph() is _replica_tracing.step_graph
        )

    def _atomic_delta(self, value):
        """`d` when `value` is `self + d` read inside this trace, else None."""
        if tf.executing_eagerly() or not isinstance(value, tf.Tensor):
            return None
        op = value.op
        if op.type not in ("AddV2", "Add", "Sub"):
            return None
        first, second = op.inputs
        if not self._is_whole_read(first):
            return None
        return second if op.type != "Sub" else -second


def is_read_of(tensor: tf.Tensor, handle) -> bool:
    """Whether `tensor` is a `ReadVariableOp` of `handle` (or of its capture)."""
    read = tensor.op
    if read.type != "ReadVariableOp":
        return False
    used = read.inputs[0]
    captured = dict((id(i), e) for e, i in getattr(read.graph, "captures", ()))
    return captured.get(id(used)) is handle or used is handle


class StoreVariable(InStore, ResourceVariable):
    """A resource variable of the parameter store.

    Besides what `InStore` adds, inside a replica step Keras'
    `v.assign(v + d)` (how a Keras variable implements `assign_add`) is
    applied as one atomic `assign_add(d)`, so that counters and metric
    totals lose no increment when replicas write them at the same time. Any
    other `assign` there is noted in `_ReplicaTracing.plain_writes`: replicas
    that made it at the same time would race. Where the step's writes are
    deferred (`deferring_writes`), every write is held as an output instead.
    """

    @classmethod
    def adopt(cls, variable: tf.Variable, on_host_access: Callable[[], None]):
        """Turns a freshly created resource variable into a store variable.

        The variable keeps everything its creator chain gave it; only methods
        are added, so the class is switched instead of building a second one.
        """
        if type(variable) is not ResourceVariable:
            return variable
        variable.__class__ = cls
        variable._on_host_access = on_host_access
        variable._read_as_rows = (
            variable.trainable
            and variable.shape.rank is not None
            and variable.shape.rank >= 1
            and variable.shape.is_fully_defined()
            and variable.shape.num_elements() * variable.dtype.size >= ROWS_READ_BYTES
        )
        return variable

    def snapshot_in_steps(self) -> None:
        """Every read inside one replica step returns the step's first read.

        For a variable that a step reads twice and that other replicas may
        change in between, such as the dynamic loss scale: the step must
        unscale its gradient by the scale its loss was scaled with.
        """
        self._snapshot_in_steps = True

    def _read_variable_op(self, no_copy=False):
        """Reads the variable, or stands in for the read inside a replica
        step (see `InStore._stands_in`)."""
        self._before_eager_access()
        if self._snapshot_in_steps and _replica_tracing.active and not tf.executing_eagerly():
            return _replica_tracing.snapshot(
                self, lambda: super(StoreVariable, self)._read_variable_op(no_copy=no_copy)
            )
        if self._stands_in():
            return _replica_tracing.stand_in(self)
        return super()._read_variable_op(no_copy=no_copy)

    def _is_whole_read(self, tensor) -> bool:
        return is_read_of(tensor, self.handle)

    def _gather_where_stored(self, ids: tf.Tensor) -> tf.Tensor:
        """Rows `ids` (any shape) read beside the variable (at the claim)."""
        return tf.raw_ops.ResourceGather(
            resource=self.handle, indices=ids, dtype=self.dtype, validate_indices=True
        )

    def _read_whole(self) -> tf.Tensor:
        """The whole value, read without a tape record (at the claim)."""
        return tf.raw_ops.ReadVariableOp(resource=self.handle, dtype=self.dtype)

    def assign(self, value, use_locking=None, name=None, read_value=True):
        self._before_eager_access()
        if _replica_tracing.active:
            delta = self._atomic_delta(value)
            if delta is not None:
                return self.assign_add(
                    delta, use_locking=use_locking, name=name, read_value=read_value
                )
            if _replica_tracing.plain_writes is not None:
                _replica_tracing.plain_writes.append(self.name)
            if _replica_tracing.deferred is not None:
                return _replica_tracing.deferred.write(self, value, plain=True)
        return super().assign(value, use_locking=use_locking, name=name, read_value=read_value)

    def assign_add(self, delta, use_locking=None, name=None, read_value=True):
        self._before_eager_access()
        if _replica_tracing.active and _replica_tracing.deferred is not None:
            return _replica_tracing.deferred.write(self, delta, plain=False)
        return super().assign_add(delta, use_locking, name, read_value)

    def assign_sub(self, delta, use_locking=None, name=None, read_value=True):
        self._before_eager_access()
        if _replica_tracing.active and _replica_tracing.deferred is not None:
            return _replica_tracing.deferred.write(self, -tf.convert_to_tensor(delta), plain=False)
        return super().assign_sub(delta, use_locking, name, read_value)


class DeferredWrites:
    """A replica step's writes to store variables, held as outputs of the
    step rather than applied (a step that applies no update, on a cluster).

    Its caller applies them once the step's call has returned, so that a
    call cut off by a lost worker has written nothing, and running its
    shard again elsewhere counts it once. Per variable, in the order first
    written: an addition (`assign_add` of the held value), or, once the step
    assigned it a value that is not an addition to its own, an assignment
    of that value plus any addition after it. A read inside the step does
    not see what the step wrote.

    Attributes:
        variables: the variables written, in order.
        plain: per variable, whether its write is an assignment.
        values: per variable, the value to add or assign.
    """

    def __init__(self):
        self.variables: list[StoreVariable] = []
        self.plain: list[bool] = []
        self.values: list[tf.Tensor] = []

    def write(self, variable: StoreVariable, value, plain: bool) -> tf.Tensor:
        """Holds a write: an assignment (`plain`) or an addition of `value`."""
        value = tf.cast(tf.convert_to_tensor(value), variable.dtype)
        for k, held in enumerate(self.variables):
            if held is variable:
                self.plain[k] = self.plain[k] or plain
                self.values[k] = value if plain else self.values[k] + value
                return self.values[k]
        self.variables.append(variable)
        self.plain.append(plain)
        self.values.append(value)
        return value


class _ReplicaTracing(threading.local):
    """Whether this thread is tracing a replica step (set by the strategy).

    Attributes:
        active: whether a replica step is being traced.
        step_graph: the graph of that step (None when it runs eagerly).
        snapshots: per variable id, the step graph's first read of it.
        plain_writes: the names of the store variables the step assigns a
            value that is not an addition to their own (None outside a step).
    """

    active = False
    plain_writes: list[str] | None = None
    # Where a step's writes are held rather than applied (`deferring_writes`).
    deferred: DeferredWrites | None = None
    step_graph = None
    # Whether reads of large variables get stand-ins (until the claim).
    reads_as_rows = False

    def __init__(self):
        self.snapshots: dict[int, tf.Tensor] = {}
        self.stand_ins: dict[int, tuple[StoreVariable, list[tf.Tensor]]] = {}

    def stand_in(self, variable: StoreVariable) -> tf.Tensor:
        """A tensor that stands for `variable`'s value until the claim.

        It has the variable's shape and dtype, and gradients flow from it to
        the variable as from a read. `resolve_row_reads` rewires its users;
        should one be left (a user made after the claim), running it fails
        with an error that names it, rather than computing with a wrong value.
        """
        shape = variable.shape.as_list()
        name = f"tf_diffmap_unresolved_read_of_{variable.name.split(':')[0].replace('/', '_')}"
        empty = tf.raw_ops.PlaceholderWithDefault(
            input=tf.zeros([0, *shape[1:]], variable.dtype), shape=[None, *shape[1:]]
        )
        value = tf.ensure_shape(empty, shape, name=name)
        record_read(variable, value)
        self.stand_ins.setdefault(id(variable), (variable, []))[1].append(value)
        return value

    def snapshot(self, variable, read: Callable[[], tf.Tensor]) -> tf.Tensor:
        """The step graph's first read of `variable`, made by `read` if none.

        A graph nested in the step graph (a `tf.cond` branch) uses that read
        too; a read made first in a nested graph is not kept for others.
        """
        graph = tf.compat.v1.get_default_graph()
        cached = self.snapshots.get(id(variable))
        if cached is not None:
            outer = graph
            while outer is not None:
                if outer is cached.graph:
                    return cached
                outer = getattr(outer, "outer_graph", None)
        value = read()
        if graph is self.step_graph:
            self.snapshots[id(variable)] = value
        return value


_replica_tracing = _ReplicaTracing()

# Trainable store variables of at least this many bytes are read as rows
# where a replica step gathers rows of them (`StoreVariable._read_variable_op`).
ROWS_READ_BYTES = 256 << 10


def replica_tracing() -> _ReplicaTracing:
    """This thread's replica-step tracing state (set by the strategy)."""
    return _replica_tracing


@contextlib.contextmanager
def deferring_writes():
    """Within: the store variables' writes of the replica step being traced
    are held (`DeferredWrites`, which it yields), not applied."""
    previous, _replica_tracing.deferred = _replica_tracing.deferred, DeferredWrites()
    try:
        yield _replica_tracing.deferred
    finally:
        _replica_tracing.deferred = previous


# -- what a variable split by rows uses (`tf_diffmap.store.partitioned`) -----------

# The base of `partitioned.PartitionedVariable`: a variable whose handle is
# made, never allocated; `checks.compatibility_problems` says when it is gone.
UninitializedVariable = getattr(
    resource_variable_ops, "UninitializedVariable", resource_variable_ops.BaseResourceVariable
)

# The name a variable's value has in a checkpoint.
VARIABLE_VALUE_KEY = getattr(trackable_base, "VARIABLE_VALUE_KEY", "VARIABLE_VALUE")


def record_read(variable, value: tf.Tensor) -> None:
    """Tells the gradient tapes that `value` is a read of `variable`.

    A gradient of `value` then reaches `variable` (its handle), as for a
    read of a plain variable.
    """
    resource_variable_ops.variable_accessed(variable)
    record.record_operation(
        "ReadVariableOp",
        [value],
        [variable.handle],
        backward_function=lambda x: [x],
        forward_function=lambda x: [x],
    )


def record_rows_read(variable, ids: tf.Tensor, rows: tf.Tensor) -> None:
    """Tells the gradient tapes that `rows` are rows `ids` of `variable`.

    Their gradient reaches `variable` as `tf.IndexedSlices` of those ids.
    """
    resource_variable_ops.variable_accessed(variable)
    dense_shape = tf.constant(variable.shape.as_list(), tf.int64)
    row_shape = variable.shape.as_list()[1:]

    def rows_gradient(gradient):
        values = tf.reshape(gradient, [-1, *row_shape])
        return [tf.IndexedSlices(values, tf.reshape(ids, [-1]), dense_shape), None]

    record.record_operation(
        "ResourceGather", [rows], [variable.handle, ids], backward_function=rows_gradient
    )
