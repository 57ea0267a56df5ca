"""The cluster workload's floor: a bare asynchronous parameter-server loop.

What the least an asynchronous parameter-server loop costs in TensorFlow's own
runtime, on the cluster workload's shape (workers, ps tasks and the chief as
processes of one host, talking gRPC): the MLP's parameters and Adam's slots
live on the ps task; each worker runs one `tf.function` whose `tf.while_loop`,
on the worker's device, does a forward and backward pass on a batch of its
own and applies Adam beside the parameters on the ps device
(`ResourceApplyAdam` under `tf.device(variable.device)`, as tf_diffmap applies
its updates beside the store), one update after the other; the workers' calls
run at once, one Python thread each (a remote call releases the GIL while it
waits). Each update reads the parameters from the ps task and sends its
gradients back: the traffic every asynchronous parameter server has. Adam's
bias correction reads a step counter on the ps, as Keras' `iterations`.

What it is not: no input pipeline (each worker trains on one fixed batch of
`batch_size / workers` examples, the size of a tf_diffmap shard, read once
per call from a variable on the worker); no Keras (no model, no compiled
step, no loss or metrics returned, no callbacks); no tf_diffmap bookkeeping
(no queue of shards, no version counter, no staleness accounting, no
failure handling); and no dealing of work: each worker applies the same
number of updates per call. A contender that trains the same model on the
same cluster pays for those above this floor; the floor itself is what the
runtime, gRPC and the kernels cost on this host, with every process sharing
its cores.

Timed like the other cluster rows (`benchmarks.worker.run_cluster`): a
warm-up call traces the loop, then "epochs" of `examples_per_epoch` examples
(one call per worker, each of `ceil(examples_per_epoch / batch_size)`
updates) until both `min_epochs` and `min_seconds` are reached, the first
epoch timed but not counted.
"""

from __future__ import annotations

import concurrent.futures
import math
import statistics
import time
from typing import Any

import numpy as np
import tensorflow as tf

from benchmarks import timeline, workloads

__all__ = ["HIDDEN_UNITS", "ParameterServerLoop", "run_cluster"]

# The hidden layers of the MLPs of `workloads.MODELS` (ReLU; a softmax head).
HIDDEN_UNITS = {"mlp": (256, 128), "mlp_wide": (256, 256)}

# Keras' Adam defaults but the learning rate (the workload's).
BETA_1, BETA_2, EPSILON = 0.9, 0.999, 1e-7


class ParameterServerLoop:
    """An MLP's parameters and Adam's state on ps devices; one update loop per worker.

    Args:
        model: a key of `HIDDEN_UNITS` (an MLP of `workloads.MODELS`).
        worker_devices: one device per worker task; each runs its own loop.
        parameter_devices: the ps tasks' devices; the parameters go round-robin
            over them, each with its Adam slots beside it; the step counter
            Adam's bias correction reads is on the first.
        shard: examples per update (a worker's fixed batch).
        learning_rate: Adam's learning rate.
        seed: seeds the initial weights and the data the batches are cut from.

    Raises:
        ValueError: an unknown model, no worker or ps device, or a shard < 1.

    Example:
        >>> loop = ParameterServerLoop("mlp_wide", ["/device:CPU:0"], ["/device:CPU:0"],
        ...                            shard=64, learning_rate=1e-3)  # doctest: +SKIP
        >>> loop.run(10)  # doctest: +SKIP
        [0.0123]
    """

    def __init__(
        self,
        model: str,
        worker_devices: list[str],
        parameter_devices: list[str],
        shard: int,
        learning_rate: float,
        seed: int = 0,
    ) -> None:
        if model not in HIDDEN_UNITS:
            raise ValueError(
                f"Unknown model {model!r} for the floor; expected one of {sorted(HIDDEN_UNITS)}."
            )
        if not worker_devices or not parameter_devices:
            raise ValueError(
                f"The floor needs worker and ps devices, received workers {worker_devices!r} "
                f"and ps {parameter_devices!r}."
            )
        if shard < 1:
            raise ValueError(f"shard must be at least 1 example, received {shard!r}.")
        self.worker_devices = list(worker_devices)
        self.parameter_devices = list(parameter_devices)
        self.shard = shard
        self.learning_rate = float(learning_rate)
        spec = workloads.MODELS[model]
        features = int(np.prod(spec["input_shape"]))
        widths = (features, *HIDDEN_UNITS[model], spec["classes"])
        rng = np.random.default_rng(seed)
        self.parameters: list[tf.Variable] = []
        self.slots: list[tuple[tf.Variable, tf.Variable]] = []
        for i, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:])):
            limit = math.sqrt(6.0 / (fan_in + fan_out))  # Glorot uniform, as Dense
            kernel = rng.uniform(-limit, limit, (fan_in, fan_out)).astype("float32")
            bias = np.zeros(fan_out, "float32")
            with tf.device(self.parameter_devices[i % len(self.parameter_devices)]):
                for value in (kernel, bias):
                    self.parameters.append(tf.Variable(value))
                    m, v = tf.Variable(np.zeros_like(value)), tf.Variable(np.zeros_like(value))
                    self.slots.append((m, v))
        with tf.device(self.parameter_devices[0]):
            self.step = tf.Variable(0, dtype=tf.int64)
        # Each worker's fixed batch: its own slice of the workload's data.
        x, y = workloads.synthetic_data(model, shard * len(self.worker_devices), seed)
        x = x.reshape(len(x), -1)
        self.batches = []
        for w, device in enumerate(self.worker_devices):
            with tf.device(device):
                rows = slice(w * shard, (w + 1) * shard)
                self.batches.append((tf.Variable(x[rows]), tf.Variable(y[rows])))
        self._loops = [self._make_loop(w) for w in range(len(self.worker_devices))]

    def _forward(self, x):
        h = x
        pairs = list(zip(self.parameters[0::2], self.parameters[1::2]))
        for i, (kernel, bias) in enumerate(pairs):
            h = tf.matmul(h, kernel) + bias
            if i < len(pairs) - 1:
                h = tf.nn.relu(h)
        return h  # logits; the softmax is in the loss

    def _apply_adam(self, gradients) -> list:
        with tf.device(self.step.device):
            t = tf.cast(self.step.assign_add(1), tf.float32)
            beta_1_power, beta_2_power = tf.pow(BETA_1, t), tf.pow(BETA_2, t)
        ops = []
        for variable, (m, v), gradient in zip(self.parameters, self.slots, gradients):
            with tf.device(variable.device):
                ops.append(
                    tf.raw_ops.ResourceApplyAdam(
                        var=variable.handle,
                        m=m.handle,
                        v=v.handle,
                        beta1_power=beta_1_power,
                        beta2_power=beta_2_power,
                        lr=self.learning_rate,
                        beta1=BETA_1,
                        beta2=BETA_2,
                        epsilon=EPSILON,
                        grad=gradient,
                    )
                )
        return ops

    def _make_loop(self, worker: int):
        device = self.worker_devices[worker]
        x_var, y_var = self.batches[worker]

        @tf.function
        def loop(updates):
            with tf.device(device):
                x, y = x_var.read_value(), y_var.read_value()

                def body(i):
                    # The body's own graph: on the worker again, but for the applies,
                    # which `_apply_adam` places beside the parameters.
                    with tf.device(device):
                        with tf.GradientTape() as tape:
                            logits = self._forward(x)
                            loss = tf.reduce_mean(
                                tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits)
                            )
                        applied = self._apply_adam(tape.gradient(loss, self.parameters))
                        # The next update starts once this one is applied: one at a time.
                        with tf.control_dependencies(applied):
                            return (i + 1,)

                return tf.while_loop(lambda i: i < updates, body, (tf.constant(0),))[0]

        return loop

    def run(self, updates: int) -> list[float]:
        """Runs `updates` updates on every worker at once.

        Returns:
            Each worker's seconds, from its call to the loop's end.
        """
        count = tf.constant(updates)

        def one(loop) -> float:
            start = time.perf_counter()
            done = int(loop(count))  # reading the result waits for the loop
            seconds = time.perf_counter() - start
            if done != updates:
                raise RuntimeError(f"A worker's loop ran {done} updates, not {updates}.")
            return seconds

        with concurrent.futures.ThreadPoolExecutor(len(self._loops)) as pool:
            return list(pool.map(one, self._loops))

    def updates_applied(self) -> int:
        """Every update applied so far, by all workers (Adam's step counter)."""
        return int(self.step.numpy())


def run_cluster(rt, task: dict, seed: int) -> dict[str, Any]:
    """The floor's row of the cluster workload, on the runtime's cluster.

    Args:
        rt: a `benchmarks.contenders.Runtime` of the `floor_cluster` contender,
            connected to its localhost cluster.
        task: the cluster task (model, global batch, learning rate, epoch size,
            `min_epochs`, `min_seconds`).
        seed: seeds the initial weights and the batches.

    Returns:
        The keys of `benchmarks.worker.run_cluster`'s result that the report
        reads, and the updates the ps applied against those expected.

    Raises:
        ValueError: a global batch that the workers cannot share evenly.
    """
    workers = len(rt.devices)
    batch_size = task["batch_size"]
    if batch_size % workers:
        raise ValueError(
            f"The floor splits the global batch {batch_size} over {workers} workers; "
            "give a batch size that is a multiple of the workers."
        )
    shard = batch_size // workers
    loop = ParameterServerLoop(
        task["model"], rt.devices, rt.parameter_devices, shard, task["learning_rate"], seed
    )
    updates = math.ceil(task["examples_per_epoch"] / batch_size)  # per worker per epoch
    examples = updates * batch_size
    start = time.perf_counter()
    loop.run(3)  # traces the loop, as the other rows' warm-up fit of 3 steps
    warmup = time.perf_counter() - start
    seconds: list[float] = []
    worker_seconds = [0.0] * workers
    pids = rt.process_ids()
    cpu_start = timeline.processes_cpu_seconds(pids)
    while len(seconds) < task["min_epochs"] + 1 or sum(seconds[1:]) < task["min_seconds"]:
        start = time.perf_counter()
        for w, s in enumerate(loop.run(updates)):
            worker_seconds[w] += s
        seconds.append(time.perf_counter() - start)
    cpu_end = timeline.processes_cpu_seconds(pids)
    counted = seconds[1:]
    median = statistics.median(counted)
    window = sum(seconds)
    per_worker = updates * len(seconds)
    return {
        "epochs": len(counted),
        "examples_per_epoch": examples,
        "first_epoch_seconds": seconds[0],
        "epoch_seconds": counted,
        "median_epoch_seconds": median,
        "examples_per_second": examples / median,
        "mean_examples_per_second": examples * len(counted) / sum(counted),
        "shard": shard,
        "replica_steps": [per_worker] * workers,
        "replica_ms_per_update": [1000 * window / per_worker] * workers,
        "median_replica_ms_per_update": 1000 * window / per_worker,
        "replica_time_source": "window seconds / the worker's updates",
        # What each worker's own calls took: the slower one sets an epoch's end.
        "worker_ms_per_update": [1000 * s / per_worker for s in worker_seconds],
        "updates_applied": loop.updates_applied(),
        "updates_expected": workers * (3 + per_worker),
        "warmup_seconds": warmup,
        "window_seconds": window,
        "devices": list(rt.devices),
        "parameter_devices": list(rt.parameter_devices),
        **timeline.cpu_per_work(
            cpu_start, cpu_end, len(pids), workers * per_worker, workers * per_worker * shard
        ),
    }
