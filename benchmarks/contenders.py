"""The contenders: what a Keras user would train with instead of `tf_diffmap`.

`CONTENDERS` describes them for the parent process (labels, which Python runs
them); `Runtime` builds one inside a worker process, after the logical devices
are made. Each contender gets the same devices (logical CPU devices, or GPUs
with `device="gpu"`), the same model, the same data and the same global batch
size. The cluster contenders start their own localhost cluster of worker
and ps processes, which `Runtime.close` stops.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from types import ModuleType
from typing import Any

from benchmarks.plan import CLUSTER_CONTENDERS

__all__ = ["CONTENDERS", "Contender", "Runtime", "label"]


@dataclasses.dataclass(frozen=True)
class Contender:
    """One contender.

    Attributes:
        name: its key in configurations and results.
        label: how tables and plots name it.
        legacy: runs under tf-keras (`TF_USE_LEGACY_KERAS=1`) in the Python
            given by `--tf-keras-python`, not under Keras 3.
        asynchronous: a `tf_diffmap.Strategy` (reports staleness).
    """

    name: str
    label: str
    legacy: bool = False
    asynchronous: bool = False


CONTENDERS = {
    c.name: c
    for c in (
        Contender("plain_keras", "plain Keras"),
        Contender("mirrored", "MirroredStrategy"),
        # The default: the store aggregates one fresh shard gradient per
        # replica into each optimizer step (`gradients_per_step="auto"`,
        # `max_step_staleness=0`), a late window filled past its patience.
        Contender("tf_diffmap", "tf_diffmap", asynchronous=True),
        # The same, a late shard put back on the queue (`late_shards="requeue"`).
        Contender("tf_diffmap_requeue", "tf_diffmap, late shards requeued", asynchronous=True),
        # Asynchronous windows (`max_step_staleness=1`, the default before
        # fresh windows): no replica waits, gradients up to a step stale.
        Contender(
            "tf_diffmap_async_windows", "tf_diffmap, asynchronous windows", asynchronous=True
        ),
        # Every shard's gradient a step of its own (`gradients_per_step=1`), as
        # before aggregation, and where `AsyncOptimizer`'s per-update rules apply.
        Contender("tf_diffmap_per_shard", "tf_diffmap, a step per shard", asynchronous=True),
        # Fresh windows (`max_step_staleness=0`): every step from gradients
        # of the current parameters, replicas in step, a window closed short
        # ("close", backup replicas) or filled ("fill") past its patience.
        Contender("tf_diffmap_fresh", "tf_diffmap, fresh windows", asynchronous=True),
        Contender("tf_diffmap_fresh_fill", "tf_diffmap, fresh windows filled", asynchronous=True),
        Contender(
            "tf_diffmap_own_devices",
            "tf_diffmap, each replica's ops on its own device",
            asynchronous=True,
        ),
        Contender("tf_diffmap_bounded", "tf_diffmap bounded", asynchronous=True),
        Contender("central_storage", "CentralStorage (tf-keras)", legacy=True),
        Contender("tf_diffmap_cluster", "tf_diffmap, localhost cluster", asynchronous=True),
        # The same cluster with asynchronous windows (`max_step_staleness=1`).
        Contender(
            "tf_diffmap_cluster_async",
            "tf_diffmap, localhost cluster, asynchronous windows",
            asynchronous=True,
        ),
        Contender("parameter_server", "ParameterServerStrategy (tf-keras)", legacy=True),
    )
}

DEVICES = ("cpu", "gpu")

# The contenders that train tf_diffmap on a localhost cluster of their own.
TF_DIFFMAP_CLUSTER = ("tf_diffmap_cluster", "tf_diffmap_cluster_async")


def label(name: str, max_staleness: int | None = None) -> str:
    """The display name of a contender."""
    if name == "tf_diffmap_bounded" and max_staleness is not None:
        return f"tf_diffmap max_staleness={max_staleness}"
    return CONTENDERS[name].label


class Runtime:
    """A contender inside a worker process: TensorFlow, Keras and the strategy.

    Creating it makes the logical CPU devices, so it must come before anything
    else touches TensorFlow in the process.

    Args:
        contender: a key of `CONTENDERS`.
        replicas: logical CPU devices to make (and replicas to run); plain
            Keras uses the first device only.
        max_staleness: the bound of `tf_diffmap_bounded`.
        mirrored_reduce: `"one_device"` (`ReductionToOneDevice`, the faster
            on this 2-core host) or `"collective"` (MirroredStrategy's own
            choice on CPUs in TF 2.21).
        replicas_per_device: tf_diffmap's replicas on each device (the
            default and per-shard contenders).
        steps_per_loop: tf_diffmap's `Strategy(steps_per_loop=K)` (None: its
            default).
        device: `"cpu"` (replicas are logical CPU devices) or `"gpu"` (one
            GPU per replica, or `gpu_memory_mb` slices of the first GPU when
            there are fewer GPUs than replicas).
        gpu_memory_mb: memory of each logical GPU when a GPU is split.
        cluster: `{"workers": n, "ps": m}` for the cluster contenders: the
            localhost cluster to start (its servers see no GPU); with
            `"split": True`, ParameterServerStrategy splits large variables
            over the ps tasks (`MinSizePartitioner`, 256 KiB shards), as
            tf_diffmap does by default on such a cluster.
        inter_op_threads: TensorFlow's inter-op pool, set before it starts
            (None: TensorFlow's default, one thread per core).

    Attributes:
        devices: the replicas' devices (the workers', on a cluster).
    """

    def __init__(
        self,
        contender: str,
        replicas: int,
        max_staleness: int | None = None,
        mirrored_reduce: str = "one_device",
        replicas_per_device: int = 1,
        steps_per_loop: int | None = None,
        device: str = "cpu",
        gpu_memory_mb: int | None = None,
        cluster: dict[str, int] | None = None,
        inter_op_threads: int | None = None,
    ):
        if contender not in CONTENDERS:
            raise ValueError(
                f"Unknown contender {contender!r}; expected one of {list(CONTENDERS)}."
            )
        if device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, received {device!r}.")
        self.name = contender
        self.replicas = replicas
        self.legacy = CONTENDERS[contender].legacy
        self.max_staleness = max_staleness
        self.mirrored_reduce = mirrored_reduce
        self.replicas_per_device = replicas_per_device
        self.steps_per_loop = steps_per_loop
        self.device = device
        self.cluster = cluster
        self._servers = None  # the localhost cluster of a cluster contender
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        if self.legacy:
            os.environ["TF_USE_LEGACY_KERAS"] = "1"
            import tensorflow as tf

            split = _logical_devices(tf)
            self.keras: ModuleType = tf.keras
            import tf_keras

            self.keras_version = f"tf-keras {tf_keras.__version__}"
        else:
            import tf_diffmap

            split = tf_diffmap.split_devices
            import keras
            import tensorflow as tf

            self.keras = keras
            self.keras_version = f"Keras {keras.__version__}"
            self.tf_diffmap_version = tf_diffmap.__version__
        self.tf = tf
        if inter_op_threads:
            # Before TensorFlow starts: enough threads for every replica that
            # sleeps in its emulated device time (`workloads.replica_delay`).
            tf.config.threading.set_inter_op_parallelism_threads(inter_op_threads)
        if contender in CLUSTER_CONTENDERS:
            self.devices: list[str] = []  # the workers' devices, once connected
        else:
            self.devices = _replica_devices(tf, replicas, device, gpu_memory_mb, split)
        try:
            self.strategy = self._make_strategy()
        except BaseException:
            self.close()
            raise

    @property
    def local_cluster(self):
        """The `tf_diffmap.cluster.LocalCluster` of `tf_diffmap_cluster`, else None."""
        return self._servers if self.name in TF_DIFFMAP_CLUSTER else None

    def process_ids(self) -> list[int]:
        """The processes this contender trains in: this one, and the servers
        of the localhost cluster it started (none off a cluster)."""
        servers = self._servers
        if servers is None:
            return [os.getpid()]
        pids = servers.pids
        return [os.getpid(), *(pids.values() if isinstance(pids, dict) else pids)]

    def close(self) -> None:
        """Stops the localhost cluster this runtime started, if any."""
        if self._servers is not None:
            servers, self._servers = self._servers, None
            servers.stop()

    def _start_local_cluster(self):
        """The cluster workload's `LocalCluster` (this process is its chief), started."""
        from tf_diffmap import cluster

        return cluster.LocalCluster(
            workers=self.cluster["workers"],
            ps=self.cluster["ps"],
            env={"CUDA_VISIBLE_DEVICES": ""},
        ).start()

    def _make_strategy(self):
        tf = self.tf
        if self.name == "plain_keras":
            return None
        if self.name in TF_DIFFMAP_CLUSTER:
            from tf_diffmap import cluster

            self._servers = self._start_local_cluster()
            strategy = cluster.strategy_for_cluster(
                self._servers.resolver(), **self._tf_diffmap_options()
            )
            self.devices = list(strategy.replica_devices)
            return strategy
        if self.name == "parameter_server":
            import sys

            from benchmarks.servers import LocalServers

            self._servers = LocalServers(
                workers=self.cluster["workers"],
                ps=self.cluster["ps"],
                python=sys.executable,
                env={"CUDA_VISIBLE_DEVICES": ""},
            ).start()
            partitioner = None
            if self.cluster.get("split"):
                partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
                    min_shard_bytes=256 << 10, max_shards=self.cluster["ps"]
                )
            strategy = tf.distribute.experimental.ParameterServerStrategy(
                self._servers.resolver(), variable_partitioner=partitioner
            )
            self.devices = [
                f"/job:worker/replica:0/task:{i}/device:CPU:0"
                for i in range(self.cluster["workers"])
            ]
            return strategy
        if self.name == "mirrored":
            if self.mirrored_reduce == "one_device":
                ops = tf.distribute.ReductionToOneDevice()
            elif self.mirrored_reduce == "collective":
                ops = None  # MirroredStrategy picks collective all-reduce on CPUs.
            else:
                raise ValueError(
                    f"mirrored_reduce must be 'collective' or 'one_device', "
                    f"received {self.mirrored_reduce!r}."
                )
            return tf.distribute.MirroredStrategy(self.devices, cross_device_ops=ops)
        if self.name == "central_storage":
            return tf.distribute.experimental.CentralStorageStrategy(
                compute_devices=self.devices,
                parameter_device=self.devices[0] if self.device == "cpu" else "/device:CPU:0",
            )
        import tf_diffmap

        if self.name in (
            "tf_diffmap",
            "tf_diffmap_requeue",
            "tf_diffmap_async_windows",
            "tf_diffmap_per_shard",
            "tf_diffmap_own_devices",
            "tf_diffmap_fresh",
            "tf_diffmap_fresh_fill",
        ):
            return tf_diffmap.Strategy(
                devices=self.devices,
                replicas_per_device=self.replicas_per_device,
                **self._tf_diffmap_options(),
            )
        return tf_diffmap.Strategy(
            devices=self.devices, max_staleness=self.max_staleness, **self._tf_diffmap_options()
        )

    def _tf_diffmap_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {}
        if self.steps_per_loop is not None:
            options["steps_per_loop"] = self.steps_per_loop
        if self.name == "tf_diffmap_own_devices":
            # As GPU replicas are placed: the transfers between devices paid.
            options["colocate_cpu_replicas"] = False
        if self.name == "tf_diffmap_per_shard":
            options["gradients_per_step"] = 1
        if self.name == "tf_diffmap_bounded":
            # The bound applies to asynchronous windows: fresh ones keep
            # replicas in step already.
            options["max_step_staleness"] = 1
        if self.name.startswith("tf_diffmap_fresh"):
            options["max_step_staleness"] = 0
            options["late_window"] = "fill" if self.name.endswith("_fill") else "close"
        if self.name == "tf_diffmap_requeue":
            options["late_shards"] = "requeue"
        if self.name in ("tf_diffmap_async_windows", "tf_diffmap_cluster_async"):
            options["max_step_staleness"] = 1
        return options

    def scope(self):
        """The strategy's scope (a no-op for plain Keras)."""
        if self.strategy is None:
            return contextlib.nullcontext()
        return self.strategy.scope()

    @property
    def asynchronous(self) -> bool:
        return CONTENDERS[self.name].asynchronous

    def optimizer(self, learning_rate: float, rule: str | None = None, drop_above=None):
        """Adam, wrapped in `tf_diffmap.AsyncOptimizer` when a rule is given."""
        adam = self.keras.optimizers.Adam(learning_rate)
        if rule is None:
            return adam
        if not self.asynchronous:
            raise ValueError(f"Staleness rule {rule!r} needs a tf_diffmap contender.")
        import tf_diffmap

        return tf_diffmap.AsyncOptimizer(adam, staleness=rule, drop_above=drop_above)

    def statistics(self) -> dict[str, Any] | None:
        """The store's staleness statistics, for tf_diffmap contenders."""
        if not self.asynchronous:
            return None
        # Read after `reset_statistics()`, so every counter covers one task.
        return self.strategy.statistics().as_dict()

    def reset_statistics(self) -> None:
        if self.asynchronous:
            self.strategy.reset_statistics()

    def replica_steps(self) -> list[int] | None:
        if not self.asynchronous:
            return None
        return list(self.strategy.replica_steps())


def _logical_devices(tf):
    """`split_devices` for tf-keras' environment, which has no `tf_diffmap`."""

    def split(count: int, kind: str, memory_mb: int | None) -> list[str]:
        physical = tf.config.list_physical_devices(kind)[0]
        tf.config.set_logical_device_configuration(
            physical,
            [tf.config.LogicalDeviceConfiguration(memory_limit=memory_mb) for _ in range(count)],
        )
        return [d.name for d in tf.config.list_logical_devices(kind)]

    return split


def _replica_devices(tf, replicas: int, device: str, gpu_memory_mb, split) -> list[str]:
    """The replicas' devices: logical CPUs, one GPU each, or slices of the first GPU.

    Args:
        tf: TensorFlow, its devices not yet initialized.
        replicas: how many devices.
        device: `"cpu"` or `"gpu"`.
        gpu_memory_mb: memory of each slice when a GPU is split.
        split: `(count, kind, memory_mb) -> device names` (`split_devices`).

    Raises:
        RuntimeError: `"gpu"` in a process that sees no GPU.
        ValueError: a GPU to split without `gpu_memory_mb`.
    """
    if device == "cpu":
        return split(replicas, "CPU", None)[:replicas]
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        raise RuntimeError(
            "device 'gpu' was asked for, but this process sees no GPU "
            "(tf.config.list_physical_devices('GPU') is empty); use device 'cpu'."
        )
    if len(gpus) >= replicas:
        return [d.name for d in tf.config.list_logical_devices("GPU")][:replicas]
    if gpu_memory_mb is None:
        raise ValueError(
            f"{replicas} replicas on {len(gpus)} GPU(s) split the first GPU, which needs "
            "gpu_memory_mb (the memory of each slice, for example 2048)."
        )
    return split(replicas, "GPU", gpu_memory_mb)[:replicas]
