"""The one module that touches TensorFlow's private APIs.

`tf.distribute` offers no public way to write a strategy: a strategy is a
subclass of `tf.distribute.Strategy` whose `StrategyExtended` overrides private
hooks. Everything tf_diffmap relies on beyond the public API is named here, so
that a TensorFlow upgrade touches one file, and `check_compatibility` (run when
a `Strategy` is built, and by the test suite) fails loudly with a clear message
when a release changes any of it.
"""

from __future__ import annotations

import dataclasses
import inspect
import threading
from collections.abc import Callable

import keras
import tensorflow as tf
from tensorflow.python.eager import record
from tensorflow.python.ops import control_flow_util, resource_variable_ops, summary_ops_v2
from tensorflow.python.trackable import base as trackable_base

from tf_diffmap.devices import task_of

TESTED_TENSORFLOW = ("2.21",)

# Base classes of the strategy (public names for private classes).
StrategyBase = tf.distribute.Strategy
ExtendedBase = tf.compat.v1.distribute.StrategyExtended
ResourceVariable = resource_variable_ops.ResourceVariable

# Private hooks that `strategy._AsyncExtended` overrides, with the parameters
# TensorFlow calls them with. A change in any of them means the strategy may no
# longer be called the way it was written for.
EXTENDED_HOOKS: dict[str, tuple[str, ...]] = {
    "_create_variable": ("self", "next_creator"),
    "_validate_colocate_with_variable": ("self", "colocate_with_variable"),
    "_call_for_each_replica": ("self", "fn", "args", "kwargs"),
    "_experimental_distribute_dataset": ("self", "dataset", "options"),
    "_distribute_datasets_from_function": ("self", "dataset_fn", "options"),
    "_reduce_to": ("self", "reduce_op", "value", "destinations", "options"),
    "_replica_ctx_all_reduce": ("self", "reduce_op", "value", "options"),
    "_replica_ctx_update": ("self", "var", "fn", "args", "kwargs", "group"),
    "_update": ("self", "var", "fn", "args", "kwargs", "group"),
    "_update_non_slot": ("self", "colocate_with", "fn", "args", "kwargs", "group"),
    "_local_results": ("self", "val"),
    "_use_merge_call": ("self",),
    "_in_multi_worker_mode": ("self",),
    "_num_replicas_in_sync": None,  # a property
}

# Hooks that the base class does not define but TensorFlow calls: the caller
# must still mention them.
CALLED_HOOKS: dict[str, object] = {
    "_get_local_replica_id": tf.distribute.ReplicaContext.__init__,
}

# Private methods of ResourceVariable that `StoreVariable` overrides.
VARIABLE_HOOKS: dict[str, tuple[str, ...]] = {
    "_read_variable_op": ("self", "no_copy"),
}


def _parameter_names(obj: object) -> tuple[str, ...]:
    return tuple(inspect.signature(obj).parameters)


def _source(obj: object) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def compatibility_problems() -> list[str]:
    """Returns what differs from the TensorFlow internals tf_diffmap was built on."""
    problems = []
    for name, params in EXTENDED_HOOKS.items():
        member = inspect.getattr_static(ExtendedBase, name, None)
        if member is None:
            problems.append(f"tf.distribute StrategyExtended has no `{name}`")
        elif params is None:
            if not isinstance(member, property):
                problems.append(f"StrategyExtended.{name} is no longer a property")
        elif _parameter_names(member)[: len(params)] != params:
            problems.append(
                f"StrategyExtended.{name} takes {_parameter_names(member)}, expected {params}"
            )
    for name, caller in CALLED_HOOKS.items():
        if name not in _source(caller):
            problems.append(f"{caller.__qualname__} no longer calls `{name}`")
    for name, params in VARIABLE_HOOKS.items():
        member = getattr(ResourceVariable, name, None)
        if member is None:
            problems.append(f"ResourceVariable has no `{name}`")
        elif _parameter_names(member)[: len(params)] != params:
            problems.append(
                f"ResourceVariable.{name} takes {_parameter_names(member)}, expected {params}"
            )
    state = getattr(summary_ops_v2, "_summary_state", None)
    if state is None or not all(hasattr(state, a) for a in ("writer", "step", "is_recording")):
        problems.append("tf.summary keeps its per-thread state elsewhere")
    if not callable(getattr(control_flow_util, "GraphOrParentsInXlaContext", None)):
        problems.append("control_flow_util.GraphOrParentsInXlaContext is gone")
    for name in ("_functions", "_inputs"):
        if not callable(getattr(tf.data.Dataset, name, None)):
            problems.append(f"tf.data.Dataset.{name} is gone")
    if not hasattr(tf.raw_ops, "ResourceCountUpTo"):
        problems.append("tf.raw_ops.ResourceCountUpTo is gone")
    optimizer_classes = keras.optimizers.Optimizer.__mro__
    if not any("_distribution_strategy" in _source(c.__init__) for c in optimizer_classes):
        problems.append("Keras optimizers no longer have `_distribution_strategy`")
    problems += _optimizer_problems()
    problems += _variable_problems()
    for name in ("_set_device", "_is_stateful", "_update_input"):
        if not hasattr(tf.Operation, name):
            problems.append(f"tf.Operation.{name} is gone")
    return problems


def _variable_problems() -> list[str]:
    """What `StoreVariable` and `PartitionedVariable` rely on."""
    problems = []
    uninitialized = getattr(resource_variable_ops, "UninitializedVariable", None)
    if uninitialized is None:
        problems.append("resource_variable_ops.UninitializedVariable is gone")
    else:
        wanted = {"shape", "dtype", "name", "trainable", "synchronization", "aggregation"}
        missing = wanted - set(_parameter_names(uninitialized.__init__))
        if missing:
            problems.append(f"UninitializedVariable no longer takes {sorted(missing)}")
    if not callable(getattr(record, "record_operation", None)):
        problems.append("tensorflow.python.eager.record.record_operation is gone")
    if not callable(getattr(resource_variable_ops, "variable_accessed", None)):
        problems.append("resource_variable_ops.variable_accessed is gone")
    if getattr(trackable_base, "VARIABLE_VALUE_KEY", None) is None:
        problems.append("Trackable's VARIABLE_VALUE_KEY is gone")
    for name in ("_serialize_to_tensors", "_restore_from_tensors", "_export_to_saved_model_graph"):
        if not callable(getattr(ResourceVariable, name, None)):
            problems.append(f"ResourceVariable.{name} is gone")
        elif f"self.value.{name}" not in _source(getattr(keras.Variable, name, None)):
            problems.append(f"keras.Variable.{name} no longer hands over to its tf.Variable")
    return problems


def check_compatibility() -> None:
    """Raises `RuntimeError` if TensorFlow's internals moved.

    Raises:
        RuntimeError: naming every hook that changed, the TensorFlow version
            found and the versions tf_diffmap was tested with.
    """
    problems = compatibility_problems()
    if problems:
        raise RuntimeError(
            f"tf_diffmap was built against TensorFlow {', '.join(TESTED_TENSORFLOW)}"
            f" and found TensorFlow {tf.__version__}, whose internals differ: "
            + "; ".join(problems)
            + ". Install a TensorFlow version that tf_diffmap supports "
            "(see its pyproject.toml)."
        )


def in_xla_context() -> bool:
    """Whether the graph being built will be compiled by XLA (jit_compile)."""
    return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))


def optimizer_strategy(optimizer: object) -> tf.distribute.Strategy | None:
    """The strategy a Keras optimizer was created under, or None if it keeps none.

    A Keras optimizer remembers the strategy current when it was created and
    creates its variables (momentum, moments) under it.
    """
    return getattr(optimizer, "_distribution_strategy", None)


# Where Keras' optimizers keep their slots: per row-update kind, the slot's
# name in `sparse` and the list attribute of the optimizer that holds it, in
# the order of the optimizer's variables (`_get_variable_index`).
OPTIMIZER_SLOTS: dict[type, dict[str, str]] = {
    keras.optimizers.SGD: {"momentum": "momentums"},
    keras.optimizers.Adam: {
        "momentum": "_momentums",
        "velocity": "_velocities",
        "velocity_hat": "_velocity_hats",
    },
    keras.optimizers.Adagrad: {"accumulator": "_accumulators"},
    keras.optimizers.Ftrl: {"accumulator": "_accumulators", "linear": "_linears"},
}


def optimizer_slots(optimizer, variable) -> dict[str, tf.Variable]:
    """The slot variables that `optimizer` keeps for `variable`, by name.

    Uses Keras' private `_get_variable_index` and slot lists (see
    `OPTIMIZER_SLOTS`), the way each optimizer's own `update_step` does.
    """
    index = optimizer._get_variable_index(variable)  # noqa: SLF001
    for cls, names in OPTIMIZER_SLOTS.items():
        if isinstance(optimizer, cls):
            slots = {}
            for name, attribute in names.items():
                held = getattr(optimizer, attribute, None)
                if held:
                    slot = held[index]
                    slots[name] = slot.value if isinstance(slot, keras.Variable) else slot
            return slots
    return {}


def optimizer_of_update(fn) -> object | None:
    """The Keras optimizer whose update `fn` applies, or None.

    Keras' TensorFlow backend hands each variable's update to the strategy
    (`extended.update(var, fn, args=(gradient, learning_rate))`) as a
    function nested in the optimizer's `_distributed_tf_update_step`, which
    calls `self.update_step`: the optimizer is that function's `self`.
    """
    code = getattr(fn, "__code__", None)
    if code is None or not fn.__closure__:
        return None
    for name, cell in zip(code.co_freevars, fn.__closure__, strict=False):
        if name == "self":
            try:
                candidate = cell.cell_contents
            except ValueError:
                return None
            if isinstance(candidate, keras.optimizers.Optimizer):
                return candidate
    return None


def _optimizer_problems() -> list[str]:
    problems = []
    update = None
    for cls in keras.optimizers.Optimizer.__mro__:
        update = cls.__dict__.get("_distributed_tf_update_step", update)
    if update is None or "self.update_step" not in _source(update):
        problems.append(
            "Keras optimizers no longer hand each update to the strategy as a "
            "function calling `self.update_step`"
        )
    if not callable(getattr(keras.optimizers.Optimizer, "_get_variable_index", None)):
        problems.append("Keras optimizers have no `_get_variable_index`")
    for cls, names in OPTIMIZER_SLOTS.items():
        source = "".join(_source(c) for c in cls.__mro__ if c.__module__.startswith("keras"))
        for attribute in names.values():
            if f"self.{attribute}" not in source:
                problems.append(f"keras.optimizers.{cls.__name__} has no `{attribute}`")
    return problems


def is_mixed_strategy_error(error: BaseException) -> bool:
    """Whether TensorFlow refused a variable created under another strategy."""
    return isinstance(error, RuntimeError) and "Mixing different tf.distribute.Strategy" in str(
        error
    )


def capture_summary_state() -> Callable[[], None]:
    """Returns a function that installs this thread's `tf.summary` state.

    `tf.summary` keeps its default writer, step and recording condition per
    thread. Replica steps are traced in a helper thread, which must see the
    writer that the caller's thread has set.
    """
    state = summary_ops_v2._summary_state  # noqa: SLF001
    writer, step, recording = state.writer, state.step, state.is_recording

    def install() -> None:
        state.writer, state.step, state.is_recording = writer, step, recording

    return install


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
    totals lose no increment when replicas write them at the same time.
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
                return super().assign_add(
                    delta, use_locking=use_locking, name=name, read_value=read_value
                )
        return super().assign(value, use_locking=use_locking, name=name, read_value=read_value)

    def assign_add(self, delta, use_locking=None, name=None, read_value=True):
        self._before_eager_access()
        return super().assign_add(delta, use_locking, name, read_value)

    def assign_sub(self, delta, use_locking=None, name=None, read_value=True):
        self._before_eager_access()
        return super().assign_sub(delta, use_locking, name, read_value)


class _ReplicaTracing(threading.local):
    """Whether this thread is tracing a replica step (set by the strategy).

    Attributes:
        active: whether a replica step is being traced.
        step_graph: the graph of that step (None when it runs eagerly).
        snapshots: per variable id, the step graph's first read of it.
    """

    active = False
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


@dataclasses.dataclass
class RowReads:
    """How one replica step read a large variable.

    Attributes:
        variable: the variable.
        lookups: `(ids, rows)` of each row gather, flattened: ids `[n]`
            (int64), rows `[n, ...]`, read where the variable lives.
        value: a whole read of it, made when something used its value
            other than by gathering rows; else None.
        replaced: `(stand-in or gather, its replacement)` pairs, for uses
            made after the claim (`rewire_late_uses`).
    """

    variable: object
    lookups: list[tuple[tf.Tensor, tf.Tensor]]
    value: tf.Tensor | None = None
    replaced: list[tuple[tf.Tensor, tf.Tensor | None]] = dataclasses.field(default_factory=list)


def _gathers_rows(op, stand_in: tf.Tensor) -> bool:
    return (
        op.type == "GatherV2"
        and op.inputs[0] is stand_in
        and all(t is not stand_in for t in op.inputs[1:])
        and tf.get_static_value(op.inputs[2]) == 0
        and op.get_attr("batch_dims") == 0
    )


def _reroute(old: tf.Tensor, new: tf.Tensor, consumers=None) -> None:
    for consumer in list(old.consumers() if consumers is None else consumers):
        for index, tensor in enumerate(consumer.inputs):
            if tensor is old:
                consumer._update_input(index, new)  # noqa: SLF001


def resolve_row_reads() -> dict[int, RowReads]:
    """Gives the stand-ins of this replica step their reads (at its claim).

    Each row gather of a stand-in becomes a `ResourceGather` of the same
    ids, which runs beside the variable and moves only the rows (for a
    variable split by rows, one beside each shard, of the ids it holds,
    the rows put back in order where the step runs); every other user of a
    stand-in (an op that needs the whole value) reads the variable whole.
    The reads run after what the stand-in waited for (the step's read of
    the store version), and, being made before the step's first update,
    before any update of the step (`tf.function` orders the ops on one
    variable in the order they were made). From here on the step reads its
    variables as usual.

    Uses the private `Operation._update_input`, the one way to change what
    an op of a graph being traced takes as input.

    Returns:
        Per variable id, how the step read it.
    """
    tracing = _replica_tracing
    pending, tracing.stand_ins = tracing.stand_ins, {}
    tracing.reads_as_rows = False
    resolved: dict[int, RowReads] = {}
    if not pending:
        return resolved
    with tracing.step_graph.as_default(), tf.control_dependencies(None):
        for key, (variable, stand_ins) in pending.items():
            reads = resolved[key] = RowReads(variable, [])
            row_shape = variable.shape.as_list()[1:]
            for stand_in in stand_ins:
                waits = list(stand_in.op.inputs[0].op.control_inputs) + list(
                    stand_in.op.control_inputs
                )
                with tf.control_dependencies(waits), tf.device(stand_in.device):
                    others = []
                    for op in list(stand_in.consumers()):
                        if not _gathers_rows(op, stand_in):
                            others.append(op)
                            continue
                        rows = variable._gather_where_stored(op.inputs[1])
                        _reroute(op.outputs[0], rows)
                        reads.replaced.append((op.outputs[0], rows))
                        ids = tf.reshape(tf.cast(op.inputs[1], tf.int64), [-1])
                        reads.lookups.append((ids, tf.reshape(rows, [-1, *row_shape])))
                    if others:
                        if reads.value is None:
                            reads.value = variable._read_whole()
                        _reroute(stand_in, reads.value, others)
                    reads.replaced.append((stand_in, reads.value))
    return resolved


def rewire_late_uses(resolved: dict[int, RowReads], outputs):
    """Gives the uses of stand-ins and of their gathers made after the claim
    their replacements, and returns `outputs` with them replaced too.

    A use made after the claim of a value read before it (a step that
    returns a lookup's rows, or computes from them once the update is
    applied) gets the read made at the claim, which ran before the update,
    as the value it stands for did.

    Raises:
        ValueError: a use of a table's whole value read before the claim,
            made after it, when nothing before the claim read it whole (a
            whole read made now would see the step's own update).
    """
    replacements = {}
    for reads in resolved.values():
        gathers = {old.op for old, _ in reads.replaced if old.op.type == "GatherV2"}
        for old, new in reads.replaced:
            late = [op for op in old.consumers() if op not in gathers]
            if new is None:
                if late or _is_in(old, outputs):
                    user = late[0].name if late else "the step's outputs"
                    raise ValueError(
                        f"The value of `{reads.variable.name}` read before this step's "
                        f"update is used after the update, by {user}. Inside a replica "
                        "step tf_diffmap reads a large table by rows, and whole only "
                        "where it is used whole before the update: use its value "
                        "before `apply_gradients`, or read the variable again after "
                        "it (it then holds the updated value)."
                    )
                continue
            _reroute(old, new, late)
            replacements[old.ref()] = new
    if not replacements:
        return outputs
    return tf.nest.map_structure(
        lambda t: replacements.get(t.ref(), t) if isinstance(t, tf.Tensor) else t, outputs
    )


def _is_in(tensor: tf.Tensor, structure) -> bool:
    return any(t is tensor for t in tf.nest.flatten(structure) if isinstance(t, tf.Tensor))


def replica_tracing() -> _ReplicaTracing:
    return _replica_tracing


# -- what a variable split by rows uses (`tf_diffmap.partitioned`) -----------

# The base of `partitioned.PartitionedVariable`: a variable whose handle is
# made, never allocated; `compatibility_problems` says when it is gone.
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


# -- where a replica step's bookkeeping runs ---------------------------------


def _device_key(name: str | None) -> tuple | None:
    if not name:
        return None
    spec = tf.DeviceSpec.from_string(name)
    return (*task_of(name), spec.device_type, spec.device_index)


def _place(op, device: tuple) -> None:
    job, replica, task, device_type, device_index = device
    spec = tf.DeviceSpec(job, replica, task, device_type, device_index)
    op._set_device(spec.to_string())  # noqa: SLF001


def _placed_by_scope(op, away: tuple | None) -> bool:
    """Whether `op` is where the step's device scope put it, and nothing
    else (a `colocate_with`) ties it to another op."""
    if _device_key(op.device) != away:
        return False
    try:
        op.get_attr("_class")
    except ValueError:
        return True
    return False


def place_scalars_beside_reads(graph, replica_device: str) -> int:
    """Places a traced step's scalar ops that use only values read from one
    other device on that device.

    A replica step is traced on its replica's device, and so is the
    arithmetic it does on what it reads from the parameter store: a metric's
    `total / count`, a constant added to a counter. Run on the replica's
    device, each such scalar travels to it and back, a transfer between
    devices at every step; run beside the variables it reads, it does not.
    An op moves when it is stateless, every output is a scalar, and its
    inputs are values read from variables of one device other than the
    replica's (or ops that moved there), besides constants; a constant moves
    with the ops that use it, when they are all there. Only where ops run
    changes: every value and every dependency stays as traced. Ops of
    nested graphs (conditionals' branches) are left where they are.

    Uses the private `Operation._set_device`, the one way to place an op of
    a graph being traced after it was made.

    Args:
        graph: the step's graph, while it is traced (before it becomes a
            function).
        replica_device: the replica's device.

    Returns:
        How many ops moved.
    """
    away = _device_key(replica_device)
    handles = {
        id(internal): _device_key(external.device)
        for external, internal in graph.captures
        if getattr(external, "dtype", None) == tf.resource and getattr(external, "device", "")
    }
    constant = object()
    where: dict[str, object] = {}
    beside: dict[str, tuple] = {}  # ops placed on a device other than the replica's
    moved = 0
    operations = graph.get_operations()
    for op in operations:
        if op.type == "ReadVariableOp":
            where[op.name] = handles.get(id(op.inputs[0]))
            continue
        if op.type == "Const":
            where[op.name] = constant
            continue
        if op._is_stateful or not op.inputs or not op.outputs:  # noqa: SLF001
            if op.inputs and op.inputs[0].dtype == tf.resource:
                device = handles.get(id(op.inputs[0]))
                if device is not None and device != away:
                    beside[op.name] = device
            continue
        sources = {where.get(t.op.name) for t in op.inputs} - {constant}
        if not sources:
            where[op.name] = constant
            continue
        device = sources.pop() if len(sources) == 1 else None
        scalar = all(t.shape.rank == 0 for t in op.outputs)
        inherited = _placed_by_scope(op, away)
        if device is not None and device != away and scalar and inherited:
            _place(op, device)
            where[op.name] = device
            beside[op.name] = device
            moved += 1
    # Constants (and ops of constants only) follow their consumers, last first.
    for op in reversed(operations):
        if where.get(op.name) is not constant:
            continue
        consumers = [c for t in op.outputs for c in t.consumers()]
        devices = {beside.get(c.name) for c in consumers}
        inherited = _placed_by_scope(op, away)
        if consumers and inherited and len(devices) == 1 and None not in devices:
            device = devices.pop()
            _place(op, device)
            beside[op.name] = device
            moved += 1
    return moved


# Where the ops that pack and unpack the values crossing between tasks are named.
PACKED_SCOPE = "tf_diffmap_packed"

_PACKED_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)

# Values above this size travel alone: their transfer's fixed cost is small
# beside their bytes, and joining them would only copy them once more.
PACK_MAX_BYTES = 1 << 20

# Ops that run functions: a resource they take does not place them.
_CALLS = frozenset(
    {"If", "StatelessIf", "While", "StatelessWhile", "Case", "StatelessCase"}
    | {"PartitionedCall", "StatefulPartitionedCall"}
)


def _full_device(name: str | None) -> str | None:
    """`name` if it names a task and a device completely, else None."""
    key = _device_key(name)
    if key is None or None in key:
        return None
    return tf.DeviceSpec.from_string(name).to_string()


def _runs_on(op, handles: dict[int, str]) -> str | None:
    """Where the placer will put `op`, when the graph already says so: beside
    the variable of its resource input, or on its own full device. None
    when that is for the placer to decide (a `colocate_with`, a partial or
    empty device, a call of a function or a conditional, whose ops go
    where their own devices say)."""
    if op.type in _CALLS:
        return None
    for tensor in op.inputs:
        if tensor.dtype == tf.resource:
            return handles.get(id(tensor))
    try:
        op.get_attr("_class")
    except ValueError:
        return _full_device(op.device)
    return None


def _successors(operations) -> dict:
    """Each op's successors: its consumers and control outputs, and the edges
    that `tf.function`'s automatic control dependencies add once the trace
    ends (each op on a resource after the previous one on it; stateful ops
    without a resource one after the other)."""
    after: dict = {op: set() for op in operations}
    last: dict = {}
    for op in operations:
        for tensor in op.inputs:
            if tensor.op in after:
                after[tensor.op].add(op)
        for control in op.control_inputs:
            if control in after:
                after[control].add(op)
        keys = [id(t) for t in op.inputs if t.dtype == tf.resource]
        if not keys and op._is_stateful:  # noqa: SLF001
            keys = ["stateful"]
        for key in keys:
            if key in last:
                after[last[key]].add(op)
            last[key] = op
    return after


def _reaches(after: dict, starts) -> set:
    seen, stack = set(starts), list(starts)
    while stack:
        for nxt in after.get(stack.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return seen


def pack_crossings(graph) -> int:
    """Makes the values that a traced step sends from one task to another
    travel as one tensor per pair of devices and dtype.

    On a cluster a replica step reads every parameter from a ps task, sends
    every gradient back, and sends its metrics' updates to the chief: each
    value is one transfer between the tasks, a remote call with its own
    fixed cost on both sides, per value and per update (a convolutional
    network with batch normalization has dozens of variables). Here the
    floating-point values that go from one device to a device of another
    task are flattened and joined where they are made, travel as one
    tensor, and are cut apart again where they are used: every op that used
    one of them uses its piece. Only the transfers change: each op runs
    where and after what it ran before, and the values are the same, bit
    for bit.

    A pair of devices is packed only where both ends are known as the step
    is traced (an op beside the variable it reads or writes, or an op with
    a full device), for values of fully known shape and at most
    `PACK_MAX_BYTES` (a larger value's bytes outweigh its call), two or more
    at a time. Joining values makes each wait for all: a value that depends on what is
    done with another one of its pack (on the far side, or through packs
    already made) is left out, counting the dependencies that `tf.function`
    adds between the ops on one resource once the trace ends. Ops of nested
    graphs (conditionals' branches) are left as they are; they see the
    pieces through their graph's inputs.

    Uses the private `Operation._update_input`, the one way to change what
    an op of a graph being traced takes as input.

    Args:
        graph: the step's graph, while it is traced (before it becomes a
            function), or any graph whose ops name their devices.

    Returns:
        How many values travel packed.
    """
    handles = {
        id(internal): _full_device(external.device)
        for external, internal in getattr(graph, "captures", ())
        if getattr(external, "dtype", None) == tf.resource
    }
    operations = graph.get_operations()
    where = {op: _runs_on(op, handles) for op in operations}
    groups: dict[tuple, dict] = {}
    for op in operations:
        source = where[op]
        if source is None:
            continue
        for tensor in op.outputs:
            if tensor.dtype not in _PACKED_DTYPES or not tensor.shape.is_fully_defined():
                continue
            if tensor.shape.num_elements() * tensor.dtype.size > PACK_MAX_BYTES:
                continue
            for consumer in tensor.consumers():
                target = where.get(consumer)
                if target is None or task_of(target) == task_of(source):
                    continue
                users = groups.setdefault((source, target, tensor.dtype), {}).setdefault(
                    tensor.ref(), []
                )
                for index, given in enumerate(consumer.inputs):
                    if given is tensor and (consumer, index) not in users:
                        users.append((consumer, index))
    after = _successors(operations)
    packed = 0
    with graph.as_default(), tf.name_scope(PACKED_SCOPE):
        for (source, target, _), uses in groups.items():
            # Leave out what depends on the pack's own consumers, until
            # nothing does.
            while len(uses) > 1:
                downstream = _reaches(after, [c for users in uses.values() for c, _ in users])
                cyclic = [ref for ref in uses if ref.deref().op in downstream]
                if not cyclic:
                    break
                for ref in cyclic:
                    del uses[ref]
            if len(uses) < 2:
                continue
            values = [ref.deref() for ref in uses]
            with tf.device(source):
                joined = tf.concat([tf.reshape(t, [-1]) for t in values], 0)
            with tf.device(target):
                pieces = tf.split(joined, [t.shape.num_elements() for t in values])
                for tensor, piece in zip(values, pieces):
                    unpacked = tf.reshape(piece, tensor.shape)
                    for consumer, index in uses[tensor.ref()]:
                        consumer._update_input(index, unpacked)  # noqa: SLF001
            # Later packs must see this one's dependencies: every consumer
            # now waits for every value packed.
            for tensor in values:
                after[tensor.op].update(c for users in uses.values() for c, _ in users)
            packed += len(values)
    return packed


# -- the eager context's cluster (faults across hosts) -----------------------


def dataset_functions(dataset) -> list:
    """The traced functions a `tf.data.Dataset` and its inputs hold.

    Each is registered in the eager context and, on a cluster, on every
    remote task; once the last reference to it is gone, the context removes
    it from every remote task too. Holding these keeps them registered.

    Uses the private `DatasetV2._functions` and `_inputs`; returns what it
    finds (nothing where a dataset lacks them).
    """
    found, seen, stack = [], set(), [dataset]
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        for wrapper in getattr(current, "_functions", lambda: [])():
            function = getattr(wrapper, "function", None)
            if function is not None:
                found.append(function)
        stack.extend(getattr(current, "_inputs", lambda: [])())
    return found


def cluster_addresses() -> dict[str, str]:
    """Task name (`/job:<j>/replica:0/task:<i>`) to `host:port`, of the
    cluster this client is connected to (empty when it is not)."""
    from tensorflow.python.eager import context

    server_def = context.context().get_server_def()
    if server_def is None:
        return {}
    return {
        f"/job:{job.name}/replica:0/task:{index}": address
        for job in server_def.cluster.job
        for index, address in job.tasks.items()
    }


def reconnect_cluster() -> None:
    """Reconnects to the same cluster: a restarted task gets a fresh context.

    `update_server_def` compares every task's incarnation with the one the
    client knew and makes a new remote context on each task that restarted,
    as `ParameterServerStrategy`'s recovery does; the other tasks keep theirs.
    """
    from tensorflow.python.eager import context

    ctx = context.context()
    ctx.update_server_def(ctx.get_server_def())
