"""A batch split into one shard per replica, as ops of Keras' graph.

Splitting in the graph costs one op per tensor, run by TensorFlow's executor
rather than by Python. `split_in_graph` gives the shards one by one;
`stack_in_graph` gives the same shards stacked in runs of equal size, which
go on the queue with one op per run (`feed.StepFeed`).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

__all__ = ["split_in_graph", "stack_in_graph", "stackable"]


def split_in_graph(tensors, replicas: int) -> list[list[tf.Tensor]]:
    """Splits a batch into one shard per replica, as ops of the caller's graph.

    Shards differ in size by at most one example; a batch smaller than the
    number of replicas leaves some shards empty. Tensors without a batch
    dimension (scalars) go whole to every shard. Splitting in the graph costs
    one op per tensor, run by TensorFlow's executor rather than by Python.
    """
    batched = [t for t in tensors if t.shape.rank != 0]
    if replicas == 1 or not batched:
        return [list(tensors)]
    examples = tf.shape(batched[0])[0]
    sizes = examples // replicas + tf.cast(tf.range(replicas) < examples % replicas, tf.int32)
    pieces = [
        tf.split(t, sizes, num=replicas) if t.shape.rank != 0 else [t] * replicas for t in tensors
    ]
    return [list(shard) for shard in zip(*pieces)]


def stackable(tensors) -> bool:
    """Whether a batch's shards may go on a queue stacked (`stack_in_graph`).

    Each shard of a stacked run must hold data: TensorFlow's `enqueue_many`
    does not take items with no elements. So there must be a batched tensor,
    every batched tensor needs a known rank and, past the batch dimension,
    sizes known when tracing and not zero, and the batch must not be known
    to hold no example (a token); such a batch is queued shard by shard.
    """
    batched = [t for t in tensors if t.shape.rank != 0]
    if not batched or batched[0].shape.rank is not None and batched[0].shape[0] == 0:
        return False
    return all(
        t.shape.rank is not None and all(d is not None and d > 0 for d in t.shape[1:])
        for t in batched
    )


def stack_in_graph(
    tensors, replicas: int, even: bool = False
) -> tuple[list[tuple[list[tf.Tensor], Any]], Any]:
    """A batch's shards stacked in runs: the shards `split_in_graph` gives.

    The first `examples % replicas` shards hold one example more than the
    others, so the batch is two runs of equal shards: each batched tensor
    splits in two, and each part becomes `[shards, examples per shard, ...]`
    (a scalar is repeated once per shard). Each run then goes on a queue
    with one `enqueue_many` rather than one enqueue per shard, and no
    conditional decides between even and uneven batches. Shards that would
    hold no example (a batch smaller than the replicas) are left out.

    Args:
        tensors: the batch's tensors (`stackable`).
        replicas: how many shards.
        even: the examples are known to divide evenly: one run.

    Returns:
        `(stacked tensors, shards in the run)` per run, and the shards in all.
    """
    batched = [t for t in tensors if t.shape.rank != 0]
    examples = tf.shape(batched[0])[0]
    per_shard, larger = examples // replicas, examples % replicas
    if even:
        runs = [(per_shard, replicas)]
        parts = [[t] for t in tensors]
    else:
        smaller = tf.where(per_shard > 0, replicas - larger, 0)
        runs = [(per_shard + 1, larger), (per_shard, smaller)]
        sizes = [size * count for size, count in runs]
        parts = [tf.split(t, sizes) if t.shape.rank != 0 else None for t in tensors]
    stacked = []
    for k, (size, count) in enumerate(runs):
        run = []
        for t, pieces in zip(tensors, parts):
            if t.shape.rank == 0:
                run.append(tf.fill([count], t))
            else:
                rest = tf.shape(pieces[k])[1:]
                run.append(tf.reshape(pieces[k], tf.concat([[count, size], rest], 0)))
        stacked.append((run, count))
    return stacked, (replicas if even else larger + smaller)
