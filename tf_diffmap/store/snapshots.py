"""Snapshots of the store's counters, taken by Keras' graph at each step.

Batch-level staleness points (`StalenessTensorBoard(update_freq="batch")`)
need the store's counters as they are when a batch has been handed to the
replicas. Reading them from Python at each batch costs eager ops and the
interpreter lock while the replicas run; instead, while a callback asks for
them, each training step of Keras' graph copies the counters into a ring of
variables next to them (four reads and five scatters, run by TensorFlow's
executor), and the callback's thread reads the new rows in bulk, one call for
many points.

The ring has `capacity` rows. A reader that falls more than `capacity`
snapshots behind loses the oldest ones; since a point covers the updates
between two snapshots, a lost snapshot only makes the next point cover more
batches: no update goes uncounted.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import tensorflow as tf

from tf_diffmap.devices import task_name
from tf_diffmap.store.parameter_store import counters_as_stats
from tf_diffmap.store.staleness import StalenessStats

__all__ = ["CounterSnapshots", "Snapshots"]


@dataclasses.dataclass(frozen=True)
class Snapshots:
    """Snapshots read from the ring, oldest first.

    Attributes:
        indices: `[K]` each snapshot's index (see `CounterSnapshots.start`).
        times: `[K]` wall-clock time (seconds since the epoch) of each.
        versions: `[K]` the store version.
        optimizer_steps: `[K]` the optimizer steps the store had applied,
            where it aggregates gradients into steps; else None (every
            update is a step of its own).
        counters: `[K, replicas, columns]` the store's per-replica counters.
        lr_scale_sums: `[K, replicas]` the store's learning-rate factor sums.
        lost: snapshots overwritten before they were read (their updates
            count in the next point).
        next_index: where the next read starts.
        sampled: the one snapshot was read from Python when asked for, at
            the step Keras' graph had reached (on a cluster, see
            `CounterSnapshots`), rather than taken by the graph at each step.
    """

    indices: np.ndarray
    times: np.ndarray
    versions: np.ndarray
    optimizer_steps: np.ndarray | None
    counters: np.ndarray
    lr_scale_sums: np.ndarray
    lost: int
    next_index: int
    sampled: bool = False

    def __len__(self) -> int:
        return len(self.indices)

    def stats(self, k, like: StalenessStats) -> StalenessStats:
        """Snapshot k as `StalenessStats` (the columns of `like`'s store).

        With a list of snapshots `k`, every array has a leading dimension
        for them (`steps` too), and `version` is the last one's.
        """
        return counters_as_stats(
            int(np.max(self.versions[k])),
            self.counters[k],
            staleness_max=like.staleness_max,
            lr_scale_sum=self.lr_scale_sums[k],
            abandoned=like.abandoned,
            steps=None if self.optimizer_steps is None else self.optimizer_steps[k],
            step_staleness_max=like.step_staleness_max,
        )


class CounterSnapshots:
    """A ring of counter snapshots, one per training step while switched on.

    Any number of readers may use it at once, each from its own start
    (`start` returns where); the ring is on while one is registered.

    Args:
        store: the `ParameterStore` whose counters are copied; the ring lives
            on its host, next to them.
        client_host: where Keras' graph runs; the on/off flag lives there, so
            that a step of a graph with the ring switched off reads nothing
            remote.
        capacity: rows of the ring.
    """

    def __init__(self, store, client_host: str, capacity: int = 512):
        self._store = store
        self.capacity = capacity
        self._readers: set[int] = set()
        self._lock = threading.Lock()
        replicas, columns = store.counters.shape
        # On a cluster the version counter lives on a ps task: an op of
        # Keras' step that reaches it, even in a branch that does not run,
        # makes every step a call to that task (and a lost ps the step's own
        # error).
        # There Keras' graph only counts its steps, and `read` takes one
        # snapshot from Python when asked.
        self.in_graph = task_name(store.host) == task_name(client_host)
        self._host = store.host
        self._gather = None
        with tf.init_scope():
            with tf.device(client_host):
                self.on = tf.Variable(False, trainable=False, name="snapshots_on")
                self.steps = tf.Variable(
                    tf.constant(0, tf.int64), trainable=False, name="snapshot_steps"
                )
            if not self.in_graph:
                return
            with tf.device(store.host):
                # Snapshots taken in all; row `i % capacity` holds the i-th.
                self.written = tf.Variable(
                    tf.constant(0, tf.int64), trainable=False, name="snapshots_written"
                )
                self.ring_times = tf.Variable(
                    tf.zeros([capacity], tf.float64), trainable=False, name="snapshot_time"
                )
                self.ring_versions = tf.Variable(
                    tf.zeros([capacity], tf.int64), trainable=False, name="snapshot_version"
                )
                self.ring_steps = tf.Variable(
                    tf.zeros([capacity], tf.int64), trainable=False, name="snapshot_optimizer_steps"
                )
                self.ring_counters = tf.Variable(
                    tf.zeros([capacity, replicas, columns], tf.int64),
                    trainable=False,
                    name="snapshot_counters",
                )
                self.ring_lr = tf.Variable(
                    tf.zeros([capacity, replicas], tf.float64),
                    trainable=False,
                    name="snapshot_lr_scale_sum",
                )

    # -- in Keras' graph ------------------------------------------------------

    def record_in_graph(self, after) -> tf.Tensor:
        """Ops that take a snapshot after `after` while the ring is on.

        Switched off, a step reads one flag on the client host, and
        nothing else.
        """
        with tf.control_dependencies(after):
            on = self.on.read_value()
        if not self.in_graph:
            return tf.cond(on, self._count, lambda: tf.constant(False))
        # A call, not inlined: the snapshot's ops live on the store's host,
        # and inlined into Keras' step they would make every step a
        # multi-device one that reaches that host, the ring on or off.
        take = tf.function(self._take, autograph=False, experimental_attributes={"_noinline": True})
        return tf.cond(on, take, lambda: tf.constant(False))

    def _count(self) -> tf.Tensor:
        with tf.control_dependencies([self.steps.assign_add(1, read_value=False)]):
            return tf.identity(tf.constant(True))

    def _take(self) -> tf.Tensor:
        store = self._store
        with tf.device(self._host):
            # Every read before the first write: the row is one moment's.
            version = store.version.read_value()
            steps = store.optimizer_steps.read_value()
            counters = store.counters.read_value()
            lr = store.lr_scale_sum.read_value()
            now = tf.timestamp()
            index = self.written.read_value()
            slot = tf.reshape(index % self.capacity, [1, 1])
            with tf.control_dependencies([version, steps, counters, lr, now]):
                rows = [
                    self.ring_times.scatter_nd_update(slot, tf.reshape(now, [1])),
                    self.ring_versions.scatter_nd_update(slot, tf.reshape(version, [1])),
                    self.ring_steps.scatter_nd_update(slot, tf.reshape(steps, [1])),
                    self.ring_counters.scatter_nd_update(slot, counters[tf.newaxis]),
                    self.ring_lr.scatter_nd_update(slot, lr[tf.newaxis]),
                ]
            # Counted written once its row is complete: a reader never sees
            # a row in the making.
            with tf.control_dependencies(rows):
                counted = self.written.assign_add(1, read_value=False)
        with tf.control_dependencies([counted]):
            return tf.identity(tf.constant(True))

    # -- from Python ----------------------------------------------------------

    def start(self, reader: object) -> int:
        """Registers `reader` and switches the ring on.

        Returns:
            The index of the next snapshot: the one the next training step
            takes. While a reader is registered, every step takes one, so
            snapshot `i` is the `(i - start + 1)`-th step since the start.
        """
        if self.in_graph and self._gather is None:  # traced here, not in a first read
            self._gather = self._make_gather()
        with self._lock:
            self._readers.add(id(reader))
            self.on.assign(True)
            return int((self.written if self.in_graph else self.steps).read_value())

    def stop(self, reader: object | None = None) -> None:
        """Unregisters `reader` (None: every reader); off once none is left."""
        with self._lock:
            if reader is None:
                self._readers.clear()
            else:
                self._readers.discard(id(reader))
            if not self._readers:
                self.on.assign(False)

    def read(self, since: int) -> Snapshots:
        """The snapshots written since index `since`, in one bulk read.

        Args:
            since: the `next_index` of the previous read (or `start`'s result).
        """
        if not self.in_graph:
            return self._sample(since)
        if self._gather is None:
            self._gather = self._make_gather()
        # One call: while the replicas run, each eager op of this thread
        # costs about as much as the whole gather (measured in `fit`).
        first, written, after, times, versions, steps, counters, lr = (
            t.numpy() for t in self._gather(tf.constant(since, tf.int64))
        )
        first, written = int(first), int(written)
        # A row the graph overwrote while it was read is from a later
        # snapshot: drop the rows the ring may have lapped meanwhile.
        lapped = max(int(after) - self.capacity - first, 0)
        return Snapshots(
            indices=np.arange(first, written, dtype=np.int64)[lapped:],
            times=times[lapped:],
            versions=versions[lapped:],
            optimizer_steps=steps[lapped:] if self._store.aggregates else None,
            counters=counters[lapped:],
            lr_scale_sums=lr[lapped:],
            lost=(first - since) + lapped,
            next_index=written,
        )

    def _sample(self, since: int) -> Snapshots:
        """One snapshot read now, at the step Keras' graph has reached."""
        steps = int(self.steps.read_value())
        if steps <= since:
            nothing = np.zeros([0], np.int64)
            return Snapshots(
                nothing, nothing * 1.0, nothing, nothing, nothing, nothing, 0, since, True
            )
        store = self._store
        return Snapshots(
            indices=np.array([steps - 1]),
            times=np.array([time.time()]),
            versions=store.version.numpy()[None],
            optimizer_steps=store.optimizer_steps.numpy()[None] if store.aggregates else None,
            counters=store.counters.numpy()[None],
            lr_scale_sums=store.lr_scale_sum.numpy()[None],
            lost=0,
            next_index=steps,
            sampled=True,
        )

    def _make_gather(self):
        variables = [
            self.ring_times,
            self.ring_versions,
            self.ring_steps,
            self.ring_counters,
            self.ring_lr,
        ]
        capacity = self.capacity

        def gather(since):
            """The rows written since index `since` that the ring still
            holds: their first index, the count written before and after
            the rows were read, and the rows."""
            with tf.device(self._host):
                written = self.written.read_value()
                first = tf.maximum(since, written - capacity)
                slots = tf.range(first, written) % capacity
                rows = [tf.gather(v, slots) for v in variables]
                with tf.control_dependencies(rows):
                    after = self.written.read_value()
                return [first, written, after, *rows]

        return tf.function(gather, autograph=False).get_concrete_function(
            tf.TensorSpec([], tf.int64)
        )
