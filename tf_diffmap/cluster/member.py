"""A worker's side of elastic membership: join a running cluster, leave on SIGTERM.

`python -m tf_diffmap.cluster --join [ADDRESS]` runs `join_and_serve`: a
worker task that announces itself to the chief's membership endpoint
(`tf_diffmap.cluster.membership`) and serves, until SIGTERM (a scale-down,
or a preemption notice), when it asks the chief to let it leave, waits until
its replicas have finished their shards and its task has left the cluster,
and exits.

- **With a TF_CONFIG** that names this worker (as a TFJob's operator or the
  plain manifests' entrypoint make it, where the pod's ordinal is its index)
  the server starts at once at its address, and the announcement, which asks
  for that index, is retried in the background until the chief answers (it
  may start after the workers). A worker of the first cluster spec is told
  it holds its slot already; one beyond it (a scale-up) joins the running
  `fit`.
- **Without one**, the worker asks the chief for a free slot first (retried
  until the chief answers), then starts its server at `address` with the
  index it was given.

ADDRESS is the chief's endpoint, `host:port`; by default the chief's address
in TF_CONFIG with its port plus `MEMBERSHIP_PORT_OFFSET`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time

import tensorflow as tf

from tf_diffmap.cluster.connect import resolve_cluster
from tf_diffmap.cluster.membership import (
    JOIN_TIMEOUT,
    LEAVE_TIMEOUT,
    MEMBERSHIP_PORT_OFFSET,
    request,
)
from tf_diffmap.cluster.server import check_server, start_server

__all__ = ["chief_endpoint", "join_and_serve"]

# Seconds between two tries of a request the chief did not answer.
RETRY_SECONDS = 2.0


def chief_endpoint(cluster: dict) -> str:
    """The membership endpoint of the chief a cluster names: its host, at
    its port plus `MEMBERSHIP_PORT_OFFSET`.

    Raises:
        ValueError: the cluster names no chief.
    """
    chiefs = cluster.get("chief")
    if not chiefs:
        raise ValueError(
            "--join without an address needs a TF_CONFIG whose cluster names the chief; "
            "give the chief's membership endpoint: --join HOST:PORT."
        )
    chief = chiefs[0] if isinstance(chiefs, list) else chiefs[min(chiefs)]
    host, _, port = chief.rpartition(":")
    return f"{host}:{int(port) + MEMBERSHIP_PORT_OFFSET}"


def join_and_serve(
    membership: str | None = None,
    address: str | None = None,
    config: str | None = None,
    logical_cpus: int = 1,
    port: int | None = None,
    exit_when_stdin_closes: bool = False,
    join_timeout: float = JOIN_TIMEOUT,
    leave_timeout: float = LEAVE_TIMEOUT,
) -> int:
    """Joins a running cluster as a worker, serves, and leaves on SIGTERM.

    Args:
        membership: the chief's membership endpoint, `host:port`; by default
            derived from TF_CONFIG's chief (`chief_endpoint`).
        address: without TF_CONFIG, the `host:port` the others reach this
            worker at; a host alone is given `port` (or a free port); by
            default this host's name.
        config: a TF_CONFIG JSON string; by default the `TF_CONFIG`
            variable, if set.
        logical_cpus: logical CPU devices to make of the CPU, one replica
            each: as many as the first workers have.
        port: the port to listen on; by default that of `address`.
        exit_when_stdin_closes: exit once standard input reaches its end.
        join_timeout: seconds to keep asking a chief that does not answer.
        leave_timeout: seconds the chief takes at most to let it leave.

    Returns:
        The exit status: 0 once it left (or was stopped), 1 when the chief
        refused it a slot.
    """
    config = config if config is not None else os.environ.get("TF_CONFIG")
    resolver = None
    # What it was given is checked before it takes over the signals.
    if config:
        os.environ["TF_CONFIG"] = config
        resolver = resolve_cluster()
        if resolver.task_type != "worker":
            raise ValueError(
                f"--join starts a worker, and TF_CONFIG names task {resolver.task_type!r} "
                f"{resolver.task_id!r} (the chief's, left in this shell?). Unset it to be given a "
                "free slot (env -u TF_CONFIG python -m tf_diffmap.cluster --join HOST:PORT), "
                "or give this worker's own TF_CONFIG."
            )
        check_server(resolver)
        membership = membership or chief_endpoint(resolver.cluster_spec().as_dict())
    elif membership is None:
        raise ValueError("--join needs the chief's membership endpoint, HOST:PORT.")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if resolver is not None:
        spec = resolver.cluster_spec().as_dict()
        index = resolver.task_id
        tasks = spec["worker"]
        own = tasks[index]
        start_server(
            resolver.cluster_spec(), "worker", index, logical_cpus, port, exit_when_stdin_closes
        )
        announce = threading.Thread(
            target=_announce,
            args=(membership, own, index, join_timeout, stop),
            name="tf_diffmap-announce",
            daemon=True,
        )
        announce.start()
    else:
        own = _with_port(address or socket.getfqdn(), port)
        reply = _ask(membership, {"join": {"address": own, "index": None}}, join_timeout, stop)
        if reply is None:
            return 0
        if "error" in reply:
            print(f"The chief refused this worker: {reply['error']}", file=sys.stderr, flush=True)
            return 1
        index = int(reply["index"])
        cluster = {
            job: {int(i): a for i, a in tasks.items()} for job, tasks in reply["cluster"].items()
        }
        listen = port if port is not None else int(own.rpartition(":")[2])
        start_server(
            tf.train.ClusterSpec(cluster),
            "worker",
            index,
            logical_cpus,
            listen,
            exit_when_stdin_closes,
        )
    while not stop.wait(1.0):
        pass
    started = time.monotonic()
    message = {"leave": {"index": index, "address": own}}
    try:
        reply = request(membership, message, leave_timeout + 30.0)
    except (OSError, ValueError) as error:
        reply = {"error": f"the chief did not answer ({error})"}
    seconds = time.monotonic() - started
    if "error" in reply:
        print(
            f"worker {index} stops without leaving: {reply['error']} ({seconds:.1f} s)",
            file=sys.stderr,
            flush=True,
        )
    else:
        print(json.dumps({"left": "worker", "index": index, "seconds": seconds}), flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    # The server cannot be shut down cleanly: end the process.
    os._exit(0)


def _announce(membership: str, own: str, index: int, timeout: float, stop: threading.Event):
    """Asks the chief for this worker's own slot until it answers."""
    reply = _ask(membership, {"join": {"address": own, "index": index}}, timeout, stop)
    if reply is None:
        return
    if "error" in reply:
        print(
            f"worker {index} serves, but the chief refused it a slot: {reply['error']}",
            file=sys.stderr,
            flush=True,
        )
    else:
        print(json.dumps({"announced": "worker", **reply}), flush=True)


def _ask(membership: str, message: dict, timeout: float, stop: threading.Event) -> dict | None:
    """A request tried again until the chief answers; None after `timeout`
    or once stopped."""
    deadline = time.monotonic() + timeout
    while not stop.is_set():
        try:
            return request(membership, message, RETRY_SECONDS * 5)
        except (OSError, ValueError) as error:
            if time.monotonic() >= deadline:
                print(
                    f"The chief's membership endpoint at {membership} did not answer within "
                    f"{timeout:g} s ({error}).",
                    file=sys.stderr,
                    flush=True,
                )
                return None
        stop.wait(RETRY_SECONDS)
    return None


def _with_port(address: str, port: int | None) -> str:
    """`address` as `host:port`: a host alone is given `port`, or a free port."""
    host, sep, number = address.rpartition(":")
    if sep and number.isdigit() and not address.endswith("]"):
        return address
    return f"{address}:{port or _free_port()}"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]
