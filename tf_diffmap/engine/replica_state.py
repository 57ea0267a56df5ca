"""Where one replica is: `ReplicaState`, and every move between states.

A replica's life is one `ReplicaState`; its transitions are listed in the
enum's docstring and in `MOVES`, and made in one place
(`workers.ReplicaLoops._move`), which refuses any move not listed. `GONE`
are the states in which a replica does not train.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Protocol

__all__ = ["GONE", "MOVES", "LoopRunner", "ReplicaState"]


class ReplicaState(enum.Enum):
    """Where one replica is. Every transition, and what causes it::

        STOPPED   --start()-->                           RUNNING
        RUNNING   --STOP item taken while stopping-->    STOPPED
        RUNNING   --its loop raised an error-->          FAILED
        RUNNING   --its loop lost its worker task-->     LOST
        FAILED    --STOP item taken while stopping-->    STOPPED
        FAILED    --start() once its thread is gone-->   RUNNING
        LOST      --rejoin(): its worker serves again--> REJOINING
        REJOINING --its thread started-->                RUNNING
        REJOINING --rejoined while loops are stopped-->  STOPPED
        ABSENT    --join(): a worker joined its slot-->  JOINING
        JOINING   --its thread started-->                RUNNING
        JOINING   --joined while loops are stopped-->    STOPPED
        RUNNING   --leave(): its worker asks to leave--> LEAVING
        LEAVING   --its call returned, shard done-->     ABSENT
        LEAVING   --its loop lost its worker task-->     LOST
        LEAVING   --its loop raised an error-->          FAILED
        STOPPED   --leave(): no thread to end-->         ABSENT
        LOST      --leave(): its worker is gone for good--> ABSENT

    Only `ReplicaLoops._move` changes a state, and refuses any other change.
    `start()` leaves LOST, REJOINING, ABSENT, JOINING and LEAVING replicas
    alone: they come back through `rejoin` or `join`.
    """

    STOPPED = "stopped"
    RUNNING = "running"
    FAILED = "failed"
    LOST = "lost"
    REJOINING = "rejoining"
    ABSENT = "absent"
    JOINING = "joining"
    LEAVING = "leaving"


MOVES = {
    (ReplicaState.STOPPED, ReplicaState.RUNNING),
    (ReplicaState.RUNNING, ReplicaState.STOPPED),
    (ReplicaState.RUNNING, ReplicaState.FAILED),
    (ReplicaState.RUNNING, ReplicaState.LOST),
    (ReplicaState.FAILED, ReplicaState.STOPPED),
    (ReplicaState.FAILED, ReplicaState.RUNNING),
    (ReplicaState.LOST, ReplicaState.REJOINING),
    (ReplicaState.REJOINING, ReplicaState.RUNNING),
    (ReplicaState.REJOINING, ReplicaState.STOPPED),
    (ReplicaState.ABSENT, ReplicaState.JOINING),
    (ReplicaState.JOINING, ReplicaState.RUNNING),
    (ReplicaState.JOINING, ReplicaState.STOPPED),
    (ReplicaState.RUNNING, ReplicaState.LEAVING),
    (ReplicaState.LEAVING, ReplicaState.ABSENT),
    (ReplicaState.LEAVING, ReplicaState.LOST),
    (ReplicaState.LEAVING, ReplicaState.FAILED),
    (ReplicaState.STOPPED, ReplicaState.ABSENT),
    (ReplicaState.LOST, ReplicaState.ABSENT),
}

# Replicas with no thread of their own until their worker serves again (or
# joins), and those whose thread is ending for good: none of them trains.
GONE = (
    ReplicaState.LOST,
    ReplicaState.REJOINING,
    ReplicaState.ABSENT,
    ReplicaState.JOINING,
    ReplicaState.LEAVING,
)


class LoopRunner(Protocol):
    """What `ReplicaLoops` drives: a training step's queue and loops (`feed.StepFeed`)."""

    def run_loop(self, replica_id: int, max_steps: int) -> tuple[int, bool]:
        """Applies up to `max_steps` queued shards; returns (taken, stopped)."""

    def pending(self) -> int:
        """Shards queued or being applied."""

    def progress(self) -> tuple[int, int]:
        """Shards put and shards done so far (one consistent read)."""

    def send_stops(self, count: int) -> None:
        """Queues `count` STOP items (one ends one loop)."""

    def drop_loop(self, replica_id: int, max_steps: int) -> tuple[int, bool]:
        """Takes up to `max_steps` items and counts them dropped; (taken, stopped)."""

    def release(self, replica_id: int, requeue: bool) -> bool:
        """Lets go of the item a failed loop call held (queued again, or done)."""

    def replica_steps(self) -> Sequence[int]:
        """Steps each replica has completed (the store's own count)."""

    def stamps(self) -> Sequence[int]:
        """Per replica, a stamp of the shard its loop call holds (0: none)."""

    def fence(self, replica_ids: Sequence[int], fenced: bool) -> None:
        """Keeps replicas' loop calls from taking more (or lets them again)."""
