"""The replica loop: shards reach the replicas through a TensorFlow queue.

Keras' graph splits each batch into one shard per replica and puts the shards
on a `tf.queue.FIFOQueue` with native ops. Each replica runs a *loop function*
that takes up to K shards from the queue in a `tf.while_loop`, applies each as
one replica step and counts it, all inside TensorFlow: Python calls a loop
once per K shards, not once per shard.

Nothing here holds one of TensorFlow's inter-op threads while it waits: a
queue's enqueue and dequeue are asynchronous kernels, which give their thread
back while the queue is full or empty.

Every shard that is put is counted (`progress[0]`), and every shard a loop
takes is counted once it is applied or dropped (`progress[1]`), so that the
caller can tell, with one read, what is still in flight. A STOP item (its
first component true) ends one loop; it is not counted. While a loop holds a
shard (taken, not yet counted), its replica's cell of `holding` is 1: when a
loop call fails, that says whether a shard went down with it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import tensorflow as tf

__all__ = ["ShardChannel", "drop_function", "loop_function"]

_PUT, _DONE = 0, 1


class ShardChannel:
    """The queue of one program's shards and its in-flight count.

    Args:
        specs: one `tf.TensorSpec` per tensor of a shard (batch dimension
            unknown).
        capacity: shards that may wait; a full queue holds the putting
            graph back (without holding a thread).
        device: where the queue and its counter live (the host CPU).
        name: a prefix for the queue's and the counter's names.
        replicas: how many replicas take from it.
    """

    def __init__(
        self,
        specs: Sequence[tf.TensorSpec],
        capacity: int,
        device: str,
        name: str,
        replicas: int = 1,
    ):
        self.specs = list(specs)
        self.device = device
        with tf.init_scope(), tf.device(device):
            self.queue = tf.queue.FIFOQueue(
                capacity,
                [tf.bool, *(spec.dtype for spec in self.specs)],
                shapes=None,
                name=f"{name}_shards",
            )
            self.progress = tf.Variable(
                tf.zeros([2], tf.int64), trainable=False, name=f"{name}_progress"
            )
            self.holding = tf.Variable(
                tf.zeros([replicas], tf.int64), trainable=False, name=f"{name}_holding"
            )

    # -- in graphs ------------------------------------------------------------

    def put(self, shards: Sequence[Sequence[tf.Tensor]]) -> tf.Operation:
        """Counts, then queues, shards (in the caller's graph)."""
        if not shards:
            return tf.no_op()
        # Counted from the shards' own sizes, so that a batch that never
        # arrives (the end of the data) is not counted as put.
        with tf.device(self.device):
            sizes = tf.stack([_examples(shard) for shard in shards])
            count = tf.reduce_sum(tf.cast(sizes >= 0, tf.int64))
            counted = self.progress.scatter_nd_add([[_PUT]], tf.reshape(count, [1]))
            stop = tf.constant(False)
            with tf.control_dependencies([counted]):
                return tf.group([self.queue.enqueue([stop, *shard]) for shard in shards])

    def take(self) -> tuple[tf.Tensor, list[tf.Tensor]]:
        """Takes the next item (blocks while there is none): (is STOP, shard)."""
        with tf.device(self.device):
            item = self.queue.dequeue()
        stop, shard = item[0], list(item[1:])
        stop.set_shape([])
        for tensor, spec in zip(shard, self.specs):
            tensor.set_shape(spec.shape)
        return stop, shard

    def hold(self, replica_id: tf.Tensor) -> tf.Operation:
        """Marks that the replica holds a shard it took."""
        with tf.device(self.device):
            return self.holding.scatter_nd_update(
                tf.reshape(replica_id, [1, 1]), tf.constant([1], tf.int64)
            )

    def done(self, replica_id: tf.Tensor | None = None) -> tf.Operation:
        """Counts one taken shard as applied or dropped (and no longer held)."""
        with tf.device(self.device):
            counted = self.progress.scatter_nd_add([[_DONE]], [tf.constant(1, tf.int64)])
            if replica_id is None:
                return counted
            with tf.control_dependencies([counted]):
                return self.holding.scatter_nd_update(
                    tf.reshape(replica_id, [1, 1]), tf.constant([0], tf.int64)
                )

    # -- from Python ----------------------------------------------------------

    def pending(self) -> int:
        """Shards put and not yet applied or dropped (one consistent read)."""
        put, done = self.progress.numpy()
        return int(put - done)

    def release(self, replica_id: int, requeue: bool) -> bool:
        """Lets go of the shard a failed loop call held, if it held one.

        Args:
            replica_id: the replica whose loop call failed.
            requeue: put it back on the queue as an empty shard (a token
                stands for a shard the taker reads itself, so another
                replica takes it instead); otherwise count it done.

        Returns:
            Whether the replica held a shard.
        """
        if not int(self.holding[replica_id]):
            return False
        self.holding.scatter_nd_update([[replica_id]], [0])
        if requeue:
            with tf.device(self.device):
                self.queue.enqueue([tf.constant(False), *self._empty()])
        else:
            self.progress.scatter_nd_add([[_DONE]], [1])
        return True

    def resync(self) -> None:
        """With no loop running and nothing queued: nothing is in flight."""
        if int(self.queue.size()) == 0:
            put, done = self.progress.numpy()
            if put != done:
                self.progress.assign([done, done])

    def send_stops(self, count: int) -> None:
        """Queues `count` STOP items, each with an empty shard."""
        empty = self._empty()
        with tf.device(self.device):
            for _ in range(count):
                self.queue.enqueue([tf.constant(True), *empty])

    def _empty(self) -> list[tf.Tensor]:
        return [
            tf.zeros([0 if d is None else d for d in spec.shape.as_list()], spec.dtype)
            if spec.shape.rank is not None
            else tf.zeros([0], spec.dtype)
            for spec in self.specs
        ]


def _examples(shard: Sequence[tf.Tensor]) -> tf.Tensor:
    for tensor in shard:
        if tensor.shape.rank:
            return tf.shape(tensor, out_type=tf.int64)[0]
    return tf.size(shard[0], out_type=tf.int64) if shard else tf.constant(1, tf.int64)


def loop_function(
    channel: ShardChannel,
    apply_shard: Callable[[tf.Tensor, list[tf.Tensor]], tf.Operation],
    skip: Callable[[list[tf.Tensor]], tf.Tensor],
    fetch: Callable[..., list[tf.Tensor]] | None = None,
) -> Callable[..., tuple[tf.Tensor, tf.Tensor]]:
    """A replica loop: take and apply up to `max_steps` shards, or a STOP.

    Args:
        channel: where the shards (or tokens) come from.
        apply_shard: `(replica_id, shard) -> op`, one replica step with its
            bookkeeping, in the loop's body.
        skip: `item -> bool tensor`, true for an item to drop unapplied
            (an empty shard, or anything after a replica failed).
        fetch: where items are tokens, `(token, *sources) -> shard`: the
            shard a token stands for, read from the loop's own sources (its
            worker's input iterator).

    Returns:
        `loop(replica_id, max_steps, *sources) -> (items taken, whether a
        STOP ended it)`, to be traced as a `tf.function`.
    """

    def loop(replica_id, max_steps, *sources):
        def cond(taken, stopped):
            return tf.logical_and(taken < max_steps, tf.logical_not(stopped))

        def body(taken, stopped):
            stop, item = channel.take()

            def apply():
                shard = fetch(item, *sources) if fetch is not None else item
                with tf.control_dependencies([apply_shard(replica_id, shard)]):
                    with tf.control_dependencies([channel.done(replica_id)]):
                        return tf.constant(True)

            def drop():
                with tf.control_dependencies([channel.done(replica_id)]):
                    return tf.constant(False)

            def take_item():
                with tf.control_dependencies([channel.hold(replica_id)]):
                    return tf.cond(skip(item), drop, apply)

            def end():
                return tf.constant(False)

            finished = tf.cond(stop, end, take_item)
            with tf.control_dependencies([finished]):
                return taken + tf.cast(tf.logical_not(stop), tf.int32), tf.identity(stop)

        return tf.while_loop(
            cond, body, [tf.constant(0, tf.int32), tf.constant(False)], parallel_iterations=1
        )

    return loop


def drop_function(channel: ShardChannel) -> Callable[[tf.Tensor], tuple[tf.Tensor, tf.Tensor]]:
    """A loop that only takes items and counts them dropped, on the queue's host.

    A replica that failed runs this instead of its own loop, which may need a
    task that is gone: the queue keeps draining, so that whatever feeds it
    never blocks, until a STOP ends it.

    Returns:
        `drop(max_steps) -> (items taken, whether a STOP ended it)`.
    """

    def drop(max_steps):
        def cond(taken, stopped):
            return tf.logical_and(taken < max_steps, tf.logical_not(stopped))

        def body(taken, stopped):
            stop, _ = channel.take()
            counted = tf.cond(
                stop,
                lambda: tf.constant(False),
                lambda: _after(channel.done(), tf.constant(True)),
            )
            with tf.control_dependencies([counted]):
                return taken + tf.cast(tf.logical_not(stop), tf.int32), tf.identity(stop)

        return tf.while_loop(
            cond, body, [tf.constant(0, tf.int32), tf.constant(False)], parallel_iterations=1
        )

    return drop


def _after(op, value):
    with tf.control_dependencies([op]):
        return tf.identity(value)
