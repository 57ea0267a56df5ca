"""The container's entrypoint: one task of a tf_diffmap cluster, as TF_CONFIG names it.

A worker or ps task runs its server, `python -m tf_diffmap.cluster`, until the
pod is stopped; the chief runs the command given to the container (its
training script, the image's CMD by default). A worker or ps ignores that
command.

TF_CONFIG comes from the pod:

- set, as the Kubeflow training operator sets it in each replica of a
  `TFJob` (deploy/kubeflow/): used as it is;
- unset, as in the plain manifests (deploy/kubernetes/): computed here from

  - `TF_DIFFMAP_TASK_TYPE`: `chief`, `worker` or `ps`;
  - `TF_DIFFMAP_CLUSTER`: the number of tasks of each type, as
    `chief=1,worker=2,ps=1`;
  - `TF_DIFFMAP_ADDRESS`: every task's address, with `{type}`, `{index}` and
    `{namespace}` filled in, as
    `tf-diffmap-{type}-{index}.tf-diffmap.{namespace}.svc:2222`;
  - `POD_NAMESPACE`: the pod's namespace (from the downward API; by default
    `default`);
  - this task's index: `JOB_COMPLETION_INDEX` in an indexed Job, else the
    ordinal that ends the pod's hostname in a StatefulSet
    (`tf-diffmap-worker-1` is worker 1).

  The pod's hostname must be the first label of its own address: a
  StatefulSet or Job renamed without its `TF_DIFFMAP_ADDRESS` is refused
  here rather than left to wait for tasks that have no address.

`TF_DIFFMAP_LOGICAL_CPUS=N` gives a worker without GPUs N replicas on its CPU
(`python -m tf_diffmap.cluster --logical-cpus N`).

`TF_DIFFMAP_MAX_WORKERS=M` makes the cluster elastic (docs/cluster.md, "Workers
that join and leave"): every worker runs `python -m tf_diffmap.cluster --join`,
announcing itself to the chief's membership endpoint (the chief's address, at
its port plus one) and leaving on SIGTERM; in the plain manifests a worker
whose ordinal is at or beyond `TF_DIFFMAP_CLUSTER`'s count (the StatefulSet
scaled up) and below M joins the running fit. The chief's script reads the
same variable (`deploy/train.py` passes it to `strategy_for_cluster` as
`max_workers`).

Standard library only: it runs before TensorFlow is imported, and whatever it
starts checks TF_CONFIG again (`python -m tf_diffmap.cluster` for a server,
`strategy_for_cluster` in the chief's script).

Example:
    python entrypoint.py python train.py
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
from collections.abc import Mapping, Sequence

TASK_TYPES = ("chief", "worker", "ps")
SERVER_TYPES = ("worker", "ps")
_ORDINAL = re.compile(r"-(\d+)$")


class TaskError(ValueError):
    """The pod's environment does not name one task of the cluster."""


def parse_counts(text: str) -> dict[str, int]:
    """Reads `TF_DIFFMAP_CLUSTER`, such as `chief=1,worker=2,ps=1`.

    Raises:
        TaskError: an item that is not `type=count`, an unknown or repeated
            type, or a count that is not a whole number of at least 1.
    """
    counts: dict[str, int] = {}
    for item in text.split(","):
        name, sep, value = item.strip().partition("=")
        name = name.strip()
        if not sep or name not in TASK_TYPES or name in counts:
            raise TaskError(
                f"TF_DIFFMAP_CLUSTER={text!r}: {item.strip()!r} is not type=count with a "
                f"type of {TASK_TYPES} given once; for example chief=1,worker=2,ps=1."
            )
        if not value.strip().isdigit() or int(value) < 1:
            raise TaskError(
                f"TF_DIFFMAP_CLUSTER={text!r}: {name} needs a whole number of at least 1, "
                f"received {value.strip()!r}."
            )
        counts[name] = int(value)
    return counts


def max_workers(env: Mapping[str, str]) -> int | None:
    """`TF_DIFFMAP_MAX_WORKERS`: the most workers of an elastic cluster (None: fixed).

    Raises:
        TaskError: a value that is not a whole number of at least 1.
    """
    value = env.get("TF_DIFFMAP_MAX_WORKERS")
    return _at_least_one("TF_DIFFMAP_MAX_WORKERS", value) if value else None


def _at_least_one(name: str, value: str) -> int:
    """A variable's whole number of at least 1, or a TaskError that says so."""
    if not value.strip().isdigit() or int(value) < 1:
        raise TaskError(f"{name} must be a whole number of at least 1, received {value!r}.")
    return int(value)


def task_index(env: Mapping[str, str], hostname: str) -> int:
    """This pod's index: its indexed Job's completion index, or its StatefulSet ordinal.

    Raises:
        TaskError: neither `JOB_COMPLETION_INDEX` nor a hostname ending in
            `-<ordinal>`.
    """
    index = env.get("JOB_COMPLETION_INDEX")
    if index is not None:
        if not index.isdigit():
            raise TaskError(f"JOB_COMPLETION_INDEX must be a whole number, received {index!r}.")
        return int(index)
    match = _ORDINAL.search(hostname)
    if match is None:
        raise TaskError(
            f"No index for this pod: JOB_COMPLETION_INDEX is unset (not an indexed Job) and "
            f"its hostname {hostname!r} does not end in -<ordinal> (not a StatefulSet)."
        )
    return int(match.group(1))


def tf_config_from_pod(env: Mapping[str, str], hostname: str) -> str:
    """The TF_CONFIG of this pod's task, from the variables the plain manifests set.

    Args:
        env: the pod's environment (see the module's docstring).
        hostname: the pod's hostname.

    Returns:
        TF_CONFIG as a JSON string: every task's address by type, and this task.

    Raises:
        TaskError: a variable missing or malformed, an index beyond its type's
            count, addresses that are not distinct, or a hostname that is not
            the first label of this task's address.
    """
    missing = [
        name
        for name in ("TF_DIFFMAP_TASK_TYPE", "TF_DIFFMAP_CLUSTER", "TF_DIFFMAP_ADDRESS")
        if not env.get(name)
    ]
    if missing:
        raise TaskError(
            f"TF_CONFIG is unset, and so are {', '.join(missing)}: set TF_CONFIG, or the "
            "TF_DIFFMAP_* variables of the manifests in deploy/kubernetes/."
        )
    task_type = env["TF_DIFFMAP_TASK_TYPE"]
    if task_type not in TASK_TYPES:
        raise TaskError(
            f"TF_DIFFMAP_TASK_TYPE must be one of {TASK_TYPES}, received {task_type!r}."
        )
    counts = parse_counts(env["TF_DIFFMAP_CLUSTER"])
    if task_type not in counts:
        raise TaskError(
            f"This task is a {task_type}, and TF_DIFFMAP_CLUSTER "
            f"({env['TF_DIFFMAP_CLUSTER']!r}) has no {task_type} tasks."
        )
    index = task_index(env, hostname)
    most = max_workers(env)
    if most is not None and most < counts.get("worker", 0):
        raise TaskError(
            f"TF_DIFFMAP_MAX_WORKERS={most} is below the {counts['worker']} workers of "
            f"TF_DIFFMAP_CLUSTER ({env['TF_DIFFMAP_CLUSTER']!r}): give at least as many."
        )
    if task_type == "worker" and most is not None and counts[task_type] <= index < most:
        # A worker of a scaled-up StatefulSet: its TF_CONFIG names it, beyond
        # the first workers, and it joins the running fit (`--join`).
        counts = {**counts, "worker": index + 1}
    if index >= counts[task_type]:
        if task_type == "worker" and most is not None:
            raise TaskError(
                f"This task is worker {index}, and TF_DIFFMAP_MAX_WORKERS={most} lets the "
                f"cluster grow to workers 0 to {most - 1}: scale the StatefulSet to at most "
                f"{most} replicas, or raise TF_DIFFMAP_MAX_WORKERS (the chief reads it when "
                "it starts)."
            )
        raise TaskError(
            f"This task is {task_type} {index}, and TF_DIFFMAP_CLUSTER "
            f"({env['TF_DIFFMAP_CLUSTER']!r}) counts {counts[task_type]}: scale the "
            "StatefulSet and TF_DIFFMAP_CLUSTER together"
            + (
                ", or set TF_DIFFMAP_MAX_WORKERS so that workers beyond it join the running fit."
                if task_type == "worker"
                else "."
            )
        )
    template = env["TF_DIFFMAP_ADDRESS"]
    namespace = env.get("POD_NAMESPACE", "default")
    try:
        cluster = {
            job: [template.format(type=job, index=i, namespace=namespace) for i in range(count)]
            for job, count in counts.items()
        }
    except (KeyError, IndexError, ValueError) as error:
        raise TaskError(
            f"TF_DIFFMAP_ADDRESS={template!r} is not an address template with {{type}}, "
            f"{{index}} and {{namespace}}: {error!r}."
        ) from None
    addresses = [a for job in cluster.values() for a in job]
    if len(set(addresses)) != len(addresses):
        raise TaskError(
            f"TF_DIFFMAP_ADDRESS={template!r} gives tasks the same address: put {{type}} "
            "and {index} in it."
        )
    own = cluster[task_type][index]
    if own.split(".", 1)[0].split(":", 1)[0] != hostname:
        raise TaskError(
            f"This pod's hostname is {hostname!r}, and its address is {own!r}: the "
            "StatefulSet or Job name and TF_DIFFMAP_ADDRESS disagree."
        )
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})


def command(tf_config: str, argv: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """What this task runs: its server, or the chief's command.

    Args:
        tf_config: the task's TF_CONFIG.
        argv: the command given to the container.
        env: the pod's environment, for a worker's `TF_DIFFMAP_LOGICAL_CPUS`
            and `TF_DIFFMAP_MAX_WORKERS` (set: the worker joins through the
            chief's membership endpoint, `--join`).

    Raises:
        TaskError: TF_CONFIG that names no task of the types here, a chief
            without a command, or a `TF_DIFFMAP_LOGICAL_CPUS` or
            `TF_DIFFMAP_MAX_WORKERS` below 1.
    """
    try:
        task_type = json.loads(tf_config)["task"]["type"]
    except (ValueError, KeyError, TypeError):
        raise TaskError(
            f"TF_CONFIG must be JSON with a task type, received {tf_config[:200]!r}."
        ) from None
    if task_type not in TASK_TYPES:
        raise TaskError(f"TF_CONFIG names task type {task_type!r}; this image runs {TASK_TYPES}.")
    elastic = max_workers(env) is not None  # checked for every task: the chief reads it too
    if task_type in SERVER_TYPES:
        server = [sys.executable, "-m", "tf_diffmap.cluster"]
        cpus = env.get("TF_DIFFMAP_LOGICAL_CPUS")
        if cpus is not None and task_type == "worker":
            server += ["--logical-cpus", str(_at_least_one("TF_DIFFMAP_LOGICAL_CPUS", cpus))]
        if task_type == "worker" and elastic:
            server += ["--join"]
        return server
    if not argv:
        raise TaskError("The chief runs the container's command, and none was given.")
    return list(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Replaces this process with the task's server or the chief's command."""
    argv = sys.argv[1:] if argv is None else argv
    env = dict(os.environ)
    try:
        if not env.get("TF_CONFIG"):
            env["TF_CONFIG"] = tf_config_from_pod(env, socket.gethostname())
        run = command(env["TF_CONFIG"], argv, env)
    except TaskError as error:
        print(f"tf_diffmap entrypoint: {error}", file=sys.stderr)
        return 2
    task = json.loads(env["TF_CONFIG"])["task"]
    print(f"tf_diffmap {task['type']} {task['index']}: {' '.join(run)}", file=sys.stderr)
    sys.stderr.flush()
    os.execvpe(run[0], run, env)
    return 1  # not reached: execvpe returns only by raising


if __name__ == "__main__":
    sys.exit(main())
