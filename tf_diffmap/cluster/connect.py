"""The client's side of a cluster: connecting to it, the strategy over it.

`connect` waits for every worker and ps task and connects this process (the
chief) to them; `strategy_for_cluster` makes the strategy over the workers,
its store on the ps tasks. The tasks themselves run `server.serve`.
"""

from __future__ import annotations

import os

import tensorflow as tf

from tf_diffmap.cluster.faults import wait_for_tasks

__all__ = [
    "CONNECT_TIMEOUT",
    "check_client",
    "connect",
    "fail_fast",
    "membership_of",
    "resolve_cluster",
    "strategy_for_cluster",
]

CLIENT_JOBS = ("chief", "client", "evaluator")

CONNECT_TIMEOUT = 60.0
"""Seconds `connect` waits for every worker and ps task to serve, by default."""


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


def resolve_cluster(cluster_resolver=None):
    """The cluster given, else the one `TF_CONFIG` describes.

    Raises:
        ValueError: none given and no `TF_CONFIG`.
    """
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


def check_client(resolver: tf.distribute.cluster_resolver.ClusterResolver) -> dict:
    """The cluster's jobs, checked for a client that trains on it; connects nothing.

    What `connect` (and so `strategy_for_cluster`) requires of the cluster and
    of this process's task before it waits for any task to serve.

    Args:
        resolver: a `tf.distribute.cluster_resolver.ClusterResolver`.

    Returns:
        The cluster spec as a dict: job name to task addresses.

    Raises:
        ValueError: a cluster without `worker` or `ps` tasks, or a task type
            that is not a client job (`chief`).
    """
    spec = resolver.cluster_spec().as_dict()
    for job in ("worker", "ps"):
        if not spec.get(job):
            raise ValueError(
                f"The cluster has no '{job}' tasks (jobs: {sorted(spec)}); "
                "tf_diffmap needs workers for the replicas and ps tasks for the store."
            )
    if resolver.task_type not in CLIENT_JOBS:
        raise ValueError(
            f"This process is task type {resolver.task_type!r}; the process that trains "
            f"must be one of {CLIENT_JOBS}. Start workers and ps tasks with "
            "`python -m tf_diffmap.cluster` instead."
        )
    return spec


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
    resolver = resolve_cluster(cluster_resolver)
    spec = check_client(resolver)
    task_type = resolver.task_type
    indices = lambda tasks: tasks if isinstance(tasks, dict) else range(len(tasks))  # noqa: E731
    wait_for_tasks(
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


def strategy_for_cluster(
    cluster_resolver=None,
    connect_timeout: float = CONNECT_TIMEOUT,
    max_workers: int | None = None,
    membership_port: int | None = None,
    **kwargs,
):
    """A `tf_diffmap.Strategy` over the cluster's workers, its store on the ps tasks.

    Args:
        cluster_resolver: the cluster; by default read from `TF_CONFIG`.
        connect_timeout: seconds to wait for every worker and ps task to
            serve before raising `tf.errors.UnavailableError` naming them.
        max_workers: the most worker tasks the cluster may grow to while it
            trains (elastic membership, `tf_diffmap.cluster.membership`);
            None (default): the workers of the cluster spec, and no others.
            Every worker slot's replicas have their place from the start
            (absent until a worker joins), a batch is cut into one shard per
            slot's replica, and `gradients_per_step="auto"` is one per slot's
            replica: one optimizer step per batch, whoever is present.
            Workers join and leave through an endpoint the chief serves
            (`python -m tf_diffmap.cluster --join ADDRESS`).
        membership_port: the port of that endpoint; by default the chief's
            own port in the cluster spec plus one (0: any free port, read
            it from `membership_of(strategy).port`).
        **kwargs: other `Strategy` options (`replicas_per_device`,
            `max_step_staleness`, `queue_size`, `variable_partitioner`),
            with the same defaults as on one host: fresh windows.

    Returns:
        The strategy; variables are sharded over the ps tasks, and with
        several ps tasks a large one (an embedding table) is split by rows
        over them (`Strategy(variable_partitioner=...)`).

    Raises:
        ValueError: no cluster, a cluster without `worker` or `ps` tasks, a
            task type that is not a client job, or a `Strategy` option out of
            range.
        tf.errors.UnavailableError: tasks that did not serve within
            `connect_timeout`, named with their addresses.
    """
    # Imported here: the engine imports this package (its faults and inputs)
    # when it trains on a cluster, and the package does not import the engine
    # as it loads.
    from tf_diffmap.strategy import Strategy

    resolver = resolve_cluster(cluster_resolver)
    spec = check_client(resolver)
    if max_workers is not None:
        port = _membership_port(resolver, spec, membership_port)
        workers = _task_indices(spec["worker"])
        if isinstance(max_workers, bool) or not isinstance(max_workers, int):
            raise ValueError(f"max_workers must be None or an int, received {max_workers!r}.")
        if max_workers < len(workers):
            raise ValueError(
                f"max_workers={max_workers} is below the {len(workers)} worker tasks of the "
                "cluster spec; give at least as many, or None for a cluster that does not grow."
            )
    replicas, store = connect(resolver, connect_timeout)
    reserved = []
    if max_workers is not None:
        free = [i for i in range(max_workers + max(workers) + 1) if i not in workers]
        free = free[: max_workers - len(workers)]
        reserved = _slot_devices(replicas, workers[0], free)
    strategy = Strategy(
        devices=replicas, parameter_device=store, reserved_devices=reserved, **kwargs
    )
    runtime = strategy.extended.runtime
    # Datasets given to the strategy are built on the workers themselves.
    runtime.read_input_on_workers()
    if max_workers is not None:
        from tf_diffmap.cluster.membership import Membership

        runtime.membership = Membership(
            runtime,
            {i: spec["worker"][i] for i in workers},
            spec,
            port,
        )
    return strategy


def membership_of(strategy):
    """The `Membership` of a strategy made with `max_workers`, or None.

    Its `port` is the endpoint's, `states()` each worker slot's state.
    """
    return getattr(strategy.extended.runtime, "membership", None)


def _task_indices(tasks) -> list[int]:
    return sorted(tasks) if isinstance(tasks, dict) else list(range(len(tasks)))


def _membership_port(resolver, spec: dict, port: int | None) -> int:
    """The membership endpoint's port: given, or the chief's own plus one."""
    if port is not None:
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
            raise ValueError(f"membership_port must be a port number, received {port!r}.")
        return port
    from tf_diffmap.cluster.membership import MEMBERSHIP_PORT_OFFSET

    tasks = spec.get(resolver.task_type) or []
    own = tasks.get(resolver.task_id) if isinstance(tasks, dict) else tasks[resolver.task_id]
    try:
        return int(own.rpartition(":")[2]) + MEMBERSHIP_PORT_OFFSET
    except (AttributeError, ValueError):
        raise ValueError(
            f"This task's address ({own!r}) has no port to serve the membership endpoint "
            "beside; give membership_port=... ."
        ) from None


def _slot_devices(replicas: list[str], template: int, free: list[int]) -> list[str]:
    """The devices of worker tasks `free`, as those of worker `template` are."""
    prefix = f"/job:worker/replica:0/task:{template}/"
    kinds = [d[len(prefix) :] for d in replicas if d.startswith(prefix)]
    return [f"/job:worker/replica:0/task:{i}/{kind}" for i in free for kind in kinds]
