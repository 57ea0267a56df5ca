"""Shard gradients gathered beside the variables, K of them to an optimizer step.

Where the strategy aggregates (`Strategy(gradients_per_step=K)`, by default
one per replica), a replica does not apply its shard's gradient: it *pushes*
it. Each push adds its gradient to an accumulator beside each variable, and
the push that completes a window of K takes what the window holds and
leaves the accumulators empty. Its replica then applies the window's
gradient as one step of the optimizer
(`tf_diffmap.updates.aggregation`); the others go on computing. Nobody waits for
another replica: a slow one simply pushes fewer gradients.

A push is one critical section under a TensorFlow mutex on the store's host
(`MutexLock`, which waits without holding a thread): its adds, its count,
and, for the push that completes a window, the take. So a window holds
exactly K pushes, each push lands in exactly one window, and what a take
reads is what its pushes added, however many replicas push at once. The
optimizer's step runs outside the lock. Every value a critical section adds
is moved to the store's devices before the lock is taken, so that nothing
inside it waits for a replica's device or task.

A dense gradient is added to a dense accumulator of its variable's shape,
on its variable's device (split by rows alike where the variable is, see
`tf_diffmap.store.partitioned`). A sparse one (an embedding lookup's
`tf.IndexedSlices`) is queued, its distinct ids and their summed rows, on a
queue beside its variable; the take joins the window's rows into one
`tf.IndexedSlices`. A sparse window costs the rows it touches, never the
size of its table.

A push whose gradient is not accepted (too stale, see
`tf_diffmap.updates.aggregation`) still counts in its window, and adds nothing: a
window stands for K shards of the data, the batch the optimizer was tuned
for, and its step is scaled to the gradients accepted (`Window.gradients`).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import keras
import tensorflow as tf

from tf_diffmap.store.gate import Gate
from tf_diffmap.store.partitioned import PartitionedVariable
from tf_diffmap.store.rows import unique_rows, write_rows

__all__ = ["Accumulators", "FreshPush", "Window", "locked"]

_names = itertools.count()


@dataclasses.dataclass
class FreshPush:
    """What a push into fresh windows read (see `tf_diffmap.store.gate`).

    Attributes:
        replica_id: int32 scalar.
        read_steps: int64 scalar: the windows whose step its read saw
            applied (`Gate.read_closed`).
        read_time: float64 scalar: when it read (`tf.timestamp()`).
    """

    replica_id: tf.Tensor
    read_steps: tf.Tensor
    read_time: tf.Tensor


def _maybe(condition: tf.Tensor, effects, device: str) -> tf.Tensor:
    """Runs the ops `effects()` makes only where `condition` holds (in a
    graph); returns a flag that follows them."""

    def run():
        with tf.control_dependencies(effects()):
            return tf.constant(True)

    with tf.device(device):
        return tf.cond(condition, run, lambda: tf.constant(False))


@dataclasses.dataclass
class Window:
    """What a take reads: the sums of a window's accepted gradients.

    Attributes:
        taken: bool scalar: whether a window was taken (else the rest is
            empty placeholders of the same kinds).
        weight: float32 scalar: the window's accepted gradients (0 when
            none was accepted).
        pushes: int64 scalar: pushes the window held.
        sums: per variable, the sum of the accepted gradients (a tensor,
            `tf.IndexedSlices` of distinct ids, or None for a variable
            without gradient).
        accepted: where windows are fresh, whether the push was accepted
            (decided under the mutex); else None.
        number: where windows are fresh, the window the push went to, or
            that was taken; else None.
        tokens: from the window timer's call, the blocked replicas it let
            go to fill the window; else None.
        opening: where windows are fresh, whether the push opened its
            window (the timer is told); else None.
    """

    taken: tf.Tensor
    weight: tf.Tensor
    pushes: tf.Tensor
    sums: list
    accepted: tf.Tensor | None = None
    number: tf.Tensor | None = None
    tokens: tf.Tensor | None = None
    opening: tf.Tensor | None = None

    def gradients(self, replicas: int) -> list:
        """The gradient of the window's step, per variable: the sum of its
        accepted gradients, times `replicas` over their number (call where
        `taken` and `weight > 0`).

        A replica's gradient is made to be summed over the `replicas` of a
        synchronous step (`tf.distribute`'s contract: Keras divides each
        replica's loss by their number, as do custom loops that average
        over the global batch), so that a full window of `replicas`
        accepted gradients gives exactly their sum, the synchronous
        gradient of the batch, and a window with fewer accepted gradients
        (or K other than `replicas`) gives that sum's mean scaled alike.
        """
        out = []
        for total in self.sums:
            if total is None:
                out.append(None)
                continue
            values = total.values if isinstance(total, tf.IndexedSlices) else total
            scale = tf.cast(replicas, values.dtype) / tf.cast(self.weight, values.dtype)
            if isinstance(total, tf.IndexedSlices):
                out.append(tf.IndexedSlices(values * scale, total.indices, total.dense_shape))
            else:
                out.append(values * scale)
        return out


def locked(mutex: tf.Tensor, device: str, section):
    """Runs `section()` holding `mutex` (in a graph).

    Args:
        mutex: a `MutexV2` resource.
        device: the mutex's device.
        section: returns `(outputs, effects)`: a structure of tensors, and
            ops that must run before the mutex is released. Its ops run on
            `device` unless they name their own.

    Returns:
        `outputs`, available once the mutex is released.
    """
    with tf.device(device):
        lock = tf.raw_ops.MutexLock(mutex=mutex)
    with tf.control_dependencies([lock]), tf.device(device):
        outputs, effects = section()
    flat = [t for t in tf.nest.flatten(outputs) if t is not None]
    with tf.control_dependencies(flat + list(effects)), tf.device(device):
        released = tf.raw_ops.ConsumeMutexLock(mutex_lock=lock)
    # The outputs stay on the mutex's device: where they are used next
    # decides whether they travel, not where the section was traced.
    with tf.control_dependencies([released]), tf.device(device):
        return tf.nest.map_structure(lambda t: None if t is None else tf.identity(t), outputs)


class _Dense:
    """A dense accumulator beside its variable."""

    def __init__(self, store, variable):
        self.variable = variable
        self.accumulator = store.variable_beside(variable, f"{_base_name(variable)}/accumulator")

    def prepare(self, gradient, weight):
        """The gradient times its weight (1, or 0 where it is not
        accepted), on the accumulator's device."""
        dtype = self.variable.dtype
        if isinstance(gradient, tf.IndexedSlices):
            ids, rows = unique_rows(gradient)
            with tf.device(_first_device(self.accumulator)):
                return ids, tf.cast(rows, dtype) * tf.cast(weight, dtype)
        with tf.device(_first_device(self.accumulator)):
            return tf.cast(gradient, dtype) * tf.cast(weight, dtype)

    def add(self, prepared) -> tf.Operation:
        if isinstance(prepared, tuple):
            ids, rows = prepared
            return write_rows(self.accumulator, "add", ids, rows)
        return self.accumulator.assign_add(prepared, read_value=False)

    def take(self, pushes):
        del pushes
        with tf.device(_first_device(self.accumulator)):
            value = self.accumulator.read_value()
            with tf.control_dependencies([value]):
                emptied = self.accumulator.assign(tf.zeros_like(value), read_value=False)
            with tf.control_dependencies([emptied]):
                return tf.identity(value)

    def nothing(self):
        shape = self.variable.shape.as_list()
        return tf.zeros([0, *shape[1:]] if shape else [], self.variable.dtype)

    def as_sum(self, value):
        return tf.reshape(value, self.variable.shape)


class _Sparse:
    """A queue of a sparse gradient's distinct ids and rows, beside its variable."""

    def __init__(self, store, variable, capacity: int):
        self.variable = variable
        self.row_shape = variable.shape.as_list()[1:]
        self.device = _first_device(variable)
        with tf.init_scope(), tf.device(self.device):
            self.queue = tf.queue.FIFOQueue(
                capacity,
                [tf.int64, variable.dtype],
                name=f"tf_diffmap_rows_{next(_names)}",
            )

    def prepare(self, gradient, weight):
        if not isinstance(gradient, tf.IndexedSlices):
            # A dense gradient of a variable pushed sparsely before: every row.
            gradient = tf.convert_to_tensor(gradient)
            rows_count = tf.shape(gradient, out_type=tf.int64)[0]
            gradient = tf.IndexedSlices(
                gradient, tf.range(rows_count), tf.shape(gradient, out_type=tf.int64)
            )
        # Distinct ids where the gradient was computed: fewer rows travel.
        ids, rows = unique_rows(gradient)
        with tf.device(self.device):
            accepted = weight > 0
            keep = tf.where(accepted, tf.size(ids, out_type=tf.int64), tf.constant(0, tf.int64))
            rows = tf.cast(rows[:keep], self.variable.dtype) * tf.cast(weight, self.variable.dtype)
            return ids[:keep], rows

    def add(self, prepared) -> tf.Operation:
        ids, rows = prepared
        with tf.device(self.device):
            return self.queue.enqueue([ids, rows])

    def take(self, pushes):
        """Every item the window queued (`pushes` of them, one a push)."""
        with tf.device(self.device):
            empty_ids = tf.zeros([0], tf.int64)
            empty_rows = tf.zeros([0, *self.row_shape], self.variable.dtype)

            def body(i, ids, rows):
                got_ids, got_rows = self.queue.dequeue()
                return i + 1, tf.concat([ids, got_ids], 0), tf.concat([rows, got_rows], 0)

            _, ids, rows = tf.while_loop(
                lambda i, ids, rows: i < pushes,
                body,
                [tf.constant(0, tf.int64), empty_ids, empty_rows],
                shape_invariants=[
                    tf.TensorShape([]),
                    tf.TensorShape([None]),
                    tf.TensorShape([None, *self.row_shape]),
                ],
                parallel_iterations=1,
            )
            return ids, rows

    def nothing(self):
        return (
            tf.zeros([0], tf.int64),
            tf.zeros([0, *self.row_shape], self.variable.dtype),
        )

    def as_sum(self, value):
        ids, rows = value
        dense_shape = tf.constant(self.variable.shape.as_list(), tf.int64)
        with tf.device(self.device):
            ids, rows = unique_rows(tf.IndexedSlices(rows, ids, dense_shape))
        return tf.IndexedSlices(rows, ids, dense_shape)


class Accumulators:
    """The accumulators of one optimizer's variables, and their windows.

    Each variable's accumulator is made at the first push of a gradient
    for it (inside the first trace of a replica step, as Keras makes an
    optimizer's slots), of the gradient's kind: dense, or sparse for a
    `tf.IndexedSlices`.

    Args:
        store: the parameter store (placement, and the store's host).
        variables: the optimizer's trainable variables, in the order the
            gradients come.
        gradients_per_step: K, the pushes of a window (where windows are
            fresh, the pushes of a full window when the examples of a
            global batch are not known).
        gate: the windows' gate (`tf_diffmap.store.gate`): its mutex
            guards every push and take (and, where windows are fresh, the
            replicas' waits); it counts the windows taken.
    """

    def __init__(self, store, variables: Sequence, gradients_per_step: int, gate: Gate):
        self.store = store
        self.gate = gate
        # The TensorFlow variables (a Keras variable holds one).
        self.variables = [v.value if isinstance(v, keras.Variable) else v for v in variables]
        self.gradients_per_step = gradients_per_step
        self.host = store.host
        self._kinds: dict[int, _Dense | _Sparse] = {}
        with tf.init_scope(), tf.device(self.host):
            self.mutex = gate.mutex
            # Pushes since the last take, and their accepted examples.
            self.pending = tf.Variable(
                tf.constant(0, tf.int64), trainable=False, name="accumulated_pushes"
            )
            self.weight = tf.Variable(0.0, trainable=False, name="accumulated_weight")

    def _kind(self, index: int, gradient):
        kind = self._kinds.get(index)
        if kind is None:
            variable = self.variables[index]
            if isinstance(gradient, tf.IndexedSlices):
                # Unbounded: a push enqueues under the mutex, where a full queue
                # would wait for a take that needs the mutex; a window holds
                # its pushes' items only until its take.
                kind = _Sparse(self.store, variable, capacity=-1)
            else:
                kind = _Dense(self.store, variable)
            self._kinds[index] = kind
        return kind

    def push(
        self,
        gradients: Sequence,
        accepted: tf.Tensor,
        examples: tf.Tensor | None = None,
        fresh: FreshPush | None = None,
    ) -> Window:
        """Adds one shard's gradients, weighted by its examples, if
        `accepted` (in a graph).

        Args:
            gradients: one per variable (None: no gradient).
            accepted: bool scalar. Where windows are not fresh, a gradient
                not accepted adds nothing, and still counts in its window.
            examples: the shard's examples, its gradient's weight in the
                window's mean (None: 1).
            fresh: where windows are fresh, what the push read; the push is
                then accepted only if `accepted` and its read saw as many
                optimizer steps as windows were taken (decided under the
                mutex), a push not accepted takes no slot, and a window is
                full once its accepted examples make a global batch.

        Returns:
            The window this push completed (`taken`), or empty placeholders.
        """
        if len(gradients) != len(self.variables):
            raise ValueError(
                f"An aggregated step pushed {len(gradients)} gradients for an "
                f"optimizer of {len(self.variables)} variables; every step of one "
                "optimizer must update the same variables under tf_diffmap's "
                "aggregation. Use one optimizer per set of variables."
            )
        with tf.device(self.host):
            size = tf.constant(1.0) if examples is None else tf.cast(examples, tf.float32)
            if fresh is None:
                weight = tf.where(accepted, size, tf.constant(0.0))
            else:
                # Decided under the mutex: the adds are conditional there.
                weight = size
        prepared = {}
        for index, gradient in enumerate(gradients):
            if gradient is not None:
                prepared[index] = self._kind(index, gradient).prepare(gradient, weight)
        # Everything the section adds is on the store's devices before it
        # takes the lock.
        ready = [t for t in tf.nest.flatten(list(prepared.values())) if t is not None]

        def add_all():
            return [self._kinds[i].add(p) for i, p in prepared.items()]

        def section():
            if fresh is None:
                added = add_all()
                with tf.control_dependencies(added), tf.device(self.host):
                    # Read here: an assignment's value is otherwise read where
                    # it is used, which may be after the take has emptied it.
                    pending = tf.identity(self.pending.assign_add(1))
                    total = tf.identity(self.weight.assign_add(weight))
                    full = pending >= self.gradients_per_step
                window = self._take_if(full, pending, total)
                return window, added
            gate = self.gate
            with tf.device(self.host):
                number = gate.windows.read_value()
                ok = tf.logical_and(accepted, tf.equal(fresh.read_steps, number))
            with tf.control_dependencies([number]):
                added = _maybe(ok, add_all, self.host)
            with tf.control_dependencies([added]), tf.device(self.host):
                pending = tf.identity(self.pending.assign_add(tf.cast(ok, tf.int64)))
                total = tf.identity(self.weight.assign_add(tf.where(ok, weight, 0.0)))
                skipped = gate.skipped_examples.assign_add(
                    tf.cast(tf.where(ok, 0.0, weight), tf.float64), read_value=False
                )
                # Too late for its window (a rule's drop is not).
                late = tf.logical_and(accepted, tf.logical_not(ok))
                counted_late = gate.late_pushes.scatter_nd_add(
                    tf.reshape(tf.cast(fresh.replica_id, tf.int64), [1, 1]),
                    tf.reshape(tf.cast(late, tf.int64), [1]),
                )
                target = gate.target.read_value()
                full = tf.logical_and(
                    ok,
                    tf.where(
                        target > 0,
                        total >= self._full_examples(target),
                        pending >= self.gradients_per_step,
                    ),
                )
                stays = tf.logical_and(ok, tf.logical_not(full))
                waits = tf.logical_and(stays, pending < gate.present.read_value())
            with tf.control_dependencies([full]):
                owes = _maybe(waits, lambda: [gate.owe(fresh.replica_id, number)], self.host)
            window = self._take_if(full, pending, total, taker=fresh.replica_id)
            window.accepted = tf.identity(ok)
            window.number = tf.where(window.taken, window.number, number)
            window.opening = tf.logical_and(stays, tf.equal(pending, 1))
            return window, [added, owes, skipped, counted_late]

        with tf.control_dependencies(ready + [weight]):
            window = self._locked_window(section)
        if fresh is not None:
            # The timer hears of a window opened once the mutex is free. Its
            # queue is on the client, and nothing of the push waits for it:
            # the replica step runs every op it makes before it ends.
            with tf.device(self.host):
                seconds = self.gate.shard_seconds.read_value()
            _maybe(
                window.opening,
                lambda: [self.gate.open(window.number, fresh.read_time, seconds)],
                self.gate.events_host,
            )
        return window

    def flush(self) -> Window:
        """Takes what the accumulators hold, if any push is pending (in a graph)."""

        def section():
            with tf.device(self.host):
                pending = self.pending.read_value()
                total = self.weight.read_value()
            return self._take_if(pending > 0, pending, total), []

        return self._locked_window(section)

    def close_if_open(self, number: tf.Tensor, fill: tf.Tensor) -> Window:
        """The timer's call on a window open past its patience (in a graph).

        If window `number` is still open: with `fill` and replicas blocked,
        releases as many of them as the window lacks shards (at the mean
        examples of its pushes), to compute fresh gradients of the same
        parameters in place of the missing ones (`tokens`, nothing taken);
        otherwise closes it short (takes it as it is).
        """

        gate = self.gate

        def section():
            with tf.device(self.host):
                pending = self.pending.read_value()
                total = self.weight.read_value()
                target = self._full_examples(gate.target.read_value())
                now = gate.windows.read_value()
                is_open = tf.logical_and(tf.equal(now, number), pending > 0)
                blocked = gate.blocked.read_value()
                fills = tf.logical_and(is_open, tf.logical_and(fill, blocked > 0))
                per_push = total / tf.cast(tf.maximum(pending, 1), tf.float32)
                lacking = tf.where(
                    target > 0,
                    tf.cast(tf.math.ceil((target - total) / per_push), tf.int64),
                    self.gradients_per_step - pending,
                )
                closes = tf.logical_and(is_open, tf.logical_not(fills))
            with tf.control_dependencies([pending, total, blocked]):
                released = tf.cond(
                    fills,
                    lambda: gate.unblock(tf.maximum(lacking, 1)),
                    lambda: tf.constant(0, tf.int64),
                )
            with tf.control_dependencies([released]):
                window = self._take_if(closes, pending, total)
            with tf.device(self.host):
                counted = [
                    gate.closed_short.assign_add(tf.cast(closes, tf.int64), read_value=False),
                    gate.fills.assign_add(tf.cast(fills, tf.int64), read_value=False),
                ]
            window.tokens = released
            window.number = tf.where(window.taken, window.number, number)
            return window, counted

        return self._locked_window(section)

    def _full_examples(self, target: tf.Tensor) -> tf.Tensor:
        """The examples of a full fresh window: K shards' worth of a batch
        of `target` examples cut over the gate's replicas (a batch, with K
        one per replica)."""
        scale = self.gradients_per_step / self.gate.replicas
        return tf.cast(target, tf.float32) * tf.constant(scale, tf.float32)

    def _locked_window(self, section) -> Window:
        def flat_section():
            window, effects = section()
            extra = [window.accepted, window.number, window.tokens, window.opening]
            return (window.taken, window.weight, window.pushes, window.sums, extra), effects

        taken, weight, pushes, sums, extra = locked(self.mutex, self.host, flat_section)
        return Window(taken, weight, pushes, self._as_sums(sums), *extra)

    def _take_if(
        self, full: tf.Tensor, pending: tf.Tensor, total: tf.Tensor, taker: tf.Tensor | int = -1
    ) -> Window:
        """Inside the lock: takes the window when `full`, emptying the
        accumulators and the counts, and counting the window taken."""
        indices = sorted(self._kinds)

        def take():
            values = [self._kinds[i].take(pending) for i in indices]
            with tf.control_dependencies(tf.nest.flatten(values)), tf.device(self.host):
                reset = [
                    self.pending.assign(tf.constant(0, tf.int64), read_value=False),
                    self.weight.assign(0.0, read_value=False),
                ]
                number = self.gate.take(taker)
                reset.append(
                    self.gate.step_examples.assign_add(tf.cast(total, tf.float64), read_value=False)
                )
            with tf.control_dependencies(reset):
                return (
                    tf.constant(True),
                    tf.identity(total),
                    tf.identity(pending),
                    tf.nest.map_structure(tf.identity, values),
                    tf.identity(number),
                )

        def keep():
            return (
                tf.constant(False),
                tf.constant(0.0),
                tf.constant(0, tf.int64),
                [self._kinds[i].nothing() for i in indices],
                tf.constant(0, tf.int64),
            )

        with tf.device(self.host):
            taken, weight, pushes, values, number = tf.cond(full, take, keep)
        sums: list = [None] * len(self.variables)
        for i, value in zip(indices, values):
            sums[i] = value
        return Window(taken, weight, pushes, sums, None, number)

    def _as_sums(self, sums) -> list:
        return [
            None if value is None else self._kinds[i].as_sum(value) for i, value in enumerate(sums)
        ]


def _first_device(variable) -> str:
    if isinstance(variable, PartitionedVariable):
        return variable.shards[0].device
    return variable.device


def _base_name(variable) -> str:
    return getattr(variable, "name", "variable").split(":")[0]
