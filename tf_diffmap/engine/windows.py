"""The window timer: a fresh window never waits on a slow replica past its patience.

Where windows are fresh (`Strategy(max_step_staleness=0)`, see
`tf_diffmap.store.gate`), replicas that pushed into an open window wait, in
a TensorFlow queue's dequeue, until it closes. TensorFlow's queue ops have
no timeout that works, so one thread on the host per aggregation keeps the
time: the push that opens a window tells it (the gate's `opened` queue;
where a call was cut off or replicas were lost, the runtime has it look:
`WindowTimer.recheck`), and if the window is still open when its patience
has run out, the timer either closes it short (a step on the gradients that
came, weighted by their examples: backup replicas) or fills it (lets as
many blocked replicas go as the window lacks shards, to compute fresh
gradients of the same parameters in their place). A straggler's gradient then arrives stale: it
is dropped and counted, and its examples are counted as skipped.

The patience comes from the replicas' own pace: a window opens when its
fastest replica pushes; it would close, were every replica as fast as the
median one, at the median of the replicas' read-to-push times after the
opener's read. The patience is that median times `1 + margin`, measured
from the opener's read. No constant in seconds: the margin is a fraction of
the replicas' own shard time, so the same margin holds for a model whose
shard takes a millisecond and one whose shard takes a second.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable

import numpy as np

from tf_diffmap.updates.aggregation import Aggregation

__all__ = [
    "LATE_SHARDS",
    "LATE_SHARD_POLICIES",
    "LATE_WINDOW",
    "LATE_WINDOW_POLICIES",
    "PATIENCE_MARGIN",
    "WindowTimer",
]

logger = logging.getLogger("tf_diffmap")

LATE_WINDOW_POLICIES = ("close", "fill")
"""What the timer does with a window open past its patience: `"close"` it
short, or `"fill"` it with gradients of replicas that wait."""

LATE_WINDOW = "fill"
"""The default of `Strategy(late_window=...)`. Chosen on the tuning half of
the held-out grid (`benchmarks.grid`, 32 conditions, seed 0, 2026-12-06),
between closing short and filling: against synchronous training, filling
had a median gap of -0.1 points where it reaches 0.5 (closing: -1.0), a
worst gap of -10.0 points where it reaches 0.8 (closing: -64.7, a CNN with
momentum 0.99 at twice its rate, whose windows closed short kept the rate
tuned for the whole batch) and no run under 0.5 there (closing: 1). On the
benchmark suite's straggler workload (4 replicas, one 4 times slower,
digits, Adam), both reached 97% in under 0.5 times MirroredStrategy's time
(2.44 s filled, 2.70 s closed, 6.67 s; `python -m benchmarks --quick --only
accuracy`)."""

LATE_SHARD_POLICIES = ("requeue", "skip")
"""What becomes of a shard whose gradient came after its fresh window was
taken (the gradient is dropped either way): its examples go back on the
queue, for another replica (`"requeue"`, on one host), or are counted as
skipped (`"skip"`)."""

LATE_SHARDS = "skip"
"""The default of `Strategy(late_shards=...)`: see `LATE_SHARD_POLICIES`.

Requeueing was measured against it on the tuning half of the held-out grid
(`benchmarks.grid`, 32 conditions, seed 0, 2026-12-07) and the benchmark
suite's straggler workload. Against synchronous training, requeueing had a
median gap of -0.1 points (skipping: +0.0), a worst gap where synchronous
training reaches 0.8 of -3.6 points (skipping: -10.0) and no run under 0.5
there (neither had); on the second held-out set, seed 0, +0.3, -7.5 and
none (skipping: +0.0, -9.4, none). On the straggler workload (digits,
Adam, 4 replicas, one 4 times slower, 5 rounds, `python -m benchmarks
--quick --only accuracy --repeats 5 --contenders
mirrored,tf_diffmap,tf_diffmap_requeue`) both reached 97% sooner than
MirroredStrategy (3.30 s): skipping in 1.83 s (12 epochs), requeueing in
2.30 s (9 epochs), at final accuracies of 0.972 and 0.975. Requeueing is
ahead on accuracy on one seed and behind on time. On seed 2 of the second
held-out set (24 conditions) it was not: requeueing +0.3, -10.3 and none,
skipping -0.3, -5.0 and none; and one of its runs there stopped making
progress (docs/staleness-aware-updates.md). Skipping stays the default."""

PATIENCE_MARGIN = 1.0
"""The default margin of a fresh window's patience, over the median
replica's read-to-push time (see `WindowTimer`): a window waits twice the
median replica's shard. Set before any measurement, and the tuning half of
the grid ran with it; other margins have not been compared there yet."""

# What `WindowTimer.recheck` hands the timer's thread in place of a window
# opened (the reader's end is -1).
_RECHECK = -2

# The least wait before a call that failed with an error the runtime lets
# pass is made again: a patience, but not a busy loop where the patience is
# near 0.
_AGAIN_AFTER_SECONDS = 0.05


def _again_after(patience: float) -> float:
    return max(patience, _AGAIN_AFTER_SECONDS)


@dataclasses.dataclass
class _Running:
    """The threads of one `WindowTimer.start`: the reader, then the timer;
    what the reader hands the timer; whether they were told to end."""

    stop: threading.Event
    opened: queue.SimpleQueue
    threads: list[threading.Thread] = dataclasses.field(default_factory=list)


class WindowTimer:
    """Closes or fills an aggregation's windows once their patience runs out.

    Args:
        aggregation: an aggregation whose windows are fresh.
        policy: `"close"` or `"fill"` (`LATE_WINDOW_POLICIES`).
        margin: the patience is the median replica's read-to-push time
            times `1 + margin`.
        present: the replicas whose times count (those not absent or lost).
        may_fill: whether shards are queued for released replicas to take
            (a fill with nothing to compute would leave the window open).
        on_error: called with an error the timer's call raised (the timer
            then stops; the error ends training as a replica's would).
        store_lost: whether the store is lost (a ps task that died or does
            not answer): then `stop` leaves the threads to their calls.
        transient: `(error, failing_since) -> bool`, whether an error of
            the timer's call to the store, whose calls have failed since
            `failing_since` (`time.monotonic()`), may pass (on a cluster, a
            call made as a worker dies, restarts or joins can fail for that
            alone; `Runtime.may_call_again`): the timer then makes the call
            again, a patience later, instead of stopping. A stopped timer
            closes no window, and replicas that wait for one would wait
            until the window's last push came.

    Every call the timer makes to the store runs on its own threads: one to
    a ps task that hangs holds them, never the training thread.
    """

    def __init__(
        self,
        aggregation: Aggregation,
        policy: str,
        margin: float,
        present: Callable[[], list[int]],
        may_fill: Callable[[], bool],
        on_error: Callable[[BaseException], None],
        store_lost: Callable[[], bool] = lambda: False,
        transient: Callable[[BaseException, float], bool] = lambda error, since: False,
    ):
        self.aggregation = aggregation
        self.gate = aggregation.gate
        self.policy = policy
        self.margin = margin
        self._present = present
        self._may_fill = may_fill
        self._on_error = on_error
        self._store_lost = store_lost
        self._transient = transient
        # Whether a failed call was logged as a warning (once per timer).
        self._warned = False
        # When the calls let pass began to fail (None: the last one did not).
        self._failing_since: float | None = None
        self._told_present: int | None = None
        # The threads of the latest `start`, or None once stopped.
        self._running: _Running | None = None
        self._lock = threading.Lock()
        # The patience of the latest window the timer read, in seconds.
        self.patience: float | None = None

    def start(self) -> None:
        """Starts the timer's threads, unless they run.

        `start` and `stop` come from TensorFlow's threads (a step's first
        shard, a drain in a graph), at once at times: each start's threads
        have their own queue and stop flag, and a start or stop holds the
        lock until the reader it stops has ended, so that no reader takes
        the end meant for another."""
        with self._lock:
            running = self._running
            if running is not None and all(t.is_alive() for t in running.threads):
                return
            if running is not None:  # one of its threads ended on an error
                self._end(running)
            running = _Running(threading.Event(), queue.SimpleQueue())
            running.threads = [
                threading.Thread(
                    target=self._read, args=(running,), name="tf_diffmap-windows-read", daemon=True
                ),
                threading.Thread(
                    target=self._run, args=(running,), name="tf_diffmap-windows", daemon=True
                ),
            ]
            self._told_present = None
            self._running = running
            for thread in running.threads:
                thread.start()

    def stop(self) -> None:
        """Stops the threads (a window left open is the drain's to apply).

        The reader ends at once (its queue is on this host). Where the
        store is lost, the timer's thread may be in a call to a ps task
        that died or does not answer: it is left to that call, as a hung
        replica's is, and ends when the call does.
        """
        with self._lock:
            running, self._running = self._running, None
            if running is None:
                return
            self._end(running)
        if not self._store_lost():
            running.threads[1].join()

    def _end(self, running: _Running) -> None:
        """Tells `running`'s threads to end, and waits for its reader
        (holding the lock)."""
        running.stop.set()
        self.gate.opened.enqueue(self.gate.stop_event())
        running.opened.put((-1, 0.0, 0.0, None))
        running.threads[0].join()
        # What the reader left, the sentinel included if it had stopped.
        while int(self.gate.opened.size()):
            self.gate.opened.dequeue()

    def recheck(self) -> None:
        """A replica's call was cut off, or replicas were lost: the timer
        tells the gate who is present and, unless it times it already, times
        the window open now from this moment.

        A push tells the timer of the window it opened once the store's
        section is done, from the client's part of the replica's call. A
        call cut off in between (its worker died, or another task's loss
        ended it) leaves the window open, the others' pushes waiting for its
        close, and the timer that never heard of it. Called from any thread;
        the timer's thread makes the calls.
        """
        running = self._running
        if running is not None:
            running.opened.put((_RECHECK, 0.0, 0.0, None))

    def patience_for(self, opener_seconds: float, seconds: np.ndarray) -> float:
        """The patience of a window whose opener took `opener_seconds`
        from its read to its push: the median present replica's average
        read-to-push time (`seconds`, per replica, as the window opened;
        the opener's own before any is known), times `1 + margin`."""
        present = self._present()
        self._tell_present(present)
        known = [seconds[r] for r in present if seconds[r] > 0]
        pace = float(np.median(known)) if known else opener_seconds
        return pace * (1.0 + self.margin)

    def _tell_present(self, present: list[int]) -> None:
        """Tells the gate how many replicas are present, when it changed
        (and, where a worker's loss failed the call, the next time)."""
        if len(present) != self._told_present:
            if self._tried(self.gate.present.assign, len(present)) is not None:
                self._told_present = len(present)

    def _tried(self, call: Callable, *args):
        """`call(*args)`, or None where it raised an error that a worker's
        loss explains (`transient`): the caller makes the call again later."""
        try:
            result = call(*args)
        except BaseException as error:
            if not self._lets_pass(error):
                raise
            self._passed(error)
            return None
        self._failing_since = None
        return result

    def _lets_pass(self, error: BaseException) -> bool:
        """Whether the timer goes on after `error` (`transient`, told how
        long its calls have failed)."""
        if self._failing_since is None:
            self._failing_since = time.monotonic()
        return self._transient(error, self._failing_since)

    def _passed(self, error: BaseException) -> None:
        """Logs an error the timer goes on after: a warning the first time."""
        if self._warned:
            logger.debug("The window timer goes on after an error", exc_info=True)
            return
        self._warned = True
        # The error's type only: its text names tasks, which the warnings
        # about lost workers name already.
        logger.warning(
            "The window timer's call failed with %s (logged at DEBUG); it goes on, and "
            "makes the call again a patience later.",
            type(error).__name__,
            exc_info=logger.isEnabledFor(logging.DEBUG),
        )

    def _read(self, running: _Running) -> None:
        """Hands each window opened on to the timer (blocks in the gate's
        queue, which no Python timeout can interrupt; the timer's own wait
        has one)."""
        try:
            while True:
                number, read_time, push_time, seconds = self.gate.opened.dequeue()
                running.opened.put(
                    (int(number), float(read_time), float(push_time), seconds.numpy())
                )
                if int(number) < 0:
                    return
        except BaseException as error:  # noqa: BLE001 - handed to the runtime
            running.opened.put((-1, 0.0, 0.0, None))
            self._failed(running, error)

    def _run(self, running: _Running) -> None:
        """Keeps the latest window's deadline: windows open one at a time
        (the next only once this one is taken), so a window opened means
        every earlier one closed."""
        number = None
        deadline = patience = 0.0
        try:
            # Here, not in `start`, which runs on the training thread: a ps
            # that does not answer holds this thread only. Until it is told,
            # the gate counts the replicas last told (each window's opening
            # tells it again).
            self._tell_present(self._present())
            while True:
                try:
                    timeout = None if number is None else max(deadline - time.time(), 0.0)
                    try:
                        opened = running.opened.get(timeout=timeout)
                    except queue.Empty:
                        fill = self.policy == "fill" and self._may_fill()
                        # An error the runtime lets pass: made again below.
                        pushes, released = self.aggregation.close_late(number, fill)
                        self._failing_since = None
                        if released and not pushes:
                            # Filled: the released replicas take a shard time more.
                            deadline = time.time() + patience
                        else:
                            number = None  # Closed short, or closed meanwhile.
                        continue
                    if opened[0] == _RECHECK:
                        self._tell_present(self._present())
                        # The window open now (the gate counts those taken).
                        now = self._tried(self.gate.windows.numpy)
                        seconds = self._tried(self.gate.shard_seconds.numpy)
                        if now is None or seconds is None:
                            time.sleep(_again_after(patience))
                            running.opened.put(opened)  # looked at again
                        elif number is None or int(now) > number:
                            number = int(now)
                            patience = self.patience_for(0.0, seconds)
                            deadline = time.time() + patience
                        continue
                    if opened[0] < 0:
                        return
                    if number is not None and opened[0] <= number:
                        continue  # Told late: a newer window is timed already.
                    number, read_time, push_time, seconds = opened
                    patience = self.patience_for(max(push_time - read_time, 0.0), seconds)
                    self.patience = patience
                    deadline = read_time + patience
                except BaseException as error:
                    # Any error the runtime lets pass (on a cluster, all but a
                    # lost ps's): the timer goes on, as its windows need it.
                    if running.stop.is_set() or not self._lets_pass(error):
                        raise
                    self._passed(error)
                    time.sleep(_again_after(patience))
        except BaseException as error:  # noqa: BLE001 - handed to the runtime
            self._failed(running, error)

    def _failed(self, running: _Running, error: BaseException) -> None:
        if not running.stop.is_set():
            logger.debug("The window timer stopped on an error", exc_info=True)
            self._on_error(error)
