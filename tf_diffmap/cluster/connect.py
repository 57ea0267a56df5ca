"""Connecting to a cluster, and serving one of its worker or ps tasks.

`connect` waits for every task and connects this client (the chief);
`strategy_for_cluster` makes the strategy over the workers and ps tasks;
`serve` runs this machine's task, and `main` is `python -m tf_diffmap.cluster`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading

import tensorflow as tf

from tf_diffmap.cluster import faults
from tf_diffmap.cluster.local import parse_local_spec, run_local

__all__ = ["connect", "fail_fast", "strategy_for_cluster", "serve", "main"]

CLIENT_JOBS = ("chief", "client", "evaluator")

# How long `connect` waits for every worker and ps task to serve.
CONNECT_TIMEOUT = 60.0


def fail_fast() -> None:
    """Makes the runtime's RPCs to a lost task fail at once instead of waiting.

    `GRPC_FAIL_FAST=use_caller` (TensorFlow's RFC 355, what
    `ParameterServerStrategy` relies on) fails a function call on a task that
    is down with `UnavailableError` at once, instead of waiting for it to come
    back; one outstanding RPC per task keeps the runtime's failure handling
    simple, and `context.async_wait` (which Keras calls at the end of every
    epoch) must not send an RPC to every task, a lost one included: as
    `ParameterServerStrategy` sets them. A value the user set is kept.
    """
    os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")
    os.environ.setdefault("TF_ENABLE_EAGER_CLIENT_STREAMING_ENQUEUE", "False")
    os.environ.setdefault("TF_PS_DISABLE_ASYNC_EXECUTOR_GLOBALLY", "True")


def _resolver(cluster_resolver):
    if cluster_resolver is not None:
        return cluster_resolver
    if not os.environ.get("TF_CONFIG"):
        raise ValueError(
            "No cluster given: pass a tf.distribute.cluster_resolver.ClusterResolver, "
            "or set TF_CONFIG to the cluster and this process's task "
            '(for example {"cluster": {"worker": [...], "ps": [...], "chief": [...]}, '
            '"task": {"type": "chief", "index": 0}}).'
        )
    return tf.distribute.cluster_resolver.TFConfigClusterResolver()


def connect(
    cluster_resolver=None, connect_timeout: float = CONNECT_TIMEOUT
) -> tuple[list[str], list[str]]:
    """Connects this client to the cluster; returns its worker and ps devices.

    Every worker and ps task must serve: a task that is down when the chief
    starts is waited for up to `connect_timeout` seconds, then named in the
    error (the runtime itself would wait for it silently, for ever). A worker
    lost *after* the connection is tolerated (see `tf_diffmap.cluster.faults`).

    Args:
        cluster_resolver: the cluster; by default read from `TF_CONFIG`. This
            process's task type must be a client job (`chief`).
        connect_timeout: seconds to wait for every task to serve.

    Returns:
        `(replica_devices, parameter_devices)`: every GPU of each worker task
        (its CPU devices where it has none: one, or as many as it was started
        with by `--logical-cpus`), and the CPU of each `ps` task.

    Raises:
        ValueError: no cluster, a cluster without `worker` or `ps` tasks, or a
            task type that is not a client job.
        tf.errors.UnavailableError: tasks that did not serve within
            `connect_timeout`, named with their addresses.
    """
    resolver = _resolver(cluster_resolver)
    spec = resolver.cluster_spec().as_dict()
    for job in ("worker", "ps"):
        if not spec.get(job):
            raise ValueError(
                f"The cluster has no '{job}' tasks (jobs: {sorted(spec)}); "
                "tf_diffmap needs workers for the replicas and ps tasks for the store."
            )
    task_type = resolver.task_type
    if task_type not in CLIENT_JOBS:
        raise ValueError(
            f"This process is task type {task_type!r}; the process that trains "
            f"must be one of {CLIENT_JOBS}. Start workers and ps tasks with "
            "`python -m tf_diffmap.cluster` instead."
        )
    indices = lambda tasks: tasks if isinstance(tasks, dict) else range(len(tasks))  # noqa: E731
    faults.wait_for_tasks(
        {
            f"/job:{job}/replica:0/task:{i}": spec[job][i]
            for job in ("worker", "ps")
            for i in indices(spec[job])
        },
        connect_timeout,
    )
    fail_fast()
    tf.config.experimental_connect_to_cluster(
        resolver, job_name=task_type, make_master_device_default=False
    )
    devices = [d.name for d in tf.config.list_logical_devices()]

    def task_devices(job: str, index: int, kinds: tuple[str, ...], every: bool) -> list[str]:
        prefix = f"/job:{job}/replica:0/task:{index}/device:"
        for kind in kinds:
            found = [d for d in devices if d.startswith(prefix + kind + ":")]
            if found:
                return found if every else found[:1]
        raise ValueError(f"Task /job:{job}/task:{index} shows no {kinds} device.")

    workers = spec["worker"]
    ps = spec["ps"]
    replicas = [
        d for i in indices(workers) for d in task_devices("worker", i, ("GPU", "CPU"), True)
    ]
    store = [d for i in indices(ps) for d in task_devices("ps", i, ("CPU",), False)]
    return replicas, store


def strategy_for_cluster(cluster_resolver=None, connect_timeout: float = CONNECT_TIMEOUT, **kwargs):
    """A `tf_diffmap.Strategy` over the cluster's workers, its store on the ps tasks.

    Args:
        cluster_resolver: the cluster; by default read from `TF_CONFIG`.
        connect_timeout: seconds to wait for every worker and ps task to
            serve before raising `tf.errors.UnavailableError` naming them.
        **kwargs: other `Strategy` options (`replicas_per_device`,
            `max_staleness`, `queue_size`, `variable_partitioner`).

    Returns:
        The strategy; variables are sharded over the ps tasks, and with
        several ps tasks a large one (an embedding table) is split by rows
        over them (`Strategy(variable_partitioner=...)`).
    """
    from tf_diffmap.strategy import Strategy

    replicas, store = connect(cluster_resolver, connect_timeout)
    strategy = Strategy(devices=replicas, parameter_device=store, **kwargs)
    # Datasets given to the strategy are built on the workers themselves.
    strategy.extended.runtime.read_input_on_workers()
    return strategy


def serve(
    config: str | None = None,
    logical_cpus: int = 1,
    exit_when_stdin_closes: bool = False,
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

    Raises:
        ValueError: no TF_CONFIG, a task type other than worker or ps, or
            `logical_cpus` below 1.
    """
    if not isinstance(logical_cpus, int) or logical_cpus < 1:
        raise ValueError(f"logical_cpus must be an integer >= 1, received {logical_cpus!r}.")
    if config is not None:
        os.environ["TF_CONFIG"] = config
    resolver = _resolver(None)
    if resolver.task_type not in ("worker", "ps"):
        raise ValueError(
            f"`python -m tf_diffmap.cluster` serves worker and ps tasks; TF_CONFIG "
            f"names task type {resolver.task_type!r}."
        )
    # The server makes its devices from its own session config, not from
    # tf.config's logical device configuration.
    fail_fast()
    session_config = None
    if logical_cpus > 1:
        session_config = tf.compat.v1.ConfigProto(device_count={"CPU": logical_cpus})
    server = tf.distribute.Server(
        resolver.cluster_spec(),
        job_name=resolver.task_type,
        task_index=resolver.task_id,
        protocol=resolver.rpc_layer or "grpc",
        config=session_config,
        start=True,
    )
    if exit_when_stdin_closes:
        threading.Thread(target=_exit_at_end_of_stdin, daemon=True).start()
    print(
        json.dumps(
            {"serving": resolver.task_type, "index": resolver.task_id, "target": server.target}
        ),
        flush=True,
    )
    # `join` blocks in C++, where Python never sees the KeyboardInterrupt of a
    # Ctrl-C; the default action ends the process instead.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    server.join()


def _exit_at_end_of_stdin() -> None:
    sys.stdin.buffer.read()
    print("Standard input closed: the process that started this server is gone.", file=sys.stderr)
    sys.stderr.flush()
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    """`python -m tf_diffmap.cluster`: serve one task, or try a cluster locally.

    Args:
        argv: the arguments; by default `sys.argv[1:]`.

    Returns:
        The exit status.
    """
    parser = argparse.ArgumentParser(
        prog="python -m tf_diffmap.cluster",
        description=(
            "Serve this machine's tf_diffmap worker or ps task (from TF_CONFIG) until "
            "stopped, or with --local start every worker and ps task on this machine."
        ),
    )
    parser.add_argument("--tf-config", default=None, help="TF_CONFIG JSON (default: $TF_CONFIG)")
    parser.add_argument(
        "--local",
        nargs="?",
        const="workers=2,ps=1",
        default=None,
        metavar="workers=N,ps=M",
        help=(
            "start N worker and M ps processes on 127.0.0.1, print the TF_CONFIG a chief "
            "must use, and run until Ctrl-C or SIGTERM (default: workers=2,ps=1)"
        ),
    )
    parser.add_argument(
        "--logical-cpus",
        type=int,
        default=1,
        metavar="N",
        help="logical CPU devices per worker task, one replica each (default: 1)",
    )
    parser.add_argument(
        "--exit-when-stdin-closes",
        action="store_true",
        help="stop serving when standard input ends (used by LocalCluster)",
    )
    args = parser.parse_args(argv)
    if args.logical_cpus < 1:
        parser.error(f"--logical-cpus needs N >= 1, received {args.logical_cpus}.")
    if args.local is None:
        serve(args.tf_config, args.logical_cpus, args.exit_when_stdin_closes)
        return 0
    if args.tf_config is not None:
        parser.error(
            "--local starts its own tasks and prints their TF_CONFIG; drop --tf-config, "
            "for example: python -m tf_diffmap.cluster --local workers=2,ps=1"
        )
    try:
        counts = parse_local_spec(args.local)
    except ValueError as error:
        parser.error(str(error))
    try:
        return run_local(**counts, cpus_per_worker=args.logical_cpus)
    except (RuntimeError, TimeoutError) as error:
        print(f"python -m tf_diffmap.cluster --local: {error}", file=sys.stderr)
        return 1
