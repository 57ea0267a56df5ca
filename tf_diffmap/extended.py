"""The `tf.distribute` hooks of `tf_diffmap.Strategy` (private TensorFlow API).

`AsyncExtended` is the strategy's `extended`: each hook translates
TensorFlow's call into the runtime's terms (`tf_diffmap.engine.runtime`):
the variables go to the parameter store, `strategy.run` to a traced replica
step and its feed, and `update` to the replica's own update of the store.
`tf_diffmap.strategy` holds the public face: the options, their checks and
what a user reads.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import tensorflow as tf

from tf_diffmap import _tf_internal
from tf_diffmap.devices import compute_device
from tf_diffmap.engine import inputs, outputs
from tf_diffmap.engine.feed import StepFeed
from tf_diffmap.engine.inference import SplitInference, splits_over_replicas
from tf_diffmap.engine.replica_step import ReplicaStep, run_eagerly, signature_of
from tf_diffmap.engine.runtime import Runtime
from tf_diffmap.engine.windows import LATE_SHARDS, LATE_WINDOW, PATIENCE_MARGIN
from tf_diffmap.store.parameter_store import optimizer_outside_scope_message, outside_scope_message
from tf_diffmap.updates.optimizer import optimizer_chain
from tf_diffmap.updates.step import current_step

if TYPE_CHECKING:
    from tf_diffmap.cluster.inference import ClusterInference

__all__ = ["AsyncExtended"]

_tracing = _tf_internal.replica_tracing()


class AsyncExtended(_tf_internal.ExtendedBase):
    """The `tf.distribute` hooks of `Strategy` (private TensorFlow API).

    Each hook translates TensorFlow's call into the runtime's terms: the
    variables go to the parameter store, `strategy.run` to a traced replica
    step and its feed, and `update` to the replica's own update of the store.
    What the training shares while it runs is in `self.runtime`.
    """

    def __init__(
        self,
        container_strategy,
        replica_devices: list[str],
        parameter_devices: list[str],
        max_staleness: int | None,
        queue_size: int | None,
        steps_per_loop: int,
        colocate_cpu_replicas: bool,
        worker_timeout: float | None = None,
        partitioner=None,
        gradients_per_step: int = 1,
        max_step_staleness: int | None = None,
        ps_timeout: float | None = None,
        absent_replicas: Sequence[int] = (),
        late_window: str = LATE_WINDOW,
        patience_margin: float = PATIENCE_MARGIN,
        late_shards: str = LATE_SHARDS,
    ):
        super().__init__(container_strategy)
        self.runtime = Runtime(
            replica_devices,
            # Where each replica's ops run (`devices.compute_device`):
            # replicas on the logical CPU devices of one task compute on its
            # CPU:0, unless asked to keep to their own devices.
            [compute_device(d) if colocate_cpu_replicas else d for d in replica_devices],
            parameter_devices,
            max_staleness,
            queue_size,
            steps_per_loop,
            worker_timeout,
            partitioner,
            gradients_per_step,
            max_step_staleness,
            ps_timeout,
            absent_replicas,
            late_window,
            patience_margin,
            late_shards,
        )
        # Per traced function and signature: its replica step, or for a
        # training step the feed that runs it.
        self._steps: dict[Any, ReplicaStep | StepFeed | SplitInference | ClusterInference] = {}
        self._store_variable_ids: set[int] = set()
        self._made_here: weakref.WeakSet = weakref.WeakSet()

    # -- variables ----------------------------------------------------------

    def _create_variable(self, next_creator, **kwargs):
        variable = self.runtime.store.create(next_creator, kwargs)
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
        # Where every shard's gradient is a step of its own, a replica step
        # applies it as a one-replica step would: Keras must not divide its
        # loss by N there. Where gradients are aggregated, a replica's
        # gradient is one of the N a step sums, as in a synchronous step.
        if _tracing.active:
            state = current_step()
            if state is None or not state.aggregating:
                return 1
        return len(self.runtime.replica_devices)

    def _use_merge_call(self):
        return False

    def _get_local_replica_id(self, replica_id_in_sync_group):
        return replica_id_in_sync_group

    def _in_multi_worker_mode(self):
        return False

    def _call_for_each_replica(self, fn, args, kwargs):
        kwargs = kwargs or {}
        if tf.executing_eagerly():
            return run_eagerly(self.runtime, self._container_strategy(), fn, args, kwargs)
        if _tf_internal.in_xla_context():
            raise ValueError(
                "tf_diffmap.Strategy hands each step's shards to its replicas "
                "through a tf.queue.FIFOQueue (and starts their loops with a "
                "tf.py_function), which XLA cannot compile, and this step is "
                "being compiled (jit_compile=True). Compile the model with "
                "jit_compile=False."
            )
        step = self._step_for(fn, args, kwargs)
        if isinstance(step, StepFeed):
            return step.dispatch_in_graph(args, kwargs)
        return step.call_in_graph(args, kwargs)

    def _check_optimizer(self, target) -> None:
        """Refuses what a Keras model's optimizer does that cannot be async.

        An optimizer created outside the scope would make its variables
        under another strategy. A dynamic loss scale is read once per replica step: the step scales
        its loss with it and must unscale its gradient by the same value,
        though other replicas may halve or double it in between.
        """
        model_optimizer = getattr(getattr(target, "__self__", None), "optimizer", None)
        for optimizer in optimizer_chain(model_optimizer):
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

    def _step_for(
        self, fn, args, kwargs
    ) -> ReplicaStep | StepFeed | SplitInference | ClusterInference:
        """The traced replica step for this call (and signature), or what runs
        it: its feed (a training step), or its split over the replicas (on
        one host, or on a cluster's workers present)."""
        target = inspect.unwrap(fn)
        self._check_optimizer(target)
        self.runtime.watch_optimizer(getattr(getattr(target, "__self__", None), "optimizer", None))
        key = (target, *signature_of(args, kwargs))
        step = self._steps.get(key)
        if step is None:
            step = ReplicaStep(self.runtime, self._container_strategy(), fn, args, kwargs)
            if step.trains:
                step = StepFeed(step, self.runtime)
            elif self.runtime.worker_hosts is not None:
                step = self._cluster_inference(step, fn, args, kwargs)
            elif splits_over_replicas(step, self.runtime):
                step = SplitInference(step, self.runtime)
            self._steps[key] = step
        return step

    def _cluster_inference(self, step: ReplicaStep, fn, args, kwargs) -> ClusterInference:
        """A step that applies no update on a cluster: traced again, with its
        writes held, for every compute device, and its shards run on the
        workers present (`tf_diffmap.cluster.inference`)."""
        from tf_diffmap.cluster.inference import ClusterInference

        splits = splits_over_replicas(step, self.runtime)
        held = ReplicaStep(
            self.runtime, self._container_strategy(), fn, args, kwargs, defer_writes=True
        )
        return ClusterInference(held, self.runtime, splits)

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
        return state.update(var, fn, args, kwargs)

    def _update(self, var, fn, args, kwargs, group):
        with tf.device(var.device):
            return fn(var, *args, **kwargs)

    def _update_non_slot(self, colocate_with, fn, args, kwargs, group):
        device = colocate_with[0].device if colocate_with else self.runtime.store.host
        with tf.device(device):
            return fn(*args, **kwargs)

    def non_slot_devices(self, var_list):
        return self.runtime.store.host

    def _reduce_to(self, reduce_op, value, destinations, options):
        # A value is per replica (a step split over the replicas), whole, or
        # stands for one replica step of N (see `tf_diffmap.engine.outputs`).
        return outputs.reduce_replicas(reduce_op, value)

    def _batch_reduce_to(self, reduce_op, value_destination_pairs, options):
        return [outputs.reduce_replicas(reduce_op, value) for value, _ in value_destination_pairs]

    def _local_results(self, val):
        return outputs.local_results(val)

    def _broadcast_to(self, tensor, destinations):
        return tensor

    def _gather_to_implementation(self, value, destinations, axis, options):
        return outputs.gather(value, axis)

    # -- datasets -------------------------------------------------------------

    def _distributed(self, dataset: tf.data.Dataset) -> tf.data.Dataset:
        # Keras distributes what `fit` is given unless it is distributed
        # already; a dataset this strategy made must come back as it is.
        self._made_here.add(dataset)
        return dataset

    def _tokens_for_fit(self, tokens: tf.data.Dataset) -> tf.data.Dataset:
        # The chief iterates a token per shard (no example): Keras' build at
        # the start of `fit` would take one for its first batch, so the model
        # being fitted is built from the batches' structure first.
        model = _tf_internal.fitting_model()
        if model is not None:
            _tf_internal.build_from_spec(model, tokens.element_spec)
        return self._distributed(tokens)

    def _experimental_distribute_dataset(self, dataset, options):
        if dataset in self._made_here:
            return dataset
        runtime = self.runtime
        if runtime.worker_hosts is not None and not inputs.for_keras_inference():
            return self._tokens_for_fit(runtime.new_worker_input(dataset=dataset).tokens)
        made = inputs.host_dataset(dataset, runtime.failed)
        if runtime.lost_tasks():
            # Its functions are removed from every task once Keras drops it.
            runtime.keep_functions(_tf_internal.dataset_functions(made))
        elif runtime.worker_hosts is not None:
            # Held until the next evaluation's: dropped at the end of this
            # one, they would be removed from every task, and a worker hung
            # meanwhile, not yet known to be, would hold the removal (and
            # Python's GIL) for as long as it does not answer.
            runtime.inference_functions = _tf_internal.dataset_functions(made)
        return self._distributed(made)

    def _distribute_datasets_from_function(self, dataset_fn, options):
        runtime = self.runtime
        if runtime.worker_hosts is not None:
            return self._tokens_for_fit(runtime.new_worker_input(dataset_fn=dataset_fn).tokens)
        replicas = len(runtime.replica_devices)
        context = tf.distribute.InputContext(
            num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=replicas
        )
        return self._distributed(
            inputs.host_dataset(
                inputs.group_replica_batches(dataset_fn(context), replicas), runtime.failed
            )
        )

    def _experimental_distribute_values_from_function(self, value_fn):
        raise NotImplementedError(
            "tf_diffmap.Strategy feeds whole batches and splits them itself; "
            "distribute_values_from_function is not supported. Pass a "
            "tf.data.Dataset or arrays to model.fit instead."
        )

    # -- facts --------------------------------------------------------------

    @property
    def worker_devices(self):
        return tuple(dict.fromkeys(self.runtime.replica_devices))

    @property
    def parameter_devices(self):
        return tuple(self.runtime.parameter_devices)

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
        # Keras feeds whole batches of the global batch size.
        return True
