"""The parameter store: placement, sharding, version counter, statistics.

Every variable created under a `Strategy`'s scope lives once, on one of the
store's parameter devices. Replicas read it there and apply their updates there
with TensorFlow's own update ops, which lock the variable for the length of the
op. A global version counter counts applied updates; per-replica counters
record how stale each update was.

What a step has done is counted so that a step cut off anywhere (its worker
lost) is accounted for exactly once: just before it claims a version it
*marks* the claim (`marks`, beside the version), and once it has finished
writing one op counts it completed (its row of `ledger`, beside the queue).
A step is then either completed, or marked and cut off (abandoned: it may
have written part of its update), or cut off before its mark (it wrote
nothing to the variables, and its shard may run again).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from tf_diffmap import _tf_internal
from tf_diffmap.devices import host_cpu, task_name
from tf_diffmap.store.partitioned import PartitionedVariable, RowSplit, shards_for
from tf_diffmap.store.staleness import StalenessStats

__all__ = [
    "ParameterStore",
    "counters_as_stats",
    "optimizer_outside_scope_message",
    "outside_scope_message",
]

_VERSION_LIMIT = np.iinfo(np.int64).max
# Columns of `ParameterStore.counters`: four counts, the staleness sums in
# both units (versions, optimizer steps), then a histogram in each unit.
_UPDATES, _DROPPED, _EXAMPLES, _STALENESS_SUM, _STEP_STALENESS_SUM, _HISTOGRAM = range(6)
# Columns of `ParameterStore.ledger`.
_STEPS, _CLAIMS = range(2)
# The name scope of a step's ops on the per-replica counters (its statistics
# and its claims so far), which run beside those counters.
BOOKKEEPING_SCOPE = "tf_diffmap_bookkeeping"


def _read(variable: tf.Variable) -> np.ndarray:
    """The value of a counter variable, read by one op.

    `variable.numpy()` runs two eager ops (a read and an identity) and the
    variable's Python checks; a batch-level staleness point reads four
    counters, and this read takes about a third of the time.
    """
    return tf.raw_ops.ReadVariableOp(resource=variable.handle, dtype=variable.dtype).numpy()


def _device_identity(name: str) -> tuple:
    spec = tf.DeviceSpec.from_string(name)
    return (task_name(name), spec.device_type, spec.device_index)


def counters_as_stats(
    version: int,
    counters: np.ndarray,
    staleness_max: np.ndarray,
    lr_scale_sum: np.ndarray | None,
    abandoned: int,
    steps: int | None = None,
    step_staleness_max: np.ndarray | None = None,
) -> StalenessStats:
    """`StalenessStats` from a value of `ParameterStore.counters` (views, no copy).

    `counters` may carry leading dimensions (a stack of snapshots): every
    array of the result then has them too.

    Args:
        steps: optimizer steps the store has applied; None where each
            update is a step of its own (the staleness in steps is then the
            staleness in versions).
    """
    bins = (counters.shape[-1] - _HISTOGRAM) // 2
    return StalenessStats(
        version=version,
        updates=counters[..., _UPDATES],
        dropped=counters[..., _DROPPED],
        examples=counters[..., _EXAMPLES],
        staleness_sum=counters[..., _STALENESS_SUM],
        histogram=counters[..., _HISTOGRAM : _HISTOGRAM + bins],
        staleness_max=staleness_max,
        lr_scale_sum=lr_scale_sum,
        abandoned=abandoned,
        steps=steps,
        step_staleness_sum=counters[..., _STEP_STALENESS_SUM],
        step_staleness_max=step_staleness_max,
        step_histogram=counters[..., _HISTOGRAM + bins :],
    )


def outside_scope_message(variable, in_store: bool) -> str:
    """What to say when an optimizer makes its slots outside the scope.

    Keras' optimizer makes a slot for each variable of the model when it is
    built, which `fit` does under the model's strategy: for a model built
    outside the scope, no strategy at all, and TensorFlow's own error says
    only `Need to be inside "with strategy.scope()"`.

    Args:
        variable: the model's variable the slot is made for.
        in_store: whether `variable` lives in the parameter store (was
            created inside the scope).

    Returns:
        The message of the error to raise.
    """
    name = getattr(variable, "name", variable)
    if not in_store:
        return (
            f"The model's variable {name!r} was created outside this "
            "tf_diffmap.Strategy's scope: the model was built (or loaded) outside "
            "`with strategy.scope():`. Compiling it inside is not enough, since "
            "Keras trains a model under the strategy it was built under. Build the "
            "model and compile it (with its optimizer) inside the scope; `fit`, "
            "`evaluate` and `predict` may then run outside it."
        )
    return (
        f"The optimizer is creating its variables for {name!r} outside this "
        "tf_diffmap.Strategy's scope. Build the optimizer inside "
        "`with strategy.scope():` (model.compile there does, or call "
        "optimizer.build(model.trainable_variables) there)."
    )


def optimizer_outside_scope_message(optimizer: object | None = None) -> str:
    """What to say when an optimizer created outside the scope trains inside it.

    Keras makes an optimizer's variables (its iteration count, momentum,
    moments) under the strategy that was current when the optimizer was
    created; TensorFlow's own errors then speak of nested or mixed
    strategies, though the user nested nothing.

    Args:
        optimizer: the optimizer, when known (its class is named).
    """
    what = (
        f"The optimizer ({type(optimizer).__name__})"
        if optimizer is not None
        else "A Keras object, most often the optimizer,"
    )
    return (
        f"{what} was created outside this tf_diffmap.Strategy's scope and is "
        "used by a model built inside it: Keras makes an optimizer's variables "
        "under the strategy that was current when the optimizer was created. "
        "Create the optimizer inside `with strategy.scope():`, beside the model, "
        "for example `model.compile(optimizer=tf_diffmap.AsyncOptimizer("
        "keras.optimizers.SGD(0.1)), ...)` there."
    )


class ParameterStore:
    """Where the authoritative copy of every variable lives.

    Args:
        parameter_devices: the devices that hold variables. A variable goes to
            the device holding the fewest bytes so far (its slots follow it),
            so each variable's update ops run on its own shard's device.
        num_replicas: how many replicas record statistics.
        on_host_access: called before a store variable is read or written
            eagerly outside a replica (the strategy drains there).
        ledger_device: where the steps are counted completed (the host of
            the queue they come from), with the per-replica counters and
            the metrics' totals; by default the store's host.
        partitioner: splits large variables by rows over the devices (see
            `tf_diffmap.store.partitioned.shards_for`); None splits none.
    """

    def __init__(
        self,
        parameter_devices: Sequence[str],
        num_replicas: int,
        on_host_access=None,
        ledger_device: str | None = None,
        partitioner=None,
    ):
        self.devices = list(parameter_devices)
        self.partitioner = partitioner
        self.num_replicas = num_replicas
        self._on_host_access = on_host_access
        self._bytes = {d: 0 for d in self.devices}
        self.host = host_cpu(self.devices[0])  # the version and the marks
        self.histogram_bins = max(64, 8 * num_replicas)
        # Claims whose step never completed (see `settle_abandoned`).
        self.abandoned = 0
        self.ledger_device = ledger_device or self.host
        # Per replica, its marks not completed that are accounted for (as
        # abandoned), so that a new one tells a step cut off after its mark.
        self._open_marks = [0] * num_replicas
        with tf.init_scope(), tf.device(self.host):
            zeros = tf.zeros([num_replicas], tf.int64)
            # `version` counts claimed updates; `marks` counts, per replica,
            # the claims it set out to make (marked just before each claim).
            self.version = tf.Variable(
                tf.constant(0, tf.int64), trainable=False, name="store_version"
            )
            self.marks = tf.Variable(zeros, trainable=False, name="store_marks")
        with tf.init_scope(), tf.device(self.ledger_device):
            # Per replica, steps and claims completed, counted by one op per
            # step; the last row holds, as claims, those abandoned. Its claims
            # column sums to the updates that a replica's read can see.
            self.ledger = tf.Variable(
                tf.zeros([num_replicas + 1, 2], tf.int64), trainable=False, name="store_ledger"
            )
            # Per replica, in one variable so that one update is recorded by
            # one op and a snapshot reads them together: updates applied,
            # updates dropped, examples, the staleness sums in versions and
            # in steps, then the histograms in versions and in steps.
            self.counters = tf.Variable(
                tf.zeros([num_replicas, _HISTOGRAM + 2 * self.histogram_bins], tf.int64),
                trainable=False,
                name="staleness_counters",
            )
            self.staleness_max = tf.Variable(zeros, trainable=False, name="staleness_max")
            self.step_staleness_max = tf.Variable(zeros, trainable=False, name="step_staleness_max")
            self.lr_scale_sum = tf.Variable(
                tf.zeros([num_replicas], tf.float64), trainable=False, name="lr_scale_sum"
            )
        with tf.init_scope(), tf.device(self.host):
            # Optimizer steps applied where shard gradients are aggregated
            # (`accumulators`), K of them to a step.
            self.optimizer_steps = tf.Variable(
                tf.constant(0, tf.int64), trainable=False, name="store_optimizer_steps"
            )
        # Whether any traced step scales its learning rate (an AsyncOptimizer
        # rule): the statistics report a learning-rate factor only then.
        self.scales_learning_rate = False
        # Whether shard gradients are aggregated into optimizer steps (set
        # by the runtime); otherwise every update is a step of its own.
        self.aggregates = False

    # -- placement ------------------------------------------------------------

    def device_for(self, kwargs: dict) -> str:
        """Chooses the device of a new variable and accounts for its bytes.

        A variable synchronized on read (a Keras metric's totals) is not a
        parameter: it lives beside the ledger, on the host that keeps the
        steps' outputs (a metric's result is one). On a cluster a step then
        sends its metric updates to that host, rather than to a parameter
        server with the results sent back.
        """
        if kwargs.get("synchronization") == tf.VariableSynchronization.ON_READ:
            return self.ledger_device
        colocate_with = kwargs.get("colocate_with")
        if colocate_with is not None:
            device = colocate_with.device
        else:
            device = min(self.devices, key=lambda d: (self._bytes[d], self.devices.index(d)))
        shape = kwargs.get("shape")
        dtype = kwargs.get("dtype")
        if shape is not None and tf.TensorShape(shape).is_fully_defined():
            size = math.prod(tf.TensorShape(shape).as_list())
            itemsize = tf.as_dtype(dtype).size if dtype is not None else 4
            if device in self._bytes:
                self._bytes[device] += size * itemsize
        elif device in self._bytes:
            self._bytes[device] += 1
        return device

    def create(self, next_creator, kwargs: dict) -> tf.Variable:
        """Creates a variable on its store device (the strategy's creator).

        With a partitioner, a variable it splits is made of row shards on
        the devices holding the fewest bytes (`PartitionedVariable`), and a
        variable made beside a split one (an optimizer's slot) is split the
        same way, each shard beside the variable's shard of the same rows,
        so that a row update reads and writes on one device only.
        """
        beside = kwargs.get("colocate_with")
        if isinstance(beside, PartitionedVariable):
            return self._create_beside(next_creator, kwargs, beside)
        # A variable that is not split is placed as it was before its value
        # was known (by what its creator said of its shape).
        as_given = kwargs
        if (
            self.partitioner is not None
            and len(self.devices) > 1
            and beside is None
            and kwargs.get("synchronization") != tf.VariableSynchronization.ON_READ
        ):
            # The shape decides, and Keras gives a function: its value is
            # made once, here, and is the initial value whatever follows.
            value = self._initial_value(kwargs)
            kwargs = dict(kwargs, initial_value=value)
            shards = shards_for(
                self.partitioner,
                value.shape,
                value.dtype,
                len(self.devices),
                kwargs.get("name") or "Variable",
            )
            if shards > 1:
                emptiest = sorted(
                    self.devices, key=lambda d: (self._bytes[d], self.devices.index(d))
                )
                devices = sorted(emptiest[:shards], key=self.devices.index)
                split = RowSplit.even(value.shape[0], shards)
                return self._create_split(next_creator, kwargs, value, split, devices)
        initial_value = as_given.get("initial_value")
        if (
            as_given.get("shape") is None
            and initial_value is not None
            and not callable(initial_value)
        ):
            kwargs_for_size = dict(as_given, shape=getattr(initial_value, "shape", None))
        else:
            kwargs_for_size = as_given
        device = self.device_for(kwargs_for_size)
        kwargs.pop("colocate_with", None)
        # A variable made lazily inside a replica step (Keras builds optimizer
        # slots and metric totals at their first use) must not inherit the
        # step's control dependencies: its initializer is lifted out of it.
        with tf.control_dependencies(None), tf.device(device):
            variable = next_creator(**kwargs)
        if self._on_host_access is not None:
            variable = _tf_internal.StoreVariable.adopt(variable, self._on_host_access)
        return variable

    def _count(self, device: str, size: int) -> None:
        """Adds `size` bytes to the parameter device that `device` names
        (as the store names it, or as a variable's full device name)."""
        key = _device_identity(device)
        for own in self.devices:
            if _device_identity(own) == key:
                self._bytes[own] += size
                return

    def _initial_value(self, kwargs: dict) -> tf.Tensor:
        initial = kwargs.get("initial_value")
        with tf.init_scope(), tf.device(self.host):
            value = initial() if callable(initial) else initial
            return tf.convert_to_tensor(value, dtype=kwargs.get("dtype"))

    def _create_split(self, next_creator, kwargs: dict, value, split: RowSplit, devices):
        """A `PartitionedVariable` of `value`, shard k on `devices[k]`."""
        name = kwargs.get("name")
        trainable = kwargs.get("trainable")
        with tf.init_scope():
            parts = split.slices(value)
        passed = {
            k: v
            for k, v in kwargs.items()
            if k not in ("colocate_with", "initial_value", "name", "trainable", "shape")
        }
        shards = []
        with tf.control_dependencies(None):
            for k, (device, part) in enumerate(zip(devices, parts)):
                with tf.device(device):
                    shards.append(
                        next_creator(
                            initial_value=part,
                            name=f"{name or 'Variable'}/part_{k}",
                            trainable=False,
                            **passed,
                        )
                    )
                self._count(device, part.shape.num_elements() * part.dtype.size)
        return PartitionedVariable.build(
            shards,
            split,
            name=name,
            trainable=True if trainable is None else trainable,
            on_host_access=self._on_host_access,
            synchronization=kwargs.get("synchronization"),
            aggregation=kwargs.get("aggregation"),
            distribute_strategy=kwargs.get("distribute_strategy"),
        )

    def _create_beside(self, next_creator, kwargs: dict, reference) -> tf.Variable:
        """A variable made beside a split one: split alike when it has as many
        rows, else on the device of its first shard."""
        value = self._initial_value(kwargs)
        kwargs = dict(kwargs, initial_value=value)
        kwargs.pop("colocate_with", None)
        if value.shape.rank and value.shape[0] == reference.shape[0]:
            devices = [shard.device for shard in reference.shards]
            return self._create_split(next_creator, kwargs, value, reference.row_split, devices)
        device = reference.shards[0].device
        self._count(device, value.shape.num_elements() * value.dtype.size)
        with tf.control_dependencies(None), tf.device(device):
            variable = next_creator(**kwargs)
        if self._on_host_access is not None:
            variable = _tf_internal.StoreVariable.adopt(variable, self._on_host_access)
        return variable

    def variable_beside(self, reference, name: str) -> tf.Variable:
        """A zero variable of `reference`'s shape and dtype, beside it.

        For the store's own bookkeeping of a variable (an aggregation's
        accumulator): split by rows alike where `reference` is split, each
        shard beside the reference's shard. It is made outside any replica
        step and any strategy's creators, is not trainable, and reading it
        from Python does not drain the replicas.
        """
        with tf.init_scope(), tf.control_dependencies(None):
            if isinstance(reference, PartitionedVariable):
                shards = []
                for k, shard in enumerate(reference.shards):
                    with tf.device(shard.device):
                        shards.append(
                            _tf_internal.ResourceVariable(
                                tf.zeros(shard.shape, shard.dtype),
                                trainable=False,
                                name=f"{name}/part_{k}",
                            )
                        )
                return PartitionedVariable.build(
                    shards, reference.row_split, name=name, trainable=False, on_host_access=None
                )
            with tf.device(reference.device):
                return _tf_internal.ResourceVariable(
                    tf.zeros(reference.shape, reference.dtype), trainable=False, name=name
                )

    def bytes_per_device(self) -> dict[str, int]:
        """Bytes of variables placed on each parameter device (approximate)."""
        return dict(self._bytes)

    # -- the version counter, in a replica's graph ----------------------------

    def read_version(self) -> tf.Tensor:
        """The updates a replica's read can see: those completed (or abandoned)."""
        with tf.device(self.ledger_device):
            return tf.reduce_sum(self.ledger.read_value()[:, _CLAIMS])

    def read_optimizer_steps(self) -> tf.Tensor:
        """Optimizer steps applied so far (in a replica's graph)."""
        with tf.device(self.host):
            return self.optimizer_steps.read_value()

    def complete(self, replica_id, claims) -> tf.Operation:
        """Counts one step of a replica completed, with the claims it made.

        One op: a step cut off by a lost task is counted whole or not at all.
        """
        with tf.device(self.ledger_device):
            row = tf.cast(tf.reshape(replica_id, []), tf.int64)
            return self.ledger.scatter_nd_add(
                tf.stack([tf.stack([row, _STEPS]), tf.stack([row, _CLAIMS])]),
                tf.stack([tf.constant(1, tf.int64), tf.cast(claims, tf.int64)]),
            ).op

    def steps(self) -> tf.Tensor:
        """Steps each replica has completed (in a graph, on the ledger's host)."""
        with tf.device(self.ledger_device):
            return self.ledger.read_value()[: self.num_replicas, _STEPS]

    def steps_per_replica(self) -> list[int]:
        return [int(s) for s in _read(self.ledger)[: self.num_replicas, _STEPS]]

    def completed_claims(self) -> int:
        """Claims whose steps completed (abandoned ones not included)."""
        return int(_read(self.ledger)[: self.num_replicas, _CLAIMS].sum())

    def cut_after_mark(self, replica_id: int) -> bool:
        """Whether a step of the replica, cut off, had marked its claim.

        Called once for a step that did not complete, after its call ended:
        a mark of the replica that is neither completed nor accounted for
        is that step's, which is then accounted for (as abandoned).
        """
        marks = int(_read(self.marks)[replica_id])
        completed = int(_read(self.ledger)[replica_id, _CLAIMS])
        if marks - completed > self._open_marks[replica_id]:
            self._open_marks[replica_id] = marks - completed
            return True
        return False

    def claims_of(self, replica_id) -> tf.Tensor:
        """Claims a replica has recorded (applied plus dropped updates)."""
        with tf.name_scope(BOOKKEEPING_SCOPE), tf.device(self.ledger_device):
            counts = self.counters.read_value()
            return tf.gather(counts[:, _UPDATES] + counts[:, _DROPPED], replica_id)

    def settle_abandoned(self) -> int:
        """With nothing in flight: counts the claims that never completed.

        A step interrupted after its mark (its worker was lost, or it
        raised) never counts itself completed: its claim is abandoned. A
        step cut off between its mark and its claim gets its version here,
        so that each abandoned step holds one version and the version
        equals the completed updates plus the abandoned claims.

        Returns:
            The claims abandoned since the last call.
        """
        marks = _read(self.marks)
        ledger = _read(self.ledger)
        completed = ledger[: self.num_replicas, _CLAIMS]
        self._open_marks = [int(m) for m in marks - completed]
        version = int(_read(self.version))
        claimed = max(int(marks.sum()), version)
        if version < claimed:
            self.version.assign(claimed)
        abandoned = claimed - int(completed.sum())
        new = abandoned - self.abandoned
        if new:
            self.abandoned = abandoned
            with tf.device(self.ledger_device):
                self.ledger.scatter_nd_update([[self.num_replicas, _CLAIMS]], [abandoned])
        return new

    def claim_version(self, read_version: tf.Tensor, replica_id: tf.Tensor) -> tf.Tensor:
        """Marks, then bumps the version atomically; returns the staleness.

        The staleness counts the updates claimed before this one that had not
        completed when this step read the parameters: updates its gradient
        did not see, whether or not they were fully written at the claim.
        """
        with tf.device(self.host):
            mark = self.marks.scatter_nd_add(
                tf.reshape(tf.cast(replica_id, tf.int64), [1, 1]), tf.constant([1], tf.int64)
            )
            with tf.control_dependencies([mark]):
                before = tf.raw_ops.ResourceCountUpTo(
                    resource=self.version.handle, limit=_VERSION_LIMIT, T=tf.int64
                )
            return tf.maximum(before - read_version, 0)

    def record(
        self,
        replica_id: tf.Tensor,
        staleness: tf.Tensor,
        applied: tf.Tensor,
        lr_scale: tf.Tensor | None = None,
        examples: tf.Tensor | None = None,
        step_staleness: tf.Tensor | None = None,
    ) -> tf.Operation:
        """Adds one update's staleness to the replica's statistics.

        Args:
            replica_id: int32 scalar.
            staleness: int64 scalar, in versions.
            applied: bool scalar, False for an update that was dropped.
            lr_scale: the factor a staleness rule applied to the learning
                rate (1 when none did).
            examples: the examples of the shard the update was computed on.
            step_staleness: int64 scalar, in optimizer steps; by default
                `staleness` (each update is a step of its own).
        """
        with tf.name_scope(BOOKKEEPING_SCOPE), tf.device(self.ledger_device):
            row = tf.cast(replica_id, tf.int64)
            applied = tf.cast(applied, tf.int64)
            staleness = tf.cast(staleness, tf.int64)
            steps_stale = staleness if step_staleness is None else tf.cast(step_staleness, tf.int64)
            examples = tf.constant(0, tf.int64) if examples is None else tf.cast(examples, tf.int64)
            last = self.histogram_bins - 1
            columns = tf.stack(
                [
                    tf.constant(_UPDATES, tf.int64),
                    tf.constant(_DROPPED, tf.int64),
                    tf.constant(_EXAMPLES, tf.int64),
                    tf.constant(_STALENESS_SUM, tf.int64),
                    tf.constant(_STEP_STALENESS_SUM, tf.int64),
                    _HISTOGRAM + tf.minimum(staleness, last),
                    _HISTOGRAM + self.histogram_bins + tf.minimum(steps_stale, last),
                ]
            )
            cells = tf.stack([tf.fill([7], row), columns], axis=1)
            one = tf.constant(1, tf.int64)
            values = tf.stack(
                [
                    applied,
                    1 - applied,
                    examples,
                    staleness * applied,
                    steps_stale * applied,
                    one,
                    one,
                ]
            )
            if lr_scale is None:
                lr_scale = tf.constant(1.0, tf.float64)
            else:
                self.scales_learning_rate = True
            scale = tf.cast(lr_scale, tf.float64) * tf.cast(applied, tf.float64)
            cell = tf.reshape(row, [1, 1])
            return tf.group(
                self.counters.scatter_nd_add(cells, values),
                self.staleness_max.scatter_nd_max(cell, tf.reshape(staleness * applied, [1])),
                self.step_staleness_max.scatter_nd_max(
                    cell, tf.reshape(steps_stale * applied, [1])
                ),
                self.lr_scale_sum.scatter_nd_add(cell, tf.reshape(scale, [1])),
            )

    # -- reading from Python --------------------------------------------------

    def statistics(self) -> StalenessStats:
        """A snapshot of the counters (does not wait for updates in flight)."""
        counters = _read(self.counters)
        return counters_as_stats(
            int(_read(self.version)),
            counters,
            staleness_max=_read(self.staleness_max),
            lr_scale_sum=_read(self.lr_scale_sum) if self.scales_learning_rate else None,
            abandoned=self.abandoned,
            steps=int(_read(self.optimizer_steps)) if self.aggregates else None,
            step_staleness_max=_read(self.step_staleness_max),
        )

    def reset_statistics(self) -> None:
        """Zeroes the per-replica counters (the version and the steps keep counting)."""
        for variable in (
            self.counters,
            self.staleness_max,
            self.step_staleness_max,
            self.lr_scale_sum,
        ):
            variable.assign(tf.zeros_like(variable))
