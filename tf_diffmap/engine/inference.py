"""A step that applies no update, split over every replica (evaluate, predict).

Keras' `evaluate`, `predict` and the validation inside `fit` call
`strategy.run` with a step that claims no version (on a cluster:
`tf_diffmap.cluster.inference`). On one host that step
runs as `MirroredStrategy` runs it: after a drain (the step must see a
settled model), the batch is cut into one shard per replica, as a training
batch is (`shards.split_in_graph`), and every replica runs its shard at the
same time, on its own compute device. `strategy.run` returns one value per
replica (`_tf_internal.per_replica`), which Keras reduces as it reduces
`MirroredStrategy`'s: the mean of the test step's results, the
concatenation of the predictions, in input order.

Running together, the replicas' steps share each metric's variables: Keras
writes a metric's state as `v.assign(v + d)`, which a replica step applies
as one atomic `v.assign_add(d)` (`_tf_internal.StoreVariable`), so a
metric's state is the sum of every shard's contribution, as Keras merges
`MirroredStrategy`'s per-replica states. A step that writes a variable any
other way would race with itself; it runs whole on the first replica
device instead, with a warning (`ReplicaStep.plain_writes`).

The shards run as calls of the replica's traced step inside one function
built without automatic control dependencies (`tf.compat.v1.wrap_function`):
in Keras' own `tf.function`, calls that write the same variables would be
ordered one after the other.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import tensorflow as tf

from tf_diffmap import _tf_internal
from tf_diffmap.engine.shards import split_in_graph

if TYPE_CHECKING:
    from tf_diffmap.engine.replica_step import ReplicaStep
    from tf_diffmap.engine.runtime import Runtime

__all__ = ["SplitInference", "splits_over_replicas"]


def splits_over_replicas(step: ReplicaStep, runtime: Runtime) -> bool:
    """Whether a step that applies no update runs split over the replicas.

    It does with more than one replica (on one host, or on a cluster:
    `tf_diffmap.cluster.inference`), unless the step writes a variable other
    than by adding to it: replicas writing it at the same time would race,
    so the step runs whole on one replica, with a warning that names the
    variables.
    """
    if len(runtime.replica_devices) < 2:
        return False
    if step.plain_writes:
        names = ", ".join(sorted(set(step.plain_writes))[:5])
        warnings.warn(
            "tf_diffmap.Strategy runs each inference batch split over its "
            "replicas, whose steps share the model's variables, and this step "
            f"assigns {names} a value that is not an addition to its own "
            "value (Keras metrics write `v.assign(v + d)`, which replicas "
            "apply atomically). Replicas doing so at the same time would race, "
            "so this step runs each batch whole on one replica. "
            "Write the variable as `v.assign_add(d)` to have it split.",
            UserWarning,
            stacklevel=_tf_internal.user_stacklevel(),
        )
        return False
    return True


class SplitInference:
    """A step that applies no update, run on one shard per replica at once.

    Args:
        step: the traced replica step (`ReplicaStep`, which does not train),
            traced for every compute device.
        runtime: the strategy's runtime (devices, drain).

    Attributes:
        replicas: how many shards each batch is cut into.
        function: `(*batch tensors) -> every replica's output tensors`,
            replica after replica, with no order between the replicas' calls.
    """

    def __init__(self, step: ReplicaStep, runtime: Runtime):
        self.step = step
        self.runtime = runtime
        self.replicas = len(runtime.replica_devices)
        self._outputs_per_replica = len(step.output_specs()[2])
        with tf.init_scope():
            self.function = tf.compat.v1.wrap_function(self._run_shards, list(step.specs))
            # Written with every call's claims at each step (see `call_in_graph`).
            with tf.device(runtime.client_host):
                self._ran = _tf_internal.ResourceVariable(
                    tf.constant(0, tf.int64), trainable=False, name="tf_diffmap_inference_ran"
                )

    def _run_shards(self, *tensors):
        """Every replica's step on its shard, as independent calls."""
        with tf.device(self.runtime.client_host):
            shards = split_in_graph(list(tensors), self.replicas)
        flat = []
        for replica, shard in enumerate(shards):
            concrete = self.step.concretes[self.runtime.compute_devices[replica]]
            outputs, claims = concrete(tf.constant(replica, tf.int32), *shard)
            flat.extend([claims, *self.step.flat_outputs(outputs)])
        return flat

    def call_in_graph(self, args, kwargs):
        """Drains, then runs the batch's shards; the outputs are per replica."""
        drained = tf.py_function(self._drain, [], tf.bool, name="tf_diffmap_drain")
        with tf.control_dependencies([drained]):
            flat = self.function(*self.step.tensors_of(args, kwargs))
        if not isinstance(flat, (list, tuple)):
            flat = [flat]
        count = self._outputs_per_replica + 1  # the claims first
        # A wrapped function keeps only what its used outputs need: once
        # inlined in the caller's graph, a replica call whose outputs nobody
        # reads (a step that only updates metrics returns none) would be
        # pruned. A write of every call's claims uses them all.
        self._ran.assign(
            tf.add_n([flat[k * count] for k in range(self.replicas)]), read_value=False
        )
        per_output = [
            _tf_internal.per_replica(flat[k * count + i] for k in range(self.replicas))
            for i in range(1, count)
        ]
        return self.step.pack_outputs(per_output)

    def _drain(self):
        self.runtime.drain_from_graph()
        return True
