"""What `strategy.run` returns under asynchronous training, and its reductions.

A synchronous strategy's `run` returns one value per replica, each computed
from that replica's shard of this batch, and `reduce` combines them. An
asynchronous training step waits for none of its shards: `strategy.run`
returns the outputs of one replica step, the most recently completed (for
the first step after a drain, this batch's first shard). Such a value stands
for one replica of N, all of which computed alike:

- `reduce(SUM, v, axis=None)` is `N * v`, the sum over N replicas. With the
  loss of TensorFlow's custom-training tutorial,
  `tf.nn.compute_average_loss(per_example_loss, global_batch_size=B)`, a
  shard of `B / N` examples returns its share of the batch's mean loss,
  about `1 / N` of it; the sum is the shard's mean loss, an estimate of the
  batch's, as a synchronous strategy's sum is the batch's mean loss.
- `reduce(MEAN, v, axis=None)` is `v`.
- With an axis, the reduction first runs over that axis of `v` (the shard's
  examples): SUM is `N * reduce_sum(v, axis)`, MEAN `reduce_mean(v, axis)`.
- `gather(v, axis)` and `experimental_local_results(v)` hold that one
  step's values only: the other shards' outputs are not waited for.

A step that applies no update is split over the replicas on one host, as
`MirroredStrategy` splits it (`tf_diffmap.engine.inference`): `strategy.run`
returns one value per replica, each computed from that replica's shard of
the batch, and these reduce as a synchronous strategy's do: SUM adds them,
MEAN averages them, with an axis the reduction runs over the replicas'
examples together (MEAN is then the batch's mean), and `gather` and
`experimental_local_results` give every replica's value, in replica order
(concatenated, the batch's order).

On a cluster a step that applies no update is split the same way, its
shards on the workers present (`tf_diffmap.cluster.inference`), and its
values reduce as above.

A step that runs the whole batch at once (`run_eagerly`, an eager
`strategy.run`) returns the whole batch's outputs, which stand for every
replica: reducing them leaves them as they are.

The mark is an attribute of the tensor that `strategy.run` returns in the
caller's graph: reduce in the same `tf.function` as the `run`, as the
tutorial does (a tensor returned from the function is a new one).
"""

from __future__ import annotations

import tensorflow as tf

from tf_diffmap import _tf_internal

__all__ = [
    "gather",
    "local_results",
    "mark_one_replica",
    "reduce_over_axis",
    "reduce_replicas",
    "stands_for",
]

_STANDS_FOR = "_tf_diffmap_stands_for"


def mark_one_replica(outputs, num_replicas: int):
    """Marks the tensors of `outputs` as one replica step's of `num_replicas`."""
    for tensor in tf.nest.flatten(outputs):
        if isinstance(tensor, tf.Tensor) and not tf.executing_eagerly():
            setattr(tensor, _STANDS_FOR, num_replicas)
    return outputs


def stands_for(value) -> int:
    """How many replicas' values `value` stands for in a SUM (1 if unmarked)."""
    return getattr(value, _STANDS_FOR, 1)


def local_results(value) -> tuple:
    """The replicas' values of `value` (itself alone unless it is per replica)."""
    values = _tf_internal.replica_values(value)
    return (value,) if values is None else values


def gather(value, axis: int):
    """Every replica's value, concatenated along `axis` (the batch's order)."""
    values = _tf_internal.replica_values(value)
    if values is None:
        return value
    return tf.concat(values, axis=axis)


def reduce_replicas(reduce_op: tf.distribute.ReduceOp, value):
    """Reduces over the replicas a value that `strategy.run` returned."""
    values = _tf_internal.replica_values(value)
    if values is not None:
        total = tf.add_n([tf.convert_to_tensor(v) for v in values])
        if reduce_op == tf.distribute.ReduceOp.MEAN:
            total = total / tf.cast(len(values), total.dtype)
        return total
    replicas = stands_for(value)
    if reduce_op != tf.distribute.ReduceOp.SUM or replicas == 1:
        return value
    value = tf.convert_to_tensor(value)
    return value * tf.cast(replicas, value.dtype)


def reduce_over_axis(reduce_op: tf.distribute.ReduceOp, value, axis):
    """Reduces `value` over `axis` (its examples), keeping its mark.

    A per-replica value is reduced over the replicas' examples together: the
    sum of every replica's sum, or the mean of all their examples.
    """
    values = _tf_internal.replica_values(value)
    if values is not None:
        joined = tf.concat([tf.convert_to_tensor(v) for v in values], axis=axis)
        return reduce_over_axis(reduce_op, joined, axis)
    replicas = stands_for(value)
    value = tf.convert_to_tensor(value)
    if reduce_op == tf.distribute.ReduceOp.SUM:
        reduced = tf.reduce_sum(value, axis=axis)
    elif reduce_op == tf.distribute.ReduceOp.MEAN:
        reduced = tf.reduce_mean(value, axis=axis)
    else:
        raise TypeError(f"Expected a tf.distribute.ReduceOp, received {reduce_op!r}.")
    return mark_one_replica(reduced, replicas)
