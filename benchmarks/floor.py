"""Floors: the least what a workload measures costs in TensorFlow's own runtime.

`QueueLoops` is the control workload's floor (see its docstring): Keras'
`fit` whose step only queues shards, and bare loops that apply them (with a
hand-written SGD update, or with Keras' own train step). The
rest of this module is the cluster workload's floor, a bare asynchronous
parameter-server loop.

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
import threading
import time
from typing import Any

import numpy as np
import tensorflow as tf

from benchmarks import timeline, workloads

__all__ = ["HIDDEN_UNITS", "ParameterServerLoop", "QueueLoops", "run_cluster"]

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


class QueueLoops:
    """The control workload's floor: Keras' loop feeding bare replica loops.

    The least an asynchronous step of the control workload's shape costs in
    TensorFlow's runtime under Keras 3's own `fit`: `model` is a Keras model
    whose train step only cuts its batch into one shard per device and puts
    the shards on a `tf.queue.FIFOQueue` (one `enqueue_many`); one Python
    thread per device calls a loop function whose `tf.while_loop`, on that
    device, takes up to `steps_per_loop` shards and applies each as one SGD
    update of a `Dense(1)`'s mean squared error, the parameters on the first
    device (the host, where tf_diffmap's store is) and the gradient computed
    where the loop's replica computes (`compute_devices`: by default the
    loop's own device; tf_diffmap's rule puts CPU replicas on the host's
    CPU:0, `tf_diffmap.devices.compute_device`). A STOP item (`stop`) ends
    a loop; its shard of zeros is applied with a learning rate of 0, so
    that the loop's body has no conditional.

    What it is not: no version counter, staleness or statistics, no count of
    what is in flight, no outputs for Keras (the step returns a constant),
    no first step, no failure handling, no loss metric.

    With `keras_step`, each shard is applied by Keras' own train step
    instead: a compiled `Dense(1)` (MSE, SGD, its loss metric), whose
    `train_step` runs in the loop's body under the loop's device, as a
    tf_diffmap replica step does, its variables on the first device. That
    is an asynchronous loop around Keras' step with none of tf_diffmap's
    bookkeeping: what the step itself costs in an update. Its STOP shard of
    zeros is applied like any other (the loop has no conditional); it is
    not counted. The loops share Keras' step counter without a lock, so
    `iterations` may count fewer steps than were applied.

    Args:
        keras: Keras 3.
        devices: one device per replica loop; the parameters go on the first.
        batch_size: the global batch, which the devices must share evenly
            (every batch of the control workload is whole).
        learning_rate: SGD's learning rate.
        features: the inputs of the `Dense(1)`.
        steps_per_loop: the most shards one loop call takes (tf_diffmap's K).
        seed: seeds the initial kernel.
        keras_step: apply each shard with Keras' train step rather than a
            hand-written SGD update.
        compute_devices: per loop, where it computes its gradient (by
            default its device).

    Raises:
        ValueError: no device, or a batch the devices cannot share evenly.
    """

    def __init__(
        self,
        keras,
        devices: list[str],
        batch_size: int,
        learning_rate: float,
        features: int,
        steps_per_loop: int = 32,
        seed: int = 0,
        keras_step: bool = False,
        compute_devices: list[str] | None = None,
    ) -> None:
        replicas = len(devices)
        if not replicas or batch_size % replicas:
            raise ValueError(
                f"The control floor cuts a batch of {batch_size} into one shard per device "
                f"({replicas} devices); give a batch size that is a multiple of the devices."
            )
        self.devices = list(devices)
        self.steps_per_loop = steps_per_loop
        shard = batch_size // replicas
        limit = math.sqrt(6.0 / (features + 1))  # Glorot uniform, as Dense
        kernel = np.random.default_rng(seed).uniform(-limit, limit, (features, 1))
        with tf.device(self.devices[0]):
            self.kernel = tf.Variable(kernel.astype("float32"))
            self.bias = tf.Variable(np.zeros(1, "float32"))
            self.queue = tf.queue.FIFOQueue(
                2 * replicas,
                [tf.bool, tf.float32, tf.float32],
                shapes=[[], [shard, features], [shard, 1]],
            )
        self._stop_item = [tf.constant(True), tf.zeros([shard, features]), tf.zeros([shard, 1])]
        self.model = _queuing_model(keras, self.queue, replicas, shard, features)
        self._lr = float(learning_rate)
        self.stepping_model = (
            _stepping_model(keras, self.devices[0], shard, features, learning_rate, seed)
            if keras_step
            else None
        )
        # Per loop device, the devices its forward and backward ops name.
        self.gradient_devices: dict[str, set[str]] = {}
        self.compute_devices = list(compute_devices or self.devices)
        self._loops = [
            self._make_loop(device, compute)
            for device, compute in zip(self.devices, self.compute_devices)
        ]
        self._applied = [0] * replicas
        self._errors: list[BaseException] = []
        self._threads = [
            threading.Thread(target=self._run, args=(r,), name=f"floor-loop-{r}", daemon=True)
            for r in range(replicas)
        ]
        for thread in self._threads:
            thread.start()

    def _make_loop(self, device: str, compute: str):
        host = self.devices[0]

        def loop(max_steps):
            def cond(taken, stopped):
                return tf.logical_and(taken < max_steps, tf.logical_not(stopped))

            def body(taken, stopped):
                stop, x, y = self.queue.dequeue()
                # The gradient is computed where the loop's replica computes,
                # as a replica step is: named here, since the ops of a loop's
                # body do not take the device that the function is traced
                # under.
                graph = tf.compat.v1.get_default_graph()
                first = len(graph.get_operations())
                if self.stepping_model is not None:
                    with tf.device(compute):
                        logs = self.stepping_model.train_step((x, y))
                    self._record_placement(device, graph, first)
                    with tf.control_dependencies(tf.nest.flatten(logs)):
                        return taken + 1, tf.identity(stop)
                with tf.device(compute):
                    with tf.GradientTape() as tape:
                        error = tf.matmul(x, self.kernel) + self.bias - y
                        loss = tf.reduce_mean(tf.square(error))
                    kernel_gradient, bias_gradient = tape.gradient(loss, [self.kernel, self.bias])
                self._record_placement(device, graph, first)
                with tf.device(host):
                    lr = self._lr * (1.0 - tf.cast(stop, tf.float32))
                    applied = [
                        self.kernel.assign_sub(lr * kernel_gradient, read_value=False),
                        self.bias.assign_sub(lr * bias_gradient, read_value=False),
                    ]
                with tf.control_dependencies(applied):
                    return taken + 1, tf.identity(stop)

            return tf.while_loop(
                cond, body, [tf.constant(0), tf.constant(False)], parallel_iterations=1
            )

        with tf.device(device):
            return tf.function(loop, autograph=False).get_concrete_function(
                tf.TensorSpec([], tf.int32)
            )

    def _record_placement(self, device: str, graph, first: int) -> None:
        self.gradient_devices[device] = {
            op.device
            for op in graph.get_operations()[first:]
            # Not the captured variables and their reads: those run beside them.
            if op.type != "Placeholder" and not any(t.dtype == tf.resource for t in op.inputs)
        }

    def _run(self, replica: int) -> None:
        steps = tf.constant(self.steps_per_loop)
        try:
            while True:
                taken, stopped = self._loops[replica](steps)
                stopped = bool(stopped)
                self._applied[replica] += int(taken) - int(stopped)
                if stopped:
                    return
        except BaseException as error:  # noqa: BLE001 - raised by `stop`
            self._errors.append(error)

    def stop(self, timeout: float = 60.0) -> int:
        """Ends every loop once the shards queued before are applied.

        Returns:
            The shards applied, by all loops (STOP items not counted).

        Raises:
            RuntimeError: a loop failed (its error chained) or did not end.
        """
        for _ in self._threads:
            self.queue.enqueue(self._stop_item)
        for thread in self._threads:
            thread.join(timeout)
        if self._errors:
            raise RuntimeError("A loop of the control floor failed.") from self._errors[0]
        if any(thread.is_alive() for thread in self._threads):
            raise RuntimeError(f"A loop of the control floor did not end within {timeout} s.")
        return sum(self._applied)


def _stepping_model(keras, device: str, shard: int, features: int, learning_rate: float, seed):
    """The compiled `Dense(1)` whose train step the Keras-step floor runs.

    One eager train step on a shard of zeros makes its variables (the loss
    metric's among them) on `device`, before any loop is traced.
    """
    with tf.device(device):
        model = keras.Sequential(
            [
                keras.Input((features,)),
                keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(seed)),
            ]
        )
        model.compile(optimizer=keras.optimizers.SGD(learning_rate), loss="mse")
        model.train_step((tf.zeros([shard, features]), tf.zeros([shard, 1])))
    return model


def _queuing_model(keras, queue, replicas: int, shard: int, features: int):
    """A Keras model whose train step only queues its batch as shards."""

    class QueuingModel(keras.Model):
        def __init__(self):
            super().__init__()
            # Keras builds and calls a model before training it; this layer's
            # weights are never trained (the loops train their own).
            self.dense = keras.layers.Dense(1)

        def call(self, x):
            return self.dense(x)

        def train_step(self, data):
            x, y = data
            queued = queue.enqueue_many(
                [
                    tf.zeros([replicas], tf.bool),
                    tf.reshape(x, [replicas, shard, features]),
                    tf.reshape(tf.cast(y, tf.float32), [replicas, shard, 1]),
                ]
            )
            with tf.control_dependencies([queued]):
                return {"shards": tf.constant(replicas)}

    model = QueuingModel()
    model.build((None, features))
    return model
