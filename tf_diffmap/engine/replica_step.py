"""The replica step: the function Keras hands to `strategy.run`, traced per device.

`ReplicaStep` traces that function once per device that replicas compute on
(`devices.compute_device`), as a concrete function of a replica id and one
shard: it reads the store version, runs the step under a `StepState` (which
claims a version and applies the replica's own update), and returns its
outputs with the replica's count of claims. Tracing runs in a helper thread
(`in_clean_thread`): Keras' own trace has lifted scopes that would stop the
gradient tape. Whether the step trains (claims a version) decides how it is
run: a training step is fed to the replicas' loops (`feed.StepFeed`); any
other runs synchronously, after a drain: on one host split over every
replica (`inference.SplitInference`), on a cluster split over the replicas
of the workers present, traced again with its writes held as outputs
(`defer_writes`, `tf_diffmap.cluster.inference`).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import TYPE_CHECKING, Any

import keras
import numpy as np
import tensorflow as tf

from tf_diffmap import _tf_internal
from tf_diffmap.engine.threads import in_clean_thread
from tf_diffmap.updates.aggregation import (
    aggregating,
    innermost,
    optimizers_of,
    warn_if_not_aggregated,
)
from tf_diffmap.updates.penalties import (
    models_of,
    regularized_variables,
    split_penalties,
    warn_unsplit,
)
from tf_diffmap.updates.step import StepState, tracing_step

if TYPE_CHECKING:
    from tf_diffmap.engine.runtime import Runtime

__all__ = [
    "ReplicaStep",
    "batch_size",
    "eager_py_functions",
    "is_tensor",
    "run_eagerly",
    "signature_of",
]


def batch_size(tensors) -> tf.Tensor | None:
    """Examples in a shard: the leading dimension of its first batched tensor."""
    for tensor in tensors:
        tensor = tf.convert_to_tensor(tensor)
        if tensor.shape.rank:
            return tf.shape(tensor, out_type=tf.int64)[0]
    return None


def inspect_target(fn):
    """The function a (possibly wrapped) step function runs."""
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def is_tensor(value) -> bool:
    return isinstance(value, (tf.Tensor, np.ndarray)) or tf.is_tensor(value)


def signature_of(args, kwargs) -> tuple:
    """What tells apart two calls of one function that need two traces:
    their structure, each tensor's dtype and shape past the batch
    dimension, and every other leaf's value."""
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
    return repr(tf.nest.map_structure(lambda _: 0, (args, kwargs))), signature


def run_eagerly(runtime: Runtime, strategy, fn, args, kwargs):
    """`run_eagerly=True` and eager `strategy.run`: one replica, in order."""
    runtime.drain()
    with (
        tf.device(runtime.compute_devices[0]),
        tf.distribute.ReplicaContext(strategy, replica_id_in_sync_group=0),
    ):
        leaves = [leaf for leaf in tf.nest.flatten((args, kwargs)) if is_tensor(leaf)]
        before = runtime.store.claims_of(0)
        state = StepState(runtime.store, tf.constant(0, tf.int32), batch_size(leaves))
        with tracing_step(state):
            outputs = fn(*args, **kwargs)
            outputs = state.finish(outputs)
        if state.claimed:
            runtime.store.complete(0, runtime.store.claims_of(0) - before)
    return outputs


def _shard_specs(leaves, positions) -> list[tf.TensorSpec]:
    """One shard's specs: each tensor's, its batch dimension left open."""
    specs = []
    for i in positions:
        leaf = leaves[i]
        if isinstance(leaf, (tf.SparseTensor, tf.RaggedTensor)):
            raise ValueError(
                "tf_diffmap.Strategy splits batches of dense tensors into "
                f"shards, received a {type(leaf).__name__}. Make it dense in the "
                "input pipeline (`tf.sparse.to_dense(t)` for a SparseTensor, "
                "`t.to_tensor()` for a RaggedTensor)."
            )
        leaf = tf.convert_to_tensor(leaf)
        shape = leaf.shape
        if shape.rank:
            shape = tf.TensorShape([None]).concatenate(shape[1:])
        specs.append(tf.TensorSpec(shape, leaf.dtype))
    return specs


class ReplicaStep:
    """`fn` traced as one replica's step, per device replicas compute on.

    Args:
        runtime: the strategy's runtime (store, devices).
        strategy: the strategy whose replica context the step runs in.
        fn, args, kwargs: what `strategy.run` was given.
        defer_writes: trace a step that applies no update with its writes
            to store variables held as outputs rather than applied
            (`_tf_internal.deferring_writes`): its concrete functions then
            return `(outputs, claims, values)`, a value per variable of
            `deferred`.

    Attributes:
        specs: one shard's tensor specs, in the order `fn`'s tensors come.
        trains: whether the step claims a store version (applies an update).
        plain_writes: the store variables the step assigns a value that is
            not an addition to their own (replicas doing so at once race).
        concretes: per compute device, the concrete function
            `(replica_id, *shard) -> (outputs, claims)`.
        deferred: with `defer_writes`, the variables written and, for
            each, whether its write is an assignment (else an addition).
    """

    def __init__(self, runtime: Runtime, strategy, fn, args, kwargs, defer_writes: bool = False):
        self.runtime = runtime
        self.defer_writes = defer_writes
        self.deferred: list[tuple[Any, bool]] | None = None
        self.structure = (args, kwargs)
        leaves = tf.nest.flatten(self.structure)
        self.tensor_positions = [i for i, leaf in enumerate(leaves) if is_tensor(leaf)]
        self.static_leaves = [
            None if i in self.tensor_positions else leaf for i, leaf in enumerate(leaves)
        ]
        self.specs = _shard_specs(leaves, self.tensor_positions)
        self.concretes: dict[str, Any] = {}
        self.trains = False
        self.plain_writes: list[str] = []
        try:
            in_clean_thread(lambda: self._trace(fn, strategy))
        except RuntimeError as error:
            if "Mixing different tf.distribute" in str(error):
                raise RuntimeError(
                    f"{error} -- an object used in the step (usually the "
                    "optimizer) was created outside `strategy.scope()`. Create "
                    "it inside the scope, for example `with strategy.scope(): "
                    "model.compile(optimizer=keras.optimizers.SGD(...), ...)`."
                ) from error
            raise
        self.concrete = self.concretes[runtime.compute_devices[0]]
        if self.trains:
            _warn_of_py_functions(self.concrete)

    # -- tracing -------------------------------------------------------------

    def _trace(self, fn, strategy) -> None:
        runtime = self.runtime
        install_summary_state = _tf_internal.capture_summary_state()
        dtype_policy = keras.config.dtype_policy()
        # Shards that come from the client host (no input on the workers) are
        # counted there, beside the statistics that record their examples,
        # rather than on the replica's device, whence the count would travel
        # back at every step.
        counted_on_host = runtime.worker_hosts is None
        trains, pushed, plain_writes = [], [], []
        # Where the strategy aggregates gradients into steps, the optimizers
        # the step can reach take their steps through their aggregation.
        optimizers = optimizers_of(fn) if runtime.aggregates else []
        # Where windows are fresh, a step reads which windows are applied
        # before it reads the parameters.
        aggregations = {
            id(a): a for a in (runtime.aggregation_for(innermost(o)) for o in optimizers)
        }
        gates = [a.gate for a in aggregations.values() if a.fresh]

        # Where the strategy aggregates, a weight regularizer's gradient is
        # added once per optimizer step on the store, and replicas push
        # their data's gradient only (`tf_diffmap.updates.penalties`).
        regularized = regularized_variables(models_of(fn)) if optimizers else []
        states: list[StepState] = []

        def on_device(device, split):
            def step(replica_id, *tensors):
                args, kwargs = self.pack(tensors)
                with tf.device(runtime.client_host if counted_on_host else device):
                    examples = batch_size(tensors)
                with (
                    tf.device(device),
                    tf.distribute.ReplicaContext(strategy, replica_id_in_sync_group=replica_id),
                ):
                    state = StepState(
                        runtime.store,
                        replica_id,
                        examples,
                        aggregating=runtime.aggregates,
                        gates=gates,
                    )
                    state.splits_penalties = split
                    states.append(state)
                    with tracing_step(state), self._held_writes() as writes:
                        reads = [state.read_version, *state.window_reads.values()]
                        with tf.control_dependencies(reads):
                            outputs = fn(*args, **kwargs)
                        outputs = state.finish(outputs)
                        plain_writes.extend(_tf_internal.replica_tracing().plain_writes)
                    # Claims this replica has made in all (read after this
                    # step's records): a claim inside a branch may not run.
                    claims = runtime.store.claims_of(replica_id)
                    graph = tf.compat.v1.get_default_graph()
                    _tf_internal.place_scalars_beside_reads(graph, device)
                    _tf_internal.pack_crossings(graph)
                trains.append(state.claimed)
                pushed.append(state.pushed)
                if writes is None:
                    return outputs, claims
                return outputs, claims, self._note_deferred(writes)

            return step

        def trace_all(split):
            with split_penalties(regularized if split else []):
                for device in dict.fromkeys(runtime.compute_devices):
                    function = tf.function(on_device(device, split), autograph=False)
                    self.concretes[device] = function.get_concrete_function(
                        tf.TensorSpec([], tf.int32), *self.specs
                    )
                    if not trains[0] and runtime.worker_hosts is not None and not self.defer_writes:
                        # On a cluster a step that applies no update runs
                        # whole on the first device; on one host it is split
                        # over every replica's device.
                        break

        install_summary_state()
        keras.config.set_dtype_policy(dtype_policy)
        step_name = getattr(inspect_target(fn), "__qualname__", repr(fn))
        with strategy.scope():
            with aggregating(optimizers, runtime.aggregation_for):
                trace_all(bool(regularized))
                untaken = {k: v for s in states for k, (v, _) in s.penalized.items()}
                for state in states:
                    for key in state.penalties_taken:
                        untaken.pop(key, None)
                if untaken:
                    # A penalty left to the store that no aggregation takes:
                    # traced again, every replica computing its gradient.
                    warn_unsplit(step_name, [v.path for v in untaken.values()], taken=True)
                    for aggregation in aggregations.values():
                        aggregation.penalties = None
                    self.concretes.clear()
                    del trains[:], pushed[:], plain_writes[:], states[:]
                    trace_all(False)
                elif trains[0] and states and states[0].splits_penalties:
                    _warn_if_penalties_unseen(step_name, regularized, states, aggregations)
            # What applies a window that is not full, at a drain: traced now,
            # while every task serves.
            for optimizer in optimizers:
                aggregation = runtime.aggregation_for(innermost(optimizer))
                aggregation.trace_flush(strategy)
        self.trains = trains[0]
        self.plain_writes = plain_writes
        if self.trains and runtime.aggregates and not pushed[0]:
            warn_if_not_aggregated(step_name)

    @contextlib.contextmanager
    def _held_writes(self):
        """Within: the step's writes are held (`defer_writes`), or applied."""
        if not self.defer_writes:
            yield None
            return
        with _tf_internal.deferring_writes() as writes:
            yield writes

    def _note_deferred(self, writes) -> list[tf.Tensor]:
        """The held writes' values; the same variables on every device."""
        written = list(zip(writes.variables, writes.plain))
        if self.deferred is None:
            self.deferred = written
        elif [(id(v), p) for v, p in written] != [(id(v), p) for v, p in self.deferred]:
            raise RuntimeError(
                "A step that applies no update wrote different variables when "
                "traced for two devices "
                f"({[v.name for v, _ in self.deferred]} and {[v.name for v, _ in written]}); "
                "tf_diffmap.Strategy needs the same writes on every replica."
            )
        return list(writes.values)

    # -- structure -----------------------------------------------------------

    def pack(self, tensors):
        """`(args, kwargs)` of `fn`, with these tensors in its tensors' places."""
        leaves = list(self.static_leaves)
        for i, tensor in zip(self.tensor_positions, tensors):
            leaves[i] = tensor
        return tf.nest.pack_sequence_as(self.structure, leaves)

    def tensors_of(self, args, kwargs) -> list:
        """The tensors of a call's `(args, kwargs)`, in the order of `specs`."""
        leaves = tf.nest.flatten((args, kwargs))
        return [leaves[i] for i in self.tensor_positions]

    def output_specs(self):
        """The outputs' structure, its leaves, and the positions of tensors."""
        outputs = self.concrete.structured_outputs[0]
        leaves = tf.nest.flatten(outputs)
        positions = [i for i, o in enumerate(leaves) if isinstance(o, tf.Tensor)]
        return outputs, leaves, positions

    def flat_outputs(self, outputs) -> list[tf.Tensor]:
        """The tensors of the step's outputs, in order."""
        flat = tf.nest.flatten(outputs)
        return [flat[i] for i in self.output_specs()[2]]

    def pack_outputs(self, tensors):
        """The step's outputs, with these tensors in its tensors' places."""
        structure, leaves, positions = self.output_specs()
        leaves = [None if isinstance(o, tf.Tensor) else o for o in leaves]
        for i, tensor in zip(positions, tensors):
            leaves[i] = tensor
        return tf.nest.pack_sequence_as(structure, leaves)

    # -- a synchronous step, whole ------------------------------------------

    def call_in_graph(self, args, kwargs):
        """A step that applies no update, run whole: drain, then run on the
        first replica device (on a cluster, or where the step cannot be
        split: see `inference.splits_over_replicas`)."""
        drained = tf.py_function(self._drain, [], tf.bool, name="tf_diffmap_drain")
        with tf.control_dependencies([drained]):
            outputs, _ = self.concrete(tf.constant(0, tf.int32), *self.tensors_of(args, kwargs))
        return outputs

    def _drain(self):
        self.runtime.drain_from_graph()
        return True


def _warn_if_penalties_unseen(step_name, regularized, states, aggregations) -> None:
    """Says so where a regularized variable that an aggregation steps had
    no penalty left to the store (the step's loss did not take it from
    `model.losses`): whatever penalty the step adds stays per replica."""
    aggregated = {id(v) for a in aggregations.values() for v in a.variables or ()}
    seen = {key for state in states for key in state.penalized}
    unseen = [v for v in regularized if id(v) in aggregated and id(v) not in seen]
    if unseen:
        warn_unsplit(step_name, [v.path for v in unseen], taken=False)


def eager_py_functions(concrete) -> list[str]:
    """The names of the `tf.py_function` ops (`EagerPyFunc`) in a traced
    function, those of the functions it calls included."""
    graph_def = concrete.graph.as_graph_def()
    nodes = list(graph_def.node)
    for function in graph_def.library.function:
        nodes.extend(function.node_def)
    return sorted(node.name for node in nodes if node.op == "EagerPyFunc")


def _warn_of_py_functions(concrete) -> None:
    """Warns of `tf.py_function` ops in an update step.

    Each call of a `tf.py_function` makes an eager executor for its thread
    and frees it on return, and TensorFlow's `async_wait` (which Keras calls
    at the end of every epoch, while the replicas still run) reads every
    thread's executor without holding a lock: now and then it reads one just
    freed, and the process aborts ("Mutex corrupt"), crashes or hangs.
    `tf.numpy_function` makes no executor.
    """
    names = eager_py_functions(concrete)
    if names:
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        warnings.warn(
            f"The training step runs {len(names)} tf.py_function op(s) ({shown}). "
            "Under tf_diffmap.Strategy the replicas run them while Keras waits "
            "for TensorFlow's executors at the end of each epoch, and a "
            "tf.py_function call at that moment can abort the process "
            '("Mutex corrupt"), crash it or hang it. Use tf.numpy_function, '
            "whose function takes and returns NumPy arrays and has no such hazard.",
            UserWarning,
            stacklevel=_tf_internal.user_stacklevel(),
        )
