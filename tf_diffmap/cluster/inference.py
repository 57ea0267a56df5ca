"""A step that applies no update on a cluster, split over the workers present.

Keras' `evaluate`, `predict` and the validation inside `fit` call
`strategy.run` with a step that claims no version. On a cluster that step
runs as on one host (`tf_diffmap.engine.inference`): after a drain, each
batch is cut into one shard per replica slot (the training's unit,
`shards.split_in_graph`), and the shards run at the same time on the
replicas of every worker present, lost and absent ones left out. Unlike
one host, a replica may be lost mid-batch, so:

- the step is traced with its writes held as outputs
  (`ReplicaStep(defer_writes=True)`): a metric's `v.assign(v + d)` returns
  `d` rather than writing it;
- the shards are handed to the live replicas by a `shard_run.ShardRun`
  from a `tf.py_function` of Keras' graph: a shard whose replica is lost
  or hung runs again on another, and each shard's result is kept once;
- the graph then applies every shard's held writes, summed, once: a
  metric's state is the sum of every shard's contribution, each counted
  once, as Keras merges `MirroredStrategy`'s replicas.

`strategy.run` returns one value per shard (`_tf_internal.per_replica`), in
shard order, which Keras reduces as it reduces `MirroredStrategy`'s: the
mean of the test step's results, the concatenation of the predictions (in
input order). The metrics a step returns are read before its batch's writes
are applied (a read inside the step does not see them); what `evaluate`
returns is read after the last batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import tensorflow as tf

from tf_diffmap import _tf_internal
from tf_diffmap.cluster.shard_run import ShardRun
from tf_diffmap.engine.shards import split_in_graph

if TYPE_CHECKING:
    from tf_diffmap.engine.replica_step import ReplicaStep
    from tf_diffmap.engine.runtime import Runtime

__all__ = ["ClusterInference"]


class ClusterInference:
    """A step that applies no update, its shards run on a cluster's live replicas.

    Args:
        step: the replica step, traced for every compute device with its
            writes held (`ReplicaStep(defer_writes=True)`), which does not
            train.
        runtime: the strategy's runtime (devices, record, drain).
        shards: how many shards each batch is cut into: one per replica
            slot, or 1 for a step that assigns a variable other than by
            adding to it (`inference.splits_over_replicas`).

    Attributes:
        shards_run: per replica, the shards whose result it gave (each
            shard counted once, on the replica whose call was kept).
        shards_run_again: the shards run again on another replica, their
            first replica lost or hung.
    """

    def __init__(self, step: ReplicaStep, runtime: Runtime, shards: int):
        if step.deferred is None:
            raise ValueError("ClusterInference runs a step traced with defer_writes=True.")
        self.step = step
        self.runtime = runtime
        self.shards = shards
        outputs = step.concrete.structured_outputs[0]
        leaves = tf.nest.flatten(outputs)
        self._output_specs = [leaves[i] for i in step.output_specs()[2]]
        self._written = [variable for variable, _ in step.deferred]
        self.shards_run = [0] * len(runtime.replica_devices)
        self.shards_run_again = 0

    def call_in_graph(self, args, kwargs):
        """Runs the batch's shards (after a drain); the outputs are per shard,
        and the shards' held writes are applied once."""
        tensors = self.step.tensors_of(args, kwargs)
        out_types = [spec.dtype for spec in self._output_specs] * self.shards
        out_types += [variable.dtype for variable in self._written]
        # And a flag, so that the call has an output even where the step has
        # none to give.
        with tf.device(self.runtime.client_host):
            flat = tf.py_function(
                self._run, tensors, [*out_types, tf.bool], name="tf_diffmap_inference"
            )[:-1]
        count = len(self._output_specs)
        for k, tensor in enumerate(flat[: count * self.shards]):
            tensor.set_shape(self._output_specs[k % count].shape)
        writes = []
        for (variable, plain), value in zip(self.step.deferred, flat[count * self.shards :]):
            value.set_shape(variable.shape)
            write = variable.assign if plain else variable.assign_add
            writes.append(write(value, read_value=False))
        with tf.control_dependencies(writes):
            per_output = [
                _tf_internal.per_replica(
                    tf.identity(flat[k * count + i]) for k in range(self.shards)
                )
                for i in range(count)
            ]
        return self.step.pack_outputs(per_output)

    def _run(self, *tensors):
        """The batch's shards, run once each; their outputs, then the writes."""
        self.runtime.drain_from_graph()
        with tf.device(self.runtime.client_host):
            shards = split_in_graph(list(tensors), self.shards)
        run = ShardRun(self.runtime, self._call, shards)
        results = run.run()
        for replica in run.holders():
            self.shards_run[replica] += 1
        self.shards_run_again += run.run_again()
        flat = [tensor for outputs, _ in results for tensor in outputs]
        for k, (_, plain) in enumerate(self.step.deferred):
            values = [held[k] for _, held in results]
            # With one shard (an assignment), its value; else the additions.
            flat.append(values[0] if plain else tf.add_n(values))
        return [*flat, True]

    def _call(self, replica_id: int, shard):
        """One replica's step on a shard: its outputs and held writes,
        copied to this host (so that a lost worker fails this call)."""
        concrete = self.step.concretes[self.runtime.compute_devices[replica_id]]
        outputs, _, writes = concrete(tf.constant(replica_id, tf.int32), *shard)
        with tf.device(self.runtime.client_host):
            copied = [tf.identity(t) for t in self.step.flat_outputs(outputs)]
            held = [tf.identity(t) for t in writes]
        return copied, held
