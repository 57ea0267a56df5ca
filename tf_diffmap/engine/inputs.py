"""Input pipelines under the strategy, on the host.

On one host the strategy feeds whole host batches to Keras' graph, which
splits each into one shard per replica and queues the shards for the
replicas' loops. A dataset is therefore not distributed over devices at all:
`host_dataset` hands Keras the user's `tf.data.Dataset`, whose iterator
Keras drives inside its own graph (so `steps_per_execution` runs many steps
per call), ended early if a replica fails so that its error is raised at
once. On a cluster, training input is built on each worker instead
(`tf_diffmap.cluster.inputs`).
"""

from __future__ import annotations

import tensorflow as tf

from tf_diffmap import _tf_internal

__all__ = ["check_dataset", "for_keras_inference", "group_replica_batches", "host_dataset"]


def check_dataset(dataset) -> None:
    """Raises a ValueError that says what to pass unless `dataset` is a `tf.data.Dataset`."""
    if not isinstance(dataset, tf.data.Dataset):
        raise ValueError(
            "tf_diffmap.Strategy distributes tf.data.Dataset objects, "
            f"received {type(dataset).__name__}. Wrap arrays with "
            "tf.data.Dataset.from_tensor_slices(...).batch(n) or pass them "
            "to model.fit directly."
        )


def for_keras_inference() -> bool:
    """Whether Keras' `evaluate` or `predict` is asking (not `fit`).

    On a cluster, training batches are built on the workers and only tokens
    cross from the chief; evaluation and prediction run synchronously on the
    chief and need the batches themselves. Keras does not say which of its
    methods asks for a distributed dataset: `_tf_internal` finds out.
    """
    return _tf_internal.for_keras_inference()


def host_dataset(dataset: tf.data.Dataset, failed: tf.Variable) -> tf.data.Dataset:
    """The user's batches as the strategy feeds them: whole, on the host.

    Args:
        dataset: batches of the global batch size.
        failed: the strategy's failure flag; the data ends while it is set,
            so that a replica's error ends the epoch and is raised where the
            caller next reads the model (the epoch's end), not later.

    Returns:
        A `tf.data.Dataset` of the same elements.
    """
    check_dataset(dataset)
    return dataset.take_while(lambda *_: tf.logical_not(failed.read_value()))


def group_replica_batches(dataset: tf.data.Dataset, num_replicas: int) -> tf.data.Dataset:
    """Joins each run of `num_replicas` per-replica batches into one batch.

    A dataset function makes per-replica batches
    (`InputContext.get_per_replica_batch_size`); the strategy splits every
    batch it is fed into one shard per replica, so each group of
    `num_replicas` consecutive batches becomes one batch whose shards are
    those per-replica batches again (the last group may be smaller).
    """
    check_dataset(dataset)
    if num_replicas == 1:
        return dataset

    def join(*components):
        def merge(tensor):
            if isinstance(tensor, tf.RaggedTensor):
                return tensor.merge_dims(0, 1)
            return tf.reshape(tensor, tf.concat([[-1], tf.shape(tensor)[2:]], 0))

        joined = tf.nest.map_structure(merge, components)
        return joined if len(joined) > 1 else joined[0]

    return dataset.ragged_batch(num_replicas).map(join)
