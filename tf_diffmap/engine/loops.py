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
shard (taken, not yet counted), its replica's cell of `holding` is the step
count its replica reaches once that shard's step completes: when a loop call
fails, that says whether a shard went down with it, and whether its step
had completed all the same (`HeldShard`).

A replica's cell of `fences` set keeps its loop from taking anything more: a
loop reads it before each take, and gives back, untouched, an item it took
while fenced. The caller fences a replica whose call hangs (`ReplicaLoops`):
the call may finish the shard it holds, if it ever answers, and then ends.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

__all__ = ["HeldShard", "Late", "ShardChannel", "drop_function", "held_shard", "loop_function"]

_PUT, _DONE = 0, 1


class HeldShard(enum.Enum):
    """What becomes of the shard a loop call held when the call failed.

    A shard's life: QUEUED (put, not taken), then held by a loop call, which
    applies it (its step completes) or drops it, then counts it done. When
    the call fails in between, the shard becomes, once, one of:

    - APPLIED: its step completed; only its count was cut off. Counted done,
      never run again.
    - ABANDONED: its step had marked its claim and did not complete: it may
      have written part of its update. Counted done and never run again; its
      claim is abandoned (`ParameterStore.settle_abandoned`).
    - REQUEUED: cut off before its mark, so nothing of it reached the
      variables; a token goes back on the queue, for a live replica.
    - DROPPED: cut off before its mark, but it cannot run again (a real
      shard whose data went down with the call, or a replica that failed).
      Counted done.

    `held_shard` is the one place that decides.
    """

    APPLIED = "applied"
    ABANDONED = "abandoned"
    REQUEUED = "requeued"
    DROPPED = "dropped"


def held_shard(completed: bool, marked: Callable[[], bool], may_requeue: bool) -> HeldShard:
    """The fate of a shard whose loop call failed while holding it.

    Args:
        completed: whether its step was counted completed.
        marked: whether its step had marked its claim (asked only when the
            step did not complete, and only once).
        may_requeue: whether the shard can run again on another replica.
    """
    if completed:
        return HeldShard.APPLIED
    if marked():
        return HeldShard.ABANDONED
    return HeldShard.REQUEUED if may_requeue else HeldShard.DROPPED


class ShardChannel:
    """The queue of one training step's shards and its in-flight count.

    Args:
        specs: one `tf.TensorSpec` per tensor of a shard (batch dimension
            unknown).
        capacity: shards that may wait; a full queue holds the putting
            graph back (without holding a thread). It holds at least one
            step's shards (`replicas`), so that a step that put its shards
            just as the loops stopped idle never waits for them
            (`feed.StepFeed.stop_if_idle`).
        device: where the queue lives (the host CPU of Keras' graph).
        name: a prefix for the queue's and the counter's names.
        counter_device: where the in-flight counter lives (by default
            beside the queue, where Keras' graph counts what it puts: that
            graph then touches no other task, so a lost task is met first by
            the replicas' loops, whose errors the strategy classifies).
        replicas: how many replicas take from it.
    """

    def __init__(
        self,
        specs: Sequence[tf.TensorSpec],
        capacity: int,
        device: str,
        name: str,
        counter_device: str | None = None,
        replicas: int = 1,
    ):
        self.specs = list(specs)
        self.device = device
        self.counter_device = counter_device or device
        with tf.init_scope(), tf.device(device):
            self.queue = tf.queue.FIFOQueue(
                max(capacity, replicas),
                [tf.bool, *(spec.dtype for spec in self.specs)],
                shapes=None,
                name=f"{name}_shards",
            )
        with tf.init_scope(), tf.device(self.counter_device):
            self.progress = tf.Variable(
                tf.zeros([2], tf.int64), trainable=False, name=f"{name}_progress"
            )
            self.holding = tf.Variable(
                tf.zeros([replicas], tf.int64), trainable=False, name=f"{name}_holding"
            )
            self.fences = tf.Variable(
                tf.zeros([replicas], tf.bool), trainable=False, name=f"{name}_fences"
            )

    # -- in graphs ------------------------------------------------------------

    def put(self, shards: Sequence[Sequence[tf.Tensor]]) -> tf.Operation:
        """Queues shards, then counts them (in the caller's graph).

        Counted after they are queued: where a batch never arrives (at the
        end of the data Keras' `get_next` fails) nothing is counted, however
        the graph optimizer folds the batch's shape ops. A loop may count a
        shard done a moment before it is counted put; the caller reads what
        is in flight only after its step has returned.
        """
        if not shards:
            return tf.no_op()
        with tf.device(self.device):
            stop = tf.constant(False)
            queued = [self.queue.enqueue([stop, *shard]) for shard in shards]
        return self._count_put(queued, len(shards))

    def put_stacked(
        self, runs: Sequence[tuple[Sequence[tf.Tensor], Any]], count: Any
    ) -> tf.Operation:
        """Queues runs of shards, each stacked along a first dimension and
        queued with one op, then counts the `count` shards they hold (as
        `put` does).

        Args:
            runs: `(stacked tensors, shards in the run)` per run.
            count: the shards in all runs (an int or a scalar tensor).
        """
        with tf.device(self.device):
            queued = [
                self.queue.enqueue_many([tf.zeros([shards], tf.bool), *stacked])
                for stacked, shards in runs
            ]
        return self._count_put(queued, count)

    def _count_put(self, queued: list[tf.Operation], count: Any) -> tf.Operation:
        with tf.control_dependencies(queued), tf.device(self.counter_device):
            counted = tf.reshape(tf.cast(count, tf.int64), [1])
            return self.progress.scatter_nd_add([[_PUT]], counted).op

    def take(self) -> tuple[tf.Tensor, list[tf.Tensor]]:
        """Takes the next item (blocks while there is none): (is STOP, shard)."""
        with tf.device(self.device):
            item = self.queue.dequeue()
        stop, shard = item[0], list(item[1:])
        stop.set_shape([])
        for tensor, spec in zip(shard, self.specs):
            tensor.set_shape(spec.shape)
        return stop, shard

    def hold(self, replica_id: tf.Tensor, stamp: tf.Tensor) -> tf.Operation:
        """Marks that the replica holds a shard it took, or, with 0, none.

        Args:
            replica_id: the replica.
            stamp: the replica's completed steps once this shard's step
                completes (its steps so far plus one), or 0.
        """
        with tf.device(self.counter_device):
            return self.holding.scatter_nd_update(
                tf.reshape(replica_id, [1, 1]), tf.reshape(tf.cast(stamp, tf.int64), [1])
            )

    def fenced(self, replica_id: tf.Tensor) -> tf.Tensor:
        """Whether the replica is fenced off the queue (in a graph)."""
        with tf.device(self.counter_device):
            return self.fences.sparse_read(replica_id)

    def put_back(self, item: Sequence[tf.Tensor]) -> tf.Operation:
        """Queues a shard that was taken again, counted as put once more (in
        a graph): its taker counts it done as well, so that nothing drains
        before another replica has applied it."""
        with tf.device(self.device):
            queued = self.queue.enqueue([tf.constant(False), *item])
        return self._count_put([queued], 1)

    def give_back(self, replica_id: tf.Tensor, item: Sequence[tf.Tensor]) -> tf.Operation:
        """Puts an item a fenced replica took back on the queue, uncounted."""
        with tf.device(self.device):
            queued = self.queue.enqueue(list(item))
        with tf.control_dependencies([queued]):
            return self.hold(replica_id, tf.constant(0, tf.int64))

    def done(self, replica_id: tf.Tensor | None = None) -> tf.Operation:
        """Counts one taken shard as applied or dropped (and no longer held)."""
        with tf.device(self.counter_device):
            counted = self.progress.scatter_nd_add([[_DONE]], [tf.constant(1, tf.int64)])
            if replica_id is None:
                return counted
            with tf.control_dependencies([counted]):
                return self.hold(replica_id, tf.constant(0, tf.int64))

    def pass_by(self, replica_id: tf.Tensor, counted: tf.Tensor) -> tf.Operation:
        """Lets go of a taken item unapplied: counted done if `counted` (a
        shard), not at all otherwise (a STOP)."""
        with tf.device(self.counter_device):
            counts = self.progress.scatter_nd_add(
                [[_DONE]], tf.reshape(tf.cast(counted, tf.int64), [1])
            )
            with tf.control_dependencies([counts]):
                return self.hold(replica_id, tf.constant(0, tf.int64))

    # -- from Python ----------------------------------------------------------

    def pending(self, excused: int = 0) -> int:
        """Shards put and not yet applied or dropped (one consistent read),
        less `excused`: shards held by fenced calls, which nobody waits for."""
        put, done = self.counts()
        return max(put - done - excused, 0)

    def counts(self) -> tuple[int, int]:
        """Shards put and shards done so far (one consistent read)."""
        put, done = self.progress.numpy()
        return int(put), int(done)

    def settled(self, excused: tf.Tensor) -> tf.Tensor:
        """Whether every shard put has been applied or dropped, but for
        `excused` ones held by fenced calls (in a graph)."""
        with tf.device(self.counter_device):
            counts = self.progress.read_value()
            return counts[_PUT] - counts[_DONE] <= excused

    def held(self, replica_id: int) -> int:
        """The stamp of the shard a replica's failed loop call held (0: none)."""
        return int(self.holding[replica_id])

    def stamps(self) -> list[int]:
        """Each replica's stamp of the shard it holds now (0: none)."""
        return [int(s) for s in self.holding.numpy()]

    def fence(self, replica_ids: Sequence[int], fenced: bool) -> None:
        """Fences replicas off the queue, or lets them take again."""
        if replica_ids:
            indices = [[r] for r in replica_ids]
            self.fences.scatter_nd_update(indices, [fenced] * len(replica_ids))

    def release(self, replica_id: int, requeue: bool) -> None:
        """Lets go of the shard a failed loop call held.

        Args:
            replica_id: the replica whose loop call failed.
            requeue: put it back on the queue as an empty shard (a token
                stands for a shard the taker reads itself, so another
                replica takes it instead); otherwise count it done.
        """
        self.holding.scatter_nd_update([[replica_id]], [0])
        if requeue:
            self._enqueue_empty(stop=False)
        else:
            self.progress.scatter_nd_add([[_DONE]], [1])

    def resync(self, excused: int = 0) -> None:
        """With no loop running and nothing queued: nothing is in flight but
        the `excused` shards that fenced calls hold."""
        if int(self.queue.size()) == 0:
            put, done = self.progress.numpy()
            if put != done + excused:
                self.progress.assign([done + excused, done])

    def send_stops(self, count: int) -> None:
        """Queues `count` STOP items, each with an empty shard."""
        for _ in range(count):
            self._enqueue_empty(stop=True)

    def _enqueue_empty(self, stop: bool) -> None:
        with tf.device(self.device):
            self.queue.enqueue([tf.constant(stop), *self._empty()])

    def prepare(self) -> None:
        """Runs once, with no effect, each eager op of `held`, `release`,
        `counts`, `stamps`, `fence`, `resync` and `send_stops`, while every
        task serves.

        The eager context runs an eager op as a function of its own, one
        per op type and device, and sends that function to every remote
        task the first time the op runs. Run first after a worker was lost
        (these run when a loop call fails), each such op makes the runtime
        log a "Failed to register function remotely" error for that worker;
        run first while a worker is paused (a hung worker's watch), it waits
        for that worker. Run here, before any loop starts, they are known to
        every task already. Call only while no loop runs and nothing is
        queued.
        """
        self.held(0)
        self.counts()
        self.stamps()
        self.fence([0], False)
        self.resync()
        self.holding.scatter_nd_update([[0]], [0])  # 0 already: no loop holds a shard
        self.progress.scatter_nd_add([[_DONE]], [0])
        self._enqueue_empty(stop=True)
        with tf.device(self.device):
            self.queue.dequeue()  # The queue is as it was: empty.

    def _empty(self) -> list[tf.Tensor]:
        return [
            tf.zeros([0 if d is None else d for d in spec.shape.as_list()], spec.dtype)
            if spec.shape.rank is not None
            else tf.zeros([0], spec.dtype)
            for spec in self.specs
        ]


def loop_function(
    channel: ShardChannel,
    apply_shard: Callable[[tf.Tensor, list[tf.Tensor], tf.Tensor], tf.Tensor],
    skip: Callable[[list[tf.Tensor], tf.Tensor], tf.Tensor],
    start: Callable[[tf.Tensor], tuple[tf.Tensor, tf.Tensor]],
    stamp: Callable[[tf.Tensor], tf.Tensor],
    fetch: Callable[..., list[tf.Tensor]] | None = None,
    before_take: Callable[[tf.Tensor], list] | None = None,
    late: Late | None = None,
) -> Callable[..., tuple[tf.Tensor, tf.Tensor]]:
    """A replica loop: take and apply up to `max_steps` shards, or a STOP.

    Args:
        channel: where the shards (or tokens) come from.
        apply_shard: `(replica_id, shard, claims) -> claims`, one replica
            step with its bookkeeping, given the claims the replica had made
            before it and returning those after it.
        skip: `(item, failed) -> bool tensor`, true for an item to drop
            unapplied (an empty shard, or anything once a replica failed).
        start: `replica_id -> (claims, failed)`, read once per call: the
            replica's claims so far (only its own loop adds to them while it
            runs) and the strategy's failure flag (seen again at the next
            call, at most K shards later).
        stamp: `replica_id -> int64`, the replica's completed steps plus
            one, read as it takes a shard (see `ShardChannel.hold`).
        fetch: where items are tokens, `(token, *sources) -> shard`: the
            shard a token stands for, read from the loop's own sources (its
            worker's input iterator).
        before_take: `replica_id -> ops` that each take waits for (a fresh
            window's wait, `tf_diffmap.store.gate`).
        late: what tells a shard whose gradient came too late for its fresh
            window, and puts it back on the queue (`Late`); None: such a
            shard's examples are skipped.

    Returns:
        `loop(replica, max_steps, *sources) -> (items taken, whether a STOP
        ended it)`, to be traced as a `tf.function`. `replica` is the
        replica's id: an int makes it a constant of the traced loop, so that
        TensorFlow folds what is computed from it (its counters' cells) once,
        when it optimizes the function, and the loop carries one value fewer;
        an int32 scalar argument lets the replicas of one device share one
        loop function.
    """

    def loop(replica, max_steps, *sources):
        def replica_id():
            # An int is made a constant where it is used, not captured from
            # outside: not one more value a loop or a branch carries.
            return tf.constant(replica, tf.int32) if isinstance(replica, int) else replica

        claims_before, failed = start(replica_id())

        # Each iteration takes one item, and a STOP ends the loop, as does a
        # fence: at most `max_steps` iterations take at most `max_steps`
        # shards. The bound is the loop's own counter, not one more value
        # carried through it.
        def cond(taken, stopped, claims):
            return tf.logical_not(tf.logical_or(stopped, channel.fenced(replica_id())))

        def body(taken, stopped, claims):
            waits = before_take(replica_id()) if before_take is not None else []
            with tf.control_dependencies(waits):
                stop, item = channel.take()
            # Read once the item is taken: a fence set while the take waited
            # (for a queue that was empty) gives the item back.
            with tf.control_dependencies([stop]):
                fenced = channel.fenced(replica_id())
            # One conditional per item: a shard either runs or is passed
            # by, a STOP is passed by uncounted, and a fenced replica gives
            # back what it took. A STOP's stamp is 0, which its replica's
            # cell of `holding` already reads.
            passes = tf.logical_or(stop, fenced)
            runs = tf.logical_not(tf.logical_or(passes, skip(item, failed)))
            stamped = tf.where(
                passes, tf.constant(0, tf.int64), tf.cast(stamp(replica_id()), tf.int64)
            )

            def apply():
                shard = fetch(item, *sources) if fetch is not None else item
                if late is None:
                    after = apply_shard(replica_id(), shard, claims)
                    ops = [after]
                else:
                    mark = late.before(replica_id())
                    with tf.control_dependencies([mark]):
                        after = apply_shard(replica_id(), shard, claims)
                    with tf.control_dependencies([after]):
                        ops = [after, late.after(replica_id(), shard, mark, channel)]
                with tf.control_dependencies(ops):
                    with tf.control_dependencies([channel.done(replica_id())]):
                        return tf.identity(after)

            def pass_by():
                passed = channel.pass_by(replica_id(), tf.logical_not(stop))
                with tf.control_dependencies([passed]):
                    return tf.identity(claims)

            def give_back():
                given = channel.give_back(replica_id(), [stop, *item])
                with tf.control_dependencies([given]):
                    return tf.identity(claims)

            def let_go():
                return tf.cond(fenced, give_back, pass_by)

            with tf.control_dependencies([channel.hold(replica_id(), stamped)]):
                claims_after = tf.cond(runs, apply, let_go)
            kept = tf.logical_not(passes)
            return (
                taken + tf.cast(kept, tf.int32),
                tf.logical_and(stop, tf.logical_not(fenced)),
                claims_after,
            )

        taken, stopped, _ = tf.while_loop(
            cond,
            body,
            [tf.constant(0, tf.int32), tf.constant(False), claims_before],
            parallel_iterations=1,
            maximum_iterations=max_steps,
        )
        return taken, stopped

    return loop


class Late:
    """Puts a shard back on the queue when its gradient came too late.

    Under fresh windows a replica's gradient is dropped when a window was
    taken between its read and its push (it ran past the window's
    patience); the shard's examples then go back on the queue for another
    replica, rather than being skipped. Only on one host, where a queued
    item is the shard itself (on a cluster it is a token, which stands for
    whichever shard its taker's input yields next).

    Args:
        late_of: `replica_id -> int64`, the replica's pushes so far that
            came after their window was taken (`Gate.late_of`; a push a
            staleness rule dropped is not one: its shard would be dropped
            again).
        requeued: `examples -> op`, which counts the shard's examples as
            requeued (`Gate.requeued`).
        examples: `shard -> int64 scalar`, the examples of a shard (None
            where it has no batched tensor).
    """

    def __init__(self, late_of, requeued, examples):
        self._late_of = late_of
        self._requeued = requeued
        self._examples = examples

    def before(self, replica_id: tf.Tensor) -> tf.Tensor:
        return self._late_of(replica_id)

    def after(
        self, replica_id: tf.Tensor, shard: list[tf.Tensor], before: tf.Tensor, channel
    ) -> tf.Tensor:
        late = self._late_of(replica_id) > before

        def put_back():
            examples = self._examples(shard)
            counted = [] if examples is None else [self._requeued(examples)]
            with tf.control_dependencies([channel.put_back(shard), *counted]):
                return tf.constant(True)

        return tf.cond(late, put_back, lambda: tf.constant(False))


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
