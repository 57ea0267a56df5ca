"""Who trains: the replicas that are lost, rejoin, join and leave, and the
input built on the workers they read.

`ReplicaMembers` is a base of `runtime.Runtime`: the part of the runtime's
state that changes as a cluster's workers come and go (its docstring's
"replicas' record", "input built on the workers" and "brings lost replicas
back"). It keeps the replicas' record (`replicas.ReplicaRecord`, or a
cluster's `cluster.faults.ClusterRecord`), answers for it (lost, absent and
hung replicas, each replica's report), builds and splits anew the input on
the workers (`cluster.inputs.WorkerInput`) under the members lock, and brings
the feeds' replicas in and out. On one host it imports nothing of
`tf_diffmap.cluster`: a cluster's record and input are imported where a
cluster needs them.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import tensorflow as tf

from tf_diffmap.devices import host_cpu, task_name
from tf_diffmap.engine.replica_state import ReplicaState
from tf_diffmap.engine.replicas import ReplicaRecord, ReplicaReport

if TYPE_CHECKING:
    from tf_diffmap.cluster.inputs import WorkerInput

__all__ = ["ReplicaMembers"]


class ReplicaMembers:
    """The replicas' record and the input on the workers (see the module's
    docstring), for `runtime.Runtime`, which sets what is declared here and
    gives its feeds (`feeds`)."""

    replica_devices: list[str]
    failed: tf.Variable
    record: ReplicaRecord
    # Per replica, the CPU of its worker task, on a cluster that reads its
    # input there; and that input.
    worker_hosts: list[str] | None
    worker_input: WorkerInput | None
    # Held while the workers' input is made or split anew, as workers join,
    # leave, rejoin, or a new `fit` distributes its dataset.
    _members_lock: threading.RLock
    _kept_functions: list
    _absent_at_start: list[int]

    def feeds(self) -> list:
        """The training steps' feeds (`runtime.Feed`), which `Runtime` keeps."""
        raise NotImplementedError

    def recheck_windows(self) -> None:
        """A call was cut off or replicas were lost: the window timers,
        which `Runtime` keeps, look at the window open now."""
        raise NotImplementedError

    def _new_record(self) -> ReplicaRecord:
        """The replicas' record: a cluster's when a replica is on a task of
        one (`/job:...`), else one host's, and the cluster's modules are not
        imported."""
        if not any(d.startswith("/job:") for d in self.replica_devices):
            return ReplicaRecord(self.replica_devices, self._absent_at_start)
        from tf_diffmap.cluster.faults import ClusterRecord

        return ClusterRecord(
            self.replica_devices, on_back=self._rejoin, absent=self._absent_at_start
        )

    def keep_functions(self, functions) -> None:
        """Functions to keep alive while a worker is lost (see
        `runtime.Runtime.__init__`)."""
        self._kept_functions.extend(functions)

    # -- lost and hung replicas -------------------------------------------

    def _rejoin(self, task: str, replica_ids: list[int], restarted: bool = True) -> None:
        """A lost worker serves again (called from the rejoiner's thread), or
        a hung one answers (`restarted` False; from its last call's thread)."""
        if self.worker_input is not None and task:
            with self._members_lock:
                self.worker_input.rebuild(task, restarted)
        for feed in self.feeds():
            feed.rejoin(replica_ids)
        if not self.lost_tasks() - {task}:
            # Every task serves (the rejoined one knows every function).
            self._kept_functions.clear()

    # -- workers that join and leave -----------------------------------------

    def absent_replicas(self) -> set[int]:
        """The replica slots no worker holds now."""
        return self.record.absent()

    def absent_tasks(self) -> set[str]:
        """The worker tasks whose replicas are all absent now."""
        absent = self.record.absent()
        tasks = {task_name(d) for d in self.replica_devices}
        return {
            task
            for task in tasks
            if all(r in absent for r, d in enumerate(self.replica_devices) if task_name(d) == task)
        }

    def join_replicas(self, task: str, replica_ids: Sequence[int]) -> None:
        """A worker joined (its task is in the cluster now): its input is
        built, the data split anew over the workers present, and its
        replicas start (called from the membership's thread)."""
        with self._members_lock:
            self.record.mark_present(replica_ids)
            if self.worker_input is not None:
                self.worker_input.reshard(self.lost_tasks(), self.absent_tasks())
            for feed in self.feeds():
                feed.join(replica_ids)

    def leave_replicas(
        self, task: str, replica_ids: Sequence[int], timeout: float | None
    ) -> list[int]:
        """A worker leaves: its replicas finish the shards they hold and
        end, the data is split anew over the others, and what its input
        held on it is let go while it still serves.

        A background event: the wait for the leaving replicas' calls holds
        no lock that a step, a new input or a rejoining worker takes, and
        the windows stop counting them at once (`_present_replicas`), so
        the others train on throughout.

        Returns:
            The replicas whose calls did not end within `timeout`.
        """
        stuck: list[int] = []
        for feed in self.feeds():
            stuck.extend(feed.leave(replica_ids, timeout))
        with self._members_lock:
            self.record.mark_absent(replica_ids)
            if self.worker_input is not None:
                self.worker_input.reshard(self.lost_tasks(), self.absent_tasks())
        return sorted(set(stuck))

    def group_of(self, replica_id: int) -> list[int]:
        """The replicas that hang with one (`workers.HangHandler`)."""
        return self.record.group_of(replica_id)

    def hung(self, replica_id: int, group, seconds: float) -> None:
        self.record.hung(replica_id, group, seconds)
        self.recheck_windows()

    def answered(self, group) -> None:
        self.record.answered(group)
        self._rejoin(task_name(self.replica_devices[group[0]]), list(group), restarted=False)

    def lost_tasks(self) -> set[str]:
        """The tasks whose replicas are lost now."""
        return {task_name(self.replica_devices[r]) for r in self.record.lost()}

    def replica_states(self) -> list[ReplicaReport]:
        """Each replica's report, its state as its loops see it."""
        running = {r: "running" for r in range(len(self.replica_devices))}
        for feed in self.feeds():
            for r, state in enumerate(feed.states()):
                if state is not ReplicaState.RUNNING:
                    running[r] = state.value
        return [
            report
            if report.state in ("lost", "absent") and running[r] != "leaving"
            else dataclasses.replace(report, state=running[r])
            for r, report in enumerate(self.record.reports())
        ]

    # -- input on the workers ---------------------------------------------

    def read_input_on_workers(self) -> None:
        """Datasets given to the strategy are built on each replica's worker
        task (on a cluster), rather than on this host and sent through."""
        self.worker_hosts = [host_cpu(d) for d in self.replica_devices]

    def new_worker_input(self, **source) -> WorkerInput:
        """A new input on the workers, which replaces the current one."""
        from tf_diffmap.cluster.inputs import WorkerInput

        with self._members_lock:
            lost = self.lost_tasks()
            if not lost:
                self._kept_functions.clear()
            elif self.worker_input is not None:
                self._kept_functions.extend(self.worker_input.functions())
            self.worker_input = WorkerInput(
                self.worker_hosts, self.failed, lost=lost, absent=self.absent_tasks(), **source
            )
            return self.worker_input

    def worker_input_for(self, specs) -> WorkerInput | None:
        """The input on the workers that a new feed reads, if any.

        A feed given tokens of the latest distributed dataset reads its
        shards on the workers; one given real batches (a custom loop's
        tensors) gets them through the queue.
        """
        source = self.worker_input
        if source is None:
            return None
        flat = tf.nest.flatten(source.element_spec)
        same = len(flat) == len(specs) and all(
            a.dtype == b.dtype and a.shape.rank == b.shape.rank for a, b in zip(flat, specs)
        )
        return source if same else None
