"""Replica calls that hang: found, fenced off the queue, and left to themselves.

A replica whose loop call holds one shard for `worker_timeout` seconds while
nothing else moves (the others wait for that shard, at the end of an epoch
or under `max_staleness`) is *hung*: its worker was paused, or wedged,
without dying. The idle monitor of `workers.ReplicaLoops` then fences it
(and the other replicas of its worker) off the queue, and it becomes LOST:
its thread is left to its call, and nobody waits for the shard it holds
(it is *excused*). A hung call that answers finishes that shard (as any
step would), takes nothing more, and ends; its replicas then rejoin. One
whose worker turns out dead is lost as any other. A *stall* (no shard
applied for `stall_timeout` while shards wait, and no single replica to
blame) leaves every call to itself once the `HangHandler` finds it fatal.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Protocol

from tf_diffmap.engine.replica_state import GONE, LoopRunner, ReplicaState

__all__ = ["HangHandler", "HungCalls"]


class HangHandler(Protocol):
    """What `ReplicaLoops` asks about replicas whose calls hang."""

    def group_of(self, replica_id: int) -> Sequence[int]:
        """The replicas that hang with this one (those of its worker task)."""

    def hung(self, replica_id: int, group: Sequence[int], seconds: float) -> None:
        """A replica's call did not answer for `seconds` while the others
        waited (it held one shard, or did not take its STOP): its group is
        lost (report and warn)."""

    def answered(self, group: Sequence[int]) -> None:
        """Every hung call of the group has answered: its replicas rejoin
        (called from the last one's thread; `ReplicaLoops.rejoin` follows)."""

    def stalled(self, seconds: float) -> bool:
        """No shard was applied for `seconds` while shards waited and no
        single replica could be blamed: whether that is fatal (a parameter
        server that does not answer; the handler keeps the error to raise)."""


class HungCalls:
    """What `ReplicaLoops` does about calls that hang (see the module's
    docstring): the idle monitor's looks for hung calls and stalls, and the
    threads left to their calls.

    A base of `workers.ReplicaLoops`, which holds what these methods share
    with the threads (its lock, threads and states, declared below) and
    provides `_move`, `_failed` and `_run`.
    """

    num_replicas: int
    name: str
    runner: LoopRunner
    worker_timeout: float | None
    stall_timeout: float | None
    _hangs: HangHandler | None
    _lock: threading.Lock
    _progress: threading.Condition
    _threads: dict[int, threading.Thread]
    _states: list[ReplicaState]

    def __init__(self) -> None:
        # Hung replicas' threads, still in their calls; the group each hung
        # with; those of them holding a shard nobody waits for; groups with
        # a replica whose worker turned out lost.
        self._orphans: dict[int, threading.Thread] = {}
        self._group: dict[int, tuple[int, ...]] = {}
        self._excused: set[int] = set()
        self._gone: set[int] = set()
        # Per replica: (its stamp and the progress, when first seen so).
        self._unmoved: dict[int, tuple[tuple, float]] = {}
        # When the count of applied shards last moved (or shards last
        # stopped waiting), and whether the loops were abandoned for a stall.
        self._applied_since: tuple[int, float] | None = None
        self._stalled = False

    def excused(self) -> int:
        """Shards held by hung calls, which nobody waits for."""
        with self._lock:
            return len(self._excused)

    def _fence_stuck(self, live: list[threading.Thread], seconds: float) -> None:
        """Threads that did not take their STOP within `worker_timeout` are
        in calls that hang (their worker does not answer; they hold no
        shard, or the monitor had seen them): their groups are left to
        them, unless nobody else would be left to train. The STOP each was
        sent stays queued, and a loop that takes it later, not stopping,
        goes on."""
        with self._lock:
            stuck = [
                r
                for r, t in self._threads.items()
                if t in live
                and t.is_alive()
                and t is not threading.current_thread()
                and self._states[r] is not ReplicaState.LEAVING
            ]
            others = [
                r for r, state in enumerate(self._states) if r not in stuck and state not in GONE
            ]
        groups: list[list[int]] = []
        for replica_id in stuck:
            if not any(replica_id in g for g in groups):
                groups.append([r for r in self._hangs.group_of(replica_id) if r in stuck])
        for group in groups:
            if not [r for r in others if r not in group]:
                continue  # Nobody else trains: nobody waits on it.
            self.runner.fence(group, True)
            left = self._leave(group, self.runner.stamps())
            if left:
                self._hangs.hung(left[0], left, seconds)

    def _orphaned(self, replica_id: int) -> bool:
        """Whether the current thread is a hung replica's, left to its call."""
        with self._lock:
            return self._orphans.get(replica_id) is threading.current_thread()

    def _look_for_hangs(self, seen: tuple[int, int]) -> None:
        """One look of the idle monitor: a replica whose shard has not moved,
        with nothing else moving, for `worker_timeout` seconds is hung."""
        stamps = self.runner.stamps()
        now = time.monotonic()
        with self._lock:
            # A hung call may take one more item as it is fenced, and hold it.
            self._excused.update(r for r in self._orphans if stamps[r])
            live = [
                r
                for r, t in self._threads.items()
                if t.is_alive() and self._states[r] is ReplicaState.RUNNING
            ]
        for replica_id in range(self.num_replicas):
            look = (stamps[replica_id], seen)
            if replica_id not in live or not stamps[replica_id]:
                self._unmoved.pop(replica_id, None)
                continue
            first = self._unmoved.get(replica_id)
            if first is None or first[0] != look:
                self._unmoved[replica_id] = (look, now)
            elif now - first[1] >= self.worker_timeout:
                if self.stall_timeout is not None and all(stamps[q] for q in live):
                    # Every replica holds a shard and none moves: what they
                    # share stopped answering, not one worker (`_look_for_stall`).
                    continue
                self._unmoved.clear()
                self._fence_hung(replica_id, stamps[replica_id], live, now - first[1])
                return

    def _fence_hung(self, replica_id: int, stamp: int, live: list[int], seconds: float) -> None:
        """Fences a replica that looks hung, with its group, and confirms:
        if its shard is still the same once the fence is up, its calls are
        left to themselves and its group is lost; otherwise the fence goes."""
        group = [r for r in self._hangs.group_of(replica_id) if r in live]
        if not [r for r in live if r not in group]:
            return  # Nobody else trains: nobody waits on it.
        self.runner.fence(group, True)
        stamps = self.runner.stamps()
        if stamps[replica_id] != stamp:
            self.runner.fence(group, False)
            return
        left = self._leave(group, stamps)
        if left:
            self._hangs.hung(replica_id, left, seconds)

    def _leave(self, group: Sequence[int], stamps: Sequence[int]) -> list[int]:
        """Leaves a fenced group's threads to their calls: LOST, not waited
        for, and the shards they hold excused."""
        with self._lock:
            left = [r for r in group if r in self._threads]
            for r in left:
                self._move(r, ReplicaState.LOST)
            self._orphan(left, stamps)
            self._progress.notify_all()
        # One that ended meanwhile is not left to a call: it may take again.
        self.runner.fence([r for r in group if r not in left], False)
        return left

    def _orphan(self, replica_ids: Sequence[int], stamps: Sequence[int]) -> None:
        """Leaves replicas' threads to their calls, as one group (holding the
        lock): nobody waits for them, and the shards they hold are excused."""
        for r in replica_ids:
            self._orphans[r] = self._threads.pop(r)
            self._group[r] = tuple(replica_ids)
            if stamps[r]:
                self._excused.add(r)

    def _answer(self, replica_id: int, error: BaseException | None) -> None:
        """A hung replica's call ended (in its thread): the shard it held is
        applied, or, for an error, released as any failed call's is. Once
        its whole group answered, the group rejoins, unless its worker
        turned out lost (it then rejoins when it serves again)."""
        state = self._failed(replica_id, error) if error is not None else None
        with self._lock:
            del self._orphans[replica_id]
            self._excused.discard(replica_id)
            group = self._group.pop(replica_id)
            if state is ReplicaState.LOST:
                self._gone.update(group)
            self._progress.notify_all()
            if any(r in self._orphans for r in group):
                return
            gone = self._gone.intersection(group)
            self._gone.difference_update(group)
        if not gone and not self._stalled:
            self._hangs.answered(group)

    def _look_for_stall(self, seen: tuple[int, int]) -> bool:
        """One look of the idle monitor for a stall: shards wait and none was
        applied for `stall_timeout` seconds. Returns whether the loops were
        abandoned (the handler found it fatal)."""
        now = time.monotonic()
        waiting = seen[0] - seen[1] > self.excused()
        if not waiting or self._stalled:
            self._applied_since = None
            return False
        if self._applied_since is None or self._applied_since[0] != seen[1]:
            self._applied_since = (seen[1], now)
            return False
        seconds = now - self._applied_since[1]
        if seconds < self.stall_timeout:
            return False
        self._applied_since = (seen[1], now)  # Asked once per stall_timeout.
        if not self._hangs.stalled(seconds):
            return False
        self._abandon()
        return True

    def _abandon(self) -> None:
        """Every replica's call hangs and the error that ends training is
        kept: each thread is left to its call, and a new thread per replica
        drops what is queued (as a FAILED replica does) until stopped, so
        that nothing that feeds the queue waits for ever."""
        stamps = self.runner.stamps()
        with self._lock:
            self._stalled = True
            self._orphan([r for r, t in self._threads.items() if t.is_alive()], stamps)
            for r in range(self.num_replicas):
                if self._states[r] in GONE:
                    continue
                if self._states[r] is not ReplicaState.RUNNING:
                    self._move(r, ReplicaState.RUNNING)
                self._move(r, ReplicaState.FAILED)
                # Started holding the lock: its first look sees FAILED.
                thread = threading.Thread(
                    target=self._run, args=(r, None), name=f"{self.name}-drop-{r}", daemon=True
                )
                self._threads[r] = thread
                thread.start()
            self._progress.notify_all()
