"""A traced replica step and how it is fed: dispatch, shards, outputs.

`Program` traces the function Keras hands to `strategy.run` once per replica
device, in a helper thread, and builds what Keras' graph runs: for a training
step a dispatch op that queues one shard per replica and returns recent
outputs; for any other step a synchronous call on the first replica device.
"""

from __future__ import annotations

import functools
import threading
from typing import TYPE_CHECKING, Any

import keras
import numpy as np
import tensorflow as tf

from tf_diffmap import _tf_internal
from tf_diffmap.step import StepState, tracing_step

if TYPE_CHECKING:
    from tf_diffmap.strategy import _AsyncExtended

__all__ = ["Program", "batch_size", "is_empty", "is_tensor", "split_in_graph"]


def batch_size(tensors) -> tf.Tensor | None:
    """Examples in a shard: the leading dimension of its first batched tensor."""
    for tensor in tensors:
        tensor = tf.convert_to_tensor(tensor)
        if tensor.shape.rank:
            return tf.shape(tensor, out_type=tf.int64)[0]
    return None


def split_in_graph(tensors, replicas: int) -> list[list[tf.Tensor]]:
    """Splits a batch into one shard per replica, as ops of the caller's graph.

    Shards differ in size by at most one example; a batch smaller than the
    number of replicas leaves some shards empty. Tensors without a batch
    dimension (scalars) go whole to every shard. Splitting in the graph costs
    one op per tensor, run by TensorFlow's executor rather than by Python.
    """
    batched = [t for t in tensors if t.shape.rank != 0]
    if replicas == 1 or not batched:
        return [list(tensors)]
    examples = tf.shape(batched[0])[0]
    sizes = examples // replicas + tf.cast(tf.range(replicas) < examples % replicas, tf.int32)
    pieces = [
        tf.split(t, sizes, num=replicas) if t.shape.rank != 0 else [t] * replicas for t in tensors
    ]
    return [list(shard) for shard in zip(*pieces)]


def is_empty(shard) -> bool:
    """Whether a shard holds no examples (its first batched tensor is empty)."""
    for tensor in shard:
        if tensor.shape.rank:
            return tensor.shape[0] == 0
    return False


def is_tensor(value) -> bool:
    return isinstance(value, (tf.Tensor, np.ndarray)) or tf.is_tensor(value)


class Program:
    """One traced replica step and how to feed it."""

    def __init__(self, extended: _AsyncExtended, fn, args, kwargs):
        self.extended = extended
        self.structure = (args, kwargs)
        leaves = tf.nest.flatten(self.structure)
        self.tensor_positions = [i for i, leaf in enumerate(leaves) if is_tensor(leaf)]
        self.static_leaves = list(leaves)
        specs = []
        for i in self.tensor_positions:
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
            self.static_leaves[i] = None
        self.specs = specs
        self.trains = False
        # Outputs of the most recently finished step since the last drain,
        # and of any step; whether one has finished since the last drain
        # (a variable: Keras' graph reads it where no op may wait).
        self.latest: list | None = None
        self.last: list | None = None
        self.fresh: tf.Variable | None = None
        self._fresh = False  # what `fresh` holds, so that a drain sets it once
        self._trace(fn)

    def _pack(self, tensors):
        leaves = list(self.static_leaves)
        for i, tensor in zip(self.tensor_positions, tensors):
            leaves[i] = tensor
        return tf.nest.pack_sequence_as(self.structure, leaves)

    def _trace(self, fn) -> None:
        extended = self.extended
        strategy = extended._container_strategy()
        install_summary_state = _tf_internal.capture_summary_state()
        dtype_policy = keras.config.dtype_policy()
        result: dict[str, Any] = {}

        def make_replica_step(device):
            def step_on_device(replica_id, *tensors):
                args, kwargs = self._pack(tensors)
                with (
                    tf.device(device),
                    tf.distribute.ReplicaContext(strategy, replica_id_in_sync_group=replica_id),
                ):
                    state = StepState(extended._store, replica_id, batch_size(tensors))
                    with tracing_step(state):
                        with tf.control_dependencies([state.read_version]):
                            outputs = fn(*args, **kwargs)
                        state.finish(outputs)
                    # Claims this replica has made in all (read after this
                    # step's records): a claim inside a branch may not run.
                    claims = extended._store.claims_of(replica_id)
                result.setdefault("trains", state.claimed)
                return outputs, claims

            return step_on_device

        def trace():
            try:
                if not extended.graph_may_wait():
                    # Made here, outside the strategy's scope: not a store variable.
                    with tf.device("/device:CPU:0"):
                        self.fresh = tf.Variable(False, trainable=False, name="outputs_fresh")
                install_summary_state()
                keras.config.set_dtype_policy(dtype_policy)
                with strategy.scope():
                    for device in dict.fromkeys(extended.replica_devices):
                        function = tf.function(make_replica_step(device), autograph=False)
                        self.concretes[device] = function.get_concrete_function(
                            tf.TensorSpec([], tf.int32), *self.specs
                        )
                        if not result["trains"]:
                            break  # A synchronous step runs on the first device only.
            except BaseException as error:  # noqa: BLE001 - re-raised below
                result["error"] = error

        self.concretes: dict[str, Any] = {}
        thread = threading.Thread(target=trace, name="tf_diffmap-trace")
        thread.start()
        thread.join()
        if "error" in result:
            error = result["error"]
            if isinstance(error, RuntimeError) and "Mixing different tf.distribute" in str(error):
                raise RuntimeError(
                    f"{error} -- an object used in the step (usually the "
                    "optimizer) was created outside `strategy.scope()`. Create "
                    "it inside the scope, for example `with strategy.scope(): "
                    "model.compile(optimizer=keras.optimizers.SGD(...), ...)`."
                ) from error
            raise error
        self.concrete = self.concretes[extended.replica_devices[0]]
        self.trains = result["trains"]
        outputs, _ = self.concrete.structured_outputs
        self.output_structure = outputs
        out_leaves = tf.nest.flatten(outputs)
        self.output_positions = [i for i, o in enumerate(out_leaves) if isinstance(o, tf.Tensor)]
        self.output_specs = [
            tf.TensorSpec(out_leaves[i].shape, out_leaves[i].dtype) for i in self.output_positions
        ]
        self.static_outputs = [None if isinstance(o, tf.Tensor) else o for o in out_leaves]

    def _pack_outputs(self, tensors):
        leaves = list(self.static_outputs)
        for i, tensor in zip(self.output_positions, tensors):
            leaves[i] = tensor
        return tf.nest.pack_sequence_as(self.output_structure, leaves)

    # -- in Keras' graph --------------------------------------------------

    def call_in_graph(self, args, kwargs):
        """A synchronous step: drain, then run on the first replica device."""
        leaves = tf.nest.flatten((args, kwargs))
        tensors = [leaves[i] for i in self.tensor_positions]
        drained = tf.py_function(self._drain, [], tf.bool, name="tf_diffmap_drain")
        with tf.control_dependencies([drained]):
            outputs, _ = self.concrete(tf.constant(0, tf.int32), *tensors)
        return outputs

    def dispatch_in_graph(self, args, kwargs):
        """An asynchronous step: queue the shards, return recent outputs.

        The first step after a drain has no recent outputs to return. The
        dispatch op then waits for the first of its shards to finish, which
        holds one of TensorFlow's inter-op threads while the workers' steps
        run on the others. With a single inter-op thread (as on a one-CPU
        host) that wait would never end, so there no op waits for a worker
        at all: the first step after a drain runs its first shard right here in
        Keras' graph, as replica 0, returns that shard's outputs, and queues
        the other shards once it has finished.
        """
        leaves = tf.nest.flatten((args, kwargs))
        tensors = [tf.convert_to_tensor(leaves[i]) for i in self.tensor_positions]
        shards = split_in_graph(tensors, len(self.extended.replica_devices))
        if self.extended.graph_may_wait():
            flat = self._dispatch_in_graph(shards)
        else:
            flat = tf.cond(
                self.fresh.read_value(),
                lambda: self._dispatch_in_graph(shards),
                lambda: self._first_step_in_graph(shards),
            )
        # Both ways end with the flag of their host-side work, so that a
        # step without tensor outputs still runs it.
        return self._pack_outputs(flat[:-1])

    def _first_step_in_graph(self, shards):
        outputs, claims = self.concrete(tf.constant(0, tf.int32), *shards[0])
        flat = tf.nest.flatten(outputs)
        flat = [flat[i] for i in self.output_positions]
        rest = [t for shard in shards[1:] for t in shard]
        queued = tf.py_function(
            self._finish_first_step, [claims, *flat, *rest], tf.bool, name="tf_diffmap_queue_rest"
        )
        queued.set_shape([])
        return [*flat, queued]

    def _dispatch_in_graph(self, shards):
        flat = tf.py_function(
            self._dispatch,
            [t for shard in shards for t in shard],
            [*(s.dtype for s in self.output_specs), tf.bool],
            name="tf_diffmap_dispatch",
        )
        for tensor, spec in zip(flat, [*self.output_specs, tf.TensorSpec([], tf.bool)]):
            tensor.set_shape(spec.shape)
        return list(flat)

    # -- in the dispatch ops (eager, on a TensorFlow thread; never waiting) --

    def _drain(self):
        extended = self.extended
        pool = extended._pool
        if pool.in_flight and not extended.graph_may_wait():
            raise RuntimeError(
                f"A step that reads the whole model runs while {pool.in_flight} "
                "replica steps are still queued or running, and TensorFlow has a "
                "single inter-op thread: waiting for them inside this step would "
                "hold the thread they need. Call `strategy.drain()` before this "
                "step, or give TensorFlow two or more inter-op threads "
                "(`tf.config.threading.set_inter_op_parallelism_threads(2)` "
                "before anything runs)."
            )
        pool.wait_for(lambda: pool.in_flight == 0)
        return True

    def _finish_first_step(self, claims, *tensors):
        extended = self.extended
        extended._complete_claims(0, int(claims))
        outputs = len(self.output_positions)
        self.latest = self.last = list(tensors[:outputs])
        self.fresh.assign(True)
        self._fresh = True
        extended._first_step_open = False
        self._queue(self._shards(tensors[outputs:]))
        return True

    def _dispatch(self, *tensors):
        pool = self.extended._pool
        queued = self._queue(self._shards(tensors))
        if self.extended.graph_may_wait():
            if queued:
                pool.wait_for(lambda: self.latest is not None)
            outputs = self.latest
        else:
            # A step has finished since the drain (or the workers were just
            # drained from another thread, and `last` is still the latest).
            outputs = self.latest if self.latest is not None else self.last
        if outputs is None:
            # Only after a replica failed before any step finished: the
            # caller's thread raises that error before the next batch.
            outputs = [
                tf.zeros([d if d is not None else 0 for d in s.shape], s.dtype)
                for s in self.output_specs
            ]
        return [*outputs, True]

    def mark_drained(self) -> None:
        """After a drain (caller's thread): the next step reports fresh outputs."""
        self.latest = None
        if self._fresh:
            self._fresh = False
            self.fresh.assign(False)
            self.extended._first_step_open = True

    def _shards(self, tensors):
        per_shard = len(self.tensor_positions)
        shards = [list(tensors[i : i + per_shard]) for i in range(0, len(tensors), per_shard)]
        # A batch smaller than the number of replicas leaves some empty.
        return [shard for shard in shards if not is_empty(shard)]

    def _queue(self, shards) -> bool:
        """Queues shards; False when a worker has failed."""
        if not shards:
            return True
        tasks = [functools.partial(self._run_shard, shard) for shard in shards]
        # The caller's thread waits for room before each batch; here, where
        # waiting could hold the workers' only inter-op thread, only if not.
        return self.extended._pool.submit(tasks, block=self.extended.graph_may_wait())

    # -- in a worker thread ---------------------------------------------------

    def _run_shard(self, shard, replica_id: int) -> None:
        concrete = self.concretes[self.extended.replica_devices[replica_id]]
        try:
            outputs, claims = concrete(tf.constant(replica_id, tf.int32), *shard)
        except BaseException:
            # Whether it claimed a version is unknown: count again once idle.
            self.extended._resync_completed = True
            raise
        # The step has finished writing: later reads see its update (a step
        # whose update was skipped, e.g. for non-finite gradients, claimed none).
        self.extended._complete_claims(replica_id, int(claims))
        flat = tf.nest.flatten(outputs)
        self.latest = self.last = [flat[i] for i in self.output_positions]
