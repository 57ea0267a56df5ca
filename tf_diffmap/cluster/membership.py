"""Elastic membership: worker tasks that join a running cluster, and leave it.

The chief's `Membership` keeps one *slot* per worker task the cluster may
hold (`strategy_for_cluster(max_workers=...)`): the workers of the first
cluster spec hold theirs from the start, the others are empty. Every
per-replica count of the strategy (the store's counters and ledger, the
loops' cells, the queue) is sized for every slot's replicas when the
strategy is made, so that a replica that joins later has its place: until
then it is *absent* (`workers.ReplicaState.ABSENT`), and the replicas
present take its shards.

Workers announce themselves through a small endpoint the chief serves beside
its TensorFlow server (by default at the chief's port + 1): one JSON request
per connection, one JSON reply.

- **join** `{"join": {"address": "host:port", "index": N or null}}`: a
  worker asks for slot N (the index its `TF_CONFIG` or its pod's ordinal
  gives), or for any empty slot, and is told its index and the cluster. The
  chief then waits for it to serve at that address and adds its task to the
  eager context's cluster (`_tf_internal.set_cluster_task`, TensorFlow's
  `update_server_def`): the client makes a remote context on it and sends it
  every function registered so far, and the other tasks learn its address.
  Its devices must be those of the first worker's (type and count); its
  input is built on it, the data is split anew over the workers present,
  and its replicas start. A worker that already holds the slot at that
  address (a first worker, or one restarted) is told so, and nothing
  changes: a restarted worker rejoins through `faults.Rejoiner`.
- **leave** `{"leave": {"index": N}}`: a worker that is about to stop
  (scale-down, or SIGTERM as a preemption notice) asks to leave. Its
  replicas are fenced off the queue; each finishes the shard its loop call
  holds (a call that waits for an item gives it back) and ends, so nothing
  is lost and nothing waits for `worker_timeout`; the data is split anew
  over the others; its task is removed from the cluster while it still
  serves; and the reply lets it exit. The last worker present may not
  leave while replicas train: it is refused, and if it exits anyway it is a
  lost worker (every replica lost ends `fit`).
- **status** `{"status": {}}`: each slot's state and address.

A slot's life is a `SlotState`; `Membership` is the one place that changes
it.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import tensorflow as tf

from tf_diffmap.cluster.faults import PROBE_SECONDS, serves
from tf_diffmap.devices import task_parts

if TYPE_CHECKING:
    from tf_diffmap.engine.runtime import Runtime

__all__ = [
    "JOIN_TIMEOUT",
    "LEAVE_TIMEOUT",
    "MEMBERSHIP_PORT_OFFSET",
    "Membership",
    "SlotState",
    "WorkerSlot",
    "join_command",
    "request",
]

logger = logging.getLogger("tf_diffmap")

MEMBERSHIP_PORT_OFFSET = 1
"""The chief serves its membership endpoint at its own port plus this, by default."""

JOIN_TIMEOUT = 120.0
"""Seconds a worker that was given a slot has to serve before the slot is freed."""

LEAVE_TIMEOUT = 30.0
"""Seconds a leaving worker's replicas have to finish their shards."""

# The largest request or reply, in bytes.
_MAX_MESSAGE = 1 << 16
# Hosts that reach only this machine.
_LOOPBACK = ("127.0.0.1", "localhost")


class SlotState(enum.Enum):
    """Where one worker slot is. Every transition, and what causes it::

        EMPTY    --a worker asks to join it-->               EXPECTED
        EXPECTED --it serves; its task added, replicas in--> MEMBER
        EXPECTED --it did not serve within JOIN_TIMEOUT-->   EMPTY
        EXPECTED --its devices are not the first worker's--> EMPTY
        MEMBER   --it asks to leave-->                       LEAVING
        LEAVING  --its replicas ended, its task removed-->   EMPTY

    Only `Membership._move` changes a state, and refuses any other change.
    A MEMBER whose worker is lost stays a MEMBER (its replicas are "lost",
    and rejoin when it serves again).
    """

    EMPTY = "empty"
    EXPECTED = "expected"
    MEMBER = "member"
    LEAVING = "leaving"


_MOVES = {
    (SlotState.EMPTY, SlotState.EXPECTED),
    (SlotState.EXPECTED, SlotState.MEMBER),
    (SlotState.EXPECTED, SlotState.EMPTY),
    (SlotState.MEMBER, SlotState.LEAVING),
    (SlotState.LEAVING, SlotState.EMPTY),
}


@dataclasses.dataclass
class WorkerSlot:
    """One worker task the cluster may hold.

    Attributes:
        index: the worker task's index.
        replicas: the ids of its replicas.
        devices: the devices its replicas are on.
        state: where it is.
        address: the `host:port` of the worker that holds it (or is expected).
        since: `time.monotonic()` of its last change.
    """

    index: int
    replicas: list[int]
    devices: list[str]
    state: SlotState = SlotState.EMPTY
    address: str | None = None
    since: float = dataclasses.field(default_factory=time.monotonic)

    @property
    def task(self) -> str:
        return f"/job:worker/replica:0/task:{self.index}"


def join_command(endpoint: str, devices: Sequence[str]) -> str:
    """The shell command that starts a worker and joins it to the cluster.

    Args:
        endpoint: the chief's membership endpoint, `host:port`.
        devices: the devices of a worker slot (those of the first worker):
            several CPUs are a worker's `--logical-cpus`.

    Returns:
        `python -m tf_diffmap.cluster --join ENDPOINT ...` after `env -u
        TF_CONFIG`: a worker that joins this way asks for a free slot, and a
        TF_CONFIG left in its environment (the chief's, in the same shell)
        would name another task. On a chief at a loopback address, the
        worker is given one too (`--address 127.0.0.1`, on a free port), so
        that the others reach it on this machine.

    Examples:
        >>> from tf_diffmap.cluster.membership import join_command
        >>> join_command("10.0.0.5:2223", ["/job:worker/replica:0/task:0/device:GPU:0"])
        'env -u TF_CONFIG python -m tf_diffmap.cluster --join 10.0.0.5:2223'
        >>> cpus = [f"/job:worker/replica:0/task:0/device:CPU:{i}" for i in range(2)]
        >>> join_command("127.0.0.1:47866", cpus)  # doctest: +NORMALIZE_WHITESPACE
        'env -u TF_CONFIG python -m tf_diffmap.cluster --join 127.0.0.1:47866
         --logical-cpus 2 --address 127.0.0.1'
    """
    words = ["env", "-u", "TF_CONFIG", "python", "-m", "tf_diffmap.cluster", "--join", endpoint]
    cpus = [d for d in devices if "/device:CPU:" in d]
    if len(cpus) > 1 and len(cpus) == len(devices):
        words += ["--logical-cpus", str(len(cpus))]
    host = endpoint.rpartition(":")[0]
    if host in _LOOPBACK:
        words += ["--address", host]
    return " ".join(words)


def request(address: str, message: dict, timeout: float) -> dict:
    """Sends one request to a membership endpoint and returns its reply.

    Raises:
        OSError: the endpoint did not answer within `timeout`.
        ValueError: the reply is not JSON.
    """
    host, _, port = address.rpartition(":")
    with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as connection:
        connection.settimeout(timeout)
        connection.sendall(json.dumps(message).encode() + b"\n")
        reply = connection.makefile("rb").readline(_MAX_MESSAGE)
    if not reply:
        raise OSError(f"the membership endpoint at {address} closed the connection unanswered")
    return json.loads(reply)


class Membership:
    """The worker slots of a cluster that grows and shrinks, and the endpoint
    that workers join and leave through (see the module's docstring).

    Args:
        runtime: the strategy's runtime, whose replicas the slots hold.
        addresses: the `host:port` of each worker task in the cluster now.
        cluster: the cluster now (job name to addresses), told to joiners.
        port: the endpoint's port; 0 picks a free one.
        host: the interface to listen on (every one by default, as
            TensorFlow's servers do).
        join_timeout: seconds a worker given a slot has to serve.
        leave_timeout: seconds a leaving worker's replicas have to finish.
    """

    def __init__(
        self,
        runtime: Runtime,
        addresses: dict[int, str],
        cluster: dict[str, Sequence[str] | dict[int, str]],
        port: int,
        host: str = "",
        join_timeout: float = JOIN_TIMEOUT,
        leave_timeout: float = LEAVE_TIMEOUT,
    ):
        self.runtime = runtime
        self.join_timeout = join_timeout
        self.leave_timeout = leave_timeout
        self._cluster = {
            job: dict(tasks) if isinstance(tasks, dict) else dict(enumerate(tasks))
            for job, tasks in cluster.items()
        }
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        self.slots: dict[int, WorkerSlot] = {}
        for replica, device in enumerate(runtime.replica_devices):
            job, _, index = task_parts(device)
            if job != "worker":
                continue
            slot = self.slots.setdefault(index, WorkerSlot(index, [], []))
            slot.replicas.append(replica)
            if device not in slot.devices:
                slot.devices.append(device)
        for index, address in addresses.items():
            slot = self.slots[index]
            slot.state, slot.address = SlotState.MEMBER, address
        self._stopping = False
        self._admitter: threading.Thread | None = None
        self._server = _Endpoint((host, port), self._answer)
        self._server_thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.2},
            name="tf_diffmap-membership",
            daemon=True,
        )
        self._server_thread.start()
        held = sum(slot.state is SlotState.MEMBER for slot in self.slots.values())
        logger.info(
            "Workers may join this cluster: %d of its %d worker slots are held. To add a "
            "worker, run on its machine:\n    %s\nSIGTERM to that process makes it leave.",
            held,
            len(self.slots),
            self.join_command(),
        )

    @property
    def port(self) -> int:
        """The port the endpoint listens on."""
        return self._server.server_address[1]

    def join_command(self) -> str:
        """The command that adds a worker (`join_command`), with this
        endpoint at the chief's host in the cluster (or this host's name
        where the cluster names no chief)."""
        chiefs = self._cluster.get("chief")
        host = chiefs[min(chiefs)].rpartition(":")[0] if chiefs else socket.getfqdn()
        first = self.slots[min(self.slots)]
        return join_command(f"{host}:{self.port}", first.devices)

    def states(self) -> dict[int, str]:
        """Each slot's state, by worker index."""
        with self._lock:
            return {index: slot.state.value for index, slot in sorted(self.slots.items())}

    def stop(self) -> None:
        """Stops the endpoint and the admitter (the workers stay as they are)."""
        with self._lock:
            self._stopping = True
            self._wake.notify_all()
        self._server.shutdown()
        self._server.server_close()

    # -- requests ------------------------------------------------------------

    def _answer(self, message: dict) -> dict:
        try:
            if "join" in message:
                return self.join(**message["join"])
            if "leave" in message:
                return self.leave(**message["leave"])
            if "status" in message:
                with self._lock:
                    return {
                        "slots": {
                            str(i): {"state": s.state.value, "address": s.address}
                            for i, s in sorted(self.slots.items())
                        }
                    }
        except TypeError as error:
            return {"error": f"malformed request {message!r}: {error}"}
        return {"error": f"unknown request {sorted(message)}; ask to join, leave or status"}

    def join(self, address: str, index: int | None = None) -> dict:
        """A worker at `address` asks for a slot (`index`, or any empty one).

        Returns:
            The reply: its index and the cluster, or an error that says why.
        """
        with self._lock:
            if not isinstance(address, str) or ":" not in address:
                return {"error": f"a join needs the worker's host:port, received {address!r}"}
            held = [
                s
                for s in self.slots.values()
                if s.address == address and s.state is not SlotState.EMPTY
            ]
            if held and (index is None or held[0].index == index):
                slot = held[0]
                return {"index": slot.index, "cluster": self._cluster_for(slot), "already": True}
            if index is None:
                empty = [
                    s
                    for s in sorted(self.slots.values(), key=lambda s: s.index)
                    if s.state is SlotState.EMPTY
                ]
                if not empty:
                    return {"error": self._full_message()}
                slot = empty[0]
            else:
                slot = self.slots.get(index)
                if slot is None:
                    return {
                        "error": f"worker index {index} is beyond the slots of this cluster "
                        f"({sorted(self.slots)}): {self._full_message()}"
                    }
                if slot.state is not SlotState.EMPTY:
                    return {
                        "error": f"worker {index} is held by {slot.address} ({slot.state.value}); "
                        "ask for another index, or for none"
                    }
            slot.address = address
            self._move(slot, SlotState.EXPECTED)
            logger.info(
                "worker %s asks to join at %s; waiting for it to serve.", slot.task, address
            )
            self._watch()
            return {"index": slot.index, "cluster": self._cluster_for(slot)}

    def leave(self, index: int, address: str | None = None) -> dict:
        """Worker `index` is about to stop: its replicas finish their shards
        and end, and its task leaves the cluster (see the module's docstring).

        Returns:
            The reply once it may stop, or an error that says why not.
        """
        with self._lock:
            slot = self.slots.get(index)
            if slot is None or slot.state is SlotState.EMPTY:
                return {"left": True, "already": True}
            if address is not None and slot.address != address:
                return {"error": f"worker {index} is held by {slot.address}, not {address}"}
            if slot.state is SlotState.EXPECTED:
                slot.address = None
                self._move(slot, SlotState.EMPTY)
                return {"left": True}
            if slot.state is not SlotState.MEMBER:
                return {"error": f"worker {index} is {slot.state.value} already"}
            others = [
                s
                for s in self.slots.values()
                if s is not slot
                and s.state is SlotState.MEMBER
                and not set(s.replicas) <= self.runtime.record.lost()
            ]
            if not others and self.runtime.training():
                return {
                    "error": f"worker {index} is the last worker present while replicas train; "
                    "it may not leave (if it stops anyway, it is lost, and fit ends with an error)"
                }
            self._move(slot, SlotState.LEAVING)
        started = time.monotonic()
        out = changed = None
        try:
            stuck = self.runtime.leave_replicas(slot.task, slot.replicas, self.leave_timeout)
            out = time.monotonic() - started
            if stuck:
                logger.warning(
                    "worker %s leaves; its replicas %s did not finish their shards within %.0f s "
                    "and are left to their calls.",
                    slot.task,
                    stuck,
                    self.leave_timeout,
                )
            if not self.runtime.record.change_cluster(remove=[slot.task]):
                logger.warning(
                    "worker %s leaves, and stays in the cluster's definition while another "
                    "worker does not answer; no request waits for it.",
                    slot.task,
                )
            changed = time.monotonic() - started - out
        except Exception as error:  # noqa: BLE001 - the worker is told, and stops anyway
            logger.warning("worker %s leaves; removing it met %s", slot.task, error)
        with self._lock:
            self._cluster.get("worker", {}).pop(index, None)
            address, slot.address = slot.address, None
            self._move(slot, SlotState.EMPTY)
        seconds = time.monotonic() - started
        phases = (
            ""
            if out is None or changed is None
            else f" (its replicas out and the data split anew in {out:.1f} s, the cluster "
            f"changed in {changed:.1f} s)"
        )
        logger.info(
            "worker %s (%s) left after %.1f s%s; its replicas %s are absent and training goes "
            "on with the others.",
            slot.task,
            address,
            seconds,
            phases,
            slot.replicas,
        )
        return {"left": True, "seconds": seconds}

    # -- workers that join -----------------------------------------------------

    def _watch(self) -> None:
        """Starts the admitter thread unless it runs (holding the lock)."""
        self._wake.notify_all()
        if self._admitter is None or not self._admitter.is_alive():
            self._admitter = threading.Thread(
                target=self._admit_expected, name="tf_diffmap-admit", daemon=True
            )
            self._admitter.start()

    def _admit_expected(self) -> None:
        """Admits each expected worker once it serves, about once a second."""
        while True:
            with self._lock:
                expected = [s for s in self.slots.values() if s.state is SlotState.EXPECTED]
                if self._stopping or not expected:
                    self._admitter = None
                    return
            for slot in expected:
                if serves(slot.address, PROBE_SECONDS / 2):
                    self._admit(slot)
                elif time.monotonic() - slot.since > self.join_timeout:
                    with self._lock:
                        if slot.state is SlotState.EXPECTED:
                            logger.warning(
                                "worker %s at %s did not serve within %.0f s of asking to join; "
                                "its slot is free again.",
                                slot.task,
                                slot.address,
                                self.join_timeout,
                            )
                            slot.address = None
                            self._move(slot, SlotState.EMPTY)
            with self._lock:
                if not self._stopping:
                    self._wake.wait(PROBE_SECONDS)

    def _admit(self, slot: WorkerSlot) -> None:
        """Adds a worker that serves to the cluster and starts its replicas."""
        with self._lock:
            if slot.state is not SlotState.EXPECTED:
                return
            address = slot.address
        started = time.monotonic()
        record = self.runtime.record
        try:
            if not record.change_cluster(add={slot.task: address}):
                # Another worker is paused or cut off: TensorFlow's update
                # of the cluster would wait for it. Tried again later.
                with self._lock:
                    slot.since = time.monotonic()
                return
            found = {d.name for d in tf.config.list_logical_devices()}
            missing = [d for d in slot.devices if d not in found]
            if missing:
                have = sorted(d for d in found if d.startswith(slot.task + "/"))
                record.change_cluster(remove=[slot.task])
                raise ValueError(
                    f"it has the devices {have}, and its slot needs {slot.devices} (those of the "
                    "first worker): start it as the first workers were (the same GPUs, or the "
                    "same --logical-cpus)"
                )
            with self._lock:
                self._cluster.setdefault("worker", {})[slot.index] = address
            self.runtime.join_replicas(slot.task, slot.replicas)
        except Exception as error:  # noqa: BLE001 - the slot is freed and the worker refused
            logger.warning("worker %s at %s could not join: %s", slot.task, address, error)
            try:
                record.change_cluster(remove=[slot.task])
            except Exception:  # noqa: BLE001, S110 - it was not added, or cannot be removed now
                pass
            with self._lock:
                self._cluster.get("worker", {}).pop(slot.index, None)
                slot.address = None
                self._move(slot, SlotState.EMPTY)
            return
        with self._lock:
            self._move(slot, SlotState.MEMBER)
        logger.info(
            "worker %s (%s) joined in %.1f s; its replicas %s train from now on.",
            slot.task,
            address,
            time.monotonic() - started,
            slot.replicas,
        )

    # -- internals ---------------------------------------------------------------

    def _move(self, slot: WorkerSlot, state: SlotState) -> None:
        """The one place a slot's state changes (holding the lock)."""
        if slot.state is state:
            return
        if (slot.state, state) not in _MOVES:
            raise RuntimeError(
                f"Worker slot {slot.index} cannot go from {slot.state.value} to {state.value}."
            )
        slot.state = state
        slot.since = time.monotonic()

    def _cluster_for(self, slot: WorkerSlot) -> dict:
        cluster = {
            job: {str(i): a for i, a in tasks.items()} for job, tasks in self._cluster.items()
        }
        cluster.setdefault("worker", {})[str(slot.index)] = slot.address
        return cluster

    def _full_message(self) -> str:
        return (
            f"every worker slot is held ({len(self.slots)}, max_workers): start the chief with "
            "a larger strategy_for_cluster(max_workers=...) to grow further"
        )


class _Endpoint(socketserver.ThreadingTCPServer):
    """One JSON request per connection, one JSON reply (`Membership`)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], answer: Callable[[dict], dict]):
        self.answer = answer
        super().__init__(address, _Handler)


class _Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        line = self.rfile.readline(_MAX_MESSAGE)
        try:
            message = json.loads(line)
            if not isinstance(message, dict):
                raise ValueError("not an object")
        except ValueError as error:
            reply = {"error": f"a request is one JSON object on a line: {error}"}
        else:
            reply = self.server.answer(message)
        self.wfile.write(json.dumps(reply).encode() + b"\n")
