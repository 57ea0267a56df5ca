"""`tf_diffmap.Strategy`: asynchronous data parallelism for Keras 3.

How a training step flows:

1. Keras traces its train function and calls `strategy.run(train_step, ...)`.
2. The strategy traces `train_step` once more per replica device, in a helper
   thread (a clean context: Keras' trace has lifted scopes that would stop the
   gradient tape), as a concrete *replica step* placed on that device, taking a
   replica id and one shard. Replicas on one device share it; concurrent calls
   are separate executions, so nothing serializes the replicas. Around it, a
   *replica loop* per device (`tf_diffmap.engine.loops`) takes shards from a
   TensorFlow queue and applies them, up to K per call.
3. In Keras' graph the strategy splits the host batch into one shard per
   replica and queues the shards with native ops, returning the outputs
   (metrics) of the most recently completed replica step. The first step
   after a drain has none yet: it applies its first shard right there in
   Keras' graph, starts the replicas' threads, and queues the others. No op
   of Keras' graph ever waits for a replica.
4. A replica step reads the store version, runs forward and backward, claims
   a new version (its staleness is the difference), and pushes its
   gradient to the store (`tf_diffmap.updates.aggregation`): by default a
   window of fresh gradients (read at the current step), one per replica,
   is one step of the optimizer, and the replica waits for its window to
   close before it takes its next shard. With `gradients_per_step=1` it applies its own
   gradient with update ops on the store's devices.
5. Before anything reads the model as a whole, the loops are drained.

A step that applies no update (evaluate, predict) runs synchronously, in
Keras' graph, on the first replica device.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tf_diffmap import _tf_internal, scope_watch
from tf_diffmap.devices import (
    canonical_device,
    default_replica_devices,
    resolve_devices,
    warn_if_one_replica,
)
from tf_diffmap.engine import outputs
from tf_diffmap.engine.replicas import PS_TIMEOUT, WORKER_TIMEOUT, ReplicaReport
from tf_diffmap.engine.runtime import Runtime
from tf_diffmap.engine.windows import (
    LATE_SHARD_POLICIES,
    LATE_SHARDS,
    LATE_WINDOW,
    LATE_WINDOW_POLICIES,
    PATIENCE_MARGIN,
)
from tf_diffmap.extended import AsyncExtended
from tf_diffmap.store.gate import WindowStats
from tf_diffmap.store.parameter_store import optimizer_outside_scope_message
from tf_diffmap.store.partitioned import resolve_partitioner
from tf_diffmap.store.staleness import StalenessStats
from tf_diffmap.updates.step import current_step

__all__ = ["MAX_STEP_STALENESS", "Strategy", "current_step"]

MAX_STEP_STALENESS: int | None = 0
"""The default of `Strategy(max_step_staleness=...)`: fresh windows. Every
optimizer step is taken on gradients of the current parameters (a gradient
read before the latest step is dropped, its examples counted as skipped),
and a window that waits past its patience on a slow replica is filled by
the others (`tf_diffmap.engine.windows.LATE_WINDOW`).

Chosen on the tuning half of the held-out grid (`benchmarks.grid`, 32
conditions, seed 0, 2026-12-06) over asynchronous windows with a bound of 1
(the previous default) and fresh windows closed short: median accuracy gap
to synchronous training +0.0 points against -3.3 and -0.3, worst gap where
synchronous training reaches 0.8 -10.0 points against -74.7 and -64.7, and
no run below 0.5 there (against 4 and 1). A second held-out set, drawn
before any run and run untouched with two seeds, reports it: +0.1 median,
-35.6 worst, 1 run below 0.5, against -1.2, -78.2 and 9 for the bound of 1
(`python -m benchmarks.grid --report-only --part new_held_out --seeds 0 1
--variants agg_bound_1 fresh_fill`; see the Staleness-aware updates page)."""


def _check_int(name: str, value, minimum: int, none: str = "", note: str = "") -> None:
    """Raises unless `value` is an int (not a bool) >= `minimum`, or None
    where `none` says what None means."""
    if value is None and none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be {none}an int >= {minimum}{note}, received {value!r}.")


class Strategy(_tf_internal.StrategyBase):
    """Asynchronous data-parallel training for Keras 3 and `tf.distribute`.

    Each replica computes the gradient of its own shard of every batch and
    pushes it to the parameter store, with no all-reduce. By default
    (`gradients_per_step="auto"`) the store aggregates one shard gradient
    per replica into one step of the optimizer, with the hyperparameters it
    was tuned with for synchronous training. How the windows of gradients
    are kept is `max_step_staleness`: asynchronous windows (1, the default:
    no replica waits for another, and a gradient more than one step stale
    is dropped) or fresh ones (0: every step from gradients of the current
    parameters, replicas in step with each other, and a slow replica never
    waited for past a patience). With `gradients_per_step=1` every shard's
    gradient is a step of its own. A version counter measures how stale
    each gradient was.

    Args:
        devices: replica devices; by default every GPU, else every logical
            CPU device (see `tf_diffmap.split_devices`).
        parameter_device: where the parameter store lives: one device name,
            or several to shard the variables over them. Defaults to the
            host's CPU.
        replicas_per_device: replicas (worker threads) on each device, to keep
            a large device busy while one replica waits for input or the store.
        max_staleness: Stale Synchronous Parallel bound: no replica starts a
            step while more than this many steps ahead of the slowest. `None`
            (default) is fully asynchronous; 0 is lock-step.
        queue_size: shards that may wait for a free replica; defaults to two
            per replica, and is at least one per replica (a step's shards).
        steps_per_loop: K, the most shards a replica applies in one call of
            its loop function before Python sees it again (under
            `max_staleness`, 1). Larger K costs no latency: a loop takes
            shards as they come and returns early only when stopped.
        colocate_cpu_replicas: run the replicas on a task's logical CPU
            devices on its CPU:0 (default). Logical CPU devices share one
            memory and one pool of threads, so this changes no replica's
            work, id or figures, and saves the transfers between devices
            (a large part of what an update costs on a small model). False
            places each replica's ops on its own device, as a GPU replica's
            are, with those transfers.
        worker_timeout: seconds a replica may hold one shard while the
            others wait for it (at the end of an epoch, or held back by
            `max_staleness`) before its worker is treated as hung: lost,
            with a warning that names it, until its call answers, when it
            rejoins. The default, 60 s, is far above one step of any model
            this package trains on one device, so only a worker that is
            paused or wedged (a stopped process, a stuck driver, a network
            partition) reaches it, and it bounds what such a worker costs
            the others: once, not at every epoch. `None` waits for ever.
        ps_timeout: on a cluster, seconds during which no update at all is
            applied while updates wait before the parameter servers are
            probed; one that does not answer (paused, wedged, cut off by a
            network partition) ends `fit` with `tf.errors.UnavailableError`
            naming it and saying what to do, as a lost one does. A slow
            worker does not reach it: the others still apply updates. The
            default, 60 s, is above any one update of a model trained here;
            `None` waits for ever. Ignored on one host.
        variable_partitioner: how many row shards a variable is split into,
            one per parameter device at most, each beside its rows'
            optimizer slots (see `tf_diffmap.store.partitioned`). `"auto"` (the
            default) splits variables of at least 512 KiB in shards of at
            least 256 KiB (`tf_diffmap.RowPartitioner()`) when the
            parameter devices are on several tasks (a cluster with several
            ps tasks), and none on one host. A callable takes a variable's
            shape and dtype and returns its number of shards, as
            `ParameterServerStrategy`'s `variable_partitioner` does
            (`tf.distribute.experimental.partitioners` are accepted); on one
            host, with `parameter_device=[...]` listing several devices, it
            splits a table over those devices. None splits nothing.
        gradients_per_step: K, the shard gradients the store aggregates into
            one step of the optimizer. `"auto"` (the default) is one per
            replica, the shards of one batch: the optimizer takes one step
            per batch on the batch's mean gradient, with the hyperparameters
            it was tuned with for synchronous training, and no replica
            waits for a slow one past the window's patience (the others
            fill its place). 1 applies every shard's gradient as a step of its own,
            the plain asynchronous update that `tf_diffmap.AsyncOptimizer`'s
            per-update rules correct. See `tf_diffmap.updates.aggregation` and the
            documentation's "Staleness-aware updates".
        max_step_staleness: with aggregation, how many optimizer steps
            old a gradient's parameters may be. The default, 0
            (`MAX_STEP_STALENESS`, chosen on the tuning half of the held-out
            grid), makes the windows *fresh*: window v takes only gradients
            whose read saw v optimizer steps applied (a gradient that did
            not is dropped and takes no slot, its examples counted as
            skipped), weighted by their examples, and is full once they make
            a global batch; a replica that pushed into an open window waits
            for it to close before it takes its next shard, so that replicas
            that keep pace stay in step, one shard each per window, as under
            `MirroredStrategy`, and a slow one is not waited for past the
            patience (see `late_window`). A bound b >= 1 makes the windows
            *asynchronous*: K pushes each, whatever they read, no replica
            waiting; a gradient more than b steps old is dropped (it still
            counts in its window, with no weight) and counted in the
            statistics. None accepts every gradient.
        late_window: with fresh windows, what happens to a window still
            open when its patience runs out (the median replica's time from
            a read to its push, times `1 + patience_margin`, after the
            window's first read): `"fill"` (the default, `LATE_WINDOW`)
            lets as many waiting replicas go as the window lacks shards, to
            compute fresh gradients of the same parameters in place of the
            missing ones; `"close"` takes a step on the gradients that came,
            weighted by their examples (backup replicas). Either way a
            straggler's late gradient is dropped and counted.
        patience_margin: with fresh windows, the patience's margin over the
            median replica's read-to-push time, as a fraction of it
            (`tf_diffmap.engine.windows.PATIENCE_MARGIN` by default).
        late_shards: with fresh windows, what becomes of a shard whose
            gradient came after its window was taken: `"skip"` (the
            default, `LATE_SHARDS`) counts its examples as skipped;
            `"requeue"` puts it back on the queue, where another replica
            takes it, so that every example of the epoch is trained on (one
            host only: on a cluster, and for a step with more than one
            optimizer, its examples are skipped). A gradient that a
            staleness rule of `AsyncOptimizer` dropped is not requeued.
        reserved_devices: on a cluster that may grow, the devices of worker
            tasks that are not in it yet (`tf_diffmap.cluster.
            strategy_for_cluster(max_workers=...)` names them). Their
            replicas have their slots from the start, in every per-replica
            count, and are "absent" until their worker joins; a batch is cut
            into one shard per replica slot, present or not, and
            `gradients_per_step="auto"` counts the slots too. Not checked to
            exist.

    Raises:
        ValueError: an unknown or missing device, an empty device list, or an
            out-of-range option; the message names the value received.

    Examples:
        >>> import keras, numpy as np, tf_diffmap
        >>> strategy = tf_diffmap.Strategy()
        >>> with strategy.scope():
        ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        ...     model.compile(optimizer="sgd", loss="mse")
        >>> x, y = np.ones((64, 4), "float32"), np.ones((64, 1), "float32")
        >>> _ = model.fit(x, y, batch_size=16, epochs=1, verbose=0)
        >>> # 4 batches, each split into a shard per replica: an update per shard.
        >>> strategy.version == 4 * len(strategy.replica_devices)
        True
    """

    def __init__(
        self,
        devices: Sequence[str] | None = None,
        parameter_device: str | Sequence[str] | None = None,
        replicas_per_device: int = 1,
        max_staleness: int | None = None,
        queue_size: int | None = None,
        steps_per_loop: int = 32,
        colocate_cpu_replicas: bool = True,
        worker_timeout: float | None = WORKER_TIMEOUT,
        variable_partitioner="auto",
        gradients_per_step: int | str = "auto",
        max_step_staleness: int | None = MAX_STEP_STALENESS,
        ps_timeout: float | None = PS_TIMEOUT,
        reserved_devices: Sequence[str] = (),
        late_window: str = LATE_WINDOW,
        patience_margin: float = PATIENCE_MARGIN,
        late_shards: str = LATE_SHARDS,
    ):
        _tf_internal.check_compatibility()
        _check_int("replicas_per_device", replicas_per_device, 1)
        _check_int(
            "max_staleness", max_staleness, 0, "None (fully asynchronous) or ", " (0 is lock-step)"
        )
        _check_int("steps_per_loop", steps_per_loop, 1)
        _check_int("queue_size", queue_size, 1, "None (two per replica) or ")
        if gradients_per_step != "auto":
            _check_int(
                "gradients_per_step",
                gradients_per_step,
                1,
                note=' or "auto" (one per replica)',
            )
        _check_int(
            "max_step_staleness",
            max_step_staleness,
            0,
            "None (accept every gradient) or ",
            " (0: fresh windows, replicas in step)",
        )
        if late_window not in LATE_WINDOW_POLICIES:
            raise ValueError(
                f"late_window must be one of {', '.join(map(repr, LATE_WINDOW_POLICIES))}, "
                f"received {late_window!r}."
            )
        if late_shards not in LATE_SHARD_POLICIES:
            raise ValueError(
                f"late_shards must be one of {', '.join(map(repr, LATE_SHARD_POLICIES))}, "
                f"received {late_shards!r}."
            )
        if (
            isinstance(patience_margin, bool)
            or not isinstance(patience_margin, (int, float))
            or not patience_margin >= 0
        ):
            raise ValueError(
                "patience_margin must be a number >= 0 (a fraction of the median "
                f"replica's shard time), received {patience_margin!r}."
            )
        if max_step_staleness == 0 and max_staleness is not None:
            raise ValueError(
                f"max_staleness={max_staleness} bounds how far replicas run ahead of "
                "each other, and fresh windows (max_step_staleness=0, the default) "
                "keep them in step already: each waits for the window it pushed "
                "into. To bound the staleness of asynchronous training, pass "
                "max_step_staleness=1 (asynchronous windows) or gradients_per_step=1 "
                "(a step per shard) with it."
            )
        if not isinstance(colocate_cpu_replicas, bool):
            raise ValueError(
                f"colocate_cpu_replicas must be True or False, received {colocate_cpu_replicas!r}."
            )
        for name, value, what in (
            ("worker_timeout", worker_timeout, "a hung worker"),
            ("ps_timeout", ps_timeout, "a hung parameter server"),
        ):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0
            ):
                raise ValueError(
                    f"{name} must be None (wait for {what} for ever) or a "
                    f"number of seconds > 0, received {value!r}."
                )
        if devices is None:
            base = default_replica_devices()
        else:
            base = resolve_devices(devices, "devices", one_name=False)
        if parameter_device is None:
            parameters = resolve_devices(["CPU:0"], "parameter_device")
        else:
            parameters = resolve_devices(parameter_device, "parameter_device")
        partitioner = resolve_partitioner(variable_partitioner, parameters)
        replicas = [d for d in base for _ in range(replicas_per_device)]
        if devices is None:
            warn_if_one_replica(replicas)
        reserved = [canonical_device(d, "reserved_devices") for d in reserved_devices]
        absent = list(range(len(replicas), len(replicas) + len(reserved) * replicas_per_device))
        replicas += [d for d in reserved for _ in range(replicas_per_device)]
        if queue_size is not None and queue_size < len(replicas):
            raise ValueError(
                f"queue_size must hold at least one shard per replica ({len(replicas)}), "
                f"received {queue_size}."
            )
        if gradients_per_step == "auto":
            gradients_per_step = len(replicas)
        super().__init__(
            AsyncExtended(
                self,
                replicas,
                parameters,
                max_staleness,
                queue_size,
                steps_per_loop,
                colocate_cpu_replicas,
                worker_timeout,
                partitioner,
                gradients_per_step,
                max_step_staleness,
                ps_timeout,
                absent,
                late_window,
                float(patience_margin),
                late_shards,
            )
        )
        # A model built outside every scope would train as plain Keras, silently.
        scope_watch.register(self)

    @property
    def _runtime(self) -> Runtime:
        return self.extended.runtime

    @contextlib.contextmanager
    def scope(self):
        """`tf.distribute.Strategy.scope`, with a clear error for a foreign optimizer.

        Build and compile the model, and create its optimizer, inside it: its
        variables go to the parameter store. Keras builds a model's optimizer
        inside this scope when `fit` starts; an optimizer created before the
        scope was entered makes its variables under another strategy there,
        which TensorFlow refuses with an error about mixed strategies.

        Raises:
            ValueError: instead of that error, one that says how to create the
                optimizer.
        """
        with super().scope():
            try:
                yield
            except RuntimeError as error:
                if _tf_internal.is_mixed_strategy_error(error):
                    raise ValueError(optimizer_outside_scope_message()) from error
                raise

    # -- what a user reads ----------------------------------------------------

    @property
    def replica_devices(self) -> tuple[str, ...]:
        """The device of each replica, by replica id."""
        return tuple(self._runtime.replica_devices)

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        """The devices the parameter store is sharded over."""
        return tuple(self._runtime.parameter_devices)

    @property
    def variable_partitioner(self):
        """What splits large variables over the parameter devices, or None."""
        return self._runtime.store.partitioner

    @property
    def max_staleness(self) -> int | None:
        """The Stale Synchronous Parallel bound, or None."""
        return self._runtime.max_staleness

    @property
    def gradients_per_step(self) -> int:
        """K: the shard gradients aggregated into one optimizer step (1: none)."""
        return self._runtime.gradients_per_step

    @property
    def max_step_staleness(self) -> int | None:
        """With aggregation, the most optimizer steps a gradient may be stale."""
        return self._runtime.max_step_staleness

    @property
    def steps_per_loop(self) -> int:
        """K: the most shards one call of a replica's loop applies."""
        return self._runtime.steps_per_loop

    @property
    def version(self) -> int:
        """Updates claimed so far, applied or dropped (a snapshot; does not drain)."""
        return int(self._runtime.store.version.numpy())

    def statistics(self) -> StalenessStats:
        """Per-replica updates, staleness and histogram (a snapshot)."""
        return self._runtime.store.statistics()

    def window_statistics(self) -> WindowStats | None:
        """What the model optimizer's windows did: steps, windows closed short
        or filled, examples per step, and per replica its shard time and
        its waits (a snapshot; None where gradients are not aggregated, or
        before the first training step).

        The figures of every optimizer that aggregates are kept; this is
        the first one's (the model's, as a rule).
        """
        return self._runtime.window_statistics()

    def replica_states(self) -> list[ReplicaReport]:
        """Each replica's state, and when and why it was last lost (a snapshot).

        On a cluster a replica whose worker task is unreachable is "lost"
        until the task serves again; `error` is the runtime's error that
        showed it, `since` the wall-clock time of its last change, `lost`
        how often it was lost.
        """
        return self._runtime.replica_states()

    def reset_statistics(self) -> None:
        """Zeroes the per-replica counters after waiting for updates in flight."""
        self.drain()
        self._runtime.store.reset_statistics()
        for aggregation in self._runtime.aggregations():
            aggregation.gate.reset()

    def reduce(
        self, reduce_op: tf.distribute.ReduceOp | str, value: Any, axis: int | None
    ) -> tf.Tensor:
        """Reduces what `strategy.run` returned over the replicas (and `axis`).

        An asynchronous training step's `strategy.run` returns the outputs of
        one replica step, which stand for each of the N replicas: SUM
        multiplies them by N, MEAN leaves them; with an axis, the reduction
        first runs over that axis of the one step's value. A step that
        applies no update returns one value per replica on one host (its
        batch is split over the replicas), reduced as a synchronous
        strategy's are; a whole batch's outputs (that step on a cluster) are
        left as they are. See `tf_diffmap.engine.outputs` and the
        documentation's "Custom training loops".

        Args:
            reduce_op: `tf.distribute.ReduceOp.SUM` or `MEAN`, or its name.
            value: what `strategy.run` returned, in the same `tf.function`.
            axis: an axis of `value` to reduce as well, or None.

        Returns:
            A tensor.
        """
        if axis is not None:
            # TensorFlow's own reduce over an axis calls `run` again, which
            # here would be a synchronous step that drains the replicas.
            if isinstance(reduce_op, str):
                reduce_op = tf.distribute.ReduceOp(reduce_op.upper())
            value = outputs.reduce_over_axis(reduce_op, value, axis)
        return super().reduce(reduce_op, value, axis=None)

    def drain(self) -> None:
        """Waits until every dispatched shard has been applied.

        The replicas' threads stop; the next training step starts them again.

        Raises:
            Exception: the exception a replica's step raised, if one did.
        """
        self._runtime.drain()

    def shutdown(self) -> None:
        """Drops queued shards and stops the worker threads now.

        Threads also stop by themselves a second after their last shard, and
        start again with the next step.
        """
        self._runtime.shutdown()

    def worker_threads(self) -> list[threading.Thread]:
        """The worker threads alive now (for tests and diagnostics)."""
        return self._runtime.threads()

    def seconds_held_back(self) -> list[float]:
        """Per replica, the time `max_staleness` kept it waiting for others."""
        return self._runtime.seconds_held_back()

    def replica_steps(self) -> list[int]:
        """Steps (shards) each replica has completed since the strategy began."""
        return self._runtime.store.steps_per_replica()

    def __repr__(self) -> str:
        return (
            f"tf_diffmap.Strategy(devices={list(dict.fromkeys(self.replica_devices))}, "
            f"replicas={len(self.replica_devices)}, "
            f"parameter_device={list(self.parameter_devices)}, "
            f"max_staleness={self.max_staleness}, "
            f"gradients_per_step={self.gradients_per_step})"
        )
