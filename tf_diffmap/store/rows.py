"""Rows of a variable in the store: a sparse gradient made unique, and rows
written under the variable's lock.

The row updates (`tf_diffmap.updates.sparse`) and the sparse accumulators
(`tf_diffmap.store.accumulators`) both read and write a table by rows
through these two functions.
"""

from __future__ import annotations

import tensorflow as tf

from tf_diffmap.store.partitioned import PartitionedVariable

__all__ = ["unique_rows", "write_rows"]


def unique_rows(gradient: tf.IndexedSlices) -> tuple[tf.Tensor, tf.Tensor]:
    """The distinct ids of `gradient` and, for each, the sum of its rows.

    A lookup of the same id twice gives two rows of gradient; the dense
    gradient of the table holds their sum, and so does the row update.
    """
    ids, position = tf.unique(tf.cast(gradient.indices, tf.int64))
    rows = tf.math.unsorted_segment_sum(gradient.values, position, tf.size(ids))
    return ids, rows


def write_rows(variable, op: str, ids: tf.Tensor, rows: tf.Tensor):
    """Adds (`"add"`), subtracts, sets or takes the maximum of `rows` into
    rows `ids` of `variable`, holding the variable's lock.

    TensorFlow's `scatter_add` and its kin update a float variable under a
    shared lock: two replicas adding to the same row at once can lose one of
    the increments. Their `scatter_nd` forms take the variable's lock
    (`use_locking`), and so lose none. A variable split by rows is written
    shard by shard, each under its own lock.
    """
    if isinstance(variable, PartitionedVariable):
        parts = variable.row_split.partition(ids, tf.cast(rows, variable.dtype))
        writes = []
        for shard, (local, part, _) in zip(variable.shards, parts):
            with tf.device(shard.device):
                writes.append(write_rows(shard, op, local, part))
        return tf.group(writes)
    return getattr(variable, f"scatter_nd_{op}")(
        tf.expand_dims(ids, 1), tf.cast(rows, variable.dtype)
    )
