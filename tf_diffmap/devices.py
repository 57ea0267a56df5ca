"""Device discovery and logical devices.

A host with one CPU (or one GPU) still runs several replicas once the device is
split into logical devices, which TensorFlow only allows before it initializes
its devices. `split_devices` does that; `resolve_devices` turns what a user
passes to `Strategy` into canonical device names, or says what is wrong.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import tensorflow as tf

__all__ = [
    "split_devices",
    "default_replica_devices",
    "warn_if_one_replica",
    "inter_op_threads",
    "compute_device",
    "canonical_device",
    "resolve_devices",
    "task_name",
    "task_parts",
]

_logger = logging.getLogger("tf_diffmap")


def split_devices(
    num_replicas: int,
    device_type: str = "auto",
    gpu_memory_mb: int | None = None,
) -> list[str]:
    """Splits the first physical CPU or GPU into logical devices.

    Call it once, at the start of the program, before anything else asks
    TensorFlow for a device (creating a tensor, a model or a `Strategy`).

    Args:
        num_replicas: how many logical devices to make (at least 1).
        device_type: `"CPU"`, `"GPU"`, or `"auto"` (the first GPU if there is
            one, else the CPU).
        gpu_memory_mb: memory for each logical GPU; by default the GPU's memory
            is not limited per device, which TensorFlow does not allow for
            logical GPUs, so it must be given when splitting a GPU.

    Returns:
        The names of the logical devices of that type, usable as
        `Strategy(devices=...)`.

    Raises:
        ValueError: `num_replicas` below 1, an unknown `device_type`, a GPU
            requested where there is none, or a GPU split without
            `gpu_memory_mb`.
        RuntimeError: TensorFlow has already initialized its devices with
            another configuration.

    Once TensorFlow has initialized its devices, a call with the same split
    returns the same devices, and a call with another raises `RuntimeError`.

    Examples:
        >>> import tf_diffmap
        >>> tf_diffmap.split_devices(4, "CPU")
        ['/device:CPU:0', '/device:CPU:1', '/device:CPU:2', '/device:CPU:3']
    """
    if not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"split_devices needs num_replicas >= 1, received {num_replicas!r}.")
    kind = device_type.upper()
    if kind not in ("AUTO", "CPU", "GPU"):
        raise ValueError(f"device_type must be 'CPU', 'GPU' or 'auto', received {device_type!r}.")
    gpus = tf.config.list_physical_devices("GPU")
    if kind == "AUTO":
        kind = "GPU" if gpus else "CPU"
    if kind == "GPU" and not gpus:
        raise ValueError("split_devices(device_type='GPU') found no GPU; use 'CPU' or 'auto'.")
    if kind == "GPU" and gpu_memory_mb is None:
        raise ValueError(
            "Splitting a GPU needs gpu_memory_mb, the memory of each logical "
            "GPU (for example 2048)."
        )
    physical = gpus[0] if kind == "GPU" else tf.config.list_physical_devices("CPU")[0]
    if kind == "GPU":
        config = [
            tf.config.LogicalDeviceConfiguration(memory_limit=gpu_memory_mb)
            for _ in range(num_replicas)
        ]
    else:
        config = [tf.config.LogicalDeviceConfiguration() for _ in range(num_replicas)]
    current = tf.config.get_logical_device_configuration(physical)
    if current is None or len(current) != num_replicas:
        try:
            tf.config.set_logical_device_configuration(physical, config)
        except RuntimeError as error:
            have = len(tf.config.list_logical_devices(kind))
            raise RuntimeError(
                f"Cannot split the {kind} into {num_replicas} logical devices: "
                f"TensorFlow has already initialized its devices ({have} logical "
                f"{kind} device(s)). Call tf_diffmap.split_devices at the start "
                "of the program, before creating tensors, models or a Strategy; "
                "in a notebook, restart the runtime first."
            ) from error
    return [d.name for d in tf.config.list_logical_devices(kind)]


def default_replica_devices() -> list[str]:
    """Every logical GPU, or where there is none, every logical CPU device.

    These are the replica devices of a `Strategy()` given no `devices`, one
    replica each (with `replicas_per_device=1`).

    Returns:
        The devices' names.

    Examples:
        >>> import tf_diffmap
        >>> devices = tf_diffmap.default_replica_devices()
        >>> tf_diffmap.Strategy().replica_devices == tuple(devices)
        True
    """
    gpus = tf.config.list_logical_devices("GPU")
    devices = gpus or tf.config.list_logical_devices("CPU")
    return [d.name for d in devices]


def warn_if_one_replica(replicas: Sequence[str]) -> None:
    """Logs a warning when the default devices give a single replica.

    A `Strategy()` on a host with one CPU (not split) or one GPU trains one
    replica: it runs, but nothing is asynchronous, which a user who adapted
    an example would not notice.

    Args:
        replicas: the replica devices the strategy chose by default.
    """
    if len(replicas) != 1:
        return
    kind = tf.DeviceSpec.from_string(replicas[0]).device_type or "CPU"
    split = "split_devices(n)" if kind == "CPU" else 'split_devices(n, "GPU", gpu_memory_mb=...)'
    _logger.warning(
        "tf_diffmap.Strategy() found a single %s device (%s), so it trains one replica "
        "and nothing runs asynchronously. To train n replicas on this %s, call "
        "tf_diffmap.%s first thing in the program, before TensorFlow initializes its "
        "devices (in a notebook, restart the runtime first); or pass "
        "Strategy(replicas_per_device=n).",
        kind,
        replicas[0],
        kind,
        split,
    )


def inter_op_threads() -> int:
    """Threads in TensorFlow's inter-op pool, which runs every function's ops.

    What `tf.config.threading` was given, else `TF_NUM_INTEROP_THREADS`, else
    TensorFlow's default of one thread per CPU this process may run on.
    """
    configured = tf.config.threading.get_inter_op_parallelism_threads()
    if configured > 0:
        return configured
    try:
        from_env = int(os.environ.get("TF_NUM_INTEROP_THREADS", "0"))
    except ValueError:
        from_env = 0
    if from_env > 0:
        return from_env
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def local_cpu() -> str:
    """The CPU of this process's own task (where eager ops run by default)."""
    spec = tf.DeviceSpec.from_string(tf.constant(0).device or "/device:CPU:0")
    return spec.replace(device_type="CPU", device_index=0).to_string()


def host_cpu(device: str) -> str:
    """The CPU of the task that owns `device`."""
    return tf.DeviceSpec.from_string(device).replace(device_type="CPU", device_index=0).to_string()


def compute_device(device: str) -> str:
    """Where a replica on `device` runs its ops.

    The logical CPU devices of one task share its memory and its threads
    (TensorFlow's CPU devices compute on one process-wide pool): an op on
    CPU:2 runs on the cores it would run on as an op on CPU:0, and only
    adds, for every tensor that crosses between the two, a send and a
    receive between two partitions of the graph, each run by an executor of
    its own. A replica on a CPU therefore runs its ops on its task's CPU:0,
    beside the queue, the counters and (by default) the parameter store;
    its id, its loop, its shards and its figures stay its own. A replica on
    any other device (a GPU) runs its ops there.
    """
    if tf.DeviceSpec.from_string(device).device_type == "CPU":
        return host_cpu(device)
    return device


def task_name(device: str) -> str:
    """The task that owns `device`, `/job:<job>/replica:<R>/task:<N>`.

    A device that names no task is this process's (`/job:localhost/...`).
    Two devices are of one task when their task names are equal.
    """
    job, replica, task = task_parts(device)
    return f"/job:{job}/replica:{replica}/task:{task}"


def task_parts(device: str) -> tuple[str, int, int]:
    """The task that owns `device` in parts, `(job, replica, task)`, to
    build a `tf.DeviceSpec` from; a device that names none is this
    process's."""
    spec = tf.DeviceSpec.from_string(device)
    return spec.job or "localhost", spec.replica or 0, spec.task or 0


# How a device name is written, for error messages.
_DEVICE_FORMS = "'CPU:0', 'GPU:1' or '/job:worker/task:0/device:GPU:1'"


def canonical_device(name: str, what: str = "devices") -> str:
    """The canonical form of a device name, not checked to exist.

    Raises:
        ValueError: a name that is not a device name, or names no type.
    """
    return _canonical(name, what)


def _canonical(name: str, what: str = "devices") -> str:
    try:
        spec = tf.DeviceSpec.from_string(name)
    except (ValueError, TypeError) as error:  # TensorFlow's own parse error, e.g. for 'cpu0'
        raise ValueError(
            f"{what} holds {name!r}, which is not a device name; write a device as {_DEVICE_FORMS}."
        ) from error
    if spec.device_type is None:
        raise ValueError(
            f"{what} holds {name!r}, which names no device type; write a device as {_DEVICE_FORMS}."
        )
    spec = spec.replace(device_type=spec.device_type.upper())
    if spec.device_index is None:
        spec = spec.replace(device_index=0)
    return spec.to_string()


def resolve_devices(
    devices: Sequence[str] | str, what: str = "devices", one_name: bool = True
) -> list[str]:
    """Canonical names of `devices`, each checked to exist.

    Args:
        devices: device names such as `"GPU:0"` or `"/device:CPU:1"`.
        what: how the caller names the argument, for error messages.
        one_name: whether a single name (a `str`) stands for a list of one.
            `Strategy(devices=...)` refuses it: a string is a sequence of
            characters, and `devices="CPU:0"` for a list of devices would
            silently train one replica.

    Returns:
        Canonical device names, in the order given.

    Raises:
        ValueError: an empty list, a name that is not a device name, a device
            that this TensorFlow process does not have, a duplicate, or a
            single name where `one_name` is False.
    """
    if isinstance(devices, str):
        if not one_name:
            raise ValueError(
                f"{what} takes a list of device names, received the string {devices!r}. "
                f"For one device write {what}=[{devices!r}] (with replicas_per_device=k "
                f"to run k replicas on it); for several, list them: {what}=['CPU:0', "
                "'CPU:1'], or leave it out to use every GPU (else every logical CPU device)."
            )
        devices = [devices]
    devices = list(devices)
    if not devices:
        raise ValueError(
            f"{what} is empty; pass at least one device name such as 'CPU:0', "
            "or leave it out to use every GPU (else the CPU)."
        )
    known = {_canonical(d.name): d.name for d in tf.config.list_logical_devices()}
    resolved = []
    for name in devices:
        if not isinstance(name, str):
            raise ValueError(f"{what} must hold device names (str), received {name!r}.")
        canonical = _canonical(name, what)
        if canonical not in known:
            raise ValueError(
                f"{what} names {name!r}, which this process does not have. "
                f"Available devices: {sorted(known.values())}. To make more CPU "
                "or GPU devices, call tf_diffmap.split_devices(n) at program "
                "start; for devices of a cluster, connect to it first."
            )
        resolved.append(known[canonical])
    duplicates = sorted({d for d in resolved if resolved.count(d) > 1})
    if duplicates:
        raise ValueError(
            f"{what} lists {duplicates} more than once; to run several replicas "
            "on one device use Strategy(replicas_per_device=k)."
        )
    return resolved
