"""`tf_diffmap.Strategy`: asynchronous data parallelism for Keras 3.

How a training step flows:

1. Keras traces its train function and calls `strategy.run(train_step, ...)`.
2. The strategy traces `train_step` once more per replica device, in a helper
   thread (a clean context: Keras' trace has lifted scopes that would stop the
   gradient tape), as a concrete *replica step* placed on that device, taking a
   replica id and one shard. Replicas on one device share it; concurrent calls
   are separate executions, so nothing serializes the replicas. Around it, a
   *replica loop* per device (`tf_diffmap.loops`) takes shards from a
   TensorFlow queue and applies them, up to K per call.
3. In Keras' graph the strategy splits the host batch into one shard per
   replica and queues the shards with native ops, returning the outputs
   (metrics) of the most recently completed replica step. The first step
   after a drain has none yet: it applies its first shard right there in
   Keras' graph, starts the replicas' threads, and queues the others. No op
   of Keras' graph ever waits for a replica.
4. A replica step reads the store version, runs forward and backward, claims
   a new version (its staleness is the difference), and applies its own
   gradient to the store with update ops on the store's devices.
5. Before anything reads the model as a whole, the loops are drained.

A step that applies no update (evaluate, predict) runs synchronously, in
Keras' graph, on the first replica device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tf_diffmap import _tf_internal, faults, inputs, outputs, sparse
from tf_diffmap.devices import (
    compute_device,
    default_replica_devices,
    inter_op_threads,
    local_cpu,
    resolve_devices,
    warn_if_one_replica,
)
from tf_diffmap.momentum import MomentumWatch
from tf_diffmap.partitioned import resolve_partitioner
from tf_diffmap.program import Program, batch_size, is_tensor
from tf_diffmap.snapshots import CounterSnapshots
from tf_diffmap.staleness import StalenessStats
from tf_diffmap.step import StepState, as_dependency, current_step, tracing_step
from tf_diffmap.store import (
    ParameterStore,
    optimizer_outside_scope_message,
    outside_scope_message,
)
from tf_diffmap.workers import ReplicaState

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
        steps_per_loop: int,
        colocate_cpu_replicas: bool,
        worker_timeout: float | None = None,
        partitioner=None,
    ):
        super().__init__(container_strategy)
        self.worker_timeout = worker_timeout
        self.replica_devices = replica_devices
        # Where each replica's ops run (`devices.compute_device`): replicas
        # on the logical CPU devices of one task compute on its CPU:0,
        # unless asked to keep to their own devices.
        self.compute_devices = [
            compute_device(d) if colocate_cpu_replicas else d for d in replica_devices
        ]
        self.parameter_devices_list = parameter_devices
        self.max_staleness = max_staleness
        self.queue_size = queue_size or 2 * len(replica_devices)
        self.steps_per_loop = steps_per_loop
        # Where Keras' graph runs (the chief on a cluster): the queue, the
        # outputs, the flags that Keras' graph reads, and the count of
        # completed steps live here.
        self.client_host = local_cpu()
        self._store = ParameterStore(
            parameter_devices,
            len(replica_devices),
            on_host_access=self._on_host_access,
            ledger_device=self.client_host,
            partitioner=partitioner,
        )
        # On a cluster: per replica, the CPU of its worker task, where its
        # input is built (see `tf_diffmap.cluster`).
        self.worker_hosts: list[str] | None = None
        self._worker_input: inputs.WorkerInput | None = None
        # The functions of inputs replaced while a worker was lost, held
        # until no worker is: dropped, each would be removed from every
        # remote task, the lost one included (a "Failed to remove function
        # remotely" error of the runtime).
        self._kept_functions: list = []
        self._made_here: weakref.WeakSet = weakref.WeakSet()
        with tf.init_scope(), tf.device(self.client_host):
            # Set while a replica's error waits to be raised: the loops drop
            # what they take, and the input pipelines end.
            self.failed = tf.Variable(False, trainable=False, name="replica_failed")
        # Counter snapshots that Keras' graph takes while a batch-level
        # `StalenessTensorBoard` asks for them.
        self.snapshots = CounterSnapshots(self._store, self.client_host)
        self._programs: dict[Any, Program] = {}
        self._error: BaseException | None = None
        self._error_lock = threading.Lock()
        # An op that waits for a worker holds one of TensorFlow's inter-op
        # threads while it waits; the workers' steps need another.
        self._graph_may_wait = inter_op_threads() >= 2
        self._store_variable_ids: set[int] = set()
        self._momentum_watch = MomentumWatch(check_every=1)
        # Lost tasks: what a replica's error means, the replicas' record,
        # and the thread that brings a lost worker back.
        self.faults = faults.FaultHandler(replica_devices, on_back=self._rejoin)

    # -- drain and errors ---------------------------------------------------

    def _training_programs(self) -> list[Program]:
        return [p for p in list(self._programs.values()) if p.trains]

    def _on_host_access(self) -> None:
        if any(p.loops.in_worker() for p in self._training_programs()):
            return
        self.drain()

    def drain(self) -> None:
        """Waits for every queued shard, stops the loops, raises an error."""
        drained = False
        for program in self._training_programs():
            if program.loops.running() or program.in_flight():
                program.loops.wait_idle(failed=lambda: self._error is not None)
                program.loops.stop()
                program.mark_drained()
                drained = True
        self.raise_error()
        if drained:
            # Nothing in flight: a claim that never completed was abandoned
            # (its step was interrupted by a lost worker).
            self._store.settle_abandoned()
        if drained:
            # Once per stretch of training: is momentum adding up past 1?
            self._momentum_watch.check(self._store.statistics)

    def raise_error(self) -> None:
        """Raises, once, the first error of a replica (after stopping all loops)."""
        if self._error is None:
            return
        for program in self._training_programs():
            program.loops.stop()  # The failure flag is still set: they drop what is left.
            program.resync()
            program.mark_drained()
        # A failed step may have claimed a version without completing it.
        if self.faults.ps_lost is None:
            self._store.settle_abandoned()
        with self._error_lock:
            error, self._error = self._error, None
        self.failed.assign(False)
        if error is not None:
            self.snapshots.stop()  # the fit fails: its callbacks read no more
            raise error

    def _replica_failed(self, replica_id: int, error: BaseException) -> ReplicaState:
        """A replica's loop raised (called from its thread): its next state.

        A lost worker's replicas are LOST and the others go on; anything
        fatal is kept to be raised, and the failure flag ends the input.
        """
        state, raised = self.faults.verdict(replica_id, error)
        if state != "failed":
            return ReplicaState(state)
        with self._error_lock:
            if self._error is None:
                self._error = raised
        self.failed.assign(True)
        return ReplicaState.FAILED

    def _rejoin(self, task: str, replica_ids: list[int], restarted: bool = True) -> None:
        """A lost worker serves again (called from the rejoiner's thread), or
        a hung one answers (`restarted` False; from its last call's thread)."""
        if self._worker_input is not None and task:
            self._worker_input.rebuild(task, restarted)
        for program in self._training_programs():
            program.loops.rejoin(replica_ids)
        if not self.lost_tasks() - {task}:
            # Every task serves (the rejoined one knows every function).
            self._kept_functions.clear()

    def _new_worker_input(self, **source) -> inputs.WorkerInput:
        """A new input on the workers, which replaces the current one."""
        lost = self.lost_tasks()
        if not lost:
            self._kept_functions.clear()
        elif self._worker_input is not None:
            self._kept_functions.extend(self._worker_input.functions())
        self._worker_input = inputs.WorkerInput(self.worker_hosts, self.failed, lost=lost, **source)
        return self._worker_input

    # -- hung replicas (`workers.HangHandler`) -----------------------------

    def group_of(self, replica_id: int) -> list[int]:
        return self.faults.group_of(replica_id)

    def hung(self, replica_id: int, group, seconds: float) -> None:
        self.faults.hung(replica_id, group, seconds)

    def answered(self, group) -> None:
        self.faults.answered(group)
        task = faults.task_name(self.replica_devices[group[0]]) if self.faults.on_cluster else ""
        self._rejoin(task, list(group), restarted=False)

    def replica_states(self) -> list[faults.ReplicaReport]:
        running = {r: "running" for r in range(len(self.replica_devices))}
        for program in self._training_programs():
            for r, state in enumerate(program.loops.states()):
                if state is not ReplicaState.RUNNING:
                    running[r] = state.value
        reports = self.faults.reports()
        return [
            report if report.state == "lost" else dataclasses.replace(report, state=running[r])
            for r, report in enumerate(reports)
        ]

    def _drain_from_graph(self) -> None:
        """A drain asked for by a step in a graph (evaluate, predict)."""
        in_flight = sum(p.in_flight() for p in self._training_programs())
        if in_flight and not self._graph_may_wait:
            raise RuntimeError(
                f"A step that reads the whole model runs while {in_flight} "
                "replica steps are still queued or running, and TensorFlow has a "
                "single inter-op thread: waiting for them inside this step would "
                "hold the thread they need. Call `strategy.drain()` before this "
                "step, or give TensorFlow two or more inter-op threads "
                "(`tf.config.threading.set_inter_op_parallelism_threads(2)` "
                "before anything runs)."
            )
        self.drain()

    def graph_may_wait(self) -> bool:
        """Whether an op in a graph may wait for the workers."""
        return self._graph_may_wait

    def in_flight(self) -> int:
        """Shards queued or being applied, over every training program."""
        return sum(p.in_flight() for p in self._training_programs())

    def replica_steps(self) -> list[int]:
        return self._store.steps_per_replica()

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
                "tf_diffmap.Strategy hands each step's shards to its replicas "
                "through a tf.queue.FIFOQueue (and starts their loops with a "
                "tf.py_function), which XLA cannot compile, and this step is "
                "being compiled (jit_compile=True). Compile the model with "
                "jit_compile=False."
            )
        program = self._program_for(fn, args, kwargs)
        if program.trains:
            return program.dispatch_in_graph(args, kwargs)
        return program.call_in_graph(args, kwargs)

    def _run_eagerly(self, fn, args, kwargs):
        """`run_eagerly=True` and eager `strategy.run`: one replica, in order."""
        self.drain()
        strategy = self._container_strategy()
        with (
            tf.device(self.compute_devices[0]),
            tf.distribute.ReplicaContext(strategy, replica_id_in_sync_group=0),
        ):
            leaves = [leaf for leaf in tf.nest.flatten((args, kwargs)) if is_tensor(leaf)]
            before = self._store.claims_of(0)
            state = StepState(self._store, tf.constant(0, tf.int32), batch_size(leaves))
            with tracing_step(state):
                outputs = fn(*args, **kwargs)
                outputs = state.finish(outputs)
            if state.claimed:
                self._store.complete(0, self._store.claims_of(0) - before)
        return outputs

    def _check_optimizer(self, target) -> None:
        """Refuses what a Keras model's optimizer does that cannot be async.

        An optimizer created outside the scope would make its variables
        under another strategy. A dynamic loss scale is read once per replica step: the step scales
        its loss with it and must unscale its gradient by the same value,
        though other replicas may halve or double it in between.
        """
        optimizer = getattr(getattr(target, "__self__", None), "optimizer", None)
        while optimizer is not None:
            created_under = _tf_internal.optimizer_strategy(optimizer)
            if created_under is not None and created_under is not self._container_strategy():
                raise ValueError(optimizer_outside_scope_message(optimizer))
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
        self._momentum_watch.watch(getattr(getattr(target, "__self__", None), "optimizer", None))
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
        with tf.control_dependencies([claim.staleness]):
            if (
                state.sparse_updates == "lazy"
                and len(args) == 2
                and not kwargs
                and isinstance(args[0], tf.IndexedSlices)
            ):
                optimizer = _tf_internal.optimizer_of_update(fn)
                if optimizer is not None and sparse.updates_rows(optimizer):
                    return sparse.update_rows(optimizer, var, *args)
            with tf.device(var.device):
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
        # Values are never per-replica here: a value is whole, or stands for
        # one replica step of N (see `tf_diffmap.outputs`).
        return outputs.reduce_replicas(reduce_op, value)

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        return [outputs.reduce_replicas(reduce_op, value) for value, _ in value_destination_pairs]

    def _local_results(self, val):
        return (val,)

    def _broadcast_to(self, tensor, destinations):
        return tensor

    def _gather_to_implementation(self, value, destinations, axis, options):
        return value

    # -- datasets -------------------------------------------------------------

    def _distributed(self, dataset: tf.data.Dataset) -> tf.data.Dataset:
        # Keras distributes what `fit` is given unless it is distributed
        # already; a dataset this strategy made must come back as it is.
        self._made_here.add(dataset)
        return dataset

    def _experimental_distribute_dataset(self, dataset, options):
        if dataset in self._made_here:
            return dataset
        if self.worker_hosts is not None and not inputs.for_keras_inference():
            return self._distributed(self._new_worker_input(dataset=dataset).tokens)
        made = inputs.host_dataset(dataset, self.failed)
        if self.lost_tasks():
            # Its functions are removed from every task once Keras drops it.
            self._kept_functions.extend(_tf_internal.dataset_functions(made))
        return self._distributed(made)

    def _distribute_datasets_from_function(self, dataset_fn, options):
        if self.worker_hosts is not None:
            return self._distributed(self._new_worker_input(dataset_fn=dataset_fn).tokens)
        context = tf.distribute.InputContext(
            num_input_pipelines=1,
            input_pipeline_id=0,
            num_replicas_in_sync=len(self.replica_devices),
        )
        return self._distributed(
            inputs.host_dataset(
                inputs.group_replica_batches(dataset_fn(context), len(self.replica_devices)),
                self.failed,
            )
        )

    def lost_tasks(self) -> set[str]:
        """The worker tasks whose replicas are lost now."""
        return {faults.task_name(self.replica_devices[r]) for r in self.faults.lost()}

    def worker_input_for(self, specs) -> inputs.WorkerInput | None:
        """The input on the workers that a new program reads, if any.

        A program fed tokens of the latest distributed dataset reads its
        shards on the workers; one fed real batches (a custom loop's
        tensors) gets them through the queue.
        """
        source = self._worker_input
        if source is None:
            return None
        flat = tf.nest.flatten(source.element_spec)
        same = len(flat) == len(specs) and all(
            a.dtype == b.dtype and a.shape.rank == b.shape.rank for a, b in zip(flat, specs)
        )
        return source if same else None

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
    def _global_batch_size(self):
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
            per replica, and is at least one per replica (a step's shards).
        steps_per_loop: K, the most shards a replica applies in one call of
            its loop function before Python sees it again (under
            `max_staleness`, 1). Larger K costs no latency: a loop takes
            shards as they come and returns early only when stopped.
        colocate_cpu_replicas: run the replicas on a task's logical CPU
            devices on its CPU:0 (default). Logical CPU devices share one
            memory and one pool of threads, so this changes no replica's
            work, id or figures, and saves the transfers between devices
            (about 40% of the CPU an update costs on a small model). False
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
        variable_partitioner: how many row shards a variable is split into,
            one per parameter device at most, each beside its rows'
            optimizer slots (see `tf_diffmap.partitioned`). `"auto"` (the
            default) splits variables of at least 512 KiB in shards of at
            least 256 KiB (`tf_diffmap.RowPartitioner()`) when the
            parameter devices are on several tasks (a cluster with several
            ps tasks), and none on one host. A callable takes a variable's
            shape and dtype and returns its number of shards, as
            `ParameterServerStrategy`'s `variable_partitioner` does
            (`tf.distribute.experimental.partitioners` are accepted); on one
            host, with `parameter_device=[...]` listing several devices, it
            splits a table over those devices. None splits nothing.

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
        steps_per_loop: int = 32,
        colocate_cpu_replicas: bool = True,
        worker_timeout: float | None = faults.WORKER_TIMEOUT,
        variable_partitioner="auto",
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
        if (
            isinstance(steps_per_loop, bool)
            or not isinstance(steps_per_loop, int)
            or steps_per_loop < 1
        ):
            raise ValueError(f"steps_per_loop must be an int >= 1, received {steps_per_loop!r}.")
        if not isinstance(colocate_cpu_replicas, bool):
            raise ValueError(
                f"colocate_cpu_replicas must be True or False, received {colocate_cpu_replicas!r}."
            )
        if worker_timeout is not None and (
            isinstance(worker_timeout, bool)
            or not isinstance(worker_timeout, (int, float))
            or not worker_timeout > 0
        ):
            raise ValueError(
                "worker_timeout must be None (wait for a hung worker for ever) or a "
                f"number of seconds > 0, received {worker_timeout!r}."
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
        partitioner = resolve_partitioner(variable_partitioner, parameters)
        replicas = [d for d in base for _ in range(replicas_per_device)]
        if devices is None:
            warn_if_one_replica(replicas)
        if queue_size is not None and queue_size < len(replicas):
            raise ValueError(
                f"queue_size must hold at least one shard per replica ({len(replicas)}), "
                f"received {queue_size}."
            )
        super().__init__(
            _AsyncExtended(
                self,
                replicas,
                parameters,
                max_staleness,
                queue_size,
                steps_per_loop,
                colocate_cpu_replicas,
                worker_timeout,
                partitioner,
            )
        )

    @contextlib.contextmanager
    def scope(self):
        """`tf.distribute.Strategy.scope`, with a clear error for a foreign optimizer.

        Keras builds a model's optimizer inside this scope when `fit` starts;
        an optimizer created before the scope was entered makes its variables
        under another strategy there, which TensorFlow refuses with an error
        about mixed strategies.
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
        return tuple(self.extended.replica_devices)

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        """The devices the parameter store is sharded over."""
        return tuple(self.extended.parameter_devices_list)

    @property
    def variable_partitioner(self):
        """What splits large variables over the parameter devices, or None."""
        return self.extended._store.partitioner

    @property
    def max_staleness(self) -> int | None:
        """The Stale Synchronous Parallel bound, or None."""
        return self.extended.max_staleness

    @property
    def steps_per_loop(self) -> int:
        """K: the most shards one call of a replica's loop applies."""
        return self.extended.steps_per_loop

    @property
    def version(self) -> int:
        """Updates claimed so far, applied or dropped (a snapshot; does not drain)."""
        return int(self.extended._store.version.numpy())

    def statistics(self) -> StalenessStats:
        """Per-replica updates, staleness and histogram (a snapshot)."""
        return self.extended._store.statistics()

    def replica_states(self) -> list[faults.ReplicaReport]:
        """Each replica's state, and when and why it was last lost (a snapshot).

        On a cluster a replica whose worker task is unreachable is "lost"
        until the task serves again; `error` is the runtime's error that
        showed it, `since` the wall-clock time of its last change, `lost`
        how often it was lost.
        """
        return self.extended.replica_states()

    def reset_statistics(self) -> None:
        """Zeroes the per-replica counters after waiting for updates in flight."""
        self.drain()
        self.extended._store.reset_statistics()

    def reduce(
        self, reduce_op: tf.distribute.ReduceOp | str, value: Any, axis: int | None
    ) -> tf.Tensor:
        """Reduces what `strategy.run` returned over the replicas (and `axis`).

        An asynchronous training step's `strategy.run` returns the outputs of
        one replica step, which stand for each of the N replicas: SUM
        multiplies them by N, MEAN leaves them; with an axis, the reduction
        first runs over that axis of the one step's value. A whole batch's
        outputs (a step that applies no update) are left as they are. See
        `tf_diffmap.outputs` and the README's "Custom training loops".

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
        self.extended.drain()

    def shutdown(self) -> None:
        """Drops queued shards and stops the worker threads now.

        Threads also stop by themselves a second after their last shard, and
        start again with the next step.
        """
        extended = self.extended
        extended.failed.assign(True)  # The loops drop what is still queued.
        try:
            extended.faults.stop()
            for program in extended._training_programs():
                program.loops.stop()
                program.mark_drained()
        finally:
            if extended._error is None:
                extended.failed.assign(False)

    def worker_threads(self) -> list[threading.Thread]:
        """The worker threads alive now (for tests and diagnostics)."""
        loops = [t for p in self.extended._training_programs() for t in p.loops.threads()]
        return loops + self.extended.faults.rejoiner.threads()

    def seconds_held_back(self) -> list[float]:
        """Per replica, the time `max_staleness` kept it waiting for others."""
        waited = [0.0] * len(self.replica_devices)
        for program in self.extended._training_programs():
            waited = [a + b for a, b in zip(waited, program.loops.seconds_waited())]
        return waited

    def replica_steps(self) -> list[int]:
        """Steps (shards) each replica has completed since the strategy began."""
        return self.extended.replica_steps()

    def __repr__(self) -> str:
        return (
            f"tf_diffmap.Strategy(devices={list(dict.fromkeys(self.replica_devices))}, "
            f"replicas={len(self.replica_devices)}, "
            f"parameter_device={list(self.parameter_devices)}, "
            f"max_staleness={self.max_staleness})"
        )
