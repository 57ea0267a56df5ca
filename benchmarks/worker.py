"""One benchmark session: one contender on one number of devices, in its own process.

Logical devices must be made before TensorFlow initializes, so the suite
runs each session as a subprocess:

    python -m benchmarks.worker --json-config '{"contender": "mirrored", "replicas": 4,
        "tasks": [{"kind": "throughput", "model": "mlp", ...}]}'

It runs the session's tasks in order (`TASKS`: one function per kind, whose
docstring says what it measures; `docs/benchmarks.md` says how the tables
read) and prints one line, `RESULT_PREFIX` and the results as JSON. A task
that fails is reported with its error and the session goes on. Every `fit`
reads a repeated `tf.data.Dataset` with `steps_per_epoch`
(`workloads.dataset`), so no contender rebuilds its input iterator per
epoch, but a throughput task with `"input": "numpy"`, which passes NumPy
arrays to `fit` as most Keras code does.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import statistics
import sys
import time
import traceback
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from benchmarks import timeline, workloads  # noqa: E402  (import no TensorFlow)

__all__ = ["RESULT_PREFIX", "run_session", "main"]

RESULT_PREFIX = "@@benchmark-result@@ "


def peak_rss_mb() -> float:
    """This process' peak resident set size so far, in MiB (Linux: KiB units)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 1024.0 if sys.platform != "darwin" else peak / 2**20


def _callbacks(keras):
    """The timing callbacks, subclassing the given Keras module's `Callback`."""

    class EpochTimer(keras.callbacks.Callback):
        """Times each epoch; stops once `min_epochs` and `min_seconds` are both reached.

        The first epoch is timed but not counted: it also pays for `fit`
        making its iterator (under MirroredStrategy, a distributed one, which
        takes a large fraction of a second here) and for starting threads.
        """

        def __init__(self, min_epochs: int, min_seconds: float):
            super().__init__()
            self.min_epochs = min_epochs
            self.min_seconds = min_seconds
            self.seconds: list[float] = []
            self.losses: list[float] = []

        def on_epoch_begin(self, epoch, logs=None):
            self._start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            # Keras reads the epoch's metrics before this hook; under tf_diffmap
            # that read drains the workers, so the epoch's updates are all in.
            self.seconds.append(time.perf_counter() - self._start)
            self.losses.append(float((logs or {}).get("loss", float("nan"))))
            counted = self.seconds[1:]
            if len(counted) >= self.min_epochs and sum(counted) >= self.min_seconds:
                self.model.stop_training = True

    class AccuracyClock(keras.callbacks.Callback):
        """Training time until the validation accuracy reaches each target."""

        def __init__(self, x_val, y_val, targets):
            super().__init__()
            self.x_val, self.y_val = x_val, y_val
            self.targets = list(targets)
            self.train_seconds = 0.0
            self.eval_seconds = 0.0
            self.history: list[dict[str, float]] = []
            self.seconds_to: dict[str, float | None] = {str(t): None for t in self.targets}
            self.epochs_to: dict[str, int | None] = {str(t): None for t in self.targets}

        def on_epoch_begin(self, epoch, logs=None):
            self._start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.train_seconds += time.perf_counter() - self._start
            start = time.perf_counter()
            accuracy = workloads.mlp_accuracy(self.model.get_weights(), self.x_val, self.y_val)
            self.eval_seconds += time.perf_counter() - start
            self.history.append(
                {
                    "epoch": epoch + 1,
                    "train_seconds": self.train_seconds,
                    "val_accuracy": accuracy,
                    "loss": float((logs or {}).get("loss", float("nan"))),
                }
            )
            for target in self.targets:
                key = str(target)
                if self.seconds_to[key] is None and accuracy >= target:
                    self.seconds_to[key] = self.train_seconds
                    self.epochs_to[key] = epoch + 1

    return EpochTimer, AccuracyClock


def _compile(rt, model, optimizer) -> None:
    model.compile(
        optimizer=optimizer,
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )


def _steps(x, batch_size: int) -> int:
    return -(-len(x) // batch_size)


def _timed_fit(rt, model, x, y, task) -> dict[str, Any]:
    """One timed window of `fit`; throughput from the epochs' wall times."""
    EpochTimer, _ = _callbacks(rt.keras)
    timer = EpochTimer(task["min_epochs"], task["min_seconds"])
    rt.reset_statistics()
    steps_before = rt.replica_steps()
    if task.get("input", "dataset") == "numpy":
        model.fit(
            x,
            y,
            batch_size=task["batch_size"],
            epochs=task.get("max_epochs", 1000),
            callbacks=[timer],
            shuffle=False,
            verbose=0,
        )
    else:
        model.fit(
            workloads.dataset(x, y, task["batch_size"]),
            steps_per_epoch=_steps(x, task["batch_size"]),
            epochs=task.get("max_epochs", 1000),
            callbacks=[timer],
            verbose=0,
        )
    seconds = timer.seconds[1:]
    median = statistics.median(seconds)
    out: dict[str, Any] = {
        "epochs": len(seconds),
        "examples_per_epoch": len(x),
        "first_epoch_seconds": timer.seconds[0],
        "epoch_seconds": seconds,
        "median_epoch_seconds": median,
        "examples_per_second": len(x) / median,
        "mean_examples_per_second": len(x) * len(seconds) / sum(seconds),
        "final_loss": timer.losses[-1] if timer.losses else None,
    }
    steps_after = rt.replica_steps()
    if steps_after is not None:
        out["replica_steps"] = [a - b for a, b in zip(steps_after, steps_before)]
        out["staleness"] = rt.statistics()
    return out


def _warm_up(rt, model, x, y, batch_size: int, steps: int = 3) -> float:
    """Traces the train step on a few batches; returns the seconds it took."""
    start = time.perf_counter()
    model.fit(workloads.dataset(x, y, batch_size), steps_per_epoch=steps, epochs=1, verbose=0)
    return time.perf_counter() - start


def _warmed_up_model(rt, task: dict, seed: int):
    """The task's model built and compiled under the contender, its synthetic
    data, and the seconds of a warm-up fit (the step traced)."""
    x, y = workloads.synthetic_data(task["model"], task["examples_per_epoch"], seed)
    rt.keras.utils.set_random_seed(seed)
    with rt.scope():
        model = workloads.build_model(rt.keras, task["model"])
        _compile(rt, model, rt.optimizer(task["learning_rate"]))
    return model, x, y, _warm_up(rt, model, x, y, task["batch_size"])


def run_throughput(rt, task: dict, seed: int) -> dict[str, Any]:
    """Examples/s of `fit` on synthetic data, after a warm-up `fit` that
    traces the step, epoch by epoch until `min_epochs` and `min_seconds`."""
    model, x, y, warmup = _warmed_up_model(rt, task, seed)
    out = _timed_fit(rt, model, x, y, task)
    out["warmup_seconds"] = warmup
    return out


def run_embeddings(rt, task: dict, seed: int) -> dict[str, Any]:
    """The bag of ids with one table size and optimizer: examples/s of the
    epochs after the first, CPU seconds per 1,000 examples of every process
    it trains in, and the validation accuracy after each epoch (on one
    host); on a cluster, the bytes its processes sent per update and where
    the table's shards live."""
    rows, batch = task["rows"], task["batch_size"]
    x, y, x_val, y_val = workloads.embedding_data(rows, task["examples_per_epoch"], seed)
    rt.keras.utils.set_random_seed(seed)
    with rt.scope():
        model = workloads.build_embedding_model(rt.keras, rows)
        model.compile(
            optimizer=workloads.embedding_optimizer(rt.keras, task["optimizer"], rt.legacy),
            loss="binary_crossentropy",
            metrics=["accuracy"],
        )
    EpochTimer, _ = _callbacks(rt.keras)
    timer = EpochTimer(task["epochs"] - 1, 0.0)
    on_cluster = rt.cluster is not None
    pids = rt.process_ids()
    marks: dict[str, Any] = {}
    accuracies: list[float] = []

    class Clocks(rt.keras.callbacks.Callback):
        """CPU time and bytes over the timed epochs; on one host, validation
        accuracy after each epoch, outside the epoch's timing (this runs
        after `timer`)."""

        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:
                marks["cpu"] = timeline.processes_cpu_seconds(pids)
                marks["bytes"] = timeline.tcp_bytes(pids)
                marks["steps"] = rt.replica_steps()

        def on_epoch_end(self, epoch, logs=None):
            if epoch == task["epochs"] - 1:
                marks["cpu_end"] = timeline.processes_cpu_seconds(pids)
                marks["bytes_end"] = timeline.tcp_bytes(pids)
                marks["steps_end"] = rt.replica_steps()
            if not on_cluster:
                _, accuracy = self.model.evaluate(x_val, y_val, batch_size=1024, verbose=0)
                accuracies.append(float(accuracy))

    rt.reset_statistics()
    steps_per_epoch = _steps(x, batch)
    model.fit(
        workloads.dataset(x, y, batch, shuffle_seed=seed),
        steps_per_epoch=steps_per_epoch,
        epochs=task["epochs"],
        callbacks=[timer, Clocks()],
        verbose=0,
    )
    seconds = timer.seconds[1:]
    timed_examples = steps_per_epoch * batch * len(seconds)
    out: dict[str, Any] = {
        "epochs": len(timer.seconds),
        "epoch_seconds": seconds,
        "examples_per_second": steps_per_epoch * batch / statistics.median(seconds),
        "table_mb": rows * workloads.EMBEDDING_MODEL["width"] * 4 / 2**20,
        "examples_per_update": task.get("examples_per_update", batch),
    }
    if None not in (marks.get("cpu"), marks.get("cpu_end")):
        # On one host this is the process's own CPU, evaluations after the
        # timed epochs but the last included (a quarter of the examples,
        # forward only, the same for every contender).
        out["cpu_seconds_per_1000_examples"] = (
            1000 * (marks["cpu_end"] - marks["cpu"]) / timed_examples
        )
    if accuracies:
        out.update(
            val_accuracies=accuracies,
            val_accuracy=accuracies[-1],
            best_val_accuracy=max(accuracies),
        )
    if on_cluster:
        if marks.get("steps") is not None:
            updates = sum(marks["steps_end"]) - sum(marks["steps"])
        else:
            updates = steps_per_epoch * len(seconds)
        out["updates"] = updates
        if marks.get("bytes") and marks.get("bytes_end"):
            sent = {
                str(pid): marks["bytes_end"][pid]["sent"] - marks["bytes"][pid]["sent"]
                for pid in pids
            }
            out["bytes_sent_per_process"] = sent
            out["bytes_sent_per_update"] = sum(sent.values()) / max(updates, 1)
        table = model.layers[0].embeddings
        table = getattr(table, "value", table)
        shards = getattr(table, "shards", None) or getattr(table, "variables", None) or [table]
        out["table_shards"] = [[s.device, list(s.shape)] for s in shards]
    if rt.replica_steps() is not None:
        out["staleness"] = rt.statistics()
    return out


def run_straggler(rt, task: dict, seed: int) -> dict[str, Any]:
    """The same, with a `ReplicaDelay` layer making replica 0 sleep: a timed
    window per sleep in `delays` (the layer is traced once, only its
    `seconds` changes)."""
    x, y = workloads.synthetic_data(task["model"], task["examples_per_epoch"], seed)
    rt.keras.utils.set_random_seed(seed)
    with rt.scope():
        # Non-zero while the step is traced, so the sleep is traced in; each
        # window then sets its own delay (0 for the no-straggler window).
        delay = workloads.replica_delay(rt.keras, 1e-6, legacy=rt.legacy)
        model = workloads.build_model(rt.keras, task["model"], delay_layer=delay)
        _compile(rt, model, rt.optimizer(task["learning_rate"]))
    warmup = _warm_up(rt, model, x, y, task["batch_size"])
    windows = {}
    for slowdown, seconds in task["delays"].items():
        delay.seconds = float(seconds)
        window = _timed_fit(rt, model, x, y, task)
        window["delay_seconds"] = float(seconds)
        windows[slowdown] = window
    return {"warmup_seconds": warmup, "windows": windows}


def _optimizer_variables(optimizer) -> list:
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


def run_accuracy(rt, task: dict, seed: int) -> dict[str, Any]:
    """Training seconds on digits until the validation accuracy at an epoch's
    end first reaches each target, within a budget of epochs (the clock
    stops while the accuracy is computed, in NumPy, alike for everyone)."""
    x_train, x_val, y_train, y_val = workloads.digits_data(seed)
    batch_size = task["batch_size"]
    rt.keras.utils.set_random_seed(seed)
    with rt.scope():
        delay = (
            workloads.replica_delay(rt.keras, task["delay"], legacy=rt.legacy)
            if task.get("delay")
            else None
        )
        model = workloads.build_model(rt.keras, "mlp", delay_layer=delay)
        optimizer = rt.optimizer(task["learning_rate"], task.get("rule"), task.get("drop_above"))
        _compile(rt, model, optimizer)
        optimizer.build(model.trainable_variables)
    # Trace the step first, then start again from the same weights and
    # optimizer state, so that the clock measures training only.
    initial_weights = model.get_weights()
    initial_state = [v.numpy() for v in _optimizer_variables(optimizer)]
    warmup = _warm_up(rt, model, x_train, y_train, batch_size, steps=2)
    model.set_weights(initial_weights)
    for variable, value in zip(_optimizer_variables(optimizer), initial_state):
        variable.assign(value)
    rt.reset_statistics()
    steps_before = rt.replica_steps()
    _, AccuracyClock = _callbacks(rt.keras)
    clock = AccuracyClock(x_val, y_val, task["targets"])
    start = time.perf_counter()
    model.fit(
        workloads.dataset(x_train, y_train, batch_size, shuffle_seed=seed),
        steps_per_epoch=_steps(x_train, batch_size),
        epochs=task["epochs"],
        callbacks=[clock],
        verbose=0,
    )
    out: dict[str, Any] = {
        "warmup_seconds": warmup,
        "wall_seconds": time.perf_counter() - start,
        "train_seconds": clock.train_seconds,
        "eval_seconds": clock.eval_seconds,
        "seconds_to": clock.seconds_to,
        "epochs_to": clock.epochs_to,
        "final_accuracy": clock.history[-1]["val_accuracy"] if clock.history else None,
        "best_accuracy": max((h["val_accuracy"] for h in clock.history), default=None),
        "history": clock.history,
    }
    steps_after = rt.replica_steps()
    if steps_after is not None:
        out["replica_steps"] = [a - b for a, b in zip(steps_after, steps_before)]
        out["staleness"] = rt.statistics()
    return out


def run_points(rt, task: dict, seed: int) -> dict[str, Any]:
    """The cost of `StalenessTensorBoard(update_freq="batch")` on digits.

    Rounds of four `fit`s of `epochs` epochs, in turn: without the callback,
    with the graph's counter snapshots switched on but no callback reading
    them (what each step pays for them), with a point at every batch whatever
    it costs (`max_overhead=None`), and with the default overhead budget. The
    per-point figure is the callback's own measure (`point_cpu_seconds`: CPU
    time from reading the snapshots to writing the events), which the budget
    counts.
    """
    if not rt.asynchronous:
        raise ValueError("The points task measures StalenessTensorBoard: run it under tf_diffmap.")
    import tempfile

    import tf_diffmap

    x_train, _, y_train, _ = workloads.digits_data(seed)
    batch_size, epochs = task["batch_size"], task["epochs"]
    rt.keras.utils.set_random_seed(seed)
    with rt.scope():
        model = workloads.build_model(rt.keras, "mlp")
        _compile(rt, model, rt.optimizer(task["learning_rate"]))
    fit_kwargs = {"batch_size": batch_size, "shuffle": False, "verbose": 0}
    model.fit(x_train, y_train, epochs=1, **fit_kwargs)  # traces the step
    batches = epochs * _steps(x_train, batch_size)
    seconds: dict[str, list[float]] = {"none": [], "snapshots": [], "every": [], "budget": []}
    snapshots = rt.strategy.extended.runtime.snapshots
    point_ms: list[float] = []
    budget_points: list[int] = []
    with tempfile.TemporaryDirectory() as logdir:
        for _ in range(task["rounds"]):
            for kind in seconds:
                callbacks = []
                if kind == "snapshots":
                    snapshots.start(run_points)
                elif kind != "none":
                    overhead = None if kind == "every" else 0.02
                    callbacks = [
                        tf_diffmap.StalenessTensorBoard(
                            logdir, update_freq="batch", max_overhead=overhead
                        )
                    ]
                start = time.perf_counter()
                model.fit(x_train, y_train, epochs=epochs, callbacks=callbacks, **fit_kwargs)
                seconds[kind].append(time.perf_counter() - start)
                snapshots.stop(run_points)
                if kind == "every":
                    point_ms += [1000 * c for c in callbacks[0].point_cpu_seconds]
                elif kind == "budget":
                    # The thread's points, and each epoch's last batch's, written at its end.
                    budget_points.append(len(callbacks[0].point_cpu_seconds) + epochs)
    fit = {kind: statistics.median(values) for kind, values in seconds.items()}
    return {
        "replicas": rt.replicas,
        "batches_per_fit": batches,
        "ms_per_batch": 1000 * fit["none"] / batches,
        "points": len(point_ms),
        "point_cpu_ms_median": statistics.median(point_ms),
        "point_cpu_ms_p90": statistics.quantiles(point_ms, n=10)[-1],
        "fit_seconds": fit,
        "fit_seconds_all": seconds,
        "snapshots_overhead": fit["snapshots"] / fit["none"] - 1,
        "every_point_overhead": fit["every"] / fit["none"] - 1,
        "budget_overhead": fit["budget"] / fit["none"] - 1,
        "budget_points": budget_points,
    }


def run_control(rt, task: dict, seed: int) -> dict[str, Any]:
    """Steps (and updates) per second of a model too small to cost anything.

    What is left is the control path: Keras' loop, the strategy's dispatch and
    the replicas' loops. Plain Keras applies one update per step; tf_diffmap
    one per replica per step (a shard of `batch_size / replicas` examples).
    """
    spe, batch_size = task["steps_per_execution"], task["batch_size"]
    examples = task["steps_per_epoch"] * batch_size
    x, y = workloads.control_data(examples, seed)
    rt.keras.utils.set_random_seed(seed)
    with rt.scope():
        model = workloads.build_control_model(rt.keras)
        model.compile(
            optimizer=rt.keras.optimizers.SGD(task["learning_rate"]),
            loss="mse",
            steps_per_execution=spe,
        )
    warmup = _warm_up(rt, model, x, y, batch_size, steps=2 * spe)
    cpu = time.process_time()
    out = _timed_fit(rt, model, x, y, {**task, "examples_per_epoch": examples})
    cpu = time.process_time() - cpu
    steps_per_second = task["steps_per_epoch"] / out["median_epoch_seconds"]
    updates_per_step = len(rt.devices) if rt.asynchronous else 1
    # The process's CPU over the window (its first epoch included) per update:
    # what an update costs the host, whatever the cores do meanwhile.
    window_steps = (out["epochs"] + 1) * task["steps_per_epoch"]
    out.update(
        cpu_us_per_update=1e6 * cpu / (window_steps * updates_per_step),
        warmup_seconds=warmup,
        steps_per_second=steps_per_second,
        updates_per_step=updates_per_step,
        updates_per_second=steps_per_second * updates_per_step,
        steps_per_loop=getattr(rt.strategy, "steps_per_loop", None),
    )
    if out.get("replica_steps") is not None:
        # Every epoch of the window and the first one: what the replicas applied.
        out["updates_counted"] = sum(out["replica_steps"])
        out["updates_expected"] = window_steps * updates_per_step
    return out


def run_cluster(rt, task: dict, seed: int) -> dict[str, Any]:
    """Examples per second of the wide MLP, and each replica's time per update.

    The time per update of a replica is the wall time of the timed `fit` (all
    its epochs) over the updates that replica applied in it: its whole cycle,
    waits included (for a shard, for the store, for gRPC round trips). Under
    ParameterServerStrategy, which reports no per-worker count, it is the
    `fit` time over the steps, times the workers (an even spread assumed).
    """
    model, x, y, warmup = _warmed_up_model(rt, task, seed)
    pids = rt.process_ids()
    cpu_start = timeline.processes_cpu_seconds(pids)
    out = _timed_fit(rt, model, x, y, task)
    cpu_end = timeline.processes_cpu_seconds(pids)
    fit_seconds = out["first_epoch_seconds"] + sum(out["epoch_seconds"])
    steps = (out["epochs"] + 1) * _steps(x, task["batch_size"])
    updates = sum(out["replica_steps"]) if out.get("replica_steps") else steps
    out.update(
        timeline.cpu_per_work(cpu_start, cpu_end, len(pids), updates, steps * task["batch_size"])
    )
    if out.get("replica_steps"):
        per_replica = [fit_seconds / n for n in out["replica_steps"] if n]
        out["replica_ms_per_update"] = [1000 * s for s in per_replica]
        out["median_replica_ms_per_update"] = 1000 * statistics.median(per_replica)
        out["replica_time_source"] = "fit seconds / the replica's updates"
    else:
        workers = len(rt.devices)
        out["median_replica_ms_per_update"] = 1000 * fit_seconds * workers / steps
        out["replica_time_source"] = f"fit seconds x {workers} workers / steps (even spread)"
    out.update(warmup_seconds=warmup, devices=list(rt.devices), fit_seconds=fit_seconds)
    return out


def run_fault_timeline(rt, task: dict, seed: int) -> dict[str, Any]:
    """Examples/s per second of wall time while a worker is killed and restarted.

    One `fit` of the cluster workload's model runs for `seconds` of wall
    time (its epoch is longer than that; the script ends it), while
    `timeline.FaultScript` kills worker `worker` at `kill_at` and restarts it
    at `restart_at`, and `timeline.Sampler` reads the strategy's counters
    every `sample_seconds`.
    """
    local = rt.local_cluster
    if local is None:
        raise ValueError(
            "The fault_timeline task kills and restarts a worker of a localhost cluster: "
            f"run it under the tf_diffmap_cluster contender, not {rt.name!r}."
        )
    index = task["worker"]
    task_name = f"/job:worker/replica:0/task:{index}/"
    lost_replicas = [r for r, d in enumerate(rt.devices) if d.startswith(task_name)]
    if not lost_replicas:
        raise ValueError(f"No replica on worker {index}; the replicas are on {rt.devices}.")
    model, x, y, warmup = _warmed_up_model(rt, task, seed)

    def processes() -> dict[str, int]:
        return {"chief": os.getpid(), **{f"{j} {i}": pid for (j, i), pid in local.pids.items()}}

    def kill() -> int:
        pid = local.pids[("worker", index)]
        local.kill("worker", index)  # SIGKILL to that pid, through its process handle
        return pid

    restarted: dict[str, Any] = {}

    def restart() -> int:
        pid = local.restart("worker", index)  # returns once the new server serves
        restarted["restart_cpu_seconds"] = timeline.cpu_seconds(pid)
        return pid

    def finish() -> None:
        model.stop_training = True  # Keras checks it after every step

    sampler = timeline.Sampler(rt.strategy, processes, task["sample_seconds"])
    script = timeline.FaultScript(
        kill,
        restart,
        finish,
        task["kill_at"],
        task["restart_at"],
        task["seconds"],
    )
    start = time.monotonic()
    sampler.start(start)
    script.start(start)
    if task.get("input", "dataset") == "numpy":
        inputs = {"x": x, "y": y, "batch_size": task["batch_size"], "shuffle": False}
    else:
        inputs = {
            "x": workloads.dataset(x, y, task["batch_size"]),
            # By default one epoch longer than the run: no drain at epoch ends.
            "steps_per_epoch": task.get("steps_per_epoch") or 10**7,
        }
    try:
        model.fit(**inputs, epochs=10**6, verbose=0)
    finally:
        fit_seconds = time.monotonic() - start
        script.cancel()
        script.join()
        samples = sampler.stop()
    events = {**script.events, **restarted, "fit_end": fit_seconds}
    events.update(timeline.state_changes(samples, lost_replicas))
    rows = timeline.bins(samples, task["bin_seconds"])
    summary = timeline.summarize(
        rows,
        events,
        lost_replicas,
        samples,
        warmup=task["warmup_seconds"],
        settle=task["settle_seconds"],
        full_rate=task["full_rate"],
    )
    stats = rt.strategy.statistics()
    reports = rt.strategy.replica_states()
    return {
        "devices": list(rt.devices),
        "killed_worker": index,
        "lost_replicas": lost_replicas,
        "warmup_fit_seconds": warmup,
        "events": events,
        "script_error": script.error,
        "sampler_errors": sampler.errors,
        "samples": len(samples),
        "bins": rows,
        "summary": summary,
        "replica_lost_counts": [r.lost for r in reports],
        # The runtime's error that last made each replica lost (None: never lost).
        "replica_errors": [
            None if r.error is None else f"{type(r.error).__name__}: {r.error}"[:1500]
            for r in reports
        ],
        "abandoned": stats.abandoned,
        "version": rt.strategy.version,
        "updates": int(stats.updates.sum()),
    }


TASKS = {
    "throughput": run_throughput,
    "straggler": run_straggler,
    "accuracy": run_accuracy,
    "points": run_points,
    "control": run_control,
    "cluster": run_cluster,
    "fault_timeline": run_fault_timeline,
    "embeddings": run_embeddings,
}


def run_session(config: dict) -> dict[str, Any]:
    """Runs a session's tasks; every task's result or error is in the output."""
    start = time.perf_counter()
    session: dict[str, Any] = {
        "contender": config["contender"],
        "replicas": config["replicas"],
        "python": sys.executable,
        "python_version": platform.python_version(),
    }
    try:
        from benchmarks.contenders import Runtime

        rt = Runtime(
            config["contender"],
            config["replicas"],
            max_staleness=config.get("max_staleness"),
            mirrored_reduce=config.get("mirrored_reduce", "one_device"),
            replicas_per_device=config.get("replicas_per_device", 1),
            steps_per_loop=config.get("steps_per_loop"),
            device=config.get("device", "cpu"),
            gpu_memory_mb=config.get("gpu_memory_mb"),
            cluster=config.get("cluster"),
            inter_op_threads=config.get("inter_op_threads"),
        )
    except Exception as error:  # noqa: BLE001 - reported to the parent
        session.update(
            status="error",
            error=f"{type(error).__name__}: {error}",
            traceback=traceback.format_exc(limit=8),
        )
        return session
    session.update(
        tensorflow_version=rt.tf.__version__,
        keras_version=rt.keras_version,
        devices=rt.devices,
        startup_seconds=time.perf_counter() - start,
    )
    tasks = []
    try:
        for task in config.get("tasks", []):
            task_start = time.perf_counter()
            try:
                result = TASKS[task["kind"]](rt, task, config.get("seed", 0))
                result["status"] = "ok"
            except Exception as error:  # noqa: BLE001 - reported, the session goes on
                result = {
                    "status": "error",
                    "error": f"{type(error).__name__}: {error}"[:2000],
                    "traceback": traceback.format_exc(limit=12)[-4000:],
                }
            result["seconds"] = time.perf_counter() - task_start
            result["peak_rss_mb"] = peak_rss_mb()
            tasks.append({"task": task, "result": result})
            gc.collect()
    finally:
        rt.close()
    session.update(
        status="ok", tasks=tasks, peak_rss_mb=peak_rss_mb(), seconds=time.perf_counter() - start
    )
    return session


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run one benchmark session; print JSON.")
    parser.add_argument(
        "--json-config", required=True, help="the session as JSON, or @FILE to read it from a file"
    )
    args = parser.parse_args(argv)
    text = args.json_config
    if text.startswith("@"):
        with open(text[1:]) as f:
            text = f.read()
    result = run_session(json.loads(text))
    sys.stdout.write("\n" + RESULT_PREFIX + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
