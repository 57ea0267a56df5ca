"""The parameter store: placement, sharding, version counter, statistics.

Every variable created under a `Strategy`'s scope lives once, on one of the
store's parameter devices. Replicas read it there and apply their updates there
with TensorFlow's own update ops, which lock the variable for the length of the
op. A global version counter counts applied updates; per-replica counters
record how stale each update was.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from tf_diffmap import _tf_internal
from tf_diffmap.staleness import StalenessStats

__all__ = ["ParameterStore", "counters_as_stats", "outside_scope_message"]

_VERSION_LIMIT = np.iinfo(np.int64).max
# Columns of `ParameterStore.counters`.
_UPDATES, _DROPPED, _EXAMPLES, _STALENESS_SUM, _HISTOGRAM = range(5)


def _read(variable: tf.Variable) -> np.ndarray:
    """The value of a counter variable, read by one op.

    `variable.numpy()` runs two eager ops (a read and an identity) and the
    variable's Python checks; a batch-level staleness point reads four
    counters, and this read takes about a third of the time.
    """
    return tf.raw_ops.ReadVariableOp(resource=variable.handle, dtype=variable.dtype).numpy()


def counters_as_stats(
    version: int,
    counters: np.ndarray,
    staleness_max: np.ndarray,
    lr_scale_sum: np.ndarray | None,
    abandoned: int,
) -> StalenessStats:
    """`StalenessStats` from a value of `ParameterStore.counters` (views, no copy)."""
    return StalenessStats(
        version=version,
        updates=counters[:, _UPDATES],
        dropped=counters[:, _DROPPED],
        examples=counters[:, _EXAMPLES],
        staleness_sum=counters[:, _STALENESS_SUM],
        histogram=counters[:, _HISTOGRAM:],
        staleness_max=staleness_max,
        lr_scale_sum=lr_scale_sum,
        abandoned=abandoned,
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


def _host_of(device: str) -> str:
    """The CPU of the host that owns `device` (where counters live)."""
    spec = tf.DeviceSpec.from_string(device)
    return spec.replace(device_type="CPU", device_index=0).to_string()


class ParameterStore:
    """Where the authoritative copy of every variable lives.

    Args:
        parameter_devices: the devices that hold variables. A variable goes to
            the device holding the fewest bytes so far (its slots follow it),
            so each variable's update ops run on its own shard's device.
        num_replicas: how many replicas record statistics.
        on_host_access: called before a store variable is read or written
            eagerly outside a replica (the strategy drains there).
    """

    def __init__(
        self,
        parameter_devices: Sequence[str],
        num_replicas: int,
        on_host_access=None,
    ):
        self.devices = list(parameter_devices)
        self.num_replicas = num_replicas
        self._on_host_access = on_host_access
        self._bytes = {d: 0 for d in self.devices}
        self.host = _host_of(self.devices[0])
        self.histogram_bins = max(64, 8 * num_replicas)
        # Claims whose step never completed (see `settle_abandoned`).
        self.abandoned = 0
        with tf.init_scope(), tf.device(self.host):
            zeros = tf.zeros([num_replicas], tf.int64)
            # `version` counts claimed updates, `completed` the claimed steps
            # that have finished writing: a replica's read sees `completed`.
            self.version = tf.Variable(
                tf.constant(0, tf.int64), trainable=False, name="store_version"
            )
            self.completed = tf.Variable(
                tf.constant(0, tf.int64), trainable=False, name="store_completed"
            )
            # Per replica, in one variable so that one update is recorded by
            # one op and a snapshot reads them together: updates applied,
            # updates dropped, examples, staleness sum, then the histogram.
            self.counters = tf.Variable(
                tf.zeros([num_replicas, _HISTOGRAM + self.histogram_bins], tf.int64),
                trainable=False,
                name="staleness_counters",
            )
            self.staleness_max = tf.Variable(zeros, trainable=False, name="staleness_max")
            self.lr_scale_sum = tf.Variable(
                tf.zeros([num_replicas], tf.float64), trainable=False, name="lr_scale_sum"
            )

    # -- placement ------------------------------------------------------------

    def device_for(self, kwargs: dict) -> str:
        """Chooses the device of a new variable and accounts for its bytes."""
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
        """Creates a variable on its store device (the strategy's creator)."""
        initial_value = kwargs.get("initial_value")
        if (
            kwargs.get("shape") is None
            and initial_value is not None
            and not callable(initial_value)
        ):
            kwargs_for_size = dict(kwargs, shape=getattr(initial_value, "shape", None))
        else:
            kwargs_for_size = kwargs
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

    def bytes_per_device(self) -> dict[str, int]:
        """Bytes of variables placed on each parameter device (approximate)."""
        return dict(self._bytes)

    # -- the version counter, in a replica's graph ----------------------------

    def read_version(self) -> tf.Tensor:
        """The updates a replica's read can see: those already completed."""
        with tf.device(self.host):
            return self.completed.read_value()

    def complete(self) -> None:
        """Marks one claimed step as finished writing (called after the step)."""
        with tf.device(self.host):
            self.completed.assign_add(1, read_value=False)

    def claims_of(self, replica_id) -> tf.Tensor:
        """Claims a replica has recorded (applied plus dropped updates)."""
        with tf.device(self.host):
            counts = self.counters.read_value()
            return tf.gather(counts[:, _UPDATES] + counts[:, _DROPPED], replica_id)

    def claims_per_replica(self) -> list[int]:
        counts = self.counters.numpy()
        return [int(c) for c in counts[:, _UPDATES] + counts[:, _DROPPED]]

    def resync_completed(self) -> None:
        """After a failed step, with nothing in flight: every claim is done."""
        with tf.device(self.host):
            self.completed.assign(self.version)

    def settle_abandoned(self) -> int:
        """With nothing in flight: counts the claims that never completed.

        A step interrupted after its claim (its worker was lost, or it
        raised) never counts itself completed. Once nothing is in flight,
        the difference is abandoned claims, so that the version equals the
        completed updates plus the abandoned claims.

        Returns:
            The claims abandoned since the last call.
        """
        version, completed = int(_read(self.version)), int(_read(self.completed))
        if version == completed:
            return 0
        self.abandoned += version - completed
        with tf.device(self.host):
            self.completed.assign(version)
        return version - completed

    def claim_version(self, read_version: tf.Tensor) -> tf.Tensor:
        """Bumps the version atomically; returns this update's staleness.

        The staleness counts the updates claimed before this one that had not
        completed when this step read the parameters: updates its gradient
        did not see, whether or not they were fully written at the claim.
        """
        with tf.device(self.host):
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
    ) -> tf.Operation:
        """Adds one update's staleness to the replica's statistics.

        Args:
            replica_id: int32 scalar.
            staleness: int64 scalar.
            applied: bool scalar, False for an update that was dropped.
            lr_scale: the factor a staleness rule applied to the learning
                rate (1 when none did).
            examples: the examples of the shard the update was computed on.
        """
        with tf.device(self.host):
            row = tf.cast(replica_id, tf.int64)
            applied = tf.cast(applied, tf.int64)
            staleness = tf.cast(staleness, tf.int64)
            examples = tf.constant(0, tf.int64) if examples is None else tf.cast(examples, tf.int64)
            columns = tf.stack(
                [
                    tf.constant(_UPDATES, tf.int64),
                    tf.constant(_DROPPED, tf.int64),
                    tf.constant(_EXAMPLES, tf.int64),
                    tf.constant(_STALENESS_SUM, tf.int64),
                    _HISTOGRAM + tf.minimum(staleness, self.histogram_bins - 1),
                ]
            )
            cells = tf.stack([tf.fill([5], row), columns], axis=1)
            values = tf.stack(
                [applied, 1 - applied, examples, staleness * applied, tf.constant(1, tf.int64)]
            )
            if lr_scale is None:
                lr_scale = tf.constant(1.0, tf.float64)
            scale = tf.cast(lr_scale, tf.float64) * tf.cast(applied, tf.float64)
            return tf.group(
                self.counters.scatter_nd_add(cells, values),
                self.staleness_max.scatter_nd_max(
                    tf.reshape(row, [1, 1]), tf.reshape(staleness * applied, [1])
                ),
                self.lr_scale_sum.scatter_nd_add(tf.reshape(row, [1, 1]), tf.reshape(scale, [1])),
            )

    # -- reading from Python --------------------------------------------------

    def statistics(self) -> StalenessStats:
        """A snapshot of the counters (does not wait for updates in flight)."""
        counters = _read(self.counters)
        return counters_as_stats(
            int(_read(self.version)),
            counters,
            staleness_max=_read(self.staleness_max),
            lr_scale_sum=_read(self.lr_scale_sum),
            abandoned=self.abandoned,
        )

    def reset_statistics(self) -> None:
        """Zeroes the per-replica counters (the version keeps counting)."""
        for variable in (self.counters, self.staleness_max, self.lr_scale_sum):
            variable.assign(tf.zeros_like(variable))
