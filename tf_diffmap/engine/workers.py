"""Per-replica threads that run the replicas' loops, and what they share.

Each replica is one Python thread bound to one replica id. The thread calls
its replica's *loop function* (see `tf_diffmap.engine.loops`), a TensorFlow function
that takes up to K shards, one after the other, from a queue that every
replica shares, applies each as one replica step and returns once. Python
thus touches a replica once per K shards, and a slow replica simply takes
fewer shards: nobody waits at a barrier. TensorFlow releases the GIL while a
function runs, so the loops overlap.

A replica's life is one `ReplicaState` (`replica_state.py`), changed in one
place (`ReplicaLoops._move`). On a cluster that grows and shrinks
(`tf_diffmap.cluster.membership`), a replica slot whose worker has not
joined yet, or has left, is ABSENT: it has no thread, and the others take
its shards; `join` and `leave` bring it in and out. A FAILED replica runs
the runner's *drop loop* instead of its own (which may need a task that is
gone): it takes what is queued and counts it dropped, so that nothing that
feeds the queue ever blocks on a failed replica. A LOST replica (its worker
task is unreachable, see `tf_diffmap.cluster.faults`) has no thread until
`rejoin` starts one. Under `max_staleness` the thread asks for one shard at
a time and only while its replica is within the bound of the slowest
replica that is not lost.

A replica whose loop call holds one shard for `worker_timeout` seconds while
nothing else moves is *hung*; what the loops' idle monitor does about it,
and about a stall of every replica, is `hangs.HungCalls`, a base of
`ReplicaLoops`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Sequence

from tf_diffmap.engine.hangs import HangHandler, HungCalls
from tf_diffmap.engine.replica_state import GONE, MOVES, LoopRunner, ReplicaState

__all__ = ["HangHandler", "LoopRunner", "ReplicaLoops", "ReplicaState", "WorkerError"]

# How often blocked callers look again for errors, progress and idleness.
POLL_SECONDS = 0.05
# Loops with no shard put or applied for this long stop their threads; the next step
# starts them again, so an interrupted `fit` leaves no thread behind.
IDLE_SECONDS = 1.0
# How often a leave queues a STOP again for a leaving call that still waits
# for an item (`ReplicaLoops.leave`).
WAKE_SECONDS = 0.2


class WorkerError(RuntimeError):
    """A replica failed for a reason that is not an `Exception` of its own."""


class ReplicaLoops(HungCalls):
    """Threads running one training step's replica loops, asynchronously.

    Args:
        runner: the training step's queue and loop functions.
        num_replicas: how many threads (one per replica id).
        on_error: called (from the failing thread) with the replica id and
            the error its loop raised; returns the replica's next state:
            FAILED (the thread goes on dropping shards), LOST (the item it
            held goes back on the queue and the thread ends) or RUNNING (the
            item goes back on the queue and the thread goes on).
        name: prefix of the threads' names.
        steps_per_loop: K, the most shards one loop call applies.
        max_staleness: Stale Synchronous Parallel bound: a replica does not
            start a step while it is more than this many completed steps ahead
            of the slowest replica. `None` means no bound.
        worker_timeout: seconds a replica may hold one shard while nothing
            else moves before it is treated as hung; `None`: never.
        hangs: what to do about a hung replica (required with a timeout).
        stall_timeout: seconds during which no shard at all may be applied
            while shards wait before `hangs.stalled` is asked whether the
            store stopped answering; then every loop call is left to itself
            and the queue is drained, so that the error ends training.
            `None`: never.
        absent: replicas whose slot no worker holds yet (ABSENT).
    """

    def __init__(
        self,
        runner: LoopRunner,
        num_replicas: int,
        on_error: Callable[[int, BaseException], ReplicaState],
        name: str = "tf_diffmap",
        steps_per_loop: int = 32,
        max_staleness: int | None = None,
        worker_timeout: float | None = None,
        hangs: HangHandler | None = None,
        stall_timeout: float | None = None,
        absent: Collection[int] = (),
    ):
        if (worker_timeout is not None or stall_timeout is not None) and hangs is None:
            raise ValueError("A worker_timeout or stall_timeout needs a HangHandler.")
        super().__init__()
        self.stall_timeout = stall_timeout
        self.runner = runner
        self.num_replicas = num_replicas
        self.name = name
        self.steps_per_loop = steps_per_loop
        self.max_staleness = max_staleness
        self._on_error = on_error
        self._lock = threading.Lock()
        # Held-back replicas wait here for the slowest one to move on.
        self._progress = threading.Condition(self._lock)
        # The idle monitor sleeps here between looks (woken by `stop`).
        self._idle = threading.Condition(self._lock)
        self._threads: dict[int, threading.Thread] = {}
        self._states = [
            ReplicaState.ABSENT if r in absent else ReplicaState.STOPPED
            for r in range(num_replicas)
        ]
        self._stopping = False
        self._waited = [0.0] * num_replicas
        # Per replica, what `max_staleness` adds to its steps (see `join`).
        self._offsets = [0] * num_replicas
        self._monitor: threading.Thread | None = None
        self._on_idle: Callable[[], bool] | None = None
        self._local = threading.local()
        self.worker_timeout = worker_timeout
        self._hangs = hangs

    # -- lifecycle (any thread but a worker's) --------------------------------

    def start(self, on_idle: Callable[[], bool] | None = None, first: bool = False) -> None:
        """Starts every replica's thread that is not running.

        Args:
            on_idle: called after the loops stopped because no shard was put
                or applied for `IDLE_SECONDS`; returns False when shards
                arrived while they stopped, and the loops go on.
            first: before the other threads start, one replica's thread
                takes one queued item (the first step after a drain, whose
                outputs its caller returns), and the caller waits for it (up
                to `worker_timeout`: a call that hangs is then left to the
                monitor, as any other): of the replicas not lost, the one
                with the most steps, which is not a straggler, or under
                `max_staleness` the one with the fewest.
        """
        replica_id = self._first_replica() if first else None
        with self._lock:
            if on_idle is not None:
                self._on_idle = on_idle
            self._stopping = False
            answered = threading.Event()
            if replica_id is not None:
                self._start_thread(replica_id, answered)
        if replica_id is not None:
            answered.wait(self.worker_timeout)
        with self._lock:
            for replica_id in range(self.num_replicas):
                if self._states[replica_id] in GONE:
                    continue
                self._start_thread(replica_id)
            if self._monitor is None or not self._monitor.is_alive():
                self._monitor = threading.Thread(
                    target=self._watch_idle, name=f"{self.name}-idle", daemon=True
                )
                self._monitor.start()

    def _start_thread(self, replica_id: int, first: threading.Event | None = None) -> None:
        """Starts the replica's thread unless it runs (holding the lock);
        with `first`, its first call takes one item, then sets `first`."""
        thread = self._threads.get(replica_id)
        if thread is not None and thread.is_alive():
            if first is not None:
                first.set()
            return
        if self._states[replica_id] is not ReplicaState.RUNNING:
            self._move(replica_id, ReplicaState.RUNNING)
        thread = threading.Thread(
            target=self._run,
            args=(replica_id, first),
            name=f"{self.name}-replica-{replica_id}",
            daemon=True,
        )
        self._threads[replica_id] = thread
        thread.start()

    def _move(self, replica_id: int, state: ReplicaState) -> None:
        """The one place a replica's state changes (holding the lock)."""
        before = self._states[replica_id]
        if before is state:
            return
        if (before, state) not in MOVES:
            raise RuntimeError(
                f"Replica {replica_id} cannot go from {before.value} to {state.value}."
            )
        self._states[replica_id] = state

    def rejoin(self, replica_ids: Sequence[int]) -> None:
        """Brings LOST replicas back: their threads start if the loops run.

        While the loops are stopped (idle, or drained) the replicas become
        STOPPED, and the next `start()` starts them with the others.
        """
        with self._lock:
            replica_ids = [
                r
                for r in replica_ids
                if self._states[r] is ReplicaState.LOST and r not in self._orphans
            ]
        # A replica that hung was fenced off the queue.
        self._bring_in(replica_ids, ReplicaState.LOST, ReplicaState.REJOINING)

    def join(self, replica_ids: Sequence[int]) -> None:
        """Brings ABSENT replicas in (a worker joined their slots): their
        threads start if the loops run, else they are STOPPED and start with
        the others at the next `start()`."""
        steps = self.runner.replica_steps()
        with self._lock:
            replica_ids = [r for r in replica_ids if self._states[r] is ReplicaState.ABSENT]
            live = [
                steps[r] + self._offsets[r] for r, st in enumerate(self._states) if st not in GONE
            ]
            # Under `max_staleness`, a replica that joins counts as level with
            # the slowest one present, not as that many steps behind it.
            for r in replica_ids:
                self._offsets[r] = (min(live) if live else 0) - steps[r]
        # A replica that left was fenced off the queue.
        self._bring_in(replica_ids, ReplicaState.ABSENT, ReplicaState.JOINING)

    def _bring_in(
        self, replica_ids: Sequence[int], gone: ReplicaState, coming: ReplicaState
    ) -> None:
        """Lets replicas that are still `gone` take from the queue again, and
        moves each to `coming`, then to RUNNING with a thread of its own if
        the loops run, else to STOPPED (the next `start()` starts it)."""
        self.runner.fence(replica_ids, False)
        with self._lock:
            running = not self._stopping and any(t.is_alive() for t in self._threads.values())
            for replica_id in replica_ids:
                if self._states[replica_id] is not gone:
                    continue
                self._move(replica_id, coming)
                if running:
                    self._start_thread(replica_id)
                else:
                    self._move(replica_id, ReplicaState.STOPPED)

    def leave(self, replica_ids: Sequence[int], timeout: float | None) -> list[int]:
        """Takes replicas out for good (their worker leaves): each is fenced
        off the queue, finishes the shard its call holds (a call waiting for
        an item gives the item back) and ends; then it is ABSENT.

        A call that waits in the queue's dequeue would end only when an item
        reaches it, and none may come for a while (Keras' step is between
        batches, or held up): a STOP per leaving call is queued with the
        fence, and again every `WAKE_SECONDS` for each leaving call still
        running that holds no shard (another replica waiting in its take
        may have taken the STOP first). A fenced call gives its STOP back,
        and a running replica that takes a STOP while the loops are not
        stopping passes it by, so a STOP left over changes nothing. The
        others take shards throughout: nothing here holds their lock while
        it waits.

        Args:
            replica_ids: the replicas of the worker that leaves.
            timeout: seconds to wait for their calls to end; None: for ever.

        Returns:
            The replicas whose calls had not ended within `timeout` (they
            stay LEAVING; their calls end as any fenced call does).
        """
        with self._lock:
            ending = []
            for r in replica_ids:
                thread = self._threads.get(r)
                if (
                    self._states[r] is ReplicaState.RUNNING
                    and thread is not None
                    and thread.is_alive()
                ):
                    self._move(r, ReplicaState.LEAVING)
                    ending.append((r, thread))
                elif self._states[r] in (ReplicaState.RUNNING, ReplicaState.STOPPED):
                    self._threads.pop(r, None)
                    if self._states[r] is ReplicaState.RUNNING:
                        self._move(r, ReplicaState.STOPPED)
                    self._move(r, ReplicaState.ABSENT)
                elif self._states[r] is ReplicaState.LOST and r not in self._orphans:
                    self._move(r, ReplicaState.ABSENT)
            self._progress.notify_all()
        self.runner.fence(list(replica_ids), True)
        deadline = None if timeout is None else time.monotonic() + timeout
        waking = [r for r, _ in ending]
        while waking:
            self.runner.send_stops(len(waking))
            alive = [(r, t) for r, t in ending if t.is_alive()]
            left = None if deadline is None else deadline - time.monotonic()
            if not alive or (left is not None and left <= 0):
                break
            alive[0][1].join(WAKE_SECONDS if left is None else min(WAKE_SECONDS, left))
            stamps = self.runner.stamps()
            waking = [r for r, t in alive if t.is_alive() and not stamps[r]]
            if not waking and any(t.is_alive() for _, t in alive):
                # Each applies the shard it holds, then finds its fence.
                for _, thread in alive:
                    thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        with self._lock:
            return [r for r in replica_ids if self._states[r] is ReplicaState.LEAVING]

    def _left(self, replica_id: int) -> bool:
        """Whether the replica is leaving: then it is ABSENT, and its thread
        (the current one) ends."""
        with self._lock:
            if self._states[replica_id] is not ReplicaState.LEAVING:
                return False
            self._move(replica_id, ReplicaState.ABSENT)
            if self._threads.get(replica_id) is threading.current_thread():
                del self._threads[replica_id]
            self._progress.notify_all()
            return True

    def stop(self, timeout: float = 30.0) -> None:
        """Ends every loop once what is queued before the stop is taken."""
        with self._lock:
            self._stopping = True
            live = [t for t in self._threads.values() if t.is_alive()]
            monitor = self._monitor
            self._progress.notify_all()
            self._idle.notify_all()
        if live:
            self.runner.send_stops(len(live))
        started = time.monotonic()
        wait = timeout if self.worker_timeout is None else self.worker_timeout
        for thread in [*live, monitor]:
            if thread is not None and thread is not threading.current_thread():
                thread.join(max(0.0, started + wait - time.monotonic()))
        if self.worker_timeout is not None:
            self._fence_stuck(live, time.monotonic() - started)

    def in_worker(self) -> bool:
        """Whether the current thread is one of these loops' threads."""
        return getattr(self._local, "replica_id", None) is not None

    def running(self) -> bool:
        with self._lock:
            return any(t.is_alive() for t in self._threads.values())

    def wait_idle(self, failed: Callable[[], bool]) -> None:
        """Waits until nothing is queued or being applied, but for the
        shards hung calls hold, or `failed()`."""
        delay = 0.0002
        while self.runner.pending() > self.excused() and not failed():
            if not self.running():
                self.start()
            time.sleep(delay)
            delay = min(delay * 2, 0.005)

    def threads(self) -> list[threading.Thread]:
        """The threads alive now (the replicas', hung ones' and the idle monitor)."""
        with self._lock:
            threads = [*self._threads.values(), *self._orphans.values(), self._monitor]
            return [t for t in threads if t is not None and t.is_alive()]

    def states(self) -> list[ReplicaState]:
        with self._lock:
            return list(self._states)

    def seconds_waited(self) -> list[float]:
        """Time each replica spent held back by `max_staleness`."""
        with self._lock:
            return list(self._waited)

    # -- the threads ----------------------------------------------------------

    def _first_replica(self) -> int | None:
        """The replica that takes the first item after a drain (`start`);
        None when every replica is lost."""
        steps = [s + o for s, o in zip(self.runner.replica_steps(), self._offsets)]
        with self._lock:
            live = [r for r, state in enumerate(self._states) if state not in GONE]
        if not live:
            return None
        pick = min if self.max_staleness is not None else max
        return pick(live, key=lambda r: steps[r])

    def _allowed_steps(self, replica_id: int) -> int:
        """Shards this replica may take now (0: held back)."""
        if self.max_staleness is None:
            return self.steps_per_loop
        steps = [s + o for s, o in zip(self.runner.replica_steps(), self._offsets)]
        with self._lock:
            live = [s for s, state in zip(steps, self._states) if state not in GONE]
        # One at a time: the bound is checked again before every step.
        return 1 if steps[replica_id] - min(live or steps) <= self.max_staleness else 0

    def _run(self, replica_id: int, first: threading.Event | None = None) -> None:
        try:
            self._loop(replica_id, first)
        finally:
            if first is not None:
                first.set()

    def _loop(self, replica_id: int, first: threading.Event | None) -> None:
        self._local.replica_id = replica_id
        held_since = None
        while True:
            if first is not None and first.is_set():
                first = None  # The first call returned: the caller goes on.
            if self._orphaned(replica_id):
                self._answer(replica_id, None)
                return
            allowed = 1 if first is not None else self._allowed_steps(replica_id)
            if allowed == 0:
                held_since = held_since or time.monotonic()
                with self._lock:
                    if self._stopping:
                        self._waited[replica_id] += time.monotonic() - held_since
                        held_since = None
                        allowed = 1  # Only STOP items and what precedes them are left.
                    else:
                        self._progress.wait(POLL_SECONDS / 5)
                        continue
            if held_since is not None:
                with self._lock:
                    self._waited[replica_id] += time.monotonic() - held_since
                held_since = None
            if self._left(replica_id):
                return
            with self._lock:
                failed = self._states[replica_id] is ReplicaState.FAILED
            try:
                if failed:
                    _, stopped = self.runner.drop_loop(replica_id, self.steps_per_loop)
                else:
                    _, stopped = self.runner.run_loop(replica_id, allowed)
            except BaseException as error:  # noqa: BLE001 - handed to the strategy
                if failed:
                    raise  # The drop loop runs on the queue's host only.
                if self._orphaned(replica_id):
                    self._answer(replica_id, error)
                    return
                state = self._failed(replica_id, error)
                if first is not None:
                    first.set()
                with self._lock:
                    if state is ReplicaState.RUNNING and (
                        self._states[replica_id] is ReplicaState.LEAVING
                    ):
                        continue  # Fenced: its next look ends it.
                    self._move(replica_id, state)
                    self._progress.notify_all()
                    if state is ReplicaState.LOST:
                        if self._threads.get(replica_id) is threading.current_thread():
                            del self._threads[replica_id]
                        return
                continue
            if first is not None:
                first.set()
            if self._orphaned(replica_id):
                self._answer(replica_id, None)
                return
            if self._left(replica_id):
                return
            with self._lock:
                self._progress.notify_all()
                if stopped and self._stopping:
                    self._move(replica_id, ReplicaState.STOPPED)
                    if self._threads.get(replica_id) is threading.current_thread():
                        del self._threads[replica_id]
                    return

    def _failed(self, replica_id: int, error: BaseException) -> ReplicaState:
        """A loop call of the replica raised: its next state (`on_error`),
        once the item the call held is released."""
        if not isinstance(error, Exception):
            wrapped = WorkerError(f"replica {replica_id} stopped: {error!r}")
            wrapped.__cause__ = error
            error = wrapped
        state = self._on_error(replica_id, error)
        self.runner.release(replica_id, requeue=state is not ReplicaState.FAILED)
        return state

    def _watch_idle(self) -> None:
        # Idle means that nothing moved: no shard put and none applied since
        # the last look, for IDLE_SECONDS. Replicas that keep up with the
        # steps often have nothing in flight at the instant of a look; that
        # alone is no pause.
        idle_since, last = None, None
        while True:
            with self._lock:
                # A stop made while this thread looked at the progress (out
                # of the wait) must not wait for the next look.
                self._idle.wait_for(lambda: self._stopping, POLL_SECONDS * 5)
                if self._stopping or not any(t.is_alive() for t in self._threads.values()):
                    self._monitor = None
                    return
            seen = self.runner.progress()
            if self.worker_timeout is not None:
                self._look_for_hangs(seen)
            if self.stall_timeout is not None and self._look_for_stall(seen):
                continue
            if seen != last or seen[0] - seen[1] > self.excused():
                idle_since, last = None, seen
                continue
            idle_since = idle_since or time.monotonic()
            if time.monotonic() - idle_since < IDLE_SECONDS:
                continue
            self.stop()
            # A step may have put shards while the loops stopped, behind their
            # STOP items; `on_idle` then leaves the loops marked running, and
            # they start again to apply them (nothing may wait in the queue
            # with no loop to take it: a step putting more would block).
            if self._on_idle is None or self._on_idle():
                with self._lock:
                    self._monitor = None
                return
            self.start()
            idle_since, last = None, None
