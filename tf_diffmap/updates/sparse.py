"""Row updates: a sparse gradient updates only the rows it touches.

The gradient of an embedding lookup is a `tf.IndexedSlices`: the ids the
batch looked up and one row of gradient each. Keras' optimizers apply it with
dense arithmetic on their slots (SGD's momentum, Adam's moments, Ftrl's
accumulators), which reads and writes every row of the table and of each
slot at every update. Here each supported optimizer's own formula is applied
to the touched rows alone: the ids are made unique and their rows summed
where the gradient was computed, the rows of the variable and its slots are
gathered where they live, and the new rows are written back by scatter ops
that add (or, for Ftrl's weights, set) rows under the variable's lock
(`tf_diffmap.store.rows.write_rows`), so that replicas updating the same rows at once lose no
increment. The cost of an update follows the
rows it touches, not the size of the table.

Semantics ("lazy", the default, and "dense"; `AsyncOptimizer(sparse_updates=)`):

- `keras.optimizers.SGD` without momentum and `keras.optimizers.Adagrad`:
  a row without gradient does not change under Keras' dense update either,
  so the row update is exact.
- `keras.optimizers.SGD` with momentum, `keras.optimizers.Adam` (and `AdamW`,
  with or without `amsgrad`) and `keras.optimizers.Ftrl`: under the row
  update a row the batch did not touch keeps its slots and its value, where
  Keras' dense update would decay its momentum or moments and move it (and
  Ftrl's first dense update sets every untouched row to its closed form, 0).
  This is the field's lazy update (TensorFlow 1's sparse momentum, TF-Addons'
  `LazyAdam`); `sparse_updates="dense"` keeps Keras' dense update, at the
  cost of the whole table.
- Any other optimizer (or a subclass with an `update_step` of its own) is
  applied as Keras applies it, densely.

Keras' weight decay (`weight_decay=`) and `global_clipnorm` stay Keras' own,
dense, on every row.

A table split by rows over several parameter devices (`tf_diffmap.store.partitioned`)
is updated shard by shard: the touched rows are sent, from where the gradient
was computed, to the shard that holds each, and each shard's update reads and
writes that shard and its own shards of the slots, on its device.
"""

from __future__ import annotations

import warnings

import keras
import tensorflow as tf

from tf_diffmap import _tf_internal
from tf_diffmap.store.partitioned import PartitionedVariable
from tf_diffmap.store.rows import unique_rows, write_rows

__all__ = [
    "SEMANTICS",
    "row_update_kind",
    "unique_rows",
    "update_rows",
    "updates_rows",
    "write_rows",
]

SEMANTICS = ("lazy", "dense")

# The optimizers whose formula `update_rows` knows, most derived first.
_KINDS = (
    ("adam", keras.optimizers.Adam),
    ("adagrad", keras.optimizers.Adagrad),
    ("ftrl", keras.optimizers.Ftrl),
    ("sgd", keras.optimizers.SGD),
)

_warned: set[type] = set()


def row_update_kind(optimizer) -> str | None:
    """Which row update applies `optimizer`'s formula, or None if none does.

    An optimizer qualifies when the `update_step` it runs is the one of a
    supported Keras class (so `AdamW`, an `Adam`, qualifies; a subclass that
    writes its own `update_step` does not).
    """
    for kind, cls in _KINDS:
        if isinstance(optimizer, cls) and type(optimizer).update_step is cls.update_step:
            return kind
    return None


def updates_rows(optimizer) -> bool:
    """Whether `update_rows` can apply `optimizer`'s updates.

    When it cannot, a warning says so once per optimizer class: Keras' own
    update then applies, densely.
    """
    if row_update_kind(optimizer) is not None:
        return True
    cls = type(optimizer)
    if cls not in _warned:
        _warned.add(cls)
        warnings.warn(
            f"tf_diffmap applies {cls.__name__}'s updates of a sparse gradient "
            "(an embedding table's) as Keras does, densely: each update "
            "reads and writes the whole table and its slots. SGD, Adagrad, "
            "Adam, AdamW and Ftrl update only the rows a batch touched.",
            stacklevel=_tf_internal.user_stacklevel(),
        )
    return False


def update_rows(optimizer, variable, gradient: tf.IndexedSlices, learning_rate):
    """Applies `optimizer`'s update to the rows of `gradient` alone.

    Args:
        optimizer: a Keras optimizer that `updates_rows` accepts (its slots
            and hyperparameters are used; its `iterations` is not changed
            here, Keras counts it once per `apply`).
        variable: the `tf.Variable` being updated.
        gradient: its gradient, as `tf.IndexedSlices`.
        learning_rate: the learning rate of this update.

    Returns:
        The update op (None when run eagerly).
    """
    kind = row_update_kind(optimizer)
    if kind is None:
        raise ValueError(f"{type(optimizer).__name__} has no row update (see `updates_rows`).")
    ids, rows = unique_rows(gradient)
    update = _ROW_UPDATES[kind]
    slots = _tf_internal.optimizer_slots(optimizer, variable)
    split = _split_alike(variable, slots)
    if split is None:
        with tf.device(variable.device):
            dtype = variable.dtype
            rows = tf.cast(rows, dtype)
            lr = tf.cast(learning_rate, dtype)
            return update(optimizer, variable, slots, ids, rows, lr)
    # A variable split by rows: the rows go to their shards from where the
    # gradient was computed, and each shard's update runs beside it, on its
    # shards of the slots.
    rows = tf.cast(rows, variable.dtype)
    updates = []
    for k, (local, shard_rows, _) in enumerate(split.partition(ids, rows)):
        shard = variable.shards[k]
        with tf.device(shard.device):
            lr = tf.cast(learning_rate, variable.dtype)
            shard_slots = {name: slot.shards[k] for name, slot in slots.items()}
            updates.append(update(optimizer, shard, shard_slots, local, shard_rows, lr))
    return tf.group(updates)


def _split_alike(variable, slots: dict):
    """The `RowSplit` of `variable` when it and all its slots are split
    alike (see `tf_diffmap.store.partitioned`), else None."""
    if not isinstance(variable, PartitionedVariable):
        return None
    split = variable.row_split
    for slot in slots.values():
        if not isinstance(slot, PartitionedVariable) or slot.row_split != split:
            return None
    return split


def _sgd(optimizer, variable, slots, ids, grad, lr):
    if optimizer.momentum == 0:
        return write_rows(variable, "sub", ids, grad * lr)
    momentum = tf.cast(optimizer.momentum, variable.dtype)
    velocity = slots["momentum"]
    before = velocity.sparse_read(ids)
    after = before * momentum - grad * lr
    updates = [write_rows(velocity, "add", ids, after - before)]
    step = after * momentum - grad * lr if optimizer.nesterov else after
    updates.append(write_rows(variable, "add", ids, step))
    return tf.group(updates)


def _adagrad(optimizer, variable, slots, ids, grad, lr):
    accumulator = slots["accumulator"]
    square = tf.square(grad)
    accumulated = accumulator.sparse_read(ids) + square
    return tf.group(
        write_rows(accumulator, "add", ids, square),
        write_rows(variable, "sub", ids, lr * grad / tf.sqrt(accumulated + optimizer.epsilon)),
    )


def _adam(optimizer, variable, slots, ids, grad, lr):
    dtype = variable.dtype
    step = tf.cast(optimizer.iterations + 1, dtype)
    beta_1 = tf.cast(optimizer.beta_1, dtype)
    beta_2 = tf.cast(optimizer.beta_2, dtype)
    alpha = lr * tf.sqrt(1 - tf.pow(beta_2, step)) / (1 - tf.pow(beta_1, step))
    m, v = slots["momentum"], slots["velocity"]
    m_before, v_before = m.sparse_read(ids), v.sparse_read(ids)
    m_delta = (grad - m_before) * (1 - beta_1)
    v_delta = (tf.square(grad) - v_before) * (1 - beta_2)
    m_after, v_after = m_before + m_delta, v_before + v_delta
    updates = [
        write_rows(m, "add", ids, m_delta),
        write_rows(v, "add", ids, v_delta),
    ]
    if optimizer.amsgrad:
        v_hat = slots["velocity_hat"]
        v_after = tf.maximum(v_hat.sparse_read(ids), v_after)
        updates.append(write_rows(v_hat, "max", ids, v_after))
    step_rows = m_after * alpha / (tf.sqrt(v_after) + optimizer.epsilon)
    updates.append(write_rows(variable, "sub", ids, step_rows))
    return tf.group(updates)


def _ftrl(optimizer, variable, slots, ids, grad, lr):
    dtype = variable.dtype
    accumulator, linear = slots["accumulator"], slots["linear"]
    power = -tf.cast(optimizer.learning_rate_power, dtype)
    l1 = tf.cast(optimizer.l1_regularization_strength, dtype)
    l2 = tf.cast(optimizer.l2_regularization_strength, dtype) + tf.cast(optimizer.beta, dtype) / (
        2.0 * lr
    )
    shrinkage = tf.cast(optimizer.l2_shrinkage_regularization_strength, dtype)
    weights = variable.sparse_read(ids)
    accumulated = accumulator.sparse_read(ids)
    square = tf.square(grad)
    accumulated_after = accumulated + square
    linear_delta = (grad + 2 * shrinkage * weights) - (
        tf.pow(accumulated_after, power) - tf.pow(accumulated, power)
    ) / lr * weights
    linear_after = linear.sparse_read(ids) + linear_delta
    quadratic = tf.pow(accumulated_after, power) / lr + 2 * l2
    weights_after = (tf.clip_by_value(linear_after, -l1, l1) - linear_after) / quadratic
    return tf.group(
        write_rows(linear, "add", ids, linear_delta),
        write_rows(variable, "update", ids, weights_after),
        write_rows(accumulator, "add", ids, square),
    )


_ROW_UPDATES = {"sgd": _sgd, "adagrad": _adagrad, "adam": _adam, "ftrl": _ftrl}
