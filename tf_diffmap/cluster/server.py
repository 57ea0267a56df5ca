"""The tasks' side of a cluster: serving a worker or ps task.

`serve` runs this machine's worker or ps server from its TF_CONFIG until the
process is stopped; `start_server` starts one (for `serve`, and for a worker
that joins, `member.join_and_serve`). The command line that calls them,
`python -m tf_diffmap.cluster`, is `cli.main`.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading

import tensorflow as tf

from tf_diffmap.cluster.connect import fail_fast, resolve_cluster

__all__ = ["check_server", "serve", "start_server"]


def serve(
    config: str | None = None,
    logical_cpus: int = 1,
    exit_when_stdin_closes: bool = False,
    port: int | None = None,
) -> None:
    """Runs this machine's worker or ps server until the process is stopped.

    Ctrl-C (SIGINT) and SIGTERM stop it.

    Args:
        config: a TF_CONFIG JSON string; by default the `TF_CONFIG` variable.
        logical_cpus: logical CPU devices to make of the CPU before serving, so
            that a worker task without GPUs holds that many replicas.
        exit_when_stdin_closes: exit once standard input reaches its end, so
            that a server started through a pipe (as `LocalCluster` does) does
            not outlive the process that started it.
        port: the port to listen on, when the others reach this task at
            another address (a relay in front of it, as `PartitionProxy`
            is); by default the port of its address in the cluster.

    Raises:
        ValueError: no TF_CONFIG, a task type other than worker or ps, a
            task that its cluster does not list, or `logical_cpus` below 1.
    """
    if not isinstance(logical_cpus, int) or logical_cpus < 1:
        raise ValueError(f"logical_cpus must be an integer >= 1, received {logical_cpus!r}.")
    if config is not None:
        os.environ["TF_CONFIG"] = config
    resolver = resolve_cluster()
    check_server(resolver)
    server = start_server(
        resolver.cluster_spec(),
        resolver.task_type,
        resolver.task_id,
        logical_cpus,
        port,
        exit_when_stdin_closes,
        resolver.rpc_layer or "grpc",
    )
    # `join` blocks in C++, where Python never sees the KeyboardInterrupt of a
    # Ctrl-C; the default action ends the process instead.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    server.join()


def start_server(
    cluster: tf.train.ClusterSpec,
    job: str,
    index: int,
    logical_cpus: int = 1,
    port: int | None = None,
    exit_when_stdin_closes: bool = False,
    protocol: str = "grpc",
) -> tf.distribute.Server:
    """Starts this task's server and says so on standard output (one JSON
    line with `"serving"`, which `LocalCluster` waits for).

    Args:
        cluster: the cluster, which names this task.
        job: this task's job.
        index: this task's index.
        logical_cpus: logical CPU devices to make of the CPU.
        port: a port to listen on other than the one of its address.
        exit_when_stdin_closes: exit once standard input reaches its end.
        protocol: the RPC layer.

    Returns:
        The running server.
    """
    # The server makes its devices from its own session config, not from
    # tf.config's logical device configuration.
    fail_fast()
    session_config = None
    if logical_cpus > 1:
        session_config = tf.compat.v1.ConfigProto(device_count={"CPU": logical_cpus})
    server_def = tf.train.ServerDef(
        cluster=cluster.as_cluster_def(), job_name=job, task_index=index, protocol=protocol
    )
    if port is not None:
        server_def.port = port
    server = tf.distribute.Server(server_def, config=session_config, start=True)
    if exit_when_stdin_closes:
        threading.Thread(target=_exit_at_end_of_stdin, daemon=True).start()
    print(json.dumps({"serving": job, "index": index, "target": server.target}), flush=True)
    return server


def check_server(resolver: tf.distribute.cluster_resolver.ClusterResolver) -> None:
    """Checks that the cluster names a worker or ps task for this process to serve.

    What `serve` requires of TF_CONFIG before it starts a server; starts
    nothing.

    Args:
        resolver: a `tf.distribute.cluster_resolver.ClusterResolver`.

    Raises:
        ValueError: a task type other than worker or ps, or a task that the
            cluster does not list.
    """
    if resolver.task_type not in ("worker", "ps"):
        raise ValueError(
            f"`python -m tf_diffmap.cluster` serves worker and ps tasks; TF_CONFIG "
            f"names task type {resolver.task_type!r}."
        )
    jobs = resolver.cluster_spec().as_dict()
    tasks = jobs.get(resolver.task_type, [])
    indices = list(tasks) if isinstance(tasks, dict) else range(len(tasks))
    if resolver.task_id not in indices:
        raise ValueError(
            f"TF_CONFIG names task {resolver.task_type!r} {resolver.task_id!r}, which its "
            f"cluster does not list ({resolver.task_type!r} tasks: {list(indices)}); give "
            "the index of this task's address in cluster."
        )


def _exit_at_end_of_stdin() -> None:
    sys.stdin.buffer.read()
    print("Standard input closed: the process that started this server is gone.", file=sys.stderr)
    sys.stderr.flush()
    os._exit(0)
