"""Faults across hosts: which task was lost, what it costs, how it comes back.

On a cluster a replica's loop runs on a worker task and updates variables on
the ps tasks, so a lost task shows up as an error raised by a loop call. The
runtime names the task it could not reach in the message
(`... from remote target /job:worker/replica:0/task:1 ...`), as
`ParameterServerStrategy`'s own fault handling reads it; a message can name
several tasks (a ps relays the error of a worker it was receiving from), so
the tasks named are *probed*: a tiny op on each task's CPU, which fails at once
on a task that is down (the chief connects with `GRPC_FAIL_FAST=use_caller`).

What each fault does (the replicas' states are `workers.ReplicaState`):

- a **lost worker**: the replicas of that worker become LOST; the strategy's
  failure flag is not set, the other replicas go on. The shard a lost replica
  held (a token on a cluster) goes back on the queue for a live replica if
  its step had not marked its claim on a store version; otherwise it is
  *abandoned*, with its claim (counted when the loops are next idle, so that
  version = completed + abandoned). See `loops.HeldShard`.
  A `Rejoiner` thread probes the lost workers about once a second; once one
  serves again, it reconnects the cluster (`update_server_def`), rebuilds
  that worker's input pipeline and restarts its replicas (REJOINING, then
  RUNNING).
- a **hung worker** (its calls neither fail nor return, `worker_timeout`;
  detected by `workers.ReplicaLoops`): its replicas are LOST, with a
  warning (`ReplicaRecord.hung`, which one host shares), until its calls
  answer, when they rejoin (`ReplicaRecord.answered`); a hung worker that
  dies is lost as above.
- **every replica lost**, and a **lost ps**: fatal. The loops stop, the input
  ends and the error is raised as `tf.errors.UnavailableError` naming the
  task(s), with the runtime's error as its `runtime_error` (and `__cause__`).
- any other error of a replica: raised as its own type; on a cluster its
  message is shortened to its first line and the task, with the runtime's
  error as its `runtime_error` (and `__cause__`, which `fit` clears)
  (`tf_diffmap.engine.replicas.restated`).

`ClusterRecord` is the replicas' record of a cluster: `replicas.ReplicaRecord`
with the verdicts above and the rejoiner.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence

import tensorflow as tf

from tf_diffmap import _tf_internal
from tf_diffmap.devices import task_name, task_parts
from tf_diffmap.engine.replicas import ReplicaRecord, named_tasks, short_message, with_cause

__all__ = [
    "ClusterRecord",
    "Fault",
    "Rejoiner",
    "classify",
    "hung_ps_error",
    "lost_ps_error",
    "lost_replicas_error",
    "unreachable",
    "wait_for_tasks",
]

logger = logging.getLogger("tf_diffmap")

# How often the rejoiner looks again at a lost worker.
PROBE_SECONDS = 1.0
# How long a ps task has to accept a connection once updates stalled.
PS_PROBE_SECONDS = 5.0
# A replica whose calls fail this often within RETRY_WINDOW seconds because
# of another task is failed, not retried again.
RETRIES = 5
RETRY_WINDOW = 10.0

# Keras warns that the input ran out of data when a fatal error ends it.
INPUT_ENDED = " Keras' 'Your input ran out of data' warning above is this stop, not the dataset."

# Words of the runtime's messages when a peer is gone.
_CONNECTION_WORDS = (
    "socket closed",
    "connection reset",
    "connection refused",
    "failed to connect",
    "connect failed",
    "broken pipe",
    "unable to find a context_id",
    "unable to find the relevant tensor remote_handle",
    "unavailable",
)


@dataclasses.dataclass(frozen=True)
class Fault:
    """A task that a replica could not reach.

    Attributes:
        job: "worker" or "ps".
        task: its full name, `/job:<job>/replica:0/task:<N>`.
    """

    job: str
    task: str


def unreachable(error: BaseException) -> bool:
    """Whether an error is of the kinds the runtime raises for a lost peer."""
    if isinstance(error, (tf.errors.UnavailableError, tf.errors.DeadlineExceededError)):
        return True
    if isinstance(
        error, (tf.errors.CancelledError, tf.errors.AbortedError, tf.errors.UnknownError)
    ):
        text = str(error).lower()
        return any(word in text for word in _CONNECTION_WORDS)
    if isinstance(error, tf.errors.InvalidArgumentError):
        # A task restarted between two calls: the new server does not know
        # the client's context (ParameterServerStrategy's own classification).
        text = str(error).lower()
        return "unable to find" in text or "unknown device" in text
    return False


def task_answers(task: str) -> bool:
    """Whether a task runs a tiny op now (fails at once when it is down).

    An op for one task can fail with another's error: the runtime reports,
    on the next op of this client, a worker that just died under an earlier
    one. Such a failure says nothing of this task, whose server is then
    asked whether it accepts a connection (`serves`).
    """
    try:
        with tf.device(f"{task}/device:CPU:0"):
            tf.identity(tf.constant(0)).numpy()
        return True
    except (tf.errors.OpError, ValueError, RuntimeError) as error:
        logger.debug("%s does not answer: %s", task, error)
        if says_down(task, error):
            return False
    address = _tf_internal.cluster_addresses().get(task)
    return address is not None and serves(address, PROBE_SECONDS)


def says_down(task: str, error: BaseException) -> bool:
    """Whether a probe's error is about `task` itself: it names that task,
    or no task at all."""
    named = named_tasks(error)
    return not named or task in named


def classify(error: BaseException, answers: Callable[[str], bool] = task_answers) -> Fault | None:
    """The task whose loss an error reports, or None for any other error.

    Args:
        error: what a replica's loop raised.
        answers: the probe of one task (by default a tiny op on its CPU).

    Returns:
        The lost ps task if any named ps task does not answer, else the first
        named worker task that does not answer; with every named task
        answering, the first named worker (a worker that restarted between
        two calls answers, but has lost what it held). None when the error is
        not of a kind that reports an unreachable task, or names none.
    """
    if not unreachable(error):
        return None
    tasks = [t for t in named_tasks(error) if not t.startswith("/job:chief")]
    if not tasks:
        return None
    # The ps first: a probe of a lost worker can make the next probe fail
    # with that worker's error.
    down = [t for t in sorted(tasks, key=lambda t: not t.startswith("/job:ps/")) if not answers(t)]
    for job in ("ps", "worker"):
        for task in down:
            if task.startswith(f"/job:{job}/"):
                return Fault(job, task)
    workers = [t for t in tasks if t.startswith("/job:worker/")]
    return Fault("worker", workers[0]) if workers else None


def lost_ps_error(fault: Fault, error: BaseException) -> tf.errors.UnavailableError:
    """The error raised for a lost ps task: what was lost and what to do."""
    message = (
        f"The parameter server {fault.task} is unreachable ({short_message(error)}); "
        "the model's variables on it are lost, and training stopped. Restart that "
        "ps task, then resume: with keras.callbacks.BackupAndRestore in fit's "
        "callbacks, run the same fit again; otherwise load the last checkpoint "
        "(model.load_weights or tf.train.Checkpoint) and fit again." + INPUT_ENDED
    )
    return with_cause(tf.errors.UnavailableError(None, None, message), error)


def hung_ps_error(task: str, seconds: float) -> tf.errors.UnavailableError:
    """The error raised for a ps task that does not answer (`ps_timeout`)."""
    message = (
        f"The parameter server {task} did not answer for {seconds:.0f} s (ps_timeout) "
        "while updates waited for it: it is paused, wedged, or cut off from this "
        "host by the network, and training stopped. Its variables may still be "
        "there: if it answers again, run the same fit again. Otherwise restart "
        "that ps task, then resume: with keras.callbacks.BackupAndRestore in fit's "
        "callbacks, run the same fit again; otherwise load the last checkpoint "
        "(model.load_weights or tf.train.Checkpoint) and fit again." + INPUT_ENDED
    )
    return tf.errors.UnavailableError(None, None, message)


def lost_replicas_error(tasks: Sequence[str], error: BaseException) -> tf.errors.UnavailableError:
    """The error raised once every replica is lost."""
    message = (
        f"Every replica is lost: worker task(s) {', '.join(tasks)} are unreachable "
        f"(last: {short_message(error)}), and no replica is left to train. Restart "
        "the worker tasks and run fit again (keras.callbacks.BackupAndRestore "
        "resumes at the epoch it stopped in)." + INPUT_ENDED
    )
    return with_cause(tf.errors.UnavailableError(None, None, message), error)


class Rejoiner:
    """A thread that brings lost workers back once they serve again.

    Every `PROBE_SECONDS` it asks gRPC whether each lost worker's address
    accepts a connection (without waiting for it); once one does, it
    reconnects the cluster with the runtime's own `update_server_def` (which
    makes a fresh context on a restarted task) and calls `on_back(task)`,
    which rebuilds that worker's input and restarts its replicas. The thread
    ends when no worker is lost, or at `stop()`.

    Args:
        on_back: called with the task name of a worker that serves again.
        address_of: a task name to its `host:port`.
        reconnect: `task -> bool`, reconnects the cluster for a worker that
            serves again; False: not now (tried again at the next probe).
            By default `_tf_internal.reconnect_cluster`.
    """

    def __init__(
        self,
        on_back: Callable[[str], None],
        address_of: Callable[[str], str | None],
        reconnect: Callable[[str], bool] | None = None,
    ):
        self._on_back = on_back
        self._address_of = address_of
        self._reconnect = reconnect or (lambda task: _tf_internal.reconnect_cluster() or True)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._lost: set[str] = set()
        self._stopping = False
        self._thread: threading.Thread | None = None

    def watch(self, task: str | None = None) -> None:
        """Starts probing a lost worker task (or, with None, those still lost)."""
        with self._lock:
            if task is not None:
                self._lost.add(task)
            self._stopping = False
            if self._lost and (self._thread is None or not self._thread.is_alive()):
                self._thread = threading.Thread(
                    target=self._run, name="tf_diffmap-rejoin", daemon=True
                )
                self._thread.start()

    def lost(self) -> set[str]:
        with self._lock:
            return set(self._lost)

    def forget(self, task: str) -> None:
        """Stops probing a lost worker that is gone for good (it left)."""
        with self._lock:
            self._lost.discard(task)

    def stop(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._stopping = True
            self._wake.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def threads(self) -> list[threading.Thread]:
        with self._lock:
            return [self._thread] if self._thread is not None and self._thread.is_alive() else []

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._stopping or not self._lost:
                    self._thread = None
                    return
                lost = sorted(self._lost)
            for task in lost:
                address = self._address_of(task)
                if address is None or not serves(address, PROBE_SECONDS / 2):
                    continue
                try:
                    if not self._reconnect(task):
                        continue
                    self._on_back(task)
                except Exception as error:  # noqa: BLE001 - tried again at the next probe
                    logger.warning("%s serves again but did not rejoin: %s", task, error)
                    continue
                with self._lock:
                    self._lost.discard(task)
            with self._lock:
                if not self._stopping:
                    self._wake.wait(PROBE_SECONDS)


def accepts(address: str, timeout: float) -> bool:
    """Whether anything accepts a TCP connection at `address` within
    `timeout`: a server, or a paused one (its kernel still accepts)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def _set_task(task: str, address: str | None) -> None:
    job, _, index = task_parts(task)
    _tf_internal.set_cluster_task(job, index, address)


def serves(address: str, timeout: float) -> bool:
    """Whether a gRPC server accepts a connection at `address` within `timeout`.

    A port that refuses the connection (a task that is down) answers False
    at once; gRPC's own readiness would wait out the whole `timeout`.
    """
    import grpc

    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except (OSError, ValueError):
        return False
    channel = grpc.insecure_channel(address)
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout)
        return True
    except grpc.FutureTimeoutError:
        return False
    finally:
        channel.close()


def wait_for_tasks(addresses: dict[str, str], timeout: float) -> None:
    """Waits until every task serves; raises, naming those that do not.

    Args:
        addresses: task name to `host:port`.
        timeout: seconds to wait in all.

    Raises:
        tf.errors.UnavailableError: some tasks did not serve within `timeout`.
    """
    deadline = time.monotonic() + timeout
    waiting = dict(addresses)
    while True:
        waiting = {
            task: address
            for task, address in waiting.items()
            if not serves(address, max(0.05, min(1.0, deadline - time.monotonic())))
        }
        if not waiting or time.monotonic() >= deadline:
            break
    if waiting:
        named = ", ".join(f"{task} ({address})" for task, address in sorted(waiting.items()))
        raise tf.errors.UnavailableError(
            None,
            None,
            f"Cluster tasks did not answer within {timeout:g} s: {named}. Start them "
            "(python -m tf_diffmap.cluster with their TF_CONFIG) and run again, or "
            "wait longer with connect_timeout=... .",
        )


class ClusterRecord(ReplicaRecord):
    """The replicas' record on a cluster: lost tasks, and workers that rejoin.

    Each error of a replica's loop becomes a verdict, the replica's next
    state:

    - "lost": the replica's own worker task is unreachable;
    - "running": another task was unreachable during its call (a call
      cancelled because a worker it exchanged with went down): the replica
      goes on, what it held goes back on the queue;
    - "failed": fatal, with the error to raise (a lost ps, every replica
      lost, or the replica's own error, restated).

    A hung replica is lost with every replica of its worker task.

    Args:
        replica_devices: the device of each replica.
        on_back: `(task, replica_ids) -> None`, called from the rejoiner's
            thread once a lost worker serves again and the cluster is
            reconnected: rebuild its input and restart its replicas.
        absent: the replicas whose slot no worker holds yet (a cluster
            that grows, `tf_diffmap.cluster.membership`).
    """

    def __init__(
        self,
        replica_devices: Sequence[str],
        on_back: Callable[[str, list[int]], None],
        absent: Sequence[int] = (),
    ):
        super().__init__(replica_devices, absent)
        self._on_back = on_back
        self._faults_lock = threading.Lock()
        self._retries: dict[int, list[float]] = {}
        self.ps_lost: Fault | None = None
        # Lost workers taken out of the cluster, with their addresses.
        self._removed: dict[str, str] = {}
        self._cluster_lock = threading.Lock()
        self.rejoiner = Rejoiner(self._back, self.address_of, self._reconnect)

    def replicas_of(self, task: str) -> list[int]:
        """The replicas on a task."""
        return [r for r, d in enumerate(self.replica_devices) if task_name(d) == task]

    def address_of(self, task: str) -> str | None:
        """A task's `host:port`: in the cluster, or taken out while lost."""
        return _tf_internal.cluster_addresses().get(task) or self._removed.get(task)

    def change_cluster(
        self,
        add: dict[str, str] | None = None,
        remove: Sequence[str] = (),
        keep: Sequence[str] = (),
    ) -> bool:
        """Adds and removes worker tasks of the eager context's cluster.

        TensorFlow's `update_server_def` asks every task of the cluster for
        its state and waits for each: one that is down holds it until it
        serves again (the client waits for its devices), and one that is
        paused or cut off until it answers. So the workers lost or gone
        that are still in the cluster are taken out first, those that
        refuse connections (down: the client's request fails at once), and
        their addresses kept for their rejoining; while one accepts a
        connection without serving (paused, cut off, starting), nothing
        changes.

        Args:
            add: worker tasks to add, with their addresses.
            remove: worker tasks to remove (they must still serve).
            keep: lost tasks not to take out (one that rejoins).

        Returns:
            Whether the cluster was changed; False: not now.
        """
        add = dict(add or {})
        with self._cluster_lock:
            addresses = _tf_internal.cluster_addresses()
            gone = {task_name(self.replica_devices[r]) for r in self.lost() | self.absent()}
            gone = [t for t in sorted(gone) if t in addresses and t not in remove and t not in keep]
            if any(accepts(addresses[t], PROBE_SECONDS) for t in gone):
                return False
            lost = self.lost_tasks()
            for task in gone:
                if task in lost:
                    self._removed[task] = addresses[task]
                _set_task(task, None)
            for task in remove:
                _set_task(task, None)
            for task, address in add.items():
                _set_task(task, address)
                self._removed.pop(task, None)
        self._quiet_tasks()
        return True

    def lost_tasks(self) -> set[str]:
        """The worker tasks whose replicas are lost now."""
        return {task_name(self.replica_devices[r]) for r in self.lost()}

    def _reconnect(self, task: str) -> bool:
        """The cluster, reconnected for a lost worker that serves again."""
        if task in self._removed:
            return self.change_cluster(add={task: self._removed[task]}, keep=[task])
        if not self.change_cluster(keep=[task]):
            return False
        _tf_internal.reconnect_cluster()
        return True

    def verdict(self, replica_id: int, error: BaseException) -> tuple[str, BaseException | None]:
        """What a replica's error means: (next state, error to raise or None)."""
        device = self.replica_devices[replica_id]
        fault = classify(error)
        if fault is None:
            return super().verdict(replica_id, error)
        if fault.job == "ps":
            return "failed", self._ps_lost(fault, error)
        if fault.task != task_name(device):
            now = time.monotonic()
            with self._faults_lock:
                recent = [t for t in self._retries.get(replica_id, []) if now - t < RETRY_WINDOW]
                self._retries[replica_id] = [*recent, now]
            if len(recent) < RETRIES:
                return "running", None
            return super().verdict(replica_id, error)
        lost = self.replicas_of(fault.task)
        first, now_lost = self._mark_lost(lost, error=error, again=False)
        if len(now_lost | self.absent()) == len(self.replica_devices):
            self.rejoiner.stop(timeout=0)
            tasks = sorted({task_name(self.replica_devices[r]) for r in now_lost})
            return "failed", lost_replicas_error(tasks, error)
        if first:
            logger.warning(
                "worker %s is unreachable (%s); its replicas %s are lost and "
                "the work goes on with the others. They rejoin when it serves again.",
                fault.task,
                short_message(error),
                lost,
            )
        self.rejoiner.watch(fault.task)
        return "lost", None

    def store_error(self, error: BaseException) -> BaseException:
        """What an error of a store call outside the replicas' loops (the
        window timer's) means: a lost ps, named as a replica's error names
        it; any other error as it is."""
        fault = classify(error)
        if fault is None or fault.job != "ps":
            return error
        return self._ps_lost(fault, error)

    def _ps_lost(self, fault: Fault, error: BaseException) -> tf.errors.UnavailableError:
        """A ps task is lost: kept (the store is lost), and its error."""
        with self._faults_lock:
            self.ps_lost = self.ps_lost or fault
        self.rejoiner.stop(timeout=0)
        return lost_ps_error(fault, error)

    def stalled(self, seconds: float) -> BaseException | None:
        """No update applied for `seconds` while updates wait: the first ps
        task that does not accept a connection within `PS_PROBE_SECONDS`
        (a paused or cut-off server never completes gRPC's handshake) is
        fatal, named in the error; None when every ps answers (a worker is
        slow or hung: `worker_timeout` is for it)."""
        addresses = _tf_internal.cluster_addresses()
        for task in sorted(t for t in addresses if t.startswith("/job:ps/")):
            if serves(addresses[task], PS_PROBE_SECONDS):
                continue
            with self._faults_lock:
                self.ps_lost = self.ps_lost or Fault("ps", task)
            self.rejoiner.stop(timeout=0)
            logger.warning("parameter server %s does not answer; training stops.", task)
            return hung_ps_error(task, seconds)
        return None

    def transient_store_error(self, error: BaseException) -> bool:
        """Whether an error of a store call outside the replicas' loops (the
        window timer's, and those of `Runtime.store_call`) may pass: any
        but a lost ps's. Made as a worker dies, restarts or joins, a call to
        the ps can fail naming the worker, or naming no task; the call is
        made again. A ps that is lost is found by the replicas' own calls
        and by the stall probe, and then ends training; these calls fail for
        good only then."""
        if self.store_lost():
            return False
        fault = classify(error)
        return fault is None or fault.job != "ps"

    def store_lost(self) -> bool:
        """Whether a ps task, and the variables on it, are lost."""
        return self.ps_lost is not None

    def group_of(self, replica_id: int) -> list[int]:
        """The replicas that hang with one: its worker task's."""
        return self.replicas_of(task_name(self.replica_devices[replica_id]))

    def threads(self) -> list[threading.Thread]:
        """The rejoiner's thread, while it is alive."""
        return self.rejoiner.threads()

    def pause(self) -> None:
        """No probing while nothing trains (the lost workers stay lost).

        Not waited for: a probe under way ends on its own, and a drain (at
        every epoch's end) must not wait for it.
        """
        self.rejoiner.stop(timeout=0)

    def resume(self) -> None:
        """Probing again for the workers still lost, as training starts.

        While a worker is lost, what was sent to the others (a restored
        weight, a new iterator) has run there before any loop starts
        (`_tf_internal.settle`).
        """
        if self.ps_lost is None:
            _tf_internal.settle()
            self.rejoiner.watch()

    def stop(self) -> None:
        self.rejoiner.stop()

    def _hung_where(self, replica_id: int) -> str:
        return f"worker {task_name(self.replica_devices[replica_id])}"

    def _log_answered(self, group: Sequence[int]) -> None:
        tasks = ", ".join(sorted({task_name(self.replica_devices[r]) for r in group}))
        logger.warning("worker %s answers again; its replicas %s rejoined.", tasks, list(group))

    def _mark_lost(self, replicas, error=None, again=True):
        result = super()._mark_lost(replicas, error=error, again=again)
        self._quiet_tasks()
        return result

    def _mark_running(self, replicas) -> None:
        super()._mark_running(replicas)
        self._quiet_tasks()

    def mark_absent(self, replicas) -> None:
        """Replicas whose worker left: not probed, nor waited for, any more."""
        replicas = list(replicas)
        super().mark_absent(replicas)
        for task in {task_name(self.replica_devices[r]) for r in replicas}:
            self.rejoiner.forget(task)
        self._quiet_tasks()

    def _quiet_tasks(self) -> None:
        """No remote request waits for the workers lost or hung now, nor for
        those that left and are still in the cluster (a function registered
        or dropped, `_tf_internal.quiet_tasks`)."""
        gone = {task_name(self.replica_devices[r]) for r in self.lost() | self.absent()}
        _tf_internal.quiet_tasks(gone & set(_tf_internal.cluster_addresses()))

    def _back(self, task: str) -> None:
        replicas = self.replicas_of(task)
        self._on_back(task, replicas)
        self._mark_running(replicas)
        logger.warning("worker %s serves again; replicas %s rejoined.", task, replicas)
