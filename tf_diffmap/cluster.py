"""Beyond one machine: the strategy on TensorFlow's own distributed runtime.

Replicas become devices of `/job:worker` tasks and the parameter store lives
on `/job:ps` tasks, all reached through `tf.distribute.Server` and gRPC, as
`ParameterServerStrategy` does. The client (`chief`) runs `model.fit`; its
worker threads call each replica's step on its remote device.

On every worker and parameter-server machine, start a server::

    TF_CONFIG='{"cluster": {...}, "task": {"type": "worker", "index": 0}}' \\
        python -m tf_diffmap.cluster

and on the client, with the same cluster and task type `chief`::

    strategy = tf_diffmap.cluster.strategy_for_cluster()
"""

from __future__ import annotations

import argparse
import json
import os

import tensorflow as tf

__all__ = ["connect", "strategy_for_cluster", "serve"]

CLIENT_JOBS = ("chief", "client", "evaluator")


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


def connect(cluster_resolver=None) -> tuple[list[str], list[str]]:
    """Connects this client to the cluster; returns its worker and ps devices.

    Args:
        cluster_resolver: the cluster; by default read from `TF_CONFIG`. This
            process's task type must be a client job (`chief`).

    Returns:
        `(replica_devices, parameter_devices)`: every GPU of each worker task
        (its CPU where it has none), and the CPU of each `ps` task.

    Raises:
        ValueError: no cluster, a cluster without `worker` or `ps` tasks, or a
            task type that is not a client job.
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
    tf.config.experimental_connect_to_cluster(
        resolver, job_name=task_type, make_master_device_default=False
    )
    devices = [d.name for d in tf.config.list_logical_devices()]

    def task_devices(job: str, index: int, kinds: tuple[str, ...]) -> list[str]:
        prefix = f"/job:{job}/replica:0/task:{index}/device:"
        for kind in kinds:
            found = [d for d in devices if d.startswith(prefix + kind + ":")]
            if found:
                return found if kind == "GPU" else found[:1]
        raise ValueError(f"Task /job:{job}/task:{index} shows no {kinds} device.")

    workers = spec["worker"]
    ps = spec["ps"]
    indices = lambda tasks: tasks if isinstance(tasks, dict) else range(len(tasks))  # noqa: E731
    replicas = [d for i in indices(workers) for d in task_devices("worker", i, ("GPU", "CPU"))]
    store = [d for i in indices(ps) for d in task_devices("ps", i, ("CPU",))]
    return replicas, store


def strategy_for_cluster(cluster_resolver=None, **kwargs):
    """A `tf_diffmap.Strategy` over the cluster's workers, its store on the ps tasks.

    Args:
        cluster_resolver: the cluster; by default read from `TF_CONFIG`.
        **kwargs: other `Strategy` options (`replicas_per_device`,
            `max_staleness`, `queue_size`).

    Returns:
        The strategy; variables are sharded over the ps tasks.
    """
    from tf_diffmap.devices import host_cpu
    from tf_diffmap.strategy import Strategy

    replicas, store = connect(cluster_resolver)
    strategy = Strategy(devices=replicas, parameter_device=store, **kwargs)
    # Datasets given to the strategy are built on the workers themselves.
    strategy.extended.worker_hosts = [host_cpu(d) for d in strategy.replica_devices]
    return strategy


def serve(config: str | None = None) -> None:
    """Runs this machine's worker or ps server until the process is stopped.

    Args:
        config: a TF_CONFIG JSON string; by default the `TF_CONFIG` variable.
    """
    if config is not None:
        os.environ["TF_CONFIG"] = config
    resolver = _resolver(None)
    if resolver.task_type not in ("worker", "ps"):
        raise ValueError(
            f"`python -m tf_diffmap.cluster` serves worker and ps tasks; TF_CONFIG "
            f"names task type {resolver.task_type!r}."
        )
    server = tf.distribute.Server(
        resolver.cluster_spec(),
        job_name=resolver.task_type,
        task_index=resolver.task_id,
        protocol=resolver.rpc_layer or "grpc",
        start=True,
    )
    print(
        json.dumps(
            {"serving": resolver.task_type, "index": resolver.task_id, "target": server.target}
        ),
        flush=True,
    )
    server.join()


def main() -> None:
    parser = argparse.ArgumentParser(description="Serve a tf_diffmap worker or ps task.")
    parser.add_argument("--tf-config", default=None, help="TF_CONFIG JSON (default: $TF_CONFIG)")
    serve(parser.parse_args().tf_config)


if __name__ == "__main__":
    main()
