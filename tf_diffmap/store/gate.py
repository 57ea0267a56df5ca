"""The gate of fresh windows: replicas in step with each other, never waiting past a patience.

Where the store takes its steps from *fresh* windows
(`Strategy(max_step_staleness=0)`, see `tf_diffmap.updates.aggregation`),
window v takes only gradients computed on the parameters of v optimizer
steps, so a replica whose gradient entered an open window has nothing
useful to compute until that window's step is applied: its next read would
see the same parameters, and its next gradient would land in the same
window. So it *owes a wait*: before its next read, it waits until the
window it pushed into is closed and its step applied. Replicas that keep
pace then stay in phase, one shard each per window, as under
`MirroredStrategy`, with no all-reduce and nothing wasted.

The gate holds what those waits need, beside the accumulators on the
store's host, under the accumulators' mutex:

- `windows`: windows taken so far, and `closed`: those whose step is
  applied. A replica reads `closed` before it reads the parameters; its
  push is accepted only if it equals `windows` then (no window was taken
  since, and none was half applied when it read).
- `owed`: per replica, 1 + the window it owes a wait for (0: none). A
  push owes a wait unless the window holds a push per present replica.
- `blocked`: replicas blocked now on `release`, a queue of tokens. Once a
  taken window's step is applied, the replica that applied it counts it
  closed and puts one token per blocked replica, under the mutex. A
  replica checks and registers under the mutex, and blocks outside it, in
  the queue's dequeue, which holds no thread: a registration comes either
  before a window's settling (and is let go by it) or after (and sees the
  window closed).
- `opened`: a queue of the windows opened (their number, the opening
  replica's read and push times), which the host's window timer
  (`tf_diffmap.engine.windows`) reads to close a window that waits past
  its patience.
- per replica, the seconds from its read to its push (an average), which
  the patience is derived from, and the seconds it spent waiting.

A replica that reads after a window was taken but before its step was
applied sees `closed` below `windows`: its gradient is refused (it is
stale by one step), so that a gradient of v never enters a later window;
and a replica waits until `closed` has passed the window it owes. The
tokens are shared: a replica that blocks in the moment between another's
registration and its dequeue may take the token put for the other, which
then waits for the next window; every token is taken by a blocked
replica, so none waits for ever.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import tensorflow as tf

__all__ = ["Gate", "SHARD_TIME_WEIGHT", "WindowStats"]

_names = itertools.count()

SHARD_TIME_WEIGHT = 0.25
"""The weight of a replica's latest read-to-push time in its running
average (an exponential moving average): a few windows follow a change of
pace, and one slow shard of a healthy replica moves its average by a quarter."""


class Gate:
    """The waits and counts of fresh windows (see the module's docstring).

    Args:
        host: the store's host, where every variable and queue lives but
            the timer's.
        replicas: replica slots.
        events_host: where the window timer's queue of windows opened
            lives: the client's host (by default `host`).
    """

    def __init__(self, host: str, replicas: int, events_host: str | None = None):
        self.host = host
        self.events_host = events_host or host
        self.replicas = replicas
        name = f"tf_diffmap_gate_{next(_names)}"
        with tf.init_scope(), tf.device(host):
            # The accumulators' mutex too: a push and a wait's registration
            # see one another whole.
            self.mutex = tf.raw_ops.MutexV2(shared_name=name)
            zeros = tf.zeros([replicas], tf.int64)
            seconds = tf.zeros([replicas], tf.float64)
            self.windows = tf.Variable(tf.constant(0, tf.int64), trainable=False, name=f"{name}_w")
            self.closed = tf.Variable(tf.constant(0, tf.int64), trainable=False, name=f"{name}_c")
            # The replica that took the window taken last (-1: none of them).
            self.taker = tf.Variable(tf.constant(-1, tf.int64), trainable=False, name=f"{name}_tk")
            self.owed = tf.Variable(zeros, trainable=False, name=f"{name}_owed")
            # Per replica, its pushes that came after their window was
            # taken (not those a rule dropped): their shards may be requeued.
            self.late_pushes = tf.Variable(zeros, trainable=False, name=f"{name}_late")
            self.blocked = tf.Variable(tf.constant(0, tf.int64), trainable=False, name=f"{name}_b")
            # Replicas present (not absent, lost or hung), as the window
            # timer last saw them: once that many pushes are in a window, a
            # push owes no wait (a lost replica's shards are the others' to
            # push, and nobody else would come to fill the window).
            self.present = tf.Variable(
                tf.constant(replicas, tf.int64), trainable=False, name=f"{name}_p"
            )
            self.release = tf.queue.FIFOQueue(-1, [tf.int64], shapes=[[]], name=f"{name}_release")
            self.shard_seconds = tf.Variable(seconds, trainable=False, name=f"{name}_shard_s")
            self.timed_pushes = tf.Variable(zeros, trainable=False, name=f"{name}_timed")
            self.waited_seconds = tf.Variable(seconds, trainable=False, name=f"{name}_waited_s")
            self.longest_wait = tf.Variable(seconds, trainable=False, name=f"{name}_longest_s")
            # Windows the timer closed short, and times it released waiting
            # replicas to fill a window instead; the examples of every step.
            self.closed_short = tf.Variable(tf.constant(0, tf.int64), trainable=False)
            self.fills = tf.Variable(tf.constant(0, tf.int64), trainable=False)
            self.step_examples = tf.Variable(tf.constant(0.0, tf.float64), trainable=False)
            self.skipped_examples = tf.Variable(tf.constant(0.0, tf.float64), trainable=False)
            # Of those, the examples whose shard went back on the queue.
            self.requeued_examples = tf.Variable(tf.constant(0.0, tf.float64), trainable=False)
            # The examples of a full window: the largest batch queued so far
            # (0: unknown, and a window is full at one push per replica slot).
            self.target = tf.Variable(tf.constant(0, tf.int64), trainable=False, name=f"{name}_t")
        with tf.init_scope(), tf.device(self.events_host):
            # Beside the window timer, which blocks in its dequeue: a
            # blocking eager op on the store's host would hold the client's
            # stream of requests to it (ordered, while a worker is lost).
            # Each window opened: its number, its opener's read and push
            # times, and every replica's read-to-push time then (the
            # timer's patience, read with the push, not by a call of its
            # own).
            self.opened = tf.queue.FIFOQueue(
                -1,
                [tf.int64, tf.float64, tf.float64, tf.float64],
                shapes=[[], [], [], [replicas]],
                name=f"{name}_opened",
            )

    # -- in a replica's graph, before its read ----------------------------------

    def register(self, replica_id: tf.Tensor) -> tf.Tensor:
        """Under the mutex: whether the replica must block now (the window
        it owes a wait for is still open); clears what it owes, and counts
        it blocked if it must."""
        with tf.device(self.host):
            row = tf.reshape(tf.cast(replica_id, tf.int64), [1, 1])
            owed = tf.gather(self.owed.read_value(), tf.cast(replica_id, tf.int64))
            must = tf.logical_and(owed > 0, self.closed.read_value() < owed)
            with tf.control_dependencies([owed, must]):
                cleared = self.owed.scatter_nd_update(row, tf.zeros([1], tf.int64))
                counted = self.blocked.assign_add(tf.cast(must, tf.int64), read_value=False)
            with tf.control_dependencies([cleared, counted]):
                return tf.identity(must)

    def block(self, replica_id: tf.Tensor, must: tf.Tensor) -> tf.Tensor:
        """Outside the mutex: waits for a token if `must`, and adds the time
        waited to the replica's; returns when it may read."""
        with tf.device(self.host):
            start = tf.timestamp()

            def wait():
                with tf.control_dependencies([start]):
                    token = self.release.dequeue()
                with tf.control_dependencies([token]):
                    return tf.timestamp() - start

            waited = tf.cond(must, wait, lambda: tf.constant(0.0, tf.float64))
            row = tf.reshape(tf.cast(replica_id, tf.int64), [1, 1])
            waited = tf.reshape(waited, [1])
            return tf.group(
                self.waited_seconds.scatter_nd_add(row, waited),
                self.longest_wait.scatter_nd_max(row, waited),
            )

    # -- in a push, under the mutex ---------------------------------------------

    def owe(self, replica_id: tf.Tensor, window: tf.Tensor) -> tf.Operation:
        """The replica owes a wait for `window` (it pushed into it, open)."""
        with tf.device(self.host):
            row = tf.reshape(tf.cast(replica_id, tf.int64), [1, 1])
            return self.owed.scatter_nd_update(row, tf.reshape(window + 1, [1])).op

    def open(self, window: tf.Tensor, read_time: tf.Tensor, seconds: tf.Tensor) -> tf.Operation:
        """Tells the timer that `window` opened, read at `read_time`, with
        the replicas' read-to-push times `seconds` (after the push's mutex
        is released: nothing under it waits for another task)."""
        with tf.device(self.events_host):
            return self.opened.enqueue(
                [window, tf.cast(read_time, tf.float64), tf.timestamp(), seconds]
            )

    def stop_event(self) -> list:
        """What the timer's reader takes as its signal to end."""
        return [np.int64(-1), 0.0, 0.0, np.zeros([self.replicas], np.float64)]

    def take(self, taker: tf.Tensor) -> tf.Tensor:
        """A window is taken by replica `taker` (-1: the timer or a drain):
        counts it; returns its number."""
        with tf.device(self.host):
            window = self.windows.read_value()
            with tf.control_dependencies([window]):
                counted = [
                    self.windows.assign_add(1, read_value=False),
                    self.taker.assign(tf.cast(taker, tf.int64), read_value=False),
                ]
            with tf.control_dependencies(counted):
                return tf.identity(window)

    def unblock(self, count: tf.Tensor) -> tf.Tensor:
        """Under the mutex: lets up to `count` blocked replicas go (a fill:
        they compute gradients of the same parameters); returns how many."""
        with tf.device(self.host):
            blocked = self.blocked.read_value()
            released = tf.minimum(blocked, tf.maximum(count, 0))
            with tf.control_dependencies([blocked]):
                updated = self.blocked.assign_sub(released, read_value=False)
            with tf.control_dependencies([updated]):
                let_go = self._let_go(released)
            with tf.control_dependencies([let_go]):
                return tf.identity(released)

    # -- after a step ------------------------------------------------------------

    def read_closed(self) -> tf.Tensor:
        """Windows whose step is applied (in a replica's graph, before its
        read of the parameters): a push is fresh if no window was taken
        since."""
        with tf.device(self.host):
            return self.closed.read_value()

    def settle(self, number: tf.Tensor) -> tf.Tensor:
        """Under the mutex, once window `number`'s step is applied: counts it
        closed, and lets every replica blocked on it go (each replica that
        registered before this, so none waits for a window closed). Settling
        a window twice changes nothing more (see `settle_cut_off`)."""
        with tf.device(self.host):
            blocked = self.blocked.read_value()
            closed = tf.maximum(self.closed.read_value(), number + 1)
            with tf.control_dependencies([blocked, closed]):
                updates = [
                    self.blocked.assign(tf.constant(0, tf.int64), read_value=False),
                    self.closed.assign(closed, read_value=False),
                ]
            with tf.control_dependencies(updates):
                let_go = self._let_go(blocked)
            with tf.control_dependencies([let_go]):
                return tf.identity(blocked)

    def settle_cut_off(self, replica_id: tf.Tensor) -> tf.Tensor:
        """Under the mutex: if the window taken last is not settled and
        replica `replica_id` took it, settles it (its replica's call was cut
        off before it could; the window's step may not have been applied).
        Windows are taken one at a time (the next takes only pushes read
        after this one settled), so no other replica can settle it."""
        with tf.device(self.host):
            windows = self.windows.read_value()
            stuck = tf.logical_and(
                self.closed.read_value() < windows,
                tf.equal(self.taker.read_value(), tf.cast(replica_id, tf.int64)),
            )
            return tf.cond(stuck, lambda: self.settle(windows - 1) >= 0, lambda: tf.constant(False))

    def _let_go(self, tokens: tf.Tensor) -> tf.Operation:
        """Puts `tokens` tokens on the release queue (unbounded: it never
        waits, under the mutex)."""
        return self.release.enqueue_many([tf.zeros(tf.reshape(tokens, [1]), tf.int64)])

    def timed(self, replica_id: tf.Tensor, read_time: tf.Tensor) -> tf.Operation:
        """Adds a push's read-to-push time to the replica's average. A
        replica's first time stands until its second replaces it: its step
        ran for the first time (the runtime prepares a function at its first
        call), a time that errs long, where the patience is safe."""
        with tf.device(self.host):
            elapsed = tf.timestamp() - tf.cast(read_time, tf.float64)
            index = tf.cast(replica_id, tf.int64)
            cell = tf.reshape(index, [1, 1])
            before = tf.gather(self.shard_seconds.read_value(), index)
            seen = tf.gather(self.timed_pushes.read_value(), index)
            after = tf.where(seen > 1, before + SHARD_TIME_WEIGHT * (elapsed - before), elapsed)
            with tf.control_dependencies([before, seen]):
                return tf.group(
                    self.shard_seconds.scatter_nd_update(cell, tf.reshape(after, [1])),
                    self.timed_pushes.scatter_nd_add(cell, tf.ones([1], tf.int64)),
                )

    def late_of(self, replica_id: tf.Tensor) -> tf.Tensor:
        """The replica's pushes so far that came after their window was
        taken (in a graph)."""
        with tf.device(self.host):
            return tf.gather(self.late_pushes.read_value(), tf.cast(replica_id, tf.int64))

    def requeued(self, examples: tf.Tensor) -> tf.Operation:
        """Counts the examples of a dropped shard put back on the queue:
        they will be trained on, not skipped."""
        with tf.device(self.host):
            return self.requeued_examples.assign_add(
                tf.cast(examples, tf.float64), read_value=False
            )

    def set_target(self, examples: tf.Tensor) -> tf.Operation:
        """The examples of a full window: at least `examples` (a batch's)."""
        # Batches are queued one after another, by Keras' step: no two
        # writes race.
        with tf.device(self.host):
            examples = tf.cast(examples, tf.int64)
            return self.target.assign(tf.maximum(self.target.read_value(), examples)).op

    # -- from Python ---------------------------------------------------------------

    def statistics(self, patience: float | None = None) -> WindowStats:
        """The gate's counts and times, read now (a snapshot).

        Args:
            patience: the patience the window timer used last, if any.
        """
        windows = int(self.windows.numpy())
        return WindowStats(
            windows=windows,
            closed_short=int(self.closed_short.numpy()),
            fills=int(self.fills.numpy()),
            examples=float(self.step_examples.numpy()),
            skipped=float(self.skipped_examples.numpy() - self.requeued_examples.numpy()),
            requeued=float(self.requeued_examples.numpy()),
            shard_seconds=self.shard_seconds.numpy().copy(),
            seconds_waiting=self.waited_seconds.numpy().copy(),
            longest_wait=self.longest_wait.numpy().copy(),
            patience=patience,
        )

    def reset(self) -> None:
        """Zeroes the counts and times (not the windows' numbering)."""
        for variable in (
            self.closed_short,
            self.fills,
            self.step_examples,
            self.skipped_examples,
            self.requeued_examples,
            self.waited_seconds,
            self.longest_wait,
        ):
            variable.assign(tf.zeros_like(variable))


@dataclasses.dataclass(frozen=True)
class WindowStats:
    """What an optimizer's windows did, at one moment (`Strategy.window_statistics`).

    Attributes:
        windows: windows taken, each one optimizer step (a window taken
            with no accepted gradient takes no step).
        closed_short: windows the timer closed before their examples made a
            global batch, once their patience ran out.
        fills: times the timer let waiting replicas go to fill a window.
        examples: the examples of every window taken, in all.
        skipped: the examples of gradients not accepted (too stale), in
            all, less those requeued: every example a replica read is
            trained on, requeued, or counted here.
        shard_seconds: per replica, its average time from a read of the
            parameters to the push of its gradient.
        seconds_waiting: per replica, the time it waited for windows to
            close (fresh windows only).
        longest_wait: per replica, its longest single wait.
        patience: the patience the timer used for its latest window, in
            seconds (None: no timer, or no window timed yet).
        requeued: the examples of gradients not accepted whose shards went
            back on the queue, for another replica (`late_shards="requeue"`).

    Examples:
        >>> import numpy as np, tf_diffmap
        >>> stats = tf_diffmap.WindowStats(
        ...     windows=4,
        ...     closed_short=1,
        ...     fills=0,
        ...     examples=120.0,
        ...     skipped=8.0,
        ...     shard_seconds=np.array([0.002, 0.003]),
        ...     seconds_waiting=np.array([0.01, 0.0]),
        ...     longest_wait=np.array([0.004, 0.0]),
        ...     patience=0.005,
        ... )
        >>> stats.examples_per_step
        30.0
        >>> print(stats)
        4 windows, 30.0 examples each; 1 closed short, 0 filled, patience 5.0 ms; 8 examples skipped
          replica 0: shard 2.0 ms, waited 0.01 s (longest 4.0 ms)
          replica 1: shard 3.0 ms, waited 0.00 s (longest 0.0 ms)
    """

    windows: int
    closed_short: int
    fills: int
    examples: float
    skipped: float
    shard_seconds: np.ndarray
    seconds_waiting: np.ndarray
    longest_wait: np.ndarray
    patience: float | None = None
    requeued: float = 0.0

    @property
    def examples_per_step(self) -> float:
        """The mean examples of a window (0 before the first)."""
        return self.examples / self.windows if self.windows else 0.0

    def __str__(self) -> str:
        patience = "" if self.patience is None else f", patience {self.patience * 1e3:.1f} ms"
        lines = [
            f"{self.windows} windows, {self.examples_per_step:.1f} examples each; "
            f"{self.closed_short} closed short, {self.fills} filled{patience}; "
            f"{self.skipped:.0f} examples skipped"
            + (f", {self.requeued:.0f} requeued" if self.requeued else "")
        ]
        for r, (shard, waiting, longest) in enumerate(
            zip(self.shard_seconds, self.seconds_waiting, self.longest_wait)
        ):
            lines.append(
                f"  replica {r}: shard {shard * 1e3:.1f} ms, waited {waiting:.2f} s "
                f"(longest {longest * 1e3:.1f} ms)"
            )
        return "\n".join(lines)
