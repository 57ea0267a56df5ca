"""`tf_diffmap.Strategy`: asynchronous data parallelism for Keras 3.

How a training step flows:

1. Keras traces its train function and calls `strategy.run(train_step, ...)`.
2. The strategy traces `train_step` once more per replica device, in a helper
   thread (a clean context: Keras' trace has lifted scopes that would stop the
   gradient tape), as a concrete *replica step* placed on that device, taking a
   replica id and one shard. Replicas on one device share it; concurrent calls
   are separate executions, so nothing serializes the replicas.
3. In Keras' graph the strategy splits the host batch into one shard per
   replica and leaves one dispatch op (`tf.py_function`) that queues the
   shards and returns without waiting for them: it hands back the outputs
   (metrics) of the most recently completed step. The first step after a
   drain has none yet: it runs its first shard in Keras' graph, as replica 0,
   and queues the others once that shard is done. No op of Keras' graph ever
   waits for a worker (it would hold an inter-op thread the workers need).
4. A worker runs the replica step: read the store version, forward and
   backward, claim a new version (its staleness is the difference), apply its
   own gradient to the store with update ops on the store's devices.
5. Before anything reads the model as a whole, the workers are drained.

A step that applies no update (evaluate, predict) runs synchronously, in
Keras' graph, on the first replica device.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tf_diffmap import _tf_internal
from tf_diffmap.devices import (
    default_replica_devices,
    inter_op_threads,
    resolve_devices,
    warn_if_one_replica,
)
from tf_diffmap.inputs import HostDataset
from tf_diffmap.program import Program, batch_size, is_tensor
from tf_diffmap.staleness import StalenessStats
from tf_diffmap.step import StepState, as_dependency, current_step, tracing_step
from tf_diffmap.store import ParameterStore, outside_scope_message
from tf_diffmap.workers import WorkerPool

__all__ = ["Strategy", "current_step"]

_tracing = _tf_internal.replica_tracing()


class _AsyncExtended(_tf_internal.ExtendedBase):
    """The `tf.distribute` hooks of `Strategy` (private TensorFlow API)."""

    def __init__(
        self,
        container_strategy: Strategy,
        replica_devices: list[str],
        parameter_devices: list[str],
        max_staleness: int | None,
        queue_size: int | None,
    ):
        super().__init__(container_strategy)
        self.replica_devices = replica_devices
        self.parameter_devices_list = parameter_devices
        self._store = ParameterStore(
            parameter_devices, len(replica_devices), on_host_access=self._on_host_access
        )
        self._pool = WorkerPool(
            len(replica_devices),
            name="tf_diffmap",
            queue_size=queue_size,
            max_staleness=max_staleness,
        )
        self._programs: dict[Any, Program] = {}
        self._resync_completed = False
        # A first step runs in Keras' graph; if it fails, its claims are
        # counted again before the next batch (see `Program.dispatch_in_graph`).
        self._first_step_open = False
        self._claims_seen = [0] * len(replica_devices)
        self._claims_lock = threading.Lock()
        # An op that waits for a worker holds one of TensorFlow's inter-op
        # threads while it waits; the workers' steps need another.
        self._graph_may_wait = inter_op_threads() >= 2
        self._store_variable_ids: set[int] = set()

    # -- drain --------------------------------------------------------------

    def _on_host_access(self) -> None:
        if self._pool.in_worker():
            return
        self._pool.drain()
        # Whoever reads the model as a whole (an epoch's end, a metrics reset)
        # starts a new stretch: the next step reports fresh outputs.
        for program in self._programs.values():
            program.mark_drained()

    def _complete_claims(self, replica_id: int, claims: int) -> None:
        """Counts a replica's finished claims as completed."""
        with self._claims_lock:
            for _ in range(claims - self._claims_seen[replica_id]):
                self._store.complete()
            self._claims_seen[replica_id] = max(claims, self._claims_seen[replica_id])

    def graph_may_wait(self) -> bool:
        """Whether an op in a graph may wait for the workers."""
        return self._graph_may_wait

    def _before_next_batch(self) -> None:
        # Called in the caller's thread before each batch: a replica's error
        # surfaces here, and the caller waits while the queue cannot take the
        # batch's shards, so that the dispatch op itself never blocks on it.
        self._pool.raise_error()
        if (self._resync_completed or self._first_step_open) and self._pool.in_flight == 0:
            self._store.resync_completed()
            self._claims_seen = self._store.claims_per_replica()
            self._resync_completed = self._first_step_open = False
        room = self._pool.queue_size - len(self.replica_devices)
        self._pool.wait_for(lambda: self._pool.queued <= max(room, 0))
        self._pool.raise_error()

    # -- variables ----------------------------------------------------------

    def _create_variable(self, next_creator, **kwargs):
        variable = self._store.create(next_creator, kwargs)
        self._store_variable_ids.add(id(variable))
        return variable

    def _validate_colocate_with_variable(self, colocate_with_variable):
        del colocate_with_variable  # Any store variable can host its slots.

    def colocate_vars_with(self, colocate_with_variable):
        # Keras' optimizer creates its slots here when it is built, which
        # `fit` does under the model's strategy: if the model was built
        # outside this scope, that is no strategy at all, and TensorFlow's
        # own error says only "Need to be inside strategy.scope()".
        strategy = self._container_strategy()
        if not tf.distribute.has_strategy() or tf.distribute.get_strategy() is not strategy:
            raise ValueError(
                outside_scope_message(
                    colocate_with_variable, self.variable_created_in_scope(colocate_with_variable)
                )
            )
        return super().colocate_vars_with(colocate_with_variable)

    def variable_created_in_scope(self, v):
        return id(v) in self._store_variable_ids

    def _check_store_variable(self, var) -> None:
        if id(var) not in self._store_variable_ids:
            raise ValueError(
                f"Variable {getattr(var, 'name', var)!r} was not created under "
                "this tf_diffmap.Strategy's scope, so it has no place in the "
                "parameter store. Build and compile the model (and create its "
                "optimizer) inside `with strategy.scope():`."
            )

    def read_var(self, v):
        return tf.identity(v)

    def value_container(self, value):
        return value

    # -- replica steps ------------------------------------------------------

    @property
    def _num_replicas_in_sync(self):
        # Inside a replica step each replica applies its own update, as a
        # one-replica step would: Keras must not divide its loss by N there.
        return 1 if _tracing.active else len(self.replica_devices)

    def _use_merge_call(self):
        return False

    def _get_local_replica_id(self, replica_id_in_sync_group):
        return replica_id_in_sync_group

    def _in_multi_worker_mode(self):
        return False

    def _call_for_each_replica(self, fn, args, kwargs):
        kwargs = kwargs or {}
        if tf.executing_eagerly():
            return self._run_eagerly(fn, args, kwargs)
        if _tf_internal.in_xla_context():
            raise ValueError(
                "tf_diffmap.Strategy hands each step to its replicas through "
                "tf.py_function, which XLA cannot compile, and this step is "
                "being compiled (jit_compile=True). Compile the model with "
                "jit_compile=False."
            )
        program = self._program_for(fn, args, kwargs)
        if program.trains:
            return program.dispatch_in_graph(args, kwargs)
        return program.call_in_graph(args, kwargs)

    def _run_eagerly(self, fn, args, kwargs):
        """`run_eagerly=True` and eager `strategy.run`: one replica, in order."""
        self._pool.drain()
        strategy = self._container_strategy()
        with (
            tf.device(self.replica_devices[0]),
            tf.distribute.ReplicaContext(strategy, replica_id_in_sync_group=0),
        ):
            leaves = [leaf for leaf in tf.nest.flatten((args, kwargs)) if is_tensor(leaf)]
            state = StepState(self._store, tf.constant(0, tf.int32), batch_size(leaves))
            with tracing_step(state):
                outputs = fn(*args, **kwargs)
                state.finish(outputs)
            if state.claimed:
                self._complete_claims(0, int(self._store.claims_of(0)))
        return outputs

    @staticmethod
    def _check_optimizer(target) -> None:
        """Refuses what a Keras model's optimizer does that cannot be async.

        A dynamic loss scale is read once per replica step: the step scales
        its loss with it and must unscale its gradient by the same value,
        though other replicas may halve or double it in between.
        """
        optimizer = getattr(getattr(target, "__self__", None), "optimizer", None)
        while optimizer is not None:
            scale = getattr(getattr(optimizer, "dynamic_scale", None), "value", None)
            if isinstance(scale, _tf_internal.StoreVariable):
                scale.snapshot_in_steps()
            if getattr(optimizer, "gradient_accumulation_steps", None):
                raise ValueError(
                    "The model's optimizer accumulates gradients "
                    f"(gradient_accumulation_steps={optimizer.gradient_accumulation_steps}), "
                    "which needs every replica's gradient in one place; "
                    "tf_diffmap.Strategy applies each replica's gradient on "
                    "its own. Use a larger batch size instead."
                )
            optimizer = getattr(optimizer, "inner_optimizer", None)

    def _program_for(self, fn, args, kwargs) -> Program:
        target = inspect.unwrap(fn)
        self._check_optimizer(target)
        leaves = tf.nest.flatten((args, kwargs))
        signature = tuple(
            (
                tuple(tf.TensorShape(leaf.shape)[1:].as_list())
                if getattr(leaf, "shape", None) is not None and tf.TensorShape(leaf.shape).rank
                else None,
                getattr(leaf, "dtype", type(leaf)),
            )
            if is_tensor(leaf)
            else ("static", repr(leaf))
            for leaf in leaves
        )
        key = (target, tf.nest.map_structure(lambda _: 0, (args, kwargs)).__repr__(), signature)
        program = self._programs.get(key)
        if program is None:
            program = Program(self, fn, args, kwargs)
            self._programs[key] = program
            if program.trains and not self._graph_may_wait:
                # Its first step runs in Keras' graph (see `Program.dispatch_in_graph`).
                self._first_step_open = True
        return program

    def _replica_ctx_all_reduce(self, reduce_op, value, options=None):
        # Each replica applies its own gradient: there is nothing to reduce.
        # When Keras aggregates gradients, they are known: claim the version.
        state = current_step()
        if state is not None:
            state.claim(after=value)
        return value

    def _replica_ctx_update(self, var, fn, args=(), kwargs=None, group=True):
        kwargs = kwargs or {}
        self._check_store_variable(var)
        state = current_step()
        if state is None or not var.trainable:
            # Optimizer bookkeeping (accumulators, counters) is not an update
            # of the parameters: it neither claims a version nor waits for one.
            with tf.device(var.device):
                return fn(var, *args, **kwargs)
        claim = state.current_claim()
        if claim is None:
            gradients = [
                a
                for a in tf.nest.flatten((args, kwargs))
                if isinstance(as_dependency(a), tf.Tensor) and a.shape == var.shape
            ]
            if not gradients:
                # No gradient yet (Keras applies weight decay before the
                # gradients): apply it after the step claims its version.
                def deferred():
                    with tf.device(var.device):
                        fn(var, *args, **kwargs)

                state.defer(deferred)
                return None
            claim = state.claim(after=gradients)
        state.flush()
        if claim.lr_scale is not None and len(args) == 2 and not kwargs:
            # Keras' optimizers update with (gradient, learning_rate).
            gradient, learning_rate = args
            learning_rate = tf.convert_to_tensor(learning_rate)
            learning_rate = learning_rate * tf.cast(claim.lr_scale, learning_rate.dtype)
            args = (gradient, learning_rate)
        with tf.control_dependencies([claim.staleness]), tf.device(var.device):
            return fn(var, *args, **kwargs)

    def _update(self, var, fn, args, kwargs, group):
        with tf.device(var.device):
            return fn(var, *args, **kwargs)

    def _update_non_slot(self, colocate_with, fn, args, kwargs, group):
        device = colocate_with[0].device if colocate_with else self._store.host
        with tf.device(device):
            return fn(*args, **kwargs)

    def non_slot_devices(self, var_list):
        return self._store.host

    def _reduce_to(self, reduce_op, value, destinations, options):
        # Values are never per-replica here: every step's result is whole.
        return value

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        return [value for value, _ in value_destination_pairs]

    def _local_results(self, val):
        return (val,)

    def _broadcast_to(self, tensor, destinations):
        return tensor

    def _gather_to_implementation(self, value, destinations, axis, options):
        return value

    # -- datasets -------------------------------------------------------------

    def _experimental_distribute_dataset(self, dataset, options):
        return HostDataset(dataset, self._before_next_batch)

    def _distribute_datasets_from_function(self, dataset_fn, options):
        context = tf.distribute.InputContext(
            num_input_pipelines=1,
            input_pipeline_id=0,
            num_replicas_in_sync=len(self.replica_devices),
        )
        return HostDataset(dataset_fn(context), self._before_next_batch)

    def _experimental_distribute_values_from_function(self, value_fn):
        raise NotImplementedError(
            "tf_diffmap.Strategy feeds whole batches and splits them itself; "
            "distribute_values_from_function is not supported. Pass a "
            "tf.data.Dataset or arrays to model.fit instead."
        )

    # -- facts --------------------------------------------------------------

    @property
    def worker_devices(self):
        return tuple(dict.fromkeys(self.replica_devices))

    @property
    def parameter_devices(self):
        return tuple(self.parameter_devices_list)

    @property
    def experimental_between_graph(self):
        return False

    @property
    def experimental_should_init(self):
        return True

    @property
    def should_checkpoint(self):
        return True

    @property
    def should_save_summary(self):
        return True

    @property
    def _globalbatch_size(self):
        return True


class Strategy(_tf_internal.StrategyBase):
    """Asynchronous data-parallel training for Keras 3 and `tf.distribute`.

    Each replica computes the gradient of its own shard of every batch and
    applies it to the parameter store at once, without waiting for the other
    replicas; a version counter measures how stale each update was.

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
            per replica.

    Raises:
        ValueError: an unknown or missing device, an empty device list, or an
            out-of-range option; the message names the value received.

    Example:
        >>> import keras, numpy as np, tf_diffmap
        >>> strategy = tf_diffmap.Strategy()
        >>> with strategy.scope():
        ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        ...     model.compile(optimizer="sgd", loss="mse")
        >>> x, y = np.ones((64, 4), "float32"), np.ones((64, 1), "float32")
        >>> _ = model.fit(x, y, batch_size=16, epochs=1, verbose=0)
        >>> strategy.version
        4
    """

    def __init__(
        self,
        devices: Sequence[str] | None = None,
        parameter_device: str | Sequence[str] | None = None,
        replicas_per_device: int = 1,
        max_staleness: int | None = None,
        queue_size: int | None = None,
    ):
        _tf_internal.check_compatibility()
        if (
            isinstance(replicas_per_device, bool)
            or not isinstance(replicas_per_device, int)
            or replicas_per_device < 1
        ):
            raise ValueError(
                f"replicas_per_device must be an int >= 1, received {replicas_per_device!r}."
            )
        if max_staleness is not None and (
            isinstance(max_staleness, bool)
            or not isinstance(max_staleness, int)
            or max_staleness < 0
        ):
            raise ValueError(
                "max_staleness must be None (fully asynchronous) or an int >= 0 "
                f"(0 is lock-step), received {max_staleness!r}."
            )
        if queue_size is not None and (not isinstance(queue_size, int) or queue_size < 1):
            raise ValueError(f"queue_size must be an int >= 1, received {queue_size!r}.")
        if devices is None:
            base = default_replica_devices()
        else:
            base = resolve_devices(devices, "devices")
        if parameter_device is None:
            parameters = resolve_devices(["CPU:0"], "parameter_device")
        else:
            parameters = resolve_devices(parameter_device, "parameter_device")
        replicas = [d for d in base for _ in range(replicas_per_device)]
        if devices is None:
            warn_if_one_replica(replicas)
        if queue_size is not None and queue_size < len(replicas):
            raise ValueError(
                f"queue_size must hold at least one shard per replica ({len(replicas)}), "
                f"received {queue_size}."
            )
        super().__init__(_AsyncExtended(self, replicas, parameters, max_staleness, queue_size))

    # -- what a user reads ----------------------------------------------------

    @property
    def replica_devices(self) -> tuple[str, ...]:
        """The device of each replica, by replica id."""
        return tuple(self.extended.replica_devices)

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        """The devices the parameter store is sharded over."""
        return tuple(self.extended.parameter_devices_list)

    @property
    def max_staleness(self) -> int | None:
        """The Stale Synchronous Parallel bound, or None."""
        return self.extended._pool.max_staleness

    @property
    def version(self) -> int:
        """Updates claimed so far, applied or dropped (a snapshot; does not drain)."""
        return int(self.extended._store.version.numpy())

    def statistics(self) -> StalenessStats:
        """Per-replica updates, staleness and histogram (a snapshot)."""
        return self.extended._store.statistics()

    def reset_statistics(self) -> None:
        """Zeroes the per-replica counters after waiting for updates in flight."""
        self.drain()
        self.extended._store.reset_statistics()
        self.extended._claims_seen = [0] * len(self.replica_devices)

    def drain(self) -> None:
        """Waits until every dispatched shard has been applied.

        Raises:
            Exception: the exception a replica's step raised, if one did.
        """
        self.extended._pool.drain()

    def shutdown(self) -> None:
        """Drops queued shards and stops the worker threads now.

        Threads also stop by themselves a second after their last shard, and
        start again with the next step.
        """
        self.extended._pool.shutdown()

    def worker_threads(self) -> list[threading.Thread]:
        """The worker threads alive now (for tests and diagnostics)."""
        return self.extended._pool.threads()

    def seconds_held_back(self) -> list[float]:
        """Per replica, the time `max_staleness` kept it waiting for others."""
        return self.extended._pool.seconds_waited()

    def replica_steps(self) -> list[int]:
        """Steps (shards) each replica has completed since the strategy began."""
        return self.extended._pool.steps()

    def __repr__(self) -> str:
        return (
            f"tf_diffmap.Strategy(devices={list(dict.fromkeys(self.replica_devices))}, "
            f"replicas={len(self.replica_devices)}, "
            f"parameter_device={list(self.parameter_devices)}, "
            f"max_staleness={self.max_staleness})"
        )
