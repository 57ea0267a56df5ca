"""Per-replica worker threads, the shard queue, draining and errors.

Each replica is one Python thread bound to one replica id. Shards wait in one
bounded queue that every worker takes from, so a slow replica simply takes
fewer shards and nobody waits at a barrier. TensorFlow releases the GIL while
a function runs, so the workers' steps overlap.

One lock guards the pool and two conditions share it, so that each event
wakes only the threads it concerns: queued shards wake as many idle workers as
there are new shards, and a shard taken or finished wakes the callers' threads
(waiting for room in the queue, for outputs, or for the pool to drain), never
the other workers.

A worker's exception is kept as raised (not as TensorFlow's wrapped error),
the queue is cleared so that nothing blocks on it, and the exception is raised
in the caller's thread at its next contact with the pool.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["WorkerPool", "WorkerError"]

Task = Callable[[int], Any]

# How long a worker with nothing to do stays alive. Threads restart on the next
# dispatch, so an interrupted `fit` leaves no thread behind for longer than this.
IDLE_SECONDS = 1.0
# How often blocked calls look again for errors and shutdown.
POLL_SECONDS = 0.05


class WorkerError(RuntimeError):
    """A replica failed for a reason that is not an `Exception` of its own."""


class WorkerPool:
    """Runs tasks on per-replica threads, asynchronously.

    Args:
        num_replicas: how many worker threads (one per replica id).
        name: prefix of the threads' names.
        queue_size: how many shards may wait; `submit` blocks beyond that.
        max_staleness: Stale Synchronous Parallel bound: a replica does not
            start a step while it is more than this many completed steps ahead
            of the slowest replica. `None` means no bound.
    """

    def __init__(
        self,
        num_replicas: int,
        name: str = "tf_diffmap",
        queue_size: int | None = None,
        max_staleness: int | None = None,
    ):
        self.num_replicas = num_replicas
        self.name = name
        self.queue_size = queue_size or 2 * num_replicas
        self.max_staleness = max_staleness
        self._lock = threading.Lock()
        # Workers wait here for shards (and, under max_staleness, for the
        # slowest replica to catch up).
        self._work = threading.Condition(self._lock)
        # Callers (`submit`, `wait_for`, `drain`) wait here for progress.
        self._progress = threading.Condition(self._lock)
        self._queue: collections.deque[Task] = collections.deque()
        self._in_flight = 0
        self._error: BaseException | None = None
        self._threads: dict[int, threading.Thread] = {}
        self._stopping = False
        self._steps = [0] * num_replicas
        self._waited = [0.0] * num_replicas
        self._local = threading.local()

    # -- what the caller's thread uses ------------------------------------

    def in_worker(self) -> bool:
        """Whether the current thread is one of this pool's workers."""
        return getattr(self._local, "replica_id", None) is not None

    def submit(self, tasks: Sequence[Task], block: bool = True) -> bool:
        """Queues tasks; blocks while the queue is full.

        Args:
            tasks: callables taking the replica id.
            block: False queues beyond `queue_size` rather than wait, for
                callers that must not wait (the caller then keeps the queue
                bounded itself, as the strategy does before each batch).

        Returns:
            False when a worker has failed (nothing more is queued then; the
            error is raised by `raise_error`), True otherwise.
        """
        with self._lock:
            self._stopping = False
            self._start_missing_threads()
            added = 0
            for task in tasks:
                if block and len(self._queue) >= self.queue_size:
                    self._wake_workers(added)
                    added = 0
                    while len(self._queue) >= self.queue_size and self._error is None:
                        self._progress.wait(POLL_SECONDS)
                        self._start_missing_threads()
                if self._error is not None:
                    return False
                self._queue.append(task)
                self._in_flight += 1
                added += 1
            self._wake_workers(added)
        return True

    def wait_for(self, predicate: Callable[[], bool]) -> bool:
        """Waits until `predicate()` holds or a worker fails; True if it holds."""
        with self._lock:
            while not predicate():
                if self._error is not None:
                    return False
                if not self._queue and not self._in_flight:
                    return predicate()
                self._progress.wait(POLL_SECONDS)
            return True

    def drain(self) -> None:
        """Waits until every queued task has run, then raises a worker's error.

        A no-op inside a worker thread (a worker never waits for itself).
        """
        if self.in_worker():
            return
        with self._lock:
            while self._in_flight and self._error is None:
                self._progress.wait(POLL_SECONDS)
        self.raise_error()

    @property
    def queued(self) -> int:
        """Tasks waiting for a worker."""
        return len(self._queue)

    @property
    def in_flight(self) -> int:
        """Tasks queued or running."""
        return self._in_flight

    def raise_error(self) -> None:
        """Raises, once, the exception that stopped a worker, if any."""
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def shutdown(self, timeout: float = 10.0) -> None:
        """Drops queued tasks, stops the threads and waits for them."""
        with self._lock:
            self._stopping = True
            self._in_flight -= len(self._queue)
            self._queue.clear()
            self._notify_everyone()
            threads = list(self._threads.values())
        deadline = time.monotonic() + timeout
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))

    def threads(self) -> list[threading.Thread]:
        """The worker threads alive now."""
        with self._lock:
            return [t for t in self._threads.values() if t.is_alive()]

    def steps(self) -> list[int]:
        """Steps completed by each replica."""
        with self._lock:
            return list(self._steps)

    def seconds_waited(self) -> list[float]:
        """Time each replica spent held back by `max_staleness`."""
        with self._lock:
            return list(self._waited)

    # -- the workers -------------------------------------------------------

    def _start_missing_threads(self) -> None:
        for replica_id in range(self.num_replicas):
            thread = self._threads.get(replica_id)
            if thread is None or not thread.is_alive():
                thread = threading.Thread(
                    target=self._run,
                    args=(replica_id,),
                    name=f"{self.name}-replica-{replica_id}",
                    daemon=True,
                )
                self._threads[replica_id] = thread
                thread.start()

    def _held_back(self, replica_id: int) -> bool:
        if self.max_staleness is None:
            return False
        return self._steps[replica_id] - min(self._steps) > self.max_staleness

    def _next_task(self, replica_id: int) -> Task | None:
        """The next task for this replica, or None when it should exit."""
        with self._lock:
            idle_since = time.monotonic()
            held_since = None
            while True:
                if self._stopping or self._error is not None:
                    return None
                if self._queue and not self._held_back(replica_id):
                    if held_since is not None:
                        self._waited[replica_id] += time.monotonic() - held_since
                    task = self._queue.popleft()
                    self._progress.notify_all()
                    return task
                if self._queue:
                    held_since = held_since or time.monotonic()
                    idle_since = time.monotonic()
                elif time.monotonic() - idle_since > IDLE_SECONDS:
                    if self._threads.get(replica_id) is threading.current_thread():
                        del self._threads[replica_id]
                    return None
                self._work.wait(POLL_SECONDS)

    def _run(self, replica_id: int) -> None:
        self._local.replica_id = replica_id
        while True:
            task = self._next_task(replica_id)
            if task is None:
                return
            try:
                task(replica_id)
            except BaseException as error:  # noqa: BLE001 - handed to the caller
                if not isinstance(error, Exception):
                    wrapped = WorkerError(f"replica {replica_id} stopped: {error!r}")
                    wrapped.__cause__ = error
                    error = wrapped
                self._fail(error)
                return
            with self._lock:
                self._in_flight -= 1
                self._steps[replica_id] += 1
                self._progress.notify_all()
                if self.max_staleness is not None and self._queue:
                    # The slowest replica moving on may release held-back ones.
                    self._work.notify_all()

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = error
            # The failed task and every queued one will never run.
            self._in_flight -= 1 + len(self._queue)
            self._queue.clear()
            self._notify_everyone()

    def _wake_workers(self, shards: int) -> None:
        if self.max_staleness is None:
            self._work.notify(shards)
        else:
            # A held-back worker woken would pass its turn: wake them all.
            self._work.notify_all()

    def _notify_everyone(self) -> None:
        self._work.notify_all()
        self._progress.notify_all()
