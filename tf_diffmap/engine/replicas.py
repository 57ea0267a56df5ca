"""The replicas' record: each one's state, what its error means, hung replicas.

`ReplicaRecord` is the one place that reads the errors of the replicas'
loops and keeps their reports (`Strategy.replica_states()`). On one host:

- a replica's **error** is fatal: the loops stop, the input ends and the
  error is raised as its own type (`restated`: an error of TensorFlow's
  runtime that names a remote task is shortened to its first line, the
  replica and its task, with the runtime's error as its `runtime_error`
  and `__cause__`, which `fit` clears);
- a **hung replica** (its call neither fails nor returns while the others
  wait for it, `Strategy(worker_timeout=...)`, detected by
  `workers.ReplicaLoops`) is LOST, with a warning (`hung`), until its call
  answers, when it rejoins (`answered`).

On a cluster, `tf_diffmap.cluster.faults.ClusterRecord` adds what tasks that
are lost and come back do to the replicas on them.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
from collections.abc import Iterable, Sequence

import tensorflow as tf

from tf_diffmap.devices import task_name

__all__ = [
    "PS_TIMEOUT",
    "WORKER_TIMEOUT",
    "ReplicaRecord",
    "ReplicaReport",
    "named_tasks",
    "restated",
    "short_message",
    "with_cause",
]

logger = logging.getLogger("tf_diffmap")

# Seconds a replica may hold one shard while the others wait for it before
# its worker counts as hung (`Strategy(worker_timeout=...)`).
WORKER_TIMEOUT = 60.0
# Seconds without any update applied, while updates wait, before a cluster's
# parameter servers are probed (`Strategy(ps_timeout=...)`).
PS_TIMEOUT = 60.0

_TASK = re.compile(r"/job:(worker|ps|chief)/replica:0/task:(\d+)")


@dataclasses.dataclass(frozen=True)
class ReplicaReport:
    """One replica's state, as `Strategy.replica_states()` reports it.

    Attributes:
        replica: the replica id.
        device: the replica's device.
        state: "running", "stopped", "failed", "lost" or "rejoining"; on a
            cluster that grows and shrinks also "absent" (no worker holds
            its slot: not joined yet, or left), "joining" or "leaving".
        since: wall-clock time (`time.time()`) of the last change of state
            caused by a fault, or None.
        error: the error that made it lost, while it is lost; None once it
            runs again.
        lost: how many times this replica was lost.
    """

    replica: int
    device: str
    state: str
    since: float | None = None
    error: BaseException | None = None
    lost: int = 0


def named_tasks(error: BaseException) -> list[str]:
    """The tasks an error's message names, in order of first mention."""
    found = [f"/job:{job}/replica:0/task:{index}" for job, index in _TASK.findall(str(error))]
    return list(dict.fromkeys(found))


def short_message(error: BaseException) -> str:
    """The first line that says what went wrong, without the runtime's trail."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    for line in lines:
        root = re.match(r"\(\d+\)\s+[A-Z_]+:\s*(.*)", line)
        if root and root.group(1):
            return root.group(1)
    for line in lines:
        if not line.startswith(("Graph execution error", "Detected at node", "<stack traces")):
            return re.sub(r"\s*\[Op:[^\]]*\]", "", line)
    return type(error).__name__


def with_cause(new: BaseException, cause: BaseException) -> BaseException:
    """`new`, with `cause` as its `__cause__` and its `runtime_error`.

    Keras' and TensorFlow's traceback filtering re-raise what `fit` raises
    `from None`, which clears `__cause__`; an attribute of the error itself
    survives that, so the runtime's details stay reachable.
    """
    new.__cause__ = cause
    new.runtime_error = cause
    return new


def restated(error: BaseException, replica: int, device: str) -> BaseException:
    """A replica's own error, as raised: its type, short, naming its task.

    An error of TensorFlow's runtime that names a remote task comes back as
    the same type with its first line, the replica and its task; the
    runtime's full error is the cause. Other errors are returned as they are.
    """
    if not isinstance(error, tf.errors.OpError) or not named_tasks(error):
        return error
    message = f"{short_message(error)} (replica {replica} on {task_name(device)})"
    try:
        new = type(error)(error.node_def, error.op, message)
    except TypeError:
        return error
    return with_cause(new, error)


class ReplicaRecord:
    """Decides what a replica's error means, and keeps the replicas' record.

    Each error of a replica's loop becomes a verdict, the replica's next
    state (`workers.ReplicaState` values, by name, so that the record does
    not depend on the loops): on one host always "failed", with the error
    to raise (`restated`). A hung replica is lost alone (`group_of`).

    Args:
        replica_devices: the device of each replica.
        absent: the replicas whose slot no worker holds yet.
    """

    def __init__(self, replica_devices: Sequence[str], absent: Iterable[int] = ()):
        self.replica_devices = list(replica_devices)
        self._lock = threading.Lock()
        self._absent: set[int] = set(absent)
        self._reports = [
            ReplicaReport(replica=r, device=d, state="absent" if r in self._absent else "running")
            for r, d in enumerate(self.replica_devices)
        ]
        self._lost: set[int] = set()

    # -- what the runtime asks ---------------------------------------------

    def verdict(self, replica_id: int, error: BaseException) -> tuple[str, BaseException | None]:
        """What a replica's error means: (next state, error to raise or None)."""
        return "failed", restated(error, replica_id, self.replica_devices[replica_id])

    def store_error(self, error: BaseException) -> BaseException:
        """What an error of a call to the store made outside the replicas'
        loops (the window timer's) means: the error to raise. On one host,
        the error itself."""
        return error

    def transient_store_error(self, error: BaseException) -> bool:
        """Whether an error of a call to the store made outside the loops
        (the window timer's, and those of `Runtime.store_call`: after a
        call was cut off) reports a worker's loss, not the store's: the call
        is made again. Never on one host."""
        return False

    def store_lost(self) -> bool:
        """Whether the parameter store is lost (never on one host)."""
        return False

    def group_of(self, replica_id: int) -> list[int]:
        """The replicas that hang with one: itself on one host."""
        return [replica_id]

    def hung(self, replica_id: int, group: Sequence[int], seconds: float) -> None:
        """A replica's call did not answer for `seconds` while the others
        waited (it held a shard, or did not take its STOP): its group is lost
        until it answers (one warning)."""
        self._mark_lost(group)
        logger.warning(
            "%s did not answer for %.0f s (worker_timeout) while the others waited "
            "for it; its replicas %s are treated as lost and the work goes on with "
            "the others. They rejoin when it answers.",
            self._hung_where(replica_id),
            seconds,
            list(group),
        )

    def answered(self, group: Sequence[int]) -> None:
        """Every hung call of a group answered: its replicas are back."""
        self._mark_running(group)
        self._log_answered(group)

    def stalled(self, seconds: float) -> BaseException | None:
        """No update applied for `seconds` while updates wait: the error to
        raise if that is fatal (never on one host: the store is local)."""
        return None

    def lost(self) -> set[int]:
        """The replicas lost now."""
        with self._lock:
            return set(self._lost)

    def absent(self) -> set[int]:
        """The replicas whose slot no worker holds now."""
        with self._lock:
            return set(self._absent)

    def reports(self) -> list[ReplicaReport]:
        """Each replica's report, as the record knows it."""
        with self._lock:
            return list(self._reports)

    def threads(self) -> list[threading.Thread]:
        """The record's own threads, alive now (none on one host)."""
        return []

    def pause(self) -> None:
        """Nothing trains: nothing to watch (see `ClusterRecord`)."""

    def resume(self) -> None:
        """Training starts again (see `ClusterRecord`)."""

    def stop(self) -> None:
        """Stops the record's threads (none on one host)."""

    # -- for the record of a cluster ----------------------------------------

    def _hung_where(self, replica_id: int) -> str:
        """What the warning of a hung replica names."""
        return f"replica {replica_id} ({self.replica_devices[replica_id]})"

    def _log_answered(self, group: Sequence[int]) -> None:
        logger.warning("replica %s answers again and rejoined.", ", ".join(map(str, group)))

    def _mark_lost(
        self,
        replicas: Iterable[int],
        error: BaseException | None = None,
        again: bool = True,
    ) -> tuple[bool, set[int]]:
        """Marks replicas lost, each counted once more.

        Args:
            replicas: the replicas.
            error: the error that showed it, for their reports; None keeps
                what their reports hold.
            again: whether a replica already lost is marked (and counted)
                once more.

        Returns:
            Whether any of them was not lost before, and every replica lost
            now.
        """
        replicas = list(replicas)
        with self._lock:
            first = not self._lost.issuperset(replicas)
            self._lost.update(replicas)
            for r in replicas:
                report = self._reports[r]
                if again or report.state != "lost":
                    self._reports[r] = dataclasses.replace(
                        report,
                        state="lost",
                        since=time.time(),
                        error=report.error if error is None else error,
                        lost=report.lost + 1,
                    )
            return first, set(self._lost)

    def mark_absent(self, replicas: Iterable[int]) -> None:
        """Replicas whose worker left (or, lost, is gone for good): absent
        since now, neither lost nor counted as lost once more."""
        replicas = list(replicas)
        with self._lock:
            self._lost.difference_update(replicas)
            self._absent.update(replicas)
            for r in replicas:
                self._reports[r] = dataclasses.replace(
                    self._reports[r], state="absent", since=time.time(), error=None
                )

    def mark_present(self, replicas: Iterable[int]) -> None:
        """Replicas whose slot a worker joined: running since now."""
        replicas = list(replicas)
        with self._lock:
            self._absent.difference_update(replicas)
            for r in replicas:
                self._reports[r] = dataclasses.replace(
                    self._reports[r], state="running", since=time.time(), error=None
                )

    def _mark_running(self, replicas: Iterable[int]) -> None:
        """Replicas back: no longer lost, running since now."""
        replicas = list(replicas)
        with self._lock:
            self._lost.difference_update(replicas)
            for r in replicas:
                # The error that made it lost is over: `lost` keeps the count.
                self._reports[r] = dataclasses.replace(
                    self._reports[r], state="running", since=time.time(), error=None
                )
